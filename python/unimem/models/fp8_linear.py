"""FP8 linears in the models: the weight format and the products that use it.

Format. A quantised linear keeps its parameter name and shape with dtype
``torch.float8_e4m3fn`` and gains a float32 sibling ``<name>_scale_inv`` with one scale per
row and group of 128 columns: ``weight [N, K]`` -> ``weight_scale_inv [N, KG]``, stacked
experts ``gate_up_proj [E, 2I, d]`` -> ``gate_up_proj_scale_inv [E, 2I, KG]``
(:mod:`unimem_kernel.fp8_gemm`). A checkpoint's ``[128, 128]`` block scales are expanded to
rows on the way in (:func:`expand_block_scales`), so the models' own re-layouts of rows
(Qwen3-Next's per-key-head groups, stacked projections, per-expert pieces) apply to weights
and scales alike and no row range depends on block alignment.

Block tables. A 2-D FP8 weight whose scales are uniform over each 128-row block (online
quantisation, and the hub's checkpoints unless a model moved rows across block boundaries)
also gets, after loading, a non-persistent buffer ``<name>_scale_blocks [ceil(N/128), KG]``
float32: the checkpoint's 128 x 128 block scales
(:func:`~unimem.models.fp8_convert.attach_block_scales`; not a parameter, not in the state
dict). With it, products with many rows on an SM90 GPU run on cuBLASLt's block-scaled GEMM
(:func:`unimem_kernel.fp8_gemm.use_lt`); without it, always on the Triton kernel.

Products: :func:`linear` (``F.linear`` or the FP8 GEMM by the module's weight),
:func:`row_parallel` (a row-parallel output projection), :func:`fp8_matmul` (a weight, its
scales and its block table if any). In batch-invariant mode the GEMM runs the Triton
kernel's fixed tile.

Turning a built model's linears into FP8 parameters and filling them from a checkpoint is
:mod:`unimem.models.fp8_convert`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unimem.models import batch_invariant
from unimem_kernel.fp8_gemm import (  # the weight format's functions are pure tensor ops
    collapse_block_scales,
    dequantize,
    expand_block_scales,
    fp8_linear,
    quantize_blocks,
    quantize_blockwise,
)

__all__ = [
    "BLOCKS_SUFFIX",
    "SCALE_SUFFIX",
    "block_scales",
    "collapse_block_scales",
    "dequantize",
    "expand_block_scales",
    "fp8_matmul",
    "is_fp8",
    "linear",
    "quantize_blocks",
    "quantize_blockwise",
    "row_parallel",
    "weight_bytes",
]

SCALE_SUFFIX = "_scale_inv"
BLOCKS_SUFFIX = "_scale_blocks"
"""A block table's buffer name: the weight's name plus this (module docstring)."""

# ------------------------------------------------------------------ products


def is_fp8(module: nn.Module, leaf: str = "weight") -> bool:
    """Whether ``module``'s parameter ``leaf`` is an FP8 weight with scales."""
    return getattr(module, leaf + SCALE_SUFFIX, None) is not None


def block_scales(module: nn.Module, leaf: str = "weight") -> torch.Tensor | None:
    """``module``'s block table of parameter ``leaf`` (``<leaf>_scale_blocks``), or None."""
    return getattr(module, leaf + BLOCKS_SUFFIX, None)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K]`` times FP8 ``weight [N, K]`` (``scale [N, KG]``; its block table
    ``block_scales [ceil(N/128), KG]`` when it has one) transposed, in ``x``'s dtype
    (:func:`unimem_kernel.fp8_linear`: cuBLASLt or the Triton kernel; the Triton kernel's
    fixed tile under batch invariance)."""
    invariant = batch_invariant.covers(x)
    return fp8_linear(x, weight, scale, invariant=invariant, block_scales=block_scales)


def linear(x: torch.Tensor, module: nn.Module, leaf: str = "weight") -> torch.Tensor:
    """``F.linear(x, module.<leaf>)``, or the FP8 product when that weight is FP8."""
    w = getattr(module, leaf)
    if is_fp8(module, leaf):
        scale = getattr(module, leaf + SCALE_SUFFIX)
        return fp8_matmul(x, w, scale, block_scales=block_scales(module, leaf))
    return F.linear(x, w)


def row_parallel(
    x: torch.Tensor,
    module: nn.Module,
    zero_bias: torch.Tensor | None,
    tp,
    leaf: str = "weight",
) -> torch.Tensor:
    """A row-parallel output projection by ``module.<leaf>``: for a model-dtype weight
    :func:`~unimem.models.tensor_parallel.row_parallel_linear_lt` (``zero_bias`` given) or
    ``row_parallel_linear``; the FP8 product, then the all-reduce, otherwise."""
    from unimem.models.tensor_parallel import row_parallel_linear, row_parallel_linear_lt

    w = getattr(module, leaf)
    if not is_fp8(module, leaf):
        if zero_bias is None:
            return row_parallel_linear(x, w, None, tp)
        return row_parallel_linear_lt(x, w, zero_bias, tp)
    scale = getattr(module, leaf + SCALE_SUFFIX)
    y = fp8_matmul(x, w, scale, block_scales=block_scales(module, leaf))
    return y if tp.size == 1 else tp.all_reduce(y)


# ------------------------------------------------------------------ weight format


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters (each storage once; buffers such as the block tables
    are not counted)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape))
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total
