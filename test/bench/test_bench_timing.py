"""unimem_kernel.timing on the CPU: medians of per-call samples, wall-clock blocks that add
up, and the CUDA-graph timer refusing to run without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from unimem_kernel.timing import Stopwatch, graph_median_ms, median_ms, wall_clock


def test_median_ms_is_the_time_per_call_after_the_warmup():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    ms = median_ms(fn, warmup=2, iters=3, repeats=3, device="cpu")
    assert len(calls) == 2 + 3 * 3
    assert 1.5 < ms < 50  # 2 ms a call (sleep's lower bound), far below a wrong unit


def test_median_ms_refuses_empty_samples():
    with pytest.raises(ValueError):
        median_ms(lambda: None, warmup=0, iters=0, repeats=1, device="cpu")


def test_wall_clock_adds_into_a_stopwatch():
    total = Stopwatch()
    for _ in range(2):
        with wall_clock(into=total) as watch:
            time.sleep(0.003)
        assert watch is total
    assert 0.005 < total.seconds < 1.0
    with wall_clock() as fresh:
        pass
    assert 0 <= fresh.seconds < total.seconds


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_graph_timer_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        graph_median_ms(lambda: None)
