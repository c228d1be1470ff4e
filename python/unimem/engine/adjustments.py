"""Per-request logit adjustments: penalties (``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``), OpenAI's ``logit_bias``, ``min_tokens`` (SGLang's
``min_new_tokens``) and a grammar's masks (structured output, :mod:`unimem.engine.grammar`).

A request's adjustments (``Request.penalties``, ``Request.logit_bias``,
``Request.min_tokens``) apply on the device to the logits rows a step picks from — an
extend's last rows, a decode step's rows, a DSPARK verify step's rows — before anything is
picked (argmax, sampling, the chain's acceptance, which stays exact: the target distribution it
accepts against is the adjusted one), in the order and with the definitions of
:mod:`unimem.models.logit_adjustments`. Reported log-probabilities are those of the adjusted
distribution, the one the token came from (before temperature and filters).

``min_tokens`` is decided on the device from each row's position (a row producing the token
at index ``i`` of prompt + output suppresses the stops while ``i < len(prompt) +
min_tokens``), so it is exact whatever the host has read of the steps in flight. Penalties
need the whole history, which the device completes: the host packs the output it has read,
and the step adds, on the device, what the step still in flight committed for the lane (its
outputs, read before this step writes its own; :func:`plan`'s ``in_flight``) and, in a
verify step, the drafts before each row — so a penalised batch keeps the overlap of the host
with the device. A grammar cannot: its matcher, on the host, must have read the whole output,
so the engine reads the step in flight before it plans a batch with a constrained request
(:func:`needs_exact_history`), and its verify steps read their drafts back to walk them
(:class:`~unimem.engine.grammar.StepMasks`).

A step with such a request replays only the recorded forward half of its step and applies
the adjustments eagerly after it (:meth:`unimem.engine.runner.ModelRunner.finish_half`; the
recorded whole steps carry none); a request whose output has reached ``min_tokens`` (as the
host has read it) with no bias or penalty no longer holds its batch there. The host packs a
step's adjustments per lane (:func:`plan`), uploads them in two non-blocking copies
(:meth:`~unimem.models.logit_adjustments.LaneAdjustments.upload`), and the steps call
:func:`~unimem.models.logit_adjustments.apply`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from unimem.engine.batch import Batch
from unimem.engine.grammar import StepMasks
from unimem.engine.request import Request
from unimem.models.forward_context import ForwardMode
from unimem.models.logit_adjustments import LaneAdjustments

__all__ = [
    "BIAS_LIMIT",
    "MAX_LOGIT_BIAS",
    "NEUTRAL_PENALTIES",
    "check_options",
    "check_penalties",
    "needs_adjusting",
    "needs_exact_history",
    "plan",
]

MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries a request may carry (OpenAI's limit)."""

BIAS_LIMIT = 100.0
"""A bias lies in ``[-BIAS_LIMIT, BIAS_LIMIT]`` (OpenAI's range)."""


def check_options(
    logit_bias: Mapping[int, float] | None, min_tokens: int, max_new_tokens: int, vocab: int
) -> tuple[tuple[int, float], ...]:
    """The request's bias as sorted ``(token id, bias)`` pairs; ``ValueError`` naming the
    option for a token outside ``[0, vocab)``, a bias outside ``[-100, 100]`` or not a finite
    number, more than :data:`MAX_LOGIT_BIAS` entries, or ``min_tokens`` outside ``[0,
    max_new_tokens]``."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
        raise ValueError(f"request rejected: min_tokens must be an int, got {min_tokens!r}")
    if not 0 <= min_tokens <= max_new_tokens:
        raise ValueError(
            f"request rejected: min_tokens {min_tokens} outside [0, max_new_tokens "
            f"{max_new_tokens}]"
        )
    if not logit_bias:
        return ()
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"request rejected: logit_bias has {len(logit_bias)} entries (at most {MAX_LOGIT_BIAS})"
        )
    pairs = []
    for tok, bias in logit_bias.items():
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise ValueError(
                f"request rejected: logit_bias token {tok!r} outside the vocabulary [0, {vocab})"
            )
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not ok or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise ValueError(
                f"request rejected: logit_bias of token {tok} must be a number in "
                f"[-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bias!r}"
            )
        pairs.append((tok, float(bias)))
    return tuple(sorted(pairs))


NEUTRAL_PENALTIES = (0.0, 0.0, 1.0)
"""``(presence, frequency, repetition)`` that change nothing."""


def check_penalties(presence: float, frequency: float, repetition: float) -> tuple:
    """``(presence, frequency, repetition)`` as floats; ``ValueError`` naming the penalty
    outside its range: presence and frequency in ``[-2, 2]`` (OpenAI's), repetition in
    ``(0, 2]`` (SGLang's)."""
    out = []
    for name, value, lo, hi, lo_open in (
        ("presence_penalty", presence, -2.0, 2.0, False),
        ("frequency_penalty", frequency, -2.0, 2.0, False),
        ("repetition_penalty", repetition, 0.0, 2.0, True),
    ):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not (lo < value if lo_open else lo <= value) or not value <= hi:
            span = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
            raise ValueError(f"request rejected: {name} must be in {span}, got {value!r}")
        out.append(float(value))
    return tuple(out)


def needs_exact_history(req: Request) -> bool:
    """Whether planning ``req``'s next step needs its whole output read on the host: a
    grammar (penalties complete theirs on the device, :func:`plan`)."""
    return req.grammar is not None


def needs_adjusting(req: Request) -> bool:
    """Whether ``req``'s next step must adjust its logits: it has penalties, a bias or a
    grammar, or its output (as read) is still short of ``min_tokens`` (a step in flight may
    have reached it: the device decides per row)."""
    return (
        req.grammar is not None
        or bool(req.logit_bias)
        or len(req.output) < req.min_tokens
        or req.penalties != NEUTRAL_PENALTIES
    )


def _history(r: Request) -> tuple[list[int], list[float]]:
    """The distinct tokens of ``r``'s prompt and output, and each one's count in the output."""
    out = np.asarray(r.output, dtype=np.int64)
    ids = np.union1d(np.asarray(r.prompt, dtype=np.int64), out)
    counts = np.zeros(len(ids), dtype=np.float32)
    if len(out):
        np.add.at(counts, np.searchsorted(ids, out), 1.0)
    return ids.tolist(), counts.tolist()


def plan(
    reqs: Sequence[Request], width: int, in_flight: Batch | None = None
) -> LaneAdjustments | None:
    """The adjustments of a step whose first lanes are ``reqs`` (then padding up to
    ``width``), or None when no lane needs any (:func:`needs_adjusting`). ``in_flight``:
    the step launched before this one whose results the host has not read (None: every step
    read); a penalised decode or verify lane whose request it holds, in the same epoch, gets
    that step's lane as ``in_flight_lanes`` (the device adds what it committed to the
    history)."""
    if not any(needs_adjusting(r) for r in reqs):
        return None
    m = max(1, max(len(r.logit_bias) for r in reqs))
    suppressing = [r for r in reqs if r.min_tokens]
    s = max([1] + [len(r.stop_token_ids) for r in suppressing])
    bias_ids = torch.zeros(width, m, dtype=torch.int64)
    bias_values = torch.zeros(width, m, dtype=torch.float32)
    stop_ids = torch.zeros(width, s, dtype=torch.int64)
    stop_values = torch.zeros(width, s, dtype=torch.float32)
    stop_until = torch.zeros(width, dtype=torch.int64)
    penalised = [lane for lane, r in enumerate(reqs) if r.penalties != NEUTRAL_PENALTIES]
    penalties = hist_ids = hist_counts = in_flight_lanes = None
    if penalised:
        in_flight_lanes = torch.full((width,), -1, dtype=torch.int64)
        if in_flight is not None:
            held = _in_flight_lanes(in_flight)
            for lane in penalised:
                in_flight_lanes[lane] = held.get((reqs[lane].rid, reqs[lane].epoch), -1)
        histories = {lane: _history(reqs[lane]) for lane in penalised}
        u = max(len(ids) for ids, _ in histories.values())
        penalties = torch.tensor([NEUTRAL_PENALTIES] * width, dtype=torch.float32)
        hist_ids = torch.zeros(width, u, dtype=torch.int64)
        hist_counts = torch.zeros(width, u, dtype=torch.float32)
        for lane, (ids, counts) in histories.items():
            penalties[lane] = torch.tensor(reqs[lane].penalties)
            # padding repeats the first entry: the same token, the same value (module
            # docstring of unimem.models.logit_adjustments)
            hist_ids[lane] = ids[0]
            hist_counts[lane] = counts[0]
            hist_ids[lane, : len(ids)] = torch.tensor(ids)
            hist_counts[lane, : len(ids)] = torch.tensor(counts)
    for lane, r in enumerate(reqs):
        if r.logit_bias:
            ids, values = zip(*r.logit_bias, strict=True)
            bias_ids[lane, : len(ids)] = torch.tensor(ids)
            bias_values[lane, : len(ids)] = torch.tensor(values)
        if r.min_tokens and r.stop_token_ids:
            stops = sorted(r.stop_token_ids)
            stop_ids[lane, : len(stops)] = torch.tensor(stops)
            stop_values[lane, : len(stops)] = float("-inf")
            stop_until[lane] = len(r.prompt) + r.min_tokens
    grammar = None
    states = [r.grammar for r in reqs]
    if any(st is not None for st in states):
        words = next(st.words for st in states if st is not None)
        grammar = StepMasks(states + [None] * (width - len(reqs)), words)
    return LaneAdjustments(
        bias_ids,
        bias_values,
        stop_ids,
        stop_values,
        stop_until,
        penalties,
        hist_ids,
        hist_counts,
        in_flight_lanes,
        grammar=grammar,
    )


def _in_flight_lanes(batch: Batch) -> dict[tuple[int, int], int]:
    """``(rid, epoch) -> lane`` of the lanes of ``batch`` (launched, results unread) that
    committed output tokens: every lane of a decode or verify step, an extend's sampling
    lanes."""
    extend = batch.mode is ForwardMode.EXTEND
    return {
        (r.rid, epoch): lane
        for lane, (r, epoch) in enumerate(zip(batch.reqs, batch.epochs, strict=True))
        if not extend or batch.samples[lane]
    }
