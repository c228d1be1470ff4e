"""Ahead-of-time compile check of the Triton kernels for an H200 (sm_90), on a machine
without a GPU.

Without CUDA the tests run every kernel in the Triton interpreter (the root ``conftest.py``
sets ``TRITON_INTERPRET=1``), which accepts code the real compiler rejects. This test
compiles every launch variant the engine uses (``unimem_kernel.fused``, ``batch_invariant``
and ``gdn``; the arguments, constexprs and launch options recorded from the real launchers at
the ``small`` preset's sizes) with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, to a
cubin with Triton's bundled ``ptxas`` (to PTX without one). It also checks that the
signatures it compiles are the ones Triton's own JIT would specialise the launches to.

The work runs in ``tools/compile_check.py``, in a subprocess with ``TRITON_INTERPRET``
unset: under the interpreter ``@triton.jit`` returns interpreted functions, which cannot be
compiled, and ``TRITON_INTERPRET`` must be unset before ``triton`` is imported. Skipped (with
the reason) when the installed Triton cannot compile for CUDA here.
Register use and spills are not asserted (a performance matter, for the GPU benchmarks):
``python tools/compile_check.py`` prints them per variant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# A compile check for a GPU target, not kernel semantics (the fast tier runs every kernel in the
# interpreter): the slow tier, ``python3 -m pytest -q -m slow``.
pytestmark = pytest.mark.slow

_ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = _ROOT / "tools" / "compile_check.py"
_CANNOT_COMPILE = 77  # compile_check.py's exit status when this Triton cannot compile here


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compile_sm90") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(_ROOT / "python"), str(_ROOT / "sgl-kernel" / "python")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    jobs = max(1, min(4, os.cpu_count() or 1))
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT), "-j", str(jobs), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=_ROOT,
    )
    if proc.returncode == _CANNOT_COMPILE:
        pytest.skip(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no AOT")
    if not out.exists():
        pytest.fail(f"compile_check.py exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    data = json.loads(out.read_text())
    data["stdout"] = proc.stdout
    return data


def _failures(rows: list[dict], kernels: tuple[str, ...]) -> str:
    bad = [r for r in rows if r["kernel"] in kernels and not r["ok"]]
    return "\n\n".join(f"{r['name']} ({r['kernel']}):\n{r['error']}" for r in bad)


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(
            (
                "_add_rms_norm_kernel",
                "_gated_act_kernel",
                "_gdn_gates_kernel",
                "_gated_rms_norm_kernel",
                "_rope_qk_kernel",
                "_sigmoid_gate_kernel",
            ),
            id="fused",
        ),  # fmt: skip
        pytest.param(
            (
                "_bi_matmul_kernel",
                "_bi_grouped_kernel",
                "_bi_rms_norm_kernel",
                "_bi_log_softmax_kernel",
            ),
            id="batch_invariant",
        ),  # fmt: skip
        pytest.param(("_conv_kernel", "_conv_commit_kernel", "_rule_kernel"), id="gdn"),
        pytest.param(
            (
                "_store_kv_kernel",
                "_rope_store_kernel",
                "_norm_linear_kernel",
                "_markov_pick_kernel",
                "_moe_combine_kernel",
                "_count_kernel",
                "_scan_kernel",
                "_place_kernel",
                "_row_argmax_kernel",
                "_accept_kernel",
                "_fp8_gemv_kernel",
            ),
            id="model_ops",
        ),  # fmt: skip
    ],
)
def test_kernels_compile_for_sm90(report, kernels):
    rows = [r for r in report["rows"] if r["kernel"] in kernels]
    assert {r["kernel"] for r in rows} == set(kernels), "a kernel was never launched"
    msg = _failures(report["rows"], kernels)
    assert not msg, f"sm_90 compile failures (triton {report['triton']}):\n\n{msg}"


def _rule_variant_of(report, launch: str) -> str:
    """The name of the ``_rule_kernel`` variant the launch labelled ``launch`` compiled to."""
    rows = [r for r in report["rows"] if r["kernel"] == "_rule_kernel" and launch in r["launches"]]
    assert len(rows) == 1, f"{launch}: {[r['name'] for r in rows]}"
    return rows[0]["name"]


def test_gdn_rule_modes_all_compiled(report):
    # every launch of _rule_kernel the engine makes
    launches = {x for r in report["rows"] if r["kernel"] == "_rule_kernel" for x in r["launches"]}
    for mode in ("decode", "verify STORE_STATES", "verify record", "extend",
                 "extend batch_invariant", "replay commit"):  # fmt: skip
        assert any(mode in n for n in launches), f"no _rule_kernel launch for {mode}: {launches}"


@pytest.mark.parametrize(
    "group",
    [
        ("gdn_forward decode", "gdn_forward verify record", "gdn replay commit",
         "gdn replay commit all layers"),
        ("gdn_forward verify record Hk=8 H=16", "gdn replay commit Hk=8 H=16"),
        ("gdn_forward extend batch_invariant", "gdn_forward decode batch_invariant",
         "gdn_forward verify record batch_invariant", "gdn replay commit batch_invariant"),
    ],
    ids=["step", "step-grouped-heads", "batch-invariant"],
)  # fmt: skip
def test_gdn_step_kinds_share_one_rule_binary(report, group):
    """Decode, verify and the replay commit (and, batch-invariant, extend too) specialise to
    one ``_rule_kernel`` signature, hence one binary: the bitwise agreement of their states
    is by construction, not by the compiler's choices."""
    names = {launch: _rule_variant_of(report, launch) for launch in group}
    assert len(set(names.values())) == 1, names


def test_signatures_match_triton_jit(report):
    mismatched = [(r["name"], r["jit_mismatch"]) for r in report["rows"]
                  if r["jit_mismatch"] not in (None, "n/a")]  # fmt: skip
    assert not mismatched, mismatched


def test_gdn_step_rule_binary_keeps_its_registers(report):
    """The step kinds' ``_rule_kernel`` (decode, verify, the replay, all layers at once) stays
    free of large register spills: its state tile must live in registers. A layer-table
    offset of unknown divisibility once made it spill ~1.6 KB per thread and load scalars
    (3x slower on the H200); the kernel normally needs 56-112 bytes of stack, depending on
    the Triton version."""
    name = _rule_variant_of(report, "gdn_forward decode")
    row = next(r for r in report["rows"] if r["name"] == name)
    if "stack" not in row:
        pytest.skip("compiled to PTX only (no ptxas): no register report")
    assert row["stack"] <= 512, row
