"""RoPE's cos and sin of a step's positions in one launch.

Every model's rotary embedding takes ``cos, sin [T, R/2]`` of ``angle[t, j] = positions[t] *
inv_freq[j]``, computed in the rotation dtype (float32 for 16-bit models), optionally scaled by
an attention factor (gpt-oss's YaRN) and cast to the model dtype (Gemma 3, gpt-oss). In torch
that is a cast, a product, ``cos``, ``sin`` (and a scale and two casts): four to eight launches
per call, and a step calls it once for the target and twice for the drafter.
:func:`rope_cos_sin` computes the same values in one launch, with the same operations in the
same order and the same roundings: the position's conversion to float32, one
``mul.rn.f32`` (in inline assembly, so the compiler cannot contract it into the cosine's first
multiply-add), CUDA's ``cosf`` / ``sinf`` (libdevice, the library torch's CUDA kernels call),
the factor's product, the cast. On the GPU it equals :func:`rope_cos_sin_reference` bit for
bit (the GPU tests check every position up to 2^18 at several frequency tables); under the
Triton interpreter the cosine is NumPy's, which may differ from torch's CPU one in the last
place.

Contract: ``positions [T]`` int32/int64 (non-negative, below 2^24 so their float32 value is
exact — a model's context is far below); ``inv_freq [H]`` float32, contiguous; ``factor`` a
Python float or None; ``out_dtype`` float32, bfloat16 or float16. Returns new contiguous
``(cos, sin)`` of ``[T, H]`` in ``out_dtype``. float64 tables (the CPU float64 models) run the
reference. No host reads, fixed grid: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.rounding import INTERPRETED, round_rne

__all__ = ["rope_cos_sin", "rope_cos_sin_reference", "rope_cos_sin_triton"]

_BLOCK_T = 16  # positions per program


@triton.jit
def _mul_rn(a, b):
    """``a * b`` in fp32, rounded once (never contracted into a later add)."""
    if INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _rope_cos_sin_kernel(
    pos_ptr,
    inv_ptr,
    cos_ptr,
    sin_ptr,
    T,
    H,
    factor,
    HAS_FACTOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program ``i``: positions ``i * BLOCK_T ..`` times every frequency."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_H)
    tmask = t < T
    jmask = j < H
    p = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.float32)
    f = tl.load(inv_ptr + j, mask=jmask, other=0.0)
    a = _mul_rn(p[:, None], f[None, :])
    if INTERPRETED:  # the interpreter has no libdevice: NumPy's cosine
        c = tl.cos(a)
        s = tl.sin(a)
    else:
        c = libdevice.cos(a)
        s = libdevice.sin(a)
    if HAS_FACTOR:
        fac = tl.zeros_like(c) + factor  # the scalar as a tensor for the inline assembly
        c = _mul_rn(c, fac)
        s = _mul_rn(s, fac)
    at = t.to(tl.int64)[:, None] * H + j[None, :]
    m = tmask[:, None] & jmask[None, :]
    tl.store(cos_ptr + at, round_rne(c, cos_ptr.dtype.element_ty), mask=m)
    tl.store(sin_ptr + at, round_rne(s, sin_ptr.dtype.element_ty), mask=m)


def _check(positions: torch.Tensor, inv_freq: torch.Tensor, out_dtype: torch.dtype) -> None:
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be a 1-D int32/int64 vector, got {positions.dtype} "
                         f"{tuple(positions.shape)}")  # fmt: skip
    if inv_freq.dim() != 1 or inv_freq.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"inv_freq must be a 1-D float32/float64 vector, got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")  # fmt: skip
    if inv_freq.device != positions.device:
        raise ValueError(f"inv_freq is on {inv_freq.device}, positions on {positions.device}")
    if out_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype}")


def rope_cos_sin_reference(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    factor: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin) [T, H]`` of ``positions[t] * inv_freq[j]`` (times ``factor`` when given),
    in ``out_dtype`` (default ``inv_freq``'s) — module docstring. The kernel takes float32
    ``inv_freq``; the reference is the models' own formula."""
    angles = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    c, s = angles.cos(), angles.sin()
    if factor is not None:
        c, s = c * factor, s * factor
    dt = inv_freq.dtype if out_dtype is None else out_dtype
    return c.to(dt), s.to(dt)


def rope_cos_sin_triton(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    factor: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`rope_cos_sin` (arguments already checked; float32
    ``inv_freq``)."""
    out_dtype = inv_freq.dtype if out_dtype is None else out_dtype
    t, h = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(t, h, dtype=out_dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if t == 0 or h == 0:
        return cos, sin
    inv = inv_freq.contiguous()
    _rope_cos_sin_kernel[(triton.cdiv(t, _BLOCK_T),)](
        positions, inv, cos, sin, t, h, 1.0 if factor is None else float(factor),
        HAS_FACTOR=factor is not None, BLOCK_T=_BLOCK_T, BLOCK_H=next_pow2(h), num_warps=4,
    )  # fmt: skip
    return cos, sin


def _check_args(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    factor: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> bool:
    _check(positions, inv_freq, inv_freq.dtype if out_dtype is None else out_dtype)
    return inv_freq.dtype == torch.float32 and out_dtype != torch.float64


rope_cos_sin = kernel_op(
    "rope_cos_sin",
    triton=rope_cos_sin_triton,
    reference=rope_cos_sin_reference,
    device_of="positions",
    check=_check_args,
)
