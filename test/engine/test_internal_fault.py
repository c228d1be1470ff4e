"""An internal fault of the allocator fails only the request it met: that request finishes
with ``error`` naming the fault (``finish_reason`` "abort"), every other request's output
is what it would have been without it, and all memory comes back."""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.errors import InternalError
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
    return EngineCore(model, pool, TorchReferenceBackend(), max_running=3, chunk_size=64)


def _prompts(cfg, lengths):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _faulty(pool, when):
    """Make ``pool._alloc`` raise an InternalError (before changing anything) when
    ``when(todo)`` holds."""
    alloc = pool._alloc

    def faulty(todo, n_slots, plan=None):
        if when(todo):
            raise InternalError("planted allocator fault")
        return alloc(todo, n_slots, plan)

    pool._alloc = faulty


def _reference(cfg, model, prompts):
    ref = _engine(cfg, model)
    reqs = [ref.submit(p, 8) for p in prompts]
    ref.run()
    return [r.output for r in reqs]


@pytest.mark.parametrize("where", ["admission", "grow"])
def test_an_internal_fault_fails_only_its_request(tiny, where):
    cfg, model = tiny
    prompts = _prompts(cfg, [30, 46, 30, 30])  # the 46-token one meets the fault
    want = _reference(cfg, model, [prompts[0], prompts[2], prompts[3]])
    eng = _engine(cfg, model)
    reqs = [eng.submit(p, 8) for p in prompts]
    victim = reqs[1]
    if where == "admission":  # its first chunk: 3 pages, no other request asks for 3
        _faulty(eng.pool, lambda todo: any(n == 3 for _, n in todo))
    else:  # once it runs, any grow that includes it
        _faulty(eng.pool, lambda todo: any(req is victim.mem for req, _ in todo))
    eng.run()
    assert victim.finish_reason == "abort"
    assert victim.error is not None and "planted allocator fault" in victim.error
    assert victim.error.startswith("internal error")
    assert [r.output for r in (reqs[0], reqs[2], reqs[3])] == want
    assert all(r.error is None for r in (reqs[0], reqs[2], reqs[3]))
    assert eng.pool.used_bytes() == 0
    assert eng.pool.free_rows == 3
    assert not eng.scheduler.running and not eng.scheduler.waiting
