"""Choosing between an op's Triton kernel and its torch reference.

Every op in this package has a torch reference with exactly the semantics of its Triton
kernel. The public entry point runs the Triton kernel when its tensors live on a CUDA device
and the reference otherwise. Setting ``UNIMEM_KERNEL_BACKEND=triton`` forces the Triton path on
CPU too (with ``TRITON_INTERPRET=1``: the interpreter, slow, for tests at small sizes);
``UNIMEM_KERNEL_BACKEND=reference`` forces the reference everywhere.
"""

from __future__ import annotations

import os

import torch

_ENV = "UNIMEM_KERNEL_BACKEND"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op whose main tensor is ``t`` should run its Triton kernel."""
    choice = os.environ.get(_ENV, "auto")
    if choice == "triton":
        return True
    if choice == "reference":
        return False
    if choice != "auto":
        raise ValueError(f"{_ENV} must be auto, triton or reference, got {choice!r}")
    return t.is_cuda


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
