"""What the Gated DeltaNet kernels share: limits, the accumulation dtype, host-side argument
checks (metadata only, no device read), and the layer table of a ``ReplayCommitPlan``.

Imported by the conv (:mod:`~unimem_kernel.gdn_conv`), delta rule
(:mod:`~unimem_kernel.gdn_rule`, :mod:`~unimem_kernel.gdn_chunked`) and replay commit
(:mod:`~unimem_kernel.gdn_replay`) modules; :mod:`unimem_kernel.gdn` states the contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6
"""Epsilon of the q/k L2 normalisation: ``x / sqrt(sum(x^2) + eps)`` (as the reference)."""

MAX_GRID_YZ = 65535  # CUDA limit of grid axes 1 and 2

_TL_ACC = {torch.float64: tl.float64}


def tl_acc(dtype: torch.dtype):
    """Triton accumulation dtype: float64 for float64 tensors, else float32."""
    return _TL_ACC.get(dtype, tl.float32)


# ---------------------------------------------------------------------------------------------
# host-side checks (metadata only, no device read)
# ---------------------------------------------------------------------------------------------


def check_slots(slots: torch.Tensor, device: torch.device) -> int:
    """``bs``, after checking that ``slots`` is a 1-D int32/int64 tensor on ``device``."""
    if slots.device != device:
        raise ValueError(f"slots on {slots.device}, the states on {device}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be 1-D int32/int64, got {slots.dtype} {tuple(slots.shape)}")
    return slots.shape[0]


def check_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """ValueError naming the first of ``tensors`` (None skipped) not on ``device``."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, the states on {device}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    """ValueError naming ``name`` unless ``t`` has ``shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {tuple(shape)}, got {tuple(t.shape)}")


def init_flags(
    has_initial_state: torch.Tensor | None, bs: int, device: torch.device
) -> torch.Tensor | None:
    """``has_initial_state`` as uint8 (bool and integer tensors accepted; a view for
    bool/uint8, a comparison for other dtypes: the rule kernel takes one pointer dtype)."""
    if has_initial_state is None:
        return None
    check_device(device, has_initial_state=has_initial_state)
    check_shape("has_initial_state", has_initial_state, (bs,))
    if has_initial_state.dtype == torch.bool:
        return has_initial_state.view(torch.uint8)
    if has_initial_state.dtype != torch.uint8:
        return (has_initial_state != 0).view(torch.uint8)
    return has_initial_state


def _max_len(bounds: Sequence[int]) -> int:
    return max((bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)), default=0)


def cu_seqlens_on_device(
    cu_seqlens: torch.Tensor | Sequence[int],
    bs: int,
    device: torch.device,
    max_seqlen: int | None,
) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens on device, max_seqlen)``; a host list is copied to the device, a device
    tensor is read on the host only when ``max_seqlen`` is not given."""
    if isinstance(cu_seqlens, torch.Tensor):
        check_device(device, cu_seqlens=cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be 1-D int32/int64, got {cu_seqlens.dtype}")
        cu = cu_seqlens
        if max_seqlen is None:
            max_seqlen = _max_len(cu.tolist())
    else:
        bounds = list(cu_seqlens)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        if max_seqlen is None:
            max_seqlen = _max_len(bounds)
    if cu.shape[0] != bs + 1:
        raise ValueError(f"cu_seqlens must have bs + 1 = {bs + 1} entries, got {cu.shape[0]}")
    return cu, int(max_seqlen)


def strides_or_zeros(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """``t``'s strides, or ``n`` zeros for an absent tensor (a launch's unused pointer)."""
    return tuple(t.stride()) if t is not None else (0,) * n


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int32 (a copy only for other dtypes: the engine's index tensors are int32)."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` (and ``out`` returned) when ``out`` is given."""
    if out is None:
        return result
    out.copy_(result)
    return out


# ---------------------------------------------------------------------------------------------
# the layer table of a ReplayCommitPlan
# ---------------------------------------------------------------------------------------------


# A ReplayCommitPlan's int32 layer table: a head ``[n_layers, 0]``, then one row per layer of
# six offsets from layer 0's tensors (record y, g, beta, SSM state, record x, conv state) in
# 16-byte units, each as two int32 ``(lo, hi)`` with ``units = hi * 2**31 + lo`` and ``0 <=
# lo < 2**31`` (int32 so that a single-layer launch passes any int32 index tensor as the
# never-read placeholder and every step kind keeps one kernel signature). In 16-byte units
# because the kernel then moves a pointer by ``units * (16 / element size)`` elements, a
# multiple of 16 bytes the compiler can see: layer 0's alignment, hence its vectorised
# loads and stores, holds for every layer (with an offset of unknown divisibility the
# compiler makes the state loads scalar).
TABLE_HEAD = 2
TABLE_OFFSETS = ("y", "g", "beta", "ssm", "x", "conv")
TABLE_ROW = 2 * len(TABLE_OFFSETS)
_TABLE_HEAD = tl.constexpr(TABLE_HEAD)
_TABLE_ROW = tl.constexpr(TABLE_ROW)


@triton.jit
def layer_row(layers_ptr, layer):
    """Row ``layer`` of a layer table (``layers_ptr``): its six offsets, as pairs."""
    return layers_ptr + _TABLE_HEAD + layer * _TABLE_ROW


@triton.jit
def table_offset(row, j: tl.constexpr, ptr):
    """Offset ``j`` of a layer row of the table in elements of ``ptr``'s dtype (int64), a
    multiple of 16 bytes by construction."""
    lo = tl.load(row + 2 * j).to(tl.int64)
    hi = tl.load(row + 2 * j + 1).to(tl.int64)
    per_unit: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
    return (hi * 2147483648 + lo) * per_unit
