"""A tiny random Qwen3-Next checkpoint built with transformers' own classes (nothing is
downloaded): ``build(path, **overrides)`` saves it to ``path`` and returns the HF model.

Default shape: hidden 64, 4 layers (GDN, GDN, GDN, full attention), 4 query / 2 KV heads of
dim 32 with partial rotary 0.25 (8 rotary dims), GDN with 2 key heads and 4 value heads of
dim 16, conv kernel 4, MoE with 4 experts (top 2) and a shared expert on every layer,
vocab 500. ``overrides`` go to ``Qwen3NextConfig`` (e.g. ``mlp_only_layers=[1, 3]``).

HF initialises several weights to constants (zero-centred norms to 0, the gated norm to 1,
``dt_bias`` to 1) and everything else with std 0.02; the builder redraws them so that a
wrong formula (``w`` vs ``1 + w``) or a wrong mapping changes the logits visibly: norms
``0.2 * randn`` (gated norm ``1 + 0.2 * randn``), projections ``randn / sqrt(fan_in)``, and
decays kept slow (``A`` in [0.05, 1], ``dt_bias`` around -2) so the GDN state carries over
many tokens.
"""

from __future__ import annotations

import math

import torch

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
    intermediate_size=96,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw every parameter of a Qwen hybrid HF model as the module docstring says."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("linear_attn.norm.weight"):
                w = 1 + 0.2 * torch.randn(shape, generator=gen)
            elif name.endswith("norm.weight"):  # zero-centred (1 + w) norms
                w = 0.2 * torch.randn(shape, generator=gen)
            elif name.endswith("A_log"):
                w = (0.05 + 0.95 * torch.rand(shape, generator=gen)).log()
            elif name.endswith("dt_bias"):
                w = -2 + 0.5 * torch.randn(shape, generator=gen)
            elif name.endswith("conv1d.weight"):
                w = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            elif name.endswith("embed_tokens.weight"):
                w = torch.randn(shape, generator=gen)
            else:  # a [out, in] or [E, out, in] projection
                w = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            p.copy_(w.to(p.dtype))


def config(**overrides):
    """The ``Qwen3NextConfig`` of the tiny model."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**{**DEFAULTS, **overrides})


def build(path, **overrides):
    """Build (seed 0), perturb, save to ``path`` and return the float32 HF model in eval mode
    with eager attention and the per-expert (eager) MoE path."""
    from transformers import AutoModelForCausalLM

    cfg = config(**overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation="eager"
    )
    perturb(model)
    model.save_pretrained(str(path))
    return model.float().eval()
