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
- Every step, SWA pages behind each request's window are retired (one launch).

With a :class:`~unimem.cache.PrefixCache` (``cache``):

- admission goes through ``cache.admit``: a request resumes at the longest cached prefix of
  the tokens its extend computes (its ``kv_len`` and ``cached_tokens`` start there);
- an extend chunk that crosses an anchor point (a multiple of ``page_size *
  checkpoint_interval`` tokens) is cut there, so that chunk boundaries are checkpoints;
- after every step, a request whose committed length is on an anchor point is inserted into
  the cache, and a finished request is inserted before it is released (both before SWA
  retirement: the window behind the insertion point must still be held);
- when a step cannot be served, the cache evicts first (LRU); if that frees nothing, the
  cache is flushed (entries locked by running requests still keep checkpoint slots and SWA
  windows of their own); a running request is retracted only when neither freed anything.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unimem.engine.request import Request, RequestStatus
from unimem.memory.pool import MemoryPool, pages_for
from unimem.memory.spec import LayerKind

if TYPE_CHECKING:
    from unimem.cache import PrefixCache


@dataclass
class Batch:
    """One forward: ``mode`` "extend", "decode" or "verify"; request ``reqs[i]`` consumes
    ``lens[i]`` tokens starting at its ``kv_len`` (verify: its write window of ``gamma + 1``
    tokens, of which the step commits ``accepted + 1``)."""

    mode: str
    reqs: list[Request]
    lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


class Scheduler:
    def __init__(
        self,
        pool: MemoryPool,
        max_running: int,
        chunk_size: int,
        gamma: int | None = None,
        cache: PrefixCache | None = None,
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
        # Anchor points of the cache: committed lengths that are multiples of this.
        self.anchor_tokens = pool.page_size * cache.checkpoint_interval if cache else 0
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.retractions = 0
        self.cache_flushes = 0
        self._admission_paused = False

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- one step --------------------------------------------------------------------------------

    def next_batch(self) -> Batch | None:
        """The next forward to run, with memory for it already reserved; None when idle."""
        self._admit()
        while self.running:
            prefill = [r for r in self.running if self._needs_extend(r)]
            batch = self._extend_batch(prefill) if prefill else self._decode_batch()
            targets = [(r.mem, r.kv_len + n) for r, n in zip(batch.reqs, batch.lens, strict=True)]
            if self.pool.grow(targets):
                return batch
            if self.cache is not None and self._evict_for(targets):
                continue
            self._retract_newest()
        if self.waiting:
            raise RuntimeError("no request can run: the pool cannot hold even one request")
        return None

    def complete(self, batch: Batch, new_tokens: list[int | None]) -> None:
        """Account a finished forward: advance lengths, append sampled tokens, retire SWA
        pages, release finished requests. ``new_tokens[i]`` is None for a request whose chunk
        did not reach the end of its tokens."""
        for req, n, tok in zip(batch.reqs, batch.lens, new_tokens, strict=True):
            req.kv_len += n
            req.forward_steps += 1
            if tok is not None:
                req.output.append(tok)
        self._end_step(batch)

    def complete_verify(self, batch: Batch, committed: list[list[int]]) -> None:
        """Account a verify step: ``committed[i]`` are the ``accepted + 1`` tokens request
        ``i`` committed (accepted drafts, then the bonus). Its length advances by that many
        (the anchor and the accepted drafts are now in memory; the bonus is the next anchor);
        output beyond ``max_new_tokens`` is dropped. Then as :meth:`complete`."""
        for req, toks in zip(batch.reqs, committed, strict=True):
            req.kv_len += len(toks)
            req.forward_steps += 1
            req.verify_steps += 1
            req.verified_tokens += len(toks)
            req.output.extend(toks[: req.max_new_tokens - len(req.output)])
        self._end_step(batch)

    def _end_step(self, batch: Batch) -> None:
        done = [r for r in batch.reqs if r.finished]
        if self.cache is not None:
            self._insert(batch.reqs)
        self.pool.retire_swa([(r.mem, r.kv_len) for r in batch.reqs if not r.finished])
        if done:
            self.pool.release([r.mem for r in done])
            for r in done:
                r.mem = None
                r.status = RequestStatus.FINISHED
                self.running.remove(r)
                self.finished.append(r)
            self._admission_paused = False

    # --- policy pieces ---------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and not self._admission_paused:
            req = self.waiting[0]
            if self.cache is None:
                mem = self.pool.admit(min(self._extend_len(req), self.chunk_size))
                prefix = 0
            else:
                adm = self.cache.admit(req.tokens[: self._extend_end(req)], self.chunk_size)
                mem, prefix = (adm.mem, adm.prefix_tokens) if adm is not None else (None, 0)
            if mem is None:
                return
            self.waiting.popleft()
            req.mem = mem
            req.kv_len = prefix
            req.cached_tokens += prefix
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _needs_extend(self, r: Request) -> bool:
        """Whether ``r``'s next forward is an extend: without speculation, while more than
        one token is pending; with it, until it holds :meth:`_spec_extend_end` tokens."""
        if self.gamma is None:
            return r.pending > 1
        return r.kv_len < self._spec_extend_end(r)

    @staticmethod
    def _spec_extend_end(r: Request) -> int:
        """With speculation, the tokens ``r`` holds before it verifies: all when it has no
        output yet (the prefill samples its first token), else all but its anchor."""
        return r.num_tokens - 1 if r.output else r.num_tokens

    def _extend_end(self, r: Request) -> int:
        """The tokens ``r`` holds when its extends are done."""
        return r.num_tokens if self.gamma is None else self._spec_extend_end(r)

    def _extend_batch(self, prefill: list[Request]) -> Batch:
        reqs, lens, budget = [], [], self.chunk_size
        for r in prefill:
            if budget == 0:
                break
            n = min(self._extend_len(r), budget)
            if self.anchor_tokens:
                # End the chunk on the last anchor point it crosses (a checkpoint there).
                cut = (r.kv_len + n) // self.anchor_tokens * self.anchor_tokens
                if cut > r.kv_len:
                    n = cut - r.kv_len
            reqs.append(r)
            lens.append(n)
            budget -= n
        return Batch("extend", reqs, lens)

    def _extend_len(self, r: Request) -> int:
        """Tokens an extend of ``r`` has left to consume: up to the end of its tokens without
        speculation (the last chunk samples), up to :meth:`_spec_extend_end` with it."""
        return r.pending if self.gamma is None else self._spec_extend_end(r) - r.kv_len

    def _decode_batch(self) -> Batch:
        reqs = list(self.running)
        if self.gamma is None:
            return Batch("decode", reqs, [1] * len(reqs))
        return Batch("verify", reqs, [self.gamma + 1] * len(reqs))

    def _insert(self, reqs: list[Request]) -> None:
        """Cache the committed prefix of every request on an anchor point, and of finished
        ones (a model without STATE layers can resume inside; with them, only on anchors)."""
        cache, step = self.cache, self.anchor_tokens
        for r in reqs:
            n = r.kv_len
            # With speculation a finished request may hold drafts beyond its truncated output.
            if n < self.pool.page_size or n > r.num_tokens:
                continue
            if n % step == 0 or (r.finished and not cache.has_state):
                cache.insert(r.tokens[:n], r.mem)

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
        self.pool.release([req.mem])
        req.mem = None
        req.kv_len = 0
        req.retractions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.retractions += 1
        self._admission_paused = True
