"""A tiny random Qwen3.5-MoE (text) checkpoint built with transformers' own classes (nothing
is downloaded): ``build(path, **overrides)`` saves it to ``path`` and returns the HF model.

Default shape: hidden 64, 4 layers (GDN, GDN, GDN, full attention), 4 query / 2 KV heads of
dim 32 with partial rotary 0.25 (8 rotary dims), GDN with 2 key heads and 4 value heads of
dim 16, conv kernel 4, MoE with 4 experts (top 2, width 32) and a shared expert (width 48)
on every layer, vocab 500. ``overrides`` go to ``Qwen3_5MoeTextConfig``. Weights are redrawn
as :func:`tiny_qwen3_next.perturb` does (norms, ``dt_bias``, ``A_log`` away from HF's
constants; router and shared-expert gate as projections).
"""

from __future__ import annotations

import torch
from tiny_qwen3_next import perturb

DEFAULTS = dict(
    vocab_size=500,
    hidden_size=64,
    num_hidden_layers=4,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def config(**overrides):
    """The ``Qwen3_5MoeTextConfig`` of the tiny model."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**{**DEFAULTS, **overrides})


def honour_saved_tokenizer_class() -> None:
    """Let ``AutoTokenizer`` load the tokenizer class a ``qwen3_5_moe_text`` checkpoint
    directory declares. transformers 5.24 lists that model type among those whose hub
    ``tokenizer_class`` is wrong and forces its Qwen BPE tokenizer (``Qwen3_5Tokenizer``)
    instead, which cannot read the word-level test tokenizer (:mod:`tiny_tokenizer`) saved
    beside the tiny checkpoint; ``qwen3_5_text`` (the dense tiny model's type) is not on the
    list. Process-wide, affects only this model type; idempotent."""
    from transformers.models.auto import tokenization_auto

    forced = getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", None)
    if forced is not None:
        forced.discard("qwen3_5_moe_text")


def build(path, **overrides):
    """Build (seed 0), perturb, save to ``path`` (per-expert tensors, as ``save_pretrained``
    writes them) and return the float32 HF model (``Qwen3_5MoeForCausalLM``) in eval mode
    with eager attention and the per-expert (eager) MoE path. Also
    :func:`honour_saved_tokenizer_class`, so a test tokenizer saved into ``path`` loads."""
    from transformers import AutoModelForCausalLM

    honour_saved_tokenizer_class()
    cfg = config(**overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation="eager"
    )
    perturb(model)
    model.save_pretrained(str(path))
    return model.float().eval()
