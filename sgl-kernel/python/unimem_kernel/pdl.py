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

Protocol for a kernel taking part (``PDL: tl.constexpr``): :func:`wait` before its first
global load or store, :func:`launch_dependents` after its last store; launched with
``**launch_options(pdl)``. Both are no-ops without PDL (and in the interpreter).

``UNIMEM_PDL`` (off by default, until measured end to end) turns it on for
:func:`enabled` tensors: CUDA, compute capability 9 or more, not the interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from unimem_kernel import envs

__all__ = ["enabled", "launch_dependents", "launch_options", "wait"]


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` launches with PDL: ``UNIMEM_PDL`` on, ``t`` on a CUDA
    device of compute capability 9+, and not the Triton interpreter."""
    if not envs.get("UNIMEM_PDL") or not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports(t.device.index if t.device.index is not None else 0)


def launch_options(pdl: bool) -> dict:
    """The launch keyword arguments for a kernel launched with (``pdl``) or without PDL."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the predecessor grid (its writes visible) before touching memory (PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the successor grid launch once every program got here or finished (PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
