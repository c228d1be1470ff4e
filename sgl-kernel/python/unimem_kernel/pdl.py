"""Programmatic dependent launch (PDL) for the kernels of a small decode step.

A decode step of a small model at one request is ~140 kernels of a few µs inside one CUDA
graph; between two of them the GPU idles for the launch of the next (~1.2 µs on an H100,
``docs/results.md``). With PDL (SM90+), a kernel launched with the programmatic-serialization
attribute may start while its predecessor finishes: its programs execute
``griddepcontrol.wait`` before they touch memory (it returns once the predecessor grid has
completed and its writes are visible), and the predecessor executes
``griddepcontrol.launch_dependents`` when its programs are done storing, which lets the
successor's launch overlap the predecessor's tail. The results are those of plain launches;
only the gap shrinks. A micro-benchmark of chains of Triton kernels measured 0.2-0.45 µs saved
a boundary (H200, ``docs/results/bench_pdl_h200.json``).

Protocol for a kernel taking part (``PDL: tl.constexpr``, the :func:`mode`): :func:`wait`
before its first store and before its first load of anything its immediate predecessor may
write — that kernel may still be running, and its writes are visible only after the wait.
Loads of what the step's earlier kernels wrote, or of what nothing writes, may precede it:
weights, and the step's attention metadata and slots, which the metadata builder writes at
the start of the step, never the kernel just before an attention layer's. Then
:func:`launch_dependents` after its last store; launched with ``**launch_options(mode)``.
Both are no-ops without PDL (and in the interpreter).

Two places to let the successor launch (``UNIMEM_PDL``): ``1``, after the kernel's last store;
``early``, right after its wait. The successor's own wait returns only once this grid has
completed and flushed, so both give the same results; ``early`` lets the successor's
programs become resident and run their prologue (weight loads) while this grid still runs.
The signal takes effect once every program of the grid has given it, so a grid of more
programs than fit at once is never starved by waiting successors. Triggering only after the
wait keeps the guarantee transitive: when a successor starts, every kernel before this one
has completed.

``UNIMEM_PDL`` (default ``early``; ``1``, or ``0`` for plain launches) applies to tensors on
CUDA devices of compute capability 9 or more, outside the interpreter (:func:`mode`).
Measured end to end (Gemma 3 270M, one request, H100, ``docs/results/decode_floor_pdl_h100.json``):
1 310 tok/s plain, 1 375 after stores, 1 566 early, the same tokens.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from unimem_kernel import envs

__all__ = [
    "AFTER_STORES",
    "EARLY",
    "OFF",
    "launch_dependents",
    "launch_options",
    "mode",
    "triton_supports_pdl",
    "wait",
]

OFF, AFTER_STORES, EARLY = 0, 1, 2
"""The modes (the kernels' ``PDL`` constexpr): plain launches; PDL with the successor let in
after the last store; PDL with the successor let in right after the wait."""


@functools.cache
def _device_supports(index: int) -> bool:
    """An NVIDIA device of compute capability 9+ (ROCm reports its own architecture numbers
    through the same call and has no griddepcontrol)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def triton_supports_pdl() -> bool:
    """Whether this Triton has the ``griddepcontrol`` intrinsics (``tl.extra.cuda.gdc_*``,
    Triton 3.3 and later)."""
    cuda = getattr(tl.extra, "cuda", None)
    return all(hasattr(cuda, f) for f in ("gdc_wait", "gdc_launch_dependents"))


def mode(t: torch.Tensor) -> int:
    """The PDL mode of a kernel over ``t``: ``UNIMEM_PDL``'s (:data:`AFTER_STORES` or
    :data:`EARLY`) for a tensor on a CUDA device of compute capability 9+ outside the Triton
    interpreter, else :data:`OFF`. With a Triton that has no PDL intrinsics the default is
    off, and ``UNIMEM_PDL`` set on is a ``ValueError`` naming the version."""
    wanted = envs.get("UNIMEM_PDL")
    if wanted == OFF or not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return OFF
    if not _device_supports(t.device.index if t.device.index is not None else 0):
        return OFF
    if not triton_supports_pdl():
        if envs.is_set("UNIMEM_PDL"):
            raise ValueError(
                f"UNIMEM_PDL={os.environ['UNIMEM_PDL']} needs Triton 3.3 or later "
                f"(programmatic dependent launch); this is Triton {triton.__version__}"
            )
        return OFF
    return wanted


def launch_options(pdl_mode: int) -> dict:
    """The launch keyword arguments for a kernel launched in ``pdl_mode`` (any true value:
    with PDL)."""
    return {"launch_pdl": True} if pdl_mode else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the predecessor grid (its writes visible); in :data:`EARLY` mode then let
    the successor launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """After the last store: let the successor launch (:data:`AFTER_STORES` mode)."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
