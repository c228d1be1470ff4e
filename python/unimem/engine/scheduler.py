"""Continuous batching with admission by capacity, chunked prefill and retraction.

Policy (deterministic: the same requests and the same capacity give the same batches):

- Each step is either an *extend* batch (requests with more than one pending token: prompts,
  in chunks of at most ``chunk_size`` tokens in total per step) or a *decode* batch (every
  running request with exactly one pending token). Extend goes first.
- Admission, FIFO: a waiting request is admitted when fewer than ``max_running`` run and the
  pool can hold its first chunk; the pool says so by returning its memory or None.
- Before a forward, every request of the batch grows to cover the tokens the step writes. If
  the pool cannot serve that, the most recently admitted running request is *retracted*: its
  memory is released and it goes back to the front of the queue, to be recomputed from its
  prompt and the output so far. After a retraction no request is admitted until one finishes
  (otherwise the retracted request would be readmitted at once and thrash).
- Every step, SWA pages behind each request's window are retired (one launch).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from unimem.engine.request import Request, RequestStatus
from unimem.memory.pool import MemoryPool


@dataclass
class Batch:
    """One forward: ``mode`` "extend" or "decode"; request ``reqs[i]`` consumes
    ``lens[i]`` tokens starting at its ``kv_len``."""

    mode: str
    reqs: list[Request]
    lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


class Scheduler:
    def __init__(self, pool: MemoryPool, max_running: int, chunk_size: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.pool = pool
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.retractions = 0
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
            prefill = [r for r in self.running if r.pending > 1]
            batch = self._extend_batch(prefill) if prefill else self._decode_batch()
            targets = [(r.mem, r.kv_len + n) for r, n in zip(batch.reqs, batch.lens, strict=True)]
            if self.pool.grow(targets):
                return batch
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
        done = [r for r in batch.reqs if r.finished]
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
            mem = self.pool.admit(min(req.pending, self.chunk_size))
            if mem is None:
                return
            self.waiting.popleft()
            req.mem = mem
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _extend_batch(self, prefill: list[Request]) -> Batch:
        reqs, lens, budget = [], [], self.chunk_size
        for r in prefill:
            if budget == 0:
                break
            n = min(r.pending, budget)
            reqs.append(r)
            lens.append(n)
            budget -= n
        return Batch("extend", reqs, lens)

    def _decode_batch(self) -> Batch:
        return Batch("decode", list(self.running), [1] * len(self.running))

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
