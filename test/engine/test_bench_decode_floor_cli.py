"""``python -m unimem bench decode-floor``'s dry run on the CPU (a tiny Gemma 3 checkpoint,
waves of 1 and 2 requests): it runs static and unified, checks them token for token, writes
the issue's JSON schema and, with ``--host-top``, each memory kind's top host functions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test" / "models"))

import tiny_gemma3  # noqa: E402


def test_cpu_dry_run_writes_the_schema(tmp_path):
    ckpt = tmp_path / "gemma"
    tiny_gemma3.build(ckpt, num_hidden_layers=2,
                      layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8, 9], [11, 12, 13]]))
    out = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "unimem", "bench", "decode-floor", "--model-path", str(ckpt),
         "--device", "cpu", "--dtype", "float32", "--concurrency", "1,2", "--tokens", "3",
         "--page-size", "4",
         "--prompts", str(prompts), "--json", str(out), "--host-top", "5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {"model", "gpu", "commit", "rows"} <= set(data) and not data["errors"]
    assert [r["concurrency"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        for key in ("unimem_static_tok_s", "unimem_unified_tok_s", "llamacpp_engine_tok_s",
                    "llamacpp_server_tok_s", "kernels_per_layer", "gpu_ms_per_step",
                    "wall_ms_per_step"):  # fmt: skip
            assert key in r
        assert r["unimem_static_tok_s"] > 0 and r["static_equals_unified"]
        for mode in ("static", "unified"):  # --host-top: a profiled wave per memory kind
            top = r["host_top_functions"][mode]
            assert len(top) == 5 and all(f["own_us_per_step"] >= 0 for f in top)


def test_gap_profile_splits_launch_gaps_from_host_waits():
    """Overlapping kernels merge; gaps under the threshold are launch gaps inside a step,
    the others the GPU waiting for the host."""
    from unimem.bench.decode_floor import gap_profile

    # two steps of three kernels (1 us launch gaps, one overlap), 40 us apart
    spans = [(0, 10), (11, 20), (15, 18), (21, 30), (70, 80), (81, 90), (91, 100)]
    g = gap_profile(list(reversed(spans)), threshold_us=5.0)
    assert g["busy_us"] == (10 + 9 + 9) + (10 + 9 + 9)
    assert (g["short_gap_us"], g["short_gaps"]) == (4.0, 4)
    assert (g["long_gap_us"], g["long_gaps"]) == (40.0, 1)
    assert gap_profile([], 5.0)["busy_us"] == 0.0
