"""Timing of GPU work for the benchmarks: CUDA events around repeated calls, the median of
several samples (one sample = the mean time per call over ``iters`` calls)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], *, warmup: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` samples of the mean milliseconds per call of ``fn`` (after
    ``warmup`` untimed calls); each sample waits for its own end event only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)
