"""One generation request as the HTTP side runs it: checked, submitted to the engine thread,
and read back as text pieces.

:class:`Serving` holds what every route needs (the engine, its thread, the tokenizer, the
server options) and checks a request before anything is queued (:meth:`Serving.prepare`:
every problem is an :class:`~unimem.serve.protocol.ApiError` 400 naming the field).
:meth:`Serving.sampling_options` is the one place a request's sampling parameters become
:class:`~unimem.engine.sampling.SamplingOptions`.

:class:`Generation` submits one request and yields :class:`Piece` objects: new text (from
:class:`~unimem.serve.detokenize.IncrementalDetokenizer`, never a split character), the
tokens and log-probabilities behind it, and on the last piece the finish reason. A stop
string ends the request through ``EngineCore.abort`` (its memory comes back) and is reported
as ``"stop"`` with the text cut right before it. A matched stop token (EOS included) ends the
output ids but not the text (SGLang trims it). A client that disconnects — noticed by polling
``request.is_disconnected()`` while the request runs, or by the stream's cancellation —
aborts the request.

A request whose reader falls behind the engine (many streams on one event loop) reads every
delta that has queued up as one (:func:`next_delta`): one piece, one detokenizer pass and one
streamed chunk for all of them, so that the HTTP side's work per token shrinks as its load
grows instead of its queues; a reader that keeps up still gets each delta as it comes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from unimem.engine.adjustments import check_options as check_adjustments
from unimem.engine.adjustments import check_penalties
from unimem.engine.grammar import GrammarSpec
from unimem.engine.prompt_logprobs import MAX_TOP_LOGPROBS
from unimem.engine.sampling import SamplingOptions
from unimem.serve.args import ServerOptions
from unimem.serve.detokenize import IncrementalDetokenizer, StopMatcher
from unimem.serve.engine_loop import Delta, EngineLoop, PromptScores, Submission
from unimem.serve.errors import ApiError

__all__ = ["GenParams", "Generation", "Piece", "Serving", "next_delta"]

DISCONNECT_POLL_S = 0.5
"""How often a request waiting for tokens checks whether its client is still there."""

ABORT_WAIT_S = 5.0
"""Longest a stop-string response waits for the engine to end (and count) its request."""

WHOLE_RESPONSE_INTERVAL = 50
"""Tokens a request answered in one body (not streamed) and without stop strings waits for
between deltas (SGLang's scheduler sends such requests' output every 50 tokens,
``DEFAULT_FORCE_STREAM_INTERVAL``): nobody reads them before the end, and each delta costs the
HTTP side a wake-up and a detokenizer pass; the first still goes out at once (time to first
token)."""

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's and SGLang's default temperature when a request gives none."""

DRAIN_POLL_S = 0.05
"""How often a draining server checks whether its requests are done."""

RETRY_AFTER_S = 5
"""The ``Retry-After`` (seconds) of a 503 while the server shuts down."""


SAMPLED_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")
"""The sampling parameters a checkpoint's generation config may set for requests silent on
them."""


@dataclass
class GenParams:
    """A request's generation parameters, named as SGLang names them. ``max_new_tokens``
    None: up to the end of the context. ``top_logprobs``: how many of the most likely
    tokens (raw distribution) each output position — and each scored prompt position —
    reports, 0 to :data:`~unimem.engine.prompt_logprobs.MAX_TOP_LOGPROBS`.
    ``prompt_logprobs_from``: score the prompt from that position (None: not at all;
    :mod:`unimem.engine.prompt_logprobs`), spelled ``prompt_logprobs_field`` in the
    request. The penalties, ``logit_bias`` / ``min_tokens``: :mod:`unimem.engine.adjustments`
    (``min_tokens`` spelled ``min_tokens_field``). ``grammar``: the output must follow it
    (structured output, :mod:`unimem.serve.structured`), set by the request's field
    ``grammar_field``."""

    max_new_tokens: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    no_stop_trim: bool = False  # keep the matched stop string / stop token's text
    skip_special_tokens: bool = True
    prompt_logprobs_from: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens_field: str = "max_tokens"  # how the request spelled it (errors name it)
    top_logprobs_field: str = "top_logprobs"
    prompt_logprobs_field: str = "logprob_start_len"
    min_tokens_field: str = "min_tokens"
    grammar: GrammarSpec | None = None
    grammar_field: str = "response_format"

    @classmethod
    def with_defaults(cls, defaults: Mapping, **fields) -> GenParams:
        """Parameters starting from the checkpoint's sampling defaults (``temperature``,
        ``top_p``, ``top_k``, ``min_p`` of its ``generation_config.json``, as
        :attr:`unimem.Engine.sampling_defaults` holds them), as SGLang does; the request's
        own values are set on the result afterwards and win."""
        known = {k: v for k, v in defaults.items() if k in SAMPLED_DEFAULT_KEYS and v is not None}
        return cls(**known, **fields)


@dataclass
class Piece:
    """New output of a request: ``text`` (may be empty), ``token_ids`` and ``logprobs``
    behind it; ``finish_reason`` ("stop", "length", "abort") and ``matched`` (the stop token
    id or stop string, if any) on the last piece; ``prompt``: the prompt's log-probabilities
    on the first piece with tokens of a request that asked for them; ``top_logprobs``: each
    token's most likely tokens (``(id, log-probability)`` pairs) where asked for."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    prompt: PromptScores | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


class Serving:
    """The HTTP side's view of the server (module docstring)."""

    def __init__(self, engine, loop: EngineLoop, options: ServerOptions) -> None:
        self.engine = engine
        self.loop = loop
        self.options = options
        self.tokenizer = engine.tokenizer
        self.core = engine.core
        self.vocab_size = engine.model.config.vocab_size
        # What the server really accepts (max_model_len): the model's context, or less when
        # one request of that length could not be held by the memory even alone.
        self.memory_limit = self.core.max_request_tokens()
        self.context_length = min(engine.context_length, self.memory_limit)
        self.eos_token_ids = frozenset(engine.eos_token_ids)
        self.started = time.time()
        self.draining = False  # SIGTERM: new requests get 503, running ones finish

    def shutting_down_error(self) -> ApiError:
        return ApiError(
            503,
            "the server is shutting down; retry on another replica or later",
            code="shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    # ------------------------------------------------------------------ checks

    def require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ApiError(
                400,
                "this server runs without a tokenizer (--skip-tokenizer-init):"
                " send input_ids to /generate",
                code="no_tokenizer",
            )

    def check_model(self, name: str | None) -> None:
        """Any ``model`` names the served model, as SGLang's server takes it (its OpenAI routes
        read ``model`` only for a LoRA adapter, ``base:adapter``, so a client written for it
        may send any name, ``"default"`` say), except a ``base:adapter`` name other than the
        served name itself: 400, this server serves no adapters (never the base model
        silently in its place)."""
        if name is None or name == self.options.served_model_name or ":" not in name:
            return
        adapter = name.split(":", 1)[1]
        raise ApiError(
            400,
            f"model {name!r} asks for the LoRA adapter {adapter!r}; this server serves no "
            f"adapters (its model: {self.options.served_model_name!r})",
            param="model",
            code="unsupported_value",
        )

    def max_room(self, prompt_len: int) -> int:
        """The most output tokens a prompt of ``prompt_len`` tokens may ask for: within the
        context (:attr:`context_length`: the write window and look-ahead of speculation and
        what the memory holds for one request are counted)."""
        return self.context_length - prompt_len

    def sampling_options(self, p: GenParams) -> SamplingOptions | None:
        """The one place request parameters become engine sampling options (None: greedy).
        400 naming the field if a value is invalid or cannot run here."""
        try:
            opts = SamplingOptions(p.temperature, p.top_p, p.top_k, p.min_p, p.seed)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=name, code="invalid_value") from None
        try:
            self.core.check_sampling(opts)
        except ValueError as e:
            raise ApiError(400, str(e), param="temperature", code="unsupported_value") from None
        return None if opts.greedy else opts

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        """400 naming ``field`` if an id of ``ids`` is outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"{field}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})",
                param=field,
                code="invalid_value",
            )

    def prepare(self, prompt: Sequence[int], p: GenParams, prompt_field: str) -> Submission:
        """Check a request (400 naming the field) and build its submission (without a sink)."""
        prompt = list(prompt)
        if not prompt:
            raise ApiError(
                400, f"{prompt_field} is empty", param=prompt_field, code="invalid_value"
            )
        self.check_token_ids(prompt, prompt_field)
        if p.n != 1:
            raise ApiError(400, f"n must be 1, got {p.n}", param="n", code="unsupported_value")
        if self.draining:
            raise self.shutting_down_error()
        room = self.max_room(len(prompt))
        if room < 1:
            why = ""
            if self.memory_limit < self.engine.context_length:
                why = (
                    f" (the model's is {self.engine.context_length}; this server's memory "
                    f"holds at most {self.memory_limit} tokens for one request: raise "
                    "--max-total-tokens or --mem-fraction-static)"
                )
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} "
                f"tokens{why}; the {prompt_field} has {len(prompt)} tokens, which leaves "
                "no room for output",
                param=prompt_field,
                code="context_length_exceeded",
            )
        n, name = p.max_new_tokens, p.max_tokens_field
        if n is None:
            n = room
        elif isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ApiError(
                400, f"{name} must be an int >= 0, got {n!r}", param=name, code="invalid_value"
            )
        elif n > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} "
                f"tokens; {prompt_field} {len(prompt)} + {name} {n} do not fit "
                f"(at most {room} output tokens)",
                param=name,
                code="context_length_exceeded",
            )
        for s in p.stop:
            if not isinstance(s, str) or not s:
                raise ApiError(
                    400, "stop strings must be non-empty", param="stop", code="invalid_value"
                )
        bad = [t for t in p.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"stop_token_ids: {bad[0]} outside the vocabulary",
                param="stop_token_ids",
                code="invalid_value",
            )
        if p.stop and self.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer", param="stop")
        top = p.top_logprobs_field
        k = p.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400,
                f"{top} must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}",
                param=top,
                code="invalid_value",
            )
        sampling = self.sampling_options(p)
        start = p.prompt_logprobs_from
        if start is not None and (
            isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(prompt)
        ):
            field_name = p.prompt_logprobs_field
            raise ApiError(
                400,
                f"{field_name} must be a prompt position in [0, {len(prompt)}] (or -1: output "
                f"tokens only), got {start!r}",
                param=field_name,
                code="invalid_value",
            )
        # 0 output tokens (a prefill: SGLang's max_new_tokens 0, a legacy completion's echo
        # with max_tokens 0): the engine samples one, which the response leaves out
        discard = n == 0
        try:
            self.core.check_request(prompt, max(n, 1))
        except ValueError as e:
            raise ApiError(400, str(e), param=name, code="context_length_exceeded") from None
        try:
            check_adjustments(p.logit_bias, p.min_tokens, n, self.vocab_size)
        except ValueError as e:
            param = "logit_bias" if "logit_bias" in str(e) else p.min_tokens_field
            raise ApiError(400, str(e), param=param, code="invalid_value") from None
        try:
            penalties = check_penalties(
                p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            )
        except ValueError as e:
            param = str(e).split(": ", 1)[1].split(" ", 1)[0]  # the penalty's name
            raise ApiError(400, str(e), param=param, code="invalid_value") from None
        if p.grammar is not None:
            try:  # compiled here, off the engine thread (the compiler caches it for there)
                self.core.grammar_state(p.grammar)
            except ValueError as e:
                msg = str(e).removeprefix("request rejected: ")
                raise ApiError(
                    400, f"{p.grammar_field}: {msg}", param=p.grammar_field, code="invalid_value"
                ) from None
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= self.eos_token_ids
        sub = Submission(prompt, max(n, 1), frozenset(stops), sampling, sink=_no_sink)
        sub.discard_output = discard
        sub.top_logprobs = k
        sub.logit_bias, sub.min_tokens, sub.penalties = p.logit_bias, p.min_tokens, penalties
        sub.grammar = p.grammar
        if start is not None:
            sub.prompt_logprobs_from, sub.prompt_top_logprobs = start, k
        return sub

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown (SIGTERM): stop admitting (new requests get 503 with
        ``Retry-After``), end the queued requests that have not started with the same 503,
        let running ones finish for up to ``timeout`` seconds, then abort what still runs
        (its stream ends with finish_reason "abort" and ``[DONE]``)."""
        self.draining = True
        loop = self.loop
        if not loop.alive:
            return
        err = self.shutting_down_error()
        try:
            await asyncio.wrap_future(loop.fail_queued(err.message))
            deadline = time.monotonic() + timeout
            while loop.busy and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if loop.busy:
                await asyncio.wrap_future(loop.abort_all())
        except RuntimeError:  # the engine thread stopped meanwhile: nothing left to drain
            return

    # ------------------------------------------------------------------ helpers

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def token_bias(raw: Mapping | None, name: str) -> dict[int, float] | None:
    """A request's ``logit_bias`` (JSON keys are strings: token ids) as ``{id: bias}``; 400
    naming ``name`` for a key that is not a token id or a value that is not a number (ranges:
    :meth:`Serving.prepare`)."""
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise ApiError(400, f"{name} must be an object", param=name, code="invalid_value")
    out = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise ApiError(
                400, f"{name}: key {key!r} is not a token id", param=name, code="invalid_value"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(
                400, f"{name}: {key!r} must map to a number", param=name, code="invalid_value"
            )
        out[tok] = float(value)
    return out


def _no_sink(delta: Delta) -> None:  # replaced by Generation before submission
    raise RuntimeError("submission without a sink")


async def next_delta(queue: asyncio.Queue, held: deque) -> Delta | None:
    """The request's next delta: everything queued by now (``queue``, then ``held``: what an
    earlier call took but could not join) as one — the tokens and log-probabilities of
    consecutive deltas concatenated, the last one's finish — or None where the client went
    away. A delta with an error is never joined to another (the tokens before it still come
    first); nothing is joined past a finish or a None. Waits only when nothing is queued."""
    if not held:
        held.append(await queue.get())
    while not queue.empty():
        held.append(queue.get_nowait())
    delta = held.popleft()
    while (
        delta is not None
        and held
        and held[0] is not None
        and delta.finish_reason is None
        and delta.error is None
        and held[0].error is None
    ):
        nxt = held.popleft()
        delta = Delta(
            delta.tokens + nxt.tokens,
            delta.logprobs + nxt.logprobs,
            nxt.finish_reason,
            nxt.cached_tokens,
            prompt=delta.prompt if delta.prompt is not None else nxt.prompt,
            tops=delta.tops + nxt.tops,
        )
    return delta


class Generation:
    """One submitted request (module docstring). ``http_request``: the Starlette request
    (for disconnects; None: never polled). ``params``: the request's :class:`GenParams`
    (its ``no_stop_trim`` and ``skip_special_tokens`` shape the text). After the pieces:
    ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``output_ids``."""

    def __init__(
        self,
        serving: Serving,
        sub: Submission,
        stop: Sequence[str],
        http_request,
        params: GenParams | None = None,
    ):
        self.serving = serving
        self.sub = sub
        self.http_request = http_request
        params = params or GenParams()
        self.no_stop_trim = params.no_stop_trim
        self.detok = (
            IncrementalDetokenizer(serving.tokenizer, params.skip_special_tokens)
            if serving.tokenizer
            else None
        )
        self.stopper = StopMatcher(stop)
        self.prompt_tokens = len(sub.prompt)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.discard = sub.discard_output  # 0 output tokens asked for: none reported
        self.arrival = sub.arrival
        self.disconnected = False  # the client went away (not the server ending it)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Submit and yield pieces until the last one (which has a ``finish_reason``). An
        :class:`ApiError` if the engine could not run it. Aborts the request if the consumer
        stops early or the client disconnects (:meth:`_watch_client`)."""
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()  # None: the client went away
        self.sub.sink = queue.put_nowait  # runs on this event loop (EngineLoop batches)
        self.sub.event_loop = asyncio.get_running_loop()
        handle = self.serving.loop.submit(self.sub)
        watcher = (
            asyncio.create_task(self._watch_client(queue))
            if self.http_request is not None
            else None
        )
        held: deque[Delta | None] = deque()
        try:
            while self.finish_reason is None:
                delta = await next_delta(queue, held)  # all that has queued up, as one
                if delta is None:
                    self.disconnected = True
                    return  # finally aborts
                piece = self._piece(delta)
                if piece.finish_reason == "stop" and isinstance(piece.matched, str):
                    # a stop string: end it in the engine, counted as the response reports it
                    if delta.finish_reason is None:
                        ended = self.serving.loop.abort(handle, report_as="stop")
                        # answer once the server counts it: a client that reads the
                        # metrics right after its response sees its own request there
                        await asyncio.wait({asyncio.wrap_future(ended)}, timeout=ABORT_WAIT_S)
                    else:  # the engine had ended it already (and counted it) for another reason
                        self.serving.loop.relabel(delta.finish_reason, "stop")
                yield piece
        finally:
            if watcher is not None:
                watcher.cancel()
            if self.finish_reason is None:
                self.serving.loop.abort(handle)
                self.finish_reason = "abort"

    async def _watch_client(self, queue: asyncio.Queue) -> None:
        """Every ``DISCONNECT_POLL_S``, whether tokens flow or not, ask whether the client is
        still there; if not, queue ``None`` for :meth:`pieces`. Its own task, so that reading
        a delta costs no task or timer (a whole response's client is noticed mid-generation:
        the stream's cancellation covers only streamed responses)."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await self.http_request.is_disconnected():
                queue.put_nowait(None)
                return

    def _piece(self, d: Delta) -> Piece:
        if d.error is not None:
            self.finish_reason = "abort"
            if d.status == 503:
                if self.serving.draining:
                    raise self.serving.shutting_down_error()
                headers = {"Retry-After": str(RETRY_AFTER_S)}
                code = "engine_error" if not self.serving.loop.alive else "service_unavailable"
                raise ApiError(503, d.error, code=code, headers=headers)
            raise ApiError(d.status, d.error, code="invalid_value")
        if self.discard:  # the one token the engine sampled is not part of the response
            reason = "length" if d.finish_reason is not None else None
            if reason is not None:
                self.cached_tokens = d.cached_tokens
            self.finish_reason = reason
            return Piece("", finish_reason=reason, prompt=d.prompt)
        toks, lps = list(d.tokens), list(d.logprobs)
        self.output_ids += toks
        self.completion_tokens += len(toks)
        reason, matched = d.finish_reason, None
        text_ids = toks
        if reason == "stop" and self.output_ids and self.output_ids[-1] in self.sub.stop_token_ids:
            matched = self.output_ids[-1]
            if not self.no_stop_trim:
                text_ids = toks[:-1] if toks else []
        if reason is not None:
            self.cached_tokens = d.cached_tokens
        if self.detok is None:
            self.finish_reason = reason
            return Piece("", toks, lps, reason, matched, d.prompt, list(d.tops))
        text = self.detok.push(text_ids)
        if reason is not None:
            text += self.detok.finish()
        ready, stopped = self.stopper.push(text)
        if stopped:
            reason, matched = "stop", self.stopper.matched
            if self.no_stop_trim:
                ready += matched
        elif reason is not None:
            ready += self.stopper.flush()
        self.finish_reason = reason
        return Piece(ready, toks, lps, reason, matched, d.prompt, list(d.tops))

    async def collect(self) -> Piece:
        """Run to the end; one piece with all the text, ids and log-probabilities. Without
        stop strings (which the HTTP side matches as text comes) its deltas come
        :data:`WHOLE_RESPONSE_INTERVAL` tokens at a time."""
        if not self.stopper.stops:
            every = max(WHOLE_RESPONSE_INTERVAL, self.serving.loop.stream_interval)
            self.sub.stream_interval = every
        out = Piece("")
        async for piece in self.pieces():
            out.text += piece.text
            out.token_ids += piece.token_ids
            out.logprobs += piece.logprobs
            out.top_logprobs += piece.top_logprobs
            out.finish_reason, out.matched = piece.finish_reason, piece.matched
            if piece.prompt is not None:
                out.prompt = piece.prompt
        if out.finish_reason is None:  # the client went away
            out.finish_reason = "abort"
        return out
