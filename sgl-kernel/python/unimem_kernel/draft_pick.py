"""The DSPARK drafter's left-to-right greedy pick with its low-rank Markov bias, in ``G + 1``
launches of one kernel.

For a block of ``G`` drafted columns per request, column ``i``'s token is

    tok_i = argmax_v ( base[b, i, v] + bias(prev)[v] ),   bias(prev) = U[prev] @ W.T

with ``prev`` the anchor for ``i = 0`` and ``tok_{i-1}`` after it; with an acceptance control,
``tok_i`` is replaced by ``ref[b, i]`` where ``take[b, i]`` *before* it conditions the next
column. In torch this is a chain of ~6 small kernels per column (gather, a ``[bs, R] x [R,
V]`` matmul, cast, add, argmax, where). Here it is ``G + 1`` launches of one kernel: launch
``i`` has ``bs x NSPLIT`` programs, each first resolving column ``i - 1``'s token from that
column's ``NSPLIT`` partial argmaxes (the token it conditions on; the first program of the
lane stores it), then taking the argmax of column ``i`` over its chunk of the vocabulary in
blocks of ``BLOCK_V``: the bias of a block is ``R`` multiply-adds per entry in fp32, rounded
to the bias dtype (the dtype of ``U`` and ``W``, as the torch matmul's output is) and upcast
to the logits' fp32. Ties keep the first index, within a chunk and across chunks (as
``torch.argmax``). (One program per lane walking all ``G`` columns was measured on the H200
at 0.62 ms per step for 48 x 7 x 32 000: too few programs; the split form keeps the
vocabulary sweep parallel and pays one launch per column.)

Contract: ``base [bs, G, V]`` float32 (any strides, unit last), ``anchors [bs]`` integer
token ids in ``[0, V)``, ``u, w [V, R]`` in one float dtype (unit last stride), optional
``ref [bs, G]`` integer and ``take [bs, G]`` bool. Returns ``[bs, G]`` int64, freshly
allocated (as are the ``[bs, G, NSPLIT]`` partials). Fixed grids, no host read: recorded
inside the verify step's CUDA graph. A row's picks depend only on that row
(batch-invariant). NaN logits are not supported (torch's argmax
would pick them; the sweep's comparisons skip them).

Numerics: the kernel's fp32 dot over ``R`` may round to a different bias value than cuBLAS's
matmul in rare ties of the bf16 rounding, so on a GPU the two can pick different tokens where
two logits are within a bias ulp of each other; under the interpreter on CPU (fp32 ``U``,
``W``, fp32 rounding) the kernel equals the reference exactly on the tests' inputs.
``markov_pick_reference`` is the drafter's torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import next_pow2, use_triton
from unimem_kernel.fused import _round

__all__ = ["markov_pick", "markov_pick_reference"]

_BLOCK_V = 1024
_NSPLIT = 16  # vocabulary chunks per lane and column: bs x 16 programs fill the GPU


@triton.jit
def _column_argmax(base_row, u, w_ptr, w_sv, offs_r, rmask, lo, hi, BLOCK_V: tl.constexpr):
    """``(max, first index)`` of ``base_row[v] + round(w[v] . u)`` over ``v in [lo, hi)``."""
    bias_ty = w_ptr.dtype.element_ty
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = lo.to(tl.int64)
    for v0 in range(lo, hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vmask = offs < hi
        w = tl.load(
            w_ptr + offs.to(tl.int64)[:, None] * w_sv + offs_r[None, :],
            mask=vmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(tl.float32)
        bias = _round(tl.sum(w * u[None, :], axis=1), bias_ty).to(tl.float32)
        logit = tl.load(base_row + offs, mask=vmask, other=float("-inf")) + bias
        logit = tl.where(vmask, logit, float("-inf"))
        blk_max = tl.max(logit, axis=0)
        blk_idx = tl.min(tl.where(logit == blk_max, offs, hi), axis=0).to(tl.int64)
        better = blk_max > best_val  # strictly: an earlier block keeps its tie
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
    return best_val, best_idx


@triton.jit
def _column_token(part_val, part_idx, ref_ptr, take_ptr, b, col, ref_sb, take_sb,
                  NSPLIT: tl.constexpr, HAS_CONTROL: tl.constexpr):  # fmt: skip
    """Column ``col``'s token from its ``NSPLIT`` partial argmaxes (``[NSPLIT]`` rows of
    ``part_*`` at this lane and column), replaced by the control's reference if it takes."""
    offs_s = tl.arange(0, NSPLIT)
    vals = tl.load(part_val + offs_s)
    idxs = tl.load(part_idx + offs_s)
    top = tl.max(vals, axis=0)
    # the first split holding the maximum has the smallest index among the ties
    tok = tl.min(tl.where(vals == top, idxs, 0x7FFFFFFFFFFFFFFF), axis=0)
    if HAS_CONTROL:
        take = tl.load(take_ptr + b * take_sb + col).to(tl.int1)
        ref = tl.load(ref_ptr + b * ref_sb + col).to(tl.int64)
        tok = tl.where(take, ref, tok)
    return tok


@triton.jit(do_not_specialize=["V", "col", "chunk"])
def _markov_pick_kernel(
    base_ptr,
    anchors_ptr,
    u_ptr,
    w_ptr,
    ref_ptr,
    take_ptr,
    part_val_ptr,  # [bs, G, NSPLIT] fp32
    part_idx_ptr,  # [bs, G, NSPLIT] int64
    out_ptr,
    V,
    col,
    chunk,
    base_sb,
    base_sg,
    u_sv,
    w_sv,
    ref_sb,
    take_sb,
    out_sb,
    G: tl.constexpr,
    R: tl.constexpr,
    BR: tl.constexpr,
    NSPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_CONTROL: tl.constexpr,
    FIRST: tl.constexpr,  # col == 0: prev is the anchor
    FINAL: tl.constexpr,  # col == G: only resolve column G - 1's token
):
    """Program ``(b, s)`` of column ``col``: resolves column ``col - 1``'s token from its
    partials (split 0 stores it) — that token is ``prev`` — then, unless ``FINAL``, the
    argmax of vocabulary chunk ``s`` of column ``col`` into the partials."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    parts = b * (G * NSPLIT)
    if FIRST:
        prev = tl.load(anchors_ptr + b).to(tl.int64)
    else:
        at = parts + (col - 1) * NSPLIT
        prev = _column_token(part_val_ptr + at, part_idx_ptr + at, ref_ptr, take_ptr, b,
                             col - 1, ref_sb, take_sb, NSPLIT, HAS_CONTROL)  # fmt: skip
        tl.store(out_ptr + b * out_sb + (col - 1), prev, mask=s == 0)
    if not FINAL:
        offs_r = tl.arange(0, BR)
        rmask = offs_r < R
        u = tl.load(u_ptr + prev * u_sv + offs_r, mask=rmask, other=0.0).to(tl.float32)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, V)
        val, idx = _column_argmax(base_ptr + b * base_sb + col * base_sg, u, w_ptr, w_sv,
                                  offs_r, rmask, lo, hi, BLOCK_V)  # fmt: skip
        at = parts + col * NSPLIT + s
        tl.store(part_val_ptr + at, val)
        tl.store(part_idx_ptr + at, idx)


def markov_bias_reference(u: torch.Tensor, w: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``[..., V]``: ``U[prev] @ W.T`` (the drafter's ``markov_bias``)."""
    return u[prev.long()] @ w.T


def markov_pick_reference(
    base: torch.Tensor,
    anchors: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor | None = None,
    take: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of :func:`markov_pick` (``DsparkDrafter.pick``'s loop)."""
    prev = anchors.long()
    cols = []
    for i in range(base.shape[1]):
        logits = base[:, i] + markov_bias_reference(u, w, prev).to(base.dtype)
        tok = torch.argmax(logits, dim=-1)
        if take is not None:
            tok = torch.where(take[:, i], ref[:, i], tok.long())
        cols.append(tok)
        prev = tok
    return torch.stack(cols, dim=1)


def markov_pick(
    base: torch.Tensor,
    anchors: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor | None = None,
    take: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy left-to-right pick of a drafted block (module docstring): ``[bs, G]`` int64.
    Triton for float32 ``base`` on CUDA (or with ``UNIMEM_KERNEL_BACKEND=triton``), the
    reference otherwise (float64, CPU)."""
    if base.dim() != 3:
        raise ValueError(f"base must be [bs, G, V], got {tuple(base.shape)}")
    bs, g, v = base.shape
    if anchors.shape != (bs,):
        raise ValueError(f"anchors must be [bs = {bs}], got {tuple(anchors.shape)}")
    if u.dim() != 2 or u.shape[0] != v or w.shape != u.shape or w.dtype != u.dtype:
        raise ValueError(
            f"u and w must both be [V = {v}, R] of one dtype, got {tuple(u.shape)} {u.dtype} "
            f"and {tuple(w.shape)} {w.dtype}"
        )
    if (ref is None) != (take is None):
        raise ValueError("ref and take come together (the acceptance control's decisions)")
    if ref is not None and (ref.shape != (bs, g) or take.shape != (bs, g)):
        raise ValueError(
            f"ref and take must be [bs, G] = [{bs}, {g}], got {tuple(ref.shape)}, "
            f"{tuple(take.shape)}"
        )
    if (
        base.dtype != torch.float32
        or not use_triton(base)
        or torch.is_grad_enabled()
        and (base.requires_grad or u.requires_grad or w.requires_grad)
    ):
        return markov_pick_reference(base, anchors, u, w, ref, take)
    out = torch.empty(bs, g, dtype=torch.int64, device=base.device)
    if bs == 0 or g == 0:
        return out
    if base.stride(-1) != 1:
        base = base.contiguous()
    u, w = u.contiguous(), w.contiguous()
    has_control = ref is not None
    r = u.shape[1]
    block_v = min(_BLOCK_V, next_pow2(v))
    nsplit = min(_NSPLIT, next_pow2(triton.cdiv(v, block_v)))
    chunk = triton.cdiv(triton.cdiv(v, nsplit), block_v) * block_v
    part_val = torch.empty(bs, g, nsplit, dtype=torch.float32, device=base.device)
    part_idx = torch.empty(bs, g, nsplit, dtype=torch.int64, device=base.device)
    ctl = (ref, take) if has_control else (anchors, anchors)
    for col in range(g + 1):  # column col's argmax; column col - 1's token
        _markov_pick_kernel[(bs, 1 if col == g else nsplit)](
            base, anchors, u, w, *ctl, part_val, part_idx, out, v, col, chunk,
            base.stride(0), base.stride(1), u.stride(0), w.stride(0),
            ref.stride(0) if has_control else 0, take.stride(0) if has_control else 0,
            out.stride(0), G=g, R=r, BR=next_pow2(r), NSPLIT=nsplit, BLOCK_V=block_v,
            HAS_CONTROL=has_control, FIRST=col == 0, FINAL=col == g, num_warps=4,
        )  # fmt: skip
    return out
