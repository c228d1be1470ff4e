"""Padded extend steps (``UNIMEM_EXTEND_GRAPHS=on``; what the GPU records as CUDA graphs, run
eagerly on the CPU): a short extend padded to a (requests, tokens) bucket — lanes past the
batch on row 0, one more lane holding the padding tokens — gives every request the tokens and
log-probabilities of the ragged extend, with and without DSPARK, over cached prefixes, beside
sampled requests, on Gemma 3 and gpt-oss (sinks, a short window, MoE), and the padding writes
nothing a request reads; long extends stay ragged;
models with recurrent-state layers keep the ragged extend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from unimem.engine.api import Engine
from unimem.engine.runner import EXTEND_LANES, EXTEND_TOKENS, NO_EXTRAS
from unimem.models.sampler import BOUNDED

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_gpt_oss  # noqa: E402
import tiny_qwen3_next  # noqa: E402


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = [5, 17, 3, 40, 9, 300, 12, 7, 2, 33, 21, 6]  # 300: past the token buckets
    out = [[2] + torch.randint(4, 250, (n,), generator=g).tolist() for n in lens]
    out.append(out[1] + [7, 8, 9])  # the second prompt (cached by then), then more
    return out


def _params(n: int) -> list[dict]:
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 5}
    return [{"max_new_tokens": 6, **(sampled if i % 3 == 1 else {})} for i in range(n)]


def _engine(ckpt, monkeypatch, padded: bool, **extra) -> Engine:
    """A CPU engine over ``ckpt`` with padded extends on or off."""
    monkeypatch.setenv("UNIMEM_EXTEND_GRAPHS", "on" if padded else "off")
    return Engine(
        model_path=str(ckpt), device="cpu", dtype="float32", page_size=4,
        max_total_tokens=4096, max_running_requests=6, context_length=512, **extra,
    )  # fmt: skip


def _run(ckpt, monkeypatch, padded: bool, **extra):
    eng = _engine(ckpt, monkeypatch, padded, **extra)
    runner = eng.core.runner
    calls = []
    real = runner._extend_padded

    def spy(lanes, tokens, rule=None, **kw):
        calls.append((lanes, tokens, rule))
        return real(lanes, tokens, rule=rule, **kw)

    runner._extend_padded = spy
    prompts = _prompts()
    # two waves: the second one extends over prefixes the first left in the cache
    outs = eng.generate(input_ids=prompts[:7], sampling_params=_params(7), return_logprob=True)
    outs += eng.generate(input_ids=prompts[7:], sampling_params=_params(len(prompts) - 7),
                         return_logprob=True)  # fmt: skip
    lanes = runner.extend_lanes
    eng.shutdown()
    return outs, calls, lanes


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "DSPARK"}], ids=["plain", "dspark"])
def test_padded_extend_equals_the_ragged_extend(gemma2_ckpt, monkeypatch, spec):
    want, none, lanes = _run(gemma2_ckpt, monkeypatch, False, **spec)
    assert not none and lanes == ()
    got, calls, lanes = _run(gemma2_ckpt, monkeypatch, True, **spec)
    assert lanes == EXTEND_LANES[:3]  # buckets need one more lane than their requests: <= 5
    assert calls and all(t in EXTEND_TOKENS for _, t, _ in calls)
    # greedy extends, and sampled ones under the batch's cut-off rule (top-k 20: bounded)
    assert {rule for _, _, rule in calls} == {None, BOUNDED}
    assert got[-1]["meta_info"]["cached_tokens"] > 0  # an extend over a cached prefix
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"]
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-4)


def _extras_params(n: int, vocab: int) -> list[dict]:
    """Every request but the fourth with extras: a bias that wins picks, min_new_tokens
    holding off a stop token, penalties, a sampled request with a bias."""
    out = []
    for i, p in enumerate(_params(n)):
        kind = i % 4
        if kind == 0:
            p["logit_bias"] = {"7": 6.0, str(vocab - 1): 4.0}
        elif kind == 1:
            p["logit_bias"] = {"9": 3.0}
        elif kind == 2:
            p.update(min_new_tokens=4, stop_token_ids=list(range(10, 200)))
            p.update(presence_penalty=0.5, repetition_penalty=1.2)
        out.append(p)
    return out


def _run_extras(ckpt, monkeypatch, padded: bool, halves: bool, **extra):
    eng = _engine(ckpt, monkeypatch, padded, **extra)
    runner = eng.core.runner
    runner.eager_halves = halves
    calls = []  # ("halves" | "whole", lanes, tokens) of the padded extends with extras
    finish, whole = runner._extend_padded_finish, runner._extend_padded

    def spy_finish(lanes, tokens, *args):
        calls.append(("halves", lanes, tokens))
        return finish(lanes, tokens, *args)

    def spy_whole(lanes, tokens, rule=None, extras=NO_EXTRAS):
        if extras is not NO_EXTRAS:
            calls.append(("whole", lanes, tokens))
        return whole(lanes, tokens, rule=rule, extras=extras)

    runner._extend_padded_finish, runner._extend_padded = spy_finish, spy_whole
    vocab = eng.model.config.vocab_size
    prompts = [p for p in _prompts() if len(p) < 100]
    first, second = prompts[:6], prompts[6:]
    outs = eng.generate(input_ids=first, sampling_params=_extras_params(len(first), vocab),
                        return_logprob=True, top_logprobs_num=3)  # fmt: skip
    outs += eng.generate(input_ids=second, sampling_params=_extras_params(len(second), vocab),
                         return_logprob=True)  # fmt: skip
    eng.shutdown()
    return outs, calls


@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "DSPARK"}], ids=["plain", "dspark"])
def test_padded_extends_with_extras_equal_the_ragged_extend(gemma2_ckpt, monkeypatch, spec,
                                                              halves):  # fmt: skip
    """Extends of requests with logit adjustments and top log-probabilities take the padded
    path too — the padded step with its extras eagerly, or (what the GPU replays) its
    recorded forward half, then the LM head, the adjustments and the pick — and give the
    ragged extend's tokens, log-probabilities and top tokens."""
    want, none = _run_extras(gemma2_ckpt, monkeypatch, False, False, **spec)
    assert not none
    got, calls = _run_extras(gemma2_ckpt, monkeypatch, True, halves, **spec)
    # padded extends with extras ran, split where asked, else as the whole padded step
    assert {kind for kind, *_ in calls} == {"halves" if halves else "whole"}
    assert any(7 in o["output_ids"] for o in want)  # the bias changed picks
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]
        ma, mb = a["meta_info"], b["meta_info"]
        lp_a = [x[0] for x in ma["output_token_logprobs"]]
        lp_b = [x[0] for x in mb["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-4)
        tops = [[[t[1] for t in row] for row in m.get("output_top_logprobs", [])] for m in (ma, mb)]
        assert tops[0] == tops[1]
    assert all(len(o["meta_info"]["output_top_logprobs"]) == 6 for o in got[:6])


def test_padded_extend_equals_the_ragged_extend_on_gpt_oss(tmp_path, monkeypatch):
    """gpt-oss: attention sinks, a window of 8 (shorter than most chunks), MoE experts that
    the padding tokens also route through."""
    tiny_gpt_oss.build(tmp_path)
    want, _, _ = _run(tmp_path, monkeypatch, False)
    got, calls, _ = _run(tmp_path, monkeypatch, True)
    assert calls
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]


def test_recurrent_state_models_keep_the_ragged_extend(tmp_path, monkeypatch):
    tiny_qwen3_next.build(tmp_path)
    monkeypatch.setenv("UNIMEM_EXTEND_GRAPHS", "on")
    eng = Engine(model_path=str(tmp_path), device="cpu", dtype="float32", page_size=4,
                 max_total_tokens=1024)  # fmt: skip
    assert eng.core.runner.extend_lanes == ()
    eng.shutdown()


@pytest.mark.parametrize("mode,padded", [("", False), ("auto", False), ("on", True)])
def test_auto_pads_extends_only_where_the_runner_records_graphs(gemma2_ckpt, monkeypatch,
                                                                 mode, padded):  # fmt: skip
    """The default (``auto``) pads short extends where the runner records CUDA graphs, so an
    eager (CPU) engine keeps the ragged extend; ``on`` forces the padded path."""
    monkeypatch.setenv("UNIMEM_EXTEND_GRAPHS", mode)
    eng = Engine(model_path=str(gemma2_ckpt), device="cpu", dtype="float32", page_size=4,
                 max_total_tokens=1024, max_running_requests=6, context_length=256)  # fmt: skip
    try:
        assert bool(eng.core.runner.extend_lanes) is padded
        assert not eng.core.runner.extend_graphs
    finally:
        eng.shutdown()
