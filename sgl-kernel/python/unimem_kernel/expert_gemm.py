"""The routed experts' grouped GEMM of a MoE layer, with the kernel chosen by regime.

:func:`expert_linear` computes ``x[rows of e] @ weight[e].T`` for every expert ``e`` over rows
grouped by expert (``offs``: the cumulative end row of each expert, ``torch._grouped_mm``'s
convention). In a decode or verify step an expert owns a few dozen rows, so the product is
bound by reading every expert's weights once, and ``torch._grouped_mm`` (CUTLASS grouped
kernel) streams them well below the memory rate. There the Triton grouped kernel of
:mod:`unimem_kernel.batch_invariant` runs with a tile sized for that regime
(:func:`expert_gemm_config`: 64- or 128-row tiles by the mean rows per expert, so one row
tile covers a typical expert); with many rows per expert (prefill) ``torch._grouped_mm``
runs. The choice depends on the shapes only (host-known: capturable in CUDA graphs; one
compiled kernel per tile and ``(K, N)``).

``UNIMEM_MOE_GEMM=triton`` or ``vendor`` forces one path (``auto``, the default, chooses);
``UNIMEM_KERNEL_BACKEND`` and the device decide as for every op (``_dispatch.kernel_op``).
Either path keeps each row's result independent of the other rows' values; the two round
differently, and neither is the batch-invariant configuration (deterministic inference uses
:func:`unimem_kernel.bi_grouped_linear`, not this function).
"""

from __future__ import annotations

import torch

from unimem_kernel import envs
from unimem_kernel._dispatch import kernel_op
from unimem_kernel.batch_invariant import MatmulConfig, bi_grouped_linear_triton

__all__ = ["expert_gemm_config", "expert_linear", "expert_linear_reference", "expert_linear_triton"]

# Tiles by mean rows per expert, chosen by measurement (docs/decisions.md, the MoE grouped
# GEMM): up to 64 rows per expert (a verify step's typical expert) the 64-row tile, up to 128
# the 128-row tile; above that torch._grouped_mm.
_TILES = (
    (64, MatmulConfig(64, 128, 64, 4, 4, 1)),
    (128, MatmulConfig(128, 128, 64, 8, 3, 1)),
)


def expert_gemm_config(rows: int, num_experts: int, dtype: torch.dtype) -> MatmulConfig | None:
    """The Triton tile for a grouped GEMM of ``rows`` rows over ``num_experts`` experts, or
    ``None`` where ``torch._grouped_mm`` runs (module docstring). ``UNIMEM_MOE_GEMM=triton``
    takes the largest tile of the table beyond its row range."""
    choice = envs.get("UNIMEM_MOE_GEMM")
    if dtype not in (torch.bfloat16, torch.float16) or choice == "vendor":
        return None
    for max_rows, tile in _TILES:
        if rows <= max_rows * num_experts:
            return tile
    return _TILES[-1][1] if choice == "triton" else None


def _rows_of(x: torch.Tensor, rows: torch.Tensor | None) -> int:
    return x.shape[0] if rows is None else rows.shape[0]


def expert_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton grouped kernel with :func:`expert_gemm_config`'s tile (bf16 / fp16)."""
    cfg = expert_gemm_config(_rows_of(x, rows), weight.shape[0], x.dtype)
    if cfg is None:
        raise ValueError(f"no Triton tile for {x.dtype} at these rows (expert_gemm_config)")
    return bi_grouped_linear_triton(x, weight, offs, rows=rows, config=cfg)


def expert_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, N]``: row ``i`` of ``a`` times ``weight[e] [N, K]`` transposed, ``e`` the expert
    owning row ``i`` by ``offs [E]`` (int32, non-decreasing, ``offs[-1] == T``; not checked on
    the device), where ``a = x`` or, with ``rows [T]`` (int64), ``a = x[rows]`` — read by the
    Triton kernel's loads, gathered first for ``torch._grouped_mm``. The Triton kernel runs on
    CUDA where :func:`expert_gemm_config` has a tile; elsewhere ``torch._grouped_mm`` (CUTLASS
    on the GPU: the vendor path, and the reference off CUDA). The caller checks shapes (the
    MoE layer)."""
    a = x if rows is None else x[rows]
    return torch._grouped_mm(a, weight.transpose(-2, -1), offs=offs)


def _has_tile(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None
) -> bool:
    return expert_gemm_config(_rows_of(x, rows), weight.shape[0], x.dtype) is not None


expert_linear = kernel_op(
    "expert_linear",
    triton=expert_linear_triton,
    reference=expert_linear_reference,
    device_of="x",
    check=_has_tile,
)
