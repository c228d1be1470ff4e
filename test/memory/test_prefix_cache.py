"""The prefix cache over both pools: sharing, SWA windows, checkpoints, eviction.

- A hypothesis state machine drives random admit (through the cache) / advance / insert /
  finish / evict / flush / match sequences on poisoned pools whose every unit's bytes are a
  function of the tokens it covers. After every step: the pool's holder counts are exactly
  the holders (requests and cache), every held unit holds the bytes of its tokens (so nothing
  still referenced was freed or overwritten), every free byte is poison, handed-out units
  start zeroed, and every match ends at a point with FULL pages, the SWA window and the
  checkpoint — all holding the right bytes. At teardown, releasing every request and flushing
  the cache leaves every band empty (nothing leaks). Misuse is interleaved — stale handles,
  duplicates, double frees, a request's own slot or page handed to the sharing entry points,
  out-of-range ids, bad token ids — and each is refused (``ValueError``) with the pool and
  the cache bit-identical (``pool_state.snapshot``).
- Deterministic tests: a prefix whose SWA pages were partly retired resumes only where its
  window is whole (one page later the window has a retired page: the sink); a request admitted
  on a hit reads exactly the cached bytes (FULL through translation, the SWA window, the
  checkpoint); eviction order and locks; adoption; the pool's sharing contract.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pool_state import changed, snapshot

import unimem_kernel as uk
from unimem.cache import CacheStats, PrefixCache
from unimem.memory.checks import check_holders, check_unified, unit_bytes
from unimem.memory.pool import POISON_BYTE, MemoryPool, SharedPrefix
from unimem.memory.spec import AttentionLayerSpec, DraftLane, LayerKind, MemorySpec, StateLayerSpec
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory

F, S, T = LayerKind.FULL, LayerKind.SWA, LayerKind.STATE
f32, bf16 = torch.float32, torch.bfloat16


def _full(h=2, dk=8, dv=8, dt=f32):
    return AttentionLayerSpec(F, h, dk, dv, dt)


def _swa(w, h=2, dk=8, dv=4, dt=f32):
    return AttentionLayerSpec(S, h, dk, dv, dt, window=w)


def _state():
    return StateLayerSpec((6, 3), bf16, (2, 4, 4), f32)


SPECS = {
    "full": MemorySpec(page_size=4, layers=(_full(), _full(dt=bf16))),
    "full+state": MemorySpec(
        page_size=4,
        layers=(_full(), _state(), _full(dt=bf16)),
        draft_lanes=(DraftLane(T, _state()),),
    ),
    "full+swa": MemorySpec(
        page_size=2,
        layers=(_full(dk=16, dv=8), _swa(5)),
        draft_lanes=(DraftLane(F, _full(h=1, dk=16, dv=16)),),
    ),
    "full+swa+state": MemorySpec(
        page_size=4,
        layers=(_swa(6), _state(), _full(dk=16, dv=8), _swa(5, dt=bf16)),
        draft_lanes=(DraftLane(S, _swa(6)), DraftLane(F, _full()), DraftLane(T, _state())),
    ),
}
MAX_CONTEXT = 40


def content(pool: MemoryPool, kind: LayerKind, tokens) -> torch.Tensor:
    """The bytes a unit of ``kind`` holds when it covers ``tokens`` (a page: the K/V of the
    page ending at ``tokens[-1]``; a state slot: the state after ``tokens``)."""
    return _content(kind, pool.layout.unit_bytes(kind), tuple(tokens))


@functools.lru_cache(maxsize=1 << 14)
def _content(kind: LayerKind, n: int, tokens: tuple[int, ...]) -> torch.Tensor:
    digest = hashlib.sha256(f"{kind.value}:{tokens}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8)


def write(pool: MemoryPool, kind: LayerKind, vid: int, tokens, fresh: bool = False) -> None:
    view = unit_bytes(pool, kind, vid)
    assert view is not None, f"{kind} unit {vid} is not bound"
    if fresh:
        assert not bool(view.any()), f"{kind} unit {vid} was not zeroed on hand-out"
    view.copy_(content(pool, kind, tokens))


def holds(pool: MemoryPool, kind: LayerKind, vid: int, tokens) -> bool:
    view = unit_bytes(pool, kind, vid)
    return view is not None and torch.equal(view, content(pool, kind, tokens))


def path_tokens(node) -> list[int]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def make_pool(name: str, kind: str, units: int) -> MemoryPool:
    spec = SPECS[name]
    if kind == "static":
        return StaticMemory(
            spec,
            num_full_pages=units,
            num_swa_pages=max(4, units * 2 // 3),
            num_state_slots=6,
            max_requests=4,
            max_context=MAX_CONTEXT,
            poison=True,
        )
    probe = UnifiedMemory(spec, 1 << 20, 1, 8)
    per_unit = sum(probe.layout.unit_bytes(k) for k in spec.kinds) // len(spec.kinds)
    return UnifiedMemory(
        spec, units * per_unit, max_requests=4, max_context=MAX_CONTEXT, poison=True
    )


@dataclass
class Live:
    """A running request of the simulation: its tokens, how many are computed, and how many
    of its page columns have been written."""

    mem: object
    seq: list[int]
    kv: int
    written: int


_gen = torch.Generator().manual_seed(1)
STEMS = [[int(t) for t in torch.randint(0, 3, (MAX_CONTEXT,), generator=_gen)] for _ in range(2)]
TAILS = [[int(t) for t in torch.randint(0, 3, (MAX_CONTEXT,), generator=_gen)] for _ in range(3)]
# Few stems and tails, so that requests share long prefixes (and sometimes everything).
sequences = st.builds(
    lambda stem, cut, tail, length: (STEMS[stem][:cut] + TAILS[tail])[:length],
    st.integers(0, 1),
    st.integers(0, MAX_CONTEXT),
    st.integers(0, 2),
    st.integers(2, MAX_CONTEXT - 4),
)


# Misuse the machine interleaves (each refused with nothing changed; see ``_misuse``).
STALE = ("stale_insert", "stale_release", "stale_grow")
ON_LIVE = (
    "insert_own_slot",
    "insert_anchor_checkpoint",
    "insert_freed_checkpoint",
    "insert_bad_tokens",
    "insert_too_long",
    "unref_request_page",
    "free_own_slot",
    "free_checkpoint_twice",
    "twice_release",
    "twice_grow",
)
ANY = ("evict_negative", "admit_bad_chunk", "free_unheld", "save_unheld", "prefix_unheld")


class PrefixCacheMachine(RuleBasedStateMachine):
    """Subclassed per spec (``NAME``) and pool (``KIND``: "unified" or "static")."""

    NAME = "full+swa+state"
    KIND = "unified"

    @initialize(units=st.integers(14, 40), interval=st.integers(1, 2))
    def setup(self, units, interval):
        self.pool = make_pool(self.NAME, self.KIND, units)
        self.spec = self.pool.spec
        self.P = self.pool.page_size
        self.cache = PrefixCache(self.pool, checkpoint_interval=interval)
        self.live: dict[int, Live] = {}
        self.dead: list = []  # released handles
        self.hits = 0

    # --- simulation of the model's writes ------------------------------------------------------

    def _write_new_pages(self, r: Live) -> None:
        mem, p = r.mem, self.P
        for c in range(r.written, len(mem.pages)):
            toks = r.seq[: (c + 1) * p]
            write(self.pool, F, mem.pages[c], toks, fresh=True)
            if self.spec.has(S):
                write(self.pool, S, mem.pages[c], toks, fresh=True)
        r.written = len(mem.pages)

    def _pick(self, i: int) -> Live:
        rows = sorted(self.live)
        return self.live[rows[i % len(rows)]]

    # --- rules -----------------------------------------------------------------------------------

    @rule(seq=sequences, chunk=st.integers(1, 24))
    def admit(self, seq, chunk):
        adm = self.cache.admit(seq, chunk)
        if adm is None:
            return
        mem, k = adm.mem, adm.prefix_tokens
        assert k % self.P == 0 and k < len(seq) and mem.shared * self.P == k
        if self.spec.has(T):
            if k:
                assert holds(self.pool, T, mem.state_slot, seq[:k]), "checkpoint not copied"
                self.hits += 1
            else:
                write(self.pool, T, mem.state_slot, [], fresh=True)
        r = Live(mem, seq, k, mem.shared)
        self._write_new_pages(r)
        self.live[mem.row] = r

    @precondition(lambda self: self.live)
    @rule(
        pick=st.integers(0, 99),
        n=st.integers(1, 12),
        align=st.booleans(),
        insert=st.booleans(),
        misuse=st.sampled_from(ON_LIVE),
    )
    def advance(self, pick, n, align, insert, misuse):
        """Compute ``n`` more tokens (``align``: up to an anchor point, as the engine's chunks
        will end); insert at the new length (before retiring, as the engine does at a chunk
        boundary), then retire SWA pages behind the window. Then ``misuse``: a call that
        breaks the contract on a running request (refused, nothing changes)."""
        self._advance(self._pick(pick), n, align, insert)
        self._refuse(misuse, pick)

    def _advance(self, r: Live, n: int, align: bool, insert: bool) -> bool:
        kv = r.kv + n
        if align:
            step = self.P * self.cache.checkpoint_interval
            kv = max(kv // step * step, (r.kv // step + 1) * step)
        kv = min(kv, len(r.seq))
        if not self.pool.grow([(r.mem, kv)]):
            self.cache.evict(1 << 30)  # eviction first, as the scheduler does before retracting
            if not self.pool.grow([(r.mem, kv)]):
                return False
        self._write_new_pages(r)
        r.kv = kv
        if self.spec.has(T):
            write(self.pool, T, r.mem.state_slot, r.seq[:kv])
        if insert:
            self.cache.insert(r.seq[:kv], r.mem)
        self.pool.retire_swa([(r.mem, kv)])
        return True

    @rule(
        seq=sequences,
        chunk=st.integers(1, 24),
        n=st.integers(1, 12),
        misuse=st.sampled_from(ON_LIVE),
        pick=st.integers(0, 99),
    )
    def serve(self, seq, chunk, n, misuse, pick):
        """A whole request: admitted through the cache, computed in chunks ending on anchor
        points with an insert at each, inserted and released at the end. After each chunk,
        a call that breaks the contract on it (refused, nothing changes)."""
        self.admit(seq, chunk)
        r = next((r for r in self.live.values() if r.seq is seq), None)
        if r is None:
            return
        while r.kv < len(r.seq) and self._advance(r, n, True, True):
            self._refuse(misuse, pick, r)
            misuse = ON_LIVE[(ON_LIVE.index(misuse) + 1) % len(ON_LIVE)]
        self.finish_request(r, insert=True)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def insert(self, pick):
        r = self._pick(pick)
        got = self.cache.insert(r.seq[: r.kv], r.mem).tokens
        if got:
            assert self.cache.match(r.seq[: r.kv]).num_tokens >= got

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), insert=st.booleans())
    def finish(self, pick, insert):
        self.finish_request(self._pick(pick), insert)

    def finish_request(self, r: Live, insert: bool) -> None:
        if insert:
            self.cache.insert(r.seq[: r.kv], r.mem)
        del self.live[r.mem.row]
        self.pool.release([r.mem])
        self.dead.append(r.mem)

    # --- misuse: refused, and nothing changes ----------------------------------------------------

    @precondition(lambda self: self.dead)
    @rule(which=st.sampled_from(STALE), pick=st.integers(0, 99))
    def misuse_stale_handle(self, which, pick):
        self._refuse(which, pick)

    @rule(which=st.sampled_from(ANY), pick=st.integers(0, 99))
    def misuse_ids_and_counts(self, which, pick):
        self._refuse(which, pick)

    def _refuse(self, which, pick, r=None):
        call = self._misuse(which, pick, r)
        if call is None:
            return
        before = snapshot(self.pool, self.cache)
        with pytest.raises(ValueError):
            call()
        diff = changed(before, snapshot(self.pool, self.cache))
        assert not diff, f"refused {which} changed {diff}"

    def _misuse(self, which, pick, r=None):
        """The misuse ``which`` (of ``STALE``, ``ON_LIVE``, ``ANY``) as a call, on request
        ``r`` (default: one picked by ``pick``); None where it does not apply."""
        pool, cache, has_t = self.pool, self.cache, self.spec.has(T)
        r = r or (self._pick(pick) if self.live else None)
        stale = self.dead[pick % len(self.dead)] if self.dead else None
        unheld = next(s for s in range(1, 10**6) if not pool._holds_state(s))
        if which.startswith("stale_"):
            return {
                "stale_insert": lambda: cache.insert([0] * self.P, stale),
                "stale_release": lambda: pool.release([stale]),
                "stale_grow": lambda: pool.grow([(stale, self.P)]),
            }[which]
        if which == "insert_own_slot" and has_t:
            return lambda: cache.insert(r.seq[: r.kv], r.mem, checkpoint=r.mem.state_slot)
        if which == "insert_anchor_checkpoint" and has_t and cache.held()[2]:
            ckpt = cache.held()[2][pick % len(cache.held()[2])]
            return lambda: cache.insert(r.seq[: r.kv], r.mem, checkpoint=ckpt)
        if which in ("insert_freed_checkpoint", "free_checkpoint_twice") and has_t:
            ckpt = pool.save_state(r.mem.state_slot)
            if ckpt is None:
                return None
            pool.free_states([ckpt])  # a valid call; the next use of ckpt is not
            if which == "free_checkpoint_twice":
                return lambda: pool.free_states([ckpt])
            return lambda: cache.insert(r.seq[: r.kv], r.mem, checkpoint=ckpt)
        read = cache._anchor_pages(r.kv) * self.P if r else 0  # the token ids an insert reads
        if which == "insert_bad_tokens" and read:
            bad = list(r.seq[: r.kv])
            bad[pick % read] = float(bad[pick % read]) + 0.5
            return lambda: cache.insert(bad, r.mem)
        if which == "insert_too_long":
            n = (len(r.mem.pages) + 1) * self.P
            return lambda: cache.insert(list(r.seq) + [0] * n, r.mem)
        if which == "unref_request_page":
            mine = [p for p in r.mem.pages if p not in set(cache.held()[0])]
            return mine and (lambda: pool.unref_pages(mine[:1])) or None
        if which == "free_own_slot" and has_t:
            return lambda: pool.free_states([r.mem.state_slot])
        if which == "twice_release":
            return lambda: pool.release([x.mem for x in self.live.values()] + [r.mem])
        if which == "twice_grow":
            return lambda: pool.grow([(r.mem, r.kv), (r.mem, MAX_CONTEXT)])
        if which == "evict_negative":
            return lambda: cache.evict([-1, 0.5, None][pick % 3])
        if which == "admit_bad_chunk":
            return lambda: cache.admit(STEMS[0][:8], [0, -1, 1.5][pick % 3])
        if which == "free_unheld":
            return lambda: pool.free_states([[unheld, -1, 10**9][pick % 3]])
        if which == "save_unheld":
            return lambda: pool.save_state([unheld, -1, 10**9][pick % 3])
        if which == "prefix_unheld":
            pages = tuple(range(10**6, 10**6 + 1 + pick % 3))
            return lambda: pool.admit(MAX_CONTEXT, SharedPrefix(pages, unheld))
        return None

    @rule(nbytes=st.integers(0, 1 << 13))
    def evict(self, nbytes):
        before = self.pool.used_bytes()
        freed = self.cache.evict(nbytes)
        assert self.pool.used_bytes() == before - freed.bytes
        if freed.bytes < nbytes:
            # Short of the ask: nothing the cache alone holds can be freed any more — no
            # unlocked leaf, no anchor with a checkpoint or an SWA unit only its window keeps
            # (anchors of locked nodes were dropped too).
            assert self.cache.evict(1 << 30).bytes == 0
            assert self.cache.stats.checkpoints == 0

    @rule(go=st.integers(0, 3))
    def flush(self, go):
        if go:
            return
        self.cache.flush()
        assert self.cache.tree.size == 0

    @rule(seq=sequences)
    def match(self, seq):
        """A match ends where FULL pages, the SWA window and the checkpoint all exist and hold
        the bytes of exactly the matched tokens."""
        m = self.cache.match(seq)
        k = len(m.pages)
        assert m.num_tokens == k * self.P <= m.full_tokens
        for c, page in enumerate(m.pages):
            assert holds(self.pool, F, page, seq[: (c + 1) * self.P]), f"FULL column {c}"
        if self.spec.has(S) and k:
            first = max(0, k - self.cache.window_pages)
            assert first <= self.pool.swa_stop(k * self.P, k)
            for c in range(first, k):
                assert holds(self.pool, S, m.pages[c], seq[: (c + 1) * self.P]), f"SWA {c}"
        if self.spec.has(T):
            assert (m.checkpoint >= 0) == (k > 0)
            if k:
                assert holds(self.pool, T, m.checkpoint, seq[: k * self.P]), "checkpoint"
        if k:  # the pool's own check of the three kinds accepts it
            self.pool._check_prefix(m.prefix, self.pool.swa_stop(k * self.P, k))

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def holders_are_exact(self):
        if not hasattr(self, "pool"):
            return
        reqs = [r.mem for r in self.live.values()]
        self.cache.check()
        check_holders(self.pool, reqs, *self.cache.held())
        if isinstance(self.pool, UnifiedMemory):
            check_unified(self.pool, reqs)

    @invariant()
    def held_units_hold_their_tokens(self):
        if not hasattr(self, "pool"):
            return
        pool, p = self.pool, self.P
        for r in self.live.values():
            for c, page in enumerate(r.mem.pages):
                toks = r.seq[: (c + 1) * p]
                assert holds(pool, F, page, toks), f"row {r.mem.row}: FULL column {c}"
                if self.spec.has(S) and c >= r.mem.swa_start:
                    assert holds(pool, S, page, toks), f"row {r.mem.row}: SWA column {c}"
            if self.spec.has(T):
                assert holds(pool, T, r.mem.state_slot, r.seq[: r.kv]), f"row {r.mem.row}"
        for node in self.cache.tree.nodes():
            toks = path_tokens(node)
            assert holds(pool, F, node.page, toks), f"cached page {node.page}"
            if node.swa:
                assert holds(pool, S, node.page, toks), f"cached SWA page {node.page}"
            if node.checkpoint >= 0:
                assert holds(pool, T, node.checkpoint, toks), f"checkpoint {node.checkpoint}"

    @invariant()
    def free_bytes_are_poison(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        full, swa = pool.holders()
        slots = [r.mem.state_slot for r in self.live.values()] + self.cache.held()[2]
        owned = {b.data_ptr(): np.zeros(b.numel(), dtype=bool) for b in self._buffers()}
        for buf in self._buffers():
            owned[buf.data_ptr()][: self._sink_bytes(buf)] = True
        for kind, vids in ((F, list(full)), (S, list(swa)), (T, slots)):
            if not self.spec.has(kind):
                continue
            buf, _ = pool._unit_buffer(kind)
            mask = owned[buf.data_ptr()]
            for v in vids:
                view = unit_bytes(pool, kind, v)
                start = view.data_ptr() - buf.data_ptr()
                mask[start : start + view.numel()] = True
        for buf in self._buffers():
            free = buf.numpy()[~owned[buf.data_ptr()]]
            assert bool((free == POISON_BYTE).all()), "a free byte is not poison"

    def _buffers(self):
        if isinstance(self.pool, UnifiedMemory):
            return [self.pool.arena]
        return list(self.pool.pools.values())

    def _sink_bytes(self, buf) -> int:
        pool = self.pool
        if isinstance(pool, UnifiedMemory):
            return pool.header_bytes
        for kind, b in pool.pools.items():
            if b is buf:
                return 0 if kind is T else pool.layout.unit_bytes(kind)
        return 0

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        self.pool.release([r.mem for r in self.live.values()])
        self.cache.flush()
        for kind in self.spec.kinds:
            assert self.pool.live_units(kind) == 0, f"{kind} units leak"
        assert self.pool.holders() == ({}, {})
        if isinstance(self.pool, UnifiedMemory):
            check_unified(self.pool)


MACHINE_SETTINGS = settings(
    max_examples=15, stateful_step_count=30, deadline=None, derandomize=True
)


@pytest.mark.parametrize("kind", ["unified", "static"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_random_sequences(name, kind):
    machine = type("Machine", (PrefixCacheMachine,), {"NAME": name, "KIND": kind})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


# --- deterministic tests -------------------------------------------------------------------------

P4 = 4


def _hybrid(state: bool, draft: bool = False) -> MemorySpec:
    """Page size 4, window 6: a resume point keeps ceil(6 / 4) = 2 SWA pages behind it."""
    layers = (_swa(6), _full(dk=16, dv=8)) + ((_state(),) if state else ())
    lanes = (DraftLane(S, _swa(6)), DraftLane(F, _full())) if draft else ()
    if draft and state:
        lanes += (DraftLane(T, _state()),)
    return MemorySpec(page_size=P4, layers=layers, draft_lanes=lanes)


def _pools(spec: MemorySpec) -> dict[str, MemoryPool]:
    return {
        "unified": UnifiedMemory(spec, 1 << 21, 4, 64, poison=True),
        "static": StaticMemory(spec, 40, 40, 8, 4, 64, poison=True),
    }


def _run(cache: PrefixCache, seq, stops, chunk: int = 64, insert: bool = True):
    """Admit ``seq`` through the cache and compute it in chunks ending at ``stops``: at each
    stop write the state, insert (if asked), retire SWA. Pages get the bytes of their tokens.
    Returns the request's memory (still held)."""
    pool = cache.pool
    adm = cache.admit(seq, chunk)
    assert adm is not None
    mem = adm.mem
    for c in range(mem.shared, len(mem.pages)):
        write(pool, F, mem.pages[c], seq[: (c + 1) * P4], fresh=True)
        if pool.spec.has(S):
            write(pool, S, mem.pages[c], seq[: (c + 1) * P4], fresh=True)
    for kv in stops:
        assert kv <= len(mem.pages) * P4
        if pool.spec.has(T):
            write(pool, T, mem.state_slot, seq[:kv])
        if insert:
            cache.insert(seq[:kv], mem)
        pool.retire_swa([(mem, kv)])
    return mem


@pytest.mark.parametrize("state", [False, True], ids=["full+swa", "full+swa+state"])
def test_partly_retired_window_resumes_only_where_the_window_is_whole(state):
    """A cached prefix of 8 pages whose SWA units survive only behind its two resume points
    (columns 2-3 behind 4, 6-7 behind 8). A query sharing 6 pages has FULL pages for all six,
    yet resumes at 4: one page later (5) its window would need column 4, which is retired —
    attention would read the zero sink — and the pool refuses that prefix."""
    spec = _hybrid(state)
    pool = UnifiedMemory(spec, 1 << 21, 4, 64, poison=True)
    cache = PrefixCache(pool)
    assert cache.window_pages == 2
    seq_a = list(range(100, 140))
    a = _run(cache, seq_a, [16, 32])
    pool.release([a])
    path = cache.tree.walk(seq_a)
    pages = [n.page for n in path]
    assert len(pages) == 8
    assert [pool.swa_bound(p) for p in pages] == [False, False, True, True] * 2
    check_holders(pool, [], *cache.held())

    seq_b = seq_a[:24] + [7] * 16
    m = cache.match(seq_b)
    assert m.full_tokens == 24, "FULL pages exist for six pages"
    assert m.num_tokens == 16, "but the last resume point with a whole window is page 4"

    # One page later: the window behind position 20 starts at column swa_stop(20) = 3.
    first = pool.swa_stop(20, 5)
    assert first == 3
    assert int(pool.swa_v2p[pages[4]]) == -1, "column 4's SWA unit is retired"
    vtok = torch.tensor([pages[c] * P4 + o for c in range(first, 5) for o in range(P4)])
    phys = torch.empty_like(vtok, dtype=torch.int32)
    uk.translate_tokens(vtok.to(torch.int32), pool.swa_v2p, P4, phys)
    assert bool((phys[:P4] > 0).all()), "column 3 is still there"
    assert bool((phys[P4:] == 0).all()), "column 4 resolves to the sink"
    ckpt = path[3].checkpoint if state else -1
    with pytest.raises(ValueError, match="retired"):
        pool.admit(24, SharedPrefix(tuple(pages[:5]), ckpt))

    # Resuming where the cache said: the window behind 16 is bound and the request holds it.
    b = cache.admit(seq_b, 64)
    assert b is not None and b.prefix_tokens == 16
    assert b.mem.swa_start == pool.swa_stop(16, 4) == 2
    row = pool.req_to_token[b.mem.row, 8:16].contiguous()
    phys = torch.empty_like(row)
    uk.translate_tokens(row, pool.swa_v2p, P4, phys)
    assert bool((phys > 0).all()), "the resumed request's window is bound"
    if state:
        assert holds(pool, T, b.mem.state_slot, seq_b[:16])
    check_unified(pool, [b.mem])
    check_holders(pool, [b.mem], *cache.held())


def _gather(pool: MemoryPool, kind: LayerKind, lane: int, vtok: torch.Tensor):
    """K and V rows of virtual tokens ``vtok`` of one lane, read as attention reads them."""
    table = pool.full_v2p if kind is F else pool.swa_v2p
    phys = vtok.clone()
    if table is not None:
        uk.translate_tokens(vtok.contiguous(), table, P4, phys)
    k, v = pool.kv_cache(kind, lane)
    pg, off = phys.long() // P4, phys.long() % P4
    return k[pg, off].clone(), v[pg, off].clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (the bytes are random: some are NaN patterns)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _state_of(pool: MemoryPool, slot: int):
    phys = int(pool.physical_state_slots(torch.tensor([slot], dtype=torch.int32))[0])
    lanes = pool.layout.state.num_lanes
    return [tuple(t[phys].clone() for t in pool.state_cache(lane)) for lane in range(lanes)]


@pytest.mark.parametrize("kind", ["unified", "static"])
def test_hit_reads_exactly_the_cached_bytes(kind):
    """A request admitted on a hit reads, through the views and tables attention uses, the
    FULL K/V of every shared token and the SWA K/V of its window as the inserting request
    wrote them (draft lanes included), and starts from a copy of the checkpoint — a copy:
    the inserting request's later state does not leak into it."""
    spec = _hybrid(state=True, draft=True)
    pool = _pools(spec)[kind]
    cache = PrefixCache(pool)
    seq = list(range(200, 236))
    a = _run(cache, seq, [16])
    row_a = pool.req_to_token[a.row, :16].clone()
    lanes = {k: pool.layout.of(k).num_lanes for k in (F, S)}
    want_full = {ln: _gather(pool, F, ln, row_a) for ln in range(lanes[F])}
    want_swa = {ln: _gather(pool, S, ln, row_a[8:]) for ln in range(lanes[S])}
    want_state = _state_of(pool, a.state_slot)
    write(pool, T, a.state_slot, seq[:20])  # the inserting request moves on
    pool.retire_swa([(a, 20)])

    b = cache.admit(seq[:16] + [1, 2, 3, 4, 5], 8)
    assert b is not None and b.prefix_tokens == 16
    row_b = pool.req_to_token[b.mem.row, :16].clone()
    assert torch.equal(row_b, row_a), "the shared pages are written into the new row"
    for ln in range(lanes[F]):
        for got, want in zip(_gather(pool, F, ln, row_b), want_full[ln], strict=True):
            assert _same(got, want), f"FULL lane {ln}"
    for ln in range(lanes[S]):
        for got, want in zip(_gather(pool, S, ln, row_b[8:]), want_swa[ln], strict=True):
            assert _same(got, want), f"SWA lane {ln}"
    got_state = _state_of(pool, b.mem.state_slot)
    assert b.mem.state_slot != a.state_slot
    for ln, (got, want) in enumerate(zip(got_state, want_state, strict=True)):
        assert _same(got[0], want[0]) and _same(got[1], want[1]), f"state {ln}"
    assert not holds(pool, T, b.mem.state_slot, seq[:20])
    pool.release([a, b.mem])
    check_holders(pool, [], *cache.held())
    cache.flush()
    assert all(pool.live_units(k) == 0 for k in spec.kinds)


@pytest.mark.parametrize("kind", ["unified", "static"])
def test_pool_sharing_contract(kind):
    """Holders are counted per page and kind: retiring or releasing one holder never unbinds
    a unit another still holds; a retired unit cannot be shared again; a checkpoint is an
    independent copy; a held page id is never handed out again."""
    spec = _hybrid(state=True)
    pool = _pools(spec)[kind]
    a = pool.admit(16)
    for c, page in enumerate(a.pages):
        write(pool, F, page, [c], fresh=True)
        write(pool, S, page, [c], fresh=True)
    write(pool, T, a.state_slot, [9])
    pool.ref_pages(a.pages, a.pages[2:])  # a second holder (say, the cache)
    assert pool.retire_swa([(a, 16)]) == 2  # a lets go of columns 0-1: nobody else holds them
    assert [pool.swa_bound(p) for p in a.pages] == [False, False, True, True]
    with pytest.raises(ValueError, match="not bound"):
        pool.ref_pages([], [a.pages[0]])
    ckpt = pool.save_state(a.state_slot)
    assert ckpt is not None and holds(pool, T, ckpt, [9])
    write(pool, T, a.state_slot, [10])
    assert holds(pool, T, ckpt, [9]), "a checkpoint is a copy"
    pages = list(a.pages)
    freed = pool.release([a])
    assert freed.full == 0 and freed.swa == 0 and freed.state == 1
    for c, page in enumerate(pages):
        assert holds(pool, F, page, [c]), "pages the second holder keeps stay intact"
    b = pool.admit(16)
    assert not set(b.pages) & set(pages), "held page ids are not handed out again"
    freed = pool.unref_pages(pages, pages[2:])
    assert (freed.full, freed.swa) == (4, 2)
    assert freed.bytes == 4 * pool.layout.unit_bytes(F) + 2 * pool.layout.unit_bytes(S)
    pool.free_states([ckpt])
    pool.release([b])
    assert all(pool.live_units(k) == 0 for k in spec.kinds)
    with pytest.raises(ValueError, match="no holder taken by ref_pages"):
        pool.unref_pages([pages[0]])


def test_eviction_is_lru_over_unlocked_leaves():
    """Locked nodes (pages a running request holds) are never evicted; among the others, a
    leaf that is no resume point goes first, then the least recently used."""
    spec = _hybrid(state=True)
    pool = UnifiedMemory(spec, 1 << 21, 4, 64, poison=True)
    cache = PrefixCache(pool)
    ub = pool.layout.unit_bytes
    x, y, z = ([base + i for i in range(24)] for base in (100, 200, 300))
    pool.release([_run(cache, x, [8, 16])])  # anchors at pages 2 and 4
    pool.release([_run(cache, y, [8])])
    pool.release([_run(cache, z, [8])])
    held = cache.admit(y + [1], 8)  # y is locked while this request runs
    assert held is not None and held.prefix_tokens == 8

    # The least recently used unlocked leaf is x's anchor at page 4 (y is newer but locked).
    freed = cache.evict(1)
    assert (freed.full, freed.state) == (1, 1) and freed.bytes >= ub(F) + ub(T)
    assert cache.match(x).num_tokens == 8 and cache.match(x).full_tokens == 12
    # x's page 3 is now a leaf but no resume point: it goes before z's anchor, even when
    # used more recently.
    cache.tree.walk(x)[2].last_access = 10**9
    cache.evict(1)
    assert cache.match(x).full_tokens == 8 and cache.match(z).num_tokens == 8
    # Everything unlocked goes before anything of the locked path.
    while cache.match(x).full_tokens or cache.match(z).full_tokens:
        assert cache.evict(1).bytes > 0
        assert cache.match(y).num_tokens == 8, "locked by the running request"
    # Then the locked anchor gives back its checkpoint (its pages stay with the request).
    assert cache.evict(1).state == 1
    assert cache.match(y).num_tokens == 0 and cache.match(y).full_tokens == 8
    pool.release([held.mem])
    cache.evict(1 << 30)
    assert cache.tree.size == 0
    assert all(pool.live_units(k) == 0 for k in spec.kinds)


@pytest.mark.parametrize("kind", ["unified", "static"])
@pytest.mark.parametrize("state", [False, True], ids=["full+swa", "full+swa+state"])
def test_eviction_drops_the_anchors_of_locked_nodes(state, kind):
    """When no unlocked leaf is left, eviction drops anchors of locked nodes (LRU, deeper
    first): their checkpoint slots and the SWA units only their windows keep are freed, match
    no longer ends there, and the running request's pages are untouched. An anchor whose
    dropping would free nothing (no checkpoint, window still held by the request) is kept."""
    spec = _hybrid(state=state)
    pool = _pools(spec)[kind]
    cache = PrefixCache(pool)
    ub = pool.layout.unit_bytes
    seq = list(range(40, 64))  # 6 pages; anchors at 2, 4, 6 (windows: 2 pages behind each)
    a = _run(cache, seq, [8, 16, 24])
    assert a.swa_start == 4, "the request retired columns 0-3: only the cache holds them"
    assert all(pool.page_refs(page) == 2 for page in a.pages), "every node is locked"
    assert cache.match(seq).num_tokens == 24
    used = pool.used_bytes()

    def request_untouched():
        check_holders(pool, [a], *cache.held())
        cache.check()
        for c, page in enumerate(a.pages):
            assert holds(pool, F, page, seq[: (c + 1) * P4])
            if c >= a.swa_start:
                assert holds(pool, S, page, seq[: (c + 1) * P4])
        if state:
            assert holds(pool, T, a.state_slot, seq)

    freed = cache.evict(1)
    assert freed.full == 0 and pool.used_bytes() == used - freed.bytes
    if state:
        # the anchor at 6: its checkpoint (its window's SWA units are the request's too)
        assert (freed.state, freed.swa) == (1, 0) and freed.bytes == ub(T)
        assert cache.match(seq).num_tokens == 16 and cache.match(seq).full_tokens == 24
    else:
        # the anchor at 6 would free nothing: the one at 4 goes, with columns 2-3
        assert (freed.state, freed.swa) == (0, 2) and freed.bytes == 2 * ub(S)
        assert cache.match(seq).num_tokens == 24, "the window behind 6 is still held"
        assert cache.match(seq[:16]).num_tokens == 8, "no resume point at 4 any more"
    request_untouched()

    # Ask for more than is left: every anchor that frees something goes.
    used = pool.used_bytes()
    freed = cache.evict(1 << 30)
    assert freed.full == 0 and pool.used_bytes() == used - freed.bytes
    assert freed.swa == (4 if state else 2) and freed.state == (2 if state else 0)
    assert cache.stats.anchors == (0 if state else 1)
    assert cache.match(seq).num_tokens == (0 if state else 24)
    assert cache.match(seq).full_tokens == 24, "the locked nodes stay"
    assert cache.evict(1).bytes == 0, "nothing of its own is left"
    request_untouched()
    pool.release([a])
    cache.evict(1 << 30)
    assert cache.tree.size == 0
    assert all(pool.live_units(k) == 0 for k in spec.kinds)


def test_admission_keeps_the_window_of_its_match_while_evicting():
    """The matched point's SWA window may be held only by a deeper anchor. When admission
    must evict to fit, that anchor may go — but the window of the point being resumed must
    stay (regression: the pool then refused the prefix, its SWA unit retired)."""
    spec = SPECS["full+swa"]  # page size 2, window 5: 3 pages behind a resume point
    pool = StaticMemory(spec, 14, 9, 1, 4, MAX_CONTEXT, poison=True)
    cache = PrefixCache(pool, checkpoint_interval=2)
    filler = pool.admit(13)  # 7 pages: with the cache's two, the 9 SWA pages are all held
    seq = [1, 2, 0, 0]
    adm = cache.admit(seq, 1)
    mem = adm.mem
    assert pool.grow([(mem, 4)])
    cache.insert(seq, mem)  # anchor at page 2; its window holds pages 1 and 2
    pool.retire_swa([(mem, 4)])
    pool.release([mem])
    b = cache.admit([1, 2, 0], 1)  # resumes at page 1; must evict the anchor at 2 to fit
    assert b is not None and b.prefix_tokens == 2
    assert pool.swa_bound(b.mem.pages[0])
    cache.check()
    check_holders(pool, [filler, b.mem], *cache.held())


def test_insert_adopts_a_page_whose_swa_unit_is_gone():
    """Two requests computed the same prefix; the cached copy's SWA units behind page 6 are
    retired. When the second inserts an anchor at 6, the nodes of columns 4-5 adopt its pages
    (same tokens, SWA still bound) instead of giving up the resume point."""
    spec = _hybrid(state=True)
    pool = UnifiedMemory(spec, 1 << 21, 4, 64, poison=True)
    cache = PrefixCache(pool)
    seq = list(range(50, 90))
    pool.release([_run(cache, seq, [32])])  # anchor at 8: SWA kept for columns 6-7 only
    old = [n.page for n in cache.tree.walk(seq)]
    assert not pool.swa_bound(old[4]) and not pool.swa_bound(old[5])
    b = _run(cache, seq[:24] + [1] * 8, [24], insert=False)  # a miss: computes its own pages
    assert b.shared == 0
    assert cache.insert(seq[:24], b).tokens == 24
    assert cache.stats.adopted_pages == 2
    now = [n.page for n in cache.tree.walk(seq)]
    assert now[4:6] == b.pages[4:6] and now[:4] == old[:4] and now[6:] == old[6:]
    assert pool.page_refs(old[4]) == 0, "the replaced pages were let go"
    assert cache.match(seq[:28]).num_tokens == 24
    assert cache.match(seq).num_tokens == 32, "the deeper anchor still resumes"
    pool.release([b])
    cache.check()
    check_holders(pool, [], *cache.held())


def test_stats_and_full_only_model():
    """A FULL-only model resumes at any page boundary; stats count lookups and hits."""
    pool = UnifiedMemory(SPECS["full"], 1 << 20, 4, 64)
    cache = PrefixCache(pool)
    seq = list(range(30))
    a = cache.admit(seq, 64)
    assert cache.insert(seq[:30], a.mem).tokens == 28  # 7 whole pages
    pool.release([a.mem])
    b = cache.admit(seq[:13] + [0] * 5, 64)
    assert b.prefix_tokens == 12
    d = cache.stats.as_dict()
    assert d["lookups"] == 2 and d["hit_tokens"] == 12 and d["hit_requests"] == 1
    assert d["cached_pages"] == 7 and d["retained_swa_pages"] == 0 and d["checkpoints"] == 0
    assert 0 < d["hit_rate"] < 1
    assert set(d) == {f.name for f in dataclasses.fields(CacheStats)} | {"hit_rate"}
    d["lookups"] = -1  # a copy: the cache's counters are not the caller's
    assert cache.stats.lookups == 2
    pool.release([b.mem])
    assert cache.flush().full == 7


@contextmanager
def _no_host_sync():
    """Any synchronising CUDA call inside raises (PyTorch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["unified", "static"])
def test_cache_paths_do_not_sync_cuda(kind):
    """Admission on a hit (shared pages into the row, checkpoint copy through the STATE
    translation), insertion (checkpoint save), eviction and release never read the device."""
    spec = _hybrid(state=True, draft=True)
    if kind == "unified":
        pool = UnifiedMemory(spec, 1 << 22, 8, 64, device="cuda", poison=True)
    else:
        pool = StaticMemory(spec, 60, 60, 16, 8, 64, device="cuda", poison=True)
    cache = PrefixCache(pool)

    def serve(seq, stops):
        adm = cache.admit(seq, 64)
        for kv in stops:
            cache.insert(seq[:kv], adm.mem)
            pool.retire_swa([(adm.mem, kv)])
        return adm

    seqs = [[s] * 4 + list(range(28)) for s in range(3)]
    for seq in seqs:  # warm-up: first launches of every op
        pool.release([serve(seq, [16, 24]).mem])
    cache.flush()
    torch.cuda.synchronize()
    with _no_host_sync():
        held = [serve(seq, [16, 24]) for seq in seqs]
        pool.release([a.mem for a in held])
        hits = [serve(seq[:20] + [9] * 8, [28]) for seq in seqs]
        assert all(a.prefix_tokens == 16 for a in hits)
        cache.evict(1 << 16)
        pool.release([a.mem for a in hits])
        cache.flush()
    torch.cuda.synchronize()
    assert all(pool.live_units(k) == 0 for k in spec.kinds)
