"""GGUF checkpoints (``unimem.models.gguf``) on tiny files written at test time (``tiny_gguf``).

A tiny random HF Gemma 3 (``tiny_gemma3``, with the values the GGUF leaves to Gemma 3's
defaults: local RoPE base 10 000, query scale ``head_dim ** -0.5``, every 6th layer full) is
written as llama.cpp writes Gemma 3, converted back, and checked: the weights equal the
original (float32) or gguf's decoding of them (Q8_0, Q5_0, F16, BF16); transformers on the
converted directory gives the original model's logits (config semantics); ``unimem.Engine``
on the ``.gguf`` path generates what transformers generates; the tokenizer built from the
metadata. Errors: another architecture, an unsupported tensor type, a file that is not a
GGUF. The cache: reused for the same content, a new directory for changed content.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import tiny_gemma3
import tiny_gguf
import torch
from safetensors.torch import load_file

from unimem.models import model_path
from unimem.models.gguf.convert import PROVENANCE_FILE, converted_checkpoint
from unimem.models.gguf.dequant import dequantize
from unimem.models.gguf.reader import GGUFError, read_gguf

Q = gguf.GGMLQuantizationType
GEMMA_DEFAULTS = dict(query_pre_attn_scalar=16, rope_local_base_freq=10_000.0, num_hidden_layers=7)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIMEM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_gemma3.build(tmp_path_factory.mktemp("hf"), **GEMMA_DEFAULTS)


def _prompt(n: int = 20) -> torch.Tensor:
    return torch.randint(7, 500, (n,), generator=torch.Generator().manual_seed(5))


def test_f32_roundtrip_weights_config_and_logits(hf, tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_gemma3(path, hf)
    out = converted_checkpoint(path)
    state = load_file(str(out / "model.safetensors"))
    original = hf.state_dict()
    assert set(state) == set(original) - {"lm_head.weight"}  # tied: the file has no output
    for name, t in state.items():
        torch.testing.assert_close(t, original[name], rtol=0, atol=1e-6, msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == hf.config.layer_types  # layer 5 full, the others sliding
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = _prompt()[None]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=1e-4)


def test_quantised_types_decode_as_gguf_does(hf, tmp_path):
    qtypes = {
        "token_embd.weight": Q.Q8_0,
        "blk.0.attn_q.weight": Q.Q5_0,
        "blk.0.ffn_down.weight": Q.F16,
        "blk.1.ffn_up.weight": Q.BF16,
    }
    path = tmp_path / "q.gguf"
    written = tiny_gguf.write_gemma3(path, hf, qtypes=qtypes)
    f = read_gguf(path)
    for name, qtype in qtypes.items():
        t = f.tensors[name]
        assert t.qtype == qtype and t.shape == written[name].shape
        ours = dequantize(t)
        ref = gguf.quants.dequantize(gguf.quants.quantize(written[name], qtype), qtype)
        np.testing.assert_array_equal(ours.numpy(), ref)
        scale = np.abs(written[name]).max()
        assert np.abs(ours.numpy() - written[name]).max() <= 0.1 * scale
    assert dequantize(f.tensors["token_embd.weight"], torch.bfloat16).dtype == torch.bfloat16


def test_engine_on_gguf_matches_transformers(hf, tmp_path):
    import unimem

    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_gemma3(path, hf)
    ids = _prompt().tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[
            0, len(ids) :
        ].tolist()
    engine = unimem.Engine(model_path=str(path), dtype="float32", max_total_tokens=512)
    try:
        out = engine.generate(
            input_ids=[ids], sampling_params={"max_new_tokens": 6, "ignore_eos": True}
        )
    finally:
        engine.shutdown()
    assert out[0]["output_ids"] == ref


def test_tokenizer_from_metadata(hf, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_gemma3(path, hf)
    tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(path)))
    assert tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok.chat_template is None  # the file has none
    vocab = tok.get_vocab()
    # <bos> first; merged by the vocabulary's order, not character by character
    assert tok("the hat")["input_ids"] == [2, vocab["the"], vocab["▁h"], vocab["at"]]
    text = "the cat, a hat!  Zz é"  # two spaces: a respelled token; é: byte fallback
    ids = tok(text)["input_ids"]
    assert vocab["▁▁"] in ids and vocab["<0xC3>"] in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    ids = tok("<start_of_turn>hi")["input_ids"]
    assert ids[:2] == [2, 5]  # control tokens are matched whole


def test_chat_template_from_metadata(hf, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "chat.gguf"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tiny_gguf.write_gemma3(path, hf, metadata={"tokenizer.chat_template": template})
    tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(path)))
    assert tok.chat_template == template


def test_other_architecture_is_refused(hf, tmp_path):
    path = tmp_path / "llama.gguf"
    tiny_gguf.write_gemma3(path, hf, arch="llama")
    with pytest.raises(GGUFError, match="architecture 'llama' is not supported"):
        converted_checkpoint(path)


def test_unsupported_tensor_type_is_refused(hf, tmp_path):
    path = tmp_path / "q4_0.gguf"
    tiny_gguf.write_gemma3(path, hf, qtypes={"blk.0.attn_q.weight": Q.Q4_0})
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.weight: ggml type Q4_0"):
        converted_checkpoint(path)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        model_path.resolve_model_path(str(bad))


def test_cache_reused_and_keyed_by_content(hf, tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_gemma3(path, hf)
    first = converted_checkpoint(path)
    stamp = (first / PROVENANCE_FILE).stat().st_mtime_ns
    assert converted_checkpoint(path) == first
    assert (first / PROVENANCE_FILE).stat().st_mtime_ns == stamp  # not converted again
    assert model_path.resolve_model_path(str(path)) == str(first)
    tiny_gguf.write_gemma3(path, hf, metadata={"general.name": "changed"})
    second = converted_checkpoint(path)
    assert second != first and (second / PROVENANCE_FILE).is_file()


def test_embedded_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(
        model_path.EMBEDDED_MODELS, "tiny-missing", ("no_such_module_xyz", "no-such-pkg==1.0")
    )
    with pytest.raises(model_path.ModelNotInstalled, match="pip install 'no-such-pkg==1.0'"):
        model_path.resolve_model_path("tiny-missing")


def test_no_path_is_the_default_model(monkeypatch):
    seen = []
    monkeypatch.setattr(model_path, "embedded_gguf", lambda name: seen.append(name) or ("", ""))
    monkeypatch.setattr("unimem.models.gguf.converted_checkpoint", lambda p, **kw: "/converted")
    assert model_path.resolve_model_path(None) == "/converted"
    assert seen == [model_path.DEFAULT_MODEL]
    from unimem.engine.args import EngineArgs

    assert EngineArgs().model_path == model_path.DEFAULT_MODEL
    assert model_path.resolve_model_path("/some/dir") == "/some/dir"
