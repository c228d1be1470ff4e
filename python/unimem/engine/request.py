"""A generation request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from unimem.engine.grammar import GrammarState
from unimem.engine.sampling import GREEDY, SamplingOptions
from unimem.memory.pool import RequestMemory
from unimem.models.forward_context import ForwardMode


@dataclass(frozen=True)
class InFlight:
    """A step launched for a request whose results the host has not read yet (the engine
    reads each step's results one step late: when the next batch is planned, at most one
    step per request is in flight; right after a launch, two).

    ``tokens``: tokens the step feeds; ``kv_min``/``kv_max``: bounds of what it adds to the
    request's ``kv_len`` (exact for extend and decode, ``1 .. gamma + 1`` for verify);
    ``outputs_min``: output tokens it appends at least (1 if it samples, else 0).
    ``snapshot``: a state slot holding a copy of the request's state taken right after the
    step (before any later step), when the step may end on a prefix-cache anchor; -1 if
    none."""

    mode: ForwardMode
    tokens: int
    kv_min: int
    kv_max: int
    outputs_min: int
    snapshot: int = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One request: ``prompt`` token ids, up to ``max_new_tokens`` output tokens picked by
    ``sampling`` (greedy by default) with the resolved int64 ``seed`` (the options' seed, or
    one the engine drew from its random seed and ``rid``).

    ``kv_len`` counts the leading tokens of ``tokens`` whose K/V and recurrent state are in
    memory. The next forward of the request consumes ``tokens[kv_len:]``; when that reaches
    the end, its last logits give the next output token. A retracted request keeps its output
    and recomputes from ``kv_len = 0`` when readmitted.

    With chain speculative decoding, ``verify_steps`` counts its verify steps and
    ``verified_tokens`` the tokens they committed (``accepted + 1`` each, counted before
    truncation at ``max_new_tokens``): their ratio is the request's accept length;
    ``verified_rows`` the rows those steps verified (``gamma + 1`` each with fixed lengths).

    ``cached_tokens``: tokens admissions skipped on prefix-cache hits (summed over
    readmissions after retraction).

    ``stop_token_ids``: output tokens that end the request (EOS and the caller's stop ids);
    the stop token is kept as the last output token and ``finish_reason`` becomes "stop"
    (else "length" once ``max_new_tokens`` are out). ``output_logprobs`` holds each output
    token's log-probability when the engine computes them. ``prompt_logprobs_from``: the
    first prompt position whose log-probability the request asks for (None: none);
    ``prompt_logprobs[j]`` then holds position ``j``'s (None before that position and at
    position 0) and, with ``prompt_top_logprobs_k`` > 0, ``prompt_top_logprobs[j]`` the most
    likely tokens there as ``(token id, log-probability)`` pairs
    (:mod:`unimem.engine.prompt_logprobs`). ``top_logprobs_k`` > 0: each output token's
    ``top_logprobs_k`` most likely tokens under the distribution it was picked from too, in
    ``output_top_logprobs`` (``(token id, log-probability)`` pairs, most likely first).
    ``penalties`` (presence, frequency, repetition), ``logit_bias`` (sorted ``(token id,
    bias)`` pairs) and ``min_tokens``: the logit adjustments of
    :mod:`unimem.engine.adjustments`. ``grammar``: the matcher of a request whose output must
    follow a grammar (:mod:`unimem.engine.grammar`; it reads each appended token, and the
    request stops when it terminates). ``error``: why the engine failed
    the request (an internal fault met it; ``finish_reason`` is then "abort"), else None.

    One step late: ``kv_len`` and ``output`` are what the host has *read*; launched steps not
    read yet are ``inflight`` (oldest first), and the ``planned_*`` properties bound where the
    request stands on the device once they are done. ``primed``: an extend of this run has
    set the request's row of the device state (length and next token), which decode and
    verify steps read. ``epoch`` counts retractions' restarts: a step's results carry the
    epoch it was launched in and are dropped if the request has restarted since.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    mem: RequestMemory | None = None
    kv_len: int = 0
    retractions: int = 0
    forward_steps: int = 0
    verify_steps: int = 0
    verified_tokens: int = 0
    verified_rows: int = 0
    cached_tokens: int = 0
    inflight: list[InFlight] = field(default_factory=list)
    epoch: int = 0
    primed: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    stopped: bool = False
    aborted: bool = False
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs_from: int | None = None
    prompt_top_logprobs_k: int = 0
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    top_logprobs_k: int = 0
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)
    grammar: GrammarState | None = None
    error: str | None = None
    sampling: SamplingOptions = GREEDY
    seed: int = 0

    @property
    def sampling_row(self) -> tuple[float, int, float, float, int]:
        """``(temperature, top_k, top_p, min_p, seed)`` as the device state holds them."""
        s = self.sampling
        return (float(s.temperature), int(s.top_k), float(s.top_p), float(s.min_p), self.seed)

    def append_output(
        self,
        tokens: list[int],
        logprobs: list[float] | None = None,
        tops: list[list[tuple[int, float]]] | None = None,
    ) -> None:
        """Append sampled ``tokens`` (with their ``logprobs`` and top log-probabilities
        ``tops``, cut to ``top_logprobs_k``), up to ``max_new_tokens`` and up to and including
        the first stop token; nothing once finished."""
        if self.aborted or self.stopped:
            return
        room = self.max_new_tokens - len(self.output)
        if room <= 0:
            return
        take = tokens[:room]
        stops = self.stop_token_ids
        if stops and not stops.isdisjoint(take):
            for j, tok in enumerate(take):
                if tok in stops:
                    take = take[: j + 1]
                    self.stopped = True
                    break
        if self.grammar is not None:
            take = self._follow_grammar(take)
        self.output.extend(take)
        if logprobs is not None:
            self.output_logprobs.extend(logprobs[: len(take)])
        if tops is not None and self.top_logprobs_k:
            k = self.top_logprobs_k
            self.output_top_logprobs.extend(t[:k] for t in tops[: len(take)])

    def append_token(
        self,
        token: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """:meth:`append_output` of one token (and its ``logprob`` and ``top``), without
        building lists: a decode step's accounting calls it for every request."""
        if self.aborted or self.stopped or len(self.output) >= self.max_new_tokens:
            return
        if self.grammar is not None and not self._follow_grammar([token]):
            return
        self.output.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None and self.top_logprobs_k:
            self.output_top_logprobs.append(top[: self.top_logprobs_k])
        if token in self.stop_token_ids:
            self.stopped = True

    def _follow_grammar(self, tokens: list[int]) -> list[int]:
        """The leading ``tokens`` the grammar accepts: up to the one it terminates on (the
        request stops), or up to one it refuses (an engine fault: the request ends with
        ``error``)."""
        n, ended = self.grammar.accept(tokens)
        if ended:
            self.stopped = True
        elif n < len(tokens):
            kind = self.grammar.spec.kind
            if self.grammar.stuck:
                self.error = f"no token of the model's vocabulary continues the {kind} here"
            else:
                self.error = f"internal error: token {tokens[n]} broke the request's {kind}"
            self.aborted = True
        return tokens[:n]

    @property
    def has_extras(self) -> bool:
        """Whether the request asks for anything a recorded step does not do: prompt or top
        log-probabilities, logit adjustments or a grammar."""
        return (
            self.grammar is not None
            or self.prompt_logprobs_from is not None
            or self.top_logprobs_k > 0
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.penalties != (0.0, 0.0, 1.0)
        )

    @property
    def finish_reason(self) -> str | None:
        """``"abort"`` (aborted), ``"stop"`` (a stop token), ``"length"``
        (``max_new_tokens``), or None while running."""
        if self.aborted:
            return "abort"
        if self.stopped:
            return "stop"
        return "length" if len(self.output) >= self.max_new_tokens else None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.aborted or self.stopped or len(self.output) >= self.max_new_tokens

    # --- where the request stands on the device (with a step in flight) -----------------------

    @property
    def planned_kv_max(self) -> int:
        """Upper bound of the tokens in memory once the in-flight steps are done."""
        inflight = self.inflight
        if not inflight:
            return self.kv_len
        if len(inflight) == 1:
            return self.kv_len + inflight[0].kv_max
        return self.kv_len + sum(f.kv_max for f in inflight)

    @property
    def planned_outputs(self) -> int:
        """Output tokens once the in-flight steps are done (exact unless a verify step is in
        flight: then a lower bound)."""
        inflight = self.inflight
        if not inflight:
            return len(self.output)
        if len(inflight) == 1:
            return len(self.output) + inflight[0].outputs_min
        return len(self.output) + sum(f.outputs_min for f in inflight)

    @property
    def planned_tokens(self) -> int:
        """Tokens the request has once the in-flight steps are done (a lower bound with a
        verify step in flight)."""
        return len(self.prompt) + self.planned_outputs

    @property
    def planned_has_output(self) -> bool:
        return self.planned_outputs > 0

    @property
    def verifying(self) -> bool:
        """Whether a verify step is in flight (the request is past its extends)."""
        inflight = self.inflight
        if len(inflight) == 1:
            return inflight[0].mode is ForwardMode.VERIFY
        return any(f.mode is ForwardMode.VERIFY for f in inflight)

    @property
    def planned_finished(self) -> bool:
        """Finished for sure once the in-flight steps are done (a verify step that may finish
        the request is not counted: it commits between 1 and ``gamma + 1`` tokens)."""
        return self.planned_outputs >= self.max_new_tokens
