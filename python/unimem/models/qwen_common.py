"""Layers shared by the Qwen hybrid families (Qwen3-Next, Qwen3.5): the pieces both stack in
the same pre-norm residual layout, and the model shell that runs that stack on a
:class:`~unimem.models.forward_context.ForwardContext`.

Layout (both families)::

    x = embed_tokens[ids]                                       # no embedding scaling
    for each layer i:
        x = x + mixer_i(norm1(x))          # GDN ("linear_attention") or gated attention
        x = x + mlp_i(norm2(x))            # dense SwiGLU, or sparse MoE + shared expert
    logits = lm_head(norm(x[logits_indices]))

* Every stack norm (``input_layernorm``, ``post_attention_layernorm``, final ``norm``, the
  attention ``q_norm`` / ``k_norm``) is zero-centred: ``rmsnorm(x) * (1 + w)``, computed in
  float32 and cast back (:func:`zero_centered_rms_norm`).
* Gated attention (:class:`GatedAttention`): ``q_proj`` yields per head ``[query (Dh) |
  gate (Dh)]``; per-head ``q_norm`` / ``k_norm``; rotate-half RoPE on the first
  ``rotary_dim`` dims only (partial rotary); ``ctx.attention``; output times
  ``sigmoid(gate)``; ``o_proj``.
* GDN mixer (:class:`GdnMixer`): the family's input projections give ``mixed_qkv`` (conv
  channels ``[q | k | v]``, head-major), ``z``, ``b``, ``a``;
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (state dtype);
  ``ctx.gdn`` (conv + SiLU + L2-norm + delta rule); gated RMSNorm per value head
  ``rmsnorm(o) * w * silu(z)`` (plain ``w``, ones-initialised — not ``1 + w``); ``out_proj``.

Parameters carry the checkpoint names (``model.layers.N.self_attn.q_proj.weight``, ...), so
most tensors load 1:1 by name (:meth:`QwenHybridForCausalLM.load_weights`); a family
re-lays out the tensors whose layout differs in :meth:`QwenHybridForCausalLM._load_special`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from unimem.models import fp8_linear
from unimem.models.base import CausalLM, ModelOutput
from unimem.models.batch_invariant import rms_normalize
from unimem.models.config import HybridConfig
from unimem.models.forward_context import ForwardContext
from unimem.models.loader import copy_param
from unimem.models.moe import expert_mlp
from unimem.models.nn_ops import apply_rope, frozen_param, small_step
from unimem.models.stacked_linear import StackedRows
from unimem.models.tensor_parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    gdn_qkv_ranges,
    heads,
    parallel_embedding,
    shard,
    vocab_shard,
)
from unimem_kernel import (
    add_rms_norm,
    bi_rms_norm,
    envs,
    gdn_gates,
    norm_linear,
    router_topk,
    sigmoid_gate,
)
from unimem_kernel import gated_rms_norm as fused_gated_rms_norm
from unimem_kernel import silu_mul as fused_silu_mul
from unimem_kernel.fused import records_autograd
from unimem_kernel.fused import use_triton as fused_ops_on
from unimem_kernel.rope_angles import rope_cos_sin

LAYER_TYPES = {"linear_attention": "gdn", "full_attention": "full"}
"""HF ``config.layer_types`` entry -> ``HybridConfig.layer_pattern`` entry."""


# ---------------------------------------------------------------------- parameters


class Weight(nn.Module):
    """Holds one parameter named ``weight`` so that module paths end in ``.weight`` as the
    checkpoint names them (``...q_proj.weight``, ``...input_layernorm.weight``)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = frozen_param(*shape, dtype=dtype, device=device)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------- norms


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, in float32 (float64
    for float64 inputs), cast back to ``x``'s dtype once at the end. Where the fused ops run
    (CUDA, ``UNIMEM_FUSED_OPS`` on, no autograd) one row-local launch
    (:func:`unimem_kernel.bi_rms_norm`, ``zero_centered``: the same math, batch-invariant);
    elsewhere the torch code below."""
    if x.dtype != torch.float64 and fused_ops_on(x) and not records_autograd(x, weight):
        return bi_rms_norm(x, weight, eps, zero_centered=True)
    acc = _acc(x.dtype)
    y = rms_normalize(x.to(acc), eps)
    return (y * (1.0 + weight.to(acc))).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
    """The GDN output norm: ``(rmsnorm(x) * weight) * silu(gate)`` over the last dim.
    ``x, gate [..., D]``, ``weight [D]``. The normalised ``x`` is rounded to ``x``'s dtype
    before the weight multiplies it and the gate applies in float32 (float64 for float64),
    as HuggingFace's ``RMSNormGated``; returns ``x``'s dtype."""
    acc = _acc(x.dtype)
    normed = rms_normalize(x.to(acc), eps).to(x.dtype)
    y = (weight * normed).to(acc) * F.silu(gate.to(acc))
    return y.to(x.dtype)


# ---------------------------------------------------------------------- rotary


class PartialRotary(nn.Module):
    """Rotate-half RoPE over the first ``rotary_dim`` dims of each head (the rest pass
    through): ``inv_freq[j] = theta ** (-2j / rotary_dim)``, angles ``position * inv_freq``,
    computed in float32 (float64 for float64 models) as HuggingFace's default rope."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, dtype: torch.dtype):
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"partial_rotary_factor gives rotary dim {rotary_dim}: must be even and in "
                f"(0, head_dim = {head_dim}]"
            )
        self.rotary_dim = rotary_dim
        self.rope_dtype = _acc(dtype)
        exps = torch.arange(0, rotary_dim, 2, dtype=self.rope_dtype) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exps), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, rotary_dim / 2]`` for ``positions [T]``."""
        return rope_cos_sin(positions, self.inv_freq)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` with its first ``rotary_dim`` dims rotated; same dtype."""
        rd = self.rotary_dim
        if rd == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


# ---------------------------------------------------------------------- mixers


class GatedAttention(nn.Module):
    """Full attention with an output gate (module docstring). Parameters as the checkpoint's
    ``self_attn``: ``q_proj [Hq * 2 * Dh, d]`` (per head ``[query | gate]``), ``k_proj``,
    ``v_proj [Hkv * Dh, d]``, ``o_proj [d, Hq * Dh]``, ``q_norm``, ``k_norm [Dh]``. ``c`` is
    the rank's config (its heads); ``o_proj`` is row-parallel."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.c = c
        self.tp = tp
        hq, hkv, dh, d = c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.d_model
        kw = {"dtype": c.dtype, "device": device}
        self.q_proj = Weight(hq * 2 * dh, d, **kw)
        self.k_proj = Weight(hkv * dh, d, **kw)
        self.v_proj = Weight(hkv * dh, d, **kw)
        self.o_proj = Weight(d, hq * dh, **kw)
        self.q_norm = Weight(dh, **kw)
        self.k_norm = Weight(dh, **kw)
        # q (with its gate), k and v as one GEMM; the q/k norms read their head views of
        # its columns in place (bi_rms_norm's two-stride rows)
        self.qkv = StackedRows(self.q_proj, self.k_proj, self.v_proj)
        # the o_proj's route through cuBLASLt (row_parallel_linear_lt); not a weight
        self.register_buffer("o_zero", torch.zeros(d, **kw), persistent=False)

    def forward(
        self,
        layer_idx: int,
        h: torch.Tensor,
        rotary: PartialRotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        c, t = self.c, h.shape[0]
        hq, hkv, dh = c.n_q_heads, c.n_kv_heads, c.head_dim_k
        qg, k, v = self.qkv.linear(h)
        qg = qg.view(t, hq, 2 * dh)
        q, gate = qg[..., :dh], qg[..., dh:]
        k, v = k.view(t, hkv, dh), v.view(t, hkv, dh)
        if q.dtype != torch.float64 and fused_ops_on(q) and not records_autograd(q):
            # q_norm / k_norm, RoPE and the K/V store in one launch (paged contexts)
            norms = (self.q_norm.weight, self.k_norm.weight, c.rms_eps)
            o = ctx.rope_attention(layer_idx, q, k, v, *cos_sin, qk_norm=norms)
        else:
            q = zero_centered_rms_norm(q, self.q_norm.weight, c.rms_eps)
            k = zero_centered_rms_norm(k, self.k_norm.weight, c.rms_eps)
            o = ctx.rope_attention(layer_idx, q, k, v, *cos_sin)  # rotary.apply on q and k
        o = sigmoid_gate(o.reshape(t, hq, dh), gate)  # o * sigmoid(gate), the gate read in place
        return fp8_linear.row_parallel(o, self.o_proj, self.o_zero, self.tp)


class GdnMixer(nn.Module):
    """Gated DeltaNet mixer (module docstring) without its input projections, which differ
    per family: subclasses create them and implement :meth:`project`.

    Parameters as the checkpoint's ``linear_attn``: ``conv1d.weight [conv_dim, K]`` (the
    checkpoint stores ``[conv_dim, 1, K]``; the middle dim is dropped at load), ``A_log``
    and ``dt_bias [H]`` (kept in ``config.state_dtype``), ``norm.weight [Dv]``,
    ``out_proj.weight [d, H * Dv]``. ``c`` is the rank's config (its key and value heads);
    ``out_proj`` is row-parallel.
    """

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.c = c
        self.tp = tp
        h, dv = c.gdn_heads, c.gdn_head_dim_v
        kw = {"dtype": c.dtype, "device": device}
        self.conv1d = Weight(c.gdn_conv_dim, c.conv_kernel, **kw)
        self.A_log = frozen_param(h, dtype=c.state_dtype, device=device)
        self.dt_bias = frozen_param(h, dtype=c.state_dtype, device=device)
        self.norm = Weight(dv, **kw)
        self.out_proj = Weight(c.d_model, h * dv, **kw)
        # the out_proj's route through cuBLASLt (row_parallel_linear_lt); not a weight
        self.register_buffer("out_zero", torch.zeros(c.d_model, **kw), persistent=False)

    def project(
        self, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h [T, d]`` -> ``mixed_qkv [T, conv_dim]`` (``[q | k | v]``; unit stride along
        the channels, rows of any stride: a column view of a wider projection is read in
        place), ``z [T, H * Dv]``, ``b [T, H]``, ``a [T, H]``."""
        raise NotImplementedError

    def forward(self, layer_idx: int, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c, t = self.c, h.shape[0]
        sdt = c.state_dtype
        mixed_qkv, z, b, a = self.project(h)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias, sdt)
        o = ctx.gdn(layer_idx, mixed_qkv, g, beta, conv_weight=self.conv1d.weight)
        z = z.reshape(t, c.gdn_heads, c.gdn_head_dim_v)
        if z.dtype == o.dtype:  # gated_rms_norm in one fused pass
            o = fused_gated_rms_norm(o, self.norm.weight, z, c.rms_eps, round_before_weight=True)
        else:
            o = gated_rms_norm(o, self.norm.weight, z, c.rms_eps)
        o = o.reshape(t, -1)
        return fp8_linear.row_parallel(o, self.out_proj, self.out_zero, self.tp)


# ---------------------------------------------------------------------- MLPs


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` (one fused pass: :func:`unimem_kernel.silu_mul`;
    torch broadcasting for operands of other shapes or dtypes)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return F.silu(gate) * up
    return fused_silu_mul(gate, up)


class DenseMlp(nn.Module):
    """SwiGLU ``down_proj(silu(gate_proj(x)) * up_proj(x))`` of width ``ffn``; on a
    tensor-parallel rank its ``ffn / tp.size`` columns (gate/up column-parallel, down
    row-parallel)."""

    def __init__(
        self,
        d: int,
        ffn: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
        *,
        stack: bool = True,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.tp = tp
        start, stop = tp.part(ffn, "intermediate_size")
        ffn = stop - start
        self.gate_proj = Weight(ffn, d, **kw)
        self.up_proj = Weight(ffn, d, **kw)
        self.down_proj = Weight(d, ffn, **kw)
        # gate and up as one GEMM; a caller that stacks them with its own projections of
        # the same input (the MoE block) passes stack=False and calls :meth:`down`
        self.gate_up = StackedRows(self.gate_proj, self.up_proj) if stack else None

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``down_proj(silu(gate) * up)`` of the gate and up projections' outputs."""
        return fp8_linear.linear(silu_mul(gate, up), self.down_proj)

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output (the output itself for size 1)."""
        if self.gate_up is not None:
            return self.down(*self.gate_up.linear(h))
        return self.down(fp8_linear.linear(h, self.gate_proj), fp8_linear.linear(h, self.up_proj))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(h))

    def takes_norm_linear(self, x: torch.Tensor) -> bool:
        """Whether a step of ``x [T, d]`` runs :meth:`forward_small`: at most
        ``UNIMEM_NORM_LINEAR_ROWS`` rows, the fused kernels on, one rank, gate/up one 16/32-bit
        stack and down not FP8, not batch-invariant mode (whose GEMMs round as the larger
        batches do)."""
        return (
            small_step(x, self.tp.size)
            and self.gate_up is not None
            and self.gate_up.single_weight() is not None
            and not fp8_linear.is_fp8(self.down_proj)
        )

    def forward_small(
        self, x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A small step: the residual add ``x + delta``, the zero-centred pre-norm, gate/up
        and SwiGLU in one :func:`unimem_kernel.norm_linear` launch, down in another (plain
        ``norm_linear`` with ``UNIMEM_NORM_LINEAR_PLAIN``, else the vendor GEMM); returns
        ``(x + delta, mlp output)``, rounded as ``add_rms_norm`` then :meth:`forward` round
        them (only the summation order differs)."""
        x, act = norm_linear(
            x, self.gate_up.single_weight(), norm_weight, eps, delta=delta, zero_centered=True,
            act="silu",
        )  # fmt: skip
        if envs.get("UNIMEM_NORM_LINEAR_PLAIN"):
            return x, norm_linear(act, self.down_proj.weight, None, eps)[1]
        return x, fp8_linear.linear(act, self.down_proj)


class StackedExperts(nn.Module):
    """The routed experts as stacked parameters, named as HuggingFace's in-memory module:
    ``gate_up_proj [E, 2I, d]`` (rows ``[gate (I) | up (I)]``) and ``down_proj [E, d, I]``."""

    def __init__(
        self, e: int, d: int, ffn: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.gate_up_proj = frozen_param(e, 2 * ffn, d, dtype=dtype, device=device)
        self.down_proj = frozen_param(e, d, ffn, dtype=dtype, device=device)


class SparseMoe(nn.Module):
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared SwiGLU expert.

    Router ``gate.weight [E, d]``: logits in the model dtype, softmax in float32 (float64 for
    float64 models), top-``k``, renormalised to sum 1 when ``norm_topk``. Output
    ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``. On a tensor-parallel
    rank every expert (and the shared one) holds its slice of the intermediate dim; the
    router is replicated and the two partial sums are all-reduced together.
    """

    def __init__(
        self,
        d: int,
        num_experts: int,
        top_k: int,
        moe_ffn: int,
        shared_ffn: int,
        norm_topk: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.tp = tp
        self.top_k = top_k
        self.norm_topk = norm_topk
        self.gate = Weight(num_experts, d, **kw)
        tp.part(moe_ffn, "moe_intermediate_size")
        self.experts = StackedExperts(num_experts, d, moe_ffn // tp.size, **kw)
        self.shared_expert = DenseMlp(d, shared_ffn, **kw, tp=tp, stack=False)
        self.shared_expert_gate = Weight(1, d, **kw)
        # the router and the shared expert's gate and up projections read the same input:
        # one GEMM (the router's 64-odd rows alone cost a whole launch)
        se = self.shared_expert
        self.in_proj = StackedRows(self.gate, se.gate_proj, se.up_proj)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits, se_gate, se_up = self.in_proj.linear(h)  # router, shared expert's gate / up
        # softmax, top-k and renormalisation: one launch on CUDA (unimem_kernel.router_topk)
        weights, ids = router_topk(logits, self.top_k, self.norm_topk)
        ex = self.experts
        # routed + sigmoid(shared_expert_gate(h)) * shared_expert(h): the gate and the sum in
        # the experts' final pass (unimem_kernel.moe_combine)
        out = expert_mlp(
            h, ids, weights, ex.gate_up_proj, ex.down_proj, act=silu_mul,
            shared=self.shared_expert.down(se_gate, se_up),
            shared_gate_weight=self.shared_expert_gate.weight,
            w_gate_up_scale=getattr(ex, "gate_up_proj_scale_inv", None),
            w_down_scale=getattr(ex, "down_proj_scale_inv", None),
        )  # fmt: skip
        return self.tp.all_reduce(out)


# ---------------------------------------------------------------------- the stack


class DecoderLayer(nn.Module):
    """One pre-norm block: ``linear_attn`` (GDN) or ``self_attn`` (gated attention), then
    ``mlp``, each around a zero-centred RMSNorm and a residual add.

    Each residual add is fused with the norm after it (:func:`unimem_kernel.add_rms_norm`):
    the layer takes the stream ``x`` and its normed input ``h`` (the previous layer's fused
    add, or the model's first norm) and returns the new stream with the next layer's
    ``input_layernorm`` of it (``next_norm``; None for the last layer: ``(x, None)``)."""

    def __init__(
        self,
        c: HybridConfig,
        kind: str,
        mixer: nn.Module,
        mlp: nn.Module,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.c = c
        self.kind = kind
        if kind == "gdn":
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = Weight(c.d_model, dtype=c.dtype, device=device)
        self.post_attention_layernorm = Weight(c.d_model, dtype=c.dtype, device=device)

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: PartialRotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
        next_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        eps = self.c.rms_eps
        if self.kind == "gdn":
            mixed = self.linear_attn(layer_idx, h, ctx)
        else:
            mixed = self.self_attn(layer_idx, h, rotary, cos_sin, ctx)
        post = self.post_attention_layernorm.weight
        if isinstance(self.mlp, DenseMlp) and self.mlp.takes_norm_linear(x):
            x, y = self.mlp.forward_small(x, mixed, post, eps)
        else:
            x, h = add_rms_norm(x, mixed, post, eps, zero_centered=True)
            y = self.mlp(h)
        if next_norm is None:
            return x + y, None
        return add_rms_norm(x, y, next_norm, eps, zero_centered=True)


def rope_settings(hf_config) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` of a Qwen hybrid text config; ValueError
    naming ``rope_parameters`` for any rope type but the default one (multimodal
    ``mrope_section`` / ``mrope_interleaved`` keys are accepted: text positions give every
    section the same position, which is plain RoPE)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters: rope_type {rope_type!r} is not supported (only 'default')"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_parameters: no rope_theta")
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def layer_pattern(hf_config) -> tuple[str, ...]:
    """``HybridConfig.layer_pattern`` from ``config.layer_types``; ValueError naming
    ``layer_types`` for an unknown type or a length other than ``num_hidden_layers``."""
    types = list(hf_config.layer_types)
    if len(types) != hf_config.num_hidden_layers:
        raise ValueError(
            f"layer_types has {len(types)} entries, num_hidden_layers is "
            f"{hf_config.num_hidden_layers}"
        )
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(
                f"layer_types[{i}] = {t!r} is not supported (known: {sorted(LAYER_TYPES)})"
            )
    return tuple(LAYER_TYPES[t] for t in types)


def check_common(hf_config) -> None:
    """ValueError naming the field for features both families' implementations lack."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias = True is not supported")


def hybrid_config(
    hf_config,
    *,
    ffn_dim: int,
    dtype: torch.dtype,
    max_context: int | None,
) -> HybridConfig:
    """The :class:`HybridConfig` of a Qwen hybrid text config (no SWA layers)."""
    theta, _ = rope_settings(hf_config)
    return HybridConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_q_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim_k=hf_config.head_dim,
        head_dim_v=hf_config.head_dim,
        ffn_dim=ffn_dim,
        layer_pattern=layer_pattern(hf_config),
        window=None,
        gdn_heads=hf_config.linear_num_value_heads,
        gdn_k_heads=hf_config.linear_num_key_heads,
        gdn_head_dim_k=hf_config.linear_key_head_dim,
        gdn_head_dim_v=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
        rope_theta=theta,
        rms_eps=float(hf_config.rms_norm_eps),
        dtype=dtype,
        max_context=int(max_context or hf_config.max_position_embeddings),
    )


class QwenHybridForCausalLM(CausalLM):
    """The model shell both families share: ``model.embed_tokens``, ``model.layers``,
    ``model.norm``, ``lm_head`` (the embedding ``Parameter`` itself when tied), the forward
    over a context, and name-based weight loading. Subclasses build the layers
    (:meth:`_build`) and handle re-laid-out tensors (:meth:`_load_special`)."""

    ignored_checkpoint_prefixes: tuple[str, ...] = ("mtp.",)
    checkpoint_prefix_map: tuple[tuple[str, str], ...] = ()
    """``(checkpoint prefix, parameter prefix)`` renames applied before matching names."""

    def __init__(
        self,
        config: HybridConfig,
        layers: list[DecoderLayer],
        rotary_dim: int,
        tie_word_embeddings: bool,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
        full_config: HybridConfig | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.tp = tp
        self.full_config = full_config or config
        kw = {"dtype": c.dtype, "device": device}
        vocab_rows = tp.vocab_part(c.vocab_size)[2]
        self.model = nn.Module()
        self.model.embed_tokens = Weight(vocab_rows, c.d_model, **kw)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = Weight(c.d_model, **kw)
        self.lm_head = Weight(vocab_rows, c.d_model, **kw)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = PartialRotary(c.head_dim_k, rotary_dim, c.rope_theta, c.dtype).to(device)
        self._expert_pieces: dict[str, set[tuple[int, str]]] = {}

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward_with_hidden(self, input_ids: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """See :meth:`CausalLM.forward_with_hidden`."""
        c = self.config
        cos_sin = self.rotary.cos_sin(ctx.positions)
        x = parallel_embedding(input_ids, self.model.embed_tokens.weight, self.tp, c.vocab_size)
        layers = self.model.layers
        n = len(layers)
        h = zero_centered_rms_norm(x, layers[0].input_layernorm.weight, c.rms_eps) if n else None
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm.weight if i + 1 < n else None
            x, h = layer(i, x, h, self.rotary, cos_sin, ctx, next_norm)
            ctx.capture_hidden(i, x)
        hidden = zero_centered_rms_norm(ctx.logits_rows(x), self.model.norm.weight, c.rms_eps)
        return self.output(hidden, ctx)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    # ------------------------------------------------------------------ weights

    def checkpoint_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """This rank's part of checkpoint tensor ``name`` (module docstring of
        :mod:`unimem.models.tensor_parallel`): vocabulary rows of the embedding and LM head,
        attention by heads, the GDN by key heads with their value heads, MLPs and every
        expert by intermediate columns; None (whole) for norms, routers and the unsharded
        model."""
        if self.tp.size == 1:
            return None
        tp, c = self.tp, self.full_config
        pname = self._param_name(name)
        if pname in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_shard(tp, c.vocab_size)
        if ".self_attn." in pname:
            dh = c.head_dim_k
            rules = {
                "q_proj.weight": shard(0, heads(tp, c.n_q_heads, 2 * dh, "num_attention_heads")),
                "k_proj.weight": shard(0, heads(tp, c.n_kv_heads, dh, "num_key_value_heads")),
                "v_proj.weight": shard(0, heads(tp, c.n_kv_heads, dh, "num_key_value_heads")),
                "o_proj.weight": shard(1, heads(tp, c.n_q_heads, dh, "num_attention_heads")),
            }
            return rules.get(pname.rsplit(".self_attn.", 1)[1])
        if ".linear_attn." in pname:
            return self._gdn_shard(pname.rsplit(".linear_attn.", 1)[1])
        if ".mlp." in pname:
            return _mlp_shard(tp, pname, shape)
        return None

    def _gdn_shard(self, leaf: str) -> Shard | None:
        """This rank's part of GDN tensor ``linear_attn.<leaf>`` (the family's projections
        in :meth:`_gdn_projection_shard`)."""
        tp, c = self.tp, self.full_config
        h, dv = c.gdn_heads, c.gdn_head_dim_v
        if leaf == "conv1d.weight":
            return shard(0, *gdn_qkv_ranges(tp, c))
        if leaf in ("A_log", "dt_bias"):
            return shard(0, heads(tp, h, 1, "linear_num_value_heads"))
        if leaf == "out_proj.weight":
            return shard(1, heads(tp, h, dv, "linear_num_value_heads"))
        return self._gdn_projection_shard(leaf)

    def _gdn_projection_shard(self, leaf: str) -> Shard | None:
        """This rank's part of the family's GDN input projection ``leaf``; None otherwise."""
        return None

    def _param_name(self, name: str) -> str:
        for src, dst in self.checkpoint_prefix_map:
            if name.startswith(src):
                return dst + name[len(src) :]
        return name

    def _load_special(
        self, pname: str, tensor: torch.Tensor, ckpt_name: str, params: dict[str, nn.Parameter]
    ) -> set[str] | None:
        """Load a tensor whose layout differs from its parameter's. Returns the parameter
        names it completed (possibly none yet), or None when ``pname`` is not special.
        Here: the hub's per-expert tensors (:meth:`_load_expert_piece`); a family adds its
        own layouts and falls back to this."""
        return self._load_expert_piece(pname, tensor, ckpt_name, params)

    def _load_expert_piece(
        self, pname: str, tensor: torch.Tensor, ckpt_name: str, params: dict[str, nn.Parameter]
    ) -> set[str] | None:
        """A per-expert checkpoint tensor ``mlp.experts.E.{gate,up,down}_proj.weight`` (what
        ``save_pretrained`` writes, :data:`EXPERT_TENSOR`) copied into its slice of the
        stacked ``mlp.experts.gate_up_proj [E, 2I, d]`` (gate rows then up rows) or
        ``mlp.experts.down_proj [E, d, I]``. A stacked parameter counts as filled once every
        expert's piece arrived (across calls); returns it then, else the empty set. None
        when ``pname`` is not a per-expert tensor; ValueError for an expert the layer lacks
        (or a layer without experts)."""
        m = EXPERT_TENSOR.match(pname)
        if m is None:
            return None
        base, e, proj, suffix = m.group(1), int(m.group(2)), m.group(3), m.group(4) or ""
        target = f"{base}.down_proj" if proj == "down" else f"{base}.gate_up_proj"
        target += suffix  # an FP8 piece's scales go to the stacked scales (fp8_linear)
        param = params.get(target)
        if param is None or e >= param.shape[0]:
            raise ValueError(f"unexpected tensor {ckpt_name}")
        if proj == "down":
            dest = param[e]
        else:
            ffn = param.shape[1] // 2
            dest = param[e, :ffn] if proj == "gate" else param[e, ffn:]
        copy_param(dest, tensor, ckpt_name)
        pieces = self._expert_pieces.setdefault(target, set())
        pieces.add((e, proj))
        need = param.shape[0] * (1 if proj == "down" else 2)
        return {target} if len(pieces) == need else set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters of the same name (after
        :attr:`checkpoint_prefix_map`), cast to each parameter's dtype and device; names
        under :attr:`ignored_checkpoint_prefixes` are skipped. ``...conv1d.weight`` drops
        its ``[conv_dim, 1, K]`` middle dim; routed experts load from per-expert tensors
        (:meth:`_load_expert_piece`) or from the stacked ones directly (HuggingFace's
        in-memory ``state_dict``, the Qwen3.5-MoE hub format); family-specific layouts go
        through :meth:`_load_special`. ``ValueError`` naming the tensor for an unknown name or a
        wrong shape. Returns the parameter names filled (``lm_head.weight`` with the
        embedding when tied)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            if name.startswith(self.ignored_checkpoint_prefixes):
                continue
            pname = self._param_name(name)
            special = self._load_special(pname, tensor, name, params)
            if special is not None:
                filled |= special
                continue
            param = params.get(pname)
            if param is None:
                raise ValueError(f"unexpected tensor {name}")
            if pname.endswith(".conv1d.weight") and tensor.dim() == 3 and tensor.shape[1] == 1:
                tensor = tensor[:, 0]
            copy_param(param, tensor, name)
            filled.add(pname)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in filled:
            filled.add("lm_head.weight")
        return filled


def _mlp_shard(tp: TensorParallel, pname: str, shape: tuple[int, ...]) -> Shard | None:
    """Dense MLPs, shared and routed experts: gate/up rows and down columns of the rank's
    slice of the intermediate dim (stacked experts ``gate_up_proj [E, 2I, d]``: both
    halves; ``down_proj [E, d, I]``); the router and the shared-expert gate whole."""
    if pname.endswith(("gate_proj.weight", "up_proj.weight")):
        return shard(0, heads(tp, shape[0], 1, "intermediate_size"))
    if pname.endswith("down_proj.weight"):
        return shard(1, heads(tp, shape[1], 1, "intermediate_size"))
    if pname.endswith("experts.gate_up_proj"):
        i = shape[1] // 2
        gate = heads(tp, i, 1, "moe_intermediate_size")
        return shard(1, gate, (gate[0] + i, gate[1] + i))
    if pname.endswith("experts.down_proj"):
        return shard(2, heads(tp, shape[2], 1, "moe_intermediate_size"))
    return None


EXPERT_TENSOR = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight(_scale_inv)?$"
)
"""A per-expert checkpoint tensor (hub format): group 1 the experts' module path, 2 the
expert index, 3 the projection, 4 ``_scale_inv`` for an FP8 weight's scales."""
