"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet and gated full attention layers
(``config.layer_types``), sparse MoE with a shared expert (or a dense SwiGLU MLP on
``mlp_only_layers``, on layers off ``decoder_sparse_step``, or when ``num_experts == 0``).

The stack, norms, attention and GDN core are :mod:`unimem.models.qwen_common`'s. What is
Qwen3-Next's own is the GDN input projection layout: the checkpoint fuses it into
``in_proj_qkvz`` and ``in_proj_ba`` with rows grouped per key head; :meth:`load_weights`
re-lays them out once so the forward is one GEMM and a split (:class:`Qwen3NextGdn`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from unimem.models.config import HybridConfig
from unimem.models.loader import copy_param
from unimem.models.qwen_common import (
    DecoderLayer,
    DenseMlp,
    GatedAttention,
    GdnMixer,
    QwenHybridForCausalLM,
    SparseMoe,
    Weight,
    check_common,
    hybrid_config,
    rope_settings,
)
from unimem.models.stacked_linear import StackedRows
from unimem.models.tensor_parallel import SINGLE, Shard, TensorParallel, local_config, shard

__all__ = ["Qwen3NextForCausalLM", "qkvz_rows_to_contiguous", "ba_rows_to_contiguous"]


def qkvz_rows_to_contiguous(w: torch.Tensor, hk: int, h: int, dk: int, dv: int) -> torch.Tensor:
    """Re-lay out checkpoint ``in_proj_qkvz.weight [2*Hk*Dk + 2*H*Dv, d]``, whose rows are
    grouped per key head (for each key head: ``q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)``,
    ``r = H // Hk``), into ``[q (all Hk heads) | k | v (all H heads) | z]``, each head-major.
    Value head ``g * r + j`` is the ``j``-th value block of key head ``g``, as HuggingFace
    reshapes it."""
    r = h // hk
    grouped = w.reshape(hk, 2 * dk + 2 * r * dv, w.shape[-1])
    q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
    return torch.cat([x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)])


def ba_rows_to_contiguous(w: torch.Tensor, hk: int, h: int) -> torch.Tensor:
    """Re-lay out checkpoint ``in_proj_ba.weight [2*H, d]`` (per key head: ``b (r) | a (r)``)
    into ``[b (H) | a (H)]``."""
    r = h // hk
    b, a = w.reshape(hk, 2 * r, w.shape[-1]).split([r, r], dim=1)
    return torch.cat([b.reshape(h, -1), a.reshape(h, -1)])


class Qwen3NextGdn(GdnMixer):
    """GDN mixer with fused input projections, stored re-laid out (see
    :func:`qkvz_rows_to_contiguous`): ``in_proj_qkvz.weight`` rows ``[q | k | v | z]`` and
    ``in_proj_ba.weight`` rows ``[b | a]``. The checkpoint groups rows per key head, so a
    tensor-parallel rank's key heads with their value heads are one contiguous row range."""

    def __init__(
        self, c: HybridConfig, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(c, device, tp)
        h, dv = c.gdn_heads, c.gdn_head_dim_v
        self.split_qkvz = [c.gdn_conv_dim, h * dv]
        self.in_proj_qkvz = Weight(sum(self.split_qkvz), c.d_model, dtype=c.dtype, device=device)
        self.in_proj_ba = Weight(2 * h, c.d_model, dtype=c.dtype, device=device)
        self.in_proj = StackedRows(self.in_proj_qkvz, self.in_proj_ba)  # one GEMM for both

    def project(self, h):
        qkvz, ba = self.in_proj.linear(h)
        mixed_qkv, z = qkvz.split(self.split_qkvz, dim=-1)
        b, a = ba.chunk(2, dim=-1)
        return mixed_qkv, z, b, a  # column views: the GDN kernels read rows by their stride


def _check_shape(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """ValueError naming checkpoint tensor ``name`` unless it has ``param``'s shape (checked
    before a re-layout, whose reshape would otherwise fail with a message naming nothing)."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"tensor {name}: shape {tuple(tensor.shape)} in the checkpoint, "
            f"expected {tuple(param.shape)}"
        )


def _is_moe_layer(hf_config, i: int) -> bool:
    return (
        i not in (hf_config.mlp_only_layers or [])
        and hf_config.num_experts > 0
        and (i + 1) % hf_config.decoder_sparse_step == 0
    )


class Qwen3NextForCausalLM(QwenHybridForCausalLM):
    """Qwen3-Next on unimem's model interface (module docstring). Build with
    :meth:`from_hf_config`, fill with :meth:`load_weights`."""

    ignored_checkpoint_prefixes = ("mtp.",)

    def __init__(
        self,
        config,
        layers,
        rotary_dim,
        tie_word_embeddings,
        device,
        num_experts,
        tp: TensorParallel = SINGLE,
        full_config: HybridConfig | None = None,
    ):
        super().__init__(config, layers, rotary_dim, tie_word_embeddings, device, tp, full_config)
        self.num_experts = num_experts

    @classmethod
    def from_hf_config(
        cls,
        hf_config,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_context: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> Qwen3NextForCausalLM:
        """Uninitialised model of ``hf_config`` (a ``Qwen3NextConfig``), rank ``tp``'s shard;
        ValueError naming the field for anything unsupported."""
        model_type = getattr(hf_config, "model_type", "qwen3_next")
        if model_type != "qwen3_next":
            raise ValueError(f"model_type {model_type!r}: expected 'qwen3_next'")
        check_common(hf_config)
        if hf_config.decoder_sparse_step < 1:
            raise ValueError(
                f"decoder_sparse_step must be >= 1, got {hf_config.decoder_sparse_step}"
            )
        n = hf_config.num_hidden_layers
        moe = [_is_moe_layer(hf_config, i) for i in range(n)]
        ffn = hf_config.moe_intermediate_size if any(moe) else hf_config.intermediate_size
        full = hybrid_config(hf_config, ffn_dim=ffn, dtype=dtype, max_context=max_context)
        c = local_config(full, tp)
        _, factor = rope_settings(hf_config)
        layers = []
        for i, kind in enumerate(c.layer_pattern):
            if kind == "gdn":
                mixer: nn.Module = Qwen3NextGdn(c, device, tp)
            else:
                mixer = GatedAttention(c, device, tp)
            if moe[i]:
                mlp: nn.Module = SparseMoe(
                    c.d_model,
                    hf_config.num_experts,
                    hf_config.num_experts_per_tok,
                    hf_config.moe_intermediate_size,
                    hf_config.shared_expert_intermediate_size,
                    bool(hf_config.norm_topk_prob),
                    dtype,
                    device,
                    tp,
                )
            else:
                mlp = DenseMlp(c.d_model, hf_config.intermediate_size, dtype, device, tp)
            layers.append(DecoderLayer(c, kind, mixer, mlp, device))
        return cls(
            c,
            layers,
            int(c.head_dim_k * factor),
            bool(getattr(hf_config, "tie_word_embeddings", False)),
            device,
            hf_config.num_experts,
            tp,
            full,
        )

    def _gdn_projection_shard(self, leaf: str) -> Shard | None:
        c, tp = self.full_config, self.tp
        hk, r = c.gdn_key_heads, c.gdn_heads // c.gdn_key_heads
        a, b = tp.part(hk, "linear_num_key_heads")
        if leaf == "in_proj_qkvz.weight":  # per key head: q, k (dk each), v, z (r * dv each)
            group = 2 * c.gdn_head_dim_k + 2 * r * c.gdn_head_dim_v
            return shard(0, (a * group, b * group))
        if leaf == "in_proj_ba.weight":  # per key head: b, a (r each)
            return shard(0, (a * 2 * r, b * 2 * r))
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`QwenHybridForCausalLM.load_weights`, plus the Qwen3-Next layouts:

        * ``linear_attn.in_proj_qkvz.weight`` and ``linear_attn.in_proj_ba.weight`` are
          re-laid out from per-key-head groups to ``[q | k | v | z]`` and ``[b | a]``
          (:func:`qkvz_rows_to_contiguous`, :func:`ba_rows_to_contiguous`);
        * routed experts load from the hub's per-expert tensors
          ``mlp.experts.E.{gate,up,down}_proj.weight`` (what ``save_pretrained`` writes) into
          the stacked ``mlp.experts.gate_up_proj [E, 2I, d]`` (gate rows then up rows) and
          ``mlp.experts.down_proj [E, d, I]``, or from those stacked tensors directly
          (HuggingFace's in-memory ``state_dict``). A stacked parameter counts as filled once
          every expert's piece arrived (across calls).
        """
        return super().load_weights(weights)

    def _load_special(self, pname, tensor, ckpt_name, params):
        c = self.config
        # (an FP8 weight's per-row scales, ``..._scale_inv``, take its row re-layout)
        if pname.endswith((".in_proj_qkvz.weight", ".in_proj_qkvz.weight_scale_inv")) and (
            pname in params
        ):
            hk, h, dk, dv = c.gdn_key_heads, c.gdn_heads, c.gdn_head_dim_k, c.gdn_head_dim_v
            param = params[pname]
            _check_shape(param, tensor, ckpt_name)
            copy_param(param, qkvz_rows_to_contiguous(tensor, hk, h, dk, dv), ckpt_name)
            return {pname}
        if pname.endswith((".in_proj_ba.weight", ".in_proj_ba.weight_scale_inv")) and (
            pname in params
        ):
            param = params[pname]
            _check_shape(param, tensor, ckpt_name)
            relaid = ba_rows_to_contiguous(tensor, c.gdn_key_heads, c.gdn_heads)
            copy_param(param, relaid, ckpt_name)
            return {pname}
        return super()._load_special(pname, tensor, ckpt_name, params)
