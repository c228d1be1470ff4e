"""The checkpoint loader: sharded checkpoints load like single-file ones, and every broken
checkpoint fails with one line naming the file or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny_gemma3
import torch
from safetensors.torch import load_file, save_file

from unimem.models.loader import CheckpointError, load_checkpoint, load_model
from unimem.models.registry import supported_architectures


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    tiny_gemma3.build(path)
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    hf = tiny_gemma3.build(path / "tmp")
    hf.save_pretrained(str(path / "ck"), max_shard_size="40KB")
    return path / "ck"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_sharded_equals_single_file(single, sharded):
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a = load_model(single, dtype="float32")
    b = load_model(sharded, dtype="float32")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_checkpoint_bundle(single):
    ckpt = load_checkpoint(single, dtype="float32")
    assert ckpt.eos_token_ids == (1,)
    assert ckpt.tokenizer is None  # no tokenizer files in this directory
    assert ckpt.model.config.window == 8


def test_missing_shard(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ck")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert victim in _one_line(e) and "missing" in str(e.value)


def test_wrong_shape_unexpected_and_missing_tensors(single, tmp_path):
    path = _copy(single, tmp_path / "ck")
    weights = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"

    bad = dict(weights)
    bad[name] = bad[name][:, :-1].contiguous()
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert name in _one_line(e) and "shape" in str(e.value)

    extra = dict(weights)
    extra["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2, 2)
    save_file(extra, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert "model.layers.0.self_attn.rogue.weight" in _one_line(e)

    lacking = {k: v for k, v in weights.items() if k != name}
    save_file(lacking, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert name in _one_line(e) and "missing" in str(e.value)


def test_unsupported_architecture_lists_the_supported_ones(single, tmp_path):
    path = _copy(single, tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(path)
    msg = _one_line(e)
    assert "LlamaForCausalLM" in msg
    assert all(a in msg for a in supported_architectures())


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
