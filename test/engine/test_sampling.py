"""Sampling on the device: temperature 0 is argmax bit for bit; a seeded request samples the
same tokens alone, in batches of any composition and after retraction; the empirical
distribution of a sample matches softmax(logits / T) restricted by top-k / top-p / min-p (and
a deliberately wrong filter fails the same check); bad options are rejected naming the field;
DSPARK takes temperature > 0 (its exactness: test/speculative/test_spec_sampling.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.api import SamplingParams
from unimem.engine.core import EngineCore
from unimem.engine.sampling import (
    SamplingOptions,
    default_seed,
    gumbel_noise,
    hash_uniform,
    sample,
    seed_to_int64,
)
from unimem.engine.step_io import DeviceSamplingState
from unimem.memory.unified import UnifiedMemory
from unimem.models import sampler as sampling_mod
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem_kernel import greedy_pick as gp
from unimem_kernel.sorted_cut import sorted_cut_reference


def _rows(n, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0):
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), float(top_p)),
        torch.full((n,), float(min_p)),
    )


# ------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingOptions(**kwargs)


def test_engine_sampling_params_pass_options_through_and_name_the_key():
    p = SamplingParams({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3})
    assert p.sampling == SamplingOptions(0.7, 0.9, 20, 0.05, 3)
    assert SamplingParams({}).sampling.greedy
    with pytest.raises(ValueError, match=r"sampling_params\.top_k must be an int"):
        SamplingParams({"top_k": 1.5})
    with pytest.raises(ValueError, match=r"sampling_params\.min_p must be in"):
        SamplingParams({"min_p": 2})


def test_seeds_are_int64_and_default_seeds_are_deterministic():
    assert seed_to_int64(2**64 + 5) == 5 and seed_to_int64(2**64 - 1) == -1
    assert default_seed(0, 1) == default_seed(0, 1)
    assert len({default_seed(s, r) for s in range(4) for r in range(50)}) == 200
    assert all(-(2**63) <= default_seed(7, r) < 2**63 for r in range(20))


# ------------------------------------------------------------------- the sampling function


def test_temperature_zero_is_argmax_bit_identical():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    logits[5, 17] = logits[5, 3] = logits[5].max() + 1  # a tie: argmax's own choice
    temperature = torch.where(torch.arange(64) % 2 == 0, 0.0, 0.8)
    _, top_k, top_p, min_p = _rows(64, top_k=5, top_p=0.5, min_p=0.1)
    seeds, positions = torch.arange(64), torch.arange(64) * 3
    out = sample(logits, temperature, top_k, top_p, min_p, seeds, positions)
    greedy = torch.argmax(logits, dim=-1)
    assert out.dtype == torch.int64 and out.shape == (64,)
    assert torch.equal(out[::2], greedy[::2])
    assert not torch.equal(out[1::2], greedy[1::2])  # the others sampled


def test_sampling_shapes_and_dtypes_are_fixed():
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    out = sample(
        logits, *_rows(3, 1.0, 4, 0.9, 0.0), torch.arange(3), torch.zeros(3, dtype=torch.int64)
    )
    assert out.shape == (3,) and out.dtype == torch.int64
    u = hash_uniform(torch.tensor([1, -1]), torch.tensor([0, 9]), 1000)
    assert u.shape == (2, 1000) and u.dtype == torch.float32
    assert u.min() > 0 and u.max() < 1
    assert torch.isfinite(gumbel_noise(torch.tensor([3]), torch.tensor([4]), 10_000)).all()


def test_noise_depends_only_on_seed_position_and_vocab_index():
    a = hash_uniform(torch.tensor([11, 12]), torch.tensor([5, 5]), 64)
    b = hash_uniform(torch.tensor([99, 11, 11]), torch.tensor([5, 5, 6]), 64)
    assert torch.equal(a[0], b[1])  # the same row wherever it sits in the batch
    assert not torch.equal(a[0], a[1]) and not torch.equal(b[1], b[2])
    assert torch.equal(hash_uniform(torch.tensor([11]), torch.tensor([5]), 32)[0], a[0, :32])


LOGITS = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.6, 0.1, -0.5, -1.5])
SEEDS = 4000


def _expected(logits, temperature, top_k, top_p, min_p):
    """softmax(logits / T) restricted by top-k, top-p (of the top-k renormalised mass) and
    min-p, by ranks in numpy."""
    p = np.exp(logits.double().numpy() / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    k = len(p) if top_k <= 0 else min(top_k, len(p))
    topk_mass = p[order[:k]].sum()
    mass = 0.0
    for rank, i in enumerate(order[:k]):
        if rank > 0 and (mass >= top_p * topk_mass or p[i] < min_p * p[order[0]]):
            break
        keep[i] = True
        mass += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _empirical(temperature, top_k, top_p, min_p, position=7):
    n = SEEDS
    logits = LOGITS.expand(n, -1).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    positions = torch.full((n,), position, dtype=torch.int64)
    out = sample(logits, *_rows(n, temperature, top_k, top_p, min_p), seeds, positions)
    return np.bincount(out.numpy(), minlength=len(LOGITS)) / n


TV_BOUND = 0.035  # about 2.5x the expected TV of 4000 draws over 8 outcomes

CONFIGS = [
    (1.0, -1, 1.0, 0.0),
    (0.5, -1, 1.0, 0.0),
    (2.0, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, -1, 0.7, 0.0),
    (1.3, 6, 0.8, 0.0),
    (1.0, -1, 1.0, 0.3),
    (0.8, 5, 0.9, 0.2),
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CONFIGS)
def test_empirical_distribution_matches_the_filtered_softmax(temperature, top_k, top_p, min_p):
    want = _expected(LOGITS, temperature, top_k, top_p, min_p)
    got = _empirical(temperature, top_k, top_p, min_p)
    assert np.all(got[want == 0] == 0)  # filtered tokens are never drawn
    assert 0.5 * np.abs(got - want).sum() < TV_BOUND, (got, want)


def _top_p_one_too_many(scaled, top_k, top_p, min_p, rule=sampling_mod.SORTED):
    """keep_threshold whose top-p keeps one more token than it should (a wrong filter)."""
    desc, _ = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(desc, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    kept = (before < top_p[:, None]).sum(dim=-1, keepdim=True)  # then one too many
    return desc.gather(1, kept.clamp(max=desc.shape[1] - 1))[:, 0]


def test_a_wrong_top_p_filter_fails_the_same_check(monkeypatch):
    config = (1.0, -1, 0.7, 0.0)
    want = _expected(LOGITS, *config)
    monkeypatch.setattr(sampling_mod, "keep_threshold", _top_p_one_too_many)
    got = _empirical(*config)
    assert 0.5 * np.abs(got - want).sum() > TV_BOUND


def test_different_positions_and_seeds_draw_differently():
    a = _empirical(1.0, -1, 1.0, 0.0, position=7)
    b = _empirical(1.0, -1, 1.0, 0.0, position=8)
    assert not np.array_equal(a, b)


# ------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=3)


def _prompts(cfg, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _engine(cfg, model, arena=8 << 20, max_running=4, chunk=64, **kw):
    pool = UnifiedMemory(memory_spec(cfg, 16), arena, max_running, cfg.max_context)
    return EngineCore(model, pool, TorchReferenceBackend(), max_running, chunk, **kw)


def _run(eng, jobs):
    """Submit ``(prompt, n, options)`` jobs and run; outputs in submission order."""
    reqs = [eng.submit(p, n, sampling=s) for p, n, s in jobs]
    eng.run()
    return [r.output for r in reqs]


HOT = SamplingOptions(temperature=1.5, top_p=0.95, top_k=40, seed=1234)


def _reference(model, prompt, n, options):
    """Autoregressive reference: full forward over the whole sequence every token, then
    :func:`sample` on the last logits with the request's seed at the token's position."""
    toks = list(prompt)
    seed = torch.tensor([seed_to_int64(options.seed)])
    params = _rows(1, options.temperature, options.top_k, options.top_p, options.min_p)
    for _ in range(n):
        logits = model.reference_forward([torch.tensor(toks)])[0][-1:]
        pos = torch.tensor([len(toks)])
        toks.append(int(sample(logits, *params, seed, pos)[0]))
    return toks[len(prompt) :]


def test_sampled_engine_output_equals_the_reference_sampler(tiny):
    cfg, model = tiny
    prompt = _prompts(cfg, 1, 30)[0]
    (out,) = _run(_engine(cfg, model), [(prompt, 16, HOT)])
    assert out == _reference(model, prompt, 16, HOT)
    assert out != _run(_engine(cfg, model), [(prompt, 16, None)])[0]


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(tiny):
    cfg, model = tiny
    prompts = _prompts(cfg, 6, 30, seed=1)
    target = (prompts[0], 20, HOT)
    alone = _run(_engine(cfg, model), [target])[0]
    others = [
        (prompts[i], 10 + i, SamplingOptions(temperature=0.7, seed=i) if i % 2 else None)
        for i in range(1, 6)
    ]
    batches = [
        (4, 64, [target, *others[:3]]),
        (4, 16, [*others[:2], target]),  # joins later, small chunks
        (2, 64, [others[3], target, others[4]]),
        (3, 32, [*others, target]),
    ]
    for max_running, chunk, jobs in batches:
        outs = _run(_engine(cfg, model, max_running=max_running, chunk=chunk), jobs)
        assert outs[jobs.index(target)] == alone


def test_a_seeded_request_samples_the_same_tokens_after_retraction(tiny):
    cfg, model = tiny
    prompts = _prompts(cfg, 6, 40, seed=2)
    jobs = [
        (p, 24, SamplingOptions(temperature=1.0, top_p=0.9, seed=50 + i))
        for i, p in enumerate(prompts)
    ]
    roomy = _run(_engine(cfg, model), jobs)
    eng = _engine(cfg, model, arena=int(1.1 * (1 << 20)), chunk=32)
    tight = _run(eng, jobs)
    assert eng.scheduler.retractions > 0
    assert tight == roomy


def test_different_seeds_differ_and_seedless_requests_are_reproducible(tiny):
    cfg, model = tiny
    prompt = _prompts(cfg, 1, 30, seed=3)[0]
    jobs = [(prompt, 16, SamplingOptions(temperature=1.0, seed=s)) for s in (1, 2, 3)]
    outs = _run(_engine(cfg, model), jobs)
    assert len({tuple(o) for o in outs}) == 3
    seedless = [(prompt, 16, SamplingOptions(temperature=1.0))] * 2
    first = _run(_engine(cfg, model, random_seed=5), seedless)
    assert first[0] != first[1]  # different rids, different seeds
    assert _run(_engine(cfg, model, random_seed=5), seedless) == first
    assert _run(_engine(cfg, model, random_seed=6), seedless) != first


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_token_logprobs_in_one_pass(monkeypatch, backend):
    """``token_logprobs`` of float32 rows (one pass: each row's argmax and its
    log-probability, then a difference of two logits) equals float64 ``log_softmax`` at any
    token — the argmax, a tie's first index, an unlikely token, a row with ``-inf`` — and is
    exactly the argmax's log-probability there; float64 rows keep their own precision."""
    from unimem.models.sampler import token_logprobs

    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", backend)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 300, generator=g) * 5
    logits[1, [10, 250]] = 40.0
    logits[3, :200] = -math.inf
    tokens = torch.tensor([int(logits[0].argmax()), 10, int(logits[2].argmin()), 299, 7])
    got = token_logprobs(logits, tokens)
    want = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5)
    top = logits.argmax(-1)
    assert torch.equal(got[:2], gp.greedy_logprob(logits)[1][:2])  # the argmax rows
    assert top[1] == 10
    got64 = token_logprobs(logits.double(), tokens)
    assert torch.equal(got64, want.float())


def test_logprobs_are_those_of_the_unfiltered_distribution(tiny):
    cfg, model = tiny
    prompt = _prompts(cfg, 1, 20, seed=4)[0]
    eng = _engine(cfg, model, logprobs=True)
    opts = SamplingOptions(temperature=2.0, top_k=3, seed=9)
    (req,) = [eng.submit(prompt, 6, sampling=opts)]
    eng.run()
    toks = list(prompt)
    for tok, lp in zip(req.output, req.output_logprobs, strict=True):
        logits = model.reference_forward([torch.tensor(toks)])[0][-1]
        assert lp == pytest.approx(float(torch.log_softmax(logits.double(), -1)[tok]), abs=1e-4)
        toks.append(tok)


def test_sampling_state_is_allocated_once_and_row_zero_stays_greedy(tiny):
    cfg, model = tiny
    eng = _engine(cfg, model)
    state = eng.runner.sampling
    ptrs = (state.floats.data_ptr(), state.ints.data_ptr())
    _run(eng, [(p, 8, HOT) for p in _prompts(cfg, 3, 20)])
    assert (state.floats.data_ptr(), state.ints.data_ptr()) == ptrs
    assert state.floats[:, 0].tolist() == [0.0, 1.0, 0.0] and state.ints[:, 0].tolist() == [0, 0]
    assert state.floats.dtype == torch.float32 and state.ints.dtype == torch.int64


def test_dspark_takes_temperature_above_zero(tiny):
    cfg, model = tiny
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=2)
    chain = DsparkChain(drafter, 3)
    pool = UnifiedMemory(memory_spec(cfg, 16, drafter.config.lanes()), 8 << 20, 2, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 2, 64, chain=chain)
    prompt = _prompts(cfg, 1, 20)[0]
    hot = eng.submit(prompt, 4, sampling=SamplingOptions(temperature=0.5))
    greedy = eng.submit(prompt, 4, sampling=SamplingOptions(temperature=0.0, top_k=3))
    eng.run()
    assert len(hot.output) == len(greedy.output) == 4


# ------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sampling_never_syncs_and_is_capturable():
    dev = torch.device("cuda")
    n, vocab = 8, 4096
    logits = torch.randn(n, vocab, device=dev)
    params = [t.to(dev) for t in _rows(n, 0.9, 50, 0.9, 0.05)]
    seeds = torch.arange(n, device=dev)
    positions = torch.arange(n, device=dev) + 10
    out = torch.empty(n, dtype=torch.int64, device=dev)
    out.copy_(sample(logits, *params, seeds, positions))  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out.copy_(sample(logits, *params, seeds, positions))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sample(logits, *params, seeds, positions))
    eager = sample(logits, *params, seeds, positions)
    graph.replay()
    assert torch.equal(out, eager)
    cpu = sample(logits.cpu(), *(t.cpu() for t in params), seeds.cpu(), positions.cpu())
    assert (cpu == eager.cpu()).float().mean() > 0.9  # log/exp may differ in the last ulp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_device_sampling_state_writes_without_sync():
    dev = torch.device("cuda")
    state = DeviceSamplingState(8, dev)
    rows_in = torch.tensor([2, 5], dtype=torch.int32, device=dev)
    rows_out = torch.tensor([5, 0], dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        floats, ints = state.upload([(0.5, 3, 0.9, 0.0, 7), (1.0, -1, 1.0, 0.1, -3)])
        state.write(rows_in, floats, ints)
        rows = state.read(rows_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.seeds.tolist() == [-3, 0] and rows.top_k.tolist() == [-1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sampled_cuda_graph_decode_is_sync_free_and_equals_eager():
    """Mixed greedy and sampled requests through CUDA-graph decode (the sampling variant)
    without a host sync; the same tokens as eager steps; greedy requests equal a greedy-only
    run (their lanes take the argmax in the sampling variant too). Four equal requests in
    lockstep and one bucket (4): the kernel shapes are the same in every run."""
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend
    from unimem.models.presets import preset

    FA4Backend()
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=1, device=dev)
    prompts = _prompts(cfg, 4, 100, seed=5)
    opts = [
        SamplingOptions(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=i) if i % 2 else None
        for i in range(4)
    ]

    def run(graphs: bool, which: list[SamplingOptions | None], sync_debug: bool):
        pool = UnifiedMemory(memory_spec(cfg, 16), 64 << 20, 4, cfg.max_context, dev)
        buckets = (4,) if graphs else None
        eng = EngineCore(
            model, pool, FA4Backend(), 4, 512, cuda_graphs=graphs, graph_buckets=buckets
        )
        reqs = [eng.submit(p, 60, sampling=s) for p, s in zip(prompts, which, strict=True)]
        torch.cuda.synchronize()
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            eng.run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [r.output for r in reqs]

    graphed = run(True, opts, sync_debug=True)  # every sampled lane bounded (top-k 50)
    assert graphed == run(False, opts, sync_debug=False)
    greedy = run(True, [None] * 4, sync_debug=False)
    assert [graphed[i] for i in (0, 2)] == [greedy[i] for i in (0, 2)]
    assert all(graphed[i] != greedy[i] for i in (1, 3))
    # one lane without top-k: the general variant (whole-row sort) runs; the bounded lane
    # draws the same tokens as in the bounded variant
    mixed = list(opts)
    mixed[3] = SamplingOptions(temperature=0.8, top_p=0.9, min_p=0.02, seed=3)
    graphed_mixed = run(True, mixed, sync_debug=True)
    assert graphed_mixed == run(False, mixed, sync_debug=False)
    assert graphed_mixed[1] == graphed[1]
    # sampled lanes without filters: the unfiltered variant (nothing sorted); beside a
    # filtered lane (the general variant) the same tokens
    free = [SamplingOptions(temperature=0.8, seed=i) if i % 2 else None for i in range(4)]
    graphed_free = run(True, free, sync_debug=True)
    assert graphed_free == run(False, free, sync_debug=False)
    free_mixed = list(free)
    free_mixed[3] = SamplingOptions(temperature=0.8, top_p=0.9, seed=3)
    assert run(True, free_mixed, sync_debug=False)[1] == graphed_free[1]


def test_filters_in_row_chunks_equal_the_whole_batch(monkeypatch):
    """keep_threshold and filtered_probs work on chunks of rows (their temporaries stay
    bounded at any batch); the chunks change nothing, bit for bit."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 23, 97
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.rand(n, generator=g) + 0.1
    temperature[::5] = 0.0  # greedy rows among them
    top_k = torch.randint(-1, 40, (n,), generator=g, dtype=torch.int32)
    top_p = torch.rand(n, generator=g).clamp(min=0.05)
    top_p[::3] = 1.0
    min_p = torch.rand(n, generator=g) * 0.2
    scaled = logits / temperature.clamp(min=0.1)[:, None]
    whole_cut = sampling_mod.keep_threshold(scaled, top_k, top_p, min_p)
    whole_p = sampling_mod.filtered_probs(logits, temperature, top_k, top_p, min_p)
    monkeypatch.setattr(sampling_mod, "THRESHOLD_CHUNK_ELEMENTS", 4 * vocab)  # chunks of 4 rows
    assert len(sampling_mod._row_chunks(n, vocab)) == 6
    assert torch.equal(sampling_mod.keep_threshold(scaled, top_k, top_p, min_p), whole_cut)
    chunked_p = sampling_mod.filtered_probs(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(chunked_p, whole_p)
    assert torch.allclose(chunked_p.sum(-1), torch.ones(n))


BOUNDED_CONFIGS = [c for c in CONFIGS if 0 < c[1] <= 6]


@pytest.mark.parametrize("bounded_only", [False, True], ids=["mixed_batch", "bounded_batch"])
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", BOUNDED_CONFIGS)
def test_bounded_top_k_rows_sample_the_filtered_softmax(
    monkeypatch, temperature, top_k, top_p, min_p, bounded_only
):
    """A row with 0 < top_k <= TOP_K_BOUND is cut among its TOP_K_BOUND largest logits (the
    bound lowered to 6 of the 8 tokens here): the same filtered softmax, in a batch of any
    kind."""
    monkeypatch.setattr(sampling_mod, "TOP_K_BOUND", 6)
    want = _expected(LOGITS, temperature, top_k, top_p, min_p)
    n = SEEDS
    logits = LOGITS.expand(n, -1).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    positions = torch.full((n,), 7, dtype=torch.int64)
    rows = _rows(n, temperature, top_k, top_p, min_p)
    rule = sampling_mod.BOUNDED if bounded_only else sampling_mod.SORTED
    out = sample(logits, *rows, seeds, positions, rule)
    got = np.bincount(out.numpy(), minlength=len(LOGITS)) / n
    assert np.all(got[want == 0] == 0)
    assert 0.5 * np.abs(got - want).sum() < TV_BOUND, (got, want)


def _same_as_in_a_mixed_batch(args, seeds, positions, rows, rule):
    """The probabilities and tokens of ``rows`` (a mask) in a batch promised ``rule`` equal
    theirs in the whole mixed batch (the SORTED rule); returns the promised batch's
    probabilities."""
    mixed_p = sampling_mod.filtered_probs(*args)
    mixed_tok = sample(*args, seeds, positions)
    sub = [t[rows] for t in args]
    only_p = sampling_mod.filtered_probs(*sub, rule=rule)
    only_tok = sample(*sub, seeds[rows], positions[rows], rule=rule)
    assert torch.equal(mixed_p[rows], only_p)
    assert torch.equal(mixed_tok[rows], only_tok)
    return only_p


def test_a_bounded_row_draws_the_same_in_any_batch(monkeypatch):
    """Which cut-off rule a row takes depends on its own top-k only: bounded rows give the
    same cut-offs, probabilities and tokens beside unbounded rows (the whole-row sort runs)
    and in a batch promised bounded (it does not); unbounded rows keep the whole-row rule."""
    monkeypatch.setattr(sampling_mod, "TOP_K_BOUND", 16)
    g = torch.Generator().manual_seed(3)
    n, vocab = 12, 97
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.rand(n, generator=g) + 0.3
    top_k = torch.randint(1, 17, (n,), generator=g, dtype=torch.int32)
    top_k[1::3] = -1  # unbounded rows in the mixed batch
    top_p = torch.rand(n, generator=g).clamp(min=0.3)
    min_p = torch.rand(n, generator=g) * 0.1
    seeds = torch.arange(n, dtype=torch.int64) + 5
    positions = torch.arange(n, dtype=torch.int64) + 9
    bounded = top_k > 0
    args = (logits, temperature, top_k, top_p, min_p)
    _same_as_in_a_mixed_batch(args, seeds, positions, bounded, sampling_mod.BOUNDED)
    # the unbounded rows: exactly the whole-row rule
    scaled = logits / temperature[:, None]
    desc, _ = torch.sort(scaled, dim=-1, descending=True, stable=True)
    full = sorted_cut_reference(desc, top_k, top_p, min_p)
    cut = sampling_mod.keep_threshold(scaled, top_k, top_p, min_p)
    assert torch.equal(cut[~bounded], full[~bounded])
    # and the two rules agree on these rows' cut-offs where both apply
    assert torch.equal(cut[bounded], full[bounded])


def test_bounded_cut_offs_read_the_leading_values_by_chunk_maxima(monkeypatch):
    """Over a vocabulary long enough for the select by chunk maxima
    (:func:`unimem_kernel.top_values.top_values`, the bound lowered to 8 so 1 031 tokens are
    64 of it and more), a bounded batch's cut-offs equal those from ``torch.topk`` over the
    whole row (``UNIMEM_TOP_VALUES=topk``), those with the maxima from torch's ``amax``
    (``amax``) and the whole-row sorted rule's, ties and masked tokens included; the default
    takes the maxima from the Triton kernel (the interpreter here)."""
    from unimem_kernel.top_values import default_chunk

    monkeypatch.setattr(sampling_mod, "TOP_K_BOUND", 8)
    g = torch.Generator().manual_seed(29)
    n, vocab = 10, 1031
    assert default_chunk(vocab, 8) > 1
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[2] = torch.randint(-2, 3, (vocab,), generator=g).float()  # ties at the cut
    logits[4, ::3] = -math.inf
    temperature = torch.rand(n, generator=g) + 0.3
    top_k = torch.randint(1, 9, (n,), generator=g, dtype=torch.int32)
    top_p = torch.rand(n, generator=g).clamp(min=0.3)
    min_p = torch.rand(n, generator=g) * 0.05
    args = (logits, temperature, top_k, top_p, min_p)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    chunked = sampling_mod.tempered_keep_threshold(*args, sampling_mod.BOUNDED)
    monkeypatch.setenv("UNIMEM_TOP_VALUES", "topk")
    whole = sampling_mod.tempered_keep_threshold(*args, sampling_mod.BOUNDED)
    assert torch.equal(chunked, whole)
    # the chunk maxima from torch's amax give the same cut-offs
    monkeypatch.setenv("UNIMEM_TOP_VALUES", "amax")
    assert torch.equal(sampling_mod.tempered_keep_threshold(*args, sampling_mod.BOUNDED), whole)
    scaled = logits / temperature[:, None]
    desc, _ = torch.sort(scaled, dim=-1, descending=True, stable=True)
    assert torch.equal(chunked, sorted_cut_reference(desc, top_k, top_p, min_p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tempered_cut_off_needs_no_tempered_copy(dtype):
    """tempered_keep_threshold(logits, t) is keep_threshold(logits / t) value for value under
    every rule: the leading values found among the logits and divided afterwards are the
    tempered row's (a vocabulary past TOP_K_BOUND, bounded and whole-row rows, a greedy row,
    masked tokens, bf16 logits divided in float32 as the sampler divides them)."""
    g = torch.Generator().manual_seed(17)
    n, vocab = 9, sampling_mod.TOP_K_BOUND * 2 + 37
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    logits[3, ::5] = -math.inf
    temperature = torch.rand(n, generator=g) + 0.3
    temperature[5] = 0.0
    top_k = torch.randint(1, 300, (n,), generator=g, dtype=torch.int32)
    top_k[::4] = -1
    top_p = torch.rand(n, generator=g).clamp(min=0.3)
    min_p = torch.rand(n, generator=g) * 0.05
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    for rule in sampling_mod.CUT_RULES:
        want = sampling_mod.keep_threshold(scaled, top_k, top_p, min_p, rule)
        got = sampling_mod.tempered_keep_threshold(logits, temperature, top_k, top_p, min_p, rule)
        assert got.dtype == torch.float32 and torch.equal(got, want), rule


def test_an_unfiltered_row_draws_the_same_in_any_batch():
    """Rows with no filter (top-k off, top-p 1, min-p 0) promised UNFILTERED sort nothing
    (cut-off -inf) and give bit for bit the probabilities and tokens the SORTED rule gives
    them beside filtered rows (there their cut-off is the row's smallest logit); logits with
    -inf entries (masked tokens) included; greedy rows stay argmax."""
    g = torch.Generator().manual_seed(8)
    n, vocab = 10, 97
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[2, ::7] = -math.inf
    temperature = torch.rand(n, generator=g) + 0.3
    temperature[4] = 0.0  # greedy
    top_k = torch.full((n,), -1, dtype=torch.int32)
    top_p = torch.ones(n)
    min_p = torch.zeros(n)
    top_k[1::3], top_p[2::4] = 9, 0.8  # filtered rows beside them in the mixed batch
    seeds = torch.arange(n, dtype=torch.int64) + 21
    positions = torch.arange(n, dtype=torch.int64) + 4
    args = (logits, temperature, top_k, top_p, min_p)
    free = (top_k <= 0) & (top_p >= 1)
    assert free.sum() >= 4 and (~free).sum() >= 3
    only_p = _same_as_in_a_mixed_batch(args, seeds, positions, free, sampling_mod.UNFILTERED)
    live = temperature[free] > 0
    scaled = logits[free] / temperature[free][:, None]
    assert torch.equal(only_p[live], torch.softmax(scaled[live], dim=-1))
    cut = sampling_mod.keep_threshold(scaled, *[t[free] for t in args[2:]],
                                      rule=sampling_mod.UNFILTERED)  # fmt: skip
    assert torch.equal(cut, torch.full_like(cut, -math.inf))
    with pytest.raises(ValueError, match="cut-off rule must be one of"):
        sampling_mod.keep_threshold(scaled, top_k[free], top_p[free], min_p[free], rule="none")


def test_cut_rule_promises():
    assert SamplingOptions().cut_rule is None  # greedy: any rule serves it
    assert SamplingOptions(temperature=0.7, top_k=64).cut_rule == sampling_mod.BOUNDED
    assert SamplingOptions(temperature=0.7, top_k=64, top_p=0.9).cut_rule == sampling_mod.BOUNDED
    assert SamplingOptions(temperature=0.7).cut_rule == sampling_mod.UNFILTERED
    assert SamplingOptions(temperature=0.7, top_p=0.9).cut_rule == sampling_mod.SORTED
    assert SamplingOptions(temperature=0.7, min_p=0.1).cut_rule == sampling_mod.SORTED
    big = sampling_mod.TOP_K_BOUND + 1
    assert SamplingOptions(temperature=0.7, top_k=big).cut_rule == sampling_mod.SORTED
    batch = sampling_mod.batch_cut_rule
    assert batch([None, sampling_mod.BOUNDED, sampling_mod.BOUNDED]) == sampling_mod.BOUNDED
    assert batch([sampling_mod.UNFILTERED, None]) == sampling_mod.UNFILTERED
    assert batch([sampling_mod.UNFILTERED, sampling_mod.BOUNDED]) == sampling_mod.SORTED
    assert batch([None, None]) == sampling_mod.SORTED


@pytest.mark.parametrize("rule", ["sorted", "bounded", "unfiltered"])
def test_filtered_token_probs_is_the_filtered_distribution_at_the_token(rule):
    """``filtered_token_probs`` (one normalising pass, no ``[N, V]`` result) equals the
    gather from ``filtered_probs`` to float32 rounding, for every cut-off rule, greedy rows
    (1 at their argmax, else 0) and tokens the filters cut (0); over a vocabulary larger
    than the bounded rule's window, and in chunks of rows."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 24, sampling_mod.TOP_K_BOUND + 44
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.rand(n, generator=g) + 0.3
    temperature[:4] = 0.0
    top_k = torch.randint(1, 40, (n,), generator=g, dtype=torch.int32)
    top_p = torch.rand(n, generator=g) * 0.6 + 0.4
    min_p = torch.rand(n, generator=g) * 0.05
    if rule == "unfiltered":
        top_k[:], top_p[:], min_p[:] = -1, 1.0, 0.0
    elif rule == "bounded":
        top_p[:], min_p[:] = 1.0, 0.0
    probs = sampling_mod.filtered_probs(logits, temperature, top_k, top_p, min_p, rule)
    for tokens in (
        torch.randint(0, vocab, (n,), generator=g),  # mostly cut by the filters
        torch.multinomial(probs, 1, generator=g)[:, 0],  # kept ones
        logits.argmax(-1),
    ):
        want = probs.gather(1, tokens[:, None])[:, 0]
        got = sampling_mod.filtered_token_probs(
            logits, temperature, top_k, top_p, min_p, tokens, rule
        )
        assert got.dtype == torch.float32 and got.shape == (n,)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9)
    chunked = sampling_mod.THRESHOLD_CHUNK_ELEMENTS, sampling_mod.BOUNDED_CHUNK_ELEMENTS
    try:  # a few rows per chunk (either rule's chunks): the same values
        sampling_mod.THRESHOLD_CHUNK_ELEMENTS = sampling_mod.BOUNDED_CHUNK_ELEMENTS = vocab * 5
        again = sampling_mod.filtered_token_probs(
            logits, temperature, top_k, top_p, min_p, tokens, rule
        )
        stats = sampling_mod.filtered_token_stats(
            logits, temperature, top_k, top_p, min_p, tokens, rule
        )
    finally:
        sampling_mod.THRESHOLD_CHUNK_ELEMENTS, sampling_mod.BOUNDED_CHUNK_ELEMENTS = chunked
    assert torch.equal(again, got)
    args = (logits, temperature, top_k, top_p, min_p, tokens, rule)
    whole = sampling_mod.filtered_token_stats(*args)
    for a, b in zip(stats, whole, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(whole[0], got, rtol=2e-6, atol=1e-9)
