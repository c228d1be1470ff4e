"""The engine thread on its own (no HTTP): deltas add up to ``unimem.Engine``'s outputs, an
abort ends a running request with its memory back (once the prefix cache, on by default, is
flushed), a request the core refuses is answered with an error, and stopping the loop aborts
what runs."""

from __future__ import annotations

import threading
import time

import pytest
import tiny_qwen3_next
import tiny_tokenizer

import unimem
from unimem.serve.engine_loop import Delta, EngineLoop, Submission

TIMEOUT_S = 60


class Collector:
    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.first = threading.Event()
        self.done = threading.Event()

    def __call__(self, delta: Delta) -> None:  # runs on the engine thread
        self.deltas.append(delta)
        self.first.set()
        if delta.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.tokens]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next_loop")
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


def _submit(loop: EngineLoop, prompt, n: int) -> tuple[object, Collector]:
    sink = Collector()
    return loop.submit(Submission(prompt, n, frozenset(), None, sink)), sink


def test_deltas_add_up_to_engine_outputs_and_abort_returns_memory(engine):
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [9]]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    loop = EngineLoop(engine.core)
    loop.start()
    try:
        runs = [_submit(loop, p, 10) for p in prompts]
        for _, sink in runs:
            assert sink.done.wait(TIMEOUT_S)
        assert [sink.tokens for _, sink in runs] == want
        assert all(sink.deltas[-1].finish_reason == "length" for _, sink in runs)
        # a long request, aborted once it produced something
        handle, sink = _submit(loop, [5, 6], 200)
        assert sink.first.wait(TIMEOUT_S)
        loop.abort(handle)
        assert sink.done.wait(TIMEOUT_S)
        assert sink.deltas[-1].finish_reason == "abort" and len(sink.tokens) < 200
        assert loop.call(lambda core: engine.flush_cache()).result(TIMEOUT_S)
        assert loop.call(lambda core: core.pool.used_bytes()).result(TIMEOUT_S) == 0
        # a call is answered after the snapshot that shows its effect is published (slowed
        # down here: an answer before it would leave a caller reading the old state)
        publish = loop._publish
        loop._publish = lambda: (time.sleep(0.2), publish())
        mem = loop.call(lambda core: core.pool.admit(8)).result(TIMEOUT_S)
        assert mem is not None and loop.snapshot()["used_bytes"] > 0
        loop.call(lambda core: core.pool.release([mem])).result(TIMEOUT_S)
        assert loop.snapshot()["used_bytes"] == 0
        loop._publish = publish
        assert loop.snapshot()["requests_finished"] == {"length": 3, "abort": 1}
        # the core refuses it (HTTP checks skipped): an error, nothing queued
        bad, sink = _submit(loop, [5, 10**6], 4)
        assert sink.done.wait(TIMEOUT_S)
        assert sink.deltas[-1].error and "outside the vocabulary" in sink.deltas[-1].error
        # stopping aborts what runs
        handle, sink = _submit(loop, [7, 8], 200)
        assert sink.first.wait(TIMEOUT_S)
    finally:
        loop.stop()
    assert sink.done.is_set() and sink.deltas[-1].finish_reason == "abort"
    assert engine.flush_cache()  # the thread has stopped: the engine is ours


def test_the_snapshot_says_where_the_engine_threads_time_went(engine):
    """Working iterations are counted and timed (their wall time, the steps' wall and CPU
    time inside them); an idle loop adds none."""
    loop = EngineLoop(engine.core)
    assert loop.snapshot()["engine_time"] == {
        "iterations": 0, "iteration_seconds": 0.0, "step_seconds": 0.0, "step_cpu_seconds": 0.0,
    }  # fmt: skip
    loop.start()
    try:
        _, sink = _submit(loop, [5, 6, 7], 12)
        assert sink.done.wait(TIMEOUT_S)
        # the snapshot is published inside an iteration: one more brings this one's time in
        assert loop.call(lambda core: None).result(TIMEOUT_S) is None
        t = loop.snapshot()["engine_time"]
        assert t["iterations"] >= 12  # a prefill and eleven decode steps at least
        assert 0 < t["step_seconds"] <= t["iteration_seconds"]
        assert 0 < t["step_cpu_seconds"] <= t["step_seconds"] + 1e-3
        time.sleep(0.3)  # idle: nothing is added
        assert loop.call(lambda core: None).result(TIMEOUT_S) is None
        later = loop.snapshot()["engine_time"]
        assert 1 <= later["iterations"] - t["iterations"] <= 2  # the calls', no idle ones
    finally:
        loop.stop()
    assert engine.pool.used_bytes() == 0
    late = Collector()
    loop.submit(Submission([5], 2, frozenset(), None, late))
    assert late.deltas[-1].error  # refused after stop


def test_stream_interval_batches_a_requests_tokens(engine):
    """``stream_interval`` 3: a request's first token goes out at once, then deltas of at
    least 3 tokens, the rest with its end; they add up to the same outputs."""
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    params = {"max_new_tokens": 11, "temperature": 0.0, "ignore_eos": True}
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with pytest.raises(ValueError, match="stream_interval"):
        EngineLoop(engine.core, stream_interval=0)
    loop = EngineLoop(engine.core, stream_interval=3)
    loop.start()
    try:
        runs = [_submit(loop, p, 11) for p in prompts]
        for _, sink in runs:
            assert sink.done.wait(TIMEOUT_S)
    finally:
        loop.stop()
    assert [sink.tokens for _, sink in runs] == want
    for _, sink in runs:
        sizes = [len(d.tokens) for d in sink.deltas]
        assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]), sizes
        assert len(sizes) <= 1 + -(-10 // 3) and sink.deltas[-1].finish_reason == "length"


def test_a_requests_own_stream_interval(engine):
    """A submission's ``stream_interval`` (what a whole-body response asks for) overrides
    the loop's: its first token at once, the rest with its end."""
    loop = EngineLoop(engine.core)
    loop.start()
    try:
        sink = Collector()
        loop.submit(Submission([5, 6, 7], 11, frozenset(), None, sink, stream_interval=50))
        assert sink.done.wait(TIMEOUT_S)
    finally:
        loop.stop()
    assert [len(d.tokens) for d in sink.deltas] == [1, 10]
