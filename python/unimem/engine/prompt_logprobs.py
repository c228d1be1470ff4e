"""Log-probabilities of prompt tokens: SGLang's ``input_token_logprobs`` (``logprob_start_len``,
``top_logprobs_num``) and OpenAI's ``echo`` with ``logprobs`` — what lm-eval's log-likelihood
tasks read through a completions server.

A request asks for them from prompt position ``s`` (``Request.prompt_logprobs_from``, ``0 <= s
<= len(prompt)``): every prompt position ``j`` with ``max(s, 1) <= j < len(prompt)`` gets
``log p(prompt[j] | prompt[:j])`` under the model's raw distribution (before temperature and
sampling filters, as the output tokens' log-probabilities), and with ``top_k > 0``
(``Request.prompt_top_logprobs_k``) the ``top_k`` most likely tokens there with theirs, most
likely first. Position 0 has none: nothing precedes it. The token's own value and the top
list's come from the same float row, so a position whose token is the argmax has its
log-probability equal to the first top value, bit for bit (lm-eval's ``is_greedy`` compares
them).

Where they come from — the extend chunks that compute those rows:

- the scheduler never resumes such a request at a cached prefix past ``s - 1`` tokens (the row
  of position ``j - 1`` scores position ``j``), and the runner takes the ragged extend, not a
  padded graph;
- :func:`plan` lays the chunk's rows out: the forward returns the final-normed hidden state of
  every row of such a request (``ForwardContext.logits_indices``) but logits only for each
  lane's last row (``head_indices``), as without prompt log-probabilities;
- :func:`score_rows` runs the model's LM head (:meth:`~unimem.models.base.CausalLM.head_logits`)
  over the scored rows in pieces whose logits take at most :data:`PIECE_BYTES`, keeping per row
  the target's log-probability and the top ``k`` — a long prompt never holds its
  ``rows x vocab`` logits at once;
- :class:`StagedPromptLogprobs` carries the results to the host as a step's outputs go: a
  non-blocking copy into pinned memory behind an event, read when the engine accounts the
  step (one step late), and written into the requests whose run launched it (a result of a
  request retracted or finished since is dropped; a retracted request computes its rows
  again).

Every tensor-parallel rank runs the same pieces (the head's gather is a collective).

The limit on top tokens (:data:`MAX_TOP_LOGPROBS`) and its check for output positions
(:func:`check_top_logprobs`) live here too: one limit for prompt and output positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from unimem.engine.request import Request, RequestStatus
from unimem.engine.step_io import stage_to_host

__all__ = [
    "MAX_TOP_LOGPROBS",
    "PIECE_BYTES",
    "PromptRows",
    "StagedPromptLogprobs",
    "cache_match_limit",
    "check_options",
    "check_top_logprobs",
    "plan",
    "score_rows",
]

MAX_TOP_LOGPROBS = 20
"""Most top tokens a prompt or output position reports (OpenAI's chat limit)."""

PIECE_BYTES = 64 << 20
"""Most bytes of float32 logits one piece of :func:`score_rows` holds (64 rows of a
262 144-token vocabulary)."""


def check_options(prompt_len: int, start: int | None, top_k: int) -> None:
    """``ValueError`` naming the option when ``start`` (None: no prompt log-probabilities)
    is not in ``[0, prompt_len]`` or ``top_k`` not in ``[0, MAX_TOP_LOGPROBS]``, or
    ``top_k`` is given without ``start``."""
    for name, value in (("prompt_logprobs_from", start), ("prompt_top_logprobs", top_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"request rejected: {name} must be an int, got {value!r}")
    if start is None:
        if top_k:
            raise ValueError(
                "request rejected: prompt_top_logprobs needs prompt_logprobs_from "
                "(prompt log-probabilities)"
            )
        return
    if not 0 <= start <= prompt_len:
        raise ValueError(
            f"request rejected: prompt_logprobs_from {start} outside the prompt's "
            f"positions [0, {prompt_len}]"
        )
    if not 0 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"request rejected: prompt_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_k}"
        )


def check_top_logprobs(top_k: int, engine_logprobs: bool) -> None:
    """``ValueError`` naming the option when an output token's top count ``top_k`` is not an
    int in ``[0, MAX_TOP_LOGPROBS]``, or is asked of an engine that computes no
    log-probabilities."""
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"request rejected: top_logprobs must be an int, got {top_k!r}")
    if not 0 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"request rejected: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_k}"
        )
    if top_k and not engine_logprobs:
        raise ValueError("request rejected: top_logprobs needs an engine built with logprobs=True")


def cache_match_limit(req: Request) -> int | None:
    """How many leading tokens of ``req`` a prefix-cache admission may look up (it resumes
    at most one before that): None for any, ``max(s, 1)`` for a request scoring its prompt
    from position ``s`` — the row before position ``s`` must be computed."""
    s = req.prompt_logprobs_from
    return None if s is None else max(s, 1)


@dataclass(frozen=True)
class PromptRows:
    """One extend's layout for prompt log-probabilities (host lists, uploaded once).

    ``hidden_rows``: the batch rows whose final hidden states the forward returns (the
    context's ``logits_indices``): every row of a lane that scores its prompt, the last row
    of the others, lane by lane. ``head_rows``: each lane's last row as an index into
    ``hidden_rows`` (``head_indices``: the sampler's logits, lane order). ``picks``: the
    scored rows as indices into ``hidden_rows``, ``targets`` the prompt token each scores,
    ``owners`` its ``(lane, prompt position)``. ``top_k``: the most any lane asks for."""

    hidden_rows: list[int]
    head_rows: list[int]
    picks: list[int]
    targets: list[int]
    owners: list[tuple[int, int]]
    top_k: int


def plan(reqs: Sequence[Request], starts: Sequence[int], lens: Sequence[int]) -> PromptRows | None:
    """The layout of an extend whose lane ``i`` computes ``reqs[i].tokens[starts[i] :
    starts[i] + lens[i]]`` (rows request-major), or None when no lane scores a prompt
    position in this chunk (the forward then returns only the last rows)."""
    hidden, head, picks, targets, owners = [], [], [], [], []
    top_k = 0
    row0 = 0
    for lane, (r, s, n) in enumerate(zip(reqs, starts, lens, strict=True)):
        first = r.prompt_logprobs_from
        lo = hi = 0
        if first is not None:
            # row p scores prompt position p + 1
            lo, hi = max(s, first - 1, 0), min(s + n, len(r.prompt) - 1)
        if lo < hi:
            base = len(hidden)
            hidden.extend(range(row0, row0 + n))
            for p in range(lo, hi):
                picks.append(base + p - s)
                targets.append(r.prompt[p + 1])
                owners.append((lane, p + 1))
            top_k = max(top_k, r.prompt_top_logprobs_k)
        else:
            hidden.append(row0 + n - 1)
        head.append(len(hidden) - 1)
        row0 += n
    if not picks:
        return None
    return PromptRows(hidden, head, picks, targets, owners, top_k)


def score_rows(
    head_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    picks: torch.Tensor,
    targets: torch.Tensor,
    top_k: int,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows ``hidden[picks]`` (``hidden [N, d]`` final-normed, ``picks [n]`` int64,
    ``n >= 1``; ``targets [n]`` int64 token ids): ``values [n, 1 + top_k]`` in the logits'
    dtype — the target's log-probability, then the top ``k`` tokens' — and ``ids [n, top_k]``
    int64, most likely first. ``head_logits``: the model's LM head (``[m, d] -> [m, vocab]``),
    run over pieces of rows whose float32 logits fit :data:`PIECE_BYTES`. Device work only."""
    n = picks.shape[0]
    step = max(1, PIECE_BYTES // (4 * vocab))
    values = ids = None
    for start in range(0, n, step):
        rows = picks[start : start + step]
        end = start + rows.shape[0]
        logits = head_logits(hidden.index_select(0, rows))
        if values is None:
            values = torch.empty(n, 1 + top_k, dtype=logits.dtype, device=logits.device)
            ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        values[start:end, :1] = logits.gather(1, targets[start:end, None]) - lse
        if top_k:
            top, top_ids = torch.topk(logits, top_k, dim=-1)
            values[start:end, 1:] = top - lse
            ids[start:end] = top_ids
    if values is None:
        raise ValueError("score_rows needs at least one row")
    return values, ids


@dataclass
class StagedPromptLogprobs:
    """Host copies of one extend's prompt log-probabilities (:func:`score_rows`), valid once
    ``event`` completed (None: a CPU run, already valid); ``owners`` as in
    :class:`PromptRows`."""

    values: torch.Tensor
    ids: torch.Tensor
    owners: list[tuple[int, int]]
    event: torch.cuda.Event | None

    @classmethod
    def stage(
        cls, values: torch.Tensor, ids: torch.Tensor, owners: list[tuple[int, int]]
    ) -> StagedPromptLogprobs:
        """Copy the device results to pinned host memory without blocking, stream-ordered
        after the step, with an event behind the copies."""
        (host_v, host_i), event = stage_to_host(values, ids)
        return cls(host_v, host_i, owners, event)

    def apply(self, reqs: Sequence[Request], epochs: Sequence[int]) -> None:
        """Write the results into ``reqs`` (the batch's lanes; ``epochs`` theirs at launch),
        skipping requests that are no longer running in that epoch. Waits for the copies."""
        if self.event is not None:
            self.event.synchronize()
        values, ids = self.values.tolist(), self.ids.tolist()
        running = RequestStatus.RUNNING
        for (lane, pos), v, i in zip(self.owners, values, ids, strict=True):
            req = reqs[lane]
            if req.status is not running or req.epoch != epochs[lane]:
                continue
            req.prompt_logprobs[pos] = v[0]
            k = req.prompt_top_logprobs_k
            if k:
                req.prompt_top_logprobs[pos] = list(zip(i[:k], v[1 : 1 + k], strict=True))
