"""Aborting a request between steps — waiting, running with a step in flight, or finished —
gives its memory back and leaves every other request's output unchanged."""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=4)


def _engine(cfg, model):
    pool = UnifiedMemory(memory_spec(cfg, 16), 2 << 20, 3, cfg.max_context)
    return EngineCore(model, pool, TorchReferenceBackend(), max_running=2, chunk_size=64)


def _prompts(cfg, n):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, cfg.vocab_size, (n, 30), generator=g).tolist()


def test_abort_waiting_running_and_finished(tiny):
    cfg, model = tiny
    prompts = _prompts(cfg, 4)
    ref = _engine(cfg, model)
    kept = [ref.submit(p, 10) for p in (prompts[0], prompts[3])]
    ref.run()

    eng = _engine(cfg, model)
    reqs = [eng.submit(p, 10) for p in prompts]
    for _ in range(3):
        assert eng.step()
    running, waiting = reqs[1], reqs[2]
    assert running in eng.scheduler.running and running.inflight  # a step in flight
    assert waiting in eng.scheduler.waiting
    assert eng.abort(running) and eng.abort(waiting)
    assert running.finish_reason == waiting.finish_reason == "abort"
    eng.run()
    assert not eng.abort(reqs[0])  # already finished
    assert [r.output for r in (reqs[0], reqs[3])] == [r.output for r in kept]
    assert eng.pool.used_bytes() == 0  # everything came back
    assert not eng.scheduler.running and not eng.scheduler.waiting
