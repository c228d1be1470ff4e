"""The reference engine: submit requests, step the scheduler, run the model, sample greedily."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from unimem.attention.backend import AttentionBackend
from unimem.engine.model import HybridModel
from unimem.engine.request import Request
from unimem.engine.runner import ModelRunner
from unimem.engine.scheduler import Scheduler
from unimem.memory.pool import MemoryPool, pages_for


class Engine:
    """Continuous-batching greedy generation over one memory pool.

    ``submit`` validates a request against the model and the pool and raises ``ValueError``
    naming the problem; a rejected request never enters the queue, so it cannot disturb the
    others.
    """

    def __init__(
        self,
        model: HybridModel,
        pool: MemoryPool,
        backend: AttentionBackend,
        max_running: int,
        chunk_size: int,
    ) -> None:
        self.model = model
        self.pool = pool
        self.scheduler = Scheduler(pool, max_running, chunk_size)
        self.runner = ModelRunner(
            model, pool, backend, max_bs=max_running, max_tokens=max(chunk_size, max_running)
        )
        self._next_rid = 0
        self.steps = 0

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        c = self.model.config
        if len(prompt) == 0:
            raise ValueError("request rejected: the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"request rejected: output length must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt if not 0 <= int(t) < c.vocab_size]
        if bad:
            raise ValueError(
                f"request rejected: token id {bad[0]} outside the vocabulary [0, {c.vocab_size})"
            )
        total = len(prompt) + max_new_tokens - 1
        if total > self.pool.max_context:
            raise ValueError(
                f"request rejected: prompt {len(prompt)} + output {max_new_tokens} tokens exceed "
                f"the context of {self.pool.max_context}"
            )
        if not self.pool.fits_alone(total, self._swa_peak_tokens(total)):
            raise ValueError(
                f"request rejected: {total} tokens do not fit in the memory even alone"
            )
        req = Request(self._next_rid, [int(t) for t in prompt], max_new_tokens)
        self._next_rid += 1
        self.scheduler.add(req)
        return req

    def _swa_peak_tokens(self, total: int) -> int:
        """Most SWA tokens a request holds at once: its window behind the oldest query of a
        step plus the step's chunk, page-rounded."""
        window = self.pool.swa_window or 0
        p = self.pool.page_size
        return min(total, (pages_for(window, p) + pages_for(self.scheduler.chunk_size, p) + 1) * p)

    def step(self) -> bool:
        """Run one batch; False when there is nothing left to do."""
        batch = self.scheduler.next_batch()
        if batch is None:
            return False
        logits = self.runner.forward(batch)
        sampled = torch.argmax(logits, dim=-1).tolist()
        new_tokens = [
            tok if r.kv_len + n == r.num_tokens else None
            for r, n, tok in zip(batch.reqs, batch.lens, sampled, strict=True)
        ]
        self.scheduler.complete(batch, new_tokens)
        self.steps += 1
        return True

    def run(self, on_step: Callable[[Engine], None] | None = None) -> list[Request]:
        """Step until every submitted request finished; returns them in finishing order."""
        while self.step():
            if on_step is not None:
                on_step(self)
        return self.scheduler.finished
