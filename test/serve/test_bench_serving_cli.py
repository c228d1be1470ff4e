"""``python -m unimem bench serving`` without a server: its command-line errors (one line,
exit 2) and the figure drawn from a run's JSON (--replot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unimem", "bench", "serving", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _level(c: int, tok_s: float) -> dict:
    return {
        "concurrency": c,
        "output_tok_s": tok_s,
        "ttft_p50_ms": 10.0 * c,
        "ttft_p99_ms": 20.0 * c,
        "itl_p50_ms": 3.0 + c / 16,
        "itl_p99_ms": 4.0 + c / 8,
        "requests_ok": 4 * c,
        "requests_failed": 0,
    }


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "--model-path is required"),
        (("--model-path", "/nonexistent"), "no config.json"),
        # one process each: the other messages are the slow tier
        pytest.param(
            ("--replot", "/nonexistent.json", "--plot", "/tmp/x.png"),
            "no such file",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("--replot", "/nonexistent.json"), "--replot needs --plot", marks=pytest.mark.slow
        ),
        pytest.param(
            ("--model-path", "x", "--concurrency", "0"), "concurrency", marks=pytest.mark.slow
        ),
    ],
)
def test_errors_are_one_line_and_exit_2(args, message):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_replot_draws_the_figure_from_a_runs_json(tmp_path):
    pytest.importorskip("matplotlib")
    levels = (1, 8, 32)
    run = {
        "args": {
            "model_path": "ckpt",
            "prompt_tokens": 256,
            "output_tokens": 128,
            "speculative_algorithm": "DSPARK",
            "speculative_draft_model_path": None,
            "max_total_tokens": 12288,
            "max_running_requests": 64,
        },
        "gpu": "Some GPU",
        "results": {
            mode: {"levels": [_level(c, f * 100 * c) for c in levels], "server": {}}
            for mode, f in (("static", 1.0), ("unified", 1.2))
        },
    }
    src = tmp_path / "run.json"
    src.write_text(json.dumps(run))
    png = tmp_path / "fig.png"
    r = _run("--replot", str(src), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _args(*argv: str):
    from unimem.bench import serving

    a = serving.build_parser().parse_args(["--model-path", "ckpt", *argv])
    return serving, a


def test_compare_speculation_runs_one_memory_kind_without_and_with_dspark():
    serving, a = _args("--compare", "speculation", "--speculative-draft-model-path", "/d")
    a.modes = ["unified"]  # what _check_args leaves (its default here)
    assert serving.runs(a) == [("none", "unified", False), ("dspark", "unified", True)]
    plain = serving.server_command(a, "unified", False, 5)
    spec = serving.server_command(a, "unified", True, 5)
    assert "--enable-unified-memory" in plain and "--speculative-algorithm" not in plain
    assert "--speculative-draft-model-path" not in plain
    assert spec[spec.index("--speculative-algorithm") + 1] == "DSPARK"
    assert spec[spec.index("--speculative-draft-model-path") + 1] == "/d"
    serving, a = _args("--modes", "static,unified")
    a.modes = ["static", "unified"]
    assert serving.runs(a) == [("static", "static", False), ("unified", "unified", False)]


def test_compare_speculation_refuses_two_memory_kinds():
    r = _run("--model-path", "x", "--compare", "speculation", "--modes", "static,unified")
    assert r.returncode == 2 and "runs one memory kind" in r.stderr, r.stderr


def test_short_prompts_are_the_packages_real_ones_cycled(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_tokenizer

    from unimem.data.prompts import short_prompts

    tiny_tokenizer.save(tmp_path, 64)
    serving, a = _args("--prompts", "short", "--output-tokens", "7")
    a.checkpoint_dir = str(tmp_path)
    out = tmp_path / "p.jsonl"
    texts = short_prompts()
    serving.write_prompts(a, out, len(texts) + 3)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == texts + texts[:3]
    assert all(r["output_tokens_count"] == 7 and r["prompt_tokens_count"] > 0 for r in rows)


def test_engine_time_per_iteration_in_milliseconds():
    from unimem.bench.serving import engine_time_per_iteration

    t = {"iterations": 200, "iteration_seconds": 0.5, "step_seconds": 0.4,
         "step_cpu_seconds": 0.1}  # fmt: skip
    got = engine_time_per_iteration(t)
    assert got["iterations"] == 200
    assert got["iteration_ms"] == pytest.approx(2.5) and got["step_ms"] == pytest.approx(2.0)
    assert got["step_cpu_ms"] == pytest.approx(0.5) and got["step_wait_ms"] == pytest.approx(1.5)
    assert engine_time_per_iteration(None) is None  # a server that reports none
    assert engine_time_per_iteration({**t, "iterations": 0}) is None
