"""Greedy acceptance of a verify step in two launches: the target's argmax of every verify row,
then each request's accepted prefix of drafts and its bonus token.

A verify step feeds the target ``[anchor, d_1 .. d_gamma]`` per request, so its logits have
``W = gamma + 1`` rows per request; row ``j``'s argmax is the target's greedy choice for the
position of ``d_{j+1}`` (row ``gamma``'s the one after ``d_gamma``). The longest prefix of
drafts equal to those choices is accepted and the choice right after it is the *bonus*
token. In torch this is ``torch.argmax(logits, -1).reshape(bs, W)`` followed by a handful of
small kernels (compare, cumprod, sum, gather); here it is two launches of fixed grids:

1. ``_row_argmax_kernel``, ``rows x NSPLIT`` programs: program ``(r, s)`` scans the ``s``-th
   contiguous chunk of row ``r``'s vocabulary in blocks of ``BLOCK_V`` and writes its
   ``(max, first index)`` to the ``[rows, NSPLIT]`` partials. ``NSPLIT`` (up to 8) splits the
   vocabulary so that ``rows x NSPLIT`` programs fill the GPU.
2. ``_accept_kernel``, ``bs`` programs: lane ``b`` reduces the partials of its ``W`` rows to
   their tokens, stores ``tokens[b]``, compares them with ``draft[b]`` and stores the accepted
   prefix length and the bonus token.

Contract: ``logits [bs * W, V]`` float32 (other float dtypes run the reference), rows
request-major (row ``b * W + j`` is lane
``b``'s verify row ``j``), any row stride (a unit last stride is read in place; another last
stride is copied first), ``V >= 1``; ``draft [bs, gamma]`` of any integer dtype (any
strides), ``gamma >= 0``, on the device of ``logits``. Returns ``(tokens, accepted, bonus)``:
``tokens [bs, W]`` int64 (the rows' argmaxes), ``accepted [bs]`` int32 in ``0..gamma`` (the
longest ``j``-prefix with ``draft[b, j] == tokens[b, j]``) and ``bonus [bs]`` int64
(``tokens[b, accepted[b]]``), all three freshly allocated, as are the ``[bs * W, NSPLIT]``
partials (float32 and int64); nothing else is allocated. With ``lse=True`` a fourth output,
every row's ``logsumexp`` (``[bs * W]``; float32 from the kernels, equal to
``torch.logsumexp``'s to float32 rounding: the sum's order differs), comes from the same pass
over the logits (each chunk also keeps its sum of ``exp(x - max)``, rescaled block by block):
a verify step's log-probabilities then cost a gather, not another few passes over
``[bs * W, V]`` float32. No host read and fixed grids: the
op can be recorded in a CUDA graph with the verify step. Ties keep the first index, within a
block, across blocks and across chunks, as ``torch.argmax`` does; a row of ``-inf`` gives
index 0. NaN logits are not supported (``torch.argmax`` would pick a NaN; the kernel's
comparisons skip them). A row's token depends only on that row, and a lane's result only on
its rows and drafts (batch-invariant). ``bs == 0`` gives empty outputs and launches nothing.

``greedy_verify_accept_reference`` is the torch reference, with identical semantics (the
argmax plus ``unimem.speculative.accept.greedy_accept``, written here again: this package
does not import ``unimem``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = [
    "greedy_verify_accept",
    "greedy_verify_accept_reference",
    "greedy_verify_accept_triton",
]

_BLOCK_V = 2048  # logits per block of the vocabulary sweep (read at call time; tests shrink it)
_NSPLIT = 8  # at most this many vocabulary chunks per row: bs x W x 8 programs fill the GPU


@triton.jit(do_not_specialize=["V", "chunk"])
def _row_argmax_kernel(
    logits_ptr,
    part_val_ptr,  # [rows, NSPLIT] fp32
    part_idx_ptr,  # [rows, NSPLIT] int64
    part_sum_ptr,  # [rows, NSPLIT] fp32 (LSE only)
    V,
    chunk,
    logits_sr,
    NSPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LSE: tl.constexpr,
):
    """Program ``(r, s)``: ``(max, first index)`` of row ``r`` over ``[s * chunk, (s + 1) *
    chunk) & [0, V)`` into the partials; an empty chunk gives ``(-inf, s * chunk)``. With
    ``LSE`` also ``sum(exp(x - max))`` over the chunk (rescaled block by block; 0 for an
    empty chunk or one of ``-inf`` only)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    row_ptr = logits_ptr + row * logits_sr
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = lo.to(tl.int64)
    total = tl.zeros((), tl.float32)  # sum(exp(x - best_val)) of the blocks so far
    for v0 in range(lo, hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vmask = offs < hi
        x = tl.load(row_ptr + offs, mask=vmask, other=float("-inf"))
        blk_max = tl.max(x, axis=0)
        blk_idx = tl.min(tl.where(vmask & (x == blk_max), offs, hi), axis=0).to(tl.int64)
        if LSE:
            new_max = tl.maximum(best_val, blk_max)
            if new_max > float("-inf"):  # else every value so far is -inf: the sum stays 0
                total = total * tl.exp(best_val - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        better = blk_max > best_val  # strictly: an earlier block keeps its tie
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
    at = row * NSPLIT + s
    tl.store(part_val_ptr + at, best_val)
    tl.store(part_idx_ptr + at, best_idx)
    if LSE:
        tl.store(part_sum_ptr + at, total)


@triton.jit
def _accept_kernel(
    part_val_ptr,
    part_idx_ptr,
    part_sum_ptr,
    draft_ptr,
    tokens_ptr,  # [bs, W] int64, contiguous
    accepted_ptr,  # [bs] int32
    bonus_ptr,  # [bs] int64
    lse_ptr,  # [bs * W] fp32 (LSE only)
    draft_sb,
    draft_sg,
    W: tl.constexpr,
    WP: tl.constexpr,  # next_pow2(W)
    NSPLIT: tl.constexpr,
    LSE: tl.constexpr,
):
    """Program ``b``: lane ``b``'s ``W`` tokens from their partials, then its accepted prefix
    against ``draft[b]`` and the bonus token; with ``LSE`` each row's log-sum-exp from its
    chunks' sums (in chunk order)."""
    b = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, WP)
    offs_s = tl.arange(0, NSPLIT)
    jmask = offs_j < W
    at = (b * W + offs_j)[:, None] * NSPLIT + offs_s[None, :]
    vals = tl.load(part_val_ptr + at, mask=jmask[:, None], other=float("-inf"))
    idxs = tl.load(part_idx_ptr + at, mask=jmask[:, None], other=0)
    top = tl.max(vals, axis=1)
    # among chunks holding the row's maximum, the first (smallest index) wins
    tok = tl.min(tl.where(vals == top[:, None], idxs, 0x7FFFFFFFFFFFFFFF), axis=1)
    tl.store(tokens_ptr + b * W + offs_j, tok, mask=jmask)
    if LSE:
        sums = tl.load(part_sum_ptr + at, mask=jmask[:, None], other=0.0)
        # a chunk of -inf only (or an empty one) adds nothing; a row of -inf only gives -inf
        scale = tl.where(vals > float("-inf"), tl.exp(vals - top[:, None]), 0.0)
        lse = tl.log(tl.sum(sums * scale, axis=1)) + top
        tl.store(lse_ptr + b * W + offs_j, lse, mask=jmask)
    dmask = offs_j < W - 1
    d = tl.load(draft_ptr + b * draft_sb + offs_j * draft_sg, mask=dmask, other=0).to(tl.int64)
    # column gamma = W - 1 (and the padding past it) always misses: accepted <= gamma
    miss = (d != tok) | (offs_j >= W - 1)
    acc = tl.min(tl.where(miss, offs_j, W - 1), axis=0)
    bonus = tl.sum(tl.where(offs_j == acc, tok, 0), axis=0)
    tl.store(accepted_ptr + b, acc.to(tl.int32))
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _check(logits: torch.Tensor, draft: torch.Tensor) -> None:
    if draft.dim() != 2 or not _is_integer(draft.dtype):
        raise ValueError(
            f"draft must be a 2-D integer tensor [bs, gamma], got {tuple(draft.shape)} "
            f"{draft.dtype}"
        )
    bs, gamma = draft.shape
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits must be a 2-D float tensor [bs * (gamma + 1), V], got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    if logits.shape[0] != bs * (gamma + 1):
        raise ValueError(
            f"logits must have bs * (gamma + 1) = {bs} * {gamma + 1} = {bs * (gamma + 1)} rows "
            f"for draft [{bs}, {gamma}], got {logits.shape[0]}"
        )
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary (V >= 1), got V = 0")
    if logits.device != draft.device:
        raise ValueError(
            f"logits and draft must be on one device, got {logits.device} and {draft.device}"
        )


def greedy_verify_accept_reference(
    logits: torch.Tensor, draft: torch.Tensor, *, lse: bool = False
) -> tuple[torch.Tensor, ...]:
    """``(tokens [bs, W] int64, accepted [bs] int32, bonus [bs] int64)`` of a greedy verify
    step (module docstring); with ``lse`` also every row's ``logsumexp [bs * W]`` in the
    logits' dtype. The kernels take float32 ``logits``; other float dtypes (the float64 CPU
    models) run the reference."""
    bs, gamma = draft.shape
    tokens = torch.argmax(logits, dim=-1).reshape(bs, gamma + 1)
    miss = draft.long() != tokens[:, :gamma]
    # the first miss, with column gamma always a miss: the accepted prefix length
    miss = torch.cat([miss, miss.new_ones(bs, 1)], dim=1)
    accepted = torch.argmax(miss.to(torch.int32), dim=1).to(torch.int32)
    bonus = tokens.gather(1, accepted.long()[:, None])[:, 0]
    if lse:
        return tokens, accepted, bonus, torch.logsumexp(logits, dim=-1)
    return tokens, accepted, bonus


def greedy_verify_accept_triton(
    logits: torch.Tensor, draft: torch.Tensor, *, lse: bool = False
) -> tuple[torch.Tensor, ...]:
    """Triton launcher of :func:`greedy_verify_accept` (arguments already checked; float32
    logits): a split row argmax (with ``lse``, and each chunk's sum of exponentials in the
    same pass), then the acceptance per lane."""
    bs, gamma = draft.shape
    w = gamma + 1
    rows, v = logits.shape
    dev = logits.device
    tokens = torch.empty(bs, w, dtype=torch.int64, device=dev)
    accepted = torch.empty(bs, dtype=torch.int32, device=dev)
    bonus = torch.empty(bs, dtype=torch.int64, device=dev)
    row_lse = torch.empty(rows if lse else 0, dtype=torch.float32, device=dev)
    out = (tokens, accepted, bonus, row_lse) if lse else (tokens, accepted, bonus)
    if bs == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_v = min(_BLOCK_V, next_pow2(v))
    nsplit = min(_NSPLIT, next_pow2(triton.cdiv(v, block_v)))
    chunk = triton.cdiv(triton.cdiv(v, nsplit), block_v) * block_v
    part_val = torch.empty(rows, nsplit, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows, nsplit, dtype=torch.int64, device=dev)
    part_sum = torch.empty(rows, nsplit, dtype=torch.float32, device=dev) if lse else part_val
    _row_argmax_kernel[(rows, nsplit)](
        logits, part_val, part_idx, part_sum, v, chunk, logits.stride(0),
        NSPLIT=nsplit, BLOCK_V=block_v, LSE=lse, num_warps=4,
    )  # fmt: skip
    # gamma == 0: no draft is read (its tensor may be empty); pass any valid pointer
    draft_arg = draft if gamma > 0 else tokens
    _accept_kernel[(bs,)](
        part_val, part_idx, part_sum, draft_arg, tokens, accepted, bonus,
        row_lse if lse else part_val,
        draft.stride(0) if gamma > 0 else 0, draft.stride(1) if gamma > 0 else 0,
        W=w, WP=next_pow2(w), NSPLIT=nsplit, LSE=lse, num_warps=1,
    )  # fmt: skip
    return out


def _check_and_cover(logits: torch.Tensor, draft: torch.Tensor, *, lse: bool = False) -> bool:
    _check(logits, draft)
    return logits.dtype == torch.float32


greedy_verify_accept = kernel_op(
    "greedy_verify_accept",
    triton=greedy_verify_accept_triton,
    reference=greedy_verify_accept_reference,
    device_of="logits",
    check=_check_and_cover,
)
