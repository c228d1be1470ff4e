"""The reference engine: submit requests, step the scheduler, run the model, sample greedily
— one token per step, or, with a :class:`~unimem.spec.chain.DsparkChain`, a verified chain of
up to ``gamma + 1`` tokens per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from unimem.attention.backend import AttentionBackend
from unimem.cache import PrefixCache
from unimem.engine.model import HybridModel
from unimem.engine.request import Request
from unimem.engine.runner import ModelRunner
from unimem.engine.scheduler import Scheduler
from unimem.memory.pool import MemoryPool, pages_for
from unimem.spec.chain import DsparkChain


class Engine:
    """Continuous-batching greedy generation over one memory pool.

    ``submit`` validates a request against the model and the pool and raises ``ValueError``
    naming the problem; a rejected request never enters the queue, so it cannot disturb the
    others.

    ``chain``: decode by chain speculation. The pool must have been built with the drafter's
    draft lanes (``memory_spec(config, page_size, draft_lanes=drafter.config.lanes())``), and
    every request needs ``gamma`` tokens of context beyond its last for the write window.

    ``cache``: a :class:`~unimem.cache.PrefixCache` over ``pool``: requests resume at cached
    prefixes, prefixes are inserted at anchor points and on finish, and the cache is evicted
    before a running request is retracted (see :mod:`unimem.engine.scheduler`).
    """

    def __init__(
        self,
        model: HybridModel,
        pool: MemoryPool,
        backend: AttentionBackend,
        max_running: int,
        chunk_size: int,
        chain: DsparkChain | None = None,
        cache: PrefixCache | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.chain = chain
        self.cache = cache
        if chain is not None:
            c = model.config
            window = c.window if "swa" in c.layer_pattern else None
            chain.drafter.config.check_target(c.vocab_size, c.d_model, c.num_layers, window)
        self.scheduler = Scheduler(
            pool,
            max_running,
            chunk_size,
            gamma=chain.gamma if chain is not None else None,
            cache=cache,
        )
        self.runner = ModelRunner(
            model,
            pool,
            backend,
            max_bs=max_running,
            max_tokens=max(chunk_size, max_running),
            chain=chain,
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
        # With a chain, the last verify's write window reaches gamma tokens past the end.
        total = len(prompt) + max_new_tokens - 1 + (self.chain.gamma if self.chain else 0)
        if total > self.pool.max_context:
            window = f" + write window {self.chain.gamma}" if self.chain else ""
            raise ValueError(
                f"request rejected: prompt {len(prompt)} + output {max_new_tokens} tokens"
                f"{window} exceed the context of {self.pool.max_context}"
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
        step = self.scheduler.chunk_size
        if self.chain is not None:
            step = max(step, self.chain.verify_width)
        return min(total, (pages_for(window, p) + pages_for(step, p) + 1) * p)

    def step(self) -> bool:
        """Run one batch; False when there is nothing left to do."""
        batch = self.scheduler.next_batch()
        if batch is None:
            return False
        if batch.mode == "verify":
            out = self.runner.verify(batch)
            # The step's one host read: accepted counts and the target's tokens together.
            rows = torch.cat([out.accepted.long()[:, None], out.target], dim=1).tolist()
            self.scheduler.complete_verify(batch, [row[1 : row[0] + 2] for row in rows])
            self.steps += 1
            return True
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
