"""Continuous batching with admission by capacity, chunked prefill and retraction.

Policy (deterministic: the same requests and the same capacity give the same batches):

- Each step is either an *extend* batch (requests with more than one pending token: prompts,
  in chunks of at most ``chunk_size`` tokens in total per step) or a *decode* batch (every
  running request with exactly one pending token). Extend goes first.
- Chain speculative decoding (``gamma`` given): the decode batch becomes a *verify* batch:
  every running request verifies ``gamma + 1`` tokens from its anchor (its one pending
  token), and its pages are grown to ``kv_len + gamma + 1`` tokens first (the write window,
  reserved ahead, page-granular; nothing is freed when drafts are rejected). A request that
  already has output extends only up to its anchor (``num_tokens - 1``) and samples nothing:
  a retracted request is rebuilt to exactly the state it had, so its next verify step is
  the one it would have run anyway (verify counts do not depend on retraction). A request
  without output extends its whole prompt and samples its first token from the prefill.
- Admission, FIFO: a waiting request is admitted when fewer than ``max_running`` run and the
  pool can hold its first chunk; the pool says so by returning its memory or None.
- Before a forward, every request of the batch grows to cover the tokens the step writes. If
  the pool cannot serve that, the most recently admitted running request is *retracted*: its
  memory is released and it goes back to the front of the queue, to be recomputed from its
  prompt and the output so far. After a retraction no request is admitted until one finishes
  (otherwise the retracted request would be readmitted at once and thrash).
- With a :class:`~unimem.engine.prefill_delay.PrefillDelayer` (``delayer``), a pass may admit
  nothing while a saturated batch decodes, so that admissions come in batches (SGLang's
  prefill delayer; the policy is that module's). It decides once per :meth:`next_batch`;
  a pass that finds nothing running after reading results admits anyway.
- Every step, SWA pages behind each request's window are retired (one launch, for the
  requests whose window moved past a page: the others have nothing to let go).
- An internal fault of the allocator (:class:`~unimem.memory.errors.InternalError`, raised
  with the pool left as it was) fails only the request it met: admissions and the step's
  grow are retried request by request, and the request whose call raises finishes at once
  with ``error`` set (``finish_reason`` "abort"); the others continue.

One step late. The engine launches step ``k + 1`` before it reads step ``k``'s
results, so a request may have one step *in flight* (:class:`~unimem.engine.request.InFlight`)
when the next batch is planned. Planning then uses bounds: the request stands at most at
``planned_kv_max`` (a verify step commits ``1 .. gamma + 1`` tokens) and its pages are grown to
that plus the new step's tokens; a request is left out only once it is finished for sure
(``planned_finished``) — a verify batch may therefore run one step too many for a request
that its in-flight step finished, whose results are then dropped. When a batch does not fit,
the in-flight results are read first (``drain``) and the batch is planned again from exact
lengths, before anything is evicted or retracted. Results are accounted by :meth:`complete`
and :meth:`complete_verify` when read; those of a request that has finished or restarted
(retraction) since the launch are dropped.

With a :class:`~unimem.cache.PrefixCache` (``cache``):

- admission goes through ``cache.admit``: a request resumes at the longest cached prefix of
  the tokens its extend computes (its ``kv_len`` and ``cached_tokens`` start there) — for a
  request scoring its prompt from position ``s``, of its first ``max(s, 1)`` tokens
  (:func:`~unimem.engine.prompt_logprobs.cache_match_limit`: the rows it scores are
  computed);
- an extend chunk that crosses an anchor point (a multiple of ``page_size *
  checkpoint_interval`` tokens) is cut there, so that chunk boundaries are checkpoints;
- after every step, a request whose committed length is on an anchor point is inserted into
  the cache, and a finished request is inserted before it is released (both before SWA
  retirement: the window behind the insertion point must still be held). With STATE layers
  the checkpoint must hold the state after exactly those tokens, but results are read one
  step late, when a later step may have advanced the slot: a step that may end on an anchor
  point therefore copies the request's state right after its launch (a *snapshot*, stream-
  ordered before any later step), which becomes the checkpoint or is freed;
- when a step cannot be served, the cache evicts first (LRU); if that frees nothing, the
  cache is flushed (entries locked by running requests still keep checkpoint slots and SWA
  windows of their own); a running request is retracted only when neither freed anything.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import islice, repeat
from typing import TYPE_CHECKING

from unimem.engine.batch import Batch
from unimem.engine.prefill_delay import PrefillDelayer
from unimem.engine.prompt_logprobs import cache_match_limit
from unimem.engine.request import InFlight, Request, RequestStatus
from unimem.memory.errors import InternalError, require
from unimem.memory.pool import MemoryPool, RequestMemory, pages_for
from unimem.memory.spec import LayerKind
from unimem.models.forward_context import ForwardMode

if TYPE_CHECKING:
    from unimem.cache import PrefixCache


class Scheduler:
    def __init__(
        self,
        pool: MemoryPool,
        max_running: int,
        chunk_size: int,
        gamma: int | None = None,
        cache: PrefixCache | None = None,
        delayer: PrefillDelayer | None = None,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if gamma is not None and gamma < 1:
            raise ValueError(f"gamma must be >= 1 (or None without speculation), got {gamma}")
        if cache is not None and cache.pool is not pool:
            raise ValueError("the prefix cache must be built over the scheduler's pool")
        self.gamma = gamma
        self.pool = pool
        self.cache = cache
        self.delayer = delayer
        # Anchor points of the cache: committed lengths that are multiples of this.
        self.anchor_tokens = pool.page_size * cache.checkpoint_interval if cache else 0
        # Checkpoints of STATE layers are snapshots taken at launch (see launched / _insert).
        self._snapshots = cache is not None and cache.has_state
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.retractions = 0
        self.verify_batches = 0
        self.verified_rows = 0
        self.cache_flushes = 0
        self._admission_paused = False
        # InFlight records are immutable: a verify step of n tokens always makes the same one,
        # and so does a decode step of n tokens that samples or not.
        self._verify_inflight: dict[int, InFlight] = {}
        self._decode_inflight: dict[tuple[int, bool], InFlight] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> bool:
        """Finish ``req`` now (``finish_reason`` "abort"): a waiting request leaves the queue;
        a running one releases its memory — launched in stream order after its steps in
        flight, whose results are then dropped. False if it had already finished."""
        if req.status is RequestStatus.FINISHED:
            return False
        req.aborted = True
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.pool.release([req.mem])
            self._drop_inflight(req)
            req.mem = None
            self.running.remove(req)
            self._admission_paused = False
        req.status = RequestStatus.FINISHED
        self.finished.append(req)
        return True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- one step --------------------------------------------------------------------------------

    def next_batch(self, drain: Callable[[], bool] | None = None) -> Batch | None:
        """The next forward to run, with memory for it already reserved; None when there is
        nothing to run. ``drain()`` reads the in-flight step's results (accounting them
        through :meth:`complete` / :meth:`complete_verify`) and says whether there were any:
        it is called when nothing can be planned from bounds or a planned batch does not fit.
        """
        hold = self._hold_admissions()
        while True:
            # a pass that found its requests all finished (drain) has nothing to hold for
            admitted = self._admit() if not (hold and self.running) else 0
            if admitted and self.delayer is not None:
                self.delayer.admitted(admitted)
            batch = self._plan()
            if batch is None:
                if drain is not None and drain():
                    continue
                if self.waiting and not self.running:
                    raise RuntimeError("no request can run: the pool cannot hold even one request")
                return None
            targets = [
                (r.mem, r.planned_kv_max + n) for r, n in zip(batch.reqs, batch.lens, strict=True)
            ]
            try:
                reserve = None if self.waiting else partial(self._reserve, batch.reqs, targets)
                if self.pool.grow(targets, reserve):
                    return batch
            except InternalError:
                self._grow_each(batch.reqs, targets)
                continue
            if drain is not None and drain():
                continue
            if self.cache is not None and self._evict_for(targets):
                continue
            self._retract_newest()

    def _reserve(self, reqs: list[Request], targets: list) -> list[int]:
        """What the pool may give each request ahead when the batch needs pages: one page
        past its target, not past its last token (``prompt + max_new_tokens``). Asked for
        only while no request waits for admission (free pages go to those first)."""
        p = self.pool.page_size
        return [
            max(t, min(t + p, len(r.prompt) + r.max_new_tokens))
            for r, (_, t) in zip(reqs, targets, strict=True)
        ]

    def _grow_each(self, reqs: list[Request], targets: list) -> None:
        """After a batch grow met an internal fault (nothing changed): grow the requests one
        at a time and fail those whose own grow raises; the batch is planned again."""
        for r, target in zip(reqs, targets, strict=True):
            try:
                self.pool.grow([target])
            except InternalError as e:
                self.fail(r, e)

    def fail(self, req: Request, err: Exception) -> None:
        """Finish ``req`` now because an internal fault met it: ``req.error`` names the fault
        (``finish_reason`` "abort"); its memory comes back as on :meth:`abort`."""
        req.error = f"internal error: {type(err).__name__}: {err}"
        self.abort(req)

    def launched(self, batch: Batch) -> None:
        """Record that ``batch`` was launched (call right after the launch, before the next
        one): each request has it in flight until its results are accounted. With a prefix
        cache over STATE layers, the state of each request that the step may leave on an
        anchor point is copied now, in stream order before any later step can advance it
        (see :meth:`_insert`)."""
        batch.epochs = [r.epoch for r in batch.reqs]
        if batch.mode is ForwardMode.VERIFY and not self._snapshots:
            made = self._verify_inflight
            for r, n in zip(batch.reqs, batch.lens, strict=True):
                step = made.get(n)
                if step is None:
                    step = made[n] = InFlight(ForwardMode.VERIFY, n, 1, n, 1)
                r.inflight.append(step)
            return
        if batch.mode is ForwardMode.DECODE and not self._snapshots:
            made = self._decode_inflight
            for r, n, samples in zip(batch.reqs, batch.lens, batch.samples, strict=True):
                step = made.get((n, samples))
                if step is None:
                    step = made[n, samples] = InFlight(ForwardMode.DECODE, n, n, n, int(samples))
                r.primed = True
                r.inflight.append(step)
            return
        for r, n, samples in zip(batch.reqs, batch.lens, batch.samples, strict=True):
            if batch.mode is ForwardMode.VERIFY:
                step = InFlight(ForwardMode.VERIFY, n, 1, n, 1)
            else:
                step = InFlight(batch.mode, n, n, n, int(samples))
                r.primed = True
            if self._snapshots and self._may_end_on_anchor(r, step):
                saved = self.pool.save_state(r.mem.state_slot)
                if saved is not None:
                    step = dataclasses.replace(step, snapshot=saved)
            r.inflight.append(step)

    def _may_end_on_anchor(self, r: Request, step: InFlight) -> bool:
        """Whether ``r``'s committed length after ``step`` (and the steps in flight before
        it) can be a multiple of the anchor spacing."""
        lo = r.kv_len + sum(f.kv_min for f in r.inflight) + step.kv_min
        hi = r.kv_len + sum(f.kv_max for f in r.inflight) + step.kv_max
        a = self.anchor_tokens
        return hi // a * a >= max(lo, self.pool.page_size)

    def _drop_inflight(self, r: Request) -> None:
        """Forget ``r``'s steps in flight (finished or retracted): free their snapshots
        (after the copies, in stream order); their results will be dropped."""
        snaps = [f.snapshot for f in r.inflight if f.snapshot >= 0]
        if snaps:
            self.pool.free_states(snaps)
        r.inflight.clear()

    def complete(
        self,
        batch: Batch,
        new_tokens: list[int],
        logprobs: list[float] | None = None,
        tops: list[list[list[tuple[int, float]]]] | None = None,
    ) -> None:
        """Account a finished extend or decode step: advance lengths, append the sampled
        tokens (and their ``logprobs`` and top log-probabilities ``tops[i][0]``, if given)
        of the requests with ``batch.samples[i]``,
        then cache / retire SWA pages / release finished requests. Results of requests that
        finished or restarted since the launch are dropped."""
        live = []
        running = RequestStatus.RUNNING
        epochs, samples = batch.epochs, batch.samples
        for i, (req, n, tok) in enumerate(zip(batch.reqs, batch.lens, new_tokens, strict=True)):
            # a result of a run that finished or restarted since the launch is dropped
            if req.status is not running or req.epoch != epochs[i]:
                continue
            step = req.inflight.pop(0)
            req.kv_len += n
            req.forward_steps += 1
            if samples[i]:
                top = None if tops is None else tops[i][0]
                req.append_token(tok, None if logprobs is None else logprobs[i], top)
            live.append((req, step.snapshot))
        self._end_step(live)

    def complete_verify(
        self,
        batch: Batch,
        committed: list[list[int]],
        logprobs: list[list[float]] | None = None,
        verify_lens: list[int] | None = None,
        tops: list[list[list[tuple[int, float]]]] | None = None,
    ) -> None:
        """Account a verify step: ``committed[i]`` are the ``accepted + 1`` tokens request
        ``i`` committed (accepted drafts, then the bonus), ``logprobs[i]`` and ``tops[i]``
        (their top log-probabilities, a list per verified row) theirs if given,
        ``verify_lens[i]`` the rows it verified (default ``gamma + 1``). Its length advances
        by the committed tokens (the anchor and the accepted drafts are now in memory; the
        bonus is the next anchor); output beyond ``max_new_tokens`` or a stop token is
        dropped. Then as :meth:`complete`. ``verify_batches`` / ``verified_rows`` count the
        steps with a live lane and their live lanes' rows."""
        if len(committed) != len(batch.reqs):
            raise ValueError(f"{len(committed)} results for a batch of {len(batch.reqs)}")
        live = []
        rows = 0
        running = RequestStatus.RUNNING
        lens = repeat(self.gamma + 1) if verify_lens is None else verify_lens
        lps = repeat(None) if logprobs is None else logprobs
        top_rows = repeat(None) if tops is None else tops
        epochs = batch.epochs
        for i, (req, toks, n, lp, top) in enumerate(
            zip(batch.reqs, committed, lens, lps, top_rows, strict=False)
        ):
            # a result of a run that finished or restarted since the launch is dropped
            if req.status is not running or req.epoch != epochs[i]:
                continue
            step = req.inflight.pop(0)
            k = len(toks)
            req.kv_len += k
            req.forward_steps += 1
            req.verify_steps += 1
            req.verified_tokens += k
            req.verified_rows += n
            rows += n
            req.append_output(toks, lp, top)
            live.append((req, step.snapshot))
        if live:
            self.verify_batches += 1
            self.verified_rows += rows
        self._end_step(live)

    def _end_step(self, stepped: list[tuple[Request, int]]) -> None:
        """After accounting a step: ``stepped`` pairs each request whose result was taken
        with the step's state snapshot (-1: none)."""
        done = []
        going = []  # the requests whose window moved past another page (pool.swa_stop)
        window, p = self.pool.swa_window, self.pool.page_size
        behind = None if window is None else 1 - window
        for r, _ in stepped:
            if r.finished:
                done.append(r)
            elif behind is not None:
                mem = r.mem
                if (r.kv_len + behind) // p > mem.swa_start < len(mem.pages):
                    going.append((mem, r.kv_len))
        if self.cache is not None:
            self._insert(stepped)
        else:
            require(
                all(snap < 0 for _, snap in stepped), "a state snapshot was taken without a cache"
            )
        if going:
            self.pool.retire_swa(going)
        if done:
            # A step launched after the finishing one may still be in flight: the release
            # runs after it in stream order, and its results are dropped.
            self.pool.release([r.mem for r in done])
            for r in done:
                self._drop_inflight(r)
                r.mem = None
                r.status = RequestStatus.FINISHED
                self.running.remove(r)
                self.finished.append(r)
            self._admission_paused = False

    # --- policy pieces ---------------------------------------------------------------------------

    def _hold_admissions(self) -> bool:
        """Whether this pass admits nothing (the delayer's decision; False without one, and
        while admission is paused after a retraction, which admits nothing anyway)."""
        if self.delayer is None or self._admission_paused:
            return False
        stats = self.pool.stats
        return self.delayer.hold(
            waiting=len(self.waiting),
            running=len(self.running),
            max_running=self.max_running,
            usage=stats.used_bytes / stats.capacity_bytes if stats.capacity_bytes else 0.0,
        )

    def _admit(self) -> int:
        """Admit what fits (FIFO); how many were admitted."""
        before = len(self.running)
        if self.cache is None:
            self._admit_without_cache()
        else:
            self._admit_with_cache()
        return len(self.running) - before

    def _admit_with_cache(self) -> None:
        while self.waiting and len(self.running) < self.max_running and not self._admission_paused:
            req = self.waiting[0]
            try:
                # a request scoring its prompt computes the rows it scores (never cached)
                end = self._extend_end(req)
                limit = cache_match_limit(req)
                adm = self.cache.admit(req.tokens[: end if limit is None else min(end, limit)],
                                       self.chunk_size)  # fmt: skip
            except InternalError as e:
                self.fail(req, e)
                continue
            if adm is None:
                return
            self._start(self.waiting.popleft(), adm.mem, adm.prefix_tokens)

    def _admit_without_cache(self) -> None:
        """The waiting requests that fit, in order, in one pool call
        (:meth:`~unimem.memory.pool.MemoryPool.admit_many`: one allocation for all of them)."""
        room = self.max_running - len(self.running)
        if not self.waiting or room <= 0 or self._admission_paused:
            return
        reqs = list(islice(self.waiting, room))
        counts = [min(self._extend_len(r), self.chunk_size) for r in reqs]
        try:
            mems = self.pool.admit_many(counts)
        except InternalError:
            self._admit_each(reqs, counts)
            return
        for mem in mems:  # the first len(mems) waiting requests
            self._start(self.waiting.popleft(), mem, 0)

    def _admit_each(self, reqs: list[Request], counts: list[int]) -> None:
        """After ``admit_many`` met an internal fault (nothing admitted): the same admissions
        one by one (the same outcome, by its contract); a request whose own admission raises
        fails, and the next one is tried."""
        for r, n in zip(reqs, counts, strict=True):
            try:
                mem = self.pool.admit(n)
            except InternalError as e:
                self.fail(r, e)
                continue
            if mem is None:
                return
            self.waiting.remove(r)
            self._start(r, mem, 0)

    def _start(self, req: Request, mem: RequestMemory, prefix: int) -> None:
        req.mem = mem
        req.kv_len = prefix
        req.cached_tokens += prefix
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _plan(self) -> Batch | None:
        """The next batch from the requests' planned positions (module docstring), or None
        when every running request is finished for sure."""
        active, prefill = [], []
        decoding = self.gamma is None
        for r in self.running:
            inflight = r.inflight
            if len(inflight) == 1 and inflight[0].mode is ForwardMode.VERIFY:
                # the steady state, inline: not finished for sure, and past its extends
                if len(r.output) + inflight[0].outputs_min < r.max_new_tokens:
                    active.append(r)
                continue
            if decoding and r.primed and len(inflight) == 1:
                # without speculation, one step in flight, inline: planned_finished, then
                # _needs_extend (more than one token pending after that step)
                step = inflight[0]
                outputs = len(r.output) + step.outputs_min
                if outputs >= r.max_new_tokens:
                    continue
                active.append(r)
                if len(r.prompt) + outputs - (r.kv_len + step.kv_max) > 1:
                    prefill.append(r)
                continue
            if r.planned_finished:
                continue
            active.append(r)
            if self._needs_extend(r):
                prefill.append(r)
        if not active:
            return None
        return self._extend_batch(prefill) if prefill else self._decode_batch(active)

    def _needs_extend(self, r: Request) -> bool:
        """Whether ``r``'s next forward is an extend: without speculation, while more than
        one token is pending; with it, until it holds :meth:`_spec_extend_end` tokens. A
        request with a verify step in flight is past its extends."""
        if r.verifying:
            return False
        if not r.primed:
            # Decode and verify steps read the length and next token from the device
            # state, which only an extend sets: a (re)admitted request extends first, even
            # a single token (a prefix-cache hit leaves at least one to compute).
            return True
        if self.gamma is None:
            return r.planned_tokens - r.planned_kv_max > 1
        return r.planned_kv_max < self._spec_extend_end(r)

    @staticmethod
    def _spec_extend_end(r: Request) -> int:
        """With speculation, the tokens ``r`` holds before it verifies: all when it has no
        output yet (the prefill samples its first token), else all but its anchor."""
        return r.planned_tokens - 1 if r.planned_has_output else r.planned_tokens

    def _extend_end(self, r: Request) -> int:
        """The tokens ``r`` holds when its extends are done."""
        return r.planned_tokens if self.gamma is None else self._spec_extend_end(r)

    def _extend_batch(self, prefill: list[Request]) -> Batch:
        reqs, lens, starts, samples, budget = [], [], [], [], self.chunk_size
        for r in prefill:
            if budget == 0:
                break
            start = r.planned_kv_max  # exact: no verify step is in flight
            n = min(self._extend_len(r), budget)
            if self.anchor_tokens:
                # End the chunk on the last anchor point it crosses (a checkpoint there).
                cut = (start + n) // self.anchor_tokens * self.anchor_tokens
                if cut > start:
                    n = cut - start
            reqs.append(r)
            lens.append(n)
            starts.append(start)
            samples.append(start + n == r.planned_tokens)
            budget -= n
        return Batch(ForwardMode.EXTEND, reqs, lens, starts, samples)

    def _extend_len(self, r: Request) -> int:
        """Tokens an extend of ``r`` has left to consume: up to the end of its tokens without
        speculation (the last chunk samples), up to :meth:`_spec_extend_end` with it."""
        return self._extend_end(r) - r.planned_kv_max

    def _decode_batch(self, reqs: list[Request]) -> Batch:
        n = 1 if self.gamma is None else self.gamma + 1
        mode = ForwardMode.DECODE if self.gamma is None else ForwardMode.VERIFY
        return Batch(mode, reqs, [n] * len(reqs), [], [True] * len(reqs))

    def _insert(self, stepped: list[tuple[Request, int]]) -> None:
        """Cache the committed prefix of every request on an anchor point, and of finished
        ones (a model without STATE layers can resume inside; with them, only on anchors).

        The checkpoint of a model with STATE layers is the state after exactly the committed
        tokens: the step's snapshot when it took one (:meth:`launched`), else the request's
        slot if no later step of it is in flight; otherwise — a later step has advanced the
        slot and no snapshot fitted in memory — nothing is inserted. An unused snapshot is
        freed."""
        cache, step = self.cache, self.anchor_tokens
        for r, snap in stepped:
            n = r.kv_len
            # With speculation a finished request may hold drafts beyond its truncated output.
            fits = self.pool.page_size <= n <= r.num_tokens
            if fits and n % step == 0 and cache.has_state:
                if snap >= 0:
                    cache.insert(r.tokens[:n], r.mem, checkpoint=snap)
                    continue
                if not r.inflight:
                    cache.insert(r.tokens[:n], r.mem)
            elif fits and not cache.has_state and (n % step == 0 or r.finished):
                cache.insert(r.tokens[:n], r.mem)
            if snap >= 0:
                self.pool.free_states([snap])

    def _evict_for(self, targets: list) -> bool:
        """Evict cache entries worth the pages ``targets`` still need (LRU), or, when that
        frees nothing, flush the cache; whether anything was freed (then the step is tried
        again)."""
        pool = self.pool
        pages = sum(max(0, pages_for(t, pool.page_size) - len(mem.pages)) for mem, t in targets)
        per_page = sum(
            pool.layout.unit_bytes(k) for k in (LayerKind.FULL, LayerKind.SWA) if pool.spec.has(k)
        )
        if self.cache.evict(max(1, pages * per_page)).bytes > 0:
            return True
        # Nothing unlocked is left, but entries locked by running requests may still keep
        # memory of their own (checkpoint slots, SWA windows the requests retired): drop all.
        self.cache_flushes += 1
        return self.cache.flush().bytes > 0

    def _retract_newest(self) -> None:
        req = self.running.pop()
        # A step of it still in flight runs before the release in stream order; its results
        # are dropped (new epoch): the request recomputes from what the host has read.
        self._drop_inflight(req)
        self.pool.release([req.mem])
        req.mem = None
        req.kv_len = 0
        req.primed = False
        req.epoch += 1
        req.retractions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.retractions += 1
        self._admission_paused = True
