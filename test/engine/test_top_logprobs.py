"""Output tokens' top log-probabilities (``top_logprobs``; float64 ``tiny`` preset, CPU): for
plain decoding and for DSPARK verify steps (fixed and adaptive lengths), greedy and sampled,
each output token's top list is the dense oracle's ``k`` most likely tokens under the raw
distribution at its position, in order, and holds the token's own log-probability bit for
bit where the token is among them; requests beside them are unchanged; bad values are
refused before queuing."""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.engine.sampling import SamplingOptions
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=21)


def _engine(cfg, model, chain_kind: str | None, logprobs: bool = True, halves: bool = False):
    chain, lanes = None, ()
    if chain_kind is not None:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=2)
        kw = dict(verify_lengths="adaptive", verify_budget=8) if chain_kind == "adaptive" else {}
        chain, lanes = DsparkChain(drafter, 3, **kw), drafter.config.lanes()
    pool = UnifiedMemory(memory_spec(cfg, 16, lanes), 8 << 20, 3, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 3, 64, chain=chain, logprobs=logprobs)
    eng.runner.eager_halves = halves  # the split step a graph engine takes
    return eng


def _prompts(cfg, n, length):
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _check(model, req, k):
    (logits,) = model.reference_forward([torch.tensor(req.prompt + req.output)])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert len(req.output_top_logprobs) == len(req.output) > 0
    for j, (tok, lp, top) in enumerate(
        zip(req.output, req.output_logprobs, req.output_top_logprobs, strict=True)
    ):
        row = ref[len(req.prompt) - 1 + j]
        values, ids = torch.topk(row, k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
        for t, v in top:
            if t == tok:
                assert v == lp  # the token's own value, bit for bit


@pytest.mark.parametrize("chain_kind", [None, "fixed", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_output_top_logprobs_are_the_oracles(tiny, chain_kind, temperature, halves):
    cfg, model = tiny
    prompts = _prompts(cfg, 3, 20)
    sampling = SamplingOptions(temperature=temperature, seed=5) if temperature else None
    eng = _engine(cfg, model, chain_kind, halves=halves)
    reqs = [
        eng.submit(prompts[0], 9, sampling=sampling, top_logprobs=4),
        eng.submit(prompts[1], 9, sampling=sampling),
        eng.submit(prompts[2], 9, sampling=sampling, top_logprobs=1),
    ]
    eng.run()
    _check(model, reqs[0], 4)
    _check(model, reqs[2], 1)
    assert reqs[1].output_top_logprobs == []
    ref = _engine(cfg, model, chain_kind)
    plain = [ref.submit(p, 9, sampling=sampling) for p in prompts]
    ref.run()
    assert [r.output for r in reqs] == [r.output for r in plain]
    for a, b in zip(reqs, plain, strict=True):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-9)


def test_the_runner_looks_for_extras_only_while_a_request_has_some(tiny):
    """The engine clears ``ModelRunner.extras_live`` while no unfinished request has extras
    (the steps then skip looking for them), and sets it while one does."""
    cfg, model = tiny
    eng = _engine(cfg, model, None)
    assert not eng.runner.extras_live
    plain = eng.submit(list(range(1, 9)), 3)
    assert not eng.runner.extras_live
    scored = eng.submit(list(range(1, 9)), 3, top_logprobs=2)
    assert eng.runner.extras_live
    eng.run()
    eng.step()  # nothing left: the next step prunes the finished requests
    assert not eng.runner.extras_live
    assert len(scored.output_top_logprobs) == 3 and plain.output_top_logprobs == []


@pytest.mark.parametrize(
    ("value", "logprobs", "message"),
    [(21, True, "must be in"), (-1, True, "must be in"), (True, True, "must be an int"),
     (2, False, "needs an engine built with logprobs")],
)  # fmt: skip
def test_bad_top_logprobs_are_refused_before_queuing(tiny, value, logprobs, message):
    cfg, model = tiny
    eng = _engine(cfg, model, None, logprobs=logprobs)
    with pytest.raises(ValueError, match=message):
        eng.submit(list(range(5)), 2, top_logprobs=value)
    assert eng.scheduler.idle
