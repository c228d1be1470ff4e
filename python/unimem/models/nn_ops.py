"""Numerical building blocks shared by the target model (``unimem.models.synthetic``) and the
drafter (``unimem.speculative.drafter``). Pure torch; deterministic; no memory access."""

from __future__ import annotations

import torch
from torch import nn

from unimem.models import batch_invariant
from unimem.models.batch_invariant import rms_normalize
from unimem_kernel import bi_rms_norm, envs
from unimem_kernel.fused import records_autograd
from unimem_kernel.fused import use_triton as fused_ops_on
from unimem_kernel.norm_gemv import MAX_ROWS as NORM_LINEAR_MAX_ROWS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in float32 (float64 for
    float64 inputs); returns ``x``'s dtype. Where the fused ops run (CUDA, ``UNIMEM_FUSED_OPS``
    on, no autograd) it is one row-local launch (:func:`unimem_kernel.bi_rms_norm`, the same
    math, batch-invariant); elsewhere the torch code below."""
    if x.dtype != torch.float64 and fused_ops_on(x) and not records_autograd(x, weight):
        return bi_rms_norm(x, weight, eps)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = rms_normalize(x.to(acc), eps)
    return (y * weight.to(acc)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x [T, H, D]``, ``cos, sin [T, D/2]`` (rotation dtype)."""
    half = x.shape[-1] // 2
    xa = x.to(cos.dtype)
    x1, x2 = xa[..., :half], xa[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def frozen_param(
    *shape: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> nn.Parameter:
    """An uninitialised inference-only parameter (filled later: from a seed, or by a
    checkpoint loader)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def small_step(x: torch.Tensor, tp_size: int = 1) -> bool:
    """Whether a step of ``x [T, d]`` may run a layer's small-batch body of
    :func:`unimem_kernel.norm_linear` launches (the models' ``forward_small``): at most
    ``UNIMEM_NORM_LINEAR_ROWS`` rows, the fused kernels on, not float64, no autograd, one
    tensor-parallel rank, not batch-invariant mode (the vendor GEMM of larger batches rounds
    differently). Each model adds its own weight checks (16/32-bit stacks, not FP8)."""
    rows = min(envs.get("UNIMEM_NORM_LINEAR_ROWS"), NORM_LINEAR_MAX_ROWS)
    return (
        x.shape[0] <= rows
        and tp_size == 1
        and x.dtype != torch.float64
        and fused_ops_on(x)
        and not records_autograd(x)
        and not batch_invariant.enabled()
    )
