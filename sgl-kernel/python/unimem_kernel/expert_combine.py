"""The last step of a routed-experts (MoE) layer in one launch: weight each (token, slot) pair's
expert output and sum a token's ``k`` slots, reading the pairs where the grouped GEMMs left
them (sorted by expert).

Semantics (``moe_combine_reference``, the torch code the MoE layer ran before): ``y [P, d]``
holds the expert outputs of the ``P = T * k`` pairs in *sorted* order — row ``i`` is pair
``order[i]``, pair ``p = t * k + j`` being token ``t``'s slot ``j`` — and ``weights [T, k]``
their routing weights. Then, with ``inv`` the inverse permutation of ``order``
(``inv[order[i]] = i``)::

    out[t] = sum_{j = 0 .. k-1} fp32( round_y( y[inv[t*k + j]] * round_y(weights[t, j]) ) )

computed in float32 in that order (slot 0 first) and rounded once to ``y``'s dtype: each
product rounded to ``y``'s dtype first (as ``y * weights.to(y.dtype)`` does), the sum over the
slots in float32. Per token and independent of ``T``: batch-invariant as it stands.

It replaces three passes over the ``[P, d]`` rows (the weight multiply, the ``index_copy_``
back to pair order, the sum over the slots) and the intermediate ``[P, d]`` tensor: the
kernel gathers each token's ``k`` rows through ``inv`` and writes ``[T, d]`` once. Grid
``(T, cdiv(d, BLOCK_D))``; it allocates only ``inv`` and the output, reads nothing on the host
(captured in CUDA graphs); it is compiled without multiply-add contraction, so that every
product is rounded before it is added, as in the reference. ``order`` must be a permutation
of ``0 .. P-1`` (the caller's: an ``argsort``); it is not checked on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import next_pow2, use_triton
from unimem_kernel.fused import _round  # RNE (the interpreter's own bf16 cast truncates)

__all__ = ["moe_combine", "moe_combine_reference"]

_BLOCK_D = 1024  # columns per program (d = 2048 at the Qwen3-Next bench sizes: 2 programs)


@triton.jit
def _moe_combine_kernel(
    y_ptr,  # [P, d] expert outputs, sorted by expert
    inv_ptr,  # [P] int64: row of pair p in y
    w_ptr,  # [T, K] routing weights
    out_ptr,  # [T, d]
    d,
    y_s,
    w_s,
    o_s,
    K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < d
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + j).to(tl.int64)
        w = _round(tl.load(w_ptr + t * w_s + j).to(tl.float32), dt).to(tl.float32)
        yv = tl.load(y_ptr + row * y_s + offs, mask=m, other=0.0).to(tl.float32)
        acc += _round(yv * w, dt).to(tl.float32)
    tl.store(out_ptr + t * o_s + offs, _round(acc, out_ptr.dtype.element_ty), mask=m)


def _check(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
    """``(T, k)`` after checking shapes, dtypes and devices."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be [T, k], got {tuple(weights.shape)}")
    t, k = weights.shape
    if y.dim() != 2 or y.shape[0] != t * k:
        raise ValueError(f"y must be [T * k = {t * k}, d], got {tuple(y.shape)}")
    if order.shape != (t * k,) or order.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"order must be [{t * k}] int32/int64, got {tuple(order.shape)} "
                         f"{order.dtype}")  # fmt: skip
    if not y.is_floating_point() or not weights.is_floating_point():
        raise ValueError(f"y and weights must be floating point, got {y.dtype}, {weights.dtype}")
    for name, x in (("order", order), ("weights", weights)):
        if x.device != y.device:
            raise ValueError(f"{name} is on {x.device}, y on {y.device}")
    return t, k


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i`` (int64)."""
    idx = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(idx).scatter_(0, order.long(), idx)


def moe_combine_reference(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The torch code of the module docstring's formula (``[T, d]`` in ``y``'s dtype)."""
    t, k = _check(y, order, weights)
    if t == 0 or k == 0:
        return y.new_zeros(t, y.shape[1])
    prod = y * weights.reshape(-1)[order.long(), None].to(y.dtype)
    unsorted = torch.empty_like(prod).index_copy_(0, order.long(), prod).view(t, k, -1)
    acc = unsorted[:, 0].float()
    for j in range(1, k):
        acc = acc + unsorted[:, j].float()
    return acc.to(y.dtype)


def moe_combine(
    y: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum over each token's ``k`` slots of the expert outputs ``y [T * k, d]``
    (sorted by ``order``), as ``[T, d]`` in ``y``'s dtype: the Triton kernel where
    :func:`~unimem_kernel._dispatch.use_triton` says so (CUDA), else the reference. Same
    numbers, bitwise, on either path (float32 sums in slot order). ``inverse`` (optional,
    ``[T * k]`` int64, ``inverse[order[i]] = i``: :func:`~unimem_kernel.moe_route` returns it)
    saves the kernel path the scatter that computes it; it is trusted, not checked."""
    t, k = _check(y, order, weights)
    if inverse is not None and inverse.shape != order.shape:
        raise ValueError(f"inverse must be [{t * k}] like order, got {tuple(inverse.shape)}")
    if not use_triton(y) or k == 0 or y.dtype == torch.float64:
        return moe_combine_reference(y, order, weights)
    if y.stride(-1) != 1:
        y = y.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    d = y.shape[1]
    out = y.new_empty(t, d)
    if t == 0 or d == 0:
        return out
    block = min(_BLOCK_D, next_pow2(d))
    inv = _inverse(order) if inverse is None else inverse
    _moe_combine_kernel[(t, triton.cdiv(d, block))](
        y, inv, weights, out, d, y.stride(0), weights.stride(0), out.stride(0),
        K=k, BLOCK_D=block, num_warps=4,
        # each product rounded before it is added, as torch does: no multiply-add contraction
        # (for float32 ``y`` the compiler would otherwise fuse ``acc + y * w`` into an FMA)
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
