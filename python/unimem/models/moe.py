"""Routed expert MLPs for mixture-of-experts layers: one grouped GEMM per projection.

:func:`expert_mlp` runs every (token, expert) pair a router chose through its expert's
gate/up projection, the architecture's activation and the down projection, and sums the
pairs back per token with their routing weights. The pairs are grouped by expert on the
device (:func:`unimem_kernel.moe_route`, a stable counting sort: fixed shapes, no host read,
so the step stays capturable in a CUDA graph), each projection is one grouped GEMM over the
experts' row groups (:func:`unimem_kernel.expert_linear`) — never a Python loop over experts
— and one launch weights the pairs and sums them back per token in a fixed order
(:func:`unimem_kernel.moe_combine`), so results are
deterministic. :func:`expert_mlp_reference` is the per-expert loop with identical semantics,
the oracle in tests (it reads which experts were chosen on the host).

Weights are stacked per expert: ``w_gate_up [E, 2I, d]`` with rows ``[gate (I) | up (I)]``
and ``w_down [E, d, I]`` (``nn.Linear`` orientation: out x in), optional biases
``b_gate_up [E, 2I]`` and ``b_down [E, d]``. ``act(gate [M, I], up [M, I]) -> [M, I]`` is
the architecture's gated activation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from unimem.models import batch_invariant
from unimem_kernel import (
    bi_grouped_linear,
    expert_linear,
    fp8_grouped_linear,
    moe_combine,
    moe_route,
)

GatedAct = Callable[..., torch.Tensor]
"""An expert activation ``act(gate, up) -> [M, I]``. One whose experts have gate/up biases
also takes ``act(gate, up, bias=[E, 2I], expert=[M])`` and adds row ``i``'s expert's bias
halves first (gpt-oss's :func:`unimem_kernel.clamped_swiglu`), saving a gather and an add."""

__all__ = ["GatedAct", "expert_mlp", "expert_mlp_reference", "grouped_mm_supported"]


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for activations like ``x``: bf16 on CUDA (SM90+),
    float32 on the CPU. Other cases take the reference loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16
    return x.dtype == torch.float32


def _check(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down) -> None:
    t, d = x.shape
    e, two_i, d1 = w_gate_up.shape
    if d1 != d or two_i % 2 or w_down.shape != (e, d, two_i // 2):
        raise ValueError(
            f"expert weights do not fit: x [T, {d}], w_gate_up {tuple(w_gate_up.shape)}, "
            f"w_down {tuple(w_down.shape)} (expected [E, 2I, d] and [E, d, I])"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T = {t}, k]"
        )
    if b_gate_up is not None and b_gate_up.shape != (e, two_i):
        raise ValueError(f"b_gate_up {tuple(b_gate_up.shape)} != [{e}, {two_i}]")
    if b_down is not None and b_down.shape != (e, d):
        raise ValueError(f"b_down {tuple(b_down.shape)} != [{e}, {d}]")


def expert_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    act: GatedAct,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token.

    ``x [T, d]`` (model dtype), ``topk_ids [T, k]`` int64 in ``[0, E)``, ``topk_weights
    [T, k]`` (float32; cast to ``x``'s dtype before the weighted sum, as the activations
    are). Returns ``[T, d]`` in ``x``'s dtype. Grouped GEMMs where
    :func:`grouped_mm_supported`, else :func:`expert_mlp_reference`. With ``shared [T, d]``
    (a shared expert's output) and ``shared_gate_weight [1, d]``, adds
    ``sigmoid(x @ shared_gate_weight^T) * shared`` in the same final pass
    (:func:`unimem_kernel.moe_combine`). FP8 experts: ``w_gate_up`` / ``w_down`` e4m3 with
    per-row-group scales ``w_gate_up_scale [E, 2I, KG]`` / ``w_down_scale [E, d, KG']``
    (:mod:`unimem.models.fp8_linear`); each projection is then one grouped FP8 launch
    (:func:`unimem_kernel.fp8_grouped_linear`, the torch reference off CUDA).
    """
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down)
    if (shared is None) != (shared_gate_weight is None):
        raise ValueError("shared and shared_gate_weight go together")
    fp8 = w_gate_up_scale is not None
    if fp8 != (w_down_scale is not None):
        raise ValueError("w_gate_up_scale and w_down_scale go together")
    if not fp8 and not grouped_mm_supported(x):
        return expert_mlp_reference(
            x, topk_ids, topk_weights, w_gate_up, w_down, act=act, b_gate_up=b_gate_up,
            b_down=b_down, shared=shared, shared_gate_weight=shared_gate_weight,
        )  # fmt: skip
    # the pairs grouped by expert: a stable counting sort on the device (fixed shapes, no host
    # read: the step stays capturable), with each expert's end row for the grouped GEMMs
    route = moe_route(topk_ids, w_gate_up.shape[0])
    offs = route.ends
    invariant = batch_invariant.covers(x)
    grouped = _grouped_invariant if invariant else _grouped_vendor
    if fp8:
        scales = {id(w_gate_up): w_gate_up_scale, id(w_down): w_down_scale}
        grouped = _grouped_fp8(scales, invariant)
    h = grouped(x, w_gate_up, offs, route.token)  # row i is token route.token[i]
    gate, up = h.chunk(2, dim=-1)
    # the gate/up biases of each row's expert are added inside the activation
    biases = {} if b_gate_up is None else {"bias": b_gate_up, "expert": route.expert}
    y = grouped(act(gate, up, **biases).contiguous(), w_down, offs)
    # the down biases, the weights, back to (token, slot) order and the sum over the k slots
    # in one pass: slot 0 + slot 1 + ... in float32 per token, deterministic and
    # batch-invariant (index_add_ on CUDA accumulates with atomics in a varying order; torch's
    # reduction splits by token count)
    extra = {} if shared is None else {"shared": shared, "gate_input": x,
                                       "gate_weight": shared_gate_weight}  # fmt: skip
    if b_down is not None:
        extra |= {"bias": b_down, "expert": route.expert}
    out = moe_combine(y, route.order, topk_weights, route.inverse, **extra)
    return out.to(x.dtype)


def _grouped_vendor(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``x`` (or ``x[rows]``) times their expert's ``w [E, N, K]``: one grouped GEMM
    launch (:func:`unimem_kernel.expert_linear`: Triton tiles at decode/verify sizes, which
    read ``x[rows]`` in place; ``torch._grouped_mm`` for prefill)."""
    return expert_linear(x, w, offs, rows)


def _grouped_fp8(scales: dict[int, torch.Tensor], invariant: bool) -> Callable:
    """As :func:`_grouped_vendor` for FP8 weights: ``scales`` maps ``id(w)`` to ``w``'s
    per-row-group scales (:func:`unimem_kernel.fp8_grouped_linear`; its invariant tile
    under batch invariance)."""

    def grouped(x, w, offs, rows=None):
        return fp8_grouped_linear(x, w, scales[id(w)], offs, rows, invariant=invariant)

    return grouped


def _grouped_invariant(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """As :func:`_grouped_vendor` with each row's result independent of the other rows
    (:func:`unimem_kernel.bi_grouped_linear`)."""
    return bi_grouped_linear(x, w, offs, rows=rows)


def expert_mlp_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    act: GatedAct,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`expert_mlp` as a loop over the experts that were chosen (reads the choice on
    the host: eager only)."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = x[tok] @ w_gate_up[e].T
        if b_gate_up is not None:
            h = h + b_gate_up[e]
        gate, up = h.chunk(2, dim=-1)
        y = act(gate, up) @ w_down[e].T
        if b_down is not None:
            y = y + b_down[e]
        y = y * topk_weights[tok, slot, None].to(y.dtype)
        out.index_add_(0, tok, y.to(x.dtype))
    if shared is not None:
        out = out + torch.sigmoid(x @ shared_gate_weight.t()) * shared
    return out
