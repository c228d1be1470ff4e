"""Deterministic inference on the GPU (batch-invariant mode, FA4, CUDA graphs, bf16): one
request's tokens alone == among 47 others == after being retracted and re-admitted under
memory pressure, and speculative (DSPARK) == non-speculative; padded (recorded) extends
give the ragged extends' bits. Marked gpu."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unimem.engine.core import EngineCore
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models import batch_invariant
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for

pytestmark = pytest.mark.gpu

PAGE, PROMPT, OUT, GAMMA = 16, 120, 80, 3


def _fa4():
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend

    return FA4Backend()


@pytest.fixture(scope="module")
def setup():
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=11, device=dev)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, cfg.vocab_size, (48, PROMPT), generator=g).tolist()
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
    with batch_invariant.use_batch_invariant():
        yield cfg, dev, model, prompts, drafter


def _run(setup, idx, pool_kind, spec, arena_scale=None, max_running=48):
    cfg, dev, model, prompts, drafter = setup
    chain = DsparkChain(drafter, GAMMA) if spec else None
    lanes = drafter.config.lanes() if spec else ()
    mspec = memory_spec(cfg, PAGE, lanes)
    look = 2 * (GAMMA + 1) if spec else 1
    pages = max_running * -(-(PROMPT + OUT + look) // PAGE)
    static = StaticMemory(mspec, pages, pages, max_running, max_running, cfg.max_context, dev)
    pool = static
    if pool_kind == "unified":
        sinks = sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)
        arena = int(arena_scale * static.stats.capacity_bytes) + sinks
        pool = UnifiedMemory(mspec, arena, max_running, cfg.max_context, dev)
    eng = EngineCore(model, pool, _fa4(), max_running, 256, chain=chain, cuda_graphs=True)
    reqs = {i: eng.submit(prompts[i], OUT) for i in idx}
    eng.run()
    return {i: r.output for i, r in reqs.items()}, {i: r.retractions for i, r in reqs.items()}, eng


def test_alone_equals_batched_equals_retracted_and_spec_equals_decode(setup):
    everyone = list(range(48))
    alone, _, _ = _run(setup, [7], "static", spec=False, max_running=1)
    batched, _, _ = _run(setup, everyone, "static", spec=False)
    assert batched[7] == alone[7]
    # an arena of a third of the static bytes: requests are retracted and re-admitted
    pressed, retracted, eng = _run(setup, everyone, "unified", spec=False, arena_scale=0.33)
    assert eng.scheduler.retractions > 0 and any(retracted.values())
    assert pressed == batched
    # DSPARK verify (gamma + 1 rows per request) gives the decode path's tokens
    spec, _, _ = _run(setup, everyone, "static", spec=True)
    assert spec == batched
    spec_pressed, retracted, eng = _run(setup, everyone, "unified", spec=True, arena_scale=0.33)
    assert eng.scheduler.retractions > 0
    assert spec_pressed == batched


def test_padded_extends_give_the_ragged_extends_bits(monkeypatch):
    """Batch-invariant mode, a model without recurrent state (FULL + SWA), CUDA graphs: short
    extends padded to a bucket and replayed (``UNIMEM_EXTEND_GRAPHS=on``) give the ragged
    eager extends' tokens and log-probabilities bit for bit, eight requests admitted
    together and one alone. What ``auto`` needs before it may pad in deterministic mode: a
    request's extend lands in a bucket or not depending on who else is admitted."""
    cfg = dataclasses.replace(
        preset("gpu_test"),
        layer_pattern=("swa", "full", "swa", "full"),
        gdn_heads=0,
        gdn_head_dim_k=0,
        gdn_head_dim_v=0,
    )
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=11, device=dev)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(5, 30, (8,), generator=g).tolist()  # 8 x < 30 tokens: one bucket
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def run(mode: str, idx: list[int]) -> list[tuple[list[int], list[float]]]:
        monkeypatch.setenv("UNIMEM_EXTEND_GRAPHS", mode)
        mspec = memory_spec(cfg, PAGE, ())
        pages = 9 * -(-(30 + OUT) // PAGE)
        pool = StaticMemory(mspec, pages, pages, 9, 9, cfg.max_context, dev)
        eng = EngineCore(model, pool, _fa4(), 9, 256, cuda_graphs=True, logprobs=True)
        assert bool(eng.runner.extend_graphs) is (mode == "on")
        reqs = [eng.submit(prompts[i], OUT) for i in idx]
        eng.run()
        return [(list(r.output), list(r.output_logprobs)) for r in reqs]

    with batch_invariant.use_batch_invariant():
        ragged = run("off", list(range(8)))
        padded = run("on", list(range(8)))
        alone = run("on", [3])
    assert padded == ragged
    assert alone[0] == ragged[3]
