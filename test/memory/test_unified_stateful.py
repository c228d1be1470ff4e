"""Random admit / grow / retire-SWA / finish / compact sequences on the unified arena, with
misuse interleaved: stale handles, duplicates in one batch, double and foreign frees,
out-of-range ids and counts. Every misuse raises ``ValueError`` and leaves the pool
bit-identical (``pool_state.snapshot``).

After every step: the structural invariants of ``check_unified``; every live unit holds
exactly the bytes last written through its virtual id (so compaction moved data intact and no
two live units share bytes); every free unit and every gap byte holds poison (so nothing
handed out was stale, and nothing live was ever left behind); handed-out units start zeroed.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pool_state import changed, snapshot
from specs import SPECS, F, S, T

from unimem.memory.band_plan import Side
from unimem.memory.checks import check_unified
from unimem.memory.pool import POISON_BYTE
from unimem.memory.unified import UnifiedMemory


class UnifiedArenaMachine(RuleBasedStateMachine):
    @initialize(
        name=st.sampled_from(sorted(SPECS)),
        units=st.integers(12, 40),
        seed=st.integers(0, 2**16),
    )
    def setup(self, name, units, seed):
        spec = SPECS[name]
        self.spec = spec
        probe = UnifiedMemory(spec, 1 << 20, 1, 8)
        per_unit = max(probe.layout.unit_bytes(k) for k in spec.kinds)
        self.mem = UnifiedMemory(
            spec, arena_bytes=units * per_unit, max_requests=6, max_context=48, poison=True
        )
        self.gen = torch.Generator().manual_seed(seed)
        self.live = {}  # row -> (request, tokens)
        self.data = {}  # (kind, vid) -> expected bytes
        self.saw_compaction = False
        self.dead = []  # released handles (stale: every later use must be refused)
        self.refused = 0

    # --- helpers -------------------------------------------------------------------------------

    def _unit_bytes(self, kind, vid):
        m = self.mem
        phys = int(m.spaces[kind].v2p[vid])
        assert phys > 0 or (kind is T and phys >= 0)
        ub = m.layout.unit_bytes(kind)
        start = m.base[kind] + phys * ub
        return m.arena[start : start + ub]

    def _hand_out(self, kind, vids):
        for v in vids:
            view = self._unit_bytes(kind, v)
            assert not bool(view.any()), f"{kind} unit {v} not zeroed on hand-out"
            pattern = torch.randint(0, 255, view.shape, generator=self.gen, dtype=torch.uint8)
            view.copy_(pattern)
            self.data[(kind, v)] = pattern

    def _forget(self, kind, vids):
        for v in vids:
            del self.data[(kind, v)]

    def _new_pages(self, req, before):
        vids = req.pages[before:]
        self._hand_out(F, vids)
        if self.spec.has(S):
            self._hand_out(S, vids)

    # --- rules ---------------------------------------------------------------------------------

    @rule(tokens=st.integers(1, 30))
    def admit(self, tokens):
        req = self.mem.admit(tokens)
        if req is None:
            return
        self._new_pages(req, 0)
        if self.spec.has(T):
            self._hand_out(T, [req.state_slot])
        self.live[req.row] = (req, tokens)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), extra=st.integers(1, 12))
    def grow(self, pick, extra):
        rows = sorted(self.live)
        req, tokens = self.live[rows[pick % len(rows)]]
        target = min(tokens + extra, self.mem.max_context)
        before = len(req.pages)
        if self.mem.grow([(req, target)]):
            self._new_pages(req, before)
            self.live[req.row] = (req, target)
        else:
            assert len(req.pages) == before

    @precondition(lambda self: self.live)
    @rule()
    def retire_swa(self):
        if not self.spec.has(S):
            return
        batch = [(req, tokens) for req, tokens in self.live.values()]
        starts = {req.row: req.swa_start for req, _ in batch}
        self.mem.retire_swa(batch)
        for req, _ in batch:
            self._forget(S, req.pages[starts[req.row] : req.swa_start])

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6))
    def finish(self, pick):
        rows = sorted(self.live)
        req, _ = self.live.pop(rows[pick % len(rows)])
        self._forget(F, req.pages)
        if self.spec.has(S):
            self._forget(S, req.pages[req.swa_start :])
        if self.spec.has(T):
            self._forget(T, [req.state_slot])
        self.mem.release([req])
        self.dead.append(req)

    STALE = ("stale_release", "stale_grow", "stale_retire")
    ON_LIVE = (
        "twice_grow",
        "twice_release",
        "twice_retire",
        "free_own_slot",
        "copy_unheld_slot",
        "unref_request_page",
        "grow_count",
    )
    ANY = ("free_unheld_slot", "save_unheld_slot", "admit_count", "compact_kind")

    @precondition(lambda self: self.dead)
    @rule(which=st.sampled_from(STALE), pick=st.integers(0, 10**6))
    def misuse_stale_handle(self, which, pick):
        self._refuse(which, pick)

    @precondition(lambda self: self.live)
    @rule(which=st.sampled_from(ON_LIVE), pick=st.integers(0, 10**6))
    def misuse_live_request(self, which, pick):
        self._refuse(which, pick)

    @rule(which=st.sampled_from(ANY), pick=st.integers(0, 10**6))
    def misuse_ids_and_counts(self, which, pick):
        self._refuse(which, pick)

    def _refuse(self, which, pick):
        """A call that breaks the contract: refused, and nothing changes."""
        call = self._misuse(which, pick)
        if call is None:
            return
        before = snapshot(self.mem)
        with pytest.raises(ValueError):
            call()
        diff = changed(before, snapshot(self.mem))
        assert not diff, f"refused {which} changed {diff}"
        self.refused += 1

    def _misuse(self, which, pick):
        m, live = self.mem, [req for req, _ in self.live.values()]
        req = live[pick % len(live)] if live else None
        stale = self.dead[pick % len(self.dead)] if self.dead else None
        unheld = next(s for s in range(1, 10**6) if not m._holds_state(s))
        calls = {
            "stale_release": stale and (lambda: m.release([stale])),
            "stale_grow": stale and (lambda: m.grow([(stale, 8)])),
            "stale_retire": stale and (lambda: m.retire_swa([(stale, 0)])),
            "twice_grow": req and (lambda: m.grow([(req, 8), (req, m.max_context)])),
            "twice_release": req and (lambda: m.release(live + [req])),
            "twice_retire": req and (lambda: m.retire_swa([(req, 0), (req, 0)])),
            "free_own_slot": req and self.spec.has(T) and (lambda: m.free_states([req.state_slot])),
            "free_unheld_slot": lambda: m.free_states([[unheld, -1, 10**9][pick % 3]]),
            "save_unheld_slot": lambda: m.save_state([unheld, 0, -1, 10**9][pick % 4]),
            "copy_unheld_slot": req and (lambda: m.copy_states([unheld], [req.state_slot])),
            "unref_request_page": req and req.pages and (lambda: m.unref_pages(req.pages[:1])),
            "admit_count": lambda: m.admit([0, -5, 1.5, m.max_context + 1][pick % 4]),
            "grow_count": req and (lambda: m.grow([(req, [-3, 0, 2.5][pick % 3])])),
            "compact_kind": lambda: (
                m.compact(next(k for k in (F, S, T) if not self.spec.has(k)))
                if len(self.spec.kinds) < 3
                else m.compact("swa")
            ),
        }
        return calls[which] or None

    @rule(kind=st.sampled_from([F, S, T]), up=st.booleans())
    def compact(self, kind, up):
        if not self.spec.has(kind):
            return
        i = self.mem._band_index[kind]
        sides = self.mem.bands.sides(i)
        side = Side.UP if up else Side.DOWN
        if side not in sides:
            side = sides[0]
        self.mem.compact(kind, side)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def structure(self):
        if not hasattr(self, "mem"):
            return
        check_unified(self.mem, [req for req, _ in self.live.values()])
        self.saw_compaction |= self.mem.stats.compactions > 0

    @invariant()
    def data_survives(self):
        if not hasattr(self, "mem"):
            return
        for (kind, v), pattern in self.data.items():
            assert torch.equal(self._unit_bytes(kind, v), pattern), f"{kind} unit {v} changed"

    @invariant()
    def free_bytes_are_poison(self):
        if not hasattr(self, "mem"):
            return
        m = self.mem
        owned = torch.zeros(m.arena_bytes, dtype=torch.bool)
        owned[: m.header_bytes] = True
        for kind, v in self.data:
            phys = int(m.spaces[kind].v2p[v])
            ub = m.layout.unit_bytes(kind)
            owned[m.base[kind] + phys * ub : m.base[kind] + (phys + 1) * ub] = True
        assert bool((m.arena[~owned] == POISON_BYTE).all()), "a free byte is not poison"
        assert not bool(m.arena[: m.header_bytes].any()), "a sink is not zero"


TestUnifiedArena = UnifiedArenaMachine.TestCase
TestUnifiedArena.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, derandomize=True
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
