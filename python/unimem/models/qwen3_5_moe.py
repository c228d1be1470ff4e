"""Qwen3.5-MoE text model (``Qwen3_5MoeForCausalLM``, and the text part of
``Qwen3_5MoeForConditionalGeneration``): Qwen3.5's layers with a sparse MoE on every layer.

Nothing here is new code: the GDN mixer (split ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``), gated full attention, checkpoint prefixes (multimodal
``model.language_model.*`` → ``model.*``, vision tower ``model.visual.*`` and ``mtp.*``
skipped) and tensor-parallel rules are :class:`~unimem.models.qwen3_5.Qwen3_5ForCausalLM`'s;
the MLP is :mod:`unimem.models.qwen_common`'s :class:`SparseMoe`, Qwen3-Next's block.

As HuggingFace's ``Qwen3_5MoeSparseMoeBlock`` (transformers 5.24):

* every layer is sparse: the config has no ``mlp_only_layers`` / ``decoder_sparse_step`` /
  ``intermediate_size`` (``HybridConfig.ffn_dim`` is ``moe_intermediate_size``);
* router ``mlp.gate.weight [E, d]``: softmax over the experts, top ``num_experts_per_tok``,
  always renormalised to sum 1 (the config has no ``norm_topk_prob``);
* output ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``, the shared
  expert a SwiGLU of ``shared_expert_intermediate_size``.

Expert tensors load from either checkpoint format: per expert
(``mlp.experts.E.{gate,up,down}_proj.weight``, what ``save_pretrained`` writes) or stacked
(``mlp.experts.gate_up_proj [E, 2I, d]``, gate rows then up rows, and ``mlp.experts.down_proj
[E, d, I]``: the hub checkpoints and HuggingFace's in-memory ``state_dict``).
"""

from __future__ import annotations

import torch
from torch import nn

from unimem.models.config import HybridConfig
from unimem.models.qwen3_5 import Qwen3_5ForCausalLM
from unimem.models.qwen_common import SparseMoe
from unimem.models.tensor_parallel import TensorParallel

__all__ = ["Qwen3_5MoeForCausalLM"]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (text) on unimem's model interface (module docstring). Build with
    :meth:`from_hf_config` (a ``Qwen3_5MoeTextConfig``, or a multimodal ``Qwen3_5MoeConfig``),
    fill with :meth:`load_weights`."""

    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")

    @classmethod
    def _ffn_dim(cls, text_config) -> int:
        """The routed experts' width, ``moe_intermediate_size``."""
        return text_config.moe_intermediate_size

    @classmethod
    def _mlp(
        cls, text_config, c: HybridConfig, device: torch.device | str, tp: TensorParallel
    ) -> nn.Module:
        """The sparse MoE block with its shared expert (module docstring); ValueError naming
        ``num_experts`` / ``num_experts_per_tok`` for a routing it cannot run."""
        e, k = text_config.num_experts, text_config.num_experts_per_tok
        if not isinstance(e, int) or e < 1:
            raise ValueError(f"num_experts must be >= 1, got {e!r}")
        if not isinstance(k, int) or not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts = {e}], got {k!r}")
        return SparseMoe(
            c.d_model,
            e,
            k,
            text_config.moe_intermediate_size,
            text_config.shared_expert_intermediate_size,
            True,
            c.dtype,
            device,
            tp,
        )
