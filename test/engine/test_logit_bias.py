"""Penalties, ``logit_bias`` and ``min_tokens`` in the engine (float64 ``tiny`` preset,
CPU): greedy outputs — plain decoding and DSPARK verify steps, fixed and adaptive lengths —
equal the dense oracle's greedy decoding of the adjusted logits, and so do their
log-probabilities; sampled requests never produce a token biased by -100 nor stop before
``min_tokens``; requests beside them are unchanged; bad values are refused before queuing."""

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
    return cfg, HybridModel(cfg, seed=31)


def _engine(cfg, model, chain_kind: str | None, halves: bool = False):
    chain, lanes = None, ()
    if chain_kind is not None:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=2)
        kw = dict(verify_lengths="adaptive", verify_budget=8) if chain_kind == "adaptive" else {}
        chain, lanes = DsparkChain(drafter, 3, **kw), drafter.config.lanes()
    pool = UnifiedMemory(memory_spec(cfg, 16, lanes), 8 << 20, 3, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 3, 64, chain=chain, logprobs=True)
    eng.runner.eager_halves = halves  # the split step a graph engine takes
    return eng


def _prompts(cfg, n, length):
    g = torch.Generator().manual_seed(6)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _oracle(model, prompt, n, bias=(), stops=frozenset(), min_tokens=0, penalties=None):
    """Greedy decoding of the dense oracle's adjusted logits: ``(tokens, logprobs)``, ending
    at a stop token (kept) or after ``n`` tokens. ``penalties``: (presence, frequency,
    repetition) as SGLang and vLLM define them."""
    toks, lps = list(prompt), []
    while len(toks) - len(prompt) < n:
        (logits,) = model.reference_forward([torch.tensor(toks)])
        row = logits[-1].double().clone()
        if penalties is not None:
            presence, frequency, repetition = penalties
            out = toks[len(prompt) :]
            for t in set(toks):
                row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
                c = out.count(t)
                row[t] -= frequency * c + presence * (c > 0)
        for t, b in bias:
            row[t] += b
        if len(toks) - len(prompt) < min_tokens:
            row[list(stops)] = float("-inf")
        t = int(row.argmax())
        lps.append(float(torch.log_softmax(row, -1)[t]))
        toks.append(t)
        if t in stops:
            break
    return toks[len(prompt) :], lps


@pytest.mark.parametrize("chain_kind", [None, "fixed", "adaptive"])
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_greedy_outputs_follow_the_adjusted_logits(tiny, chain_kind, halves):
    cfg, model = tiny
    prompts = _prompts(cfg, 3, 20)
    plain, _ = _oracle(model, prompts[0], 8)
    # favour a token the plain output never picks first, hard enough to win now and then
    bias = ((plain[0], -4.0), ((plain[0] + 1) % cfg.vocab_size, 3.0))
    # the plain output's third token stops the second request, unless min_tokens holds it
    stop = _oracle(model, prompts[1], 8)[0][2]
    eng = _engine(cfg, model, chain_kind, halves)
    a = eng.submit(prompts[0], 8, logit_bias=dict(bias))
    b = eng.submit(prompts[1], 8, stop_token_ids=[stop], min_tokens=6)
    c = eng.submit(prompts[2], 8)
    eng.run()
    want_a, lps_a = _oracle(model, prompts[0], 8, bias=bias)
    want_b, lps_b = _oracle(model, prompts[1], 8, stops={stop}, min_tokens=6)
    assert a.output == want_a and a.output != plain
    assert b.output == want_b and len(b.output) >= 6
    assert a.output_logprobs == pytest.approx(lps_a, abs=1e-6)  # float32 outputs
    assert b.output_logprobs == pytest.approx(lps_b, abs=1e-6)
    assert c.output == _oracle(model, prompts[2], 8)[0]


@pytest.mark.parametrize("chain_kind", [None, "fixed", "adaptive"])
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_greedy_outputs_follow_the_penalised_logits(tiny, chain_kind, halves):
    """Penalties that change the greedy output (the random model never repeats a token, so
    the changing ones reward repeats: a repetition penalty below 1, negative presence and
    frequency ones) and positive ones, with the verify step's drafts counted before each
    row and the step in flight's committed tokens (which the host has not read when it plans
    the next step) added on the device."""
    cfg, model = tiny
    prompts = _prompts(cfg, 3, 12)
    eng = _engine(cfg, model, chain_kind, halves)
    settings = [(0.0, 0.0, 0.5), (-2.0, -1.0, 1.0), (1.0, 0.5, 1.3)]
    reqs = []
    for p, pen in zip(prompts, settings, strict=True):
        kw = {}
        if pen is not None:
            kw = dict(presence_penalty=pen[0], frequency_penalty=pen[1], repetition_penalty=pen[2])
        reqs.append(eng.submit(p, 10, **kw))
    eng.run()
    for req, p, pen in zip(reqs, prompts, settings, strict=True):
        want, lps = _oracle(model, p, 10, penalties=pen)
        assert req.output == want
        assert req.output_logprobs == pytest.approx(lps, abs=1e-6)
    for p, pen in zip(prompts[:2], settings[:2], strict=True):
        assert _oracle(model, p, 10, penalties=pen)[0] != _oracle(model, p, 10)[0]


@pytest.mark.parametrize("chain_kind", [None, "fixed"])
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_sampled_requests_keep_their_adjustments(tiny, chain_kind, halves):
    cfg, model = tiny
    prompts = _prompts(cfg, 2, 16)
    sampling = SamplingOptions(temperature=1.0, seed=9)
    eng = _engine(cfg, model, chain_kind, halves)
    # the 40 most likely first tokens are forbidden; all but ten tokens stop the other
    # request, but not before its fifth token
    (logits,) = model.reference_forward([torch.tensor(prompts[0])])
    banned = torch.topk(logits[-1], 40).indices.tolist()
    a = eng.submit(prompts[0], 12, sampling=sampling, logit_bias={t: -100.0 for t in banned})
    stops = set(range(10, cfg.vocab_size))
    b = eng.submit(prompts[1], 12, sampling=sampling, stop_token_ids=stops, min_tokens=5)
    eng.run()
    assert a.output[0] not in banned and not set(a.output) & set(banned)
    assert all(t < 10 for t in b.output[:5])  # only the ten non-stops while suppressed
    assert len(b.output) == 6 and b.stopped  # then a stop token (nearly all are) ends it


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(logit_bias={5: 101.0}), r"must be a number in \[-100, 100\]"),
        (dict(logit_bias={10**6: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
        (dict(min_tokens=3), r"outside \[0, max_new_tokens 2\]"),
        (dict(min_tokens=-1), "outside"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 2\]"),
    ],
)
def test_bad_adjustments_are_refused_before_queuing(tiny, kwargs, message):
    cfg, model = tiny
    eng = _engine(cfg, model, None)
    with pytest.raises(ValueError, match=message):
        eng.submit(list(range(5)), 2, **kwargs)
    assert eng.scheduler.idle


def test_the_plan_names_each_penalised_lane_in_the_step_in_flight(tiny):
    """A penalised lane's row in the outputs of the step in flight (its committed tokens
    are added on the device): decode and verify lanes of the same epoch; an extend's lanes
    only where they sampled; -1 for a lane it does not hold, a request restarted since, or
    no step in flight."""
    from unimem.engine.adjustments import plan
    from unimem.engine.batch import Batch
    from unimem.models.forward_context import ForwardMode

    cfg, model = tiny
    eng = _engine(cfg, model, None)
    a, b, c, d = (eng.submit(p, 8, presence_penalty=0.5) for p in _prompts(cfg, 4, 6))
    decode = Batch(ForwardMode.DECODE, [d, a, b], [1, 1, 1], epochs=[0, 0, 0])
    assert plan([a, b, c], 4, decode).in_flight_lanes.tolist() == [1, 2, -1, -1]
    assert plan([a, b, c], 4).in_flight_lanes.tolist() == [-1] * 4
    b.epoch += 1  # retracted and restarted since the step in flight was launched
    assert plan([a, b], 2, decode).in_flight_lanes.tolist() == [1, -1]
    extend = Batch(ForwardMode.EXTEND, [a, c], [6, 6], [0, 0], [False, True], epochs=[0, 0])
    assert plan([a, c], 2, extend).in_flight_lanes.tolist() == [-1, 1]
