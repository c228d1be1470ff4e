"""The gated delta rule of the Gated DeltaNet mixer (recurrent form), on arena slots: its
Triton kernel, launchers and public ops (``gated_delta_rule_extend`` / ``_decode`` /
``_verify``; contract: :mod:`unimem_kernel.gdn`, semantics:
:mod:`unimem_kernel.gdn_reference`).

``_rule_kernel``: grid ``(bs, H, cdiv(Dv, BLOCK_V))`` over value heads (q/k read from key
head ``h // GROUP``, ``GROUP = H // Hk``); the state tile ``[Dk, BLOCK_V]`` stays in
registers (float32, or float64 for float64 states) across a token loop that prefetches the
next token's q/k/v/g/beta. Each program owns its slice of the slot, so the in-place read at
the start and write at the end never race with another program. Its ``flags`` (``RULE_*``)
select ragged rows, initial-state flags, output and final-state stores, the record's gates
(stored by V block 0), the replay (lane ``b``'s tokens ``0 .. accepted[b]``, no output) and
several layers in one launch (``RULE_LAYERS``: a ``ReplayCommitPlan``'s table of per-layer
offsets); constexprs are only the shapes, the tile, the dtype, the per-position state stores
of a verify with scratches (``STORE_STATES``) and the mixer's L2 norm of q and k (``PREP``). The
arguments that vary between step kinds without changing arithmetic (gate, slot, flag and
table pointers; batch strides) are not specialised on, so that one tile is one binary.

:func:`_mixer_rule` is the one call site of the mixer's rule (extend, decode, verify and the
replay commit), so that they pass the kernel the same kinds of arguments.
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
    as_int32,
    check_device,
    check_shape,
    check_slots,
    cu_seqlens_on_device,
    init_flags,
    into,
    layer_row,
    strides_or_zeros,
    table_offset,
    tl_acc,
)


@triton.jit
def _load_token(
    q_row,
    k_row,
    v_row,
    g_row,
    b_row,
    offs_k,
    offs_v,
    q_sd,
    k_sd,
    v_sd,
    ok,
    DK: tl.constexpr,
    DV: tl.constexpr,
    ACC: tl.constexpr,
):
    """q, k, v, g, beta of one token (zeros where ``ok`` is False), in ``ACC``."""
    kmask = offs_k < tl.where(ok, DK, 0)
    vmask = offs_v < tl.where(ok, DV, 0)
    k = tl.load(k_row + offs_k * k_sd, mask=kmask, other=0.0).to(ACC)
    q = tl.load(q_row + offs_k * q_sd, mask=kmask, other=0.0).to(ACC)
    v = tl.load(v_row + offs_v * v_sd, mask=vmask, other=0.0).to(ACC)
    g = tl.load(g_row, mask=ok, other=0.0).to(ACC)
    beta = tl.load(b_row, mask=ok, other=0.0).to(ACC)
    return q, k, v, g, beta


@triton.jit
def _delta_step(state, k, v, g, beta):
    """One token of the gated delta rule on a ``[BK, BV]`` state tile (``k [BK]``, ``v [BV]``,
    scalars ``g``, ``beta``): decay, prediction, rank-1 update."""
    state = state * tl.exp(g)
    pred = tl.sum(state * k[:, None], axis=0)
    u = beta * (v - pred)
    return state + k[:, None] * u[None, :]


# Runtime step flags of ``_rule_kernel`` (bits of ``flags``). They are runtime values, not
# constexprs, so that extend, decode, verify and the replay commit of one tile configuration
# run one compiled kernel: a token's state is then bitwise the same whichever step computes
# it (the compiler cannot contract or reorder one step kind differently from another).
RULE_VARLEN = 1  # rows ragged by cu_seqlens (else seq_len rows per lane, request-major)
RULE_HAS_INIT = 2  # has_initial_state per lane (else every live lane reads its slot)
RULE_STORE_OUT = 4  # store o
RULE_WRITE_FINAL = 8  # write the final state back to the slot
RULE_REPLAY = 16  # tokens 0 .. accepted[b] of each lane (the replay commit)
RULE_SAVE_GATES = 32  # store g and beta of every token into the record (verify)
RULE_LAYERS = 64  # several layers in one launch (a ReplayCommitPlan's table, see below)
# the same bits as the kernel sees them (a jitted function reads globals only as constexprs)
_K_VARLEN = tl.constexpr(RULE_VARLEN)
_K_HAS_INIT = tl.constexpr(RULE_HAS_INIT)
_K_STORE_OUT = tl.constexpr(RULE_STORE_OUT)
_K_WRITE_FINAL = tl.constexpr(RULE_WRITE_FINAL)
_K_REPLAY = tl.constexpr(RULE_REPLAY)
_K_SAVE_GATES = tl.constexpr(RULE_SAVE_GATES)
_K_LAYERS = tl.constexpr(RULE_LAYERS)


@triton.jit(
    do_not_specialize=[
        "g_ptr", "beta_ptr", "slots_ptr", "cu_ptr", "init_ptr", "scratch_ptr", "acc_ptr",
        "rg_ptr", "rb_ptr", "layers_ptr", "flags", "seq_len", "q_sb", "k_sb", "v_sb", "g_sb",
        "g_st", "g_sh", "b_sb", "b_st", "b_sh", "o_sb", "r_sb", "r_st",
    ]
)  # fmt: skip
def _rule_kernel(
    q_ptr,  # [.., Hk, Dk]: token (b, t) at b * q_sb + (start_b + t) * q_st (+ hk * q_sh)
    k_ptr,  # [.., Hk, Dk]
    v_ptr,  # [.., H, Dv]
    g_ptr,  # [.., H]
    beta_ptr,  # [.., H]
    o_ptr,  # [.., H, Dv]
    state_ptr,  # [N, H, Dk, Dv] SSM state (slot view)
    slots_ptr,  # [bs]
    cu_ptr,  # [bs+1] (RULE_VARLEN)
    init_ptr,  # [bs] uint8 (RULE_HAS_INIT)
    scratch_ptr,  # [bs, T, H, Dk, Dv] (STORE_STATES)
    acc_ptr,  # [bs] accepted index per lane (RULE_REPLAY)
    rg_ptr,  # [bs, T, H] record gates g (RULE_SAVE_GATES)
    rb_ptr,  # [bs, T, H] record gates beta (RULE_SAVE_GATES)
    layers_ptr,  # int32 layer table of a ReplayCommitPlan (RULE_LAYERS)
    flags,
    seq_len,
    scale,
    eps,
    q_sb,
    q_st,
    q_sh,
    q_sd,
    k_sb,
    k_st,
    k_sh,
    k_sd,
    v_sb,
    v_st,
    v_sh,
    v_sd,
    g_sb,
    g_st,
    g_sh,
    b_sb,
    b_st,
    b_sh,
    o_sb,
    o_st,
    o_sh,
    o_sd,
    s_sn,
    s_sh,
    s_sk,
    s_sv,
    c_sb,
    c_st,
    c_sh,
    c_sk,
    c_sv,
    r_sb,
    r_st,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    ACC: tl.constexpr,
    STORE_STATES: tl.constexpr,
    PREP: tl.constexpr,  # L2 norm of q, k (the mixer's prologue; SiLU ran in the conv)
    GROUP: tl.constexpr,  # H // Hk: value head h reads q, k of key head h // GROUP
):
    b = tl.program_id(0)
    h = tl.program_id(1)  # value head
    if (flags & _K_LAYERS) != 0:
        # program (b * n_layers + layer): the layer's q/k/v, g, beta and state tensors are
        # layer 0's moved by the table's element offsets
        n_layers = tl.load(layers_ptr)
        layer = b % n_layers
        b = b // n_layers
        row = layer_row(layers_ptr, layer)
        off_y = table_offset(row, 0, q_ptr)
        q_ptr += off_y
        k_ptr += off_y
        v_ptr += off_y
        g_ptr += table_offset(row, 1, g_ptr)
        beta_ptr += table_offset(row, 2, beta_ptr)
        state_ptr += table_offset(row, 3, state_ptr)
    varlen = (flags & _K_VARLEN) != 0
    store_out = (flags & _K_STORE_OUT) != 0
    write_final = (flags & _K_WRITE_FINAL) != 0
    replay = (flags & _K_REPLAY) != 0
    save_gates = (flags & _K_SAVE_GATES) != 0
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    if varlen:
        start = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
        b_off = b.to(tl.int64) * 0
    else:
        start = b.to(tl.int64) * 0
        length = seq_len.to(tl.int64)
        b_off = b.to(tl.int64)
    if replay:
        # the lane keeps the state after token ``accepted`` (skipped outside [0, T))
        accepted = tl.load(acc_ptr + b).to(tl.int64)
        live = live & (accepted >= 0) & (accepted < length)
        length = tl.where(live, accepted + 1, 0)
    has = live
    if (flags & _K_HAS_INIT) != 0:
        has = has & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)

    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = offs_v < DV
    # scalar predicates as integer bounds (see _conv_kernel)
    m_has = (offs_k < tl.where(has, DK, 0))[:, None] & vmask[None, :]
    m_live = (offs_k < tl.where(live, DK, 0))[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * s_sn + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    state = tl.load(s_ptrs, mask=m_has, other=0.0).to(ACC)

    h64 = h.to(tl.int64)
    hk64 = (h // GROUP).to(tl.int64)  # its key head
    q_row = q_ptr + b_off * q_sb + start * q_st + hk64 * q_sh
    k_row = k_ptr + b_off * k_sb + start * k_st + hk64 * k_sh
    v_row = v_ptr + b_off * v_sb + start * v_st + h64 * v_sh
    g_row = g_ptr + b_off * g_sb + start * g_st + h64 * g_sh
    b_row = beta_ptr + b_off * b_sb + start * b_st + h64 * b_sh
    o_row = o_ptr + b_off * o_sb + start * o_st + h64 * o_sh
    c_base = scratch_ptr + b.to(tl.int64) * c_sb + h64 * c_sh
    c_offs = offs_k[:, None] * c_sk + offs_v[None, :] * c_sv
    # the record's gates (RULE_SAVE_GATES): by the first V block of each head
    r_off = b.to(tl.int64) * r_sb + h64
    r_ok = live & save_gates & (tl.program_id(2) == 0)

    # software prefetch: token t + 1 is loaded while token t is computed
    nq, nk, nv, ng, nb = _load_token(
        q_row, k_row, v_row, g_row, b_row, offs_k, offs_v, q_sd, k_sd, v_sd,
        live & (length > 0), DK, DV, ACC,
    )  # fmt: skip
    for t in range(0, length):
        q, k, v, g, beta = nq, nk, nv, ng, nb
        nxt = t + 1
        nq, nk, nv, ng, nb = _load_token(
            q_row + nxt * q_st, k_row + nxt * k_st, v_row + nxt * v_st, g_row + nxt * g_st,
            b_row + nxt * b_st, offs_k, offs_v, q_sd, k_sd, v_sd,
            live & (nxt < length), DK, DV, ACC,
        )  # fmt: skip
        if PREP:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        tl.store(rg_ptr + r_off + t * r_st, g.to(rg_ptr.dtype.element_ty), mask=r_ok)
        tl.store(rb_ptr + r_off + t * r_st, beta.to(rb_ptr.dtype.element_ty), mask=r_ok)
        state = _delta_step(state, k, v, g, beta)
        if store_out:
            o = tl.sum(state * (q * scale)[:, None], axis=0)
            tl.store(o_row + t * o_st + offs_v * o_sd, o.to(o_ptr.dtype.element_ty), mask=vmask)
        if STORE_STATES:
            tl.store(
                c_base + t * c_st + c_offs,
                state.to(scratch_ptr.dtype.element_ty),
                mask=m_live,
            )
    if write_final:
        tl.debug_barrier()  # every thread's read of the slot before any write
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=m_live)


_STEP_TILE = (32, 1)  # (BV, warps) of decode, verify and the replay commit
_EXTEND_BV = 8
_BATCH_INVARIANT_TILE = (64, 4)


def _rule_config(
    h: int, dk: int, dv: int, block_v: int | None, num_warps: int | None, kind: str
) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)``: the whole key dim in one tile. ``kind``: ``"step"`` (decode,
    verify and the replay commit: one tile, hence one compiled kernel, so that a token's
    state is bitwise the same whichever of them computes it — the acceptance control and a
    greedy speculative run equal to the plain one depend on it), ``"extend"`` or
    ``"batch_invariant"``. The defaults were chosen by measurement (docs/decisions.md, the
    GDN rule tiles):

    - step: ``BV = 32`` in one warp (every reduction over ``Dk`` within a warp);
    - extend (long sequences, few requests: bound by the token loop's latency): small V
      blocks in one warp, ``BV = 8`` (as in fla's recurrent kernel), which keeps more
      programs in flight;
    - batch-invariant: ``BV = 64`` in 4 warps for every kind, extend included, so that a
      prefill's state equals a decode's bitwise (``test_gdn_batch_invariant.py``): one
      compiled kernel for every step kind.
    """
    if kind not in ("step", "extend", "batch_invariant"):
        raise ValueError(f"kind must be step, extend or batch_invariant, got {kind!r}")
    bk = next_pow2(dk)
    default_bv, default_warps = {
        "step": _STEP_TILE,
        "extend": (_EXTEND_BV, None),
        "batch_invariant": _BATCH_INVARIANT_TILE,
    }[kind]
    bv = min(next_pow2(dv), default_bv) if block_v is None else block_v
    if bv <= 0 or bv & (bv - 1):
        raise ValueError(f"block_v must be a power of two, got {bv}")
    if num_warps is None:
        if default_warps is not None and block_v is None:
            num_warps = default_warps
        elif kind == "extend":
            num_warps = max(1, min(8, bk * bv // 1024))
        else:
            num_warps = max(1, min(4, bk * bv // 2048))
    if h > MAX_GRID_YZ or triton.cdiv(dv, bv) > MAX_GRID_YZ:
        raise ValueError(f"delta rule grid too large: H={h}, Dv={dv}, block_v={bv}")
    return bk, bv, num_warps


def _launch_rule(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qkv_strides: tuple[tuple[int, ...], ...],  # per tensor (batch, token, head, dim)
    gb: tuple[torch.Tensor, torch.Tensor],
    gb_strides: tuple[tuple[int, ...], ...],  # per tensor (batch, token, head)
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    *,
    seq_len: int,
    cu: torch.Tensor | None,
    init: torch.Tensor | None,
    scratch: torch.Tensor | None,
    write_final: bool,
    prep: bool,
    scale: float | None,
    block_v: int | None,
    num_warps: int | None,
    record_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    accepted: torch.Tensor | None = None,
    kind: str | None = None,
    layers: tuple[torch.Tensor, int] | None = None,
) -> None:
    """One ``_rule_kernel`` launch. ``layers`` (``(table, n_layers)`` of a
    :class:`ReplayCommitPlan`): ``n_layers`` layers' lanes in one launch, the tensors passed
    being layer 0's. ``record_gates`` (``g, beta [bs, T, H]``, a verify with a
    record): every token's gates are stored there. ``accepted [bs]`` (the replay commit):
    each lane runs tokens ``0 .. accepted`` without storing outputs and writes its final
    state (``write_final``). ``kind``: the tile configuration's step kind (default: from the
    call: extend with ``cu``, else step)."""
    bs = slots.shape[0]
    _, h, dk, dv = ssm_state.shape
    if bs == 0 or h == 0 or dv == 0:
        return
    if kind is None:
        kind = "extend" if cu is not None else "step"
    bk, bv, warps = _rule_config(h, dk, dv, block_v, num_warps, kind)
    q, k, v = qkv
    g, beta = gb
    group = gdn_reference.check_heads(h, k.shape[-2])
    flags = (
        (RULE_VARLEN if cu is not None else 0)
        | (RULE_HAS_INIT if init is not None else 0)
        | (RULE_WRITE_FINAL if write_final else 0)
        | (RULE_REPLAY if accepted is not None else RULE_STORE_OUT)
        | (RULE_SAVE_GATES if record_gates is not None else 0)
        | (RULE_LAYERS if layers is not None else 0)
    )
    table, n_layers = (slots.view(torch.int32), 1) if layers is None else layers
    rg, rb = (g, beta) if record_gates is None else record_gates
    r_strides = (0, 0) if record_gates is None else tuple(rg.stride()[:2])
    # index pointers in one dtype whatever the step kind (placeholders are reinterpreting
    # views, never read), so that the kinds share one signature, hence one binary
    cu32 = as_int32(cu) if cu is not None else slots.view(torch.int32)
    init8 = init if init is not None else slots.view(torch.uint8)
    acc32 = as_int32(accepted) if accepted is not None else slots.view(torch.int32)
    _rule_kernel[(bs * n_layers, h, triton.cdiv(dv, bv))](
        q, k, v, g, beta, out, ssm_state, slots, cu32, init8,
        ssm_state if scratch is None else scratch,
        acc32, rg, rb, table, flags, seq_len,
        dk**-0.5 if scale is None else scale,
        L2NORM_EPS,
        *qkv_strides[0], *qkv_strides[1], *qkv_strides[2], *gb_strides[0], *gb_strides[1],
        *out_strides, *ssm_state.stride(), *strides_or_zeros(scratch, 5), *r_strides,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        ACC=tl_acc(ssm_state.dtype),
        STORE_STATES=scratch is not None,
        PREP=prep,
        GROUP=group,
        num_warps=warps,
    )  # fmt: skip


def check_rule(q, k, v, g, beta, ssm_state: torch.Tensor, lead: tuple[int, ...]) -> None:
    """``q, k [*lead, Hk, Dk]`` (``Hk`` dividing ``H``), ``v [*lead, H, Dv]``,
    ``g, beta [*lead, H]``."""
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be [N, H, Dk, Dv], got {tuple(ssm_state.shape)}")
    _, h, dk, dv = ssm_state.shape
    hk = q.shape[-2] if q.dim() == len(lead) + 2 else h
    gdn_reference.check_heads(h, hk)
    for name, t, shape in (
        ("q", q, (*lead, hk, dk)),
        ("k", k, (*lead, hk, dk)),
        ("v", v, (*lead, h, dv)),
        ("g", g, (*lead, h)),
        ("beta", beta, (*lead, h)),
    ):
        check_shape(name, t, shape)
        check_device(ssm_state.device, **{name: t})


def _bthd(t: torch.Tensor, fixed: bool) -> tuple[int, ...]:
    """(batch, token, head[, dim]) strides of a ``[bs, T, H(, D)]`` (fixed) or ``[T, H(, D)]``
    (ragged) or ``[bs, H(, D)]`` (decode: pass as fixed with a unit token dim) tensor."""
    s = tuple(t.stride())
    return s if fixed else (0, *s)


def gated_delta_rule_extend_triton(
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
    *,
    out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``gated_delta_rule_extend`` (recurrent form, one launch): ``q, k [T,
    Hk, Dk]``, ``v [T, H, Dv]``, ``g, beta [T, H]`` ragged by ``cu_seqlens``; initial state read
    from and final state written to each request's slot, in place. Returns ``o [T, H, Dv]``
    (``v``'s dtype). ``max_seqlen`` is accepted for symmetry with the conv (the rule's grid does
    not depend on it)."""
    del max_seqlen
    check_rule(q, k, v, g, beta, ssm_state, (q.shape[0],))
    bs = check_slots(slots, ssm_state.device)
    cu, _ = cu_seqlens_on_device(cu_seqlens, bs, ssm_state.device, 0)
    init = init_flags(has_initial_state, bs, ssm_state.device)
    o = torch.empty_like(v) if out is None else out
    check_shape("out", o, v.shape)
    _launch_rule(
        (q, k, v), tuple(_bthd(t, False) for t in (q, k, v)), (g, beta),
        tuple(_bthd(t, False) for t in (g, beta)), o, _bthd(o, False), ssm_state, slots,
        seq_len=0, cu=cu, init=init, scratch=None, write_final=True, prep=False, scale=scale,
        block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def _decode_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``[bs, H(, D)]`` as ``[bs, 1, H(, D)]``."""
    return (t.stride(0), 0, *t.stride()[1:])


def gated_delta_rule_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``gated_delta_rule_decode``: one token per lane (``q, k [bs, Hk,
    Dk]``, ``v [bs, H, Dv]``, ``g, beta [bs, H]``); slot states updated in place. Returns ``o
    [bs, H, Dv]``. With ``out`` given: no allocation, no host read."""
    bs = check_slots(slots, ssm_state.device)
    check_rule(q, k, v, g, beta, ssm_state, (bs,))
    o = torch.empty_like(v) if out is None else out
    check_shape("out", o, v.shape)
    _launch_rule(
        (q, k, v), tuple(_decode_strides(t) for t in (q, k, v)), (g, beta),
        tuple(_decode_strides(t) for t in (g, beta)), o, _decode_strides(o), ssm_state, slots,
        seq_len=1, cu=None, init=None, scratch=None, write_final=True, prep=False, scale=scale,
        block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def gated_delta_rule_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    state_scratch: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``gated_delta_rule_verify``: ``T`` tokens per lane (``q, k [bs, T, Hk,
    Dk]``, ``v [bs, T, H, Dv]``, ``g, beta [bs, T, H]``); ``state_scratch [bs, T, H, Dk, Dv]``
    receives the state after every token; slots only read. Returns ``o [bs, T, H, Dv]``."""
    bs = check_slots(slots, ssm_state.device)
    t = q.shape[1] if q.dim() == 4 else 0
    check_rule(q, k, v, g, beta, ssm_state, (bs, t))
    check_device(ssm_state.device, state_scratch=state_scratch)
    check_shape("state_scratch", state_scratch, (bs, t, *ssm_state.shape[1:]))
    o = torch.empty_like(v) if out is None else out
    check_shape("out", o, v.shape)
    _launch_rule(
        (q, k, v), tuple(_bthd(x, True) for x in (q, k, v)), (g, beta),
        tuple(_bthd(x, True) for x in (g, beta)), o, _bthd(o, True), ssm_state, slots,
        seq_len=t, cu=None, init=None, scratch=state_scratch, write_final=False, prep=False,
        scale=scale, block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def _split_conv_out(
    y: torch.Tensor, h: int, dk: int, dv: int, nk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q, k [T, Hk, Dk]`` and ``v [T, H, Dv]`` of a conv output ``y [T, conv_dim]``."""
    kd = nk * dk
    return (
        y[:, :kd].unflatten(1, (nk, dk)),
        y[:, kd : 2 * kd].unflatten(1, (nk, dk)),
        y[:, 2 * kd :].unflatten(1, (h, dv)),
    )


def _row_strides(t: torch.Tensor, tv: int, fixed: bool) -> tuple[int, ...]:
    """(batch, token, ...) strides of a row tensor ``[T, ...]``: request-major with ``tv``
    rows a lane (fixed) or ragged (batch stride 0)."""
    s = tuple(t.stride())
    return (s[0] * tv, *s) if fixed else (0, *s)


def _mixer_rule(
    y: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    nk: int,
    *,
    tv: int,
    cu: torch.Tensor | None,
    init: torch.Tensor | None,
    scratch: torch.Tensor | None,
    write_final: bool,
    block_v: int | None,
    num_warps: int | None,
    record_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    accepted: torch.Tensor | None = None,
    layers: tuple[torch.Tensor, int] | None = None,
) -> None:
    """The mixer's delta rule over a conv output ``y [T, conv_dim]`` (SiLU applied) and gates
    ``g, beta [T, H]`` (the L2 norm of q, k inside): the one call site of the verify, decode,
    extend and the replay commit, so that they pass the kernel the same kinds of arguments."""
    _, h, dk, dv = ssm_state.shape
    q, k, v = _split_conv_out(y, h, dk, dv, nk)
    fixed = cu is None
    _launch_rule(
        (q, k, v), tuple(_row_strides(t, tv, fixed) for t in (q, k, v)), (g, beta),
        tuple(_row_strides(t, tv, fixed) for t in (g, beta)), out, out_strides, ssm_state,
        slots, seq_len=tv, cu=cu, init=init, scratch=scratch, write_final=write_final,
        prep=True, scale=None, block_v=block_v, num_warps=num_warps,
        record_gates=record_gates, accepted=accepted, layers=layers,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


def gated_delta_rule_extend_reference(
    q, k, v, g, beta, ssm_state, slots, cu_seqlens, has_initial_state=None, scale=None, *, out=None
) -> torch.Tensor:
    """The gated delta rule of the extend on arena slots (contract: :mod:`unimem_kernel.gdn`; the
    Triton side: ``gated_delta_rule_extend_triton``, the recurrent form). The reference is
    ``gdn_reference.gated_delta_rule_extend`` (the chunked form), into ``out``."""
    args = (q, k, v, g, beta, ssm_state, slots, cu_seqlens, has_initial_state, scale)
    return into(out, gdn_reference.gated_delta_rule_extend(*args))


def gated_delta_rule_decode_reference(q, k, v, g, beta, ssm_state, slots, scale=None, *, out=None):
    """The gated delta rule of a decode step on arena slots (contract:
    :mod:`unimem_kernel.gdn`; the Triton side: ``gated_delta_rule_decode_triton``). The
    reference is ``gdn_reference.gated_delta_rule_decode``, into ``out``."""
    args = (q, k, v, g, beta, ssm_state, slots, scale)
    return into(out, gdn_reference.gated_delta_rule_decode(*args))


def gated_delta_rule_verify_reference(
    q, k, v, g, beta, ssm_state, slots, state_scratch, scale=None, *, out=None
) -> torch.Tensor:
    """The gated delta rule of a verify step on arena slots (contract:
    :mod:`unimem_kernel.gdn`; the Triton side: ``gated_delta_rule_verify_triton``). The
    reference is ``gdn_reference.gated_delta_rule_verify``, into ``out``."""
    args = (q, k, v, g, beta, ssm_state, slots, state_scratch, scale)
    return into(out, gdn_reference.gated_delta_rule_verify(*args))


gated_delta_rule_extend = kernel_op(
    "gated_delta_rule_extend",
    triton=gated_delta_rule_extend_triton,
    reference=gated_delta_rule_extend_reference,
    device_of="ssm_state",
)


gated_delta_rule_decode = kernel_op(
    "gated_delta_rule_decode",
    triton=gated_delta_rule_decode_triton,
    reference=gated_delta_rule_decode_reference,
    device_of="ssm_state",
)


gated_delta_rule_verify = kernel_op(
    "gated_delta_rule_verify",
    triton=gated_delta_rule_verify_triton,
    reference=gated_delta_rule_verify_reference,
    device_of="ssm_state",
)
