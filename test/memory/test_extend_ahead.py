"""A band extending into a wide gap takes ``extend_ahead`` units more than it needs, so that a
growing batch's next allocations find free units and skip the planner (and its device push);
near the end of a gap extensions are exact again; the arena's contents and outputs do not
depend on it (the pool checks and the engines' static == unified tests run with it on)."""

from __future__ import annotations

import pytest
from specs import geometry

from unimem.memory.band_plan import AHEAD_GAP_FACTOR, BandLayout, BandState, Extend, Side
from unimem.memory.checks import check_unified
from unimem.memory.unified import EXTEND_AHEAD_UNITS, UnifiedMemory


def _two_bands(ahead: int, arena_end: int) -> BandLayout:
    state = BandState("state", 400, 192, 0, 1, 0)  # bytes [192, 592)
    full = BandState("full", 256, 0, 40, 40, 0)  # empty, anchored at byte 10240
    return BandLayout([state, full], 192, arena_end, extend_ahead=ahead)


def test_a_wide_gap_is_taken_ahead_then_allocations_plan_nothing():
    lay = _two_bands(4, 1 << 20)
    plan = lay.plan([(1, 1)])
    assert sum(a.n for a in plan if isinstance(a, Extend) and a.band == 1) == 1 + 4
    for a in plan:
        lay.apply(a)
    lay.bands[1].free -= 1  # the demand is bound
    for _ in range(4):
        assert lay.plan([(1, 1)]) == []  # served from the units taken ahead
        lay.bands[1].free -= 1
    assert lay.plan([(1, 1)])  # used up: the planner extends again


def _top_band_with_room(room: int, ahead: int) -> BandLayout:
    """FULL on top of the arena (it grows down), ``room`` units above the state band."""
    state = BandState("state", 400, 192, 0, 40, 0)  # bytes [192, 16192): FULL's limit 64
    hi = 64 + room + 2
    full = BandState("full", 256, 0, hi - 2, hi, 0)
    lay = BandLayout([state, full], 192, hi * 256, extend_ahead=ahead)
    assert lay.room(1, Side.DOWN) == room
    return lay


def test_near_the_end_of_a_gap_extensions_are_exact():
    ahead, need = 4, 3
    exact = _top_band_with_room(need + AHEAD_GAP_FACTOR * ahead - 1, ahead)
    assert sum(a.n for a in exact.plan([(1, need)]) if isinstance(a, Extend)) == need
    wide = _top_band_with_room(need + AHEAD_GAP_FACTOR * ahead, ahead)
    assert sum(a.n for a in wide.plan([(1, need)]) if isinstance(a, Extend)) == need + ahead


def test_extend_ahead_is_checked():
    with pytest.raises(ValueError, match="extend_ahead"):
        _two_bands(-1, 4096)


def test_growing_requests_plan_once_per_several_pages(monkeypatch):
    """Eight requests grown a page at a time in a roomy arena: the planner runs (copies the
    layout) about once per ``EXTEND_AHEAD_UNITS`` pages a band takes, not at every page, and
    the pool passes its checks."""
    spec = geometry("equal-p4")
    pool = UnifiedMemory(spec, 1 << 22, max_requests=8, max_context=1024, poison=True)
    copies = []
    real = BandLayout.copy
    monkeypatch.setattr(BandLayout, "copy", lambda self: copies.append(1) or real(self))
    reqs = [pool.admit(spec.page_size) for _ in range(8)]
    assert all(r is not None for r in reqs)
    grows = 0
    for step in range(2, 40):
        for r in reqs:
            assert pool.grow([(r, step * spec.page_size)])
            grows += 1
    check_unified(pool)
    kinds = len(pool.kinds)
    assert len(copies) <= 8 + kinds * grows // EXTEND_AHEAD_UNITS + kinds, (len(copies), grows)
    assert len(copies) < grows // 4
