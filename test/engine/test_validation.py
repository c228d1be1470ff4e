"""The validation protocol: static vs unified memory give token-identical greedy outputs,
also when the arena is small enough to force compaction and retraction; a deliberately
corrupted KV page is caught; bad requests are rejected without disturbing the others."""

from __future__ import annotations

import json

import pytest
import torch

from unimem.__main__ import main
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.validate.protocol import ValidateConfig, validate


@pytest.mark.parametrize(
    "page_size, input_len, arena_mb",
    [(1, 40, 1.0), (16, 40, 1.1), pytest.param(64, 60, 3.0, marks=pytest.mark.slow)],
)
def test_static_and_unified_match_under_pressure(page_size, input_len, arena_mb):
    cfg = ValidateConfig(
        requests=6,
        input_len=input_len,
        output_len=24,
        page_size=page_size,
        arena_mb=arena_mb,
        max_running=4,
        chunk_size=32,
    )
    report = validate(cfg)
    assert report["exact_match"] == report["requests"] == 6, report["mismatches"]
    assert report["unified"]["output_tokens"] == report["static"]["output_tokens"] == 6 * 24
    # The arena was small enough that the unified run had to move data and retract.
    assert report["unified"]["compactions"] > 0
    assert report["unified"]["retractions"] > 0


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=3)


def _prompts(cfg, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _static(cfg, page_size=16):
    spec = memory_spec(cfg, page_size)
    return StaticMemory(spec, 64, 64, 4, max_requests=4, max_context=cfg.max_context)


def _run(model, pool, prompts, output_len=12, corrupt_at=None):
    eng = EngineCore(model, pool, TorchReferenceBackend(), max_running=4, chunk_size=64)
    for p in prompts:
        eng.submit(p, output_len)
    while eng.step():
        if eng.steps == corrupt_at:
            req = eng.scheduler.running[0]
            vpage = req.mem.pages[0]
            phys = vpage if pool.full_v2p is None else int(pool.full_v2p[vpage])
            # A deterministic, wrong-but-finite page, as a misaddressed write would leave.
            _, v = pool.kv_cache(LayerKind.FULL, 0)
            v[phys].fill_(3.0)
    return {r.rid: r.output for r in eng.scheduler.finished}


def test_a_corrupted_kv_page_fails_the_comparison(tiny):
    cfg, model = tiny
    prompts = _prompts(cfg, 3, 40)
    spec = memory_spec(cfg, 16)
    clean = _run(model, _static(cfg), prompts)
    unified = UnifiedMemory(spec, 2 << 20, max_requests=4, max_context=cfg.max_context)
    assert _run(model, unified, prompts) == clean
    unified = UnifiedMemory(spec, 2 << 20, max_requests=4, max_context=cfg.max_context)
    corrupted = _run(model, unified, prompts, corrupt_at=3)
    assert corrupted != clean


def test_bad_requests_are_rejected_and_the_others_finish(tiny):
    cfg, model = tiny
    good = _prompts(cfg, 3, 30)
    clean = _run(model, _static(cfg), good)

    spec = memory_spec(cfg, 16)
    pool = UnifiedMemory(spec, 2 << 20, max_requests=4, max_context=cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), max_running=4, chunk_size=64)
    eng.submit(good[0], 12)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.submit([], 12)
    eng.submit(good[1], 12)
    with pytest.raises(ValueError, match="exceed the context"):
        eng.submit([1] * (cfg.max_context + 1), 4)
    with pytest.raises(ValueError, match="output length must be >= 1"):
        eng.submit(good[0], 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([cfg.vocab_size], 4)
    with pytest.raises(ValueError, match="do not fit in the memory even alone"):
        eng.submit([1] * 1500, 4)
    eng.submit(good[2], 12)
    eng.run()
    assert {r.rid: r.output for r in eng.scheduler.finished} == clean


def test_impossible_configurations_fail_at_start_up(capsys):
    assert main(["validate", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["validate", "--arena-mb", "0.1"]) == 2
    assert "too small" in capsys.readouterr().err


def test_main_command_writes_the_report(tmp_path):
    out = tmp_path / "report.json"
    args = ["validate", "--requests", "3", "--input-len", "20", "--output-len", "6"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == report["exact_match"] == 3
    for key in ("output_tokens", "throughput_tok_s", "peak_bytes"):
        assert key in report["static"] and key in report["unified"]
    assert {"compactions", "retractions"} <= set(report["unified"])
