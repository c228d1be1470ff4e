"""What the fused model ops share: their dispatch rule, dtypes and argument checks.

The fused ops (:mod:`unimem_kernel.fused`) take fp16, bf16 and fp32 tensors in their kernels;
float64 runs their references. :func:`use_triton` is the package's dispatch rule under the
``UNIMEM_FUSED_OPS`` switch (off: every fused op runs its reference, the unfused torch code),
which the models also consult before calling a fused op.
"""

from __future__ import annotations

import torch

from unimem_kernel import _dispatch

__all__ = [
    "FLOAT_DTYPES",
    "FUSED_SWITCH",
    "KERNEL_DTYPES",
    "acc_dtype",
    "check_device",
    "check_float",
    "check_heads_like",
    "unit_last",
    "unit_stride_rows",
    "use_triton",
]

FUSED_SWITCH = "UNIMEM_FUSED_OPS"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (*KERNEL_DTYPES, torch.float64)


def use_triton(t: torch.Tensor) -> bool:
    """The package's dispatch rule for a fused op whose main tensor is ``t``, unless
    ``UNIMEM_FUSED_OPS=off`` (module docstring)."""
    return _dispatch.use_triton(t, FUSED_SWITCH)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references' arithmetic dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_float(name: str, t: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``t`` is a tensor of a float dtype the ops take."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    """ValueError unless ``t`` (called ``name``) is on ``ref``'s device."""
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_heads_like(o: torch.Tensor, other: torch.Tensor, name: str) -> None:
    """``o [T, H, D]`` and ``other`` (called ``name``) of its shape, dtype and device."""
    check_float("o", o)
    check_float(name, other)
    if o.dim() != 3:
        raise ValueError(f"o must be [T, H, D], got shape {tuple(o.shape)}")
    if other.shape != o.shape:
        raise ValueError(f"{name} must have o's shape {tuple(o.shape)}, got {tuple(other.shape)}")
    if other.dtype != o.dtype:
        raise ValueError(f"{name} must have o's dtype {o.dtype}, got {other.dtype}")
    check_device(name, other, o, "o")


def unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, x.shape[-1]]`` with unit stride along the last dim (a view where the
    layout allows, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last dim (itself where it has one, else a copy)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()
