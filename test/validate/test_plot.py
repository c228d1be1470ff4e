"""``validate --plot``: the figure is written, and the per-step series it is drawn from agree
with the report (the largest per-step sum is the reported peak, one compaction / retraction
mark per reported compaction / retraction), with and without draft lanes."""

from __future__ import annotations

import json
import sys

import pytest

from unimem.__main__ import main
from unimem.validate.plot import memory_figure
from unimem.validate.protocol import StepSeries, ValidateConfig, validate

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_series(report: dict) -> None:
    for mode in ("static", "unified"):
        summary = report[mode]
        s = StepSeries(**report["series"][mode])
        used = s.used_bytes()
        assert s.steps == summary["steps"] == len(used) > 0
        assert max(used) == summary["peak_bytes"]
        # each kind's target and draft parts add up to its units' bytes
        for k in s.units:
            parts = zip(s.kind_bytes(k), s.kind_bytes(k, draft=True), s.units[k], strict=True)
            assert all(t + d == n * s.unit_bytes[k] for t, d, n in parts)
        assert all(u <= summary["capacity_bytes"] for u in used)
        assert sum(s.capacity.values()) == summary["capacity_bytes"]
        assert all(1 <= i <= s.steps for i in s.compaction_steps + s.retraction_steps)
        assert max(s.running) <= report["config"]["max_running"]
    static = StepSeries(**report["series"]["static"])
    for k, units in static.units.items():  # a static pool never holds more than its size
        assert max(units) * static.unit_bytes[k] <= static.capacity[k]
    assert static.compaction_steps == []
    u = report["unified"]
    unified = StepSeries(**report["series"]["unified"])
    assert len(unified.compaction_steps) == u["compactions"]
    assert len(unified.retraction_steps) == u["retractions"]
    assert unified.capacity == {"arena": u["capacity_bytes"]}


def test_validate_plot_on_a_small_arena(tmp_path, capsys):
    png, out = tmp_path / "memory.png", tmp_path / "report.json"
    args = ["validate", "--requests", "6", "--input-len", "40", "--output-len", "24"]
    args += ["--arena-mb", "1.1", "--max-running", "4", "--chunk-size", "32"]
    assert main([*args, "--plot", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    report = json.loads(out.read_text())
    _check_series(report)
    # the arena was small enough to compact and retract: the marks are there to draw
    assert report["unified"]["compactions"] > 0 and report["unified"]["retractions"] > 0
    assert "Traceback" not in capsys.readouterr().err


def test_series_with_draft_lanes(tmp_path):
    cfg = ValidateConfig(
        requests=3, input_len=12, output_len=7, spec="dspark", gamma=3, max_running=2
    )
    report = validate(cfg)
    _check_series(report)
    s = StepSeries(**report["series"]["unified"])
    assert any(s.draft_unit_bytes.values())  # the drafter's lanes are counted apart
    assert max(map(sum, zip(*(s.kind_bytes(k, True) for k in s.units), strict=True))) > 0
    memory_figure(report, str(tmp_path / "spec.svg"))
    assert (tmp_path / "spec.svg").read_text().lstrip().startswith("<?xml")


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("unimem.__main__.validate", _must_not_run)
    assert main(["validate", "--plot", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and "Traceback" not in err
    assert not (tmp_path / "m.png").exists()


def _must_not_run(*args, **kwargs):
    raise AssertionError("the run started")
