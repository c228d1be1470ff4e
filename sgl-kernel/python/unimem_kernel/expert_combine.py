"""The last step of a routed-experts (MoE) layer in one launch: weight each (token, slot) pair's
expert output and sum a token's ``k`` slots, reading the pairs where the grouped GEMMs left
them (sorted by expert).

Semantics (``moe_combine_reference``, the torch code the MoE layer ran before): ``y [P, d]``
holds the expert outputs of the ``P = T * k`` pairs in *sorted* order — row ``i`` is pair
``order[i]``, pair ``p = t * k + j`` being token ``t``'s slot ``j`` — and ``weights [T, k]``
their routing weights. Then, with ``inv`` the inverse permutation of ``order``
(``inv[order[i]] = i``)::

    out[t] = sum_{j = 0 .. k-1} fp32( round_y( y[inv[t*k + j]] * round_y(weights[t, j]) ) )

computed in float32 in that order (slot 0 first) and rounded once to ``y``'s dtype: each
product rounded to ``y``'s dtype first (as ``y * weights.to(y.dtype)`` does), the sum over the
slots in float32. Per token and independent of ``T``: batch-invariant as it stands.

Optionally the experts' output biases join first (gpt-oss's ``down_proj_bias``): with
``bias [E, d]`` and ``expert [P]`` (the expert of each sorted row, :func:`moe_route`'s),
``y[i]`` is ``round_y(y[i] + bias[expert[i]])`` before it is weighted, bit for bit what
``y + bias[expert]`` gives; this saves the gather and the add a layer ran for it.

Optionally a sigmoid-gated shared expert joins (Qwen3-Next's block): ``out[t] += sigmoid(
x[t] . w_gate) * shared[t]``, each of the logit, the gate, the product and the sum rounded to
``y``'s dtype as torch's bf16 ops round them; the logit's dot product is the kernel's own
float32 sum over ``d`` (every column program computes it for its token), so this term agrees
with the reference to rounding rather than bitwise.

It replaces three passes over the ``[P, d]`` rows (the weight multiply, the ``index_copy_``
back to pair order, the sum over the slots) and the intermediate ``[P, d]`` tensor: the
kernel gathers each token's ``k`` rows through ``inv`` and writes ``[T, d]`` once. Grid
``(T, cdiv(d, BLOCK_D))``; it allocates only ``inv`` and the output, reads nothing on the host
(captured in CUDA graphs); it is compiled without multiply-add contraction, so that every
product is rounded before it is added, as in the reference. ``order`` must be a permutation
of ``0 .. P-1`` (the caller's: :func:`unimem_kernel.moe_route`, whose ``inverse`` it can
take too); it is not checked on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.rounding import round_rne

__all__ = ["moe_combine", "moe_combine_reference", "moe_combine_triton"]

_BLOCK_D = 1024  # columns per program


@triton.jit
def _moe_combine_kernel(
    y_ptr,  # [P, d] expert outputs, sorted by expert
    inv_ptr,  # [P] int64: row of pair p in y
    w_ptr,  # [T, K] routing weights
    out_ptr,  # [T, d]
    sh_ptr,  # [T, d] the shared expert's output (HAS_SHARED)
    hx_ptr,  # [T, d] the shared gate's input (HAS_SHARED)
    wg_ptr,  # [d] the shared gate's weight (HAS_SHARED)
    b_ptr,  # [E, d] the experts' output biases (HAS_BIAS)
    e_ptr,  # [P] int: the expert of each sorted row (HAS_BIAS)
    d,
    y_s,
    w_s,
    o_s,
    sh_s,
    hx_s,
    b_s,
    K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_BLOCKS: tl.constexpr,  # cdiv(d, BLOCK_D)
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < d
    dt = y_ptr.dtype.element_ty
    # Every load is issued before any arithmetic waits on one: the slots' rows and weights,
    # the shared expert's terms (independent of the rows), then the routed rows. The gate's
    # logit is a [T, 1] product: the whole row, in every column program.
    rows = ()
    ws = ()
    for j in tl.static_range(K):
        rows = rows + (tl.load(inv_ptr + t * K + j).to(tl.int64),)
        ws = ws + (round_rne(tl.load(w_ptr + t * w_s + j).to(tl.float32), dt).to(tl.float32),)
    if HAS_SHARED:
        cols = tl.arange(0, BLOCK_D)
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(D_BLOCKS):
            cm = i * BLOCK_D + cols < d
            hv = tl.load(hx_ptr + t * hx_s + i * BLOCK_D + cols, mask=cm, other=0.0)
            wv = tl.load(wg_ptr + i * BLOCK_D + cols, mask=cm, other=0.0)
            dot += hv.to(tl.float32) * wv.to(tl.float32)
        sv = tl.load(sh_ptr + t * sh_s + offs, mask=m, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        yv = tl.load(y_ptr + rows[j] * y_s + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(e_ptr + rows[j]).to(tl.int64)
            bv = tl.load(b_ptr + e * b_s + offs, mask=m, other=0.0).to(tl.float32)
            yv = round_rne(yv + bv, dt).to(tl.float32)
        acc += round_rne(yv * ws[j], dt).to(tl.float32)
    out = round_rne(acc, out_ptr.dtype.element_ty)
    if HAS_SHARED:
        # the logit, its sigmoid, the gated shared output and the sum, each rounded as torch
        # rounds it
        logit = round_rne(tl.sum(dot, axis=0), dt).to(tl.float32)
        gate = round_rne(tl.sigmoid(logit), dt).to(tl.float32)
        gated = round_rne(gate * sv, dt).to(tl.float32)
        out = round_rne(out.to(tl.float32) + gated, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * o_s + offs, out, mask=m)


def _check(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
    """``(T, k)`` after checking shapes, dtypes and devices."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be [T, k], got {tuple(weights.shape)}")
    t, k = weights.shape
    if y.dim() != 2 or y.shape[0] != t * k:
        raise ValueError(f"y must be [T * k = {t * k}, d], got {tuple(y.shape)}")
    if order.shape != (t * k,) or order.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"order must be [{t * k}] int32/int64, got {tuple(order.shape)} "
                         f"{order.dtype}")  # fmt: skip
    if not y.is_floating_point() or not weights.is_floating_point():
        raise ValueError(f"y and weights must be floating point, got {y.dtype}, {weights.dtype}")
    for name, x in (("order", order), ("weights", weights)):
        if x.device != y.device:
            raise ValueError(f"{name} is on {x.device}, y on {y.device}")
    return t, k


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i`` (int64)."""
    idx = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(idx).scatter_(0, order.long(), idx)


def _check_bias(y, bias, expert) -> None:
    if (bias is None) != (expert is None):
        raise ValueError("bias and expert go together")
    if bias is None:
        return
    if bias.dim() != 2 or bias.shape[1] != y.shape[1] or bias.dtype != y.dtype:
        raise ValueError(f"bias must be [E, {y.shape[1]}] {y.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")  # fmt: skip
    if expert.shape != (y.shape[0],) or expert.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert must be [{y.shape[0]}] int32/int64, got "
                         f"{tuple(expert.shape)} {expert.dtype}")  # fmt: skip
    for name, x in (("bias", bias), ("expert", expert)):
        if x.device != y.device:
            raise ValueError(f"{name} is on {x.device}, y on {y.device}")


def _check_shared(y, t, shared, gate_input, gate_weight) -> None:
    given = [x is not None for x in (shared, gate_input, gate_weight)]
    if any(given) and not all(given):
        raise ValueError("shared, gate_input and gate_weight go together (all or none)")
    if not all(given):
        return
    d = y.shape[1]
    for name, x in (("shared", shared), ("gate_input", gate_input)):
        if x.shape != (t, d) or x.dtype != y.dtype or x.device != y.device:
            raise ValueError(f"{name} must be [{t}, {d}] {y.dtype} on {y.device}, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")  # fmt: skip
    if gate_weight.numel() != d or gate_weight.device != y.device:
        raise ValueError(f"gate_weight must hold {d} values on {y.device}, got "
                         f"{tuple(gate_weight.shape)} on {gate_weight.device}")  # fmt: skip


def moe_combine_reference(
    y: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    inverse: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    gate_input: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum over each token's ``k`` slots of the expert outputs ``y [T * k, d]``
    (sorted by ``order``), as ``[T, d]`` in ``y``'s dtype (float64 and ``k = 0`` run the
    reference). Same numbers, bitwise, on either side (float32 sums in slot order). ``inverse``
    (optional, ``[T * k]`` int64, ``inverse[order[i]] = i``: :func:`~unimem_kernel.moe_route`
    returns it) saves the kernel the scatter that computes it; it is trusted, not checked (the
    reference does not need it).

    A sigmoid-gated shared expert (Qwen3-Next's) joins in the same pass when ``shared``
    (its output ``[T, d]``), ``gate_input`` (the layer input ``[T, d]``) and ``gate_weight``
    (``[d]`` or ``[1, d]``) are given: ``out = routed + sigmoid(gate_input @ gate_weight^T) *
    shared``, each term rounded to ``y``'s dtype as torch's ops round it. The gate's dot
    product is the kernel's own float32 sum, so that term agrees with the reference to
    rounding, not bitwise (the routed sum stays bitwise).

    ``bias [E, d]`` with ``expert [P]`` (int32/int64, the expert of each row of ``y``): the
    experts' output biases, added to the rows first (``y + bias[expert]``)."""
    t, k = _check(y, order, weights)
    _check_shared(y, t, shared, gate_input, gate_weight)
    _check_bias(y, bias, expert)
    if bias is not None:
        y = y + bias[expert.long()]
    if t == 0 or k == 0:
        out = y.new_zeros(t, y.shape[1])
    else:
        prod = y * weights.reshape(-1)[order.long(), None].to(y.dtype)
        unsorted = torch.empty_like(prod).index_copy_(0, order.long(), prod).view(t, k, -1)
        acc = unsorted[:, 0].float()
        for j in range(1, k):
            acc = acc + unsorted[:, j].float()
        out = acc.to(y.dtype)
    if shared is not None:
        gate = torch.sigmoid(gate_input @ gate_weight.reshape(-1, 1).to(gate_input.dtype))
        out = out + gate * shared
    return out


def moe_combine_triton(
    y: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    inverse: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    gate_input: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`moe_combine` (arguments already checked; ``k >= 1``)."""
    t, k = weights.shape
    if y.stride(-1) != 1:
        y = y.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    d = y.shape[1]
    out = y.new_empty(t, d)
    if t == 0 or d == 0:
        return out
    has_shared = shared is not None
    if has_shared:
        shared, gate_input = (x if x.stride(-1) == 1 else x.contiguous()
                              for x in (shared, gate_input))  # fmt: skip
        gate_weight = gate_weight.reshape(-1)
    has_bias = bias is not None
    if has_bias and bias.stride(-1) != 1:
        bias = bias.contiguous()
    block = min(_BLOCK_D, next_pow2(d))
    inv = _inverse(order) if inverse is None else inverse
    _moe_combine_kernel[(t, triton.cdiv(d, block))](
        y, inv, weights, out,
        shared if has_shared else out, gate_input if has_shared else out,
        gate_weight if has_shared else out, bias if has_bias else out,
        expert if has_bias else inv,
        d, y.stride(0), weights.stride(0), out.stride(0),
        shared.stride(0) if has_shared else 0, gate_input.stride(0) if has_shared else 0,
        bias.stride(0) if has_bias else 0,
        K=k, HAS_SHARED=has_shared, HAS_BIAS=has_bias, BLOCK_D=block,
        D_BLOCKS=triton.cdiv(d, block), num_warps=4,
        # each product rounded before it is added, as torch does: no multiply-add contraction
        # (for float32 ``y`` the compiler would otherwise fuse ``acc + y * w`` into an FMA)
        enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _check_combine(
    y: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    inverse: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    gate_input: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert: torch.Tensor | None = None,
) -> bool:
    t, k = _check(y, order, weights)
    _check_shared(y, t, shared, gate_input, gate_weight)
    _check_bias(y, bias, expert)
    if inverse is not None and inverse.shape != order.shape:
        raise ValueError(f"inverse must be [{t * k}] like order, got {tuple(inverse.shape)}")
    return weights.shape[1] > 0 and y.dtype != torch.float64


moe_combine = kernel_op(
    "moe_combine",
    triton=moe_combine_triton,
    reference=moe_combine_reference,
    device_of="y",
    check=_check_combine,
)
