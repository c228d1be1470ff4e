"""Numerical building blocks shared by the target model (``unimem.models.synthetic``) and the
drafter (``unimem.speculative.drafter``). Pure torch; deterministic; no memory access."""

from __future__ import annotations

import torch
from torch import nn

from unimem.models.batch_invariant import rms_normalize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in float32 (float64 for
    float64 inputs); returns ``x``'s dtype."""
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
