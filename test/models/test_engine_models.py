"""``unimem.Engine`` on tiny random checkpoints of every supported architecture, against
HuggingFace transformers' ``generate`` on the same checkpoint (CPU, float32): greedy output
ids equal and per-token log-probabilities within 1e-4, through the static pools and through a
unified arena small enough that compaction happens; the prefix cache is on (the default)
except where a test says why not (``test_engine_prefix_cache.py`` tests the cache itself)."""

from __future__ import annotations

import importlib
import logging

import pytest
import tiny_tokenizer
import torch

import unimem

ARCHS = ["gemma3", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
OUT = 10
LOGPROB_TOL = 1e-4


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [9, 12, 17, 21, 26, 33]  # all longer than the window of 8
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    builder = importlib.import_module(f"tiny_{request.param}")
    path = tmp_path_factory.mktemp(request.param)
    hf = builder.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    prompts = _prompts(hf.config.vocab_size)
    expected = []
    for ids in prompts:
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=OUT,
            min_new_tokens=OUT,
            do_sample=False,
            output_logits=True,  # raw logits (scores are after min_new_tokens' EOS mask)
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        toks = out.sequences[0, len(ids) :].tolist()
        logits = torch.stack([x[0] for x in out.logits]).float()
        lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None])[:, 0].tolist()
        expected.append((toks, lps))
    return request.param, path, prompts, expected


def _engine(path, **kw):
    base = dict(model_path=str(path), device="cpu", dtype="float32", page_size=4)
    return unimem.Engine(**{**base, **kw})


def _check(outs, expected):
    for i, (out, (toks, lps)) in enumerate(zip(outs, expected, strict=True)):
        assert out["output_ids"] == toks, f"prompt {i}"
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, lps, strict=True)) < LOGPROB_TOL, f"prompt {i}"
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": OUT}


def test_static_memory_equals_transformers(checkpoint):
    _, path, prompts, expected = checkpoint
    engine = _engine(path, max_total_tokens=1024, max_running_requests=6)
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    _check(outs, expected)
    engine.shutdown()


def test_unified_arena_with_compaction_equals_transformers(checkpoint):
    _, path, prompts, expected = checkpoint
    # a budget that binds: not every request fits at once, so the arena's split moves. The
    # prefix cache is off here: with it on, the static split (and so the arena) gains a state
    # slot per running request for checkpoints and 64 tokens no longer bind for the STATE
    # models; the cache under memory pressure is test_engine_prefix_cache.py's.
    engine = _engine(
        path,
        enable_unified_memory=True,
        max_total_tokens=64,
        max_running_requests=3,
        disable_radix_cache=True,
    )
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    _check(outs, expected)
    assert engine.pool.stats.compactions > 0
    engine.shutdown()


def test_text_prompts_stop_tokens_and_finish_reasons(checkpoint):
    _, path, prompts, expected = checkpoint
    engine = _engine(path, max_total_tokens=1024)
    text = " ".join(f"w{t}" for t in prompts[2])
    out = engine.generate(prompt=text, sampling_params={"max_new_tokens": OUT, "ignore_eos": True})
    assert out["output_ids"] == expected[2][0]
    assert out["text"] == engine.tokenizer.decode(expected[2][0], skip_special_tokens=True)
    stop = expected[2][0][3]
    out = engine.generate(
        input_ids=prompts[2],
        sampling_params={"max_new_tokens": OUT, "stop_token_ids": [stop], "ignore_eos": True},
    )
    first = expected[2][0].index(stop)
    assert out["output_ids"] == expected[2][0][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    engine.shutdown()


def test_bad_arguments_fail_before_anything_runs(checkpoint):
    _, path, prompts, _ = checkpoint
    with pytest.raises(ValueError, match="dp_size"):
        _engine(path, dp_size=2)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        _engine(path, tp_size=0)
    with pytest.raises(ValueError, match="unknown argument 'not_a_flag'"):
        _engine(path, not_a_flag=1)
    engine = _engine(path, max_total_tokens=1024)
    ctx = engine.context_length
    bad = [
        ({"max_new_tokens": 4, "top_q": 1}, [prompts[0]], "unknown key 'top_q'"),
        ({"max_new_tokens": -1}, [prompts[0]], "max_new_tokens"),
        ({"temperature": -0.7}, [prompts[0]], "sampling_params.temperature must be >= 0"),
        ({"top_p": 0}, [prompts[0]], "sampling_params.top_p"),
        ({"max_new_tokens": 4}, [prompts[0], []], "request 1: the prompt is empty"),
        ({"max_new_tokens": 4}, [prompts[0], [5] * ctx], "context length"),
    ]
    for params, ids, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.generate(input_ids=ids, sampling_params=params)
        assert engine.core.scheduler.idle  # nothing was queued
    engine.shutdown()


def test_dspark_with_a_drafter_checkpoint(checkpoint, tmp_path, caplog):
    from unimem.speculative.checkpoint import save_drafter
    from unimem.speculative.drafter import DsparkDrafter, draft_config_for

    _, path, prompts, expected = checkpoint
    # no drafter given and none shipped: the engine says what the untrained one costs
    with caplog.at_level(logging.WARNING, logger="unimem.engine.api"):
        _engine(path, max_total_tokens=1024, speculative_algorithm="DSPARK").shutdown()
    assert "UNTRAINED" in caplog.text and "slower than serving without DSPARK" in caplog.text
    caplog.clear()
    plain = _engine(path, max_total_tokens=1024)
    model = plain.model
    drafter = DsparkDrafter(
        draft_config_for(model.config), model.embed_weight, model.lm_head_weight, seed=3
    )
    save_drafter(drafter, tmp_path / "drafter")
    plain.shutdown()
    engine = _engine(
        path,
        max_total_tokens=1024,
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=4,
        speculative_draft_model_path=str(tmp_path / "drafter"),
    )
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [toks for toks, _ in expected]
    assert engine.core.chain.drafter.config.gamma is None  # an untrained drafter's record
    assert "UNTRAINED" not in caplog.text  # a drafter was given: no warning
    engine.shutdown()
    with pytest.raises(ValueError, match="speculative_draft_model_path needs"):
        _engine(path, speculative_draft_model_path=str(tmp_path / "drafter"))
