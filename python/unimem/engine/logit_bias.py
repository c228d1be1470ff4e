"""Per-request logit adjustments: OpenAI's ``logit_bias`` and ``min_tokens`` (SGLang's
``min_new_tokens``).

A request's adjustments (``Request.logit_bias``, ``Request.min_tokens``): token ids with an
additive bias on their logits, and — while its output has fewer than ``min_tokens`` tokens —
its stop tokens (EOS and the caller's stop ids) suppressed (``-inf``). They apply on the device
to the logits rows a step picks from — an extend's last rows, a decode step's rows, a DSPARK
verify step's rows — before anything is picked (argmax, sampling, the chain's acceptance, which
stays exact: the target distribution it accepts against is the adjusted one). Reported
log-probabilities are those of the adjusted distribution, the one the token came from (before
temperature and filters).

Which rows: a row that produces the token at index ``i`` of prompt + output suppresses the
stops while ``i < len(prompt) + min_tokens`` — decided on the device from the step's own
positions, so it is exact whatever the host has read of the steps in flight.

A step with such a request runs eagerly (the recorded CUDA graphs carry no adjustments); a
request whose output has reached ``min_tokens`` (as the host has read it) and has no bias no
longer holds its batch there. The host packs a step's adjustments per lane
(:func:`plan`), uploads them in two non-blocking copies
(:meth:`~unimem.models.logit_adjustments.LaneAdjustments.upload`), and the steps call
:func:`~unimem.models.logit_adjustments.apply`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from unimem.engine.request import Request
from unimem.models.logit_adjustments import LaneAdjustments

__all__ = ["BIAS_LIMIT", "MAX_LOGIT_BIAS", "check_options", "needs_adjusting", "plan"]

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


def needs_adjusting(req: Request) -> bool:
    """Whether ``req``'s next step must adjust its logits: it has a bias, or its output (as
    read) is still short of ``min_tokens`` (a step in flight may have reached it: the device
    decides per row)."""
    return bool(req.logit_bias) or len(req.output) < req.min_tokens


def plan(reqs: Sequence[Request], width: int) -> LaneAdjustments | None:
    """The adjustments of a step whose first lanes are ``reqs`` (then padding up to
    ``width``), or None when no lane needs any (:func:`needs_adjusting`)."""
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
    return LaneAdjustments(bias_ids, bias_values, stop_ids, stop_values, stop_until)
