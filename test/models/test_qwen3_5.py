"""Qwen3.5 (text) on unimem's model interface against HuggingFace transformers (independent
code) on a tiny random checkpoint (:mod:`tiny_qwen3_5`), CPU float32: the same checks as
``test_qwen3_next.py`` (whose helpers this reuses), plus the hub's multimodal checkpoint
naming and the claim that Qwen3.5's multimodal rotary is plain partial RoPE for text."""

from __future__ import annotations

import pytest
import tiny_qwen3_5
import torch
from test_qwen3_next import (
    TOL,
    dense_context_diff,
    dense_greedy,
    hf_greedy,
    hf_logits,
    load_state,
    prompts,
    reference_diff,
    state_dict_of,
)

from unimem.models.loader import load_model
from unimem.models.qwen3_5 import Qwen3_5ForCausalLM
from unimem.models.qwen_common import PartialRotary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    hf = tiny_qwen3_5.build(path)
    model = load_model(path, dtype=torch.float32)
    ids = prompts(hf.config.vocab_size)
    return path, hf, model, ids, hf_logits(hf, ids)


def test_config(tiny):
    _, _, model, _, _ = tiny
    assert isinstance(model, Qwen3_5ForCausalLM)
    c = model.config
    assert c.layer_pattern == ("gdn", "gdn", "gdn", "full")
    assert (c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v) == (4, 2, 32, 32)
    assert (c.gdn_heads, c.gdn_key_heads, c.gdn_head_dim_k, c.gdn_head_dim_v) == (4, 2, 16, 16)
    assert (c.conv_kernel, c.ffn_dim, c.window, c.max_context) == (4, 96, None, 256)
    assert model.rotary.rotary_dim == 8


def test_reference_forward_matches_hf(tiny):
    _, _, model, ids, hf = tiny
    assert reference_diff(model, ids, hf) <= TOL


def test_dense_context_matches_hf(tiny):
    _, _, model, ids, hf = tiny
    worst, rows = dense_context_diff(model, ids, hf)
    assert rows == len(ids) * 12
    assert worst <= TOL


def test_greedy_matches_hf_generate(tiny):
    _, hf_model, model, ids, _ = tiny
    sel = [ids[0], ids[5]]
    assert dense_greedy(model, sel, 8) == hf_greedy(hf_model, sel, 8)


def test_multimodal_checkpoint_names(tiny):
    """The hub's ``Qwen3_5ForConditionalGeneration`` naming: text weights under
    ``model.language_model.``, vision tower and MTP head skipped; a ``Qwen3_5Config``
    (text_config inside) builds the same model."""
    from transformers import Qwen3_5Config

    _, hf_model, model, _, _ = tiny
    sd = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in state_dict_of(hf_model).items()
    }
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    sd["mtp.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)
    outer = Qwen3_5Config(text_config=hf_model.config.to_dict(), tie_word_embeddings=False)
    other = Qwen3_5ForCausalLM.from_hf_config(outer, dtype=torch.float32, device="cpu")
    filled = other.load_weights(sd.items())
    assert filled == {n for n, _ in other.named_parameters()}
    ours = dict(model.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, ours[name]), name


def test_tied_embeddings_match_hf(tmp_path):
    hf_model = tiny_qwen3_5.build(tmp_path, tie_word_embeddings=True, linear_num_key_heads=4)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.lm_head_weight.data_ptr() == model.embed_weight.data_ptr()
    ids = prompts(hf_model.config.vocab_size, lengths=(11, 70))
    assert reference_diff(model, ids, hf_logits(hf_model, ids)) <= TOL


def test_mrope_is_plain_partial_rope_for_text():
    """HF's multimodal text rotary (real Qwen3.5 shape: head dim 256, partial 0.25, mrope
    sections [11, 11, 10] interleaved) gives, for text positions, exactly the cos/sin of a
    plain partial RoPE."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rope = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    cfg = tiny_qwen3_5.config(head_dim=256, rope_parameters=rope)
    hf_rotary = Qwen3_5TextRotaryEmbedding(cfg)
    pos = torch.arange(0, 4000, 7)
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), pos[None])
    ours = PartialRotary(256, 64, 10_000_000.0, torch.float32)
    c, s = ours.cos_sin(pos)
    assert torch.equal(cos[0], torch.cat([c, c], -1)) and torch.equal(sin[0], torch.cat([s, s], -1))


@pytest.mark.parametrize("wrong", ["b_a_swapped", "k_v_swapped", "qkv_key_heads_swapped"])
def test_wrong_mapping_is_caught(tiny, wrong):
    _, hf_model, _, ids, hf = tiny
    sd = state_dict_of(hf_model)
    if wrong == "b_a_swapped":
        a, b = (
            "model.layers.0.linear_attn.in_proj_a.weight",
            "model.layers.0.linear_attn.in_proj_b.weight",
        )
    elif wrong == "k_v_swapped":
        a, b = "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.v_proj.weight"
    if wrong == "qkv_key_heads_swapped":  # swap the two query heads' rows
        name = "model.layers.2.linear_attn.in_proj_qkv.weight"
        w = sd[name].clone()
        w[:32] = torch.cat([sd[name][16:32], sd[name][:16]])
        sd[name] = w
    else:
        sd[a], sd[b] = sd[b].clone(), sd[a].clone()
    model = load_state(Qwen3_5ForCausalLM, hf_model, sd)
    assert reference_diff(model, ids[:3], hf[:3]) > 100 * TOL


def test_loader_errors(tiny):
    _, hf_model, _, _, _ = tiny
    model = Qwen3_5ForCausalLM.from_hf_config(hf_model.config, dtype=torch.float32, device="cpu")
    bad = "model.layers.0.linear_attn.in_proj_qkv.weight"
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        model.load_weights([(bad, torch.zeros(7, 64))])
    with pytest.raises(ValueError, match=r"conv1d\.weight"):
        model.load_weights([("model.layers.0.linear_attn.conv1d.weight", torch.zeros(96, 2, 4))])
    with pytest.raises(
        ValueError, match=r"unexpected tensor model\.layers\.0\.linear_attn\.in_proj_qkvz"
    ):
        model.load_weights([("model.layers.0.linear_attn.in_proj_qkvz.weight", torch.zeros(3))])


def test_unsupported_config_is_rejected():
    from transformers import Qwen3NextConfig

    with pytest.raises(ValueError, match="model_type"):
        Qwen3_5ForCausalLM.from_hf_config(Qwen3NextConfig(), dtype=torch.float32, device="cpu")
    cfg = tiny_qwen3_5.config(hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        Qwen3_5ForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")
