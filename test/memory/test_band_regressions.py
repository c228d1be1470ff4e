"""Regressions of issue 48, and failure isolation of the allocator.

- A 3-kind arena whose FULL and SWA units differ in size: an empty SWA band re-anchored in a
  gap narrower than one SWA unit used to land above the gap and extend down over FULL (an
  ``AssertionError`` and a leaked request row; under ``python -O`` FULL and SWA units of one
  request sharing bytes). Both sequences now return None (the request cannot fit) and leave
  the pool as it was — also under ``python -O`` (run in a subprocess).
- ``admit_many`` used to bind other physical units, and compact where admits one by one did
  not: it now leaves the pool bit-identical to those admits.
- An internal error anywhere in planning leaves nothing behind (rows, ids, holder counts) and
  is raised as :class:`~unimem.memory.errors.InternalError` with the band table.

The sequences live in ``band_cases`` (plain functions that raise ``AssertionError``
explicitly, never ``assert``): they also run under ``python -O``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from band_cases import case_band_overlap, case_prefix_cache_sequence
from pool_state import changed, pool_snapshot
from specs import SPECS, T, geometry

from unimem.cache import PrefixCache
from unimem.memory.band_plan import BandLayout, BandState, Side
from unimem.memory.checks import check_unified
from unimem.memory.errors import InternalError
from unimem.memory.unified import UnifiedMemory

HERE = Path(__file__).resolve().parent


def test_band_overlap_is_out_of_memory_not_corruption():
    case_band_overlap()


def test_prefix_cache_sequence_is_out_of_memory_not_corruption():
    case_prefix_cache_sequence()


def test_both_cases_under_python_O():
    """The same sequences with assertions compiled out (``python -O``)."""
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "import band_cases as t\n"
        "assert False, 'not run under -O'\n"
        "t.case_band_overlap(); t.case_prefix_cache_sequence(); print('ok')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *sys.path])
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --- admit_many ----------------------------------------------------------------------------------


def _admit_many_equals_one_by_one(spec, arena, counts):
    one = UnifiedMemory(spec, arena, max_requests=4, max_context=64, poison=True)
    many = UnifiedMemory(spec, arena, max_requests=4, max_context=64, poison=True)
    singles = []
    for n in counts:
        r = one.admit(n)
        if r is None:
            break
        singles.append(r)
    batch = many.admit_many(counts)
    assert [vars(r) for r in batch] == [vars(r) for r in singles]
    assert not changed(pool_snapshot(one), pool_snapshot(many))
    return one, many


def test_admit_many_binds_the_units_admits_one_by_one_bind():
    """issue 48, case 1: the empty SWA band anchors after the first request's FULL pages."""
    _admit_many_equals_one_by_one(geometry("equal-p4"), 16384, [1, 5])


def test_admit_many_compacts_only_where_admits_one_by_one_do():
    """issue 48, case 2: one plan for the batch's total demand moved units; per-request
    plans do not."""
    one, many = _admit_many_equals_one_by_one(geometry("equal-p4"), 5694, [8, 8])
    assert many.stats.compactions == one.stats.compactions == 0


def test_admit_many_stops_where_admits_one_by_one_stop():
    one, many = _admit_many_equals_one_by_one(geometry("unequal-p1"), 4000, [2, 2, 2, 2])
    assert 0 < len(many._live) < 4


# --- the planner's own check ---------------------------------------------------------------------


def test_plan_check_raises_internal_error_with_the_band_table():
    lay = BandLayout(
        [BandState("swa", 256, 0, 2, 6, 1), BandState("full", 336, 0, 3, 5, 0)], 256, 4096
    )
    with pytest.raises(InternalError, match=r"(?s)full overlaps the band below it\n.*swa: units"):
        lay.check()


def test_anchor_of_an_empty_middle_band_respects_both_limits():
    """A gap narrower than one unit and off the band's grid: the empty band sits at the first
    grid point above the gap and has no room until its upper neighbour moves."""
    state = BandState("state", 400, 192, 0, 4, 0)  # bytes [192, 1792)
    swa = BandState("swa", 256, 0, 0, 0, 0)
    full = BandState("full", 336, 0, 6, 10, 0)  # bytes [2016, 3360)
    lay = BandLayout([state, swa, full], 192, 3440)
    at = lay._anchor_for(1)
    assert 256 * at >= 1792
    swa.lo = swa.hi = at
    assert lay.room(1, Side.UP) == lay.room(1, Side.DOWN) == 0
    # A gap with grid points: the anchor lies inside it, nearest the middle.
    full.lo, full.hi = 8, 10  # bytes [2688, 3360): gap [1792, 2688)
    swa.lo = swa.hi = 0
    at = lay._anchor_for(1)
    assert 1792 <= 256 * at <= 2688


def test_a_plan_from_free_units_is_empty_and_copies_nothing(monkeypatch):
    """Demands the bands' free units cover plan to no action without the layout's copy (the
    common case of every allocation once the bands have grown); one unit more, and the full
    planner runs (on its copy) and extends."""
    state = BandState("state", 400, 192, 0, 4, 3)
    full = BandState("full", 336, 0, 6, 10, 2)
    lay = BandLayout([state, full], 192, 8192)
    copies = []
    real = BandLayout.copy
    monkeypatch.setattr(BandLayout, "copy", lambda self: copies.append(1) or real(self))
    assert lay.plan([(0, 3), (1, 1), (1, 1)]) == []
    assert not copies
    plan = lay.plan([(1, 3)])
    assert copies and plan and plan[-1].band == 1  # the full band extends (after a move)
    assert (full.lo, full.hi, full.free) == (6, 10, 2)  # planned on the copy


# --- failure isolation ---------------------------------------------------------------------------


def _broken_plan(self, demands):
    raise InternalError("planted: the planner failed")


@pytest.mark.parametrize("name", ["full+swa+state", "unequal-p1", "full+swa"])
def test_an_internal_error_leaks_nothing(name, monkeypatch):
    """Every allocating call that meets an internal error raises it and leaves the pool (and
    the cache) exactly as it was: no row, id, unit or holder count is kept."""
    spec = geometry(name)
    m = UnifiedMemory(spec, 64 * 1024, max_requests=4, max_context=32, poison=True)
    cache = PrefixCache(m)
    r = m.admit(5)
    tokens = list(range(12))
    adm = cache.admit(tokens, 8)
    cache.insert(tokens[: 8 // spec.page_size * spec.page_size], adm.mem)
    before = pool_snapshot(m, cache)
    monkeypatch.setattr(BandLayout, "plan", _broken_plan)
    calls = [
        lambda: m.admit(30),
        lambda: m.admit_many([3, 30]),
        lambda: m.grow([(r, 30)]),
        lambda: cache.admit(tokens + [1] * 10, 20),
    ]
    if spec.has(T):
        calls.append(lambda: m.save_state(r.state_slot))
    for call in calls:
        with pytest.raises(InternalError, match="planted"):
            call()
        assert not changed(before, pool_snapshot(m, cache))
    monkeypatch.undo()
    cache.check()
    check_unified(m, [r, adm.mem])
    assert m.admit(3) is not None


def test_a_failed_admit_uses_no_generation():
    m = UnifiedMemory(SPECS["full+state"], 8192, max_requests=2, max_context=64)
    a = m.admit(4)
    assert m.admit(64) is None
    assert m.admit_many([64]) == []
    b = m.admit(4)
    assert b.generation == a.generation + 1
