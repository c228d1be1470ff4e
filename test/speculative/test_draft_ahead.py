"""Drafting ahead (``ModelRunner(draft_ahead=True)``, :data:`unimem.engine.runner.DRAFT_AHEAD`)
on CPU (float64 ``tiny`` preset, torch backend).

A greedy fixed verify step drafts its lanes' next block at its end; the next verify of the same
requests uses those drafts. The drafts must be exactly the ones that step would have made, so
every request's verify count, committed tokens per step and output equal a run that drafts at
the start of each step — with admissions mid-run (lanes whose drafts are missing), chunked
prefill, retraction under memory pressure and unified-memory compaction, sampled requests in
the batch (no drafting ahead in those steps), and a request at the context's edge (the block
drafted ahead by its last step stays inside its reserved pages).
"""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.engine.draft_runner import draft_config_for
from unimem.engine.sampling import SamplingOptions
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter

GAMMA = 4


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = HybridModel(cfg, seed=5)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=9)
    return cfg, model, drafter


def _prompts(cfg, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _run(model, drafter, pool, prompts, out_len, draft_ahead, *, late=(), sampled=(), steps=None):
    """Run ``prompts`` (those in ``late`` submitted after 6 steps; those in ``sampled`` with
    temperature 0.8) and return per request (output, verify steps, verified tokens), the
    engine, and how many verify steps started from drafts made ahead."""
    refs = {i: p + p for i, p in enumerate(prompts)}
    chain = DsparkChain(drafter, GAMMA, AcceptanceControl(0.7, 3, refs))
    eng = EngineCore(
        model, pool, TorchReferenceBackend(), 3, 24, chain=chain, draft_ahead=draft_ahead
    )
    drafted = [0]
    inner = eng.runner._drafted_step

    def counting(width):
        drafted[0] += 1
        inner(width)

    eng.runner._drafted_step = counting
    sample = SamplingOptions(temperature=0.8, seed=11)

    def submit(i):
        eng.submit(prompts[i], out_len, sampling=sample if i in sampled else None)

    for i in range(len(prompts)):
        if i not in late:
            submit(i)
    for _ in range(6):
        eng.step()
    for i in late:
        submit(i)
    eng.run()
    got = {r.rid: (r.output, r.verify_steps, r.verified_tokens) for r in eng.scheduler.finished}
    return got, eng, drafted[0]


@pytest.mark.parametrize("memory", ["static", "unified"])
def test_drafts_made_ahead_are_the_drafts_of_the_next_step(tiny, memory):
    cfg, model, drafter = tiny
    prompts = _prompts(cfg, 7, 30)
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())

    def pool():
        if memory == "static":
            return StaticMemory(spec, 256, 256, 3, 3, cfg.max_context)
        return UnifiedMemory(spec, 1 << 20, 3, cfg.max_context)  # tight: compaction

    kw = {"late": (4, 5, 6), "sampled": (2,)}
    base, _, none = _run(model, drafter, pool(), prompts, 20, False, **kw)
    ahead, eng, drafted = _run(model, drafter, pool(), prompts, 20, True, **kw)
    assert none == 0
    assert drafted > 0
    assert ahead == base
    assert all(len(out) == 20 for out, _, _ in ahead.values())
    if memory == "unified":
        assert eng.pool.stats.compactions > 0


def test_under_retraction(tiny):
    """An arena that forces retractions: a retracted request extends again before it verifies,
    so it never starts from drafts made before its retraction."""
    cfg, model, drafter = tiny
    prompts = _prompts(cfg, 6, 60, seed=1)
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())

    def pool():
        return UnifiedMemory(spec, 1200 << 10, 3, cfg.max_context)

    base, _, _ = _run(model, drafter, pool(), prompts, 30, False)
    ahead, eng, drafted = _run(model, drafter, pool(), prompts, 30, True)
    assert drafted > 0
    assert ahead == base
    assert eng.scheduler.retractions > 0


def test_at_the_context_edge(tiny):
    """The longest request the engine accepts when drafting ahead (one token longer is
    rejected): its last steps draft up to the end of its reserved row and it finishes as
    without drafting ahead."""
    cfg, model, drafter = tiny
    out_len = 12
    reach = GAMMA + (GAMMA + 1) + GAMMA  # write window, one step late, block drafted ahead
    edge = cfg.max_context - out_len + 1 - reach
    prompts = _prompts(cfg, 2, 20, seed=1)
    prompts.append(_prompts(cfg, 1, edge, seed=2)[0])
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())
    pages = 3 * -(-cfg.max_context // 16)

    def pool():
        return StaticMemory(spec, pages, pages, 3, 3, cfg.max_context)

    probe = EngineCore(
        model, pool(), TorchReferenceBackend(), 3, 24,
        chain=DsparkChain(drafter, GAMMA), draft_ahead=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="exceed the context"):
        probe.submit(prompts[2] + [1], out_len)
    base, _, _ = _run(model, drafter, pool(), prompts, out_len, False)
    ahead, _, drafted = _run(model, drafter, pool(), prompts, out_len, True)
    assert drafted > 0
    assert ahead == base


@pytest.mark.gpu
def test_gpu_graphs_drafting_ahead_match_drafting_in_the_step():
    """On the GPU with CUDA graphs (FA4, the ``gpu_test`` preset): the drafted-step graphs with
    the GDN commit on its own stream give every request the same outputs, verify counts and
    committed tokens as the graphs that draft first, in static and unified memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend

    dev = torch.device("cuda")
    cfg = preset("gpu_test")
    model = HybridModel(cfg, seed=1, device=dev)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
    prompts = _prompts(cfg, 10, 120, seed=4)
    refs = {i: p + p for i, p in enumerate(prompts)}
    spec = memory_spec(cfg, 16, drafter.config.lanes())
    results = {}
    for memory in ("static", "unified"):
        for ahead in (False, True):
            pages = 6 * -(-(120 + 80 + 4 * (GAMMA + 1)) // 16)
            pool = (
                StaticMemory(spec, pages, pages, 6, 6, cfg.max_context, dev)
                if memory == "static"
                else UnifiedMemory(spec, 64 << 20, 6, cfg.max_context, dev)
            )
            chain = DsparkChain(drafter, GAMMA, AcceptanceControl(0.6, 1, refs, dev))
            eng = EngineCore(
                model, pool, FA4Backend(), 6, 256, chain=chain, cuda_graphs=True,
                draft_ahead=ahead,
            )  # fmt: skip
            assert (eng.runner.drafted_graphs is not None) == ahead
            for p in prompts:
                eng.submit(p, 80)
            eng.run()
            results[memory, ahead] = {
                r.rid: (r.output, r.verify_steps, r.verified_tokens) for r in eng.scheduler.finished
            }
    first = results["static", False]
    assert len(first) == 10
    for key, got in results.items():
        assert got == first, key
