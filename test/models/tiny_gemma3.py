"""A tiny random Gemma 3 text checkpoint, built at test time with transformers' own classes.

``build(path, **overrides)`` writes ``config.json`` + ``model.safetensors`` to ``path`` and
returns the float32 HF model (eval mode, eager attention). Defaults: hidden 64, 6 layers
(5 sliding : 1 full, from ``sliding_window_pattern=6``), 4 query / 2 KV heads of dim 16,
``query_pre_attn_scalar`` 24 (not the head dim), ``sliding_window`` 8, vocab 500, distinct
local (500) and global (50000) RoPE bases. ``overrides`` go to ``Gemma3TextConfig`` as they
are (e.g. ``rope_scaling={"rope_type": "linear", "factor": 4.0}``,
``final_logit_softcapping=2.0``, ``layer_types=[...]``).

HF initialises every RMSNorm weight (stored as ``w`` in ``x * (1 + w)``) to zero; they are
redrawn here as ``0.5 * N(0, 1)`` so that a wrong norm formula shows in the logits.
"""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

DEFAULTS = dict(
    vocab_size=500,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    sliding_window_pattern=6,
    rope_theta=50_000.0,
    rope_local_base_freq=500.0,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)


def config(**overrides) -> Gemma3TextConfig:
    """The tiny ``Gemma3TextConfig`` (module docstring) with ``overrides`` applied."""
    return Gemma3TextConfig(**{**DEFAULTS, **overrides})


def build(path, seed: int = 0, **overrides) -> Gemma3ForCausalLM:
    """Seeded random tiny Gemma 3 saved to ``path`` (safetensors); the HF model, float32,
    eval mode, eager attention."""
    cfg = config(**overrides)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path))
    model.config._attn_implementation = "eager"
    return model
