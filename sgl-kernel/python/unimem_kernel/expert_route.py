"""Grouping a routed-experts (MoE) layer's (token, slot) pairs by expert: a stable counting sort
in two or three small launches instead of a radix ``argsort`` plus the count, scan and index
passes.

Semantics (``moe_route_reference``, the torch code the MoE layer ran before): ``topk_ids
[T, k]`` holds each token's chosen experts in ``[0, E)``; pair ``p = t * k + j`` is token
``t``'s slot ``j``. With ``P = T * k`` and ``flat = topk_ids.reshape(-1)``:

- ``order [P]`` int64: ``argsort(flat, stable=True)`` — the pairs by expert, pairs of one
  expert in ascending pair id;
- ``inverse [P]`` int64: ``inverse[order[i]] = i``, the sorted row of each pair;
- ``token [P]`` int64: ``order // k``, the token of each sorted row;
- ``expert [P]`` int64: ``flat[order]``, the expert of each sorted row;
- ``ends [E]`` int32: the cumulative pair count per expert — expert ``e``'s rows are
  ``ends[e-1] .. ends[e]`` (the ``offs`` of ``torch._grouped_mm``).

All of them are integers, so the kernels and the reference agree exactly. The kernels:
``_count_kernel`` (one program per block of ``BLOCK`` pairs: the block's histogram over the
experts), ``_scan_kernel`` (one program: the expert totals, their running sum ``ends``, and for
every block and expert the first sorted row its pairs take, in place of the histogram),
``_place_kernel`` (one program per block: each pair's rank among the block's earlier pairs of
its expert, hence its sorted row; it writes all four permutation outputs). Where the
histogram table is small (``_PLACE_SCAN_ELEMENTS``: a decode or verify step over up to ~64
experts) the place kernel takes the scan's sums itself from the table and the scan kernel
does not run: two launches (the place kernel's extra sums cost less than the scan's launch
and its wait).

A pair's row depends only on the pairs before it, so the result is the stable order,
deterministic and independent of scheduling. Grids depend on shapes only and nothing is read
on the host: the route is captured in CUDA graphs. ``topk_ids`` must lie in ``[0, E)`` (a
router's ``topk`` does); the kernels do not check it on the device — the reference raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = ["ExpertRoute", "moe_route", "moe_route_reference", "moe_route_triton"]

_BLOCK = 128  # pairs per program of the count and place kernels ([BLOCK, BLOCK] rank compare)
# Fewer pairs than _BLOCK take one program of the next power of two of them (at least this
# many): a decode step's one token routed to 10 of 512 experts scans a [16, 512] table, not
# a [128, 512] one (the place kernel took 9.4 us a layer at one token on an H100 with 128).
_MIN_BLOCK = 16
_SCAN_ELEMENTS = 16384  # histogram entries the scan holds at once (rows x padded experts)
# Histogram entries (blocks x padded experts) up to which the place kernel scans the count
# kernel's table itself, saving the scan's launch: a decode or verify step (384 tokens x top 8
# of 64 experts: 24 x 64); a prefill chunk's table goes through the scan kernel.
_PLACE_SCAN_ELEMENTS = 4096


class ExpertRoute(NamedTuple):
    """The pairs of a MoE layer grouped by expert (module docstring); all on the ids' device."""

    order: torch.Tensor  # [P] int64: pair id of each sorted row
    inverse: torch.Tensor  # [P] int64: sorted row of each pair
    token: torch.Tensor  # [P] int64: token of each sorted row
    expert: torch.Tensor  # [P] int64: expert of each sorted row
    ends: torch.Tensor  # [E] int32: end row of each expert's group


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, hist_ptr, P, E, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < P
    # masked lanes read 0 and are excluded by the mask (the interpreter's histogram counts
    # masked lanes in bin 0 and subtracts them again: they must hold 0)
    ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
    hist = tl.histogram(ids, E_BLOCK, mask=m)
    cols = tl.arange(0, E_BLOCK)
    tl.store(hist_ptr + b.to(tl.int64) * E + cols, hist, mask=cols < E)


@triton.jit(do_not_specialize=["NB"])
def _scan_kernel(
    hist_ptr, ends_ptr, NB, E, ROWS: tl.constexpr, E_BLOCK: tl.constexpr
):  # fmt: skip
    """hist [NB, E] int32 -> (in place) first sorted row of block b's pairs of expert e."""
    cols = tl.arange(0, E_BLOCK)
    cm = cols < E
    rows = tl.arange(0, ROWS)
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    for r0 in range(0, NB, ROWS):
        r = r0 + rows
        ptrs = hist_ptr + r[:, None].to(tl.int64) * E + cols[None, :]
        h = tl.load(ptrs, mask=(r[:, None] < NB) & cm[None, :], other=0)
        total += tl.sum(h, axis=0)
    ends = tl.cumsum(total, axis=0)
    tl.store(ends_ptr + cols, ends, mask=cm)
    carry = ends - total  # first row of each expert's group
    for r0 in range(0, NB, ROWS):
        r = r0 + rows
        ptrs = hist_ptr + r[:, None].to(tl.int64) * E + cols[None, :]
        mask = (r[:, None] < NB) & cm[None, :]
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=mask)
        carry += tl.sum(h, axis=0)


@triton.jit(do_not_specialize=["P", "NB"])
def _place_kernel(
    ids_ptr, hist_ptr, order_ptr, inverse_ptr, token_ptr, expert_ptr, ends_ptr, P, E, NB,
    K: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr, E_BLOCK: tl.constexpr,
    NB_BLOCK: tl.constexpr,
):  # fmt: skip
    """Block ``b``'s pairs to their sorted rows. Without ``SCAN``, ``hist`` holds the scan's
    first sorted row of each (block, expert); with ``SCAN`` (``NB <= NB_BLOCK``), it holds the
    count kernel's histograms and this program takes the expert totals, their running sum and
    the counts of the earlier blocks itself (the whole ``[NB, E]`` table in one tile), and
    program 0 stores ``ends``: the scan's launch is saved."""
    b = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    p = b * BLOCK + lane
    m = p < P
    ids = tl.load(ids_ptr + p, mask=m, other=-1).to(tl.int32)
    # rank of pair i among the block's earlier pairs of its expert (the masked lanes are the
    # block's last ones: never earlier than a live pair)
    earlier = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    if SCAN:
        r = tl.arange(0, NB_BLOCK)
        cols = tl.arange(0, E_BLOCK)
        cm = cols < E
        h = tl.load(hist_ptr + r[:, None].to(tl.int64) * E + cols[None, :],
                    mask=(r[:, None] < NB) & cm[None, :], other=0)  # fmt: skip
        total = tl.sum(h, axis=0)
        ends = tl.cumsum(total, axis=0)
        if b == 0:
            tl.store(ends_ptr + cols, ends, mask=cm)
        first = ends - total + tl.sum(tl.where(r[:, None] < b, h, 0), axis=0)
        base = tl.sum(tl.where(ids[:, None] == cols[None, :], first[None, :], 0), axis=1)
    else:
        base = tl.load(hist_ptr + b.to(tl.int64) * E + ids, mask=m, other=0)
    row = (base + rank).to(tl.int64)
    p64 = p.to(tl.int64)
    tl.store(order_ptr + row, p64, mask=m)
    tl.store(token_ptr + row, p64 // K, mask=m)
    tl.store(expert_ptr + row, ids.to(tl.int64), mask=m)
    tl.store(inverse_ptr + p64, row, mask=m)


def _empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer (the kernels write every entry; tests poison it through this)."""
    return torch.empty(n, dtype=dtype, device=device)


def _check(topk_ids: torch.Tensor, num_experts: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")


def moe_route_reference(topk_ids: torch.Tensor, num_experts: int) -> ExpertRoute:
    """Group the pairs of ``topk_ids [T, k]`` by expert (module docstring); identical outputs on
    either side. The kernels allocate the five outputs and one ``[cdiv(P, B), E]`` int32
    scratch (``B`` pairs a program: 128, or fewer pairs' next power of two, at least 16);
    the reference raises on an expert id outside ``[0, E)`` (that check reads the ids on
    the host)."""
    _check(topk_ids, num_experts)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got "
                         f"[{int(flat.min())}, {int(flat.max())}]")  # fmt: skip
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(flat.numel(), device=flat.device)
    )
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    return ExpertRoute(order, inverse, order // max(k, 1), flat[order], ends)


def moe_route_triton(topk_ids: torch.Tensor, num_experts: int) -> ExpertRoute:
    """Triton launcher of :func:`moe_route` (arguments already checked): a count, an optional
    scan and a place launch."""
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    order, inverse, token, expert = (_empty(n, torch.int64, dev) for _ in range(4))
    ends = _empty(num_experts, torch.int32, dev)
    if n == 0:
        ends.zero_()
        return ExpertRoute(order, inverse, token, expert, ends)
    block = min(_BLOCK, max(_MIN_BLOCK, next_pow2(n)))
    nb = triton.cdiv(n, block)
    e_block = next_pow2(num_experts)
    hist = torch.empty(nb, num_experts, dtype=torch.int32, device=dev)
    _count_kernel[(nb,)](ids, hist, n, num_experts, BLOCK=block, E_BLOCK=e_block, num_warps=4)
    scan_in_place = next_pow2(nb) * e_block <= _PLACE_SCAN_ELEMENTS
    if not scan_in_place:
        rows = max(1, min(next_pow2(nb), _SCAN_ELEMENTS // e_block))
        _scan_kernel[(1,)](hist, ends, nb, num_experts, ROWS=rows, E_BLOCK=e_block, num_warps=4)
    _place_kernel[(nb,)](
        ids, hist, order, inverse, token, expert, ends, n, num_experts, nb, K=k, BLOCK=block,
        SCAN=scan_in_place, E_BLOCK=e_block, NB_BLOCK=next_pow2(nb) if scan_in_place else 1,
        num_warps=4,
    )  # fmt: skip
    return ExpertRoute(order, inverse, token, expert, ends)


moe_route = kernel_op(
    "moe_route",
    triton=moe_route_triton,
    reference=moe_route_reference,
    device_of="topk_ids",
    check=_check,
)
