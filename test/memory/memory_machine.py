"""A stateful random-operation model of the memory layer (hypothesis ``RuleBasedStateMachine``):
:class:`~unimem.memory.unified.UnifiedMemory` with or without a
:class:`~unimem.cache.PrefixCache`, driven through the public API only, against an
independent model of what every unit must hold. Tests import this module by name (pytest puts
this folder on ``sys.path``).

Geometries (:data:`GEOMETRIES`): 2- and 3-kind arenas, page sizes 1 to 64, FULL / SWA / STATE
units of unequal sizes, asymmetric K/V, mixed dtypes, draft lanes on every kind, the ``tiny``
preset with a 1- and a 2-layer drafter; arenas from the constructor's minimum up.

Operations: admit (through the cache when there is one), ``admit_many`` (checked against a
copy of the pool doing the same admits one by one: the two pools must end bit-identical),
grow a request (on out of memory: evict the cache, then retract the newest request, as the
scheduler does), retire SWA, insert into the cache, finish, evict, flush, save / free
checkpoints, explicit compaction, and 14 kinds of misuse (each must raise ``ValueError`` and
change nothing).

The model keeps, independently of the pool: every live request's token count, pages and SWA
start (from the documented formula), the checkpoints it owns, and the bytes last written to
every unit it knows to be held. After every operation:

- the structural checks (``check_unified``; ``PrefixCache.check``);
- the pool's holder counts equal those the model derives from the live requests and what the
  cache reports holding; live units and state slots are exactly those;
- every held unit holds exactly the bytes last written through its id (compaction moved data
  intact; no two held units share bytes); every other byte of the arena is poison;
- handed-out units start zeroed; a resumed request's state slot is a copy of its checkpoint;
- an out-of-capacity return (``admit`` None, ``grow`` False, ``save_state`` None) leaves the
  pool bit-identical, generation counter included.

``COUNTS`` accumulates, over every run in the process, the operations, out-of-capacity
returns, compactions and retractions (the slow tier prints them).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pool_state import changed, pool_snapshot
from specs import GEOMETRIES, F, S, T, geometry, minimal_arena

from unimem.cache import PrefixCache
from unimem.memory.band_plan import Side
from unimem.memory.checks import check_unified
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import POISON_BYTE, SharedPrefix, pages_for
from unimem.memory.unified import UnifiedMemory

COUNTS: Counter = Counter()
"""Totals over every run of the machine in this process (see the module docstring)."""


@dataclass
class Live:
    """The model of one live request: its handle, its tokens, the tokens committed (the
    K/V and state in memory), the SWA start the contract implies."""

    mem: object
    tokens: list[int]
    kv: int
    swa_start: int


class MemoryMachine(RuleBasedStateMachine):
    """See the module docstring. ``geometries`` limits the specs drawn (subclasses)."""

    geometries = tuple(GEOMETRIES)

    @initialize(
        data=st.data(),
        extra_units=st.one_of(st.just(0), st.integers(1, 8), st.integers(8, 40)),
        jitter=st.integers(0, 1 << 12),
        max_requests=st.integers(1, 6),
        context_pages=st.integers(2, 10),
        cached=st.integers(0, 9),
        interval=st.integers(1, 2),
        seed=st.integers(0, 2**16),
        used=st.integers(0, 12),
        checkpoints=st.integers(0, 3),
    )
    def setup(self, data, extra_units, jitter, max_requests, context_pages, cached, interval,
              seed, used, checkpoints):  # fmt: skip
        name = data.draw(st.sampled_from(self.geometries), label="geometry")
        spec = geometry(name)
        self.spec = spec
        self.p = spec.page_size
        layout = MemoryLayout.build(spec)
        unit = layout.unit_bytes(F)
        # extra room in FULL pages, plus a few bytes: the band grids meet at other offsets
        arena = minimal_arena(name) + extra_units * unit + (jitter % unit if extra_units else 0)
        self.mem = UnifiedMemory(
            spec,
            arena,
            max_requests=max_requests,
            max_context=min(context_pages * self.p, 64 if self.p <= 4 else 128),
            poison=True,
        )
        self.cache = PrefixCache(self.mem, interval) if cached < 6 else None  # 60 %
        self.gen = torch.Generator().manual_seed(seed)
        self.live: dict[int, Live] = {}  # row -> model
        self.order: list[int] = []  # rows, oldest admission first (retraction takes the last)
        self.ckpts: set[int] = set()  # checkpoint slots the model owns (raw save_state)
        self.data: dict[tuple, torch.Tensor] = {}  # (kind, id) -> bytes last written
        self.dead: list = []  # released handles
        self.window = spec.max_window
        COUNTS["runs"] += 1
        self._used_arena(used, checkpoints)

    def _used_arena(self, tokens, checkpoints):
        """Start from an arena that was used: one request of ``tokens`` tokens (0: none)
        saves ``checkpoints`` states, then all is freed — every band keeps its extent, free."""
        if tokens == 0:
            return
        mem = self.mem.admit(min(tokens, self.mem.max_context))
        if mem is None:
            return
        saved = []
        for _ in range(checkpoints if self.spec.has(T) else 0):
            slot = self.mem.save_state(mem.state_slot)
            if slot is not None:
                saved.append(slot)
        self.mem.free_states(saved)
        self.mem.release([mem])

    # --- the model ------------------------------------------------------------------------------

    def _unit(self, kind, vid):
        m = self.mem
        phys = int(m.spaces[kind].v2p[vid])
        assert phys >= 0 and (kind is T or phys > 0), f"{kind} id {vid} is not bound"
        ub = m.layout.unit_bytes(kind)
        start = m.base[kind] + phys * ub
        return m.arena[start : start + ub]

    def _write(self, kind, vid, zero=True):
        view = self._unit(kind, vid)
        if zero:
            assert not bool(view.any()), f"{kind} unit {vid} is not zeroed when handed out"
        pattern = torch.randint(0, 255, view.shape, generator=self.gen, dtype=torch.uint8)
        view.copy_(pattern)
        self.data[(kind, vid)] = pattern

    def _fresh_pages(self, vids):
        for v in vids:
            self._write(F, v)
            if self.spec.has(S):
                self._write(S, v)

    def _swa_stop(self, pos, num_pages):
        if not self.spec.has(S):
            return 0
        return min(max(0, (pos - self.window + 1) // self.p), num_pages)

    def _held(self):
        """(FULL holders, SWA holders, held state slots) as the model derives them."""
        full, swa, slots = Counter(), Counter(), list(self.ckpts)
        for lv in self.live.values():
            full.update(lv.mem.pages)
            if self.spec.has(S):
                swa.update(lv.mem.pages[lv.swa_start :])
            if self.spec.has(T):
                slots.append(lv.mem.state_slot)
        if self.cache is not None:
            pages, swa_pages, cache_slots = self.cache.held()
            full.update(pages)
            swa.update(swa_pages)
            slots += cache_slots
        return full, swa, slots

    def _forget_unheld(self):
        full, swa, slots = self._held()
        held = {(F, p) for p in full} | {(S, p) for p in swa} | {(T, s) for s in slots}
        for key in [k for k in self.data if k not in held]:
            del self.data[key]

    def _admitted(self, mem, tokens, kv, prefix_ckpt=-1):
        """Record a new request (fresh pages zeroed, then written)."""
        shared = mem.shared
        self._fresh_pages(mem.pages[shared:])
        if self.spec.has(T):
            if prefix_ckpt >= 0:
                got = self._unit(T, mem.state_slot)
                assert torch.equal(got, self.data[(T, prefix_ckpt)]), "resumed state != checkpoint"
            self._write(T, mem.state_slot, zero=prefix_ckpt < 0)
        swa_start = self._swa_stop(shared * self.p, shared) if shared else 0
        assert mem.swa_start == swa_start, f"swa_start {mem.swa_start}, model {swa_start}"
        self.live[mem.row] = Live(mem, tokens, kv, swa_start)
        self.order.append(mem.row)

    def _release(self, row):
        lv = self.live.pop(row)
        self.order.remove(row)
        self.mem.release([lv.mem])
        self.dead.append(lv.mem)
        self._forget_unheld()

    def _unchanged(self, before, what):
        diff = changed(before, pool_snapshot(self.mem))
        assert not diff, f"{what} returned out of memory but changed {diff}"
        COUNTS["out_of_capacity"] += 1

    def _tokens(self, n):
        return torch.randint(0, 3, (n,), generator=self.gen).tolist()

    def _pick(self, pick):
        rows = sorted(self.live)
        return self.live[rows[pick % len(rows)]]

    # --- rules ----------------------------------------------------------------------------------

    @rule(length=st.integers(1, 40), chunk=st.integers(1, 24))
    def admit(self, length, chunk):
        COUNTS["ops"] += 1
        length = 1 + (length - 1) % self.mem.max_context  # spread over the context
        tokens = self._tokens(length)
        if self.cache is not None:
            self._cache_admit(tokens, chunk)
            return
        need = min(length, chunk)
        before = pool_snapshot(self.mem)
        mem = self.mem.admit(need)
        if mem is None:
            self._unchanged(before, "admit")
            return
        assert len(mem.pages) == pages_for(need, self.p)
        self._admitted(mem, tokens, 0)

    def _cache_admit(self, tokens, chunk):
        m = self.cache.match(tokens[:-1])
        ckpt = m.checkpoint
        adm = self.cache.admit(tokens, chunk)
        self._forget_unheld()  # the cache may have evicted
        if adm is None:
            COUNTS["out_of_capacity"] += 1
            return
        mem, k = adm.mem, adm.prefix_tokens
        assert k == m.num_tokens and tuple(mem.pages[: k // self.p]) == m.pages
        need = k + min(len(tokens) - k, chunk)
        assert len(mem.pages) == pages_for(need, self.p)
        assert mem.shared == k // self.p
        self._admitted(mem, tokens, k, ckpt if k else -1)

    @rule(counts=st.lists(st.integers(1, 24), min_size=1, max_size=5), draw=st.integers(0, 3))
    def admit_many(self, counts, draw):
        """admit_many leaves the pool as admits one by one (on a copy) would, bit for bit."""
        if draw:  # a quarter of the draws (the check copies the pool): admits one by one
            for n in counts:
                self.admit(n, n)
            return
        COUNTS["ops"] += 1
        counts = [1 + (n - 1) % self.mem.max_context for n in counts]
        twin = copy.deepcopy(self.mem)
        singles = []
        for n in counts:
            r = twin.admit(n)
            if r is None:
                break
            singles.append(r)
        batch = self.mem.admit_many(counts)
        diff = changed(pool_snapshot(twin), pool_snapshot(self.mem))
        assert not diff, f"admit_many({counts}) differs from admits one by one in {diff}"
        assert [vars(r) for r in batch] == [vars(r) for r in singles]
        if len(batch) < len(counts):
            COUNTS["out_of_capacity"] += 1
        for mem, n in zip(batch, counts, strict=False):
            self._admitted(mem, self._tokens(n), 0)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 12))
    def step(self, pick, n):
        """Grow a request by ``n`` tokens and commit them; under pressure evict the cache,
        then retract the newest request (the scheduler's order), until it fits or it is the
        one retracted."""
        COUNTS["ops"] += 1
        lv = self._pick(pick)
        target = min(lv.kv + n, self.mem.max_context)
        if len(lv.tokens) < target:
            lv.tokens += self._tokens(target - len(lv.tokens))
        while True:
            before = pool_snapshot(self.mem)
            have = len(lv.mem.pages)
            if self.mem.grow([(lv.mem, target)]):
                self._fresh_pages(lv.mem.pages[have:])
                lv.kv = target
                return
            self._unchanged(before, "grow")
            if self.cache is not None and self.cache.evict(1 << 30).bytes > 0:
                self._forget_unheld()
                continue
            newest = self.order[-1]
            COUNTS["retractions"] += 1
            self._release(newest)
            if newest == lv.mem.row or lv.mem.row not in self.live:
                return

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6))
    def retire_swa(self, pick):
        COUNTS["ops"] += 1
        lv = self._pick(pick)
        self.mem.retire_swa([(lv.mem, lv.kv)])
        lv.swa_start = max(lv.swa_start, self._swa_stop(lv.kv, len(lv.mem.pages)))
        assert lv.mem.swa_start == lv.swa_start
        self._forget_unheld()

    @precondition(lambda self: self.live and self.cache is not None)
    @rule(pick=st.integers(0, 10**6))
    def insert(self, pick):
        COUNTS["ops"] += 1
        lv = self._pick(pick)
        k = lv.kv // self.p
        before = set(self.cache.held()[2])
        self.cache.insert(lv.tokens[: k * self.p], lv.mem)
        for slot in set(self.cache.held()[2]) - before:
            got = self._unit(T, slot)
            assert torch.equal(got, self.data[(T, lv.mem.state_slot)]), "checkpoint != state"
            self.data[(T, slot)] = got.clone()
        self._forget_unheld()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), insert=st.booleans())
    def finish(self, pick, insert):
        COUNTS["ops"] += 1
        lv = self._pick(pick)
        if insert and self.cache is not None:
            self.insert(pick)
        self._release(lv.mem.row)

    @precondition(lambda self: self.live)
    @rule(flush=st.booleans())
    def finish_all(self, flush):
        """Every request finishes (the bands keep their extents, all free)."""
        COUNTS["ops"] += 1
        for row in list(self.order):
            self._release(row)
        if flush and self.cache is not None:
            self.cache.flush()
            self._forget_unheld()

    @precondition(lambda self: self.cache is not None)
    @rule(nbytes=st.integers(0, 1 << 16), flush=st.booleans())
    def evict(self, nbytes, flush):
        COUNTS["ops"] += 1
        if flush:
            self.cache.flush()
        else:
            self.cache.evict(nbytes)
        self._forget_unheld()

    @precondition(lambda self: T in self.spec.kinds and (self.live or self.ckpts))
    @rule(pick=st.integers(0, 10**6))
    def save_state(self, pick):
        COUNTS["ops"] += 1
        sources = sorted(self.ckpts) + [lv.mem.state_slot for lv in self.live.values()]
        src = sources[pick % len(sources)]
        before = pool_snapshot(self.mem)
        slot = self.mem.save_state(src)
        if slot is None:
            self._unchanged(before, "save_state")
            return
        got = self._unit(T, slot)
        assert torch.equal(got, self.data[(T, src)]), "a checkpoint is not a copy of its source"
        self.ckpts.add(slot)
        self.data[(T, slot)] = got.clone()

    @precondition(lambda self: self.ckpts)
    @rule(pick=st.integers(0, 10**6))
    def free_state(self, pick):
        COUNTS["ops"] += 1
        slot = sorted(self.ckpts)[pick % len(self.ckpts)]
        self.ckpts.remove(slot)
        self.mem.free_states([slot])
        self._forget_unheld()

    @precondition(lambda self: self.ckpts and self.spec.has(F))
    @rule(pick=st.integers(0, 10**6), length=st.integers(1, 64))
    def resume_from_checkpoint(self, pick, length):
        """admit with a SharedPrefix made of a live request's first pages and a checkpoint
        the model owns (the raw pool API under the prefix cache)."""
        COUNTS["ops"] += 1
        donors = [lv for lv in self.live.values() if lv.mem.pages]
        if not donors:
            return
        lv = donors[pick % len(donors)]
        k = min(len(lv.mem.pages), max(1, lv.kv // self.p))
        stop = self._swa_stop(k * self.p, k)
        if self.spec.has(S) and stop < lv.mem.swa_start:
            return  # the window behind the resume point is gone
        ckpt = sorted(self.ckpts)[pick % len(self.ckpts)]
        n = min(max(length, k * self.p), self.mem.max_context)
        if n < k * self.p:
            return
        before = pool_snapshot(self.mem)
        mem = self.mem.admit(n, SharedPrefix(tuple(lv.mem.pages[:k]), ckpt))
        if mem is None:
            self._unchanged(before, "admit with a prefix")
            return
        self._admitted(
            mem, lv.tokens[: k * self.p] + self._tokens(n - k * self.p), k * self.p, ckpt
        )

    @rule(kind=st.sampled_from([F, S, T]), up=st.booleans())
    def compact(self, kind, up):
        COUNTS["ops"] += 1
        if not self.spec.has(kind):
            return
        sides = self.mem.bands.sides(self.mem._band_index[kind])
        side = Side.UP if up else Side.DOWN
        self.mem.compact(kind, side if side in sides else sides[0])

    # --- misuse: refused, nothing changes -------------------------------------------------------

    MISUSE = (
        "stale_release",
        "stale_grow",
        "stale_retire",
        "twice_grow",
        "twice_release",
        "twice_retire",
        "free_own_slot",
        "free_unheld_slot",
        "save_unheld_slot",
        "copy_unheld_slot",
        "unref_request_page",
        "admit_count",
        "grow_count",
        "compact_kind",
    )

    @rule(which=st.sampled_from(MISUSE), pick=st.integers(0, 10**6))
    def misuse(self, which, pick):
        call = self._misuse(which, pick)
        if call is None:
            return
        COUNTS["ops"] += 1
        before = pool_snapshot(self.mem, self.cache) if self.cache else pool_snapshot(self.mem)
        with pytest.raises(ValueError):
            call()
        after = pool_snapshot(self.mem, self.cache) if self.cache else pool_snapshot(self.mem)
        diff = changed(before, after)
        assert not diff, f"refused {which} changed {diff}"
        COUNTS["misuse_refused"] += 1

    def _misuse(self, which, pick):
        m = self.mem
        live = [lv.mem for lv in self.live.values()]
        req = live[pick % len(live)] if live else None
        stale = self.dead[pick % len(self.dead)] if self.dead else None
        unheld = next(s for s in range(1, 10**6) if not m._holds_state(s))
        has_t = self.spec.has(T)
        calls = {
            "stale_release": stale and (lambda: m.release([stale])),
            "stale_grow": stale and (lambda: m.grow([(stale, 8)])),
            "stale_retire": stale and (lambda: m.retire_swa([(stale, 0)])),
            "twice_grow": req and (lambda: m.grow([(req, 8), (req, m.max_context)])),
            "twice_release": req and (lambda: m.release(live + [req])),
            "twice_retire": req and (lambda: m.retire_swa([(req, 0), (req, 0)])),
            "free_own_slot": req and has_t and (lambda: m.free_states([req.state_slot])),
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

    # --- the invariant --------------------------------------------------------------------------

    @invariant()
    def memory_is_what_the_model_says(self):
        if not hasattr(self, "mem"):
            return
        m = self.mem
        check_unified(m, [lv.mem for lv in self.live.values()])
        if self.cache is not None:
            self.cache.check()
        full, swa, slots = self._held()
        got_full, got_swa = m.holders()
        assert got_full == dict(full), "FULL holder counts differ from the model's"
        assert got_swa == (dict(swa) if self.spec.has(S) else {}), "SWA holder counts differ"
        assert len(set(slots)) == len(slots), "a state slot has two owners"
        assert m.live_units(T) == len(slots), "live state slots differ from the model's"
        for lv in self.live.values():
            assert lv.mem.swa_start == lv.swa_start
            assert len(lv.mem.pages) * self.p >= lv.kv
        owned = torch.zeros(m.arena_bytes, dtype=torch.bool)
        owned[: m.header_bytes] = True
        held = {(F, p) for p in full} | {(S, p) for p in swa} | {(T, s) for s in slots}
        assert held == set(self.data), "the model lost track of a held unit"
        for (kind, v), pattern in self.data.items():
            view = self._unit(kind, v)
            assert torch.equal(view, pattern), f"{kind} unit {v} does not hold what was written"
            ub = m.layout.unit_bytes(kind)
            phys = int(m.spaces[kind].v2p[v])
            owned[m.base[kind] + phys * ub : m.base[kind] + (phys + 1) * ub] = True
        assert bool((m.arena[~owned] == POISON_BYTE).all()), "a free byte is not poison"
        assert not bool(m.arena[: m.header_bytes].any()), "a sink is not zero"

    def teardown(self):
        if hasattr(self, "mem"):
            COUNTS["compactions"] += self.mem.stats.compactions
            COUNTS["moved_units"] += self.mem.stats.moved_units
