"""Timing of GPU work for the benchmarks: CUDA events around repeated calls, the median of
several samples (one sample = the mean time per call over ``iters`` calls)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def _median_sample_ms(run: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` samples of ``run()``'s milliseconds (CUDA events) divided by
    the ``calls`` it makes; each sample waits for its own end event only."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def median_ms(fn: Callable[[], object], *, warmup: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` samples of the mean milliseconds per call of ``fn`` (after
    ``warmup`` untimed calls), ``iters`` back-to-back calls per sample."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def calls() -> None:
        for _ in range(iters):
            fn()

    return _median_sample_ms(calls, iters, repeats)


def graph_median_ms(fn: Callable[[], object], *, warmup: int, iters: int, repeats: int) -> float:
    """Like :func:`median_ms`, but the ``iters`` calls are recorded once in a CUDA graph and
    each sample is one replay: the time of the kernels as a captured step runs them, without
    the host's launch cost (which dominates eager calls of kernels of a few µs). ``fn`` must
    be capturable (no host sync; its outputs may be allocated, from the graph's pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, allocator) outside the capture
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _median_sample_ms(graph.replay, iters, repeats)
