"""gpt-oss (``GptOssForCausalLM``) on the :class:`~unimem.models.base.CausalLM` interface.

Architecture (pre-norm residual stack; every layer is attention + a routed MoE)::

    x = embed_tokens[ids]
    for each layer i:
        x = x + o_proj(attention_i(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))  n = rmsnorm(x)
        x = x + moe(rmsnorm(x))
    logits = lm_head(rmsnorm(x[logits_indices]))                 # untied LM head

* attention: GQA with biases on q/k/v/o, softmax scale ``head_dim ** -0.5``, a learned sink
  logit per query head (``sinks``, float32) that joins every softmax denominator. Layers
  follow ``layer_types``: ``"sliding_attention"`` -> ``"swa"`` with window ``sliding_window``
  (HF shows key ``j`` to query ``p`` iff ``p - sliding_window < j <= p``: exactly our
  convention, no conversion), ``"full_attention"`` -> ``"full"``.
* RoPE: rotate-half over the whole head dim, ``rope_type`` ``"default"`` or ``"yarn"``; the YaRN
  attention factor multiplies cos and sin (:func:`rope_inv_freq`).
* RMSNorm: ``x / rms(x) * w`` in float32, weights kept in float32 (as HF keeps them).
* MoE: router ``logits = W x + b``; top-k of the logits, softmax over the k chosen (float32);
  experts ``(up + 1) * glu(gate)`` with ``gate`` clamped above at ``swiglu_limit``, ``up``
  clamped to ``[-limit, limit]`` and ``glu(g) = g * sigmoid(swiglu_alpha * g)``, each with
  biases on both projections (:func:`unimem.models.moe.expert_mlp`).

Checkpoints: parameter names are HF's; the expert tensors are re-laid out at load
(:meth:`GptOssForCausalLM.load_weights`), from transformers' stacked ``[E, d, 2I]``
interleaved layout or from the hub's MXFP4 ``*_blocks`` / ``*_scales`` pairs
(:func:`dequantize_mxfp4`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unimem.models.base import CausalLM, ModelOutput
from unimem.models.config import HybridConfig
from unimem.models.forward_context import ForwardContext
from unimem.models.loader import copy_param
from unimem.models.moe import expert_mlp
from unimem.models.nn_ops import frozen_param, rms_norm
from unimem.models.stacked_linear import StackedRows
from unimem.models.tensor_parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    heads,
    local_config,
    parallel_embedding,
    row_parallel_linear,
    shard,
    vocab_shard,
)
from unimem_kernel import add_rms_norm, clamped_swiglu, router_topk
from unimem_kernel.rope_angles import rope_cos_sin

__all__ = ["GptOssForCausalLM", "dequantize_mxfp4", "rope_inv_freq", "rope_parameters"]

_LAYER_KINDS = {"sliding_attention": "swa", "full_attention": "full"}


# ---------------------------------------------------------------------- rotary embedding


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of ``hf_config`` as one flat dict with ``rope_type`` and
    ``rope_theta``: transformers 5 ``rope_parameters``, else the older ``rope_scaling`` plus
    ``rope_theta``. ``ValueError`` naming the field for a per-layer-type (nested) dict, a
    ``rope_type`` other than ``"default"`` / ``"yarn"`` or a partial rotary factor."""
    params = getattr(hf_config, "rope_parameters", None)
    field = "rope_parameters"
    if not params:
        params = getattr(hf_config, "rope_scaling", None) or {}
        field = "rope_scaling"
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{field}: per-layer-type RoPE parameters are not supported")
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 150000.0
    if params["rope_type"] not in ("default", "yarn"):
        raise ValueError(
            f"{field}.rope_type {params['rope_type']!r} is not supported "
            "(gpt-oss supports 'default' and 'yarn')"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{field}.partial_rotary_factor must be 1.0")
    if params["rope_type"] == "yarn" and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = hf_config.max_position_embeddings
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` for :func:`rope_parameters`.

    ``"default"``: ``theta ** (-2i / head_dim)``, factor 1. ``"yarn"`` (YaRN, as transformers
    computes it, in float32): per pair ``i`` a blend ``inv = interp * (1 - m_i) + extrap *
    m_i`` of ``extrap = theta ** (-2i / D)`` and ``interp = extrap / factor``, where ``m_i =
    1 - clamp((i - low) / (high - low), 0, 1)`` and ``low`` / ``high`` are the dims where
    ``beta_fast`` / ``beta_slow`` rotations fit in ``original_max_position_embeddings``
    (floored / ceiled when ``truncate``, default True, clipped to ``[0, D - 1]``). The
    attention factor (it multiplies cos and sin) is ``attention_factor`` if given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``0.1 ln(factor) + 1`` (1 for ``factor <= 1``).
    """
    base = float(params["rope_theta"])
    exps = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    pos_freqs = base**exps
    if params["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap_weight = 1 - ramp
    inv_extrap = 1.0 / pos_freqs
    inv_interp = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interp * (1 - extrap_weight) + inv_extrap * extrap_weight
    return inv_freq, float(attention_factor)


# ---------------------------------------------------------------------- MXFP4


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the 4-bit e2m1 codes 0..7; bit 3 is the sign (codes 8..15 negate them)."""


def _e2m1_table(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 to floats: ``blocks [..., G, 16]`` uint8 (32 e2m1 values per group, two per
    byte, the low nibble first) and ``scales [..., G]`` uint8 (e8m0: the group's values are
    multiplied by ``2 ** (scale - 127)``) -> ``[..., G * 32]`` in ``dtype`` (exact in float32
    and bfloat16 for finite scales), on ``blocks``' device."""
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit "
            "(expected [..., G, 16] and [..., G])"
        )
    table = _e2m1_table(blocks.device)
    codes = blocks.to(torch.uint8)
    low = table[(codes & 0x0F).long()]
    high = table[(codes >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(device=blocks.device, dtype=torch.int32) - 127
    values = torch.ldexp(values, exponent[..., None].to(torch.float32))
    return values.flatten(-2).to(dtype)


# ---------------------------------------------------------------------- modules


class _Weight(nn.Module):
    """Holds one ``weight`` (embedding table or norm), so names match HF's modules."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = frozen_param(*shape, dtype=dtype, device=device)


class _Linear(nn.Module):
    """``weight [out, in]`` and an optional ``bias [out]``; ``y = x W^T + b``."""

    def __init__(
        self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = frozen_param(n_out, n_in, dtype=dtype, device=device)
        self.bias = frozen_param(n_out, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GptOssAttention(nn.Module):
    """One attention layer (FULL or SWA: the window is applied by the context). ``sinks
    [Hq]`` is float32. ``c`` is the rank's config (its heads and their sinks); ``o_proj`` is
    row-parallel, its bias added once after the all-reduce."""

    def __init__(
        self, c: HybridConfig, bias: bool, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.c = c
        self.tp = tp
        d, dt = c.d_model, c.dtype
        self.q_proj = _Linear(d, c.n_q_heads * c.head_dim_k, bias, dt, device)
        self.k_proj = _Linear(d, c.n_kv_heads * c.head_dim_k, bias, dt, device)
        self.v_proj = _Linear(d, c.n_kv_heads * c.head_dim_v, bias, dt, device)
        self.qkv = StackedRows(self.q_proj, self.k_proj, self.v_proj)  # one GEMM, biases too
        self.o_proj = _Linear(c.n_q_heads * c.head_dim_v, d, bias, dt, device)
        self.sinks = frozen_param(c.n_q_heads, dtype=torch.float32, device=device)

    def forward(
        self,
        layer_idx: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        c, t = self.c, h.shape[0]
        q, k, v = self.qkv.linear(h)
        q = q.reshape(t, c.n_q_heads, c.head_dim_k)
        k = k.reshape(t, c.n_kv_heads, c.head_dim_k)
        v = v.reshape(t, c.n_kv_heads, c.head_dim_v)  # strided views of the projection
        # apply_rope on q and k, K/V stored, in one pass where the context pages them
        o = ctx.rope_attention(layer_idx, q, k, v, *rope, sinks=self.sinks)
        o = o.reshape(t, c.n_q_heads * c.head_dim_v)
        return row_parallel_linear(o, self.o_proj.weight, self.o_proj.bias, self.tp)


class GptOssRouter(nn.Module):
    """``weight [E, d]``, ``bias [E]``: top-k of ``x W^T + b`` (model dtype), then softmax of
    the k chosen logits in float32. That softmax is the renormalised top-k of the softmax
    over every expert (the ``exp`` of the others cancels), which is what
    :func:`unimem_kernel.router_topk` computes in one launch on CUDA (Qwen3-Next's router):
    the same weights up to float32 rounding, ties to the lower expert."""

    def __init__(
        self, c: HybridConfig, num_experts: int, top_k: int, device: torch.device | str
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = frozen_param(num_experts, c.d_model, dtype=c.dtype, device=device)
        self.bias = frozen_param(num_experts, dtype=c.dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [T, k] int64, topk_weights [T, k] float32)``."""
        logits = F.linear(x, self.weight, self.bias)
        weights, ids = router_topk(logits, self.top_k, True)
        return ids, weights


class GptOssExperts(nn.Module):
    """The stacked experts of one layer, in :func:`~unimem.models.moe.expert_mlp`'s layout
    (re-laid out at load from the checkpoint's; :meth:`GptOssForCausalLM.load_weights`):

    * ``gate_up_proj [E, 2I, d]``: rows ``[gate (I) | up (I)]``;
    * ``gate_up_proj_bias [E, 2I]``: ``[gate | up]``;
    * ``down_proj [E, d, I]``, ``down_proj_bias [E, d]``.

    On a tensor-parallel rank ``I`` is its slice of the intermediate dim (``c`` is the rank's
    config); the outputs are all-reduced and ``down_proj_bias`` is added by rank 0 only, so
    it counts once.
    """

    def __init__(
        self,
        c: HybridConfig,
        num_experts: int,
        alpha: float,
        limit: float,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        e, d, i, dt = num_experts, c.d_model, c.ffn_dim, c.dtype
        self.alpha, self.limit = float(alpha), float(limit)
        self.gate_up_proj = frozen_param(e, 2 * i, d, dtype=dt, device=device)
        self.gate_up_proj_bias = frozen_param(e, 2 * i, dtype=dt, device=device)
        self.down_proj = frozen_param(e, d, i, dtype=dt, device=device)
        self.down_proj_bias = frozen_param(e, d, dtype=dt, device=device)

    def act(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        bias: torch.Tensor | None = None,
        expert: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The clamped SwiGLU: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
        ``g = min(gate, l)``; ``[M, I]`` in, ``[M, I]`` out, the input dtype; with ``bias``
        / ``expert`` the rows' gate/up biases added first. One launch where the fused
        kernels run (:func:`unimem_kernel.clamped_swiglu`), else its reference (the torch
        code)."""
        return clamped_swiglu(gate, up, self.alpha, self.limit, bias=bias, expert=expert)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        y = expert_mlp(
            x,
            topk_ids,
            topk_weights,
            self.gate_up_proj,
            self.down_proj,
            act=self.act,
            b_gate_up=self.gate_up_proj_bias,
            b_down=self.down_proj_bias if self.tp.rank == 0 else None,
        )
        return self.tp.all_reduce(y)


class GptOssMLP(nn.Module):
    """Router + experts of one layer."""

    def __init__(
        self,
        c: HybridConfig,
        num_experts: int,
        top_k: int,
        alpha: float,
        limit: float,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.router = GptOssRouter(c, num_experts, top_k, device)
        self.experts = GptOssExperts(c, num_experts, alpha, limit, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``+ moe(norm(x))``; norm weights float32."""

    def __init__(
        self,
        c: HybridConfig,
        mlp: GptOssMLP,
        bias: bool,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.c = c
        self.input_layernorm = _Weight(c.d_model, dtype=torch.float32, device=device)
        self.self_attn = GptOssAttention(c, bias, device, tp)
        self.post_attention_layernorm = _Weight(c.d_model, dtype=torch.float32, device=device)
        self.mlp = mlp

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
        next_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``h``: ``x``'s ``input_layernorm`` (the previous layer's fused add, or the
        model's). Returns the new stream and, with ``next_norm``, its RMS norm (each residual
        add fused with the norm after it: :func:`unimem_kernel.add_rms_norm`)."""
        eps = self.c.rms_eps
        a = self.self_attn(layer_idx, h, rope, ctx)
        x, h = add_rms_norm(x, a, self.post_attention_layernorm.weight, eps)
        y = self.mlp(h)
        if next_norm is None:
            return x + y, None
        return add_rms_norm(x, y, next_norm, eps)


class GptOssModel(nn.Module):
    """The ``model.`` stack: ``embed_tokens``, ``layers``, final ``norm``."""

    def __init__(
        self,
        layers: list[GptOssDecoderLayer],
        c: HybridConfig,
        device: torch.device | str,
        vocab_rows: int,
    ) -> None:
        super().__init__()
        self.embed_tokens = _Weight(vocab_rows, c.d_model, dtype=c.dtype, device=device)
        self.layers = nn.ModuleList(layers)
        self.norm = _Weight(c.d_model, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------- the model


class GptOssForCausalLM(CausalLM):
    """gpt-oss (module docstring). Build with :meth:`from_hf_config`, fill with
    :meth:`load_weights`. ``config`` is rank ``tp``'s (its heads and intermediate slice),
    ``full_config`` the whole model's."""

    ignored_checkpoint_prefixes: tuple[str, ...] = ()

    def __init__(
        self,
        config: HybridConfig,
        *,
        num_experts: int,
        top_k: int,
        swiglu_alpha: float,
        swiglu_limit: float,
        attention_bias: bool,
        rope_params: dict[str, Any],
        max_position_embeddings: int,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.full_config = config
        c = local_config(config, tp)
        self.config = c
        self.tp = tp
        self.num_experts = num_experts
        layers = [
            GptOssDecoderLayer(
                c,
                GptOssMLP(c, num_experts, top_k, swiglu_alpha, swiglu_limit, device, tp),
                attention_bias,
                device,
                tp,
            )
            for _ in c.layer_pattern
        ]
        vocab_rows = tp.vocab_part(c.vocab_size)[2]
        self.model = GptOssModel(layers, c, device, vocab_rows)
        self.lm_head = _Linear(c.d_model, vocab_rows, False, c.dtype, device)
        inv_freq, self.rope_attention_factor = rope_inv_freq(
            rope_params, c.head_dim_k, max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._pending_mxfp4: dict[str, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, head_dim / 2]``: angles in float32, both scaled by the YaRN attention
        factor, then cast to the model dtype (as HF rotates in the activations' dtype)."""
        f, dt = self.rope_attention_factor, self.config.dtype
        return rope_cos_sin(positions, self.inv_freq, f, dt)

    @torch.no_grad()
    def forward_with_hidden(self, input_ids: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """``input_ids [T]`` through every layer (``ctx`` does all K/V access); logits
        (float32, float64 for a float64 model) and final-normed hidden states ``[N, d]`` of the
        rows ``ctx.logits_indices``."""
        c = self.config
        rope = self._rope(ctx.positions)
        x = parallel_embedding(input_ids, self.model.embed_tokens.weight, self.tp, c.vocab_size)
        layers = self.model.layers
        n = len(layers)
        h = rms_norm(x, layers[0].input_layernorm.weight, c.rms_eps) if n else None
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm.weight if i + 1 < n else None
            x, h = layer(i, x, h, rope, ctx, next_norm)
            ctx.capture_hidden(i, x)
        hidden = rms_norm(ctx.logits_rows(x), self.model.norm.weight, c.rms_eps)
        return self.output(hidden, ctx)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Any,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_context: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> GptOssForCausalLM:
        """The model for a transformers ``GptOssConfig`` (parameters uninitialised; rank
        ``tp``'s shard).
        ``ValueError`` naming the field for what gpt-oss here does not support: a layer type
        other than sliding / full attention, a RoPE type other than default / yarn, a
        ``quantization_config`` other than MXFP4."""
        quant = getattr(hf_config, "quantization_config", None)
        if quant is not None:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
            method = getattr(method, "value", method)
            if method != "mxfp4":
                raise ValueError(
                    f"quantization_config.quant_method {method!r} is not supported "
                    "(gpt-oss loads 'mxfp4' or unquantised checkpoints)"
                )
        n_layers = hf_config.num_hidden_layers
        layer_types = getattr(hf_config, "layer_types", None) or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ]
        if len(layer_types) != n_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {n_layers} num_hidden_layers"
            )
        pattern = []
        for i, kind in enumerate(layer_types):
            if kind not in _LAYER_KINDS:
                raise ValueError(
                    f"layer_types[{i}] {kind!r} is not supported ({sorted(_LAYER_KINDS)})"
                )
            pattern.append(_LAYER_KINDS[kind])
        window = None
        if "swa" in pattern:
            window = getattr(hf_config, "sliding_window", None)
            if not window:
                raise ValueError("sliding_window must be set for sliding_attention layers")
        rope = rope_parameters(hf_config)
        n_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        max_pos = hf_config.max_position_embeddings
        config = HybridConfig(
            vocab_size=hf_config.vocab_size,
            d_model=hf_config.hidden_size,
            n_q_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            head_dim_k=head_dim,
            head_dim_v=head_dim,
            ffn_dim=hf_config.intermediate_size,
            layer_pattern=tuple(pattern),
            window=window,
            gdn_heads=0,
            gdn_head_dim_k=0,
            gdn_head_dim_v=0,
            rope_theta=float(rope["rope_theta"]),
            rms_eps=float(hf_config.rms_norm_eps),
            dtype=dtype,
            max_context=max_context if max_context is not None else max_pos,
        )
        return cls(
            config,
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            swiglu_alpha=getattr(hf_config, "swiglu_alpha", 1.702),
            swiglu_limit=getattr(hf_config, "swiglu_limit", 7.0),
            attention_bias=getattr(hf_config, "attention_bias", True),
            rope_params=rope,
            max_position_embeddings=max_pos,
            device=device,
            tp=tp,
        )

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the names filled.

        Names map 1:1 except the experts of layer ``N`` (prefix ``model.layers.N.mlp.
        experts.``), re-laid out into :class:`GptOssExperts`' layout:

        * transformers' format: ``gate_up_proj [E, d, 2I]`` (``x @ W``, columns interleaved
          gate, up, gate, ...), ``gate_up_proj_bias [E, 2I]`` (interleaved), ``down_proj
          [E, I, d]`` (``x @ W``), ``down_proj_bias [E, d]``;
        * the hub's MXFP4 format (``quantization_config.quant_method == "mxfp4"``):
          ``gate_up_proj_blocks [E, 2I, d/32, 16]`` + ``gate_up_proj_scales [E, 2I, d/32]``
          (dequantised rows interleaved gate, up, ...) and ``down_proj_blocks [E, d, I/32,
          16]`` + ``down_proj_scales [E, d, I/32]``; the two halves of a pair may come in
          any order, also in different calls (a lone half stays pending and its parameter
          unfilled).

        ``ValueError`` naming the tensor for an unknown name or a wrong shape.
        """
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if name.startswith(self.ignored_checkpoint_prefixes):
                continue
            for suffix in ("_blocks", "_scales"):
                if name.endswith(suffix):
                    target = name.removesuffix(suffix)
                    if target not in params or not target.endswith(("gate_up_proj", "down_proj")):
                        raise ValueError(f"unexpected tensor {name}")
                    offset = self._mxfp4_offset if target.endswith("down_proj") else 0
                    _check_shape(tensor, _mxfp4_shape(params[target], suffix, offset), name)
                    pending = self._pending_mxfp4.setdefault(target, {})
                    pending[suffix] = tensor
                    if len(pending) == 2:
                        del self._pending_mxfp4[target]
                        self._load_mxfp4(params[target], target, **pending)
                        filled.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected tensor {name}")
                self._load_dense(params[name], name, tensor)
                filled.add(name)
        return filled

    @staticmethod
    def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
        """``[g0, u0, g1, u1, ...]`` along ``dim`` -> ``[g0, g1, ... | u0, u1, ...]``."""
        pairs = t.unflatten(dim, (-1, 2))
        return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)

    def _load_dense(self, param: nn.Parameter, name: str, tensor: torch.Tensor) -> None:
        if name.endswith("experts.gate_up_proj"):
            e, two_i, d = param.shape
            _check_shape(tensor, (e, d, two_i), name)
            tensor = self._deinterleave(tensor, 2).transpose(1, 2)
        elif name.endswith("experts.gate_up_proj_bias"):
            _check_shape(tensor, tuple(param.shape), name)
            tensor = self._deinterleave(tensor, 1)
        elif name.endswith("experts.down_proj"):
            e, d, i = param.shape
            _check_shape(tensor, (e, i, d), name)
            tensor = tensor.transpose(1, 2)
        copy_param(param, tensor, name)

    def _load_mxfp4(
        self, param: nn.Parameter, name: str, _blocks: torch.Tensor, _scales: torch.Tensor
    ) -> None:
        for e in range(param.shape[0]):  # one expert at a time bounds the float32 temporaries
            blocks = _blocks[e].to(param.device)
            w = dequantize_mxfp4(blocks, _scales[e].to(param.device), torch.float32)
            if name.endswith("gate_up_proj"):
                w = self._deinterleave(w, 0)
            else:  # a rank's slice of I may start inside a group of 32: drop the head
                w = w[:, self._mxfp4_offset : self._mxfp4_offset + param.shape[2]]
            param.data[e].copy_(w)

    # ------------------------------------------------------------------ tensor parallel

    @property
    def _mxfp4_offset(self) -> int:
        """Where this rank's intermediate slice starts inside its first MXFP4 group of 32
        (the down projection's blocks are read from the group that holds it)."""
        if self.tp.size == 1:
            return 0
        return self.tp.part(self.full_config.ffn_dim, "intermediate_size")[0] % 32

    def checkpoint_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """This rank's part of checkpoint tensor ``name``: vocabulary rows of the embedding
        and LM head; q/k/v rows (and biases) and sinks by head, ``o_proj`` columns; every
        expert's slice of the intermediate dim (interleaved gate/up columns ``[2a, 2b)``,
        ``down_proj`` rows ``[a, b)``, MXFP4 down blocks from the group holding ``a``);
        None (whole) for norms, the router, ``o_proj.bias``, ``down_proj_bias`` and the
        unsharded model."""
        if self.tp.size == 1:
            return None
        tp, c = self.tp, self.full_config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_shard(tp, c.vocab_size)
        if ".self_attn." in name:
            leaf = name.rsplit(".self_attn.", 1)[1]
            q = heads(tp, c.n_q_heads, c.head_dim_k, "num_attention_heads")
            rows = {
                "q_proj": q,
                "k_proj": heads(tp, c.n_kv_heads, c.head_dim_k, "num_key_value_heads"),
                "v_proj": heads(tp, c.n_kv_heads, c.head_dim_v, "num_key_value_heads"),
                "sinks": heads(tp, c.n_q_heads, 1, "num_attention_heads"),
            }
            proj = leaf.split(".", 1)[0]
            if proj in rows:
                return shard(0, rows[proj])
            if leaf == "o_proj.weight":
                return shard(1, heads(tp, c.n_q_heads, c.head_dim_v, "num_attention_heads"))
            return None
        if ".mlp.experts." in name:
            leaf = name.rsplit(".mlp.experts.", 1)[1]
            a, b = tp.part(c.ffn_dim, "intermediate_size")
            if leaf == "gate_up_proj":  # [E, d, 2I], gate/up interleaved
                return shard(2, (2 * a, 2 * b))
            if leaf in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
                return shard(1, (2 * a, 2 * b))
            if leaf == "down_proj":  # [E, I, d]
                return shard(1, (a, b))
            if leaf in ("down_proj_blocks", "down_proj_scales"):  # [E, d, I / 32, ...]
                return shard(2, (a // 32, -(-b // 32)))
        return None


def _mxfp4_shape(param: torch.Tensor, suffix: str, offset: int = 0) -> tuple[int, ...]:
    """Shape of the ``_blocks`` / ``_scales`` half of the MXFP4 pair that fills ``param [E,
    rows, K]`` (groups of 32 along ``K``; ``offset``: where ``K`` starts in its first
    group)."""
    e, rows, k = param.shape
    groups = -(-(offset + k) // 32)
    return (e, rows, groups, 16) if suffix == "_blocks" else (e, rows, groups)


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"tensor {name}: shape {tuple(tensor.shape)}, expected {tuple(expected)}")
