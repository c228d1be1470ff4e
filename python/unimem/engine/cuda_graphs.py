"""CUDA graphs of a uniform step (decode or verify), one per batch-size bucket.

A step function ``step(width)`` runs a whole decode or verify step (or the forward half of
one) for the first ``width`` lanes of the runner's capture-stable buffers
(:mod:`unimem.engine.step_io`): it reads its inputs from device buffers only, builds the
step's attention metadata from the live ``v2p`` tables (``MetadataBuilder.decode``/
``verify``), runs every kernel and writes its outputs into fixed buffers, or returns them.
It never reads the device on the host and allocates only from the caching allocator — so it
can be recorded. What the recorded call returned stays valid for every replay of that
bucket (:meth:`StepGraphs.replay` returns it): tensors the graph writes on each replay.

:class:`StepGraphs` records it once per bucket and replays the smallest bucket that holds a
batch; the lanes past the batch are padding (row 0, slot -1: sink reads, no state writes).

Capture protocol, per bucket, largest first (one shared memory pool):

1. pad every lane (``prepare(width)``);
2. run the step eagerly once: every Triton kernel and every FA4 variant of this width
   compiles here — a first compile inside a capture breaks it;
3. record it under ``torch.cuda.graph``.

The warm-up run reads and writes only the padding row and the sinks, so capturing is safe at
any time, also with requests in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["StepGraphs", "default_buckets"]


def default_buckets(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself): at
    most 7 padded lanes above 8 requests."""
    sizes = {b for b in (1, 2, 4) if b < max_bs}
    sizes.update(range(8, max_bs + 1, 8))
    sizes.add(max_bs)
    return tuple(sorted(sizes))


class StepGraphs:
    """Recorded ``step(width)`` for each of ``buckets`` (module docstring), in ``pool`` (a
    memory pool handle shared with other graphs that never replay at the same time; default:
    a new one)."""

    def __init__(
        self,
        step: Callable[[int], object],
        prepare: Callable[[int], None],
        buckets: Sequence[int],
        device: torch.device,
        pool: tuple | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive ints, got {tuple(buckets)!r}")
        self.buckets = tuple(sorted(set(buckets)))
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        """What the recorded ``step(width)`` returned, per bucket."""
        # graphs that never replay at once may share one pool: their outputs are either in
        # the runner's fixed buffers or held here (tensors of the pool that later captures
        # do not reuse), and are read before any other graph of the pool replays
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        pool = self.pool
        side = torch.cuda.Stream(device)
        for width in reversed(self.buckets):
            prepare(width)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step(width)  # warm-up: compiles every kernel variant of this width
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[width] = step(width)
            self.graphs[width] = graph
        torch.cuda.synchronize(device)

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket(self, bs: int) -> int:
        """The smallest captured width that holds ``bs`` lanes."""
        for width in self.buckets:
            if width >= bs:
                return width
        raise ValueError(f"batch of {bs} exceeds the largest captured batch {self.max_bs}")

    def replay(self, width: int) -> object:
        """Replay bucket ``width``; returns what its recorded step returned (now rewritten
        by this replay)."""
        self.graphs[width].replay()
        return self.outputs[width]
