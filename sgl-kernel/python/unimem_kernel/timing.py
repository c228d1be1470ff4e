"""The one timing helper of the benchmarks (``python -m unimem bench`` suites and the kernel
micro-benchmarks under ``sgl-kernel/benchmark/``).

Two clocks, chosen by the device the work runs on:

- CUDA: events recorded around the calls on the current stream; a sample waits for its own
  end event only, so the host may run ahead of the device as in a serving loop;
- CPU: ``time.perf_counter`` around the calls (the work is synchronous).

A *sample* is the mean milliseconds per call over ``iters`` back-to-back calls; a timing is
the median of ``repeats`` samples after ``warmup`` untimed calls (compiles, autotuning and
the caching allocator's first allocations stay out of it). :func:`graph_median_ms` records
the ``iters`` calls once in a CUDA graph and times replays: the kernels' time without the
host's launch cost, as a captured engine step runs them. :func:`wall_clock` times a whole
run (a benchmark's end-to-end throughput), synchronising a CUDA device at both ends.

Only ``torch`` is imported here, so a kernel benchmark pulls in nothing of the engine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["Stopwatch", "graph_median_ms", "median_ms", "sync", "wall_clock"]


def _is_cuda(device: torch.device | str | None) -> bool:
    """Whether work on ``device`` is timed by CUDA events (``None``: CUDA when available)."""
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on a CUDA ``device`` (no-op for the CPU)."""
    if _is_cuda(device):
        torch.cuda.synchronize()


def _cuda_sample_ms(run: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _cpu_sample_ms(run: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3 / calls


def _median_sample_ms(run: Callable[[], object], calls: int, repeats: int, cuda: bool) -> float:
    """Median over ``repeats`` samples of ``run()``'s milliseconds divided by the ``calls``
    it makes."""
    if repeats < 1 or calls < 1:
        raise ValueError(f"repeats and calls must be >= 1, got {repeats} and {calls}")
    sample = _cuda_sample_ms if cuda else _cpu_sample_ms
    return statistics.median(sample(run, calls) for _ in range(repeats))


def median_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    iters: int = 10,
    repeats: int = 5,
    device: torch.device | str | None = None,
) -> float:
    """Median over ``repeats`` samples of the mean milliseconds per call of ``fn`` (after
    ``warmup`` untimed calls), ``iters`` back-to-back calls per sample; CUDA events when
    ``device`` is CUDA (default: when CUDA is available), else ``perf_counter``."""
    cuda = _is_cuda(device)
    for _ in range(warmup):
        fn()
    sync("cuda" if cuda else "cpu")

    def calls() -> None:
        for _ in range(iters):
            fn()

    return _median_sample_ms(calls, iters, repeats, cuda)


def graph_median_ms(
    fn: Callable[[], object], *, warmup: int = 1, iters: int = 20, repeats: int = 7
) -> float:
    """Like :func:`median_ms`, but the ``iters`` calls are recorded once in a CUDA graph and
    each sample is one replay: the time of the kernels as a captured step runs them, without
    the host's launch cost (which dominates eager calls of kernels of a few µs). ``fn`` must
    be capturable (no host synchronisation; its outputs may be allocated, from the graph's
    pool). Raises ``RuntimeError`` without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("graph_median_ms needs a CUDA device")
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
    return _median_sample_ms(graph.replay, iters, repeats, cuda=True)


@dataclass
class Stopwatch:
    """Seconds counted by :func:`wall_clock` blocks (one block, or the sum of several)."""

    seconds: float = 0.0


@contextmanager
def wall_clock(
    device: torch.device | str | None = "cpu", *, into: Stopwatch | None = None
) -> Iterator[Stopwatch]:
    """Wall-clock seconds of the ``with`` block (``perf_counter``), added to ``into`` (a fresh
    :class:`Stopwatch` by default), which the block gets. With a CUDA ``device`` the device is
    synchronised before the start and before the stop, so the block's queued work counts and
    earlier work does not."""
    watch = Stopwatch() if into is None else into
    sync(device)
    t0 = time.perf_counter()
    try:
        yield watch
    finally:
        sync(device)
        watch.seconds += time.perf_counter() - t0
