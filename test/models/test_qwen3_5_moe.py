"""Qwen3.5-MoE (text) on unimem's model interface against HuggingFace transformers
(independent code) on a tiny random checkpoint (:mod:`tiny_qwen3_5_moe`), CPU float32: the
same checks as ``test_qwen3_next.py`` (whose helpers this reuses) — dense oracle, a batched
cache run through extend / decode / verify + partial commit, greedy generation — plus both
expert checkpoint formats (per expert as ``save_pretrained`` writes, stacked as the hub and
HF's ``state_dict`` hold them), the multimodal checkpoint, the router's renormalisation,
wrong mappings and the loader's errors."""

from __future__ import annotations

import pytest
import tiny_qwen3_5_moe
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
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
from tiny_qwen3_next import perturb

from unimem.models.loader import CheckpointError, load_model
from unimem.models.qwen3_5 import Qwen3_5ForCausalLM
from unimem.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from unimem.models.qwen_common import SparseMoe
from unimem.models.registry import model_class


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    hf = tiny_qwen3_5_moe.build(path)
    model = load_model(path, dtype=torch.float32)
    ids = prompts(hf.config.vocab_size)
    return path, hf, model, ids, hf_logits(hf, ids)


def test_registry_serves_both_names():
    for arch in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        assert model_class(arch) is Qwen3_5MoeForCausalLM


def test_config(tiny):
    path, _, model, _, _ = tiny
    assert isinstance(model, Qwen3_5MoeForCausalLM)
    c = model.config
    assert c.layer_pattern == ("gdn", "gdn", "gdn", "full")
    assert (c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v) == (4, 2, 32, 32)
    assert (c.gdn_heads, c.gdn_key_heads, c.gdn_head_dim_k, c.gdn_head_dim_v) == (4, 2, 16, 16)
    assert (c.conv_kernel, c.ffn_dim, c.window, c.max_context) == (4, 32, None, 256)
    assert model.rotary.rotary_dim == 8
    for layer in model.model.layers:  # sparse everywhere, always renormalised
        assert isinstance(layer.mlp, SparseMoe)
        assert layer.mlp.norm_topk and layer.mlp.top_k == 2
        assert layer.mlp.experts.gate_up_proj.shape == (4, 64, 64)
        assert layer.mlp.shared_expert.gate_proj.weight.shape == (48, 64)
    # the saved checkpoint holds per-expert tensors (the stacked format is tested below)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names


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


def test_stacked_hub_names_load_the_same(tiny):
    """The hub's multimodal naming with stacked experts (``model.language_model.layers.N.
    mlp.experts.gate_up_proj``), the vision tower and the MTP head skipped, built from a
    ``Qwen3_5MoeConfig``: the same parameters as the per-expert checkpoint."""
    from transformers import Qwen3_5MoeConfig

    _, hf_model, model, _, _ = tiny
    sd = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in state_dict_of(hf_model).items()
    }
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in sd
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    sd["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(3, 3)
    outer = Qwen3_5MoeConfig(text_config=hf_model.config.to_dict(), tie_word_embeddings=False)
    other = Qwen3_5MoeForCausalLM.from_hf_config(outer, dtype=torch.float32, device="cpu")
    filled = other.load_weights(
        (k, v) for k, v in sd.items() if not k.startswith(other.ignored_checkpoint_prefixes)
    )
    assert filled == {n for n, _ in other.named_parameters()}
    ours = dict(model.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, ours[name]), name


def test_multimodal_checkpoint_matches_hf(tmp_path):
    """A ``Qwen3_5MoeForConditionalGeneration`` checkpoint as ``save_pretrained`` writes it
    (text under ``model.language_model.``, per-expert tensors, a vision tower) loads through
    the registry and matches HF's text-only logits."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = tiny_qwen3_5_moe.config().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = Qwen3_5MoeForConditionalGeneration._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager"
    )
    perturb(hf_model)
    hf_model.save_pretrained(str(tmp_path))
    hf_model = hf_model.float().eval()
    model = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(model, Qwen3_5MoeForCausalLM)
    ids = prompts(cfg.text_config.vocab_size, lengths=(11, 70))
    assert reference_diff(model, ids, hf_logits(hf_model, ids)) <= TOL


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True, "linear_num_key_heads": 4},
        {"num_experts": 6, "num_experts_per_tok": 3},
        {"num_experts_per_tok": 1},  # renormalised top-1: weight 1
    ],
)
def test_variants_match_hf(tmp_path, overrides):
    hf_model = tiny_qwen3_5_moe.build(tmp_path, **overrides)
    model = load_model(tmp_path, dtype=torch.float32)
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head_weight.data_ptr() == model.embed_weight.data_ptr()
    ids = prompts(hf_model.config.vocab_size, lengths=(11, 70))
    assert reference_diff(model, ids, hf_logits(hf_model, ids)) <= TOL


def _swap(sd, a, b):
    sd[a], sd[b] = sd[b].clone(), sd[a].clone()


@pytest.mark.parametrize(
    "wrong",
    [
        "b_a_swapped",
        "qkv_key_heads_swapped",
        "experts_swapped",
        "gate_up_halves_swapped",
        "shared_expert_gate_up_swapped",
        "no_renormalisation",
    ],
)
def test_wrong_mapping_is_caught(tiny, wrong):
    _, hf_model, _, ids, hf = tiny
    sd = state_dict_of(hf_model)
    if wrong == "b_a_swapped":
        pre = "model.layers.0.linear_attn."
        _swap(sd, pre + "in_proj_a.weight", pre + "in_proj_b.weight")
    elif wrong == "qkv_key_heads_swapped":  # swap the two query heads' rows
        name = "model.layers.2.linear_attn.in_proj_qkv.weight"
        w = sd[name].clone()
        w[:32] = torch.cat([sd[name][16:32], sd[name][:16]])
        sd[name] = w
    elif wrong == "experts_swapped":
        name = "model.layers.2.mlp.experts.gate_up_proj"
        sd[name] = sd[name].flip(0).contiguous()
    elif wrong == "gate_up_halves_swapped":
        name = "model.layers.1.mlp.experts.gate_up_proj"
        gate, up = sd[name].chunk(2, dim=1)
        sd[name] = torch.cat([up, gate], dim=1)
    elif wrong == "shared_expert_gate_up_swapped":
        pre = "model.layers.3.mlp.shared_expert."
        _swap(sd, pre + "gate_proj.weight", pre + "up_proj.weight")
    model = load_state(Qwen3_5MoeForCausalLM, hf_model, sd)
    if wrong == "no_renormalisation":
        for layer in model.model.layers:
            layer.mlp.norm_topk = False
    assert reference_diff(model, ids[:3], hf[:3]) > 100 * TOL


def test_loader_errors(tiny, tmp_path):
    path, hf_model, _, _, _ = tiny
    model = Qwen3_5MoeForCausalLM.from_hf_config(hf_model.config, dtype=torch.float32, device="cpu")
    bad = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        model.load_weights([(bad, torch.zeros(4, 64, 32))])
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj"):
        model.load_weights([("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(64, 7))])
    with pytest.raises(ValueError, match=r"unexpected tensor .*experts\.4\.gate_proj"):
        model.load_weights([("model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.1\.mlp\.gate_proj"):
        model.load_weights([("model.layers.1.mlp.gate_proj.weight", torch.zeros(96, 64))])
    with pytest.raises(ValueError, match=r"unexpected tensor .*in_proj_qkvz"):
        model.load_weights([("model.layers.0.linear_attn.in_proj_qkvz.weight", torch.zeros(3))])
    assert model.load_weights([("mtp.fc.weight", torch.zeros(3))]) == set()
    # a checkpoint lacking one expert's piece: the stacked parameter is reported missing
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.1.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.2\.mlp\."):
        load_model(tmp_path, dtype=torch.float32)


def test_unsupported_config_is_rejected():
    from transformers import Qwen3_5TextConfig

    with pytest.raises(ValueError, match="model_type"):
        Qwen3_5MoeForCausalLM.from_hf_config(Qwen3_5TextConfig(), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="model_type"):  # and the dense class refuses MoE
        Qwen3_5ForCausalLM.from_hf_config(
            tiny_qwen3_5_moe.config(), dtype=torch.float32, device="cpu"
        )
    cfg = tiny_qwen3_5_moe.config(hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        Qwen3_5MoeForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")
    cfg = tiny_qwen3_5_moe.config()
    cfg.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3_5MoeForCausalLM.from_hf_config(cfg, dtype=torch.float32, device="cpu")
