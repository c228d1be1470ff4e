"""Gemma 3 in a GGUF (``general.architecture`` = ``gemma3``): its HF config and tensor names.

Config (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) from the metadata under
``gemma3.``: ``block_count``, ``embedding_length``, ``feed_forward_length``,
``attention.head_count`` / ``head_count_kv`` / ``key_length`` (the head dim),
``attention.layer_norm_rms_epsilon``, ``attention.sliding_window``, ``context_length``,
``rope.freq_base`` (the global layers' base) and, if present, ``rope.scaling.type`` /
``rope.scaling.factor`` (linear scaling of the global layers). What the file leaves out comes
from Gemma 3's defaults, as llama.cpp's ``gemma3`` graph assumes them:

* every 6th layer (5, 11, 17, ...) is full attention, the others sliding-window;
* the sliding layers' RoPE base is 10 000 (unscaled);
* the query scale is ``head_dim ** -0.5`` (``query_pre_attn_scalar`` = head dim), except for
  the 62-layer (27B) model, which scales by ``(hidden / heads) ** -0.5``;
* the MLP activation is the tanh GELU; no attention or final logit softcapping;
* the LM head is tied to the embedding when the file has no ``output.weight``.

Tensors: llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ...) map to the HF names the
model's ``load_weights`` takes. llama.cpp's converter stores every Gemma RMSNorm weight as
``1 + w`` (its norm multiplies by the stored weight; Gemma's multiplies by ``1 + w``), so
:func:`hf_tensor` subtracts 1 from every ``*norm.weight``. q/k projections are stored in HF's
layout (the converter permutes q/k only for llama-family rotary layouts, not Gemma's).
"""

from __future__ import annotations

import re

import torch

from unimem.models.gguf.reader import GGUFError, GGUFFile

__all__ = ["ARCHITECTURE", "hf_config_dict", "hf_tensor_name", "hf_tensor"]

ARCHITECTURE = "gemma3"
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_BASE = 10_000.0

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def hf_config_dict(f: GGUFFile) -> dict:
    """The ``config.json`` content of a ``gemma3`` GGUF (module docstring)."""
    a = ARCHITECTURE

    def key(name: str):
        return f.require(f"{a}.{name}")

    n_layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))
    value_dim = int(f.get(f"{a}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{f.path}: key_length {head_dim} != value_length {value_dim}")
    types = [
        "full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    glob = {"rope_type": "default", "rope_theta": float(key("rope.freq_base"))}
    scaling = f.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{f.path}: {a}.rope.scaling.type {scaling!r} is not supported")
        glob = {**glob, "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    scalar = hidden // heads if n_layers == 62 else head_dim
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = f.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in f.tensors else None
    if vocab is None:
        raise GGUFError(f"{f.path}: tensor token_embd.weight is missing")
    if tokens is not None and len(tokens) != vocab:
        raise GGUFError(f"{f.path}: {len(tokens)} tokens but token_embd has {vocab} rows")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv")),
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": types,
        "rope_parameters": {
            "full_attention": glob,
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE},
        },
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": f.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }


def hf_tensor_name(name: str) -> str:
    """The HF parameter name of GGUF tensor ``name``; :class:`GGUFError` for a name Gemma 3
    does not have."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
    raise GGUFError(f"tensor {name} is not a Gemma 3 tensor")


def hf_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """GGUF tensor ``name``'s values in HF's convention: norm weights less 1 (module docstring)."""
    return tensor - 1.0 if name.endswith("norm.weight") else tensor
