"""Tiny GGUF files, written at test time with the ``gguf`` library's own writer.

:func:`tiny_vocab` is a small SentencePiece-style vocabulary in llama.cpp's Gemma layout
(control tokens, 256 byte tokens, then pieces with ``▁`` for a space, listed in merge order).
:func:`write_gemma3` writes a HF Gemma 3 model as llama.cpp's converter does: llama.cpp's
tensor names, every norm weight stored as ``1 + w``, the LM head left out when tied; each
tensor in the ggml type ``qtypes`` gives for its GGUF name (default F32).
"""

from __future__ import annotations

import string

import gguf
import numpy as np
import torch

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
CONTROL, NORMAL, UNKNOWN, BYTE = 3, 1, 2, 6

_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_vocab(size: int) -> tuple[list[str], list[int]]:
    """``size`` tokens and their llama.cpp token types (module docstring)."""
    tokens = list(SPECIALS)
    types = [CONTROL] * len(SPECIALS)
    types[3] = UNKNOWN
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = ["▁", "  ", *string.ascii_lowercase, *string.ascii_uppercase, *".,!?:'"]
    pieces += ["▁" + c for c in string.ascii_lowercase]
    pieces += ["th", "he", "in", "er", "an", "▁th", "▁the", "the", "▁a", "on", "re", "at"]
    pieces += [a + b for a in "etaoinsr" for b in "etaoinshrdl" if a + b not in pieces]
    pieces += ["▁" + a + b for a in "tsawohc" for b in "haeiou"]
    pieces = list(dict.fromkeys(pieces))
    tokens += pieces[: size - len(tokens)]
    types += [NORMAL] * (len(tokens) - len(types))
    unused = size - len(tokens)  # padded with control tokens, as Gemma's <unusedN>
    tokens += [f"<unused{i}>" for i in range(unused)]
    types += [CONTROL] * unused
    if len(tokens) != size:
        raise ValueError(f"tiny_vocab has only {len(tokens)} tokens, asked for {size}")
    return tokens, types


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:-1])]}.weight"


def write_gemma3(
    path,
    model,
    *,
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    arch: str = "gemma3",
    metadata: dict | None = None,
) -> dict[str, np.ndarray]:
    """Write HF Gemma 3 ``model`` (its config's sizes) as a GGUF at ``path``; returns the
    float32 arrays written per GGUF name (before quantisation)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["full_attention"]["rope_theta"])
    tokens, types = tiny_vocab(c.vocab_size)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)  # "  ": spaces as llama.cpp stores them
    w.add_array("tokenizer.ggml.scores", [-1000.0] * len(tokens))
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    written = {}
    tied = c.tie_word_embeddings
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        g = gguf_name(name)
        arr = p.detach().to(torch.float32).numpy().copy()
        if name.endswith("norm.weight"):
            arr = arr + 1.0
        written[g] = arr
        qtype = (qtypes or {}).get(g, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(g, arr.astype(np.float16))
        else:  # bytes of the quantised rows
            w.add_tensor(g, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
