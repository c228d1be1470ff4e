"""Fixed homes for what a recorded half-step leaves to the eager half after it.

A CUDA graph's outputs live in its memory pool, and a step recorded per batch bucket holds
one set per bucket: outputs that grow with the batch (hidden rows, a draft block's
distributions) would be held once for every bucket and step kind. :class:`StableOutputs`
gives each named output one buffer instead, allocated at its first — largest — call and
reused as a prefix view by every smaller one, so the outputs of all buckets share it. It
serves only steps that never run at once (one stream, one step at a time), which is how the
runner replays its graphs.
"""

from __future__ import annotations

import torch

__all__ = ["StableOutputs"]


class StableOutputs:
    """Named capture-stable buffers (module docstring). :meth:`keep` copies a tensor into
    its name's buffer and returns the view holding it; the first call of a name allocates
    the buffer with that call's shape, so the caller records its largest width first (as
    :class:`~unimem.engine.cuda_graphs.StepGraphs` does). Owner: the runner (or the verify
    step) whose recorded forwards write them; the eager half after a replay reads them
    before the next step writes them again."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def keep(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into the first ``value.shape[0]`` rows of ``name``'s buffer;
        returns that view. ``ValueError`` naming ``name`` for a dtype, device or row shape
        unlike the buffer's, or more rows than it holds (a larger width recorded after a
        smaller one)."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = torch.empty_like(
                value, memory_format=torch.contiguous_format
            )
        if (
            buf.dtype != value.dtype
            or buf.device != value.device
            or buf.shape[1:] != value.shape[1:]
            or value.shape[0] > buf.shape[0]
        ):
            raise ValueError(
                f"stable output {name!r} holds {tuple(buf.shape)} {buf.dtype} on {buf.device}; "
                f"got {tuple(value.shape)} {value.dtype} on {value.device} (record the "
                "largest width first)"
            )
        view = buf[: value.shape[0]]
        view.copy_(value)
        return view

    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
