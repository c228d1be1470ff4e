"""Fused gates and activations: SwiGLU / GeGLU / gpt-oss's clamped SwiGLU, the Gated
DeltaNet gates and gated attention's output gate, each one elementwise Triton launch in place
of a chain of torch ops (batch-invariant: every element is computed on its own). Numerics and
dispatch: see :mod:`unimem_kernel.fused`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2, records_autograd
from unimem_kernel.fused_common import (
    FLOAT_DTYPES,
    FUSED_SWITCH,
    check_device,
    check_float,
    check_heads_like,
    unit_last,
    unit_stride_rows,
)
from unimem_kernel.rounding import round_rne

__all__ = [
    "clamped_swiglu",
    "clamped_swiglu_reference",
    "clamped_swiglu_triton",
    "gdn_gates",
    "gdn_gates_reference",
    "gdn_gates_triton",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "gelu_tanh_mul_triton",
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "sigmoid_gate_triton",
    "silu_mul",
    "silu_mul_reference",
    "silu_mul_triton",
]

# ------------------------------------------------------------------- gated activations

_ELEMENTWISE_BLOCK = 1024  # elements of one row per program in the gated activations


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
    b_ptr,  # [E, 2 * F_] the rows' [gate | up] biases (HAS_BIAS)
    e_ptr,  # [rows] int: each row's bias row (HAS_BIAS)
    stride_b,
    ACT: tl.constexpr,  # 0: silu, 1: gelu (tanh approximation), 2: gpt-oss's clamped SwiGLU
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F_
    dt = o_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:  # the projection's bias of the row's expert, each sum rounded to the dtype
        b_row = b_ptr + tl.load(e_ptr + row).to(tl.int64) * stride_b
        g = round_rne(g + tl.load(b_row + cols, mask=m, other=0.0).to(tl.float32), dt)
        u = round_rne(u + tl.load(b_row + F_ + cols, mask=m, other=0.0).to(tl.float32), dt)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
    if ACT == 2:
        # (clamp(up, -l, l) + 1) * (g * sigmoid(g * alpha)), g = clamp(gate, max=l): every
        # torch op's result rounded to the dtype, as the torch code rounds it
        g = round_rne(tl.minimum(g, limit), dt).to(tl.float32)
        u = round_rne(tl.minimum(tl.maximum(u, -limit), limit), dt).to(tl.float32)
        t = round_rne(g * alpha, dt).to(tl.float32)
        sg = round_rne(1.0 / (1.0 + tl.exp(-t)), dt).to(tl.float32)
        gs = round_rne(g * sg, dt).to(tl.float32)
        u1 = round_rne(u + 1.0, dt).to(tl.float32)
        tl.store(o_ptr + row * stride_o + cols, round_rne(u1 * gs, dt), mask=m)
    else:
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))  # torch's silu: x / (1 + exp(-x)) in fp32
        else:
            # torch's tanh GELU: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))),
            # with tanh(v) = 1 - 2 / (exp(2v) + 1) (no tanh in the interpreter)
            inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            th = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
            a = 0.5 * g * (1.0 + th)
        a = round_rne(a, dt).to(tl.float32)  # the activation is rounded first
        tl.store(o_ptr + row * stride_o + cols, round_rne(a * u, dt), mask=m)


def silu_mul_reference(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's activation ``F.silu(gate) * up`` in one pass.

    ``gate_up [..., 2F]`` holds ``[gate | up]`` (the fused gate/up projection; any row stride,
    unit stride along the last dim preferred), or, with ``up`` given, ``gate_up`` is the gate
    ``[..., F]`` and ``up`` has its shape and dtype. fp16 / bf16 / fp32 (float64 runs the
    reference). Returns a new contiguous ``[..., F]`` in the input dtype, computed as torch
    does: ``silu`` in fp32 rounded to the dtype, then the product in fp32 rounded to the dtype
    (for fp32 both roundings are no-ops). The reference is that torch expression."""
    gate, up = _gate_and_up(gate_up, up)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU's activation ``F.gelu(gate, approximate="tanh") * up`` in one pass; arguments,
    layout and rounding as :func:`silu_mul` (the GELU in fp32 with torch's formula, ``tanh``
    from ``exp``, rounded to the dtype before the product). The reference is that torch
    expression."""
    gate, up = _gate_and_up(gate_up, up)
    return F.gelu(gate, approximate="tanh") * up


def _gate_and_up(gate_up: torch.Tensor, up: torch.Tensor | None):
    if up is not None:
        return gate_up, up
    return gate_up.chunk(2, dim=-1)


def clamped_swiglu_reference(
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float,
    limit: float,
    *,
    bias: torch.Tensor | None = None,
    expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU ``(clamp(up, -l, l) + 1) * (g * sigmoid(g * alpha))`` with ``g
    = min(gate, l)``, in one pass. ``gate``, ``up [..., F]`` of one shape and dtype (fp16 /
    bf16 / fp32; float64 runs the reference; any row strides with a unit last one, e.g. the
    two halves of a gate/up GEMM's output). Every torch op's result is rounded to the dtype
    where the reference rounds it (the sigmoid's ``exp`` is the kernel's own: within an ulp).
    Returns a new contiguous ``[..., F]``. The reference is gpt-oss's expert activation as
    ``unimem.models.gpt_oss`` computed it.

    ``bias [E, 2F]`` with ``expert [M]`` (int32/int64; ``gate`` and ``up`` flattened to ``M``
    rows): row ``i``'s gate and up first get the gate and up halves of ``bias[expert[i]]``
    (each sum rounded to the dtype: the projection's bias, as ``h + bias[expert]`` adds it to
    the ``[gate | up]`` output), saving the gather and the add a MoE layer ran for it."""
    if bias is not None:
        f = gate.shape[-1]
        rows = bias[expert.long()].reshape(*gate.shape[:-1], 2 * f)
        gate, up = gate + rows[..., :f], up + rows[..., f:]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _check_gated(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> bool:
    """``gate_up [..., 2F]`` (``[gate | up]``), or ``gate_up [..., F]`` and ``up`` of its
    shape, dtype and device; whether the kernel covers them (no float64, no autograd)."""
    check_float("gate_up", gate_up)
    if gate_up.dim() < 1:
        raise ValueError("gate_up must have at least one dim")
    if up is None and gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even ([gate | up]), got {gate_up.shape[-1]}")
    if up is not None:
        check_float("up", up)
        if up.shape != gate_up.shape:
            raise ValueError(
                f"up must have gate_up's shape {tuple(gate_up.shape)}, got {tuple(up.shape)}"
            )
        if up.dtype != gate_up.dtype:
            raise ValueError(f"up must have gate_up's dtype {gate_up.dtype}, got {up.dtype}")
        check_device("up", up, gate_up, "gate_up")
    return gate_up.dtype != torch.float64 and not records_autograd(gate_up, up)


def _launch_gated(
    act: int,
    gate_up: torch.Tensor,
    up: torch.Tensor | None,
    alpha: float = 0.0,
    limit: float = 0.0,
    bias: torch.Tensor | None = None,
    expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """One ``_gated_act_kernel`` launch of activation ``act`` (its ``ACT`` codes); ``bias``
    / ``expert``: the rows' biases (:func:`clamped_swiglu`)."""
    gate, upv = _gate_and_up(gate_up, up)
    f = gate.shape[-1]
    g2, u2 = unit_stride_rows(gate), unit_stride_rows(upv)
    rows = g2.shape[0]
    out = torch.empty((rows, f), dtype=gate_up.dtype, device=gate_up.device)
    if rows and f:
        block = min(_ELEMENTWISE_BLOCK, next_pow2(f))
        grid = (rows, triton.cdiv(f, block))
        has_bias = bias is not None
        if has_bias and bias.stride(-1) != 1:
            bias = bias.contiguous()
        _gated_act_kernel[grid](
            g2, u2, out, f, g2.stride(0), u2.stride(0), out.stride(0), float(alpha),
            float(limit), bias if has_bias else out, expert if has_bias else out,
            bias.stride(0) if has_bias else 0, ACT=act, HAS_BIAS=has_bias, BLOCK=block,
        )  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], f)


def silu_mul_triton(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher of :func:`silu_mul` (arguments checked; no float64)."""
    return _launch_gated(0, gate_up, up)


def gelu_tanh_mul_triton(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher of :func:`gelu_tanh_mul` (arguments checked; no float64)."""
    return _launch_gated(1, gate_up, up)


def clamped_swiglu_triton(
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float,
    limit: float,
    *,
    bias: torch.Tensor | None = None,
    expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`clamped_swiglu` (arguments checked; no float64)."""
    return _launch_gated(2, gate, up, float(alpha), float(limit), bias, expert)


def _check_clamped(gate, up, alpha, limit, *, bias=None, expert=None) -> bool:
    covered = _check_gated(gate, up)
    if (bias is None) != (expert is None):
        raise ValueError("bias and expert go together")
    if bias is not None:
        f = gate.shape[-1]
        rows = gate.numel() // max(f, 1)
        if bias.dim() != 2 or bias.shape[1] != 2 * f or bias.dtype != gate.dtype:
            raise ValueError(f"bias must be [E, {2 * f}] {gate.dtype}, got "
                             f"{tuple(bias.shape)} {bias.dtype}")  # fmt: skip
        if expert.shape != (rows,) or expert.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"expert must be [{rows}] int32/int64, got {tuple(expert.shape)} "
                             f"{expert.dtype}")  # fmt: skip
        check_device("bias", bias, gate, "gate")
        check_device("expert", expert, gate, "gate")
    return covered


silu_mul = kernel_op(
    "silu_mul",
    triton=silu_mul_triton,
    reference=silu_mul_reference,
    device_of="gate_up",
    check=_check_gated,
    switch=FUSED_SWITCH,
)


gelu_tanh_mul = kernel_op(
    "gelu_tanh_mul",
    triton=gelu_tanh_mul_triton,
    reference=gelu_tanh_mul_reference,
    device_of="gate_up",
    check=_check_gated,
    switch=FUSED_SWITCH,
)


clamped_swiglu = kernel_op(
    "clamped_swiglu",
    triton=clamped_swiglu_triton,
    reference=clamped_swiglu_reference,
    device_of="gate",
    check=_check_clamped,
    switch=FUSED_SWITCH,
)


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
    a = round_rne(a, sdt).to(tl.float32)
    b = round_rne(b, sdt).to(tl.float32)
    alog = round_rne(alog, sdt).to(tl.float32)
    dtb = round_rne(dtb, sdt).to(tl.float32)
    x = round_rne(a + dtb, sdt).to(tl.float32)
    # torch's softplus (beta 1, threshold 20): x where x > 20, else log1p(exp(x))
    sp = tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0))))
    sp = round_rne(sp, sdt).to(tl.float32)
    e = round_rne(tl.exp(alog), sdt).to(tl.float32)
    g = (-e) * sp
    beta = 1.0 / (1.0 + tl.exp(-b))  # torch's sigmoid
    tl.store(g_ptr + row * H + cols, round_rne(g, sdt), mask=m)
    tl.store(beta_ptr + row * H + cols, round_rne(beta, sdt), mask=m)


def gdn_gates_reference(
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
    the mixers' torch code (the reference) does (``softplus`` with torch's defaults: beta 1,
    threshold 20, so ``x`` itself above 20). A float64 state dtype (or operand) runs the
    reference. Returns new contiguous tensors."""
    sdt = A_log.dtype if state_dtype is None else state_dtype
    g = -A_log.to(sdt).exp() * F.softplus(a.to(sdt) + dt_bias.to(sdt))
    beta = torch.sigmoid(b.to(sdt))
    return g, beta


def gdn_gates_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`gdn_gates` (arguments checked; no float64)."""
    sdt = A_log.dtype if state_dtype is None else state_dtype
    a2, b2 = unit_last(a), unit_last(b)
    t, h = a.shape
    g = torch.empty((t, h), dtype=sdt, device=a.device)
    beta = torch.empty((t, h), dtype=sdt, device=a.device)
    if t and h:
        _gdn_gates_kernel[(t,)](
            a2, b2, A_log, dt_bias, g, beta, h, a2.stride(0), b2.stride(0),
            BLOCK_H=next_pow2(h),
        )  # fmt: skip
    return g, beta


def _check_gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_dtype: torch.dtype | None = None,
) -> bool:
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        check_float(name, t)
    if a.dim() != 2:
        raise ValueError(f"a must be [T, H], got shape {tuple(a.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
    h = a.shape[1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (h,):
            raise ValueError(f"{name} must have shape ({h},), got {tuple(t.shape)}")
    for name, t in (("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        check_device(name, t, a, "a")
    sdt = A_log.dtype if state_dtype is None else state_dtype
    if sdt not in FLOAT_DTYPES:
        raise ValueError(f"state_dtype must be a float dtype, got {sdt}")
    sdt = A_log.dtype if state_dtype is None else state_dtype
    return torch.float64 not in (sdt, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype)


gdn_gates = kernel_op(
    "gdn_gates",
    triton=gdn_gates_triton,
    reference=gdn_gates_reference,
    device_of="a",
    check=_check_gdn_gates,
    switch=FUSED_SWITCH,
)


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
    s = round_rne(1.0 / (1.0 + tl.exp(-g.to(tl.float32))), dt)  # torch's sigmoid, in the dtype
    y = round_rne(o.to(tl.float32) * s.to(tl.float32), dt)
    tl.store(y_ptr + t * (H * D) + heads * D + cols, y, mask=m)


def sigmoid_gate_reference(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate ``o * sigmoid(gate)``, flattened to ``[T, H * D]``.

    ``o`` and ``gate`` are ``[T, H, D]`` of one dtype (fp16, bf16, fp32; float64 runs the
    reference), any token and head strides with a unit last one — the gate is typically a
    column slice of the stacked q/gate projection, read in place (the torch code copies it
    to reshape it). Returns a new contiguous ``[T, H * D]`` in that dtype, computed as torch
    does: ``sigmoid`` in fp32 (``1 / (1 + exp(-x))``) rounded to the dtype, then the product in
    fp32 rounded to the dtype; the kernel's ``exp`` may differ from torch's in the last fp32
    bit, so the gate agrees to rounding. Elementwise: batch-invariant. The reference is
    ``qwen_common.GatedAttention``'s code."""
    t = o.shape[0]
    return o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))


def _check_gate(o: torch.Tensor, gate: torch.Tensor) -> bool:
    check_heads_like(o, gate, "gate")
    return o.dtype != torch.float64 and not records_autograd(o, gate)


def sigmoid_gate_triton(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`sigmoid_gate` (arguments checked; no float64)."""
    o2, g2 = unit_last(o), unit_last(gate)
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


sigmoid_gate = kernel_op(
    "sigmoid_gate",
    triton=sigmoid_gate_triton,
    reference=sigmoid_gate_reference,
    device_of="o",
    check=_check_gate,
    switch=FUSED_SWITCH,
)
