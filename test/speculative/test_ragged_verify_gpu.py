"""Ragged ("compact") verify on a real device: the adaptive verify step recorded as CUDA
graphs per batch bucket, with lengths changing every step.

- graph replay == eager: the same requests through replayed ragged verify graphs and through
  eager steps, the lengths forced on the device to change every step
  (``ModelRunner.verify_lens_override``, rewritten in place before each step: the host
  plans nothing), token-identical outputs and verified rows;
- the engine loop with adaptive lengths (the confidence allocation under a binding budget),
  greedy and sampled lanes, runs under ``torch.cuda.set_sync_debug_mode("error")``, static
  and unified memory (compaction forced) token-identical.

Marked ``gpu``: skipped without CUDA and without FlashAttention-4. Not run yet (written
without device time); the CPU half is ``test_ragged_verify.py``.
"""

from __future__ import annotations

import pytest
import torch

from unimem.engine.core import EngineCore
from unimem.engine.cuda_graphs import StepGraphs
from unimem.engine.sampling import SamplingOptions
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import HybridConfig, memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter, draft_config_for

pytestmark = pytest.mark.gpu


def _fa4():
    pytest.importorskip("flash_attn.cute", reason="FA4 not installed")
    from unimem.attention.fa4_backend import FA4Backend

    return FA4Backend()


def _prompts(cfg: HybridConfig, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def test_ragged_graph_replay_equals_eager_with_lengths_changing_every_step():
    """Four equal requests in lockstep (every step has four lanes: the captured bucket 4
    needs no padding lanes, so both ways run the same kernel shapes); before every step the
    test rewrites the lanes' lengths on the device (a fresh random 1..gamma+1 each step)."""
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=2, device=dev)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
    gamma = 3
    prompts = _prompts(cfg, 4, 100)
    spec = memory_spec(cfg, 16, drafter.config.lanes())
    results = []
    for graphs in (False, True):
        chain = DsparkChain(drafter, gamma, verify_lengths="adaptive")
        pool = UnifiedMemory(spec, 64 << 20, 4, cfg.max_context, dev)
        eng = EngineCore(
            model, pool, _fa4(), 4, 512, chain=chain, cuda_graphs=graphs,
            graph_buckets=(4,) if graphs else None,
        )  # fmt: skip
        override = torch.ones(4, dtype=torch.int32, device=dev)
        eng.runner.verify_lens_override = override
        if graphs:  # record again: the graph must read the override buffer
            with torch.inference_mode():
                eng.runner.graphs = StepGraphs(
                    eng.runner._uniform_step, eng.runner.lanes.pad, (4,), dev
                )
        reqs = [eng.submit(p, 60) for p in prompts]
        g = torch.Generator().manual_seed(0)
        while True:
            lens = torch.randint(1, gamma + 2, (4,), generator=g, dtype=torch.int32)
            override.copy_(lens, non_blocking=True)
            if not eng.step():
                break
        results.append(
            ([r.output for r in reqs], [(r.verified_rows, r.verify_steps) for r in reqs])
        )
    assert results[0] == results[1]
    # the rewritten lengths took effect: fewer rows than gamma + 1 per verify step
    assert all(rows < (gamma + 1) * steps for rows, steps in results[0][1])


def _run(model, pool, prompts, output_len, chain, max_running, samplings):
    eng = EngineCore(model, pool, _fa4(), max_running, 256, chain=chain, cuda_graphs=True)
    reqs = [eng.submit(p, output_len, sampling=s) for p, s in zip(prompts, samplings, strict=True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return reqs, eng


def test_adaptive_step_loop_is_sync_free_and_static_equals_unified():
    """More than 200 engine steps of adaptive verify (confidence allocation under a budget of
    ``2 x bs`` rows, greedy and sampled lanes: both graph variants) under
    ``set_sync_debug_mode("error")``; an arena 10 % above the static peak forces compaction
    without retraction, so both runs have the same batches: token-identical outputs and
    verified rows."""
    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=1, device=dev)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
    prompts = _prompts(cfg, 12, 150)
    gamma, max_running, output_len = 3, 6, 240
    samplings = [
        None if i % 2 else SamplingOptions(temperature=0.8, top_p=0.9, seed=i) for i in range(12)
    ]
    refs = {i: p + p for i, p in enumerate(prompts)}

    def chain():
        control = AcceptanceControl(0.5, 0, refs, dev)
        return DsparkChain(
            drafter, gamma, control, verify_lengths="adaptive", verify_budget=2 * max_running
        )

    spec = memory_spec(cfg, 16, drafter.config.lanes())
    pages = max_running * -(-(150 + output_len + 2 * (gamma + 1)) // 16)
    static = StaticMemory(spec, pages, pages, max_running, max_running, cfg.max_context, dev)
    reqs_s, eng_s = _run(model, static, prompts, output_len, chain(), max_running, samplings)
    sinks = sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)
    arena = int(1.1 * static.stats.peak_bytes) + sinks
    unified = UnifiedMemory(spec, arena, max_running, cfg.max_context, dev)
    reqs_u, eng_u = _run(model, unified, prompts, output_len, chain(), max_running, samplings)
    assert eng_s.steps >= 200 and eng_u.steps >= 200
    assert unified.stats.compactions > 0 and eng_u.scheduler.retractions == 0
    assert [r.output for r in reqs_s] == [r.output for r in reqs_u]
    assert [r.verified_rows for r in reqs_s] == [r.verified_rows for r in reqs_u]
    assert eng_s.scheduler.verified_rows <= 2 * max_running * eng_s.scheduler.verify_batches
