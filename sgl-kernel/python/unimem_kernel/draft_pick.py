"""The DSPARK drafter's left-to-right greedy pick with its low-rank Markov bias, in ``G + 1``
launches of one kernel.

For a block of ``G`` drafted columns per request, column ``i``'s token is

    tok_i = argmax_v ( base[b, i, v] + bias(prev)[v] ),   bias(prev) = U[prev] @ W.T

with ``prev`` the anchor for ``i = 0`` and ``tok_{i-1}`` after it; with an acceptance control,
``tok_i`` is replaced by ``ref[b, i]`` where ``take[b, i]`` *before* it conditions the next
column. In torch this is a chain of ~6 small kernels per column (gather, a ``[bs, R] x [R,
V]`` matmul, cast, add, argmax, where). Here launch ``i`` has ``cdiv(bs, LANES) x NSPLIT``
programs; program ``(g, s)`` serves the lane group ``g * LANES + [0, LANES)`` on vocabulary
chunk ``s``. It first resolves the group's column ``i - 1`` tokens from that column's
``NSPLIT`` partial argmaxes per lane (the tokens they condition on; the group's split-0
program stores them), then takes the group's argmaxes of column ``i`` over its chunk in blocks
of ``BLOCK_V``: each ``[BLOCK_V, R]`` block of ``W`` is loaded once and applied to every lane
of the group in a static loop, a lane's bias being ``R`` multiply-adds per entry in fp32
(``tl.sum(w * u, axis=1)``), rounded to the bias dtype (the dtype of ``U`` and ``W``, as the
torch matmul's output is) and upcast to the logits' fp32; the lanes' logits then form one
``[BLOCK_V, LANES]`` tile whose maxima and first indices are two reductions for the whole
group. Ties keep the first index, within a chunk and across chunks (as ``torch.argmax``).
Lanes past ``bs`` in the last group redo lane ``bs - 1`` and store nothing.

Why groups: one program per lane walking all ``G`` columns leaves too few programs to fill
the GPU; one program per (lane, chunk) reads its chunk of ``W`` for a single lane, so ``W``
passes through L2 ``bs`` times per column. A group of ``LANES`` lanes reads ``W`` ``bs /
LANES`` times per column, in ``bs / LANES x NSPLIT`` programs (the layout was chosen by
measurement: docs/decisions.md, the drafter's pick).

Contract: ``base [bs, G, V]`` float32 (any strides, unit last), ``anchors [bs]`` integer
token ids in ``[0, U)``, ``u [U, R]`` (``U >= V``: rows past ``V`` serve previous tokens
that are never candidates, e.g. a reduced draft vocabulary's out-of-vocabulary row) and
``w [V, R]`` in one float dtype (unit last stride), optional ``ref [bs, G]`` integer in
``[0, U)`` where ``take`` and ``take [bs, G]`` bool. Returns ``[bs, G]`` int64, freshly
allocated (as are the ``[bs, G, NSPLIT]`` partials). Fixed grids, no host read: recorded
inside the verify step's CUDA graph. A row's picks depend only on that row
(batch-invariant). NaN logits are not supported (torch's argmax
would pick them; the sweep's comparisons skip them).

Numerics: a lane's bias is computed as by the one-lane kernel this replaces. The ``W`` tile
keeps its register layout along ``R`` (for 16-bit ``W`` and ``R`` 16: 8 consecutive entries
per thread, 2 threads), so each entry sums the same products in the same order: a thread's 8
in order, then the two halves (as Triton 3.6's sm_90 PTX of both kernels shows). Which
product of a chain the compiler leaves as a plain multiply (the rest fuse into FMAs) varies
by row; with 16-bit ``U`` and ``W`` every product is exact in fp32, so that cannot change the
sum and the picks are the previous kernel's bit for bit (with fp32 ``U`` and ``W`` a sum can
differ in its last bit, rarely). The kernel's fp32 dot may round to a different bias value than
cuBLAS's matmul in rare ties of the bf16 rounding, so on a GPU the kernel and the reference
can pick different tokens where two logits are within a bias ulp of each other; under the
interpreter on CPU (fp32 ``U``, ``W``, fp32 rounding) the kernel equals the reference
exactly on the tests' inputs. ``markov_pick_reference`` is the drafter's torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2, records_autograd
from unimem_kernel.rounding import round_rne

__all__ = ["markov_pick", "markov_pick_reference", "markov_pick_triton"]

_BLOCK_V = 512  # vocabulary entries per block: one block per program at V = 32 000
_LANES = 8  # lanes per program, each W block read once for all of them
_NSPLIT = 64  # vocabulary chunks per lane group and column: 6 x 64 programs at bs 48
_NUM_WARPS = 4


@triton.jit
def _join_lanes(xs, LANES: tl.constexpr, BLOCK_V: tl.constexpr):
    """``[BLOCK_V, LANES]`` whose column ``j`` is ``xs[j]`` (a tuple of ``LANES`` ``[BLOCK_V]``
    tensors): ``tl.join`` in halves, in registers (the joined dimensions are the thread's)."""
    for level in tl.static_range(LANES.bit_length() - 1):
        ys = ()
        for i in tl.static_range(LANES >> (level + 1)):
            ys = ys + (tl.join(xs[i], xs[i + (LANES >> (level + 1))]),)
        xs = ys
    # level l's joins add a last dimension that steps LANES >> (l + 1) lanes, so the
    # row-major flattening of the joined dimensions is the lane
    return tl.reshape(xs[0], (BLOCK_V, LANES))


@triton.jit
def _split_lanes(x, LANES: tl.constexpr):
    """The ``LANES`` elements of ``x`` (``[LANES]``) as a tuple of scalars: ``tl.split`` in
    halves, in registers once ``x`` is held whole by every thread."""
    xs = (x,)
    for level in tl.static_range(LANES.bit_length() - 1):
        # piece p of this level holds the lanes ``m * 2**level + p``: splitting it into
        # ``m`` even and odd, the even halves first, keeps that rule one level down
        evens = ()
        odds = ()
        for p in tl.static_range(1 << level):
            # (the last level splits a [2] into two scalars)
            pair = xs[p] if (LANES >> level) == 2 else tl.reshape(xs[p], (LANES >> (level + 1), 2))
            a, b = tl.split(pair)
            evens = evens + (a,)
            odds = odds + (b,)
        xs = evens + odds
    return xs


@triton.jit
def _column_tokens(part_val, part_idx, at, ref_ptr, take_ptr, lanes, col, ref_sb, take_sb,
                   NSPLIT: tl.constexpr, HAS_CONTROL: tl.constexpr):  # fmt: skip
    """Column ``col``'s tokens of ``lanes`` from their ``NSPLIT`` partial argmaxes each (at
    ``part_* + at[l] + s``), replaced by the control's reference where it takes."""
    offs = at[:, None] + tl.arange(0, NSPLIT)[None, :]
    vals = tl.load(part_val + offs)
    idxs = tl.load(part_idx + offs)
    top = tl.max(vals, axis=1)
    # the first split holding the maximum has the smallest index among the ties
    tok = tl.min(tl.where(vals == top[:, None], idxs, 0x7FFFFFFFFFFFFFFF), axis=1)
    if HAS_CONTROL:
        take = tl.load(take_ptr + lanes * take_sb + col).to(tl.int1)
        ref = tl.load(ref_ptr + lanes * ref_sb + col).to(tl.int64)
        tok = tl.where(take, ref, tok)
    return tok


@triton.jit(do_not_specialize=["bs", "col"])
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
    bs,
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
    LANES: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_CONTROL: tl.constexpr,
    FIRST: tl.constexpr,  # col == 0: prev is the anchor
    FINAL: tl.constexpr,  # col == G: only resolve column G - 1's token
):
    """Program ``(g, s)`` of column ``col``, for lanes ``g * LANES + [0, LANES)``: resolves
    their column ``col - 1`` tokens from the partials (split 0 stores them) — those are
    ``prev`` — then, unless ``FINAL``, their argmaxes over vocabulary chunk ``s`` of column
    ``col`` into the partials. Lanes past ``bs`` redo lane ``bs - 1`` and store nothing."""
    grp = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.arange(0, LANES)
    live = grp * LANES + slot < bs
    lanes = tl.minimum(grp * LANES + slot, bs - 1).to(tl.int64)
    parts = lanes * (G * NSPLIT)
    if FIRST:
        prev = tl.load(anchors_ptr + lanes).to(tl.int64)
    else:
        at = parts + (col - 1) * NSPLIT
        prev = _column_tokens(part_val_ptr, part_idx_ptr, at, ref_ptr, take_ptr, lanes, col - 1,
                              ref_sb, take_sb, NSPLIT, HAS_CONTROL)  # fmt: skip
        if s == 0:
            tl.store(out_ptr + lanes * out_sb + (col - 1), prev, mask=live)
    if not FINAL:
        bias_ty = w_ptr.dtype.element_ty
        offs_r = tl.arange(0, BR)
        rmask = offs_r < R
        prevs = _split_lanes(prev, LANES)
        us = ()
        for j in tl.static_range(LANES):
            u = tl.load(u_ptr + prevs[j] * u_sv + offs_r, mask=rmask, other=0.0).to(tl.float32)
            us = us + (u,)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, V)
        base_rows = base_ptr + lanes * base_sb + col * base_sg
        best_val = tl.full([LANES], float("-inf"), tl.float32)
        best_idx = tl.full([LANES], 0, tl.int64) + lo
        for v0 in range(lo, hi, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            vmask = offs < hi
            w = tl.load(
                w_ptr + offs.to(tl.int64)[:, None] * w_sv + offs_r[None, :],
                mask=vmask[:, None] & rmask[None, :],
                other=0.0,
            ).to(tl.float32)
            sums = ()
            for j in tl.static_range(LANES):  # the W block once, for every lane
                sums = sums + (tl.sum(w * us[j][None, :], axis=1),)
            bias = round_rne(_join_lanes(sums, LANES, BLOCK_V), bias_ty).to(tl.float32)
            logit = tl.load(base_rows[None, :] + offs[:, None], mask=vmask[:, None],
                            other=float("-inf")) + bias  # fmt: skip
            logit = tl.where(vmask[:, None], logit, float("-inf"))
            blk_max = tl.max(logit, axis=0)
            blk_idx = tl.min(tl.where(logit == blk_max[None, :], offs[:, None], hi), axis=0)
            better = blk_max > best_val  # strictly: an earlier block keeps its tie
            best_idx = tl.where(better, blk_idx.to(tl.int64), best_idx)
            best_val = tl.where(better, blk_max, best_val)
        at = parts + col * NSPLIT + s
        tl.store(part_val_ptr + at, best_val, mask=live)
        tl.store(part_idx_ptr + at, best_idx, mask=live)


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
    """Greedy left-to-right pick of a drafted block (module docstring): ``[bs, G]`` int64. The
    kernels take float32 ``base`` (float64 and autograd run the reference).

    The reference: ``DsparkDrafter.pick``'s loop."""
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


def markov_pick_triton(
    base: torch.Tensor,
    anchors: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor | None = None,
    take: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`markov_pick` (arguments already checked; float32 ``base``):
    one launch per column."""
    bs, g, v = base.shape
    out = torch.empty(bs, g, dtype=torch.int64, device=base.device)
    if bs == 0 or g == 0:
        return out
    if base.stride(-1) != 1:
        base = base.contiguous()
    u, w = u.contiguous(), w.contiguous()
    has_control = ref is not None
    r = u.shape[1]
    block_v = min(_BLOCK_V, next_pow2(v))
    lanes = min(_LANES, next_pow2(bs))
    nsplit = min(_NSPLIT, next_pow2(triton.cdiv(v, block_v)))
    chunk = triton.cdiv(triton.cdiv(v, nsplit), block_v) * block_v
    part_val = torch.empty(bs, g, nsplit, dtype=torch.float32, device=base.device)
    part_idx = torch.empty(bs, g, nsplit, dtype=torch.int64, device=base.device)
    ctl = (ref, take) if has_control else (anchors, anchors)
    for col in range(g + 1):  # column col's argmax; column col - 1's token
        _markov_pick_kernel[(triton.cdiv(bs, lanes), 1 if col == g else nsplit)](
            base, anchors, u, w, *ctl, part_val, part_idx, out, bs, v, col, chunk,
            base.stride(0), base.stride(1), u.stride(0), w.stride(0),
            ref.stride(0) if has_control else 0, take.stride(0) if has_control else 0,
            out.stride(0), G=g, R=r, BR=next_pow2(r), NSPLIT=nsplit, LANES=lanes,
            BLOCK_V=block_v, HAS_CONTROL=has_control, FIRST=col == 0, FINAL=col == g,
            num_warps=_NUM_WARPS,
        )  # fmt: skip
    return out


def _check(
    base: torch.Tensor,
    anchors: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor | None = None,
    take: torch.Tensor | None = None,
) -> bool:
    if base.dim() != 3:
        raise ValueError(f"base must be [bs, G, V], got {tuple(base.shape)}")
    bs, g, v = base.shape
    if anchors.shape != (bs,):
        raise ValueError(f"anchors must be [bs = {bs}], got {tuple(anchors.shape)}")
    if (
        u.dim() != 2
        or u.shape[0] < v
        or w.dim() != 2
        or w.shape != (v, u.shape[1])
        or w.dtype != u.dtype
    ):
        raise ValueError(
            f"u must be [>= V = {v}, R] and w [V, R] of one dtype, got {tuple(u.shape)} "
            f"{u.dtype} and {tuple(w.shape)} {w.dtype}"
        )
    if (ref is None) != (take is None):
        raise ValueError("ref and take come together (the acceptance control's decisions)")
    if ref is not None and (ref.shape != (bs, g) or take.shape != (bs, g)):
        raise ValueError(
            f"ref and take must be [bs, G] = [{bs}, {g}], got {tuple(ref.shape)}, "
            f"{tuple(take.shape)}"
        )
    return base.dtype == torch.float32 and not records_autograd(base, u, w)


markov_pick = kernel_op(
    "markov_pick",
    triton=markov_pick_triton,
    reference=markov_pick_reference,
    device_of="base",
    check=_check,
)
