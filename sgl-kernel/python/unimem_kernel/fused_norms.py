"""Fused RMS norms: residual add + norm, post-norm + add + norm, and the GDN output norm.

Each op reduces a row with a fixed chunk over it (:func:`_row_block`, a function of the row
length only, the same chunking as :func:`unimem_kernel.bi_rms_norm`): one program per row,
or per token for the gated norm, whose heads' rows form one tile and are each reduced along
their own tile row. A row's result never depends on how many rows share the call, so the
ops are safe in batch-invariant (deterministic) mode. Numerics and dispatch: see
:mod:`unimem_kernel.fused`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2, records_autograd
from unimem_kernel.fused_common import (
    FUSED_SWITCH,
    acc_dtype,
    check_device,
    check_float,
    check_heads_like,
    unit_last,
    unit_stride_rows,
)
from unimem_kernel.rounding import round_rne

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "add_rms_norm_triton",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "gated_rms_norm_triton",
    "norm_add_rms_norm",
    "norm_add_rms_norm_reference",
    "norm_add_rms_norm_triton",
]


def _row_block(d: int) -> int:
    """The fixed chunk over a row's ``d`` elements (a function of ``d`` only; the same as
    :func:`unimem_kernel.batch_invariant._row_block`)."""
    return min(next_pow2(d), 4096)


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
        sv = round_rne(xv + dv, s_ptr.dtype.element_ty)  # x + delta, rounded as torch rounds it
        tl.store(s_row + cols, sv, mask=m)
        sf = sv.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
        wv = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            wv = 1.0 + wv
        tl.store(y_row + cols, round_rne((sf * rstd) * wv, y_ptr.dtype.element_ty), mask=m)
    else:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sv = round_rne(xv + dv, s_ptr.dtype.element_ty)
            tl.store(s_row + start + cols, sv, mask=m)
            sf = sv.to(tl.float32)
            sq += sf * sf
        rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / D + eps)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            dv = tl.load(d_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sf = round_rne(xv + dv, s_ptr.dtype.element_ty).to(tl.float32)  # recomputed, same bits
            wv = tl.load(w_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                wv = 1.0 + wv
            tl.store(
                y_row + start + cols, round_rne((sf * rstd) * wv, y_ptr.dtype.element_ty), mask=m
            )


def add_rms_norm_reference(
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
    ``qwen_common.zero_centered_rms_norm`` (the reference) compute it. Both outputs are new
    tensors of ``x``'s shape (contiguous). One program per row, a fixed chunk of
    :func:`_row_block` ``(D)``: a row's result does not depend on the other rows
    (batch-invariant)."""
    new_x = x + delta
    acc = acc_dtype(new_x.dtype)
    xa = new_x.to(acc)
    y = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + weight.to(acc)) if zero_centered else weight.to(acc)
    return new_x, (y * w).to(new_x.dtype)


def add_rms_norm_triton(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`add_rms_norm` (arguments checked; no float64)."""
    d = x.shape[-1]
    x2, d2 = unit_stride_rows(x), unit_stride_rows(delta)
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


def _check_add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
) -> bool:
    check_float("x", x)
    check_float("delta", delta)
    check_float("weight", weight)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    if delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
    if delta.dtype != x.dtype:
        raise ValueError(f"delta must have x's dtype {x.dtype}, got {delta.dtype}")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    check_device("delta", delta, x, "x")
    check_device("weight", weight, x, "x")
    return torch.float64 not in (x.dtype, weight.dtype) and not records_autograd(x, delta, weight)


add_rms_norm = kernel_op(
    "add_rms_norm",
    triton=add_rms_norm_triton,
    reference=add_rms_norm_reference,
    device_of="x",
    check=_check_add_rms_norm,
    switch=FUSED_SWITCH,
)


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
        dn = round_rne((dv * rstd_d) * pw, dt).to(tl.float32)  # the post-norm, rounded to x's dtype
        xv = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        sv = round_rne(xv + dn, dt)
        tl.store(s_row + cols, sv, mask=m)
        if HAS_NEXT:
            sf = sv.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
            nw = tl.load(nw_ptr + cols, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                nw = 1.0 + nw
            tl.store(y_row + cols, round_rne((sf * rstd) * nw, y_ptr.dtype.element_ty), mask=m)
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
            dn = round_rne((dv * rstd_d) * pw, dt).to(tl.float32)
            xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sv = round_rne(xv + dn, dt)
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
                dn = round_rne((dv * rstd_d) * pw, dt).to(tl.float32)  # recomputed, same bits
                xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                sf = round_rne(xv + dn, dt).to(tl.float32)
                nw = tl.load(nw_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    nw = 1.0 + nw
                tl.store(y_row + start + cols, round_rne((sf * rstd) * nw, y_ptr.dtype.element_ty),
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
    """A branch's post-norm, the residual add and the next pre-norm in one pass (Gemma's
    ``post_attention_layernorm`` -> add -> ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` -> add -> the next layer's ``input_layernorm``).

    Returns ``(new_x, normed)``: ``new_x = x + rms_norm(delta, post_weight)`` and ``normed =
    rms_norm(new_x, next_weight)`` (None when ``next_weight`` is None: the last layer, whose
    stream goes to the final norm of the logits rows only). Each norm is
    ``v * rsqrt(mean(v^2) + eps) * w`` with the math in fp32 (``w`` the weight upcast, or
    ``1 + weight`` when ``zero_centered``: Gemma's ``gemma_rms_norm``) and one rounding to
    ``x``'s dtype, the sum in ``x``'s dtype. ``x``, ``delta`` ``[..., D]`` of one shape and dtype
    (fp16, bf16, fp32; float64 runs the reference), the weights ``[D]``. Both outputs are new
    contiguous tensors of ``x``'s shape. One program per row with the fixed chunk
    :func:`_row_block` ``(D)`` (batch-invariant)."""
    acc = acc_dtype(delta.dtype)
    da = delta.to(acc)
    y = da * torch.rsqrt(da.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + post_weight.to(acc)) if zero_centered else post_weight.to(acc)
    normed = (y * w).to(delta.dtype)
    if next_weight is None:
        return x + normed, None
    return add_rms_norm_reference(x, normed, next_weight, eps, zero_centered=zero_centered)


def norm_add_rms_norm_triton(
    x: torch.Tensor,
    delta: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton launcher of :func:`norm_add_rms_norm` (arguments checked; no float64)."""
    d = x.shape[-1]
    x2, d2 = unit_stride_rows(x), unit_stride_rows(delta)
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


def _check_norm_add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    *,
    zero_centered: bool = False,
) -> bool:
    check_float("x", x)
    check_float("delta", delta)
    check_float("post_weight", post_weight)
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
        check_float(name, w)
        if w.shape != (d,):
            raise ValueError(f"{name} must have shape ({d},), got {tuple(w.shape)}")
        check_device(name, w, x, "x")
    check_device("delta", delta, x, "x")
    if x.dtype == torch.float64 or post_weight.dtype == torch.float64:
        return False
    if next_weight is not None and next_weight.dtype == torch.float64:
        return False
    return not records_autograd(x, delta, post_weight, next_weight)


norm_add_rms_norm = kernel_op(
    "norm_add_rms_norm",
    triton=norm_add_rms_norm_triton,
    reference=norm_add_rms_norm_reference,
    device_of="x",
    check=_check_norm_add_rms_norm,
    switch=FUSED_SWITCH,
)


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
            n = round_rne(ov * rstd, dt).to(tl.float32)
            n = round_rne(wv * n, dt).to(tl.float32)
        else:  # nn_ops.rms_norm(o, w) (one cast after the weight)
            n = round_rne((ov * rstd) * wv, dt).to(tl.float32)
        gate = zv / (1.0 + tl.exp(-zv))  # silu in fp32
        tl.store(y_rows + start + cols, round_rne(n * gate, dt), mask=m)


_GATED_NORM_TILE = 8192  # elements of a gated-norm program's [heads, chunk] tile


def gated_rms_norm_reference(
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
    a fixed chunk over ``D``: row-local, whatever the number of tokens."""
    acc = acc_dtype(o.dtype)
    oa = o.to(acc)
    y = oa * torch.rsqrt(oa.pow(2).mean(-1, keepdim=True) + eps)
    if round_before_weight:
        out = (weight * y.to(o.dtype)).to(acc) * F.silu(z.to(acc))
    else:
        out = (y * weight.to(acc)).to(o.dtype).to(acc) * F.silu(z.to(acc))
    return out.to(o.dtype).reshape(o.shape[0], -1)


def gated_rms_norm_triton(
    o: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    *,
    round_before_weight: bool = False,
) -> torch.Tensor:
    """Triton launcher of :func:`gated_rms_norm` (arguments checked; no float64)."""
    t, h, d = o.shape
    o2, z2 = unit_last(o), unit_last(z)
    y = torch.empty((t, h * d), dtype=o.dtype, device=o.device)
    if t and h and d:
        block = _row_block(d)
        bh = min(next_pow2(h), max(1, _GATED_NORM_TILE // block))
        _gated_rms_norm_kernel[(t, triton.cdiv(h, bh))](
            o2, weight, z2, y, h, d, o2.stride(0), o2.stride(1), z2.stride(0), z2.stride(1),
            float(eps), ROUND_BEFORE_WEIGHT=bool(round_before_weight), BH=bh, BLOCK=block,
        )  # fmt: skip
    return y


def _check_gated_rms_norm(
    o: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    *,
    round_before_weight: bool = False,
) -> bool:
    check_float("weight", weight)
    check_heads_like(o, z, "z")
    d = o.shape[2]
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    check_device("weight", weight, o, "o")
    if o.dtype == torch.float64 or weight.dtype == torch.float64:
        return False
    return not (round_before_weight and weight.dtype != o.dtype)


gated_rms_norm = kernel_op(
    "gated_rms_norm",
    triton=gated_rms_norm_triton,
    reference=gated_rms_norm_reference,
    device_of="o",
    check=_check_gated_rms_norm,
    switch=FUSED_SWITCH,
)
