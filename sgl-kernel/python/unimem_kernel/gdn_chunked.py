"""Chunked (WY) gated delta rule for extend (prefill), in place on arena slots, in Triton.

Same contract as the recurrent extend of :mod:`unimem_kernel.gdn_rule`
(``gated_delta_rule_extend_triton`` and the extend branch of ``gdn_forward_triton``): ``q, k
[T, Hk, Dk]`` read per key head (value head ``h`` reads key head ``h // (H // Hk)``, never
expanded), ``v [T, H, Dv]``, ``g, beta [T, H]``, rows ragged by a device ``cu_seqlens [bs+1]``
(``max_seqlen`` is a host bound; nothing is read back from the device); request ``b`` starts
from ``ssm_state[slots[b]]`` (zeros where ``has_initial_state[b]`` is False: the slot is then
not read) and its final state is written back there in place; padded lanes (``slots[b] < 0``)
get zero output rows and their slots are neither read nor written. ``prep=True`` applies the
mixer's prologue inside the kernel (the L2 norm of q and k: SiLU ran in the conv), as the
recurrent kernel's ``PREP`` flag, which ``gdn_forward_triton`` uses (conv first, then the
rule).

The algebra is ``gdn_reference.gated_delta_rule_chunked``'s. Within a chunk of ``C`` tokens
starting from state ``S0``, with ``G`` the cumulative log decay inside the chunk and ``D[t, s]
= exp(G_t - G_s)`` (``s <= t``)::

    A[t, s] = beta_t D[t, s] k_t.k_s  (s < t),       T = (I + A)^-1   (unit lower triangular)
    W  = T (beta exp(G) * K)    [C, Dk]               U0 = T (beta * V)   [C, BV]
    U  = U0 - W S0
    O  = (exp(G) * Q) S0 + (D * Q K^T) U   (s <= t)
    S_C = exp(G_C) S0 + (exp(G_C - G) * K)^T U

Kernel: one program per (request, value head, V block of ``BV``) keeps its ``[Dk, BV]`` state
tile in float32 (float64 for float64 states) across the request's chunks. Per chunk it loads
``K, Q [C, Dk]``, ``V [C, BV]``, ``g``, ``beta``, builds ``G`` and ``A``, inverts ``I + A`` by
forward substitution over the ``C`` rows (``C`` dependent steps on a ``[C, C]`` tile, no
matmul), and the rest is ``tl.dot``. ``A``, ``T`` and ``W`` depend only on k, g and beta: every
V block of a head recomputes them (``Dv / BV`` times).

Rounding differs from the recurrent form (other summation order), so the engine uses this
kernel only when asked (``UNIMEM_GDN_CHUNKED_PREFILL=triton``; the default ``auto`` and ``fla``
take fla's chunked kernel instead, ``unimem.models.gdn_prefill``) and never under batch-invariant
mode, where a token must get bitwise the same state from extend, decode and verify.

``dot_precision``: ``"ieee"`` (default: float32 FMA products, the tight result) or ``"tf32"``
(tensor cores, ~1e-3 relative) for the ``tl.dot`` calls on CUDA; ignored by the interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel import gdn_reference
from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.gdn_common import (
    L2NORM_EPS,
    MAX_GRID_YZ,
    check_shape,
    check_slots,
    cu_seqlens_on_device,
    init_flags,
    tl_acc,
)
from unimem_kernel.gdn_rule import check_rule

DEFAULT_CHUNK = 16
"""Chunk length of the Triton kernel (``tl.dot`` needs >= 16 on the GPU)."""

_DOT_PRECISIONS = ("ieee", "tf32")


@triton.jit(do_not_specialize=["scale", "eps"])
def _chunked_rule_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, H, Dv]
    g_ptr,  # [T, H]
    beta_ptr,  # [T, H]
    o_ptr,  # [T, H, Dv]
    state_ptr,  # [N, H, Dk, Dv] (slot view)
    slots_ptr,  # [bs]
    cu_ptr,  # [bs+1]
    init_ptr,  # [bs] uint8 (HAS_INIT)
    scale,
    eps,
    q_st,
    q_sh,
    q_sd,
    k_st,
    k_sh,
    k_sd,
    v_st,
    v_sh,
    v_sd,
    g_st,
    g_sh,
    b_st,
    b_sh,
    o_st,
    o_sh,
    o_sd,
    s_sn,
    s_sh,
    s_sk,
    s_sv,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    ACC: tl.constexpr,
    HAS_INIT: tl.constexpr,
    PREP: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    start = tl.load(cu_ptr + b).to(tl.int64)
    length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    has = live
    if HAS_INIT:
        has = has & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)

    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_c = tl.arange(0, C)
    kmask = offs_k < DK
    vmask = offs_v < DV
    # scalar predicates as integer bounds (the interpreter mistypes a splatted boolean)
    m_has = (offs_k < tl.where(has, DK, 0))[:, None] & vmask[None, :]
    m_live = (offs_k < tl.where(live, DK, 0))[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * s_sn + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    state = tl.load(s_ptrs, mask=m_has, other=0.0).to(ACC)

    h64 = h.to(tl.int64)
    hk64 = (h // GROUP).to(tl.int64)
    q_base = q_ptr + start * q_st + hk64 * q_sh
    k_base = k_ptr + start * k_st + hk64 * k_sh
    v_base = v_ptr + start * v_st + h64 * v_sh
    g_base = g_ptr + start * g_st + h64 * g_sh
    b_base = beta_ptr + start * b_st + h64 * b_sh
    o_base = o_ptr + start * o_st + h64 * o_sh

    causal = offs_c[:, None] >= offs_c[None, :]  # s <= t
    strict = offs_c[:, None] > offs_c[None, :]  # s < t
    eye = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0).to(ACC)
    live_len = tl.where(live, length, 0)

    for c0 in range(0, length, C):
        rows = c0 + offs_c  # int64 (length is)
        r_out = rows < length  # output rows: padded lanes store zeros
        r_in = rows < live_len  # loaded rows
        m_k = r_in[:, None] & kmask[None, :]
        m_v = r_in[:, None] & vmask[None, :]
        kt = tl.load(k_base + rows[:, None] * k_st + offs_k[None, :] * k_sd, mask=m_k, other=0.0)
        qt = tl.load(q_base + rows[:, None] * q_st + offs_k[None, :] * q_sd, mask=m_k, other=0.0)
        vt = tl.load(v_base + rows[:, None] * v_st + offs_v[None, :] * v_sd, mask=m_v, other=0.0)
        kt = kt.to(ACC)
        qt = qt.to(ACC)
        vt = vt.to(ACC)
        gt = tl.load(g_base + rows * g_st, mask=r_in, other=0.0).to(ACC)
        bt = tl.load(b_base + rows * b_st, mask=r_in, other=0.0).to(ACC)
        if PREP:
            qt = qt / tl.sqrt(tl.sum(qt * qt, axis=1) + eps)[:, None]
            kt = kt / tl.sqrt(tl.sum(kt * kt, axis=1) + eps)[:, None]
        qt = qt * scale

        # cumulative log decay inside the chunk (padding rows add 0)
        gcum = tl.sum(tl.where(causal, gt[None, :], 0.0), axis=1)  # [C]
        diff = gcum[:, None] - gcum[None, :]
        decay = tl.where(causal, tl.exp(tl.where(causal, diff, 0.0)), 0.0)  # D[t, s]
        kk = tl.dot(kt, tl.trans(kt), input_precision=PRECISION)  # [C, C]
        a = tl.where(strict, bt[:, None] * decay * kk, 0.0)

        # T = (I + A)^-1 by forward substitution: T[i] = e_i - sum_{j<i} A[i, j] T[j]
        tinv = eye
        for i in tl.static_range(1, C):
            a_i = tl.sum(tl.where(offs_c[:, None] == i, a, 0.0), axis=0)  # row i of A
            row = tl.sum(a_i[:, None] * tinv, axis=0)
            tinv = tl.where(offs_c[:, None] == i, tinv - row[None, :], tinv)

        eg = tl.exp(gcum)
        w = tl.dot(tinv, (bt * eg)[:, None] * kt, input_precision=PRECISION)  # [C, BK]
        u = tl.dot(tinv, bt[:, None] * vt, input_precision=PRECISION)  # [C, BV]
        u = u - tl.dot(w, state, input_precision=PRECISION)
        qk = tl.dot(qt, tl.trans(kt), input_precision=PRECISION)
        attn = tl.where(causal, decay * qk, 0.0)
        o = tl.dot(eg[:, None] * qt, state, input_precision=PRECISION)
        o = o + tl.dot(attn, u, input_precision=PRECISION)
        tl.store(
            o_base + rows[:, None] * o_st + offs_v[None, :] * o_sd,
            o.to(o_ptr.dtype.element_ty),
            mask=r_out[:, None] & vmask[None, :],
        )

        glast = tl.sum(tl.where(offs_c == C - 1, gcum, 0.0), axis=0)
        kdec = tl.exp(glast - gcum)[:, None] * kt
        state = state * tl.exp(glast) + tl.dot(tl.trans(kdec), u, input_precision=PRECISION)

    tl.debug_barrier()  # every thread's read of the slot before any write
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=m_live)


def _chunked_config(
    dk: int, dv: int, chunk_size: int, block_v: int | None, num_warps: int | None, cuda: bool
) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)``: the whole key dim in one tile, ``BV`` (default 32; at least 16
    on CUDA, as ``tl.dot``) wide V blocks."""
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    bk = max(next_pow2(dk), 16 if cuda else 1)
    bv = min(next_pow2(dv), 32) if block_v is None else block_v
    if bv <= 0 or bv & (bv - 1):
        raise ValueError(f"block_v must be a power of two, got {bv}")
    if cuda and min(chunk_size, bv) < 16:
        raise ValueError(
            f"chunk_size and block_v must be >= 16 on CUDA (tl.dot), got {chunk_size}, {bv}"
        )
    if num_warps is None:
        num_warps = 4
    return bk, bv, num_warps


def gated_delta_rule_extend_chunked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    num_k_heads: int | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    max_seqlen: int | None = None,
    *,
    out: torch.Tensor | None = None,
    prep: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
    dot_precision: str = "ieee",
) -> torch.Tensor:
    """Chunked-form Triton launcher with the contract of ``gated_delta_rule_extend_triton``
    (module docstring): one launch, grid ``(bs, H, cdiv(Dv, BV))``, no host read of a device
    tensor (``max_seqlen`` is accepted for symmetry; the grid does not depend on it).
    ``num_k_heads`` (default ``q.shape[1]``) must match q, k. ``prep``: the L2 norm of q, k
    inside the kernel (the mixer's path, whose conv applied SiLU). Returns ``o [T, H, Dv]`` (``v``'s
    dtype, or ``out``)."""
    del max_seqlen
    if dot_precision not in _DOT_PRECISIONS:
        raise ValueError(f"dot_precision must be one of {_DOT_PRECISIONS}, got {dot_precision!r}")
    check_rule(q, k, v, g, beta, ssm_state, (q.shape[0],))
    _, h, dk, dv = ssm_state.shape
    nk = q.shape[1]
    if num_k_heads is not None and num_k_heads != nk:
        raise ValueError(f"num_k_heads {num_k_heads} != q's {nk} key heads")
    group = gdn_reference.check_heads(h, nk)
    bs = check_slots(slots, ssm_state.device)
    cu, _ = cu_seqlens_on_device(cu_seqlens, bs, ssm_state.device, 0)
    init = init_flags(has_initial_state, bs, ssm_state.device)
    o = torch.empty_like(v) if out is None else out
    check_shape("out", o, v.shape)
    cuda = ssm_state.is_cuda
    bk, bv, warps = _chunked_config(dk, dv, chunk_size, block_v, num_warps, cuda)
    if bs == 0 or h == 0 or dv == 0:
        return o
    if h > MAX_GRID_YZ or triton.cdiv(dv, bv) > MAX_GRID_YZ:
        raise ValueError(f"chunked delta rule grid too large: H={h}, Dv={dv}, block_v={bv}")
    _chunked_rule_kernel[(bs, h, triton.cdiv(dv, bv))](
        q, k, v, g, beta, o, ssm_state, slots, cu,
        slots if init is None else init,
        dk**-0.5 if scale is None else scale,
        L2NORM_EPS,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(),
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        C=chunk_size,
        ACC=tl_acc(ssm_state.dtype),
        HAS_INIT=init is not None,
        PREP=prep,
        GROUP=group,
        PRECISION=dot_precision,
        num_warps=warps,
    )  # fmt: skip
    return o


def gated_delta_rule_extend_chunked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    num_k_heads: int | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    max_seqlen: int | None = None,
    *,
    out: torch.Tensor | None = None,
    prep: bool = False,
) -> torch.Tensor:
    """The chunked-form extend of the gated delta rule (contract: module docstring; the Triton
    side is :func:`gated_delta_rule_extend_chunked_triton`).

    The reference: padded lanes (``slots < 0``) give zero rows and touch no slot; ``prep``
    runs the L2 norm of q, k in the state's dtype first; then
    ``gdn_reference.gated_delta_rule_chunked`` per request (q, k expanded to the value heads
    there). It reads ``cu_seqlens`` on the host."""
    del max_seqlen
    nk = q.shape[1]
    if num_k_heads is not None and num_k_heads != nk:
        raise ValueError(f"num_k_heads {num_k_heads} != q's {nk} key heads")
    sdt = ssm_state.dtype
    if prep:
        q = gdn_reference.l2norm(q.to(sdt))
        k = gdn_reference.l2norm(k.to(sdt))
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    slot_l = slots.tolist()
    init_l = None if has_initial_state is None else has_initial_state.tolist()
    o = torch.zeros(v.shape, dtype=out.dtype if out is not None else v.dtype, device=v.device)
    _, h, dk, dv = ssm_state.shape
    for i, slot in enumerate(slot_l):
        if slot < 0:
            continue
        s, e = bounds[i], bounds[i + 1]
        if init_l is None or init_l[i]:
            s0 = ssm_state[slot].unsqueeze(0).clone()
        else:
            s0 = ssm_state.new_zeros(1, h, dk, dv)
        oi, fi = gdn_reference.gated_delta_rule_chunked(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], s0,
            scale=scale, chunk_size=chunk_size,
        )  # fmt: skip
        o[s:e] = oi[0].to(o.dtype)
        ssm_state[slot] = fi[0]
    if out is None:
        return o
    out.copy_(o)
    return out


gated_delta_rule_extend_chunked = kernel_op(
    "gated_delta_rule_extend_chunked",
    triton=gated_delta_rule_extend_chunked_triton,
    reference=gated_delta_rule_extend_chunked_reference,
    device_of="ssm_state",
)
