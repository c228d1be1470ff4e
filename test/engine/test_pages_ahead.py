"""The scheduler asks the pool for one page ahead of each request when a step needs pages
(``MemoryPool.grow``'s ``reserve``): a decoding batch then allocates once per several page
boundaries instead of at every request's own, with the same tokens; while requests wait for
admission it asks for nothing ahead (their admission comes first)."""

from __future__ import annotations

import pytest

import unimem
from unimem.memory.pool import MemoryPool

PROMPTS = [[5 + i] * (3 + i) for i in range(8)]  # staggered lengths: staggered page boundaries


def _run(gemma2_ckpt, unified: bool, monkeypatch, ahead: bool, max_running: int = 8):
    """Outputs of 8 requests x 40 tokens, the pool's allocations, and the reserves asked."""
    allocs, reserves = [], []
    grow = MemoryPool.grow

    def counting_grow(self, batch, reserve=None):
        reserves.append((reserve, len(eng.core.scheduler.waiting)))
        return grow(self, batch, reserve if ahead else None)

    with monkeypatch.context() as m:
        m.setattr(MemoryPool, "grow", counting_grow)
        eng = unimem.Engine(model_path=str(gemma2_ckpt), device="cpu", dtype="float32", page_size=4,
                            enable_unified_memory=unified, attention_backend="torch",
                            max_running_requests=max_running)  # fmt: skip
        alloc = type(eng.pool)._alloc
        m.setattr(type(eng.pool), "_alloc", lambda self, *a: allocs.append(1) or alloc(self, *a))
        outs = eng.generate(input_ids=PROMPTS,
                            sampling_params={"max_new_tokens": 40, "ignore_eos": True})  # fmt: skip
        eng.shutdown()
    return [o["output_ids"] for o in outs], len(allocs), reserves


@pytest.mark.parametrize("unified", [False, True], ids=["static", "unified"])
def test_pages_ahead_cut_allocations_and_keep_the_tokens(gemma2_ckpt, monkeypatch, unified):
    outs, n_ahead, _ = _run(gemma2_ckpt, unified, monkeypatch, ahead=True)
    plain, n_plain, _ = _run(gemma2_ckpt, unified, monkeypatch, ahead=False)
    assert outs == plain
    assert n_ahead * 2 <= n_plain, (n_ahead, n_plain)


def test_nothing_ahead_while_requests_wait(gemma2_ckpt, monkeypatch):
    outs, _, reserves = _run(gemma2_ckpt, False, monkeypatch, ahead=True, max_running=3)
    assert all(len(o) == 40 for o in outs)
    assert all(r is None for r, waiting in reserves if waiting)
    assert any(r is not None for r, waiting in reserves if not waiting)
