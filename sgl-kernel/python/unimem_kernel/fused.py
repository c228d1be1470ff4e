"""Fused elementwise model ops: residual add + RMS norm, gated activations, GDN gates, the GDN
output norm, gated attention's output gate and RoPE on q and k, each one Triton launch in
place of a chain of torch ops.

Every op has a ``*_reference`` torch function that is, literally, the torch code the models
ran before the fusion (``unimem.models.nn_ops`` / ``qwen_common`` / ``synthetic``), so a model
that calls the public op gets bit-identical results wherever the reference runs (CPU, float64).
The public op dispatches through :func:`unimem_kernel._dispatch.use_triton`: the Triton kernel
on CUDA (or when ``UNIMEM_KERNEL_BACKEND=triton``), the reference otherwise. Float64 inputs and
dtype combinations the kernels do not cover always run the reference.

Numerics of the kernels (what "identical semantics" means here): every intermediate that torch
rounds to a storage dtype (bf16 / fp16 / the state dtype) is rounded at the same point, and the
math in between runs in fp32 in the same order as torch's. What differs is the rounding of the
transcendental functions (``exp``, ``rsqrt``; ``log1p`` and ``tanh`` are built from ``exp`` /
``log``) and of the row reductions (the sum of squares in fixed chunks, not torch's tree), so
the kernels agree with the references to an ulp or so, not bitwise, except where a test in
``sgl-kernel/tests/test_fused_ops.py`` states bitwise equality.

Row ops (:func:`add_rms_norm`, :func:`gated_rms_norm`) reduce each row with a fixed chunk
over it (:func:`_row_block`, a function of the row length only, the same chunking as
:func:`unimem_kernel.bi_rms_norm`): one program per row, or per token for the gated norm,
whose heads' rows form one tile and are each reduced along their own tile row. A row's
result never depends on how many rows share the call, so they are safe in batch-invariant
(deterministic) mode. The others are elementwise.
Outputs are freshly allocated; launch grids depend on shapes only (CUDA-graph capturable).
The kernels have no backward: where autograd would record the op (an input requires grad,
:func:`records_autograd`), the public op runs its reference.

``UNIMEM_FUSED_OPS=off`` runs every op's reference (the unfused torch code) even on CUDA: the
switch for comparing fused against unfused steps, and a way around a kernel that fails on a
new GPU or Triton version.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unimem_kernel._dispatch import next_pow2
from unimem_kernel._dispatch import use_triton as _use_triton

_SWITCH = "UNIMEM_FUSED_OPS"


def use_triton(t: torch.Tensor) -> bool:
    """The package's dispatch rule, unless ``UNIMEM_FUSED_OPS=off`` (module docstring)."""
    choice = os.environ.get(_SWITCH, "on")
    if choice not in ("on", "off"):
        raise ValueError(f"{_SWITCH} must be on or off, got {choice!r}")
    return choice == "on" and _use_triton(t)


__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "clamped_swiglu",
    "clamped_swiglu_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "gdn_gates",
    "gdn_gates_reference",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "norm_add_rms_norm",
    "norm_add_rms_norm_reference",
    "rope_qk",
    "rope_qk_reference",
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "silu_mul",
    "silu_mul_reference",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (*_KERNEL_DTYPES, torch.float64)
_ELEMENTWISE_BLOCK = 1024  # elements of one row per program in silu_mul / gelu_tanh_mul


def records_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op over ``tensors`` (grad mode on and one of them
    requires grad). The kernels have no backward, so the public ops run their references
    then: a module that also trains (the drafter under distillation) calls the same ops."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _row_block(d: int) -> int:
    """The fixed chunk over a row's ``d`` elements (a function of ``d`` only; the same as
    :func:`unimem_kernel.batch_invariant._row_block`)."""
    return min(next_pow2(d), 4096)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------- validation


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _check_heads_like(o: torch.Tensor, other: torch.Tensor, name: str) -> None:
    """``o [T, H, D]`` and ``other`` (called ``name``) of its shape, dtype and device."""
    _check_float("o", o)
    _check_float(name, other)
    if o.dim() != 3:
        raise ValueError(f"o must be [T, H, D], got shape {tuple(o.shape)}")
    if other.shape != o.shape:
        raise ValueError(f"{name} must have o's shape {tuple(o.shape)}, got {tuple(other.shape)}")
    if other.dtype != o.dtype:
        raise ValueError(f"{name} must have o's dtype {o.dtype}, got {other.dtype}")
    _check_device(name, other, o, "o")


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, x.shape[-1]]`` with unit stride along the last dim (a view where the
    layout allows, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


# ------------------------------------------------------------------- rounding


# Whether Triton runs through its interpreter (fixed when triton is imported, as Triton's own
# switch is): the interpreter's fp32 -> bf16 conversion truncates instead of rounding.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to ``dt`` to nearest, ties to even (torch's rounding), as a tensor of
    ``dt``. On the GPU a 16-bit ``dt`` rounds with one ``cvt.rn`` in inline assembly, which the
    compiler cannot see through: through a plain ``.to(bf16)``, LLVM narrows ``fptrunc(fmul)``
    to a 16-bit multiply and contracts it with the 16-bit add that follows into one fused
    multiply-add, skipping the rounding torch does in between. Under the interpreter, whose
    conversion to bf16 truncates, bf16 rounds through the bits (the same value for every
    finite ``x``), so the CPU tests compare the kernels' bits."""
    if _INTERPRETED:
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dt)
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "cvt.rn.bf16.f32 $0, $1;", "=h,r", [x], dtype=tl.bfloat16, is_pure=True, pack=1
        )
    if dt == tl.float16:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16.f32 $0, $1;", "=h,r", [x], dtype=tl.float16, is_pure=True, pack=1
        )
    return x.to(dt)


# ------------------------------------------------------------------- add + RMS norm


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    D,
    stride_x,
    stride_d,
    stride_s,
    stride_y,
    eps,
    ZERO_CENTERED: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    d_row = d_ptr + row * stride_d
    s_row = s_ptr + row * stride_s
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in one chunk: read x and delta once
        m = cols < D
        xv = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        dv = tl.load(d_row + cols, mask=m, other=0.0).to(tl.float32)
        sv = _round(xv + dv, s_ptr.dtype.element_ty)  # x + delta, rounded as torch rounds it
        tl.store(s_row + cols, sv, mask=m)
        sf = sv.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
        wv = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            wv = 1.0 + wv
        tl.store(y_row + cols, _round((sf * rstd) * wv, y_ptr.dtype.element_ty), mask=m)
    else:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sv = _round(xv + dv, s_ptr.dtype.element_ty)
            tl.store(s_row + start + cols, sv, mask=m)
            sf = sv.to(tl.float32)
            sq += sf * sf
        rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / D + eps)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sf = _round(xv + dv, s_ptr.dtype.element_ty).to(tl.float32)  # recomputed, same bits
            wv = tl.load(w_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                wv = 1.0 + wv
            tl.store(y_row + start + cols, _round((sf * rstd) * wv, y_ptr.dtype.element_ty), mask=m)


def add_rms_norm_reference(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`add_rms_norm`: ``x + delta``, then
    ``unimem.models.nn_ops.rms_norm`` (or ``qwen_common.zero_centered_rms_norm``) of it."""
    new_x = x + delta
    acc = _acc(new_x.dtype)
    xa = new_x.to(acc)
    y = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + weight.to(acc)) if zero_centered else weight.to(acc)
    return new_x, (y * w).to(new_x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next pre-norm in one pass: returns ``(new_x, normed)``.

    ``new_x = x + delta`` in ``x``'s dtype (``x`` and ``delta`` ``[..., D]``, the same shape
    and dtype: fp16, bf16, fp32, float64 runs the reference); ``normed`` is the RMS norm of
    ``new_x`` over the last dim: ``new_x * rsqrt(mean(new_x^2) + eps) * w`` with the math in
    fp32 (``w`` = ``weight [D]`` upcast, or ``1 + weight`` when ``zero_centered``, multiplied in
    fp32) and one cast back to ``x``'s dtype, exactly as ``nn_ops.rms_norm`` /
    ``qwen_common.zero_centered_rms_norm`` compute it. Both outputs are new tensors of ``x``'s
    shape (contiguous). One program per row, a fixed chunk of :func:`_row_block` ``(D)``: a row's
    result does not depend on the other rows (batch-invariant).
    """
    _check_float("x", x)
    _check_float("delta", delta)
    _check_float("weight", weight)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    if delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
    if delta.dtype != x.dtype:
        raise ValueError(f"delta must have x's dtype {x.dtype}, got {delta.dtype}")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    _check_device("delta", delta, x, "x")
    _check_device("weight", weight, x, "x")
    if (
        x.dtype == torch.float64
        or weight.dtype == torch.float64
        or not use_triton(x)
        or records_autograd(x, delta, weight)
    ):
        return add_rms_norm_reference(x, delta, weight, eps, zero_centered=zero_centered)
    x2, d2 = _unit_stride_rows(x), _unit_stride_rows(delta)
    rows = x2.shape[0]
    s = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows and d:
        block = _row_block(d)
        _add_rms_norm_kernel[(rows,)](
            x2, d2, weight, s, y, d, x2.stride(0), d2.stride(0), s.stride(0), y.stride(0),
            float(eps), ZERO_CENTERED=bool(zero_centered), SINGLE=d <= block, BLOCK=block,
        )  # fmt: skip
    return s.reshape(x.shape), y.reshape(x.shape)


# ------------------------------------------------------------------- norm + add + RMS norm


@triton.jit
def _norm_add_rms_norm_kernel(
    x_ptr,
    d_ptr,
    pw_ptr,
    nw_ptr,
    s_ptr,
    y_ptr,
    D,
    stride_x,
    stride_d,
    stride_s,
    stride_y,
    eps,
    ZERO_CENTERED: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    d_row = d_ptr + row * stride_d
    s_row = s_ptr + row * stride_s
    y_row = y_ptr + row * stride_y
    dt = s_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in one chunk: x and delta read once
        m = cols < D
        dv = tl.load(d_row + cols, mask=m, other=0.0).to(tl.float32)
        rstd_d = tl.math.rsqrt(tl.sum(dv * dv, axis=0) / D + eps)
        pw = tl.load(pw_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            pw = 1.0 + pw
        dn = _round((dv * rstd_d) * pw, dt).to(tl.float32)  # the post-norm, rounded to x's dtype
        xv = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        sv = _round(xv + dn, dt)
        tl.store(s_row + cols, sv, mask=m)
        if HAS_NEXT:
            sf = sv.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
            nw = tl.load(nw_ptr + cols, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                nw = 1.0 + nw
            tl.store(y_row + cols, _round((sf * rstd) * nw, y_ptr.dtype.element_ty), mask=m)
    else:
        sq_d = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sq_d += dv * dv
        rstd_d = tl.math.rsqrt(tl.sum(sq_d, axis=0) / D + eps)
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
            pw = tl.load(pw_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                pw = 1.0 + pw
            dn = _round((dv * rstd_d) * pw, dt).to(tl.float32)
            xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sv = _round(xv + dn, dt)
            tl.store(s_row + start + cols, sv, mask=m)
            sf = sv.to(tl.float32)
            sq += sf * sf
        if HAS_NEXT:
            rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / D + eps)
            for start in range(0, D, BLOCK):
                m = start + cols < D
                dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
                pw = tl.load(pw_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    pw = 1.0 + pw
                dn = _round((dv * rstd_d) * pw, dt).to(tl.float32)  # recomputed, same bits
                xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                sf = _round(xv + dn, dt).to(tl.float32)
                nw = tl.load(nw_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    nw = 1.0 + nw
                tl.store(y_row + start + cols, _round((sf * rstd) * nw, y_ptr.dtype.element_ty),
                         mask=m)  # fmt: skip


def norm_add_rms_norm_reference(
    x: torch.Tensor,
    delta: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference of :func:`norm_add_rms_norm`: the RMS norm of ``delta`` (math in
    fp32, cast back to its dtype; Gemma's ``gemma_rms_norm`` when ``zero_centered``), then
    :func:`add_rms_norm_reference` with ``next_weight`` (or only the add when it is None)."""
    acc = _acc(delta.dtype)
    da = delta.to(acc)
    y = da * torch.rsqrt(da.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + post_weight.to(acc)) if zero_centered else post_weight.to(acc)
    normed = (y * w).to(delta.dtype)
    if next_weight is None:
        return x + normed, None
    return add_rms_norm_reference(x, normed, next_weight, eps, zero_centered=zero_centered)


def norm_add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A branch's post-norm, the residual add and the next pre-norm in one pass (Gemma's
    ``post_attention_layernorm`` -> add -> ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` -> add -> the next layer's ``input_layernorm``).

    Returns ``(new_x, normed)``: ``new_x = x + rms_norm(delta, post_weight)`` and ``normed =
    rms_norm(new_x, next_weight)`` (None when ``next_weight`` is None: the last layer, whose
    stream goes to the final norm of the logits rows only). Each norm is
    ``v * rsqrt(mean(v^2) + eps) * w`` with the math in fp32 (``w`` the weight upcast, or
    ``1 + weight`` when ``zero_centered``) and one rounding to ``x``'s dtype, the sum in
    ``x``'s dtype, as :func:`norm_add_rms_norm_reference` computes them. ``x``, ``delta``
    ``[..., D]`` of one shape and dtype (fp16, bf16, fp32; float64 runs the reference), the
    weights ``[D]``. Both outputs are new contiguous tensors of ``x``'s shape. One program per
    row with the fixed chunk :func:`_row_block` ``(D)`` (batch-invariant).
    """
    _check_float("x", x)
    _check_float("delta", delta)
    _check_float("post_weight", post_weight)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    if delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
    if delta.dtype != x.dtype:
        raise ValueError(f"delta must have x's dtype {x.dtype}, got {delta.dtype}")
    d = x.shape[-1]
    for name, w in (("post_weight", post_weight), ("next_weight", next_weight)):
        if w is None:
            continue
        _check_float(name, w)
        if w.shape != (d,):
            raise ValueError(f"{name} must have shape ({d},), got {tuple(w.shape)}")
        _check_device(name, w, x, "x")
    _check_device("delta", delta, x, "x")
    if (
        x.dtype == torch.float64
        or post_weight.dtype == torch.float64
        or (next_weight is not None and next_weight.dtype == torch.float64)
        or not use_triton(x)
        or records_autograd(x, delta, post_weight, next_weight)
    ):
        return norm_add_rms_norm_reference(
            x, delta, post_weight, next_weight, eps, zero_centered=zero_centered
        )
    x2, d2 = _unit_stride_rows(x), _unit_stride_rows(delta)
    rows = x2.shape[0]
    s = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    has_next = next_weight is not None
    y = torch.empty((rows, d) if has_next else (0, d), dtype=x.dtype, device=x.device)
    if rows and d:
        block = _row_block(d)
        _norm_add_rms_norm_kernel[(rows,)](
            x2, d2, post_weight, next_weight if has_next else post_weight, s, y, d,
            x2.stride(0), d2.stride(0), s.stride(0), y.stride(0) if has_next else 0,
            float(eps), ZERO_CENTERED=bool(zero_centered), HAS_NEXT=has_next,
            SINGLE=d <= block, BLOCK=block,
        )  # fmt: skip
    return s.reshape(x.shape), (y.reshape(x.shape) if has_next else None)


# ------------------------------------------------------------------- gated activations


@triton.jit
def _gated_act_kernel(
    g_ptr,
    u_ptr,
    o_ptr,
    F_,
    stride_g,
    stride_u,
    stride_o,
    alpha,
    limit,
    ACT: tl.constexpr,  # 0: silu, 1: gelu (tanh approximation), 2: gpt-oss's clamped SwiGLU
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F_
    dt = o_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    if ACT == 2:
        # (clamp(up, -l, l) + 1) * (g * sigmoid(g * alpha)), g = clamp(gate, max=l): every
        # torch op's result rounded to the dtype, as the torch code rounds it
        g = _round(tl.minimum(g, limit), dt).to(tl.float32)
        u = _round(tl.minimum(tl.maximum(u, -limit), limit), dt).to(tl.float32)
        t = _round(g * alpha, dt).to(tl.float32)
        sg = _round(1.0 / (1.0 + tl.exp(-t)), dt).to(tl.float32)
        gs = _round(g * sg, dt).to(tl.float32)
        u1 = _round(u + 1.0, dt).to(tl.float32)
        tl.store(o_ptr + row * stride_o + cols, _round(u1 * gs, dt), mask=m)
    else:
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))  # torch's silu: x / (1 + exp(-x)) in fp32
        else:
            # torch's tanh GELU: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))),
            # with tanh(v) = 1 - 2 / (exp(2v) + 1) (no tanh in the interpreter)
            inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            th = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
            a = 0.5 * g * (1.0 + th)
        a = _round(a, dt).to(tl.float32)  # the activation is rounded first
        tl.store(o_ptr + row * stride_o + cols, _round(a * u, dt), mask=m)


def silu_mul_reference(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of :func:`silu_mul`: ``F.silu(gate) * up``."""
    gate, up = _gate_and_up(gate_up, up)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of :func:`gelu_tanh_mul`: ``F.gelu(gate, approximate="tanh") * up``."""
    gate, up = _gate_and_up(gate_up, up)
    return F.gelu(gate, approximate="tanh") * up


def _gate_and_up(gate_up: torch.Tensor, up: torch.Tensor | None):
    if up is not None:
        return gate_up, up
    return gate_up.chunk(2, dim=-1)


def _gated_act(
    name: str,
    act: int,
    gate_up: torch.Tensor,
    up: torch.Tensor | None,
    alpha: float = 0.0,
    limit: float = 0.0,
):
    _check_float("gate_up", gate_up)
    if gate_up.dim() < 1:
        raise ValueError("gate_up must have at least one dim")
    if up is None:
        if gate_up.shape[-1] % 2:
            raise ValueError(
                f"gate_up's last dim must be even ([gate | up]), got {gate_up.shape[-1]}"
            )
        f = gate_up.shape[-1] // 2
    else:
        _check_float("up", up)
        if up.shape != gate_up.shape:
            raise ValueError(
                f"up must have gate_up's shape {tuple(gate_up.shape)}, got {tuple(up.shape)}"
            )
        if up.dtype != gate_up.dtype:
            raise ValueError(f"up must have gate_up's dtype {gate_up.dtype}, got {up.dtype}")
        _check_device("up", up, gate_up, "gate_up")
        f = gate_up.shape[-1]
    if gate_up.dtype == torch.float64 or not use_triton(gate_up) or records_autograd(gate_up, up):
        if act == 2:
            return clamped_swiglu_reference(gate_up, up, alpha, limit)
        return (silu_mul_reference if act == 0 else gelu_tanh_mul_reference)(gate_up, up)
    gate, upv = _gate_and_up(gate_up, up)
    g2, u2 = _unit_stride_rows(gate), _unit_stride_rows(upv)
    rows = g2.shape[0]
    out = torch.empty((rows, f), dtype=gate_up.dtype, device=gate_up.device)
    if rows and f:
        block = min(_ELEMENTWISE_BLOCK, next_pow2(f))
        grid = (rows, triton.cdiv(f, block))
        _gated_act_kernel[grid](
            g2, u2, out, f, g2.stride(0), u2.stride(0), out.stride(0), float(alpha),
            float(limit), ACT=act, BLOCK=block,
        )  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], f)


def silu_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's activation ``F.silu(gate) * up`` in one pass.

    ``gate_up [..., 2F]`` holds ``[gate | up]`` (the fused gate/up projection; any row stride,
    unit stride along the last dim preferred), or, with ``up`` given, ``gate_up`` is the gate
    ``[..., F]`` and ``up`` has its shape and dtype. fp16 / bf16 / fp32 (float64 runs the
    reference). Returns a new contiguous ``[..., F]`` in the input dtype, computed as torch
    does: ``silu`` in fp32 rounded to the dtype, then the product in fp32 rounded to the dtype
    (for fp32 both roundings are no-ops).
    """
    return _gated_act("silu_mul", 0, gate_up, up)


def gelu_tanh_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU's activation ``F.gelu(gate, approximate="tanh") * up`` in one pass; arguments,
    layout and rounding as :func:`silu_mul` (the GELU in fp32 with torch's formula, ``tanh``
    from ``exp``, rounded to the dtype before the product)."""
    return _gated_act("gelu_tanh_mul", 1, gate_up, up)


def clamped_swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """The torch reference of :func:`clamped_swiglu` (gpt-oss's expert activation, as
    ``unimem.models.gpt_oss`` computed it)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU ``(clamp(up, -l, l) + 1) * (g * sigmoid(g * alpha))`` with ``g
    = min(gate, l)``, in one pass. ``gate``, ``up [..., F]`` of one shape and dtype (fp16 /
    bf16 / fp32; float64 runs the reference; any row strides with a unit last one, e.g. the
    two halves of a gate/up GEMM's output). Every torch op's result is rounded to the dtype
    where the reference rounds it (the sigmoid's ``exp`` is the kernel's own: within an ulp).
    Returns a new contiguous ``[..., F]``."""
    return _gated_act("clamped_swiglu", 2, gate, up, float(alpha), float(limit))


# ------------------------------------------------------------------- GDN gates


@triton.jit
def _log1p(u):
    """``log(1 + u)`` for ``u >= 0`` accurate to a few ulp (Kahan's correction of the rounded
    ``1 + u``); the interpreter has no ``log1p``."""
    w = 1.0 + u
    one = w == 1.0
    return tl.where(one, u, tl.log(w) * (u / tl.where(one, 1.0, w - 1.0)))


@triton.jit
def _gdn_gates_kernel(
    a_ptr,
    b_ptr,
    alog_ptr,
    dtb_ptr,
    g_ptr,
    beta_ptr,
    H,
    stride_a,
    stride_b,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    sdt = g_ptr.dtype.element_ty
    a = tl.load(a_ptr + row * stride_a + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=m, other=0.0).to(tl.float32)
    alog = tl.load(alog_ptr + cols, mask=m, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + cols, mask=m, other=0.0).to(tl.float32)
    a = _round(a, sdt).to(tl.float32)
    b = _round(b, sdt).to(tl.float32)
    alog = _round(alog, sdt).to(tl.float32)
    dtb = _round(dtb, sdt).to(tl.float32)
    x = _round(a + dtb, sdt).to(tl.float32)
    # torch's softplus (beta 1, threshold 20): x where x > 20, else log1p(exp(x))
    sp = tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0))))
    sp = _round(sp, sdt).to(tl.float32)
    e = _round(tl.exp(alog), sdt).to(tl.float32)
    g = (-e) * sp
    beta = 1.0 / (1.0 + tl.exp(-b))  # torch's sigmoid
    tl.store(g_ptr + row * H + cols, _round(g, sdt), mask=m)
    tl.store(beta_ptr + row * H + cols, _round(beta, sdt), mask=m)


def gdn_gates_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`gdn_gates` (the GDN mixers' code)."""
    sdt = A_log.dtype if state_dtype is None else state_dtype
    g = -A_log.to(sdt).exp() * F.softplus(a.to(sdt) + dt_bias.to(sdt))
    beta = torch.sigmoid(b.to(sdt))
    return g, beta


def gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet gates in one pass: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
    ``beta = sigmoid(b)``, both ``[T, H]`` in the state dtype.

    ``a, b [T, H]`` (any float dtype, any row stride: the column slices of the input
    projection), ``A_log, dt_bias [H]``. ``state_dtype`` defaults to ``A_log``'s dtype. Every
    operand is cast to the state dtype first and each torch op's result is rounded to it, as
    the mixers' torch code does (``softplus`` with torch's defaults: beta 1, threshold 20, so
    ``x`` itself above 20). A float64 state dtype (or operand) runs the reference. Returns new
    contiguous tensors.
    """
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_float(name, t)
    if a.dim() != 2:
        raise ValueError(f"a must be [T, H], got shape {tuple(a.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
    h = a.shape[1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (h,):
            raise ValueError(f"{name} must have shape ({h},), got {tuple(t.shape)}")
    for name, t in (("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_device(name, t, a, "a")
    sdt = A_log.dtype if state_dtype is None else state_dtype
    if sdt not in _FLOAT_DTYPES:
        raise ValueError(f"state_dtype must be a float dtype, got {sdt}")
    if torch.float64 in (sdt, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype) or not use_triton(a):
        return gdn_gates_reference(a, b, A_log, dt_bias, sdt)
    a2, b2 = _unit_last(a), _unit_last(b)
    t = a.shape[0]
    g = torch.empty((t, h), dtype=sdt, device=a.device)
    beta = torch.empty((t, h), dtype=sdt, device=a.device)
    if t and h:
        _gdn_gates_kernel[(t,)](
            a2, b2, A_log, dt_bias, g, beta, h, a2.stride(0), b2.stride(0),
            BLOCK_H=next_pow2(h),
        )  # fmt: skip
    return g, beta


# ------------------------------------------------------------------- GDN output norm


@triton.jit
def _gated_rms_norm_kernel(
    o_ptr,
    w_ptr,
    z_ptr,
    y_ptr,
    H,
    D,
    stride_ot,
    stride_oh,
    stride_zt,
    stride_zh,
    eps,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    BH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``(t, j)``: heads ``j * BH .. j * BH + BH - 1`` of token ``t`` as one ``[BH,
    BLOCK]`` tile, each head's sum of squares reduced along its own row of the tile."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    hmask = heads < H
    o_rows = o_ptr + t * stride_ot + heads * stride_oh
    z_rows = z_ptr + t * stride_zt + heads * stride_zh
    y_rows = y_ptr + (t * H + heads) * D
    dt = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)[None, :]
    sq = tl.zeros((BH, BLOCK), dtype=tl.float32)
    for start in range(0, D, BLOCK):
        m = hmask & (start + cols < D)
        ov = tl.load(o_rows + start + cols, mask=m, other=0.0).to(tl.float32)
        sq += ov * ov
    rstd = tl.math.rsqrt(tl.sum(sq, axis=1) / D + eps)[:, None]
    for start in range(0, D, BLOCK):
        m = hmask & (start + cols < D)
        ov = tl.load(o_rows + start + cols, mask=m, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + start + cols, mask=start + cols < D, other=0.0).to(tl.float32)
        zv = tl.load(z_rows + start + cols, mask=m, other=0.0).to(tl.float32)
        if ROUND_BEFORE_WEIGHT:  # HF RMSNormGated: (weight * normed.to(dtype)) in the dtype
            n = _round(ov * rstd, dt).to(tl.float32)
            n = _round(wv * n, dt).to(tl.float32)
        else:  # nn_ops.rms_norm(o, w) (one cast after the weight)
            n = _round((ov * rstd) * wv, dt).to(tl.float32)
        gate = zv / (1.0 + tl.exp(-zv))  # silu in fp32
        tl.store(y_rows + start + cols, _round(n * gate, dt), mask=m)


_GATED_NORM_TILE = 8192  # elements of a gated-norm program's [heads, chunk] tile


def gated_rms_norm_reference(
    o: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    *,
    round_before_weight: bool = False,
) -> torch.Tensor:
    """The torch reference of :func:`gated_rms_norm` (``synthetic.GdnMixer`` /
    ``qwen_common.gated_rms_norm``), reshaped to ``[T, H * D]``."""
    acc = _acc(o.dtype)
    oa = o.to(acc)
    y = oa * torch.rsqrt(oa.pow(2).mean(-1, keepdim=True) + eps)
    if round_before_weight:
        out = (weight * y.to(o.dtype)).to(acc) * F.silu(z.to(acc))
    else:
        out = (y * weight.to(acc)).to(o.dtype).to(acc) * F.silu(z.to(acc))
    return out.to(o.dtype).reshape(o.shape[0], -1)


def gated_rms_norm(
    o: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    *,
    round_before_weight: bool = False,
) -> torch.Tensor:
    """The GDN output norm ``rmsnorm(o) * weight * silu(z)`` per head, flattened.

    ``o [T, H, D]`` (fp16, bf16, fp32; float64 runs the reference), ``weight [D]``, ``z [T, H,
    D]`` (the gate, ``o``'s dtype; any strides with a unit last one, e.g. a reshaped column
    slice of the input projection). Returns a new ``[T, H * D]`` in ``o``'s dtype. The norm
    and the gate run in fp32. Two roundings, a flag selects:

    - ``round_before_weight=False`` (``synthetic.GdnMixer``): ``nn_ops.rms_norm(o, weight)``
      (the weight multiplied in fp32, one cast to the dtype), upcast, times ``silu(z)``;
    - ``round_before_weight=True`` (``qwen_common.gated_rms_norm``, HuggingFace's
      ``RMSNormGated``): the normalised ``o`` rounded to the dtype, times ``weight`` in the
      dtype, upcast, times ``silu(z)``. With a ``weight`` dtype other than ``o``'s (torch would
      promote) the reference runs.

    One program per token (or per block of its heads), each head's row reduced on its own with
    a fixed chunk over ``D``: row-local, whatever the number of tokens.
    """
    _check_float("weight", weight)
    _check_heads_like(o, z, "z")
    t, h, d = o.shape
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    _check_device("weight", weight, o, "o")
    if (
        o.dtype == torch.float64
        or weight.dtype == torch.float64
        or (round_before_weight and weight.dtype != o.dtype)
        or not use_triton(o)
    ):
        return gated_rms_norm_reference(o, weight, z, eps, round_before_weight=round_before_weight)
    o2, z2 = _unit_last(o), _unit_last(z)
    y = torch.empty((t, h * d), dtype=o.dtype, device=o.device)
    if t and h and d:
        block = _row_block(d)
        bh = min(next_pow2(h), max(1, _GATED_NORM_TILE // block))
        _gated_rms_norm_kernel[(t, triton.cdiv(h, bh))](
            o2, weight, z2, y, h, d, o2.stride(0), o2.stride(1), z2.stride(0), z2.stride(1),
            float(eps), ROUND_BEFORE_WEIGHT=bool(round_before_weight), BH=bh, BLOCK=block,
        )  # fmt: skip
    return y


# ------------------------------------------------------------------- attention output gate

_SIGMOID_GATE_TILE = 4096  # elements of a gate program's [heads, D] tile


@triton.jit
def _sigmoid_gate_kernel(
    o_ptr,
    g_ptr,
    y_ptr,
    H,
    D,
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    BH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program ``(t, j)``: heads ``j * BH + [0, BH)`` of token ``t``, one ``[BH, BLOCK_D]``
    tile (``BLOCK_D >= D``)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    m = (heads < H) & (cols < D)
    dt = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + t * stride_ot + heads * stride_oh + cols, mask=m, other=0.0)
    g = tl.load(g_ptr + t * stride_gt + heads * stride_gh + cols, mask=m, other=0.0)
    s = _round(1.0 / (1.0 + tl.exp(-g.to(tl.float32))), dt)  # torch's sigmoid, in the dtype
    y = _round(o.to(tl.float32) * s.to(tl.float32), dt)
    tl.store(y_ptr + t * (H * D) + heads * D + cols, y, mask=m)


def sigmoid_gate_reference(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The torch reference of :func:`sigmoid_gate` (``qwen_common.GatedAttention``'s code)."""
    t = o.shape[0]
    return o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate ``o * sigmoid(gate)``, flattened to ``[T, H * D]``.

    ``o`` and ``gate`` are ``[T, H, D]`` of one dtype (fp16, bf16, fp32; float64 runs the
    reference), any token and head strides with a unit last one — the gate is typically a
    column slice of the stacked q/gate projection, read in place (the torch code copies it
    to reshape it). Returns a new contiguous ``[T, H * D]`` in that dtype, computed as torch
    does: ``sigmoid`` in fp32 (``1 / (1 + exp(-x))``) rounded to the dtype, then the product in
    fp32 rounded to the dtype; the kernel's ``exp`` may differ from torch's in the last fp32
    bit, so the gate agrees to rounding. Elementwise: batch-invariant.
    """
    _check_heads_like(o, gate, "gate")
    if o.dtype == torch.float64 or not use_triton(o) or records_autograd(o, gate):
        return sigmoid_gate_reference(o, gate)
    o2, g2 = _unit_last(o), _unit_last(gate)
    t, h, d = o.shape
    y = torch.empty((t, h * d), dtype=o.dtype, device=o.device)
    if t and h and d:
        block = next_pow2(d)
        bh = min(next_pow2(h), max(1, _SIGMOID_GATE_TILE // block))
        _sigmoid_gate_kernel[(t, triton.cdiv(h, bh))](
            o2, g2, y, h, d, o2.stride(0), o2.stride(1), g2.stride(0), g2.stride(1),
            BH=bh, BLOCK_D=block,
        )  # fmt: skip
    return y


# ------------------------------------------------------------------- RoPE


@triton.jit
def _rope_heads(
    src,
    src_sh,
    dst,
    dst_sh,
    n_heads,
    c_row,
    s_row,
    D,
    HALF,
    BH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    keep,
    nw,
    eps,
    NORM: tl.constexpr,
):
    """Rotate-half over the first ``2 * HALF`` dims of ``n_heads`` head vectors of one token
    (head ``h`` at ``src + h * src_sh``, written to ``dst + h * dst_sh``), the rest copied;
    zeros in place of every result where ``keep`` (a scalar) is False. The heads form one
    ``[BH, BLOCK_R]`` tile; the arithmetic is elementwise, so a head's result does not depend
    on the tile.

    With ``NORM``, each head vector is first replaced by its zero-centred RMS norm over all
    ``D`` dims (``x * rsqrt(mean(x^2) + eps) * (1 + nw)`` in fp32, rounded to ``src``'s dtype:
    Gemma's and Qwen3-Next's q/k norms); the sum of squares is the rotated halves' plus the
    pass-through chunks', per head, in a fixed order (row-local)."""
    dt = dst.dtype.element_ty
    xdt = src.dtype.element_ty
    rdt = c_row.dtype.element_ty  # the rotation dtype: each torch op's result rounds to it
    heads = tl.arange(0, BH)[:, None]
    hmask = heads < n_heads
    cols = tl.arange(0, BLOCK_R)[None, :]
    cmask = cols < HALF
    m = hmask & cmask
    sp = src + heads * src_sh + cols
    dp = dst + heads * dst_sh + cols
    x1 = tl.load(sp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(sp + HALF, mask=m, other=0.0).to(tl.float32)
    rstd = tl.zeros((BH, 1), dtype=tl.float32)
    if NORM:
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if BLOCK_P > 0:
            for start in range(2 * HALF, D, BLOCK_P):
                pc = start + tl.arange(0, BLOCK_P)[None, :]
                xp = tl.load(src + heads * src_sh + pc, mask=hmask & (pc < D), other=0.0)
                xp = xp.to(tl.float32)
                sq += tl.sum(xp * xp, axis=1)
        rstd = tl.math.rsqrt(sq / D + eps)[:, None]
        w1 = 1.0 + tl.load(nw + cols, mask=cmask, other=0.0).to(tl.float32)
        w2 = 1.0 + tl.load(nw + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        x1 = _round((x1 * rstd) * w1, xdt).to(tl.float32)
        x2 = _round((x2 * rstd) * w2, xdt).to(tl.float32)
    x1 = _round(x1, rdt).to(tl.float32)
    x2 = _round(x2, rdt).to(tl.float32)
    c = tl.load(c_row + cols, mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(s_row + cols, mask=cmask, other=0.0).to(tl.float32)
    x1c = _round(x1 * c, rdt).to(tl.float32)
    x2s = _round(x2 * s, rdt).to(tl.float32)
    x2c = _round(x2 * c, rdt).to(tl.float32)
    x1s = _round(x1 * s, rdt).to(tl.float32)
    lo = _round(x1c - x2s, rdt).to(tl.float32)
    hi = _round(x2c + x1s, rdt).to(tl.float32)
    tl.store(dp, tl.where(keep, _round(lo, dt), 0.0), mask=m)
    tl.store(dp + HALF, tl.where(keep, _round(hi, dt), 0.0), mask=m)
    if BLOCK_P > 0:
        for start in range(2 * HALF, D, BLOCK_P):
            pc = start + tl.arange(0, BLOCK_P)[None, :]
            pm = hmask & (pc < D)
            x = tl.load(src + heads * src_sh + pc, mask=pm, other=0.0)
            if NORM:
                wp = 1.0 + tl.load(nw + pc, mask=pc < D, other=0.0).to(tl.float32)
                x = _round((x.to(tl.float32) * rstd) * wp, xdt)
            tl.store(dst + heads * dst_sh + pc, tl.where(keep, x, 0.0).to(dt), mask=pm)


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    HQ,
    HK,
    D,
    HALF,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    stride_s,
    BHQ: tl.constexpr,
    BHK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program ``(t, 0)``: every query head of token ``t``; ``(t, 1)``: every key head."""
    t = tl.program_id(0).to(tl.int64)
    c_row = cos_ptr + t * stride_c
    s_row = sin_ptr + t * stride_s
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * HQ * D, D, HQ, c_row, s_row,
                    D, HALF, BHQ, BLOCK_R, BLOCK_P, True, c_row, 0.0, False)  # fmt: skip
    else:
        _rope_heads(k_ptr + t * stride_kt, stride_kh, ko_ptr + t * HK * D, D, HK, c_row, s_row,
                    D, HALF, BHK, BLOCK_R, BLOCK_P, True, c_row, 0.0, False)  # fmt: skip


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # nn_ops.apply_rope, literally
    half = x.shape[-1] // 2
    xa = x.to(cos.dtype)
    x1, x2 = xa[..., :half], xa[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # qwen_common.PartialRotary.apply, literally
    rd = 2 * cos.shape[-1]
    if rd == x.shape[-1]:
        return _apply_rope(x, cos, sin)
    return torch.cat([_apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`rope_qk` (``nn_ops.apply_rope`` /
    ``qwen_common.PartialRotary.apply`` on each of ``q`` and ``k``), contiguous results."""
    return _partial_rope(q, cos, sin).contiguous(), _partial_rope(k, cos, sin).contiguous()


def check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError naming the argument unless ``q [T, Hq, D]``, ``k [T, Hk, D]`` (q's dtype)
    and ``cos, sin [T, R/2]`` (one dtype, ``0 < R <= D``) are float tensors on q's device:
    the contract of :func:`rope_qk` (and of ``kv_store.rope_store_kv``)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check_float(name, t)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k must be [T, Hk, D] with q's T and D, got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    t, _, d = q.shape
    if cos.dim() != 2 or cos.shape[0] != t or not 0 < 2 * cos.shape[1] <= d:
        raise ValueError(
            f"cos must be [T, R/2] with T = {t} and 0 < R <= {d}, got {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(
            f"sin must have cos's shape {tuple(cos.shape)} and dtype {cos.dtype}, "
            f"got {tuple(sin.shape)} {sin.dtype}"
        )
    for name, x in (("k", k), ("cos", cos), ("sin", sin)):
        _check_device(name, x, q, "q")


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on ``q`` and ``k`` in one launch; returns new contiguous ``(q, k)``.

    ``q [T, Hq, D]``, ``k [T, Hk, D]`` (the same dtype, fp16 / bf16 / fp32; any strides with a
    unit last one, e.g. reshaped column slices of a fused qkv projection), ``cos, sin [T, R/2]``
    in the rotation dtype (fp32, or bf16 / fp16 as Gemma and gpt-oss pass them: then every
    product and sum is rounded to it, as torch's ops in that dtype are; float64 runs the
    reference). The first ``R``
    dims of every head are rotated (``R = D``: full rotary, ``nn_ops.apply_rope``; ``R < D``:
    partial rotary, the other dims pass through unchanged, ``qwen_common.PartialRotary``):
    ``[x1 * c - x2 * s, x2 * c + x1 * s]`` with ``x1, x2`` the two halves of the rotated dims,
    computed in the rotation dtype and cast back to ``q``'s dtype.
    """
    check_rope_args(q, k, cos, sin)
    t, hq, d = q.shape
    hk = k.shape[1]
    if (
        q.dtype == torch.float64
        or cos.dtype == torch.float64
        or not use_triton(q)
        or records_autograd(q, k, cos, sin)
    ):
        return rope_qk_reference(q, k, cos, sin)
    q2, k2, c2, s2 = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    half = cos.shape[1]
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=q.dtype, device=q.device)
    if t and (hq or hk) and d:
        rest = d - 2 * half
        _rope_qk_kernel[(t, 2)](
            q2, k2, c2, s2, qo, ko, hq, hk, d, half, q2.stride(0), q2.stride(1),
            k2.stride(0), k2.stride(1), c2.stride(0), s2.stride(0),
            BHQ=next_pow2(hq), BHK=next_pow2(hk), BLOCK_R=next_pow2(half),
            BLOCK_P=next_pow2(rest) if rest else 0,
        )  # fmt: skip
    return qo, ko
