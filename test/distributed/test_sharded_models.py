"""Tensor parallelism on the CPU (gloo, 2 processes, float64): every architecture's tiny
checkpoint and the synthetic ``tiny`` preset give at tp 2 exactly the greedy outputs of the
unsharded model, through static pools and through a unified arena small enough to compact,
with DSPARK chain speculation too; the ranks' allocator states agree after every step; each
rank holds only its slices; a rank whose state differs is caught.

One spawn for the module: every case runs in one SPMD call (:mod:`tp_checks`). The fast tier
runs a slice of the cases (:func:`_fast_cases`); the slow tier runs them all."""

from __future__ import annotations

import importlib

import pytest
import tiny_tokenizer
import tp_checks

from unimem.engine.distributed import run_ranks

ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma3"]


def _cases(paths: dict[str, str]) -> list[tuple[str, str, bool]]:
    """The synthetic preset through both memories (and DSPARK); every checkpoint in ``paths``
    through both memories, gpt-oss's with DSPARK too."""
    cases = [("synthetic", m, False) for m in ("static", "unified")]
    cases.append(("synthetic", "unified", True))
    for arch in ARCHS:
        if arch in paths:
            cases += [(paths[arch], m, False) for m in ("static", "unified")]
    if "gpt_oss" in paths:
        cases.append((paths["gpt_oss"], "unified", True))
    return cases


def _fast_cases(paths: dict[str, str]) -> list[tuple[str, str, bool]]:
    """The fast tier's slice of :func:`_cases`: the synthetic preset's cases, Qwen3-Next
    (grouped GDN key heads) through the unified arena and gpt-oss (MoE, sinks) with DSPARK."""
    synthetic = _cases({})
    return [
        *synthetic,
        (paths["qwen3_next"], "unified", False),
        (paths["gpt_oss"], "unified", True),
    ]


@pytest.fixture(
    scope="module",
    params=[pytest.param("fast"), pytest.param("every_case", marks=pytest.mark.slow)],
)
def runs(request, tmp_path_factory):
    fast = request.param == "fast"
    paths = {}
    for arch in ("qwen3_next", "gpt_oss") if fast else ARCHS:
        path = tmp_path_factory.mktemp(arch)
        hf = importlib.import_module(f"tiny_{arch}").build(path)
        tiny_tokenizer.save(path, hf.config.vocab_size)
        paths[arch] = str(path)
    cases = _fast_cases(paths) if fast else _cases(paths)
    tp2 = run_ranks(2, tp_checks.run_cases, cases)
    tp1 = tp_checks.run_cases(None, cases)
    return paths, cases, tp1, tp2


def _name(case) -> str:
    source, memory, dspark = case
    return f"{source.rsplit('/', 1)[-1]} {memory}{' dspark' if dspark else ''}"


def test_tp2_outputs_equal_tp1_static_and_unified(runs):
    _, cases, tp1, tp2 = runs
    for case in cases:
        assert tp2[case]["outputs"] == tp1[case]["outputs"], _name(case)
        assert all(len(o) == tp_checks.OUT for o in tp2[case]["outputs"]), _name(case)


def test_unified_runs_compact_on_every_rank(runs):
    _, cases, _, tp2 = runs
    for case in cases:
        if case[1] == "unified":
            # rank 0's count; the per-step agreement check held it equal on rank 1
            assert tp2[case]["compactions"] > 0, _name(case)


def test_each_rank_holds_its_slices(runs):
    _, _, _, tp2 = runs
    shapes = tp2["shapes"]  # the synthetic tiny preset: 4 q / 2 kv heads, 4 GDN heads
    assert shapes["embed"] == (256, 256)  # half of the 512-token vocabulary
    assert shapes["layers.0.mixer.qkv_proj"] == (2 * 64 + 64 + 32, 256)
    assert shapes["layers.0.mixer.o_proj"] == (256, 2 * 32)
    assert shapes["layers.1.mixer.A_log"] == (2,)
    assert shapes["layers.1.mixer.out_proj"] == (256, 2 * 48)
    assert shapes["layers.0.mlp.down"] == (256, 256)


def test_a_rank_whose_allocator_state_differs_is_caught(runs):
    message = runs[3]["disagreement"]
    assert message is not None and "host on rank 1" in message
