"""Host -> device uploads that never block the host.

Allocation decisions are made on the host (which rows, which page columns, which virtual ids)
and executed by device ops that need them as int32 tensors. Uploading through a pinned
staging tensor and ``non_blocking=True`` keeps the host from waiting: PyTorch's caching host
allocator records the copy on the current stream and does not recycle the pinned block before
the copy has run, so reusing the helper every step is safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _staged(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as an int32 host tensor, pinned when it goes to a CUDA device."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
    return host.pin_memory() if device.type == "cuda" else host


def upload_int32(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """A new int32 device tensor holding ``values``, copied without a host wait."""
    return _staged(values, device).to(device, non_blocking=True)


def upload_int32_into(dst: torch.Tensor, values: Sequence[int] | np.ndarray) -> None:
    """Copy ``values`` into the front of the int32 device tensor ``dst`` (owned by the caller,
    e.g. a CUDA graph's capture-stable input) without a host wait."""
    dst[: len(values)].copy_(_staged(values, dst.device), non_blocking=True)
