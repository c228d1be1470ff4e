"""Per-lane logit adjustments of a step — the device side of requests' penalties,
``logit_bias`` and ``min_tokens`` (:mod:`unimem.engine.adjustments` plans them). Pure tensor
work: the steps call :func:`apply` on the logits rows they pick from, before the pick.

In order, for a row of lane ``b`` producing the token at index ``i`` of its request's prompt +
output, after the tokens ``h`` before it (the lane's history — prompt and output so far, which
is the host's history plus what the step in flight committed for it, read on the device —
and, in a verify step, the drafts before the row):

1. penalties (SGLang's and vLLM's definitions): for every token ``t`` seen in ``h``, the
   repetition penalty ``r`` scales its logit (``/ r`` where positive, ``* r`` otherwise); then
   ``frequency * count(t) + presence * [count(t) > 0]`` is subtracted, counting ``t`` among
   the output tokens of ``h`` (prompt tokens count for the repetition penalty only);
2. ``logit_bias``: an additive bias on chosen tokens;
3. ``min_tokens``: the stop tokens at ``-inf`` while ``i < stop_until``;
4. a grammar (structured output, :mod:`unimem.engine.grammar`): every token the lane's
   grammar does not allow after ``h`` at ``-inf``.

Penalties are computed sparsely over the history's distinct tokens as the host has read it
(``hist_*``, padded per lane), plus the step in flight's committed tokens for the lane (read
from its outputs on the device: the host need not wait for that step to plan this one) and,
in a verify step, the drafts before each row — never a vocabulary-sized count per row.
Several entries of a row may name one token (a draft repeating a history token, padding, an
in-flight entry past the lane's count): each computes that token's value from the same
counts, so the scatter writes one value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

__all__ = ["LaneAdjustments", "apply"]


@dataclass(frozen=True)
class LaneAdjustments:
    """One step's adjustments, lane by lane (``W`` lanes; padding lanes adjust nothing):
    ``bias_ids / bias_values [W, M]`` (int64 / float32; padding entries bias token 0 by 0),
    ``stop_ids / stop_values [W, S]`` (the stop tokens and ``-inf``; padding 0 and 0),
    ``stop_until [W]`` int64 (a row producing token index ``i`` suppresses its lane's stops
    while ``i < stop_until``; 0: never). Penalties (None when no lane has any):
    ``penalties [W, 3]`` float32 (presence, frequency, repetition; neutral 0, 0, 1),
    ``hist_ids [W, U]`` int64 (the distinct tokens of the lane's prompt and output; padding
    repeats the lane's first entry), ``hist_counts [W, U]`` float32 (each one's count among
    the output tokens of ``h``; padding repeats it too), ``in_flight_lanes [W]`` int64 (the
    lane's row in the outputs of the step still in flight, whose committed tokens the host
    has not read into ``hist_*``; -1: none) and, set by the step after :meth:`upload`,
    ``in_flight_outputs`` (that step's ``(tokens [B, P], counts [B])`` on the device, read
    before this step writes its own; None: nothing in flight). ``grammar`` (None when no lane
    has one):
    called once by the step with its drafts ``[W, g]`` (a verify step) or None and the
    logits' device, it returns ``(slots [W] int64, masks [G, C, words] int32)`` there: bit
    ``t % 32`` of word ``t // 32`` of ``masks[slots[b], j]`` allows token ``t`` in lane
    ``b``'s rows of column ``j`` (``slots[b]`` -1: the lane is unconstrained; ``C`` is ``g +
    1`` in a verify step, else 1); it may wait for the drafts
    (:class:`unimem.engine.grammar.StepMasks`). Host tensors from
    :func:`unimem.engine.adjustments.plan`, device ones from :meth:`upload`."""

    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    stop_ids: torch.Tensor
    stop_values: torch.Tensor
    stop_until: torch.Tensor
    penalties: torch.Tensor | None = None
    hist_ids: torch.Tensor | None = None
    hist_counts: torch.Tensor | None = None
    in_flight_lanes: torch.Tensor | None = None
    in_flight_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
    grammar: (
        Callable[[torch.Tensor | None, torch.device], tuple[torch.Tensor, torch.Tensor]] | None
    ) = None

    def upload(self, device: torch.device) -> LaneAdjustments:
        """Device copies in two non-blocking copies (from pinned memory on CUDA)."""
        int_parts = [self.bias_ids, self.stop_ids, self.stop_until[:, None]]
        float_parts = [self.bias_values, self.stop_values]
        if self.penalties is not None:
            in_flight = self.in_flight_lanes
            if in_flight is None:  # nothing in flight
                in_flight = torch.full_like(self.stop_until, -1)
            int_parts += [in_flight[:, None], self.hist_ids]
            float_parts += [self.penalties, self.hist_counts]
        ints, floats = torch.cat(int_parts, dim=1), torch.cat(float_parts, dim=1)
        if device.type == "cuda":
            ints = ints.pin_memory().to(device, non_blocking=True)
            floats = floats.pin_memory().to(device, non_blocking=True)
        else:
            ints, floats = ints.to(device), floats.to(device)
        m, s = self.bias_ids.shape[1], self.stop_ids.shape[1]
        out = LaneAdjustments(
            ints[:, :m],
            floats[:, :m],
            ints[:, m : m + s],
            floats[:, m : m + s],
            ints[:, m + s],
            grammar=self.grammar,
        )
        if self.penalties is None:
            return out
        f = m + s
        return replace(
            out,
            penalties=floats[:, f : f + 3],
            in_flight_lanes=ints[:, m + s + 1],
            hist_ids=ints[:, m + s + 2 :],
            hist_counts=floats[:, f + 3 :],
        )


def apply(
    logits: torch.Tensor,
    lanes: torch.Tensor,
    produced: torch.Tensor,
    adj: LaneAdjustments,
    drafts: torch.Tensor | None = None,
    columns: torch.Tensor | None = None,
) -> None:
    """Adjust ``logits [R, V]`` in place (module docstring): row ``r`` belongs to lane
    ``lanes[r]`` and produces the token at index ``produced[r]`` of its request's prompt +
    output (both ``[R]`` int64). A verify step's rows also pass the lanes' drafts ``drafts
    [W, g]`` and each row's column ``columns[R]`` (the drafts ``[:column]`` precede it).
    Tensors on ``logits``' device. Device work only, but for a grammar (``adj.grammar``):
    its masks come from the host, and the constrained rows are found on the host."""
    lanes = lanes.long()
    if adj.penalties is not None:
        _penalize(logits, lanes, adj, drafts, columns)
    logits.scatter_add_(1, adj.bias_ids[lanes], adj.bias_values[lanes].to(logits.dtype))
    suppress = produced.long() < adj.stop_until[lanes]
    values = torch.where(suppress[:, None], adj.stop_values[lanes], 0.0)
    logits.scatter_add_(1, adj.stop_ids[lanes], values.to(logits.dtype))
    if adj.grammar is not None:
        slots, masks = adj.grammar(drafts, logits.device)
        cols = torch.zeros_like(lanes) if columns is None else columns.long()
        mask_rows(logits, slots[lanes], cols, masks)


MASK_CHUNK_ROWS = 64
"""Rows unpacked at once by :func:`mask_rows` (bounds its temporaries to ``64 x vocab``)."""


def mask_rows(
    logits: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor, masks: torch.Tensor
) -> None:
    """Set to ``-inf`` the logits of every token that ``masks[slots[r], columns[r]]`` (packed
    bits, :class:`LaneAdjustments`' ``grammar``) does not allow, in the rows ``r`` of
    ``logits [R, V]`` with ``slots[r] >= 0``, in place. Finds those rows on the host (one
    sync)."""
    rows = torch.nonzero(slots >= 0).reshape(-1)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    for start in range(0, rows.numel(), MASK_CHUNK_ROWS):
        r = rows[start : start + MASK_CHUNK_ROWS]
        bits = masks[slots[r], columns[r]]  # [n, words]
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(r.numel(), -1)[:, :vocab]
        logits[r] = logits[r].masked_fill(~allowed, float("-inf"))


def _penalize(
    logits: torch.Tensor,
    lanes: torch.Tensor,
    adj: LaneAdjustments,
    drafts: torch.Tensor | None,
    columns: torch.Tensor | None,
) -> None:
    ids = adj.hist_ids[lanes]  # [R, U]
    counts = adj.hist_counts[lanes]
    seen = torch.ones_like(counts, dtype=torch.bool)
    # output tokens the host's history lacks, each entry with whether it precedes the row:
    # the step in flight's committed tokens (all of them precede every row of the lane),
    # then a verify step's drafts (those before the row's column)
    extra, precedes = [], []
    if adj.in_flight_outputs is not None and adj.in_flight_lanes is not None:
        tokens, n = adj.in_flight_outputs
        lane_rows = adj.in_flight_lanes[lanes]  # [R]
        src = lane_rows.clamp(min=0)
        p = torch.arange(tokens.shape[1], device=tokens.device)
        extra.append(tokens[src].long())
        precedes.append((p[None, :] < n[src].long()[:, None]) & (lane_rows >= 0)[:, None])
    if drafts is not None:
        g = drafts.shape[1]
        extra.append(drafts.long()[lanes])  # [R, g]
        precedes.append(torch.arange(g, device=drafts.device)[None, :] < columns.long()[:, None])
    if extra:
        d = torch.cat(extra, dim=1)
        before = torch.cat(precedes, dim=1)
        # the tokens before a row are output tokens too
        counts = counts + ((ids[:, :, None] == d[:, None, :]) & before[:, None, :]).sum(-1)
        in_hist = d[:, :, None] == ids[:, None, :]  # [R, extra, U]
        d_counts = (in_hist * adj.hist_counts[lanes][:, None, :]).amax(-1)
        d_counts = d_counts + ((d[:, :, None] == d[:, None, :]) & before[:, None, :]).sum(-1)
        d_seen = in_hist.any(-1) | (d_counts > 0)
        ids = torch.cat([ids, d], dim=1)
        counts = torch.cat([counts, d_counts.to(counts.dtype)], dim=1)
        seen = torch.cat([seen, d_seen], dim=1)
    pen = adj.penalties[lanes].to(logits.dtype)  # [R, 3]
    x = logits.gather(1, ids)
    rep = pen[:, 2:3]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    c = counts.to(logits.dtype)
    x = x - pen[:, 1:2] * c - pen[:, 0:1] * (c > 0).to(logits.dtype)
    logits.scatter_(1, ids, x)
