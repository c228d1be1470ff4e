"""The step loop in its own thread, fed by a queue: the HTTP side never blocks it.

:class:`EngineLoop` owns an :class:`~unimem.engine.core.EngineCore` (built by
:class:`unimem.Engine`) and runs it in a dedicated thread. Between two steps the thread drains
its inbox (new requests, aborts, calls such as a cache flush), steps the core once, and hands
every request's new output tokens to that request's ``sink`` (a callable). A submission that
names an asyncio ``event_loop`` has its sink run there: all of a step's deltas for one event
loop go over in one ``loop.call_soon_threadsafe`` (one wake-up per step, not one per
request); without one, the sink runs on the engine thread.
It sleeps on a condition variable only when the core is idle and the inbox empty. Nothing
the HTTP side does waits on a step, and nothing in a step waits on HTTP.

After every step (and every inbox drain) the thread publishes a snapshot of the engine's
state (:meth:`EngineLoop.snapshot`: running and queued requests, memory in use per kind,
compactions, retractions, token counters, the prefix cache's statistics, where the thread's
time went), which ``/get_server_info`` and ``/metrics`` read without touching the core.

Where the thread's time goes (``engine_time`` in the snapshot, :class:`EngineTime`): per
working iteration (one inbox drain, one step, its deltas) the wall time of the whole
iteration and of ``core.step()`` alone, and the thread's CPU time inside ``core.step()``.
A step's wall time beyond its CPU time is waiting — for the GPU, or for Python's GIL while
the HTTP side holds it; the same model's step time with no server around (``python -m unimem
bench``, ``tools/device/dspark_real.py``) tells the two apart. Six clock reads an
iteration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

from unimem.engine.api import cache_stats
from unimem.engine.core import EngineCore
from unimem.engine.grammar import GrammarSpec
from unimem.engine.request import Request
from unimem.engine.sampling import SamplingOptions
from unimem.memory.spec import LayerKind

__all__ = ["Delta", "EngineLoop", "EngineTime", "Handle", "PromptScores", "Submission"]

log = logging.getLogger("unimem.serve")

THROUGHPUT_WINDOW_S = 10.0
"""Seconds of history behind the prompt / generation throughput gauges."""

IDLE_PUBLISH_S = 1.0
"""How often an idle engine thread refreshes its snapshot."""


@dataclass(frozen=True)
class PromptScores:
    """A request's prompt log-probabilities (:mod:`unimem.engine.prompt_logprobs`):
    ``token_ids`` the prompt, ``logprobs[j]`` position ``j``'s (None where not scored: position
    0 and before the first scored one), ``top[j]`` its most likely tokens as ``(id,
    log-probability)`` pairs (None where not scored; ``top`` None when none were asked)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None


@dataclass(frozen=True)
class Delta:
    """New output of one request since its previous delta: ``tokens`` with their
    ``logprobs``; ``finish_reason`` ("stop", "length", "abort") on its last delta, with
    ``cached_tokens`` (prefix-cache hits) and ``error`` (a message if the engine could not
    run the request: then no tokens follow) with the HTTP ``status`` it is answered with.
    ``prompt``: the prompt's log-probabilities, on the first delta with tokens of a request
    that asked for them (its prefill is done by then); ``tops``: each token's most likely
    tokens as ``(id, log-probability)`` pairs, where the request asked for them (else
    empty)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    status: int = 400
    prompt: PromptScores | None = None
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass
class Submission:
    """What the HTTP side asks for: ``prompt`` ids, ``max_new_tokens``, ``stop_token_ids``
    (EOS included unless ignored), ``sampling`` (None: greedy), and where its deltas go.
    ``arrival``: ``time.monotonic()`` when the HTTP request came in (time to first token is
    measured from it). ``event_loop``: run ``sink`` on this asyncio loop (module
    docstring). ``counted``: False for the server's own probes (``/health_generate``), which
    the metrics leave out. ``stream_interval``: this request's (:class:`EngineLoop`); None:
    the loop's. ``prompt_logprobs_from`` / ``prompt_top_logprobs``: score the prompt from
    that position, with that many top tokens (:meth:`EngineCore.submit
    <unimem.engine.core.EngineCore.submit>`); None: not at all. ``top_logprobs``: each output
    token's that many most likely tokens. ``logit_bias``, ``min_tokens``, ``penalties``
    (presence, frequency, repetition): the logit adjustments
    (:mod:`unimem.engine.adjustments`). ``grammar``: structured output
    (:mod:`unimem.engine.grammar`). ``discard_output``: the HTTP side asked
    for no output token (a prefill); the engine still samples one, which the response
    leaves out."""

    prompt: Sequence[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    sampling: SamplingOptions | None
    sink: Callable[[Delta], None]
    arrival: float = field(default_factory=time.monotonic)
    event_loop: asyncio.AbstractEventLoop | None = None
    counted: bool = True
    stream_interval: int | None = None
    prompt_logprobs_from: int | None = None
    prompt_top_logprobs: int = 0
    top_logprobs: int = 0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)
    grammar: GrammarSpec | None = None
    discard_output: bool = False


class Handle:
    """One submitted request, as the HTTP side holds it (pass it to :meth:`EngineLoop.abort`)."""

    def __init__(self, sub: Submission) -> None:
        self.sub = sub
        self.req: Request | None = None  # set by the engine thread
        self.sent = 0
        self.last_emit = 0.0
        self.finish_as: str | None = None  # the reason the response reports (metrics)
        self.failed: Delta | None = None  # the error it ends with, if ended before it started


@dataclass
class EngineTime:
    """The engine thread's time over its working iterations (module docstring), seconds:
    ``iterations`` counted, ``iteration_seconds`` their wall time (inbox, step, deltas),
    ``step_seconds`` the wall time inside ``core.step()``, ``step_cpu_seconds`` the thread's
    CPU time inside it. Idle waits for work are in none of them."""

    iterations: int = 0
    iteration_seconds: float = 0.0
    step_seconds: float = 0.0
    step_cpu_seconds: float = 0.0


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    verify_steps: int = 0
    verified_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)


def _prompt_scores(r: Request) -> PromptScores:
    top = None
    if r.prompt_top_logprobs_k:
        top = tuple(None if t is None else tuple(t) for t in r.prompt_top_logprobs)
    return PromptScores(tuple(r.prompt), tuple(r.prompt_logprobs), top)


class EngineLoop:
    """Runs ``core`` in a thread (module docstring). ``observe``: optional callbacks the
    thread calls as tokens come out (``ttft(seconds)``, ``itl(seconds, n)``,
    ``finished(reason, seconds)``), for the metrics. ``stream_interval`` (SGLang's
    ``--stream-interval``): a request's new tokens go out once at least this many have
    come since its last delta — its first tokens at once, whatever is left with its end —
    so that at many streams the HTTP side handles fewer, larger deltas."""

    def __init__(self, core: EngineCore, observe=None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.core = core
        self.pool = core.pool
        self.observe = observe
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._active: list[Handle] = []
        self._outbox: list[tuple[Handle, Delta]] = []
        self._stopping = False
        self._count_lock = threading.Lock()
        self.last_output = 0.0  # time.monotonic() when output tokens last came out
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self._counters = _Counters()
        self._time = EngineTime()
        self._history: deque[tuple[float, int, int]] = deque()
        self._snapshot: dict = {}
        self._publish()

    # ------------------------------------------------------------------ HTTP side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="unimem-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, sub: Submission) -> Handle:
        """Queue ``sub`` for the engine thread; returns at once."""
        handle = Handle(sub)
        self._post("submit", handle)
        return handle

    def abort(self, handle: Handle, report_as: str | None = None) -> Future:
        """End ``handle``'s request between steps (its memory comes back); a no-op once it
        finished. ``report_as``: the finish reason the response reports and the metrics
        count (a stop string ends a request as "stop"); default "abort". Returns at once;
        the future resolves (to None) once the engine thread has ended the request and
        counted its finish, so a caller that awaits it answers only after the server's
        counters and metrics include this request."""
        if report_as is not None:
            handle.finish_as = report_as
        done: Future = Future()
        self._post("abort", (handle, done))
        return done

    def relabel(self, engine_reason: str, reported: str) -> None:
        """Count one finished request as ``reported`` instead of ``engine_reason`` (a stop
        string found in the delta that already ended it for another reason)."""
        if engine_reason == reported:
            return
        with self._count_lock:
            done = self._counters.requests_finished
            if done.get(engine_reason, 0) > 0:
                done[engine_reason] -= 1
                if not done[engine_reason]:
                    del done[engine_reason]
            done[reported] = done.get(reported, 0) + 1

    def fail_queued(self, message: str, status: int = 503) -> Future:
        """End every request that is queued and has produced nothing yet (its response has
        not started) with ``message`` answered as ``status``; requests already running go
        on. Runs between two steps; the future's result is how many were ended."""

        def fail(core: EngineCore) -> int:
            n = 0
            for h in self._active:
                r = h.req
                if h.sent == 0 and not r.output and r.status.name == "WAITING":
                    core.abort(r)
                    h.failed = Delta(finish_reason="abort", error=message, status=status)
                    n += 1
            return n

        return self.call(fail)

    def abort_all(self) -> Future:
        """Abort every request (each ends with finish_reason "abort"); between two steps."""
        return self.call(lambda core: [core.abort(h.req) for h in self._active])

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running (as of the last step)."""
        s = self._snapshot
        return bool(s.get("running_requests") or s.get("queued_requests"))

    def call(self, fn: Callable[[EngineCore], object]) -> Future:
        """Run ``fn(core)`` on the engine thread between two steps; its result as a future."""
        fut: Future = Future()
        self._post("call", (fn, fut))
        return fut

    def snapshot(self) -> dict:
        """The engine's state as of its last step (module docstring; finished requests by
        reason are current); never blocks."""
        return {**self._snapshot, "requests_finished": self._finished_counts()}

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request, stop the thread and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _post(self, kind: str, item: object) -> None:
        with self._cond:
            if self._stopping or self.error is not None:
                reason = self.error or "the server is shutting down"
                if kind == "submit":
                    _send([(item, Delta(finish_reason="abort", error=reason, status=503))])
                elif kind == "call":
                    item[1].set_exception(RuntimeError(reason))
                elif kind == "abort":  # the shutdown path ends it (and counts it) anyway
                    item[1].set_result(None)
                return
            self._inbox.append((kind, item))
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._cond:
                    if not self._inbox and not busy and not self._stopping:
                        self._cond.wait(IDLE_PUBLISH_S)
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                if not inbox and not busy and not stopping:
                    self._publish()  # idle: keep the throughput gauges current
                    continue
                start = time.perf_counter()
                self._handle(inbox)
                if stopping:
                    for h in list(self._active):
                        self._abort(h)
                    self._emit()
                    return
                step_start, cpu_start = time.perf_counter(), time.thread_time()
                busy = self.core.step()
                step_end, cpu_end = time.perf_counter(), time.thread_time()
                self._emit()
                t = self._time
                t.iterations += 1
                t.step_seconds += step_end - step_start
                t.step_cpu_seconds += cpu_end - cpu_start
                t.iteration_seconds += time.perf_counter() - start
        except Exception as e:  # a broken engine: fail every request, keep the process up
            log.exception("engine loop failed")
            with self._cond:
                self.error = f"engine failure: {type(e).__name__}: {e}"
                pending, self._inbox = self._inbox, []
            failed = self._active + [i for k, i in pending if k == "submit"]
            _send([(h, Delta(finish_reason="abort", error=self.error, status=503)) for h in failed])
            for k, item in pending:
                if k == "call":
                    item[1].set_exception(RuntimeError(self.error))
                elif k == "abort":
                    item[1].set_result(None)
            self._active = []
            self._publish()

    def _handle(self, inbox: list[tuple[str, object]]) -> None:
        aborted: list[Future] = []
        settled: list[tuple[Future, object, Exception | None]] = []
        try:
            for kind, item in inbox:
                if kind == "submit":
                    self._submit(item)
                elif kind == "abort":
                    handle, done = item
                    aborted.append(done)
                    self._abort(handle)
                else:
                    fn, fut = item
                    try:
                        settled.append((fut, fn(self.core), None))
                    except Exception as e:
                        settled.append((fut, None, e))
            if inbox:
                self._emit()  # counts the aborted requests' finish; publishes the snapshot
        finally:  # even when the engine broke: nobody waits on an abort forever
            for done in aborted:
                if not done.done():
                    done.set_result(None)
            # calls are answered after the snapshot is published: a caller that has its
            # answer (a flushed cache) reads a load and metrics that show what its call did
            for fut, value, error in settled:
                if fut.done():
                    continue
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(value)

    def _submit(self, h: Handle) -> None:
        s = h.sub
        try:
            kw = {}
            if s.prompt_logprobs_from is not None:
                kw = dict(
                    prompt_logprobs_from=s.prompt_logprobs_from,
                    prompt_top_logprobs=s.prompt_top_logprobs,
                )
            if s.top_logprobs:
                kw["top_logprobs"] = s.top_logprobs
            if s.logit_bias or s.min_tokens:
                kw.update(logit_bias=s.logit_bias, min_tokens=s.min_tokens)
            if s.grammar is not None:
                kw["grammar"] = s.grammar
            if s.penalties != (0.0, 0.0, 1.0):
                presence, frequency, repetition = s.penalties
                kw.update(
                    presence_penalty=presence,
                    frequency_penalty=frequency,
                    repetition_penalty=repetition,
                )
            h.req = self.core.submit(
                s.prompt,
                s.max_new_tokens,
                stop_token_ids=s.stop_token_ids,
                sampling=s.sampling,
                **kw,
            )
        except ValueError as e:  # checked on the HTTP side already; a race is still answered
            self._outbox.append((h, Delta(finish_reason="abort", error=str(e))))
            return
        if s.counted:
            self._counters.prompt_tokens += len(s.prompt)
        self._active.append(h)

    def _abort(self, h: Handle) -> None:
        if h.req is None:  # never submitted (or refused): nothing to stop
            return
        self.core.abort(h.req)

    def _emit(self) -> None:
        """Turn the requests' new tokens and finishes into deltas, publish the load snapshot,
        then send the deltas (in that order: see below)."""
        now = time.monotonic()
        still = []
        for h in self._active:
            r = h.req
            n = len(r.output)
            done = r.finished
            if done and h.failed is not None:  # ended before it started (fail_queued)
                self._outbox.append((h, h.failed))
                continue
            every = h.sub.stream_interval or self.stream_interval
            if done or (n > h.sent and (h.sent == 0 or n - h.sent >= every)):
                first = h.sent == 0
                toks = tuple(r.output[h.sent : n])
                lps = tuple(r.output_logprobs[h.sent : n])
                self._observe_tokens(h, len(toks), now)
                h.sent = n
                reason = r.finish_reason if done else None
                if done:
                    self._finished(h, reason, now)
                error = r.error if done else None  # an internal fault failed it
                prompt = None
                if first and toks and r.prompt_logprobs_from is not None:
                    prompt = _prompt_scores(r)  # the first tokens: the prefill is done
                cached = r.cached_tokens if done else 0
                tops = ()
                if r.top_logprobs_k:
                    tops = tuple(tuple(t) for t in r.output_top_logprobs[n - len(toks) : n])
                delta = Delta(toks, lps, reason, cached, error, prompt=prompt, tops=tops)
                self._outbox.append((h, delta))
            if not done:
                still.append(h)
        self._active = still
        outbox, self._outbox = self._outbox, []
        # the load snapshot first: a client that has its response reads a load that no
        # longer counts its request
        self._publish()
        _send(outbox)

    def _observe_tokens(self, h: Handle, n: int, now: float) -> None:
        if n == 0:
            return
        self.last_output = now
        if not h.sub.counted:
            return
        self._counters.generation_tokens += n
        if self.observe is not None:
            if h.sent == 0:
                self.observe.ttft(now - h.sub.arrival)
                if n > 1:
                    self.observe.itl(0.0, n - 1)
            else:
                self.observe.itl((now - h.last_emit) / n, n)
        h.last_emit = now

    def _finished(self, h: Handle, reason: str, now: float) -> None:
        if not h.sub.counted:
            return
        c = self._counters
        r = h.req
        c.cached_tokens += r.cached_tokens
        c.verify_steps += r.verify_steps
        c.verified_tokens += r.verified_tokens
        if reason == "abort" and h.finish_as is not None:
            reason = h.finish_as
        with self._count_lock:
            c.requests_finished[reason] = c.requests_finished.get(reason, 0) + 1
        if self.observe is not None:
            self.observe.finished(reason, now - h.sub.arrival)

    def _finished_counts(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self._counters.requests_finished)

    def _publish(self) -> None:
        """Swap in a fresh snapshot (one reference assignment: readers never see a torn one)."""
        pool, sched, c = self.pool, self.core.scheduler, self._counters
        stats = pool.stats
        now = time.monotonic()
        hist = self._history
        hist.append((now, c.prompt_tokens, c.generation_tokens))
        while len(hist) > 2 and now - hist[1][0] > THROUGHPUT_WINDOW_S:
            hist.popleft()
        span = now - hist[0][0]
        units = {k.name.lower(): pool.live_units(k) for k in pool.spec.kinds}
        tokens = {
            k: n * (1 if k == LayerKind.STATE.name.lower() else pool.page_size)
            for k, n in units.items()
        }
        self._snapshot = {
            "running_requests": len(sched.running),
            "queued_requests": len(sched.waiting),
            "used_bytes": pool.used_bytes(),
            "peak_bytes": stats.peak_bytes,
            "capacity_bytes": stats.capacity_bytes,
            "live_units": units,
            "tokens_in_use": tokens,
            "compactions": stats.compactions,
            "moved_units": stats.moved_units,
            "retractions": sched.retractions,
            "steps": self.core.steps,
            "prompt_tokens_total": c.prompt_tokens,
            "generation_tokens_total": c.generation_tokens,
            "cached_tokens_total": c.cached_tokens,
            "spec_verify_steps_total": c.verify_steps,
            "spec_verified_tokens_total": c.verified_tokens,
            "requests_finished": self._finished_counts(),
            "prompt_throughput": (c.prompt_tokens - hist[0][1]) / span if span > 0 else 0.0,
            "generation_throughput": (c.generation_tokens - hist[0][2]) / span if span > 0 else 0.0,
            "prefix_cache": cache_stats(self.core),
            "prefill_delayer": None if sched.delayer is None else sched.delayer.stats(),
            "engine_error": self.error,
            "engine_time": asdict(self._time),  # as of the iteration before
        }


def _send(items: list[tuple[Handle, Delta]]) -> None:
    """Hand each delta to its request's sink: directly, or batched per event loop."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Handle, Delta]]] = {}
    for h, delta in items:
        if h.sub.event_loop is None:
            _run_sinks([(h, delta)])
        else:
            batches.setdefault(h.sub.event_loop, []).append((h, delta))
    for aloop, batch in batches.items():
        try:
            aloop.call_soon_threadsafe(_run_sinks, batch)
        except RuntimeError:  # the event loop closed (shutdown): nobody is listening
            log.debug("dropped %d deltas for a closed event loop", len(batch))


def _run_sinks(batch: list[tuple[Handle, Delta]]) -> None:
    for h, delta in batch:
        try:
            h.sub.sink(delta)
        except Exception:
            log.exception("a request's sink failed")
