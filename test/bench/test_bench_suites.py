"""``python -m unimem bench SUITE``: every registered suite is reachable and documented, the
default suite is still the end-to-end one, GPU-only suites end with one line and status 2 on
a machine without CUDA, and the CPU variants run (tiny sizes, a few seconds each)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch

from unimem.bench import DEFAULT_SUITE, SUITES


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unimem", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_suite_has_a_main_and_a_line_in_the_help():
    out = _bench("--help")
    assert out.returncode == 0, out.stderr
    for name, (module, text) in SUITES.items():
        assert f"  {name}" in out.stdout and text in out.stdout
        if module is not None:
            assert callable(importlib.import_module(f"unimem.bench.{module}").main)
    assert SUITES[DEFAULT_SUITE][0] is None  # e2e: the validation protocol's own parser


def test_the_default_suite_is_the_end_to_end_bench():
    """``bench FLAGS`` and ``bench e2e FLAGS`` reach the same parser and checks."""
    plain, named = _bench("--requests", "0"), _bench("e2e", "--requests", "0")
    assert plain.returncode == named.returncode == 2
    assert plain.stderr == named.stderr and "--requests" in plain.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
@pytest.mark.parametrize("suite", ["step-profile", pytest.param("prefill", marks=pytest.mark.slow)])
def test_gpu_only_suites_end_with_one_line_without_cuda(suite):
    out = _bench(suite)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and suite in lines[0], out.stderr


def test_step_profile_model_flags_are_checked_before_anything_runs():
    out = _bench("step-profile", "--drafter", "/nowhere")
    assert out.returncode == 2 and "need --model-path" in out.stderr, out.stderr
    out = _bench("step-profile", "--model-path", "gemma-3-270m", "--quantization", "fp8")
    assert out.returncode == 2 and "--model-path runs the Engine's own" in out.stderr, out.stderr
    # a plain decode step is --no-speculation, not gamma 0 (which failed deep in the Engine)
    out = _bench("step-profile", "--model-path", "gemma-3-270m", "--gamma", "0")
    assert out.returncode == 2 and "--gamma must be >= 1" in out.stderr, out.stderr
    assert "--no-speculation" in out.stderr
    # sampling flags: filters without a temperature, and values SamplingOptions refuses
    out = _bench("step-profile", "--top-k", "64")
    assert out.returncode == 2 and "need --temperature" in out.stderr, out.stderr
    out = _bench("step-profile", "--temperature", "0.7", "--top-p", "1.5")
    assert out.returncode == 2 and "top_p" in out.stderr, out.stderr


def test_step_profile_replays_the_sampled_graphs_of_the_requests_rule():
    """A sampled profile replays (and attributes) the step the engine runs for its requests:
    the sampled graphs of their cut-off rule, not the greedy ones."""
    from types import SimpleNamespace

    from unimem.bench.step_profile import sampling_options, step_graphs
    from unimem.models.sampler import BOUNDED, SORTED, UNFILTERED

    runner = SimpleNamespace(
        graphs="greedy", sample_graphs={r: r for r in (SORTED, BOUNDED, UNFILTERED)}
    )

    def args(t, k=-1, p=1.0):
        return SimpleNamespace(temperature=t, top_k=k, top_p=p)

    assert sampling_options(args(0.0)) is None
    assert step_graphs(runner, sampling_options(args(0.0))) == "greedy"
    assert step_graphs(runner, sampling_options(args(0.7))) == UNFILTERED
    assert step_graphs(runner, sampling_options(args(0.7, 64, 0.95))) == BOUNDED
    assert step_graphs(runner, sampling_options(args(0.7, -1, 0.9))) == SORTED
    assert sampling_options(args(0.7, 64)).seed == 0


def test_step_profile_host_only_runs_on_the_cpu(tmp_path):
    path = tmp_path / "host.json"
    out = _bench(
        "step-profile", "--host-only", "--requests", "2", "--steps", "4", "--warmup", "1",
        "--output-len", "128", "--no-profile", "--json", str(path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads(path.read_text())["runs"]
    assert [r["memory"] for r in runs] == ["static", "unified"]
    # the same host work over both memories: same tokens per step, same steps timed
    assert runs[0]["tokens_per_step"] == runs[1]["tokens_per_step"] > 0
    assert all(r["median_ms"] > 0 and r["steps"] == 4 for r in runs)


def test_prefix_suite_runs_four_identical_runs(tmp_path):
    path = tmp_path / "prefix.json"
    out = _bench(
        "prefix", "--requests", "3", "--shared-prefix-len", "32", "--unique-len", "8",
        "--output-len", "4", "--json", str(path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(path.read_text())
    assert report["identical_outputs"]
    cached = [r for r in report["runs"] if r["cache"] == "on"]
    assert len(report["runs"]) == 4 and len(cached) == 2


def test_allocator_suite_checks_its_logic_on_the_cpu(tmp_path):
    path = tmp_path / "alloc.json"
    out = _bench(
        "allocator", "--device", "cpu", "--bs", "1", "--reps", "1", "--warmup", "1",
        "--json", str(path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == {"admit", "retire", "compact", "alloc", "free", "move"}
    assert all(r["host_us"] > 0 for r in rows)


def test_sampler_suite_dry_run_checks_the_rule_per_row(tmp_path):
    path = tmp_path / "sampler.json"
    out = _bench("sampler", "--device", "cpu", "--json", str(path))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(path.read_text())
    assert report["rule_is_per_row"] and [r["rows"] for r in report["rows"]] == [1, 4]


@pytest.mark.parametrize("speculation", [False, True])
@pytest.mark.parametrize("kind", ["static", "unified"])
def test_step_profile_sizes_a_real_models_pool_for_its_requests(tmp_path, kind, speculation):
    """``step-profile --model-path`` sizes the pool so that a request of ``--input-len``
    prompt tokens and the measurement's output fits alone, whatever the input length: a
    sliding-window model's SWA pool holds less than ``max_total_tokens`` (at 24 tokens the
    real model's run was rejected: "1044 tokens do not fit in the memory even alone")."""
    import argparse
    from pathlib import Path

    from unimem.bench.step_profile import OUTPUT_LEN, model_engine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_gemma3

    # a window longer than the request: its SWA layers hold every token, as the real model's
    # (window 512, GPU chunk 8192) do at their peak
    tiny_gemma3.build(tmp_path, num_hidden_layers=2, max_position_embeddings=4096,
                      sliding_window=2048,
                      layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    args = argparse.Namespace(model_path=str(tmp_path), input_len=24, page_size=64, gamma=7,
                              requests=1, no_speculation=not speculation, drafter=None)  # fmt: skip
    engine = model_engine(kind, args, device="cpu")
    try:
        assert engine.core.max_request_tokens() >= args.input_len + OUTPUT_LEN
        engine.core.check_request(list(range(3, 3 + args.input_len)), OUTPUT_LEN)
    finally:
        engine.shutdown()


def test_step_profile_real_prompts_start_every_request_at_the_input_length():
    """``step-profile --model-path`` prompts: exactly ``--input-len`` tokens each, distinct,
    real text (a request that starts short grows to the steady state while faster ones finish:
    the profile of "48 requests" measured fewer)."""
    from unimem.bench.step_profile import real_prompts
    from unimem.data.prompts import short_prompts

    def encode(text):  # one id per word, a <bos> first: a tokenizer's shape
        return [2] + [hash(w) % 50_000 for w in text.split()]

    for length in (16, 512, 5000):
        prompts = real_prompts(encode, 6, length)
        assert [len(p) for p in prompts] == [length] * 6
        assert len({tuple(p) for p in prompts}) == 6
        assert all(p[0] == 2 and p.count(2) == 1 for p in prompts)  # encoded once
    texts = short_prompts()
    assert real_prompts(encode, 2, 40)[1] == encode("\n\n".join(texts[1:] + texts[:1]))[:40]
