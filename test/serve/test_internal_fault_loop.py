"""An internal allocator fault met by one request, through the engine thread: its client
gets an error naming the internal fault, the other requests finish with the outputs they
would have had, and all memory comes back."""

from __future__ import annotations

import threading

import pytest
import tiny_qwen3_next
import tiny_tokenizer

import unimem
from unimem.memory.errors import InternalError
from unimem.serve.engine_loop import Delta, EngineLoop, Submission

TIMEOUT_S = 60


class Collector:
    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.done = threading.Event()

    def __call__(self, delta: Delta) -> None:  # runs on the engine thread
        self.deltas.append(delta)
        if delta.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.tokens]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next_fault")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    eng = unimem.Engine(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=1024,
        max_running_requests=8,
    )
    yield eng
    eng.shutdown()


def test_the_client_of_the_faulty_request_gets_an_internal_error(engine, monkeypatch):
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [9]]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.flush_cache()
    victim = list(range(100, 130))  # 30 tokens: the only admission of 8 pages
    pool = engine.core.pool
    alloc = pool._alloc

    def faulty(todo, n_slots, plan=None):
        if any(n == 8 for _, n in todo):
            raise InternalError("planted allocator fault")
        return alloc(todo, n_slots, plan)

    monkeypatch.setattr(pool, "_alloc", faulty)
    loop = EngineLoop(engine.core)
    loop.start()
    try:
        sinks = []
        for p in [prompts[0], victim, prompts[1], prompts[2]]:
            sink = Collector()
            loop.submit(Submission(p, 6, frozenset(), None, sink))
            sinks.append(sink)
        for sink in sinks:
            assert sink.done.wait(TIMEOUT_S)
        last = sinks[1].deltas[-1]
        assert last.finish_reason == "abort"
        assert last.error is not None and last.error.startswith("internal error")
        assert "planted allocator fault" in last.error
        assert [sinks[i].tokens for i in (0, 2, 3)] == want
        assert all(sinks[i].deltas[-1].error is None for i in (0, 2, 3))
        assert loop.call(lambda core: engine.flush_cache()).result(TIMEOUT_S)
        assert loop.call(lambda core: core.pool.used_bytes()).result(TIMEOUT_S) == 0
    finally:
        loop.stop()
