"""A tiny random gpt-oss checkpoint built with transformers' own classes, for tests (imported
as a sibling module: pytest puts this directory on ``sys.path``).

``build(path, **overrides)`` saves it to ``path`` and returns the transformers model (float32,
eager attention, eager per-expert MoE, eval mode). Layers: sliding, full, sliding, full
(window 8), 4 query / 2 KV heads of dim 16, 4 experts top-2 of width 32, vocab 500, YaRN RoPE
(factor 4 from 32 original positions: it changes the logits). Weights that HF initialises to
zeros or ones (norm weights, attention and expert biases) or to tiny values (sinks, router
bias) are redrawn so that a wrong formula shows; the experts' gate/up weights are scaled so
that both SwiGLU clamps (at ``swiglu_limit``) are reached.
"""

from __future__ import annotations

import os

import torch

DEFAULTS = dict(
    vocab_size=500,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=32,
    sliding_window=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
"""``rope_parameters`` override for a plain-RoPE variant."""


def build(path: str | os.PathLike, *, seed: int = 0, gate_up_scale: float = 5.0, **overrides):
    """Save a tiny random ``GptOssForCausalLM`` to ``path`` and return it (module docstring).

    ``overrides`` replace entries of the ``GptOssConfig`` keyword arguments
    (:data:`DEFAULTS`); ``seed`` fixes every weight; ``gate_up_scale`` multiplies the experts'
    gate/up weights (std ``initializer_range * gate_up_scale``)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    kwargs = {**DEFAULTS, **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(n)]
    config = GptOssConfig(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    gen = torch.Generator().manual_seed(seed + 1)

    def noise(t: torch.Tensor, std: float) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + noise(p, 0.2))
            elif name.endswith("self_attn.sinks"):
                p.copy_(noise(p, 1.0))
            elif name.endswith("bias"):  # q/k/v/o, router, expert biases
                p.copy_(noise(p, 0.1))
            elif name.endswith("experts.gate_up_proj"):
                p.mul_(gate_up_scale)
    model.eval()
    model.save_pretrained(path)
    return model
