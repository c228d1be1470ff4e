"""``tools/mutation_check.py`` stays runnable: its mutation list parses, names five distinct
bugs (kernel arithmetic, allocator bookkeeping, metadata translation, accept logic, the
scheduler), and every site is found exactly once in the current tree, so a refactor that moves
one fails here (no pytest run of the mutated copies: that is the tool's job)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "mutation_check", ROOT / "tools" / "mutation_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_every_mutation_site_is_found_exactly_once():
    tool = _tool()
    assert len(tool.MUTATIONS) == 5
    assert tool.site_errors() == []
    for m in tool.MUTATIONS:
        assert m.models and m.old != m.new


def test_a_moved_site_is_reported(tmp_path):
    tool = _tool()
    m = tool.MUTATIONS[0]
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text(m.old + "\n" + m.old)
    errors = tool.site_errors(tmp_path, (m,))
    assert errors == [f"{m.name}: the site occurs 2 times in {m.path} (must be once)"]
    (tmp_path / m.path).write_text("moved away")
    assert "occurs 0 times" in tool.site_errors(tmp_path, (m,))[0]
