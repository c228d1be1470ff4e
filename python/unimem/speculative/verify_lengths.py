"""Per-request verify lengths under a step budget, and the packed ("compact") row layout.

A verify step with adaptive lengths verifies ``L_b`` rows for lane ``b`` (``1 <= L_b <=
gamma + 1``: the anchor and the first ``L_b - 1`` drafts) instead of ``gamma + 1`` for every
lane, the rows of all lanes packed back to back.

**Choosing lengths** (:func:`allocate_lengths`). The drafter's confidence head gives
``s_i``, the probability that draft ``i`` is accepted given that every earlier one was; the
cumulative survival ``S_k = s_0 ... s_{k-1}`` is the probability that the first ``k`` drafts
are all accepted. Verifying ``L`` rows commits ``1 + sum_{k=1..L-1} [first k accepted]``
tokens, so its expected value is ``1 + S_1 + ... + S_{L-1}``: growing a lane from ``k`` to
``k + 1`` rows gains ``S_k`` expected tokens. With ``R`` packed rows for ``W`` lanes (one row
per lane is mandatory), the allocation gives the ``R - W`` extra rows to the largest gains
over all lanes and depths. Since ``S_k`` does not increase with ``k``, taking the largest
gains greedily is optimal (the exchange argument of a concave knapsack with unit weights),
and the chosen set is a prefix per lane when ties are broken by depth (a stable sort over
``(lane, depth)``-ordered gains). Padded lanes gain ``-1``: they keep their one row and never
take budget from a live lane.

**Packed layout** (:func:`packed_layout`): lane ``b``'s rows at ``cu[b] .. cu[b] + L_b - 1``,
``cu`` the exclusive prefix sum; rows ``cu[W] .. R - 1`` are padding (no lane). For each packed
row: its lane, its offset in the lane's window, whether it is live, and its index in the
uniform ``[W, gamma + 1]`` layout (the GDN scratch and accept layout; padding rows map to a
dump index ``W * (gamma + 1)``).

All fixed-shape torch on device tensors with host ints for the shapes: no host read, so the
whole thing is recorded in the verify step's CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "PackedRows",
    "allocate_lengths",
    "expected_tokens",
    "packed_layout",
    "packed_rows",
]


def packed_rows(width: int, verify_width: int, budget: int | None) -> int:
    """Packed rows of a verify step of ``width`` lanes (a graph bucket): ``budget`` clamped to
    ``[width, width * verify_width]`` (one row per lane at least, the fixed width at most);
    ``budget`` None: ``width * verify_width`` (no cut)."""
    full = width * verify_width
    if budget is None:
        return full
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"verify budget must be None or an int >= 1, got {budget!r}")
    return max(width, min(budget, full))


def allocate_lengths(survival: torch.Tensor, live: torch.Tensor, rows: int) -> torch.Tensor:
    """Verify lengths ``[W]`` int32 in ``1 .. gamma + 1`` maximising the expected committed
    tokens under ``rows`` packed rows (module docstring).

    ``survival [W, gamma]``: per lane and draft, the conditional survival ``s_i`` (any float
    dtype, values in ``[0, 1]``); ``live [W]`` bool: padded lanes (False) get length 1;
    ``rows``: host int, ``W <= rows <= W * (gamma + 1)``. Exactly ``rows`` rows are used
    when enough live lanes exist (``sum(L) = min(rows, W + live * gamma)``)."""
    w, gamma = survival.shape
    if not w <= rows <= w * (gamma + 1):
        raise ValueError(f"rows must be in [{w}, {w * (gamma + 1)}], got {rows}")
    extra = rows - w
    if extra == 0 or gamma == 0:
        return torch.ones(w, dtype=torch.int32, device=survival.device)
    gains = torch.cumprod(survival.double().clamp(0.0, 1.0), dim=1)  # S_1 .. S_gamma
    gains = torch.where(live[:, None], gains, -1.0).reshape(-1)
    # descending, ties in (lane, depth) order: a lane's deeper gain never precedes a shallower
    # equal one, so the chosen set is a prefix of every lane
    order = torch.sort(gains, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    chosen = (rank < extra) & (gains >= 0)
    return (1 + chosen.reshape(w, gamma).sum(dim=1)).to(torch.int32)


def expected_tokens(survival: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[W]`` float64: expected committed tokens ``1 + S_1 + .. + S_{L-1}`` of each lane
    verifying ``lengths [W]`` rows under the survivals ``[W, gamma]``."""
    gains = torch.cumprod(survival.double().clamp(0.0, 1.0), dim=1)
    depth = torch.arange(1, survival.shape[1] + 1, device=survival.device)
    taken = depth[None, :] < lengths.long()[:, None]
    return 1.0 + (gains * taken).sum(dim=1)


class PackedRows(NamedTuple):
    """The packed layout of one step (module docstring); ``[R]`` tensors per packed row and
    ``cu_seqlens [W + 1]`` int32."""

    cu_seqlens: torch.Tensor
    lane: torch.Tensor  # int64, clamped to W - 1 on padding rows
    offset: torch.Tensor  # int64, 0 on padding rows
    valid: torch.Tensor  # bool
    uniform_index: torch.Tensor  # int64: lane * (gamma + 1) + offset, W * (gamma + 1) if padding


def packed_layout(lengths: torch.Tensor, rows: int, verify_width: int) -> PackedRows:
    """The packed rows of ``lengths [W]`` (int32, ``sum <= rows``) over ``rows`` rows
    (host int) for a uniform width ``verify_width`` (``gamma + 1``)."""
    w = lengths.shape[0]
    dev = lengths.device
    cu = torch.zeros(w + 1, dtype=torch.int32, device=dev)
    torch.cumsum(lengths, dim=0, dtype=torch.int32, out=cu[1:])
    t = torch.arange(rows, device=dev)
    lane = torch.searchsorted(cu[1:].long(), t, right=True)
    valid = lane < w
    lane = lane.clamp(max=w - 1)
    offset = torch.where(valid, t - cu.long()[lane], 0)
    dump = w * verify_width
    uniform = torch.where(valid, lane * verify_width + offset, dump)
    return PackedRows(cu, lane, offset, valid, uniform)
