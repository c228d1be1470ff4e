"""Qwen3.5 text model (``Qwen3_5ForCausalLM``): Gated DeltaNet and gated full attention
layers (``config.layer_types``) with a dense SwiGLU MLP on every layer.

The stack, norms, attention and GDN core are :mod:`unimem.models.qwen_common`'s. Qwen3.5's
GDN projections are separate and already in the core's layout: ``in_proj_qkv`` rows are
``[q (all key heads) | k | v (all value heads)]`` (no per-key-head grouping), ``in_proj_z``
``[H * Dv]``, ``in_proj_b`` and ``in_proj_a`` ``[H]`` — they load 1:1.

Checkpoints: the text-only format ``save_pretrained`` writes for ``Qwen3_5ForCausalLM``
(``model.layers...``, ``lm_head.weight``, config ``Qwen3_5TextConfig``) and the hub's
multimodal format (``Qwen3_5ForConditionalGeneration``, config ``Qwen3_5Config`` whose
``text_config`` is the text model's): there the text weights are ``model.language_model.*``,
loaded as ``model.*``, and the vision tower ``model.visual.*`` and the multi-token-prediction
head ``mtp.*`` are skipped.

Rotary: HuggingFace's Qwen3.5 text rotary is multimodal ("mrope": the rotary frequencies are
split into interleaved T/H/W sections, each rotated by its own position id). For text-only
input the three position ids are the token position, so every section rotates by the same
position and the result is plain partial RoPE, which is what this module applies.
"""

from __future__ import annotations

import torch
from torch import nn

from unimem.models.config import HybridConfig
from unimem.models.qwen_common import (
    DecoderLayer,
    DenseMlp,
    GatedAttention,
    GdnMixer,
    QwenHybridForCausalLM,
    Weight,
    check_common,
    hybrid_config,
    rope_settings,
)
from unimem.models.stacked_linear import StackedRows
from unimem.models.tensor_parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    gdn_qkv_ranges,
    heads,
    local_config,
    shard,
)

__all__ = ["Qwen3_5ForCausalLM"]


class Qwen3_5Gdn(GdnMixer):
    """GDN mixer with Qwen3.5's separate projections ``in_proj_qkv [conv_dim, d]``,
    ``in_proj_z [H * Dv, d]``, ``in_proj_b`` and ``in_proj_a [H, d]``."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(c, device, tp)
        h, dv, d = c.gdn_heads, c.gdn_head_dim_v, c.d_model
        kw = {"dtype": c.dtype, "device": device}
        self.in_proj_qkv = Weight(c.gdn_conv_dim, d, **kw)
        self.in_proj_z = Weight(h * dv, d, **kw)
        self.in_proj_b = Weight(h, d, **kw)
        self.in_proj_a = Weight(h, d, **kw)
        # the four projections as one GEMM (column views of its output)
        self.in_proj = StackedRows(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def project(self, h):
        return tuple(self.in_proj.linear(h))


class Qwen3_5ForCausalLM(QwenHybridForCausalLM):
    """Qwen3.5 (text) on unimem's model interface (module docstring). Build with
    :meth:`from_hf_config`, fill with :meth:`load_weights`.

    A variant with other MLPs (Qwen3.5-MoE) subclasses it: :attr:`model_types` and
    :meth:`_mlp` / :meth:`_ffn_dim` are what differ."""

    ignored_checkpoint_prefixes = ("mtp.", "model.visual.")
    checkpoint_prefix_map = (("model.language_model.", "model."),)
    model_types: tuple[str, str] = ("qwen3_5_text", "qwen3_5")
    """``(text model_type, multimodal model_type)`` of the configs this class accepts."""

    @classmethod
    def from_hf_config(
        cls,
        hf_config,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_context: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> Qwen3_5ForCausalLM:
        """Uninitialised model of ``hf_config``: the text config (``model_types[0]``), or a
        multimodal one (``model_types[1]``) whose ``text_config`` is used
        (``tie_word_embeddings`` is read from the outer config, as the loader does), rank
        ``tp``'s shard. ValueError naming the field for anything unsupported."""
        text_type, outer_type = cls.model_types
        tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        model_type = getattr(hf_config, "model_type", text_type)
        if model_type == outer_type:
            hf_config = hf_config.text_config
            model_type = getattr(hf_config, "model_type", text_type)
        if model_type != text_type:
            raise ValueError(f"model_type {model_type!r}: expected {text_type!r} or {outer_type!r}")
        check_common(hf_config)
        full = hybrid_config(
            hf_config, ffn_dim=cls._ffn_dim(hf_config), dtype=dtype, max_context=max_context
        )
        c = local_config(full, tp)
        _, factor = rope_settings(hf_config)
        layers = []
        for kind in c.layer_pattern:
            if kind == "gdn":
                mixer: nn.Module = Qwen3_5Gdn(c, device, tp)
            else:
                mixer = GatedAttention(c, device, tp)
            mlp = cls._mlp(hf_config, c, device, tp)
            layers.append(DecoderLayer(c, kind, mixer, mlp, device))
        return cls(c, layers, int(c.head_dim_k * factor), tie, device, tp, full)

    @classmethod
    def _ffn_dim(cls, text_config) -> int:
        """``HybridConfig.ffn_dim`` of the text config: the dense MLP's width."""
        return text_config.intermediate_size

    @classmethod
    def _mlp(
        cls, text_config, c: HybridConfig, device: torch.device | str, tp: TensorParallel
    ) -> nn.Module:
        """One layer's MLP (rank ``tp``'s shard): a dense SwiGLU."""
        return DenseMlp(c.d_model, text_config.intermediate_size, c.dtype, device, tp)

    def _gdn_projection_shard(self, leaf: str) -> Shard | None:
        c, tp = self.full_config, self.tp
        h, dv = c.gdn_heads, c.gdn_head_dim_v
        if leaf == "in_proj_qkv.weight":  # [q (key heads) | k | v (value heads)]
            return shard(0, *gdn_qkv_ranges(tp, c))
        if leaf == "in_proj_z.weight":
            return shard(0, heads(tp, h, dv, "linear_num_value_heads"))
        if leaf in ("in_proj_b.weight", "in_proj_a.weight"):
            return shard(0, heads(tp, h, 1, "linear_num_value_heads"))
        return None
