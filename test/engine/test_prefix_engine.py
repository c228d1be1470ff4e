"""The prefix cache in the engine (float64 ``tiny`` preset, CPU): with a shared prompt prefix,
static and unified memory give identical outputs with the cache on, and identical to a run
with the cache off — with hits, under memory pressure (eviction, flushes, retraction) and
with DSPARK speculation; chunks end on anchor points; the cache's holds are consistent after
a run and everything is given back."""

from __future__ import annotations

import json

import pytest
import torch

from unimem.__main__ import main
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.cache import PrefixCache
from unimem.engine.core import EngineCore
from unimem.memory.checks import check_unified
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.validate.protocol import ValidateConfig, make_prompts, validate


def _cfg(**kw) -> ValidateConfig:
    base = dict(
        requests=6,
        input_len=60,
        output_len=24,
        shared_prefix_len=48,
        prefix_cache=True,
        max_running=4,
        chunk_size=32,
    )
    return ValidateConfig(**{**base, **kw})


def _assert_all_match(report: dict) -> None:
    n = report["requests"]
    assert report["exact_match"] == n, report["mismatches"]
    assert report["cache_off_matches"] == n, report["cache_off_mismatches"]


def test_cache_on_matches_cache_off_with_a_shared_prefix():
    report = validate(_cfg())
    _assert_all_match(report)
    for mode in ("static", "unified"):
        c = report[mode]["prefix_cache"]
        # the first max_running requests compute the prefix; the other two resume at it
        assert c["hit_requests"] == 2 and c["hit_tokens"] == 2 * 48 == c["cached_tokens"]
        assert c["checkpoints_saved"] > 0 and c["retained_swa_pages"] > 0
        assert 0 < c["hit_rate"] < 1
    assert report["cache_off"]["output_tokens"] == 6 * 24
    # resumed requests skip their prefix: fewer forward steps than without the cache
    assert report["static"]["steps"] < report["cache_off"]["steps"]


def test_cache_under_memory_pressure_evicts_and_stays_exact():
    report = validate(_cfg(arena_mb=1.4))
    _assert_all_match(report)
    u = report["unified"]
    c = u["prefix_cache"]
    assert c["evictions"] > 0 and c["flushes"] > 0
    assert u["retractions"] > 0 and u["compactions"] > 0
    assert report["static"]["prefix_cache"]["hit_tokens"] > 0


def test_cache_with_dspark_matches_the_non_speculative_reference():
    report = validate(_cfg(spec="dspark", gamma=7, arena_mb=1.6))
    _assert_all_match(report)
    n = report["requests"]
    assert report["spec_matches_reference"] == n, report["spec_mismatches"]
    assert report["verify_counts_match"] == report["accept_lengths_match"] == n
    assert report["static"]["prefix_cache"]["hit_tokens"] > 0
    assert report["unified"]["retractions"] > 0


def test_shared_prefix_prompts():
    cfg = ValidateConfig(requests=4, input_len=20, shared_prefix_len=12)
    prompts = make_prompts(cfg, 512)
    assert all(p[:12] == prompts[0][:12] for p in prompts)
    assert len({tuple(p[12:]) for p in prompts}) == 4
    # no shared prefix: the prompts of before
    assert make_prompts(ValidateConfig(requests=4, input_len=20), 512)[0] != prompts[0]
    with pytest.raises(ValueError, match="shared prefix length"):
        ValidateConfig(input_len=20, shared_prefix_len=21)
    with pytest.raises(ValueError, match="checkpoint interval"):
        ValidateConfig(checkpoint_interval=0)


@pytest.mark.parametrize("interval", [1, 2])
def test_engine_chunks_end_on_anchors_and_everything_is_given_back(interval):
    cfg = preset("tiny")
    model = HybridModel(cfg, seed=3)
    spec = memory_spec(cfg, 16)
    pool = UnifiedMemory(spec, 3 << 20, max_requests=3, max_context=cfg.max_context)
    cache = PrefixCache(pool, interval)
    eng = EngineCore(
        model, pool, TorchReferenceBackend(), max_running=3, chunk_size=40, cache=cache
    )
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, cfg.vocab_size, (64,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (9,), generator=g).tolist() for _ in range(5)]
    reqs = [eng.submit(p, 10) for p in prompts]
    anchor = 16 * interval
    while True:
        batch = eng.scheduler.next_batch(drain=eng.drain)
        if batch is None:
            break
        if batch.mode == "extend":
            for start, n in zip(batch.starts, batch.lens, strict=True):
                end = start + n
                # a chunk crossing an anchor point ends on the last one it crosses
                assert end // anchor == start // anchor or end % anchor == 0
        eng.scheduler.next_batch = lambda b=batch, **_: b  # replay the batch through step()
        eng.step()
        del eng.scheduler.next_batch
        cache.check()
    assert [r.cached_tokens for r in reqs] == [0, 0, 0, 64, 64]
    # the same outputs as static memory without a cache
    static = StaticMemory(spec, 30, 30, 3, max_requests=3, max_context=cfg.max_context)
    ref = EngineCore(model, static, TorchReferenceBackend(), max_running=3, chunk_size=40)
    for p in prompts:
        ref.submit(p, 10)
    assert {r.rid: r.output for r in ref.run()} == {r.rid: r.output for r in reqs}
    cache.flush()
    assert pool.used_bytes() == 0
    check_unified(pool)


def test_cli_prefix_cache_report(tmp_path):
    out = tmp_path / "r.json"
    args = ["validate", "--requests", "4", "--input-len", "40", "--output-len", "6"]
    args += ["--max-running", "2", "--prefix-cache", "on", "--shared-prefix-len", "32"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["cache_off_matches"] == report["exact_match"] == 4
    for mode in ("static", "unified"):
        stats = report[mode]["prefix_cache"]
        assert stats["hit_tokens"] == 2 * 32
        for key in ("evictions", "retained_swa_pages", "checkpoints", "hit_rate"):
            assert key in stats
    assert main(["validate", "--input-len", "20", "--shared-prefix-len", "30"]) == 2
