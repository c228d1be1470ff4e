"""Prompt log-probabilities in the engine (float64 ``tiny`` preset: full, SWA and GDN layers;
CPU): each scored position equals the dense oracle's log-softmax of the row before it, with
the top tokens in order, across chunk boundaries, from a start position, past a warm prefix
cache (never resumed past the scored rows), and in the pieces a long prompt is scored in;
the outputs are the same as without scoring; bad options are refused before queuing."""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.cache import PrefixCache
from unimem.engine import prompt_logprobs
from unimem.engine.core import EngineCore
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=11)


def _engine(cfg, model, *, chunk=64, cache=False, running=3):
    pool = UnifiedMemory(memory_spec(cfg, 16), 4 << 20, running, cfg.max_context)
    pc = PrefixCache(pool, 1) if cache else None
    return EngineCore(model, pool, TorchReferenceBackend(), running, chunk, cache=pc, logprobs=True)


def _prompts(cfg, n, length, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _oracle(model, prompt):
    """``[L, vocab]`` log-softmax of every position's logits, from the dense oracle."""
    (logits,) = model.reference_forward([torch.tensor(prompt)])
    return torch.log_softmax(logits.double(), dim=-1)


def _check_against_oracle(model, req, start, k):
    ref = _oracle(model, req.prompt)
    first = max(start, 1)
    assert req.prompt_logprobs[:first] == [None] * first
    for j in range(first, len(req.prompt)):
        want = ref[j - 1]
        assert req.prompt_logprobs[j] == pytest.approx(float(want[req.prompt[j]]), abs=1e-9)
        if k:
            top = req.prompt_top_logprobs[j]
            values, ids = torch.topk(want, k)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-9)
            # the position's own value and the top list's come from one row: equal bits at
            # the argmax (what lm-eval's is_greedy compares)
            if top[0][0] == req.prompt[j]:
                assert top[0][1] == req.prompt_logprobs[j]


@pytest.mark.parametrize("chunk", [64, 16])
def test_prompt_logprobs_equal_the_oracle_across_chunks(tiny, chunk):
    cfg, model = tiny
    prompts = _prompts(cfg, 3, 40)
    eng = _engine(cfg, model, chunk=chunk)
    reqs = [
        eng.submit(prompts[0], 5, prompt_logprobs_from=0, prompt_top_logprobs=3),
        eng.submit(prompts[1], 5),  # beside them, not scoring
        eng.submit(prompts[2], 5, prompt_logprobs_from=17),
    ]
    eng.run()
    _check_against_oracle(model, reqs[0], 0, 3)
    _check_against_oracle(model, reqs[2], 17, 0)
    assert reqs[1].prompt_logprobs == [] and reqs[2].prompt_top_logprobs == []
    # scoring changes nothing of the outputs
    ref = _engine(cfg, model, chunk=chunk)
    plain = [ref.submit(p, 5) for p in prompts]
    ref.run()
    assert [r.output for r in reqs] == [r.output for r in plain]
    assert [r.output_logprobs for r in reqs] == [r.output_logprobs for r in plain]


def test_a_warm_prefix_cache_never_skips_scored_rows(tiny):
    cfg, model = tiny
    (prompt,) = _prompts(cfg, 1, 70, seed=8)
    eng = _engine(cfg, model, chunk=32, cache=True)
    warm = eng.submit(prompt, 3)
    eng.run()
    assert warm.cached_tokens == 0
    whole = eng.submit(prompt, 3, prompt_logprobs_from=0, prompt_top_logprobs=1)
    tail = eng.submit(prompt, 3, prompt_logprobs_from=50)
    again = eng.submit(prompt, 3)
    eng.run()
    assert whole.cached_tokens == 0  # every row scored: nothing resumed
    assert 0 < tail.cached_tokens <= 49  # resumed, but before the row scoring position 50
    assert again.cached_tokens > 49  # a request that scores nothing resumes as before
    _check_against_oracle(model, whole, 0, 1)
    _check_against_oracle(model, tail, 50, 0)
    assert whole.output == tail.output == again.output == warm.output


def test_a_long_prompt_is_scored_in_pieces(tiny, monkeypatch):
    cfg, model = tiny
    # 8 rows of the 512-token vocabulary a piece: 40 scored rows in 5 pieces
    monkeypatch.setattr(prompt_logprobs, "PIECE_BYTES", 8 * 4 * cfg.vocab_size)
    (prompt,) = _prompts(cfg, 1, 41, seed=9)
    eng = _engine(cfg, model)
    req = eng.submit(prompt, 2, prompt_logprobs_from=0, prompt_top_logprobs=2)
    eng.run()
    _check_against_oracle(model, req, 0, 2)


def test_score_rows_matches_one_pass(tiny, monkeypatch):
    cfg, model = tiny
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, cfg.d_model, generator=g, dtype=cfg.dtype)
    picks = torch.tensor([0, 3, 5, 6, 7, 11])
    targets = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    whole = prompt_logprobs.score_rows(model.head_logits, hidden, picks, targets, 4, cfg.vocab_size)
    monkeypatch.setattr(prompt_logprobs, "PIECE_BYTES", 4 * cfg.vocab_size)  # a row a piece
    pieces = prompt_logprobs.score_rows(
        model.head_logits, hidden, picks, targets, 4, cfg.vocab_size
    )
    logp = torch.log_softmax(model.head_logits(hidden[picks]), dim=-1)
    for values, ids in (whole, pieces):
        assert torch.allclose(values[:, 0], logp.gather(1, targets[:, None])[:, 0])
        assert torch.equal(ids, torch.topk(logp, 4).indices)
    # the same up to the head GEMM's rounding at another row count
    assert torch.allclose(whole[0], pieces[0], rtol=0, atol=1e-12)
    assert torch.equal(whole[1], pieces[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt_logprobs_from=-1), "outside the prompt's positions"),
        (dict(prompt_logprobs_from=11), "outside the prompt's positions"),
        (dict(prompt_logprobs_from=0, prompt_top_logprobs=21), "must be in"),
        (dict(prompt_top_logprobs=2), "needs prompt_logprobs_from"),
        (dict(prompt_logprobs_from=True), "must be an int"),
    ],
)
def test_bad_options_are_refused_before_queuing(tiny, kwargs, message):
    cfg, model = tiny
    eng = _engine(cfg, model)
    with pytest.raises(ValueError, match=message):
        eng.submit(list(range(10)), 2, **kwargs)
    assert eng.scheduler.idle


def test_the_whole_prompt_scored_from_its_end_gives_nothing(tiny):
    cfg, model = tiny
    eng = _engine(cfg, model)
    req = eng.submit(list(range(1, 9)), 2, prompt_logprobs_from=8)
    eng.run()
    assert req.prompt_logprobs == [None] * 8 and len(req.output) == 2
