"""The memory layer under random operations: ``memory_machine.MemoryMachine`` (a hypothesis
``RuleBasedStateMachine`` over ``UnifiedMemory`` and ``PrefixCache`` against an independent
model; see that module) in three tiers:

- the CI slice (``TestMemoryMachine``): a few hundred derandomized examples over every
  geometry;
- a planted fault: the planner's rounding broken on purpose must be caught within that slice,
  both by the planner's own check (an ``InternalError`` out of an allocating call) and, with
  that check switched off, by the model alone (bytes shared or lost);
- the slow tier (``pytest -m slow``): at least 10^5 operations, printing the counts of
  out-of-capacity returns, compactions and retractions.

Plus a directed test: pressure that must compact rather than report out of memory.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from memory_machine import COUNTS, MemoryMachine
from specs import GEOMETRIES, SPECS, minimal_arena

from unimem.memory import band_plan
from unimem.memory.checks import check_unified
from unimem.memory.errors import InternalError
from unimem.memory.unified import UnifiedMemory

CI_SLICE = settings(
    max_examples=200,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)

TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = CI_SLICE


def _floor_div(a: int, b: int) -> int:
    return a // b


def _run_planted(monkeypatch, check: bool) -> BaseException:
    """Run the CI slice (no shrinking) on a planner whose anchor rounding is broken: the
    grid point at or above a byte limit (``_ceil_div``, used by ``_anchor_for`` and by
    ``room`` at the lower limit) rounds down instead. Returns what stopped the run."""
    for name in GEOMETRIES:  # the arena sizes the machine draws, from the real planner
        minimal_arena(name)
    monkeypatch.setattr(band_plan, "_ceil_div", _floor_div)
    if not check:
        monkeypatch.setattr(band_plan.BandLayout, "check", lambda self: None)
    fast = settings(CI_SLICE, phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(BaseException) as caught:
        run_state_machine_as_test(MemoryMachine, settings=fast)
    return caught.value


def test_planted_anchor_fault_is_caught_by_the_planner_check(monkeypatch):
    err = _run_planted(monkeypatch, check=True)
    assert isinstance(err, InternalError) and "band plan" in str(err), repr(err)


def test_planted_anchor_fault_is_caught_by_the_model(monkeypatch):
    """With the plan's check off (what ``python -O`` did to the original ``assert``), the
    machine's invariant sees the overlap: ``check_unified`` (bands overlap), or the model
    (bytes that changed under a held unit, a sink that is not zero, a free byte that is
    not poison)."""
    err = _run_planted(monkeypatch, check=False)
    assert isinstance(err, (AssertionError, InternalError)), repr(err)
    assert not str(err).startswith("band plan"), repr(err)  # not the planner's own check


@pytest.mark.slow
def test_slow_tier_hundred_thousand_operations(capsys):
    """At least 10^5 random operations across every geometry, every invariant checked after
    each; prints the counts."""
    slow = settings(CI_SLICE, max_examples=400, stateful_step_count=60, derandomize=False)
    COUNTS.clear()
    start = time.monotonic()
    rounds = 0
    while COUNTS["ops"] < 100_000:
        run_state_machine_as_test(MemoryMachine, settings=slow)
        rounds += 1
    took = time.monotonic() - start
    with capsys.disabled():
        print(
            f"\nmemory stress: {COUNTS['ops']} operations in {COUNTS['runs']} runs "
            f"({rounds} rounds, {took:.0f} s): {COUNTS['out_of_capacity']} out-of-capacity "
            f"returns, {COUNTS['compactions']} compactions ({COUNTS['moved_units']} units "
            f"moved), {COUNTS['retractions']} retractions, {COUNTS['misuse_refused']} misuses "
            f"refused, 0 invariant violations"
        )


def _admit_largest(mem, limit):
    """Admit the longest request that fits (at most ``limit`` tokens); None if none fits."""
    lo, hi, best = 1, limit, None
    while lo <= hi:
        mid = (lo + hi) // 2
        req = mem.admit(mid)
        if req is None:
            hi = mid - 1
            continue
        if best is not None:
            mem.release([best[0]])
        best, lo = (req, mid), mid + 1
    return best


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pressure_forces_compaction(name):
    """Free holes deep inside one band, then make another band grow into it: the arena must
    compact (not report out of memory) and stay consistent."""
    spec = SPECS[name]
    probe = UnifiedMemory(spec, 1 << 20, 1, 8)
    per_unit = max(probe.layout.unit_bytes(k) for k in spec.kinds)
    mem = UnifiedMemory(spec, 40 * per_unit, max_requests=40, max_context=256, poison=True)
    a = _admit_largest(mem, 256)
    b = _admit_largest(mem, 256)
    assert a is not None and b is not None
    mem.retire_swa([a, b])
    mem.release([a[0]])
    live = [b[0]]
    check_unified(mem, live)
    req_b, n = b
    progress = True
    while progress:
        progress = False
        req = mem.admit(1)
        if req is not None:
            live.append(req)
            progress = True
        if n + spec.page_size <= mem.max_context and mem.grow([(req_b, n + spec.page_size)]):
            n += spec.page_size
            mem.retire_swa([(req_b, n)])
            progress = True
        check_unified(mem, live)
    assert mem.stats.compactions > 0
