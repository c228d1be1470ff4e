"""Causal conv1d of the Gated DeltaNet mixer, on arena slots: its Triton kernel, launchers
and public ops (``causal_conv1d_extend`` / ``_decode`` / ``_verify``; contract:
:mod:`unimem_kernel.gdn`, semantics: :mod:`unimem_kernel.gdn_reference`).

``_conv_kernel``: grid ``(bs, token blocks, channel blocks)``; a program computes a
``[BLOCK_T, BLOCK_D]`` tile of ``y`` from ``K`` shifted loads, then SiLU (``SILU``). Only
token block 0 of a request touches its slot: it reads the initial state and, in
extend/decode, writes the final ``K-1`` inputs back after a barrier (``BLOCK_T >= K-1``
whenever there are several token blocks, so later blocks never need the state). Verify
writes the window after every token (``STORE_STATES``) or, with a record, the input rows
(``STORE_X``, coalesced).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel import gdn_reference
from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.gdn_common import (
    MAX_GRID_YZ,
    check_device,
    check_shape,
    check_slots,
    cu_seqlens_on_device,
    init_flags,
    into,
    strides_or_zeros,
    tl_acc,
)

_CONV_MAX_BLOCK_T = 64  # tokens per conv program in long (extend) segments
_CONV_TILE = 4096  # elements of a conv program's [BLOCK_T, BLOCK_D] tile
_CONV_SHORT_TILE = (64, 2)  # (BLOCK_D, warps) of segments of 2..16 tokens (verify windows)
# The tiles were chosen by measurement (docs/decisions.md, the GDN conv tiles); the arithmetic
# is per element, so no result depends on them.
_CONV_SHORT_MAX_T = 16
_CONV_WARPS = 4


@triton.jit
def _silu(x):
    """SiLU, ``x / (1 + exp(-x))``, in ``x``'s dtype (the mixer's conv output)."""
    return x / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["seq_len"])
def _conv_kernel(
    x_ptr,  # [rows, D] inputs (row of (b, t): b * x_sb + (start_b + t) * x_st)
    w_ptr,  # [D, K]
    state_ptr,  # [N, D, K-1] conv state (slot view)
    slots_ptr,  # [bs] physical slots, < 0: padded lane
    cu_ptr,  # [bs+1] row offsets (VARLEN)
    init_ptr,  # [bs] uint8 has_initial_state (HAS_INIT)
    y_ptr,  # like x
    scratch_ptr,  # [bs, T, D, K-1] (STORE_STATES)
    xr_ptr,  # [bs, T, D] the record's conv inputs (STORE_X)
    seq_len,  # tokens per request (not VARLEN)
    dim,
    x_sb,
    x_st,
    x_sd,
    w_sd,
    w_sk,
    s_sn,
    s_sd,
    s_sk,
    y_sb,
    y_st,
    y_sd,
    c_sb,
    c_st,
    c_sd,
    c_sk,
    r_sb,
    r_st,
    KW: tl.constexpr,
    KP: tl.constexpr,  # next_pow2(KW - 1)
    ACC: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_INIT: tl.constexpr,
    STORE_STATES: tl.constexpr,
    STORE_X: tl.constexpr,
    WRITE_FINAL: tl.constexpr,
    SILU: tl.constexpr,  # SiLU on the accumulator before the store (the mixer's activation)
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    tb = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    if VARLEN:
        start = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
        b_off = 0
    else:
        start = 0
        length = seq_len.to(tl.int64)
        b_off = b.to(tl.int64)
    has = live
    if HAS_INIT:
        has = has & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)
    st_base = state_ptr + slot * s_sn

    # Scalar predicates enter block masks as integer bounds (``offs < where(p, n, 0)``): the
    # Triton interpreter mistypes a splatted boolean scalar.
    live_len = tl.where(live, length, 0)
    has_len = tl.where(has, length, 0)

    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < dim
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < length
    t_live = offs_t < live_len
    t_has = offs_t < has_len
    rows = start + offs_t  # int64
    x_base = x_ptr + b_off * x_sb
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for i in tl.static_range(KW):
        # input position of tap i for each output token; < 0: from the conv state
        pos = offs_t - (KW - 1) + i
        from_x = (pos >= 0) & t_live
        from_s = (pos < 0) & t_has
        xv = tl.load(
            x_base + (start + pos)[:, None] * x_st + offs_d[None, :] * x_sd,
            mask=from_x[:, None] & dmask[None, :],
            other=0.0,
        )
        sv = tl.load(
            st_base + offs_d[None, :] * s_sd + (pos + (KW - 1))[:, None] * s_sk,
            mask=from_s[:, None] & dmask[None, :],
            other=0.0,
        )
        xin = tl.where(from_x[:, None], xv, sv.to(xv.dtype))  # rounded to x's dtype
        wi = tl.load(w_ptr + offs_d * w_sd + i * w_sk, mask=dmask, other=0.0).to(ACC)
        acc += xin.to(ACC) * wi[None, :]
        if STORE_STATES and i >= 1:
            # window after token t, column i - 1, is input t - K + 1 + i: this tap's input
            c_ptrs = (
                scratch_ptr
                + b.to(tl.int64) * c_sb
                + offs_t[:, None].to(tl.int64) * c_st
                + offs_d[None, :] * c_sd
                + (i - 1) * c_sk
            )
            smask = t_live[:, None] & dmask[None, :]
            tl.store(c_ptrs, xin.to(scratch_ptr.dtype.element_ty), mask=smask)
        if STORE_X and i == KW - 1:
            # the last tap's input is token t itself: the record keeps the rows, coalesced
            r_ptrs = (
                xr_ptr
                + b.to(tl.int64) * r_sb
                + offs_t[:, None].to(tl.int64) * r_st
                + offs_d[None, :]
            )
            tl.store(r_ptrs, xin.to(xr_ptr.dtype.element_ty), mask=t_live[:, None] & dmask[None, :])
    if SILU:
        acc = _silu(acc)
    ymask = tmask[:, None] & dmask[None, :]
    tl.store(
        y_ptr + b_off * y_sb + rows[:, None] * y_st + offs_d[None, :] * y_sd,
        acc.to(y_ptr.dtype.element_ty),
        mask=ymask,
    )
    if WRITE_FINAL:
        # the last K-1 inputs of the request (token block 0 only: the one program per channel
        # block that reads this slot)
        first = tb == 0
        cols = tl.arange(0, KP)
        c_live = cols < tl.where(live & first, KW - 1, 0)
        c_has = cols < tl.where(has & first, KW - 1, 0)
        pos = length - (KW - 1) + cols
        fx = (pos >= 0) & c_live
        fs = (pos < 0) & c_has
        xv = tl.load(
            x_base + (start + pos)[None, :] * x_st + offs_d[:, None] * x_sd,
            mask=dmask[:, None] & fx[None, :],
            other=0.0,
        )
        sv = tl.load(
            st_base + offs_d[:, None] * s_sd + (pos + (KW - 1))[None, :] * s_sk,
            mask=dmask[:, None] & fs[None, :],
            other=0.0,
        )
        fin = tl.where(fx[None, :], xv, sv.to(xv.dtype))
        # every read of the slot (above and in the tap loop, by any thread) before any write
        tl.debug_barrier()
        tl.store(
            st_base + offs_d[:, None] * s_sd + cols[None, :] * s_sk,
            fin.to(state_ptr.dtype.element_ty),
            mask=dmask[:, None] & c_live[None, :],
        )


def _conv_blocks(
    max_len: int,
    dim: int,
    kw: int,
    block_d: int | None,
    block_t: int | None,
    num_warps: int | None = None,
) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_D, token blocks, warps)``; ``None`` picks the default: a
    ``_CONV_SHORT_TILE`` for segments of 2 .. ``_CONV_SHORT_MAX_T`` tokens (verify), else
    ``_CONV_TILE`` elements of at most 512 channels in ``_CONV_WARPS`` warps. Several token
    blocks only with ``BLOCK_T >= K-1`` (later blocks must never need the conv state)."""
    cap = _CONV_MAX_BLOCK_T if block_t is None else block_t
    if cap <= 0 or cap & (cap - 1):
        raise ValueError(f"block_t must be a power of two, got {cap}")
    block_t = min(next_pow2(max_len), cap)
    n_t = max(1, triton.cdiv(max_len, block_t))
    if n_t > 1 and block_t < kw - 1:
        raise ValueError(f"conv kernel width {kw} too large for {block_t}-token blocks")
    short = 1 < block_t <= _CONV_SHORT_MAX_T and n_t == 1
    if block_d is None:
        if short:
            block_d = max(16, min(_CONV_SHORT_TILE[0], next_pow2(dim)))
        else:
            block_d = max(16, min(512, _CONV_TILE // block_t, next_pow2(dim)))
    if num_warps is None:
        num_warps = _CONV_SHORT_TILE[1] if short else _CONV_WARPS
    if n_t > MAX_GRID_YZ or triton.cdiv(dim, block_d) > MAX_GRID_YZ:
        raise ValueError(f"conv grid too large: {n_t} token blocks, dim {dim}")
    return block_t, block_d, n_t, num_warps


def _launch_conv(
    x: torch.Tensor,
    x_strides: tuple[int, int, int],  # (batch, token, channel)
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    y: torch.Tensor,
    y_strides: tuple[int, int, int],
    *,
    seq_len: int,
    max_len: int,
    cu: torch.Tensor | None,
    init: torch.Tensor | None,
    scratch: torch.Tensor | None,
    write_final: bool,
    block_d: int | None = None,
    block_t: int | None = None,
    record_x: torch.Tensor | None = None,
    num_warps: int | None = None,
    silu: bool = False,
) -> None:
    """One ``_conv_kernel`` launch. ``scratch [bs, T, D, K-1]``: the window after every token
    (verify); ``record_x [bs, T, D]`` (row-contiguous): the input rows (verify with a
    record); ``silu``: SiLU on the output before its rounding (the mixer's conv).
    ``block_d`` / ``block_t`` / ``num_warps`` override the tile (``_conv_blocks``; per-element
    arithmetic: no result depends on them; the conv micro-benchmark sweeps them)."""
    bs = slots.shape[0]
    dim, kw = weight.shape
    if bs == 0 or dim == 0:
        return
    block_t, block_d, n_t, num_warps = _conv_blocks(max_len, dim, kw, block_d, block_t, num_warps)
    grid = (bs, n_t, triton.cdiv(dim, block_d))
    _conv_kernel[grid](
        x, weight, conv_state, slots,
        slots if cu is None else cu,
        slots if init is None else init,
        y,
        y if scratch is None else scratch,
        y if record_x is None else record_x,
        seq_len, dim,
        *x_strides, *weight.stride(), *conv_state.stride(), *y_strides,
        *strides_or_zeros(scratch, 4), *strides_or_zeros(record_x, 3)[:2],
        KW=kw,
        KP=next_pow2(max(kw - 1, 1)),
        ACC=tl_acc(x.dtype),
        VARLEN=cu is not None,
        HAS_INIT=init is not None,
        STORE_STATES=scratch is not None,
        STORE_X=record_x is not None,
        WRITE_FINAL=write_final,
        SILU=silu,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip


def _check_conv(x_dim: int, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    if weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"need weight [D, K] and conv_state [N, D, K-1], got {tuple(weight.shape)} and "
            f"{tuple(conv_state.shape)}"
        )
    dim, kw = weight.shape
    if kw < 2 or tuple(conv_state.shape[1:]) != (dim, kw - 1) or x_dim != dim:
        raise ValueError(
            f"conv shapes disagree: x has {x_dim} channels, weight {tuple(weight.shape)}, "
            f"conv_state {tuple(conv_state.shape)}"
        )
    check_device(conv_state.device, weight=weight)


def causal_conv1d_extend_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    has_initial_state: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    block_d: int | None = None,
    block_t: int | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton launcher of ``causal_conv1d_extend`` (one launch): ``x [T, D]`` ragged by
    ``cu_seqlens``; reads the initial and writes the final conv state of each request in its
    slot, in place. Returns ``out [T, D]`` (``x``'s dtype). ``activation``: None or
    ``"silu"``. ``block_d``/``block_t`` (powers of two) override the tile; tests lower
    ``block_t`` to split requests over token blocks."""
    silu = gdn_reference.check_activation(activation)
    _check_conv(x.shape[-1], weight, conv_state)
    bs = check_slots(slots, conv_state.device)
    check_device(conv_state.device, x=x, out=out)
    cu, max_len = cu_seqlens_on_device(cu_seqlens, bs, conv_state.device, max_seqlen)
    init = init_flags(has_initial_state, bs, conv_state.device)
    y = torch.empty_like(x) if out is None else out
    check_shape("out", y, x.shape)
    _launch_conv(
        x, (0, *x.stride()), weight, conv_state, slots, y, (0, *y.stride()),
        seq_len=0, max_len=max_len, cu=cu, init=init, scratch=None, write_final=True,
        block_d=block_d, block_t=block_t, silu=silu,
    )  # fmt: skip
    return y


def causal_conv1d_decode_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton launcher of ``causal_conv1d_decode``: ``x [bs, D]`` -> ``out [bs, D]``; each live
    lane's slot state is updated in place. ``activation``: None or ``"silu"``."""
    silu = gdn_reference.check_activation(activation)
    _check_conv(x.shape[-1], weight, conv_state)
    bs = check_slots(slots, conv_state.device)
    check_device(conv_state.device, x=x, out=out)
    check_shape("x", x, (bs, weight.shape[0]))
    y = torch.empty_like(x) if out is None else out
    check_shape("out", y, x.shape)
    _launch_conv(
        x, (x.stride(0), 0, x.stride(1)), weight, conv_state, slots, y,
        (y.stride(0), 0, y.stride(1)), seq_len=1, max_len=1, cu=None, init=None, scratch=None,
        write_final=True, block_d=block_d, silu=silu,
    )  # fmt: skip
    return y


def causal_conv1d_verify_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    state_scratch: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton launcher of ``causal_conv1d_verify``: ``x [bs, T, D]`` -> ``out [bs, T, D]``;
    ``state_scratch [bs, T, D, K-1]`` receives the conv state after every token; slots are
    only read. ``activation``: None or ``"silu"``."""
    silu = gdn_reference.check_activation(activation)
    _check_conv(x.shape[-1], weight, conv_state)
    bs = check_slots(slots, conv_state.device)
    check_device(conv_state.device, x=x, out=out, state_scratch=state_scratch)
    if x.dim() != 3 or x.shape[0] != bs:
        raise ValueError(f"x must be [bs={bs}, T, D], got {tuple(x.shape)}")
    t = x.shape[1]
    check_shape("state_scratch", state_scratch, (bs, t, *conv_state.shape[1:]))
    y = torch.empty_like(x) if out is None else out
    check_shape("out", y, x.shape)
    _launch_conv(
        x, tuple(x.stride()), weight, conv_state, slots, y, tuple(y.stride()), seq_len=t,
        max_len=t, cu=None, init=None, scratch=state_scratch, write_final=False,
        block_d=block_d, silu=silu,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


def causal_conv1d_extend_reference(
    x, weight, conv_state, slots, cu_seqlens, has_initial_state=None, *, out=None,
    activation=None,
) -> torch.Tensor:  # fmt: skip
    """The causal conv1d of the extend on arena slots (contract: :mod:`unimem_kernel.gdn`; the
    Triton side: ``causal_conv1d_extend_triton``). The reference is
    ``gdn_reference.causal_conv1d_extend``, into ``out``."""
    ref = gdn_reference.causal_conv1d_extend
    return into(out, ref(x, weight, conv_state, slots, cu_seqlens, has_initial_state, activation))


def causal_conv1d_decode_reference(
    x, weight, conv_state, slots, *, out=None, activation=None
) -> torch.Tensor:
    """The causal conv1d of a decode step on arena slots (contract: :mod:`unimem_kernel.gdn`;
    the Triton side: ``causal_conv1d_decode_triton``). The reference is
    ``gdn_reference.causal_conv1d_decode``, into ``out``."""
    ref = gdn_reference.causal_conv1d_decode
    return into(out, ref(x, weight, conv_state, slots, activation))


def causal_conv1d_verify_reference(
    x, weight, conv_state, slots, state_scratch, *, out=None, activation=None
) -> torch.Tensor:
    """The causal conv1d of a verify step on arena slots (contract: :mod:`unimem_kernel.gdn`;
    the Triton side: ``causal_conv1d_verify_triton``). The reference is
    ``gdn_reference.causal_conv1d_verify``, into ``out``."""
    ref = gdn_reference.causal_conv1d_verify
    return into(out, ref(x, weight, conv_state, slots, state_scratch, activation))


causal_conv1d_extend = kernel_op(
    "causal_conv1d_extend",
    triton=causal_conv1d_extend_triton,
    reference=causal_conv1d_extend_reference,
    device_of="conv_state",
)


causal_conv1d_decode = kernel_op(
    "causal_conv1d_decode",
    triton=causal_conv1d_decode_triton,
    reference=causal_conv1d_decode_reference,
    device_of="conv_state",
)


causal_conv1d_verify = kernel_op(
    "causal_conv1d_verify",
    triton=causal_conv1d_verify_triton,
    reference=causal_conv1d_verify_reference,
    device_of="conv_state",
)
