"""Fused rotate-half RoPE on q and k (one launch), and the per-head rotation that
``kv_store.rope_store_kv`` shares with it (:func:`rope_heads`: the same device function, so
the same bits). Numerics and dispatch: see :mod:`unimem_kernel.fused`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2, records_autograd
from unimem_kernel.fused_common import FUSED_SWITCH, check_device, check_float, unit_last
from unimem_kernel.rounding import round_rne

__all__ = ["check_rope_args", "rope_heads", "rope_qk", "rope_qk_reference", "rope_qk_triton"]


@triton.jit
def rope_heads(
    src,
    src_sh,
    dst,
    dst_sh,
    n_heads,
    c_row,
    s_row,
    D,
    HALF,
    BH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    keep,
    nw,
    eps,
    NORM: tl.constexpr,
):
    """Rotate-half over the first ``2 * HALF`` dims of ``n_heads`` head vectors of one token
    (head ``h`` at ``src + h * src_sh``, written to ``dst + h * dst_sh``), the rest copied;
    zeros in place of every result where ``keep`` (a scalar) is False. The heads form one
    ``[BH, BLOCK_R]`` tile; the arithmetic is elementwise, so a head's result does not depend
    on the tile.

    With ``NORM``, each head vector is first replaced by its zero-centred RMS norm over all
    ``D`` dims (``x * rsqrt(mean(x^2) + eps) * (1 + nw)`` in fp32, rounded to ``src``'s dtype:
    Gemma's and Qwen3-Next's q/k norms); the sum of squares is the rotated halves' plus the
    pass-through chunks', per head, in a fixed order (row-local)."""
    dt = dst.dtype.element_ty
    xdt = src.dtype.element_ty
    rdt = c_row.dtype.element_ty  # the rotation dtype: each torch op's result rounds to it
    heads = tl.arange(0, BH)[:, None]
    hmask = heads < n_heads
    cols = tl.arange(0, BLOCK_R)[None, :]
    cmask = cols < HALF
    m = hmask & cmask
    sp = src + heads * src_sh + cols
    dp = dst + heads * dst_sh + cols
    x1 = tl.load(sp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(sp + HALF, mask=m, other=0.0).to(tl.float32)
    rstd = tl.zeros((BH, 1), dtype=tl.float32)
    if NORM:
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if BLOCK_P > 0:
            for start in range(2 * HALF, D, BLOCK_P):
                pc = start + tl.arange(0, BLOCK_P)[None, :]
                xp = tl.load(src + heads * src_sh + pc, mask=hmask & (pc < D), other=0.0)
                xp = xp.to(tl.float32)
                sq += tl.sum(xp * xp, axis=1)
        rstd = tl.math.rsqrt(sq / D + eps)[:, None]
        w1 = 1.0 + tl.load(nw + cols, mask=cmask, other=0.0).to(tl.float32)
        w2 = 1.0 + tl.load(nw + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        x1 = round_rne((x1 * rstd) * w1, xdt).to(tl.float32)
        x2 = round_rne((x2 * rstd) * w2, xdt).to(tl.float32)
    x1 = round_rne(x1, rdt).to(tl.float32)
    x2 = round_rne(x2, rdt).to(tl.float32)
    c = tl.load(c_row + cols, mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(s_row + cols, mask=cmask, other=0.0).to(tl.float32)
    x1c = round_rne(x1 * c, rdt).to(tl.float32)
    x2s = round_rne(x2 * s, rdt).to(tl.float32)
    x2c = round_rne(x2 * c, rdt).to(tl.float32)
    x1s = round_rne(x1 * s, rdt).to(tl.float32)
    lo = round_rne(x1c - x2s, rdt).to(tl.float32)
    hi = round_rne(x2c + x1s, rdt).to(tl.float32)
    tl.store(dp, tl.where(keep, round_rne(lo, dt), 0.0), mask=m)
    tl.store(dp + HALF, tl.where(keep, round_rne(hi, dt), 0.0), mask=m)
    if BLOCK_P > 0:
        for start in range(2 * HALF, D, BLOCK_P):
            pc = start + tl.arange(0, BLOCK_P)[None, :]
            pm = hmask & (pc < D)
            x = tl.load(src + heads * src_sh + pc, mask=pm, other=0.0)
            if NORM:
                wp = 1.0 + tl.load(nw + pc, mask=pc < D, other=0.0).to(tl.float32)
                x = round_rne((x.to(tl.float32) * rstd) * wp, xdt)
            tl.store(dst + heads * dst_sh + pc, tl.where(keep, x, 0.0).to(dt), mask=pm)


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    HQ,
    HK,
    D,
    HALF,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    stride_s,
    BHQ: tl.constexpr,
    BHK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program ``(t, 0)``: every query head of token ``t``; ``(t, 1)``: every key head."""
    t = tl.program_id(0).to(tl.int64)
    c_row = cos_ptr + t * stride_c
    s_row = sin_ptr + t * stride_s
    if tl.program_id(1) == 0:
        rope_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * HQ * D, D, HQ, c_row, s_row,
                    D, HALF, BHQ, BLOCK_R, BLOCK_P, True, c_row, 0.0, False)  # fmt: skip
    else:
        rope_heads(k_ptr + t * stride_kt, stride_kh, ko_ptr + t * HK * D, D, HK, c_row, s_row,
                    D, HALF, BHK, BLOCK_R, BLOCK_P, True, c_row, 0.0, False)  # fmt: skip


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # nn_ops.apply_rope, literally
    half = x.shape[-1] // 2
    xa = x.to(cos.dtype)
    x1, x2 = xa[..., :half], xa[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # qwen_common.PartialRotary.apply, literally
    rd = 2 * cos.shape[-1]
    if rd == x.shape[-1]:
        return _apply_rope(x, cos, sin)
    return torch.cat([_apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on ``q`` and ``k`` in one launch; returns new contiguous ``(q, k)``.

    ``q [T, Hq, D]``, ``k [T, Hk, D]`` (the same dtype, fp16 / bf16 / fp32; any strides with a
    unit last one, e.g. reshaped column slices of a fused qkv projection), ``cos, sin [T, R/2]``
    in the rotation dtype (fp32, or bf16 / fp16 as Gemma and gpt-oss pass them: then every
    product and sum is rounded to it, as torch's ops in that dtype are; float64 runs the
    reference). The first ``R`` dims of every head are rotated (``R = D``: full rotary,
    ``nn_ops.apply_rope``; ``R < D``: partial rotary, the other dims pass through unchanged,
    ``qwen_common.PartialRotary``): ``[x1 * c - x2 * s, x2 * c + x1 * s]`` with ``x1, x2`` the
    two halves of the rotated dims, computed in the rotation dtype and cast back to ``q``'s
    dtype. The reference is those two models' code on each of ``q`` and ``k``."""
    return _partial_rope(q, cos, sin).contiguous(), _partial_rope(k, cos, sin).contiguous()


def check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError naming the argument unless ``q [T, Hq, D]``, ``k [T, Hk, D]`` (q's dtype)
    and ``cos, sin [T, R/2]`` (one dtype, ``0 < R <= D``) are float tensors on q's device:
    the contract of :func:`rope_qk` (and of ``kv_store.rope_store_kv``)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k must be [T, Hk, D] with q's T and D, got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    t, _, d = q.shape
    if cos.dim() != 2 or cos.shape[0] != t or not 0 < 2 * cos.shape[1] <= d:
        raise ValueError(
            f"cos must be [T, R/2] with T = {t} and 0 < R <= {d}, got {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(
            f"sin must have cos's shape {tuple(cos.shape)} and dtype {cos.dtype}, "
            f"got {tuple(sin.shape)} {sin.dtype}"
        )
    for name, x in (("k", k), ("cos", cos), ("sin", sin)):
        check_device(name, x, q, "q")


def rope_qk_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`rope_qk` (arguments checked; no float64): one launch."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q2, k2, c2, s2 = unit_last(q), unit_last(k), unit_last(cos), unit_last(sin)
    half = cos.shape[1]
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=q.dtype, device=q.device)
    if t and (hq or hk) and d:
        rest = d - 2 * half
        _rope_qk_kernel[(t, 2)](
            q2, k2, c2, s2, qo, ko, hq, hk, d, half, q2.stride(0), q2.stride(1),
            k2.stride(0), k2.stride(1), c2.stride(0), s2.stride(0),
            BHQ=next_pow2(hq), BHK=next_pow2(hk), BLOCK_R=next_pow2(half),
            BLOCK_P=next_pow2(rest) if rest else 0,
        )  # fmt: skip
    return qo, ko


def _check_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    check_rope_args(q, k, cos, sin)
    if q.dtype == torch.float64 or cos.dtype == torch.float64:
        return False
    return not records_autograd(q, k, cos, sin)


rope_qk = kernel_op(
    "rope_qk",
    triton=rope_qk_triton,
    reference=rope_qk_reference,
    device_of="q",
    check=_check_rope,
    switch=FUSED_SWITCH,
)
