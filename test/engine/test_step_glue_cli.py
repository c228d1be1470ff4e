"""benchmark/step_glue.py on the CPU ``tiny`` preset: it lists the torch ops of one eager
verify step by call site, leaving out the kernels' own (``unimem_kernel``) and the CPU
attention backend's, and finds the step's known glue (the request-state gathers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark" / "step_glue.py"


@pytest.mark.slow  # a benchmark tool's run in a subprocess
def test_lists_the_glue_of_a_verify_step_by_site():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--requests", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "one eager verify step of 2 lanes" in lines[0]
    assert any("index_select" in ln and "engine/step_io.py" in ln for ln in lines)
    assert not any("unimem_kernel/" in ln.split("<")[0] for ln in lines[1:-1])
    assert not any("torch_backend.py" in ln for ln in lines)
    assert lines[-1].endswith("ops listed")
