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

``UNIMEM_MOE_GEMM=triton`` or ``vendor`` forces one path (``auto``, the default, chooses).
Either path keeps each row's result independent of the other rows' values; the two round
differently, and neither is the batch-invariant configuration (deterministic inference uses
:func:`unimem_kernel.bi_grouped_linear`, not this function).
"""

from __future__ import annotations

import os

import torch

from unimem_kernel._dispatch import use_triton
from unimem_kernel.batch_invariant import MatmulConfig, bi_grouped_linear_triton

__all__ = ["expert_gemm_config", "expert_linear"]

_ENV = "UNIMEM_MOE_GEMM"
# Tiles by mean rows per expert, measured on the H200 (benchmark/bench_moe_gemm.py, Qwen3-Next
# bench sizes: 64 experts of width 512, d 2048; docs/benchmarks.md): up to 64 rows (a verify
# step of 48 requests x 8 tokens is 48) the 64-row tile, 1.2-1.4x torch._grouped_mm; up to
# 128 the 128-row tile (1.03-1.17x); above that torch._grouped_mm is faster (at 192 rows by
# 1.1-1.35x, at 512 by 1.2-1.6x).
_TILES = (
    (64, MatmulConfig(64, 128, 64, 4, 4, 1)),
    (128, MatmulConfig(128, 128, 64, 8, 3, 1)),
)


def expert_gemm_config(rows: int, num_experts: int, dtype: torch.dtype) -> MatmulConfig | None:
    """The Triton tile for a grouped GEMM of ``rows`` rows over ``num_experts`` experts, or
    ``None`` where ``torch._grouped_mm`` runs (module docstring). ``UNIMEM_MOE_GEMM=triton``
    takes the largest tile of the table beyond its row range."""
    choice = os.environ.get(_ENV, "auto")
    if choice not in ("auto", "triton", "vendor"):
        raise ValueError(f"{_ENV} must be auto, triton or vendor, got {choice!r}")
    if dtype not in (torch.bfloat16, torch.float16) or choice == "vendor":
        return None
    for max_rows, tile in _TILES:
        if rows <= max_rows * num_experts:
            return tile
    return _TILES[-1][1] if choice == "triton" else None


def expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, N]``: row ``i`` of ``a`` times ``weight[e] [N, K]`` transposed, ``e`` the expert
    owning row ``i`` by ``offs [E]`` (int32, non-decreasing, ``offs[-1] == T``; not checked on
    the device), where ``a = x`` or, with ``rows [T]`` (int64), ``a = x[rows]`` — read by the
    Triton kernel's loads, gathered first for ``torch._grouped_mm``. The caller checks shapes
    (the MoE layer)."""
    t = x.shape[0] if rows is None else rows.shape[0]
    cfg = expert_gemm_config(t, weight.shape[0], x.dtype) if use_triton(x) else None
    if cfg is None:
        a = x if rows is None else x[rows]
        return torch._grouped_mm(a, weight.transpose(-2, -1), offs=offs)
    return bi_grouped_linear_triton(x, weight, offs, config=cfg, rows=rows)
