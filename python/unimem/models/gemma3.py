"""Gemma 3 text models (``Gemma3ForCausalLM``, and the text half of the multimodal
``Gemma3ForConditionalGeneration`` checkpoints) on the :class:`~unimem.models.base.CausalLM`
interface.

Architecture (``d`` = hidden size), numerics as in transformers' ``modeling_gemma3``::

    x = embed[ids] * sqrt(d)                       # the factor rounded to the model dtype
    for each layer i (kind "swa" or "full" from ``config.layer_types``):
        h = attn_i(norm(x));   x = x + norm(h)     # input_layernorm / post_attention_layernorm
        h = mlp_i(norm(x));    x = x + norm(h)     # pre_ / post_feedforward_layernorm
    logits = lm_head(norm(x))                      # tied to the embedding by default
    logits = tanh(logits / cap) * cap              # if final_logit_softcapping is set

* every norm is ``x / sqrt(mean(x^2) + eps) * (1 + w)``, computed in float32 (float64 for a
  float64 model) and cast back to the input dtype afterwards (weights stored zero-centred);
* attention: q/k/v projections without bias, per-head RMSNorm of q and k (``q_norm``,
  ``k_norm``, same ``1 + w`` form over the head dim), then rotate-half RoPE over the whole
  head dim, then ``ctx.attention`` with softmax scale ``query_pre_attn_scalar ** -0.5``;
  sliding layers see ``sliding_window`` keys including the query's own (HF's mask keeps key
  ``j`` for query ``p`` iff ``p - sliding_window < j <= p``: our convention as is);
* RoPE per layer kind: sliding layers use the ``sliding_attention`` parameters (the old
  ``rope_local_base_freq``), full layers the ``full_attention`` ones (the old ``rope_theta``
  plus ``rope_scaling``), each ``"default"`` or ``"linear"`` (inverse frequencies divided by
  ``factor``). Inverse frequencies, angles, cos and sin are float32; cos/sin are then cast
  to the model dtype and the rotation runs in the model dtype, as HF does;
* MLP: GeGLU with the tanh-approximated GELU, ``down(gelu_tanh(gate(x)) * up(x))``.

Small steps (at most ``UNIMEM_NORM_LINEAR_ROWS`` rows, by default 1: a one-request decode
step; on the fused kernels, outside deterministic mode) run each layer in four launches around
the attention: a post-norm, its residual add and the next pre-norm go in front of the q/k/v and
the gate/up projections and GeGLU behind the latter (:func:`unimem_kernel.norm_linear`), so
a layer's stream is materialised by the next layer's first launch (the drafter's hidden
capture follows it there). The math and its roundings are the unfused chain's.

Attention-logit softcapping (``attn_logit_softcapping``) cannot be expressed through
``ctx.attention`` and is refused at :meth:`Gemma3ForCausalLM.from_hf_config`.
"""

from __future__ import annotations

import math
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
from unimem.models.nn_ops import frozen_param, small_step
from unimem.models.stacked_linear import StackedRows
from unimem.models.tensor_parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    heads,
    local_config,
    parallel_embedding,
    shard,
    vocab_shard,
)
from unimem_kernel import (
    add_rms_norm,
    bi_rms_norm,
    envs,
    gelu_tanh_mul,
    norm_add_rms_norm,
    norm_linear,
)
from unimem_kernel.fused import records_autograd
from unimem_kernel.fused import use_triton as fused_ops_on
from unimem_kernel.rope_angles import rope_cos_sin

__all__ = ["Gemma3ForCausalLM", "RopeSpec", "gemma_rms_norm", "text_config_of"]

_LAYER_KINDS = {"sliding_attention": "swa", "full_attention": "full"}

# Prefixes under which multimodal (Gemma3ForConditionalGeneration) checkpoints keep the text
# model, mapped to our names: the hub layout (``language_model.model.*``,
# ``language_model.lm_head.*``) and the one transformers 5 ``save_pretrained`` writes
# (``model.language_model.*``, top-level ``lm_head.*``).
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether the step body takes the fused kernels (CUDA, ``UNIMEM_FUSED_OPS`` on, no
    autograd, not float64); elsewhere the torch code below runs, unchanged."""
    x = tensors[0]
    return x.dtype != torch.float64 and fused_ops_on(x) and not records_autograd(*tensors)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's zero-centred RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (1 + w)``
    with the normalisation and the product both in float32 (float64 for float64 inputs), one
    cast back to ``x``'s dtype at the end. Where the fused kernels run, one row-local launch
    (:func:`unimem_kernel.bi_rms_norm`, ``zero_centered``: the same math)."""
    if _fused(x, weight):
        return bi_rms_norm(x, weight, eps, zero_centered=True)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = rms_normalize(x.to(acc), eps)
    return (y * (1.0 + weight.to(acc))).to(x.dtype)


def text_config_of(hf_config):
    """The text config: ``hf_config.text_config`` for a multimodal ``Gemma3Config``, else
    ``hf_config`` itself."""
    text = getattr(hf_config, "text_config", None)
    return text if text is not None else hf_config


class RopeSpec:
    """Rotary parameters of one layer kind: ``theta`` (base) and ``factor`` (linear scaling
    divisor, 1.0 for ``"default"``). :meth:`inv_freq` gives ``[head_dim / 2]`` float32."""

    def __init__(self, theta: float, factor: float = 1.0) -> None:
        self.theta = float(theta)
        self.factor = float(factor)

    @classmethod
    def from_params(cls, params: dict, field: str) -> RopeSpec:
        """From one HF rope-parameter dict (``rope_type``, ``rope_theta``, ``factor``);
        ``ValueError`` naming ``field`` for anything but default/linear RoPE over the whole
        head dim."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise ValueError(
                f"{field}['rope_type'] = {rope_type!r} is not supported (default, linear)"
            )
        prf = params.get("partial_rotary_factor", 1.0)
        if prf not in (None, 1, 1.0):
            raise ValueError(f"{field}['partial_rotary_factor'] = {prf!r} is not supported")
        theta = params.get("rope_theta")
        if not isinstance(theta, (int, float)) or theta <= 1:
            raise ValueError(f"{field}['rope_theta'] must be a number > 1, got {theta!r}")
        factor = 1.0
        if rope_type == "linear":
            factor = params.get("factor")
            if not isinstance(factor, (int, float)) or factor <= 0:
                raise ValueError(f"{field}['factor'] must be a number > 0, got {factor!r}")
        return cls(theta, factor)

    def inv_freq(self, head_dim: int, device: torch.device | str) -> torch.Tensor:
        """``1 / (theta ** (2i / head_dim)) / factor`` for ``i < head_dim / 2``, float32
        throughout (the exponent, the power and the division)."""
        exps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        inv = 1.0 / (self.theta**exps)
        return inv / self.factor if self.factor != 1.0 else inv


def _rope_specs(text) -> dict[str, RopeSpec]:
    """``{"swa": RopeSpec, "full": RopeSpec}`` from a Gemma 3 text config: the per-layer-type
    ``rope_parameters`` of transformers 5, else the legacy fields (``rope_local_base_freq``,
    ``rope_theta``, ``rope_scaling`` on the global layers)."""
    params = getattr(text, "rope_parameters", None) or {}
    if "full_attention" in params or "sliding_attention" in params:
        out = {}
        for hf_kind, kind in _LAYER_KINDS.items():
            p = params.get(hf_kind)
            if p is not None:
                out[kind] = RopeSpec.from_params(p, f"rope_parameters[{hf_kind!r}]")
        return out
    glob = dict(getattr(text, "rope_scaling", None) or {})
    glob.setdefault("rope_theta", getattr(text, "rope_theta", None) or 1_000_000.0)
    local = {"rope_type": "default"}
    local["rope_theta"] = getattr(text, "rope_local_base_freq", None) or 10_000.0
    return {
        "full": RopeSpec.from_params(glob, "rope_scaling"),
        "swa": RopeSpec.from_params(local, "rope_local_base_freq"),
    }


# ---------------------------------------------------------------------- modules


class _Weight(nn.Module):
    """A module holding one ``weight`` parameter (an embedding, norm or projection), so that
    parameter names read like the checkpoint's (``....q_proj.weight``)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = frozen_param(*shape, dtype=dtype, device=device)


class Gemma3Attention(nn.Module):
    """Self-attention of one layer: ``q_proj [Hq*D, d]``, ``k_proj``/``v_proj [Hkv*D, d]``,
    ``o_proj [d, Hq*D]``, ``q_norm``/``k_norm [D]``. The window is applied by the context.
    ``c`` is the rank's config (its heads); ``o_proj`` is row-parallel."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.c = c
        self.tp = tp
        d, hd, dt = c.d_model, c.head_dim_k, c.dtype
        self.q_proj = _Weight(c.n_q_heads * hd, d, dtype=dt, device=device)
        self.k_proj = _Weight(c.n_kv_heads * hd, d, dtype=dt, device=device)
        self.v_proj = _Weight(c.n_kv_heads * hd, d, dtype=dt, device=device)
        self.o_proj = _Weight(d, c.n_q_heads * hd, dtype=dt, device=device)
        self.q_norm = _Weight(hd, dtype=dt, device=device)
        self.k_norm = _Weight(hd, dtype=dt, device=device)
        # q, k and v as one GEMM (the parameters stay, as views of one stacked weight)
        self.qkv = StackedRows(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        layer_idx: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """``h [T, d]`` (normed) -> attention output ``[T, d]``; ``rope``: cos/sin ``[T, D/2]``
        in the model dtype."""
        o = self.attend(layer_idx, self.qkv.linear(h), rope, ctx)
        return fp8_linear.row_parallel(o, self.o_proj, None, self.tp)

    def attend(
        self,
        layer_idx: int,
        qkv: list[torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """q/k norms, RoPE, the K/V store and attention over the q, k, v projections
        (``qkv``: ``[T, Hq*D]``, ``[T, Hkv*D]`` twice, column views of one GEMM's output
        allowed) -> ``[T, Hq*Dv]``, before ``o_proj``."""
        c, eps = self.c, self.c.rms_eps
        q, k, v = qkv
        t = q.shape[0]
        q = q.view(t, c.n_q_heads, c.head_dim_k)
        k = k.view(t, c.n_kv_heads, c.head_dim_k)
        v = v.view(t, c.n_kv_heads, c.head_dim_v)
        if _fused(q, self.q_norm.weight):
            # q_norm / k_norm, RoPE and the K/V store in one launch (paged contexts)
            norms = (self.q_norm.weight, self.k_norm.weight, eps)
            o = ctx.rope_attention(layer_idx, q, k, v, *rope, qk_norm=norms)
        else:
            q = gemma_rms_norm(q, self.q_norm.weight, eps)
            k = gemma_rms_norm(k, self.k_norm.weight, eps)
            o = ctx.rope_attention(layer_idx, q, k, v, *rope)  # apply_rope on q and k
        return o.reshape(t, c.n_q_heads * c.head_dim_v)


class Gemma3MLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``; ``gate_proj``/``up_proj [I, d]``,
    ``down_proj [d, I]`` (``I``: the rank's slice; ``down_proj`` row-parallel)."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        d, i, dt = c.d_model, c.ffn_dim, c.dtype
        self.gate_proj = _Weight(i, d, dtype=dt, device=device)
        self.up_proj = _Weight(i, d, dtype=dt, device=device)
        self.down_proj = _Weight(d, i, dtype=dt, device=device)
        # gate and up as one GEMM (the parameters stay, as views of one stacked weight)
        self.gate_up = StackedRows(self.gate_proj, self.up_proj)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # gelu_tanh(gate) * up in one pass over the column views of the stacked GEMM
        act = gelu_tanh_mul(*self.gate_up.linear(h))
        return fp8_linear.row_parallel(act, self.down_proj, None, self.tp)


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP, each wrapped in a pre-norm and a post-norm (``1 + w`` RMSNorms)
    before its residual add.

    Each post-norm, its residual add and the pre-norm after it are one launch where the fused
    kernels run (:func:`unimem_kernel.norm_add_rms_norm`; elsewhere the post-norm, then
    :func:`unimem_kernel.add_rms_norm`): the layer takes the stream ``x`` and its
    ``input_layernorm`` ``h`` (the previous layer's fused chain, or the model's) and returns
    the new stream with the next layer's ``input_layernorm`` of it (``next_norm``; None for
    the last layer: ``(x, None)``)."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.eps = c.rms_eps
        self.self_attn = Gemma3Attention(c, device, tp)
        self.mlp = Gemma3MLP(c, device, tp)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, _Weight(c.d_model, dtype=c.dtype, device=device))

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
        next_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        eps = self.eps
        h = self.self_attn(layer_idx, h, rope, ctx)
        x, h = _post_norm_add(
            x, h, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight, eps
        )
        return _post_norm_add(
            x, self.mlp(h), self.post_feedforward_layernorm.weight, next_norm, eps
        )

    def forward_small(
        self,
        layer_idx: int,
        x: torch.Tensor,
        pending: tuple[torch.Tensor, torch.Tensor] | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer in :func:`unimem_kernel.norm_linear` launches (small batches, see
        :meth:`Gemma3ForCausalLM.takes_norm_linear`). ``x``: the stream before the previous
        layer's MLP branch was added; ``pending``: that branch's output and its
        ``post_feedforward_layernorm`` weight (None for the first layer: ``x`` is the
        embedding). Returns ``(x_in, x_mid, mlp_out)``: the stream entering this layer (now
        materialised), the stream after its attention branch, and its MLP output before
        ``post_feedforward_layernorm`` (the next layer's ``pending``)."""
        eps, attn, mlp = self.eps, self.self_attn, self.mlp
        delta, post = pending if pending is not None else (None, None)
        stream, qkv = norm_linear(
            x, attn.qkv.single_weight(), self.input_layernorm.weight, eps,
            delta=delta, post_weight=post, zero_centered=True,
        )  # fmt: skip
        x_in = x if stream is None else stream
        o = attn.attend(layer_idx, list(qkv.split(attn.qkv.sizes, dim=-1)), rope, ctx)
        a = _small_linear(o, attn.o_proj, attn.tp, eps)
        x_mid, act = norm_linear(
            x_in, mlp.gate_up.single_weight(), self.pre_feedforward_layernorm.weight, eps,
            delta=a, post_weight=self.post_attention_layernorm.weight, zero_centered=True,
            act="gelu_tanh",
        )  # fmt: skip
        return x_in, x_mid, _small_linear(act, mlp.down_proj, mlp.tp, eps)


def _small_linear(x: torch.Tensor, proj: nn.Module, tp: TensorParallel, eps: float) -> torch.Tensor:
    """A row-parallel projection with no norm in front, in a small batch: one plain
    :func:`unimem_kernel.norm_linear` launch on one rank for a 16/32-bit weight
    (``UNIMEM_NORM_LINEAR_PLAIN``), else :func:`~unimem.models.fp8_linear.row_parallel` (the
    vendor or FP8 GEMM, and the all-reduce)."""
    if tp.size == 1 and envs.get("UNIMEM_NORM_LINEAR_PLAIN") and not fp8_linear.is_fp8(proj):
        return norm_linear(x, proj.weight, None, eps)[1]
    return fp8_linear.row_parallel(x, proj, None, tp)


def _post_norm_add(
    x: torch.Tensor,
    h: torch.Tensor,
    post: torch.Tensor,
    next_norm: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x + norm(h, post)`` and its norm by ``next_norm`` (None: the sum only)."""
    if _fused(h, post):
        return norm_add_rms_norm(x, h, post, next_norm, eps, zero_centered=True)
    h = gemma_rms_norm(h, post, eps)
    if next_norm is None:
        return x + h, None
    return add_rms_norm(x, h, next_norm, eps, zero_centered=True)


class Gemma3TextModel(nn.Module):
    """The decoder stack: ``embed_tokens``, ``layers``, final ``norm``."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        rows = tp.vocab_part(c.vocab_size)[2]
        self.embed_tokens = _Weight(rows, c.d_model, dtype=c.dtype, device=device)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(c, device, tp) for _ in c.layer_pattern)
        self.norm = _Weight(c.d_model, dtype=c.dtype, device=device)


# ---------------------------------------------------------------------- the model


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model (module docstring). Parameters are named as in the HF checkpoint
    (``model.layers.N.self_attn.q_proj.weight``, ``model.norm.weight``, ``lm_head.weight``),
    all in the model dtype (HF keeps no Gemma 3 weight in float32). ``lm_head.weight`` is a
    separate parameter that the loader ties to ``model.embed_tokens.weight`` when the
    checkpoint has none (``tie_word_embeddings``).

    ``rope`` maps ``"swa"``/``"full"`` to that kind's :class:`RopeSpec`;
    ``final_logit_softcapping`` is None or the cap (applied to float32 logits)."""

    ignored_checkpoint_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def __init__(
        self,
        config: HybridConfig,
        rope: dict[str, RopeSpec],
        final_logit_softcapping: float | None = None,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.full_config = config
        c = local_config(config, tp)
        self.config = c
        self.tp = tp
        self.final_logit_softcapping = final_logit_softcapping
        self.model = Gemma3TextModel(c, device, tp)
        rows = tp.vocab_part(c.vocab_size)[2]
        self.lm_head = _Weight(rows, c.d_model, dtype=c.dtype, device=device)
        # sqrt(d) rounded straight to the model dtype, as HF's embedding scale
        self.embed_scale = torch.tensor(math.sqrt(c.d_model), dtype=c.dtype).item()
        self.rope = dict(rope)
        for kind in set(c.layer_pattern):
            inv = rope[kind].inv_freq(c.head_dim_k, device)
            self.register_buffer(f"inv_freq_{kind}", inv, persistent=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(
        cls,
        hf_config,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_context: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> Gemma3ForCausalLM:
        """From a ``Gemma3TextConfig`` (or a multimodal ``Gemma3Config``: its ``text_config``),
        parameters uninitialised. ``ValueError`` naming the field for what this
        implementation does not do: attention-logit softcapping, bidirectional attention,
        attention biases, an activation other than ``gelu_pytorch_tanh``, a layer type
        other than sliding/full attention, RoPE other than default/linear."""
        text = text_config_of(hf_config)
        if getattr(text, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "attn_logit_softcapping is not supported (attention softcapping cannot go "
                f"through the attention backends), got {text.attn_logit_softcapping!r}"
            )
        if getattr(text, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported (causal only)")
        if getattr(text, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported")
        act = getattr(text, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        pattern = []
        for i, t in enumerate(text.layer_types):
            if t not in _LAYER_KINDS:
                raise ValueError(
                    f"layer_types[{i}] = {t!r} is not supported ({list(_LAYER_KINDS)})"
                )
            pattern.append(_LAYER_KINDS[t])
        if len(pattern) != text.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(pattern)} entries, num_hidden_layers is "
                f"{text.num_hidden_layers}"
            )
        window = None
        if "swa" in pattern:
            window = text.sliding_window
            if not isinstance(window, int) or window < 1:
                raise ValueError(f"sliding_window must be a positive int, got {window!r}")
        rope = _rope_specs(text)
        for kind in set(pattern):
            if kind not in rope:
                raise ValueError(f"rope_parameters has no entry for the {kind} layers")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        cap = getattr(text, "final_logit_softcapping", None)
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"final_logit_softcapping must be > 0, got {cap!r}")
        config = HybridConfig(
            vocab_size=text.vocab_size,
            d_model=text.hidden_size,
            n_q_heads=text.num_attention_heads,
            n_kv_heads=text.num_key_value_heads,
            head_dim_k=head_dim,
            head_dim_v=head_dim,
            ffn_dim=text.intermediate_size,
            layer_pattern=tuple(pattern),
            window=window,
            gdn_heads=0,
            gdn_head_dim_k=0,
            gdn_head_dim_v=0,
            rope_theta=rope["full" if "full" in rope else "swa"].theta,
            rms_eps=float(text.rms_norm_eps),
            dtype=dtype,
            max_context=max_context or text.max_position_embeddings,
            attn_scale=float(text.query_pre_attn_scalar) ** -0.5,
        )
        return cls(config, rope, None if cap is None else float(cap), device, tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy ``(name, tensor)`` pairs into the parameters of the same name (cast to the
        model dtype and device). Multimodal checkpoint names are mapped to the text model's
        (``language_model.model.X`` and ``model.language_model.X`` -> ``model.X``,
        ``language_model.lm_head.X`` -> ``lm_head.X``); names under
        :attr:`ignored_checkpoint_prefixes` (the vision tower and projector) are skipped.
        Returns the parameter names filled; ``ValueError`` naming the tensor for an unknown
        name or a wrong shape."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if name.startswith(self.ignored_checkpoint_prefixes):
                continue
            target = name
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    target = new + name[len(old) :]
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected tensor {name}")
            copy_param(param, tensor, name)
            filled.add(target)
        return filled

    def checkpoint_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """This rank's part of checkpoint tensor ``name`` (multimodal names mapped as
        :meth:`load_weights` maps them): vocabulary rows of the embedding and LM head, q/k/v
        rows and ``o_proj`` columns by head, MLP gate/up rows and down columns; None (whole)
        for norms and the unsharded model."""
        if self.tp.size == 1:
            return None
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        tp, c = self.tp, self.full_config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_shard(tp, c.vocab_size)
        leaf = name.rsplit(".", 2)
        proj = ".".join(leaf[-2:])
        q = heads(tp, c.n_q_heads, c.head_dim_k, "num_attention_heads")
        kv = heads(tp, c.n_kv_heads, c.head_dim_k, "num_key_value_heads")
        rules = {
            "q_proj.weight": shard(0, q),
            "k_proj.weight": shard(0, kv),
            "v_proj.weight": shard(0, kv),
            "o_proj.weight": shard(1, heads(tp, c.n_q_heads, c.head_dim_v, "num_attention_heads")),
        }
        if proj in rules and ".self_attn." in name:
            return rules[proj]
        if ".mlp." in name:
            if proj in ("gate_proj.weight", "up_proj.weight"):
                return shard(0, heads(tp, shape[0], 1, "intermediate_size"))
            if proj == "down_proj.weight":
                return shard(1, heads(tp, shape[1], 1, "intermediate_size"))
        return None

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, D/2]``: float32 angles, cast to the model dtype."""
        inv_freq = getattr(self, f"inv_freq_{kind}")
        return rope_cos_sin(positions, inv_freq, out_dtype=self.config.dtype)

    @torch.no_grad()
    def forward_with_hidden(self, input_ids: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """``input_ids [T]`` through every layer; logits (float32, float64 for a float64
        model, softcapped if configured) and final-normed hidden ``[N, d]`` for the rows
        ``ctx.logits_indices``."""
        c = self.config
        ropes = {kind: self._rope(ctx.positions, kind) for kind in set(c.layer_pattern)}
        if self.tp.size == 1:
            x = F.embedding(input_ids, self.model.embed_tokens.weight)
        else:
            x = parallel_embedding(input_ids, self.model.embed_tokens.weight, self.tp, c.vocab_size)
        x = x * self.embed_scale
        layers = self.model.layers
        n = len(layers)
        hidden = None
        if self.takes_norm_linear(x):
            pending = None
            for i, layer in enumerate(layers):
                x_in, x, mlp_out = layer.forward_small(
                    i, x, pending, ropes[c.layer_pattern[i]], ctx
                )
                if i:
                    ctx.capture_hidden(i - 1, x_in)
                pending = (mlp_out, layer.post_feedforward_layernorm.weight)
            if n:
                # every row needs logits, in order (decode, verify): the last post-norm, the
                # add and the final norm in one launch
                final = self.model.norm.weight if ctx.logits_rows(x) is x else None
                x, hidden = _post_norm_add(x, *pending, final, c.rms_eps)
                ctx.capture_hidden(n - 1, x)
        else:
            h = gemma_rms_norm(x, layers[0].input_layernorm.weight, c.rms_eps) if n else None
            for i, layer in enumerate(layers):
                next_norm = layers[i + 1].input_layernorm.weight if i + 1 < n else None
                x, h = layer(i, x, h, ropes[c.layer_pattern[i]], ctx, next_norm)
                ctx.capture_hidden(i, x)
        if hidden is None:
            hidden = gemma_rms_norm(ctx.logits_rows(x), self.model.norm.weight, c.rms_eps)
        return self.output(hidden, ctx)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head, then ``final_logit_softcapping`` where the config sets one."""
        logits = super().head_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def takes_norm_linear(self, x: torch.Tensor) -> bool:
        """Whether a step of ``x [T, d]`` runs its layers in :func:`unimem_kernel.norm_linear`
        launches: :func:`~unimem.models.nn_ops.small_step` (rows, fused kernels, not
        batch-invariant mode; under tensor parallelism the row-parallel projections decide
        for themselves, :func:`_small_linear`), and every layer's q/k/v and gate/up weights
        one 16/32-bit stack (not FP8)."""
        if not small_step(x):
            return False
        return all(
            layer.self_attn.qkv.single_weight() is not None
            and layer.mlp.gate_up.single_weight() is not None
            for layer in self.model.layers
        )

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight
