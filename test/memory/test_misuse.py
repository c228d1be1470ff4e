"""The memory API refuses misuse before it changes anything.

Each case is a call that breaks the contract the way a scheduler, an abort path or a plugin
might: a released (stale) handle, the same request twice in one batch, a double free, a
request's own slot or page let go through the sharing entry points, an argument of the wrong
type or out of range. Every one must raise ``ValueError`` naming the argument and leave the
pool bit-identical — arena / pool bytes, request table, ``v2p`` / ``p2v`` / free stacks,
bands, holder counts, live handles, host id pools, stats (``pool_state.snapshot``) — with
every invariant still holding (``check_holders``, ``check_unified``).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from pool_state import changed, snapshot
from specs import SPECS, F, S, T

from unimem.cache import Insertion, PrefixCache
from unimem.memory.band_plan import Side
from unimem.memory.checks import check_holders, check_unified
from unimem.memory.pool import MemoryPool, RequestMemory, SharedPrefix
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory

HYBRID = SPECS["full+swa+state"]  # page size 4, windows 6 and 9
KINDS = ["unified", "static"]


def make_pool(kind: str, spec=HYBRID) -> MemoryPool:
    if kind == "unified":
        return UnifiedMemory(spec, 1 << 20, max_requests=4, max_context=40, poison=True)
    return StaticMemory(spec, 40, 30, 8, max_requests=4, max_context=40, poison=True)


def check(pool: MemoryPool, reqs=(), cache: PrefixCache | None = None, slots=()) -> None:
    held = cache.held() if cache is not None else ([], [], [])
    check_holders(pool, reqs, held[0], held[1], list(held[2]) + list(slots))
    if cache is not None:
        cache.check()
    if isinstance(pool, UnifiedMemory):
        check_unified(pool, reqs)


def refused(call, match: str, *objs) -> None:
    """``call()`` raises ``ValueError`` matching ``match`` and changes none of ``objs``."""
    before = snapshot(*objs)
    with pytest.raises(ValueError, match=match):
        call()
    diff = changed(before, snapshot(*objs))
    assert not diff, f"a refused call changed {diff}"


def _fill(pool: MemoryPool, req: RequestMemory) -> None:
    """Give a request's units nonzero bytes, so that a wrong copy or free shows."""
    for kind in (F, S):
        if pool.spec.has(kind):
            buf, base = pool._unit_buffer(kind)
            table = pool.full_v2p if kind is F else pool.swa_v2p
            ub = pool.layout.unit_bytes(kind)
            for p in req.pages[req.swa_start if kind is S else 0 :]:
                phys = p if table is None else int(table[p])
                buf[base + phys * ub : base + (phys + 1) * ub] = 7
    if pool.spec.has(T):
        phys = int(pool.physical_state_slots(torch.tensor([req.state_slot]))[0])
        buf, base = pool._unit_buffer(T)
        ub = pool.layout.unit_bytes(T)
        buf[base + phys * ub : base + (phys + 1) * ub] = 9


@pytest.fixture(params=KINDS)
def setup(request):
    """A pool with two running requests (``a``: 9 tokens, SWA columns retired; ``b``: 5)."""
    pool = make_pool(request.param)
    a, b = pool.admit(9), pool.admit(5)
    assert a is not None and b is not None
    assert pool.grow([(a, 24)])
    pool.retire_swa([(a, 24)])
    assert a.swa_start > 0
    _fill(pool, a)
    _fill(pool, b)
    check(pool, [a, b])
    return pool, a, b


# --- stale handles ---------------------------------------------------------------------------


def test_stale_handle_after_its_row_is_reused(setup):
    pool, a, b = setup
    pool.release([a])
    c = pool.admit(13)
    assert c is not None and c.row == a.row and c.generation != a.generation
    _fill(pool, c)
    live = [b, c]
    stale = "not a live request handle"
    refused(lambda: pool.release([a]), stale, pool, a)
    refused(lambda: pool.grow([(a, 30)]), stale, pool, a)
    refused(lambda: pool.grow([(b, 30), (a, 30)]), stale, pool, a)
    refused(lambda: pool.retire_swa([(a, 0)]), stale, pool, a)
    check(pool, live)


def test_stale_handle_while_its_row_is_free(setup):
    pool, a, b = setup
    pool.release([a])
    refused(lambda: pool.grow([(a, 20)]), "row .* is not in use", pool, a)
    refused(lambda: pool.release([a]), "not a live", pool, a)
    check(pool, [b])


def test_a_copy_or_a_foreign_handle_is_not_live(setup):
    pool, a, b = setup
    twin = dataclasses.replace(a, pages=list(a.pages))
    refused(lambda: pool.grow([(twin, 30)]), "not a live", pool)
    other = make_pool("unified")
    c = other.admit(4)
    refused(lambda: pool.release([c]), "not a live", pool, other)
    refused(lambda: pool.release(a), "reqs must be a sequence", pool)
    refused(lambda: pool.release([a.row]), r"reqs\[0\] must be a RequestMemory", pool)
    check(pool, [a, b])


# --- duplicates within one batch ------------------------------------------------------------


def test_same_request_twice_in_one_batch(setup):
    pool, a, b = setup
    twice = "appears twice"
    refused(lambda: pool.grow([(a, 28), (a, 36)]), twice, pool)
    refused(lambda: pool.release([a, b, a]), twice, pool)
    refused(lambda: pool.retire_swa([(b, 5), (b, 5)]), twice, pool)
    check(pool, [a, b])


# --- state slots -------------------------------------------------------------------------------


def test_checkpoint_freed_twice(setup):
    pool, a, b = setup
    s = pool.save_state(a.state_slot)
    assert s is not None
    refused(lambda: pool.free_states([s, s]), "appears twice", pool)
    pool.free_states([s])
    refused(lambda: pool.free_states([s]), "not held", pool)
    check(pool, [a, b])
    # The next checkpoint is a real, bound slot holding a's state.
    t = pool.save_state(a.state_slot)
    assert t is not None and int(pool.physical_state_slots(torch.tensor([t]))[0]) >= 0
    check(pool, [a, b], slots=[t])


def test_a_requests_own_slot_cannot_be_freed(setup):
    pool, a, b = setup
    refused(lambda: pool.free_states([b.state_slot]), "own slot of the live request", pool)
    check(pool, [a, b])


@pytest.mark.parametrize("slot", [10**7, -1, "free", 1.0])
def test_save_state_of_a_slot_not_held(setup, slot):
    pool, a, b = setup
    if slot == "free":
        slot = next(s for s in range(1, 100) if s not in (a.state_slot, b.state_slot))
    refused(lambda: pool.save_state(slot), "slot", pool)
    check(pool, [a, b])


def test_save_state_of_slot_zero_on_the_arena():
    pool = make_pool("unified")
    a = pool.admit(4)
    refused(lambda: pool.save_state(0), "not held", pool)
    check(pool, [a])


def test_copy_states_checks_every_slot(setup):
    pool, a, b = setup
    s = pool.save_state(a.state_slot)
    free = next(x for x in range(1, 100) if x not in (a.state_slot, b.state_slot, s))
    refused(lambda: pool.copy_states([free], [s]), r"src\[0\].*not held", pool)
    refused(lambda: pool.copy_states([a.state_slot], [free]), r"dst\[0\].*not held", pool)
    refused(lambda: pool.copy_states([s], [s]), "also a source", pool)
    refused(lambda: pool.copy_states([a.state_slot, b.state_slot], [s, s]), "twice", pool)
    refused(lambda: pool.copy_states([a.state_slot], []), "1 sources, 0 destinations", pool)
    check(pool, [a, b], slots=[s])


def test_state_calls_on_a_model_without_state():
    pool = UnifiedMemory(SPECS["full+swa"], 1 << 16, 4, 40)
    a = pool.admit(3)
    refused(lambda: pool.save_state(1), "no STATE layers", pool)
    refused(lambda: pool.free_states([1]), "no STATE layers", pool)
    refused(lambda: pool.compact(T), "kind: the arena has no", pool)
    refused(lambda: pool.compact("state"), "kind", pool)
    check(pool, [a])


# --- pages -----------------------------------------------------------------------------------


def test_a_requests_pages_cannot_be_unreferenced(setup):
    pool, a, b = setup
    no_ref = "no holder taken by ref_pages"
    refused(lambda: pool.unref_pages([b.pages[0]]), no_ref, pool)
    refused(lambda: pool.unref_pages([], [b.pages[0]]), no_ref, pool)
    # A second holder may let go of its own hold only, once, SWA no later than FULL.
    pool.ref_pages([a.pages[-1]], [a.pages[-1]])
    refused(lambda: pool.unref_pages([a.pages[-1]]), "SWA hold must be dropped", pool)
    refused(lambda: pool.unref_pages([a.pages[-1], a.pages[-1]]), "twice", pool)
    refused(lambda: pool.ref_pages([], [b.pages[0]]), "needs a FULL hold", pool)
    retired = a.pages[0]
    refused(lambda: pool.ref_pages([], [retired]), "not bound", pool)
    refused(lambda: pool.ref_pages([10**6]), "has no holder", pool)
    refused(lambda: pool.ref_pages([1.5]), r"pages\[0\] must be an int", pool)
    pool.unref_pages([a.pages[-1]], [a.pages[-1]])
    check(pool, [a, b])


# --- ranges and types --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "match"),
    [
        (1.5, "num_tokens must be an int"),
        (True, "num_tokens must be an int"),
        (torch.tensor(3), "num_tokens must be an int"),
        (0, r"num_tokens must be in \[1, max_context=40\], got 0"),
        (-5, r"num_tokens must be in \[1, max_context=40\], got -5"),
        (41, "max_context"),
    ],
)
def test_admit_refuses_bad_token_counts(setup, num_tokens, match):
    pool, a, b = setup
    refused(lambda: pool.admit(num_tokens), match, pool)
    check(pool, [a, b])


@pytest.mark.parametrize("target", [-3, 0, 41, 2.0, None])
def test_grow_refuses_bad_targets(setup, target):
    pool, a, b = setup
    refused(lambda: pool.grow([(b, 12), (a, target)]), r"batch\[1\] tokens", pool)
    refused(lambda: pool.grow([(a,)]), r"batch\[0\] must be a \(request, tokens\) pair", pool)
    check(pool, [a, b])


@pytest.mark.parametrize(
    "reserve,match",
    [
        ([12, 3], r"reserve\[1\] = 3 is below its request's target 28"),
        ([12], "reserve has 1 counts for 2 requests"),
        ([12, 30.0], r"reserve\[1\] must be an int"),
        ("ab", "reserve must be a sequence"),
    ],
)
def test_grow_refuses_a_bad_reserve(setup, reserve, match):
    pool, a, b = setup
    refused(lambda: pool.grow([(b, 12), (a, 28)], lambda: reserve), match, pool)
    refused(lambda: pool.grow([(b, 12), (a, 28)], [12, 40]), "reserve must be a callable", pool)
    check(pool, [a, b])


def test_grow_reserves_ahead_only_when_pages_are_needed_and_free(setup):
    """With ``reserve``, a batch that needs a page gets the pages up to each reserve in one
    allocation; one that needs none gets nothing; where the pool cannot give the reserve,
    it gives what the targets need."""
    pool, a, b = setup
    assert len(a.pages) == 6 and len(b.pages) == 2
    asked = []
    assert pool.grow([(a, 24), (b, 8)], lambda: asked.append(1))  # covered: never asked
    assert len(a.pages) == 6 and len(b.pages) == 2 and not asked
    assert pool.grow([(a, 24), (b, 9)], lambda: [28, 16])  # b needs one: both take reserve
    assert len(a.pages) == 7 and len(b.pages) == 4
    check(pool, [a, b])
    assert pool.grow([(a, 29), (b, 16)], lambda: [10**6, 40])  # capped at max_context
    assert len(a.pages) == 10 and len(b.pages) == 10
    check(pool, [a, b])


def test_grow_falls_back_to_what_the_targets_need():
    """Pages ahead come only from pages to spare: not when they do not fit, nor when they
    would leave fewer free pages than the batch has requests."""
    pool = StaticMemory(HYBRID, 8, 8, 8, max_requests=4, max_context=40, poison=True)
    a = pool.admit(4)
    assert a is not None and len(a.pages) == 1
    assert pool.grow([(a, 5)], lambda: [40])  # 10 pages do not fit in 8: the 2 needed given
    assert len(a.pages) == 2
    assert pool.grow([(a, 9)], lambda: [32])  # 8 pages fit, but would leave none free
    assert len(a.pages) == 3
    assert pool.grow([(a, 13)], lambda: [20])  # 5 pages: 3 free after, taken
    assert len(a.pages) == 5
    check(pool, [a])


@pytest.mark.parametrize("kind", KINDS)
def test_pages_ahead_keep_a_page_per_request_free(kind):
    """The reserve is taken only while every request of the batch would still find a free
    page after it."""
    pool = make_pool(kind)
    reqs = [pool.admit(4) for _ in range(4)]
    assert all(r is not None for r in reqs)
    batch = [(r, 5) for r in reqs]
    assert pool.grow(batch, lambda: [40] * 4)
    pages = [len(r.pages) for r in reqs]
    assert pages == [2] * 4 or pages == [10] * 4  # all or nothing
    check(pool, reqs)


@pytest.mark.parametrize("pos", [-1, 25, 0.5])
def test_retire_swa_refuses_bad_positions(setup, pos):
    pool, a, b = setup
    refused(lambda: pool.retire_swa([(a, 24), (b, pos)]), r"batch\[1\] pos", pool)
    check(pool, [a, b])


def test_admit_refuses_a_bad_prefix(setup):
    pool, a, b = setup
    live_page = b.pages[0]
    ckpt = pool.save_state(b.state_slot)
    cases = [
        (SharedPrefix((live_page,), ckpt), -5, "num_tokens must be in"),
        (SharedPrefix((live_page,), ckpt), 3, "does not cover the 1-page shared prefix"),
        (SharedPrefix((live_page, live_page), ckpt), 12, r"prefix.pages\[1\]: id .* twice"),
        (SharedPrefix((live_page,), 10**6), 8, "prefix.checkpoint .* not a held"),
        (SharedPrefix((10**6,), ckpt), 8, "has no holder"),
        (SharedPrefix((a.pages[0], a.pages[1]), ckpt), 12, "retired"),
        (SharedPrefix(("x",), ckpt), 8, "must be an int"),
        ((live_page,), 8, "prefix must be a SharedPrefix"),
    ]
    for prefix, n, match in cases:
        refused(lambda prefix=prefix, n=n: pool.admit(n, prefix), match, pool)
    check(pool, [a, b], slots=[ckpt])


def test_compact_refuses_a_side_the_band_does_not_grow_at():
    pool = make_pool("unified")
    a = pool.admit(12)
    i = pool._band_index[T]
    assert pool.bands.sides(i) == [Side.UP]
    refused(lambda: pool.compact(T, Side.DOWN), "side: the STATE band grows at UP", pool)
    refused(lambda: pool.compact(F, "up"), "side", pool)
    check(pool, [a])


def test_views_and_queries_refuse_unknown_arguments(setup):
    pool, a, b = setup
    refused(lambda: pool.kv_cache(F, 99), "no view", pool)
    refused(lambda: pool.state_cache(99), "no view", pool)
    refused(lambda: pool.fits_alone(-1, 0), "num_tokens must be >= 0", pool)
    refused(lambda: pool.fits_alone(4, 0.5), "swa_tokens must be an int", pool)


# --- the smallest arena ---------------------------------------------------------------------


def _needed(spec) -> int:
    with pytest.raises(ValueError, match="too small") as err:
        UnifiedMemory(spec, 16, 1, 64)
    return int(re.search(r"need (\d+) bytes", str(err.value)).group(1))


@pytest.mark.parametrize(
    "spec",
    [SPECS["full+swa"], SPECS["full+state"], dataclasses.replace(HYBRID, page_size=64), HYBRID],
    ids=["full+swa/page1", "full+state/page4", "full+swa+state/page64", "full+swa+state/page4"],
)
def test_the_smallest_arena_accepted_admits_a_one_token_request(spec):
    """The constructor names the bytes one minimal request needs (the sinks, one unit of
    every kind, and what the bands' unit grids waste between them); an arena of that size
    admits a 1-token request, 16 bytes less is refused."""
    need = _needed(spec)
    probe = UnifiedMemory(spec, need, 1, 64)
    naive = probe.header_bytes + sum(probe.layout.unit_bytes(k) for k in probe.kinds)
    assert need >= naive
    req = probe.admit(1)
    assert req is not None, f"an arena of {need} bytes cannot admit a 1-token request"
    check(probe, [req])
    with pytest.raises(ValueError, match=f"need {need} bytes"):
        UnifiedMemory(spec, need - 16, 1, 64)


def test_every_arena_the_constructor_accepts_admits_a_one_token_request():
    spec = SPECS["full+swa+state"]
    need = _needed(spec)
    probe = UnifiedMemory(spec, need, 1, 64)
    lo = probe.header_bytes + sum(probe.layout.unit_bytes(k) for k in probe.kinds)
    for size in range(lo - lo % 16, need + 2 * probe.layout.unit_bytes(F), 16):
        try:
            mem = UnifiedMemory(spec, size, 1, 64)
        except ValueError:
            assert size < need
            continue
        assert mem.admit(1) is not None, f"arena of {size} bytes"


def test_constructors_refuse_bad_sizes():
    with pytest.raises(ValueError, match="arena_bytes must be an int"):
        UnifiedMemory(HYBRID, 1e6, 1, 64)
    with pytest.raises(ValueError, match="max_requests must be an int"):
        UnifiedMemory(HYBRID, 1 << 20, 1.0, 64)
    with pytest.raises(ValueError, match="num_swa_pages must be an int"):
        StaticMemory(HYBRID, 4, 2.5, 2, 1, 64)


# --- the prefix cache ------------------------------------------------------------------------

SEQ = list(range(100, 124))


@pytest.fixture(params=KINDS)
def cached(request):
    """A cache holding an anchor at 16 tokens of ``SEQ`` (made by ``a``, still running)."""
    pool = make_pool(request.param)
    cache = PrefixCache(pool)
    adm = cache.admit(SEQ, 24)
    a = adm.mem
    ins = cache.insert(SEQ[:16], a)
    assert isinstance(ins, Insertion) and ins.tokens == 16
    assert ins.checkpoint >= 0 and cache.held()[2] == [ins.checkpoint]
    pool.retire_swa([(a, 16)])
    check(pool, [a], cache)
    return pool, cache, a


def test_insert_returns_the_checkpoint_it_makes(cached):
    pool, cache, a = cached
    again = cache.insert(SEQ[:16], a)
    assert again == Insertion(16, -1), "an anchor already there: no new checkpoint"
    snap = pool.save_state(a.state_slot)
    ins = cache.insert(SEQ[:20], a, checkpoint=snap)
    assert ins == Insertion(20, snap) and snap in cache.held()[2]
    check(pool, [a], cache)
    # Without STATE layers there is no checkpoint.
    plain = UnifiedMemory(SPECS["full+swa"], 1 << 16, 4, 40)
    pc = PrefixCache(plain)
    b = pc.admit(list(range(12)), 12).mem
    assert pc.insert(list(range(12)), b) == Insertion(12, -1)


def test_insert_refuses_a_stale_handle(cached):
    pool, cache, a = cached
    b = cache.admit(SEQ[:16] + [1, 2, 3, 4, 5], 8).mem
    pool.release([b])
    c = pool.admit(4)  # takes b's row
    assert c.row == b.row
    refused(lambda: cache.insert(SEQ[:16], b), "req is not a live request handle", pool, cache)
    check(pool, [a, c], cache)


def test_insert_refuses_bad_checkpoints(cached):
    pool, cache, a = cached
    (anchor_ckpt,) = cache.held()[2]
    freed = pool.save_state(a.state_slot)
    pool.free_states([freed])
    for ckpt, match in [
        (freed, "checkpoint: state slot .* not held"),
        (a.state_slot, "own slot of the live request"),
        (anchor_ckpt, "already an anchor's"),
        (10**7, "not held"),
        (1.5, "checkpoint must be an int"),
    ]:
        refused(lambda ckpt=ckpt: cache.insert(SEQ[:20], a, checkpoint=ckpt), match, pool, cache)
    check(pool, [a], cache)


def test_insert_refuses_bad_tokens_and_keeps_the_callers_checkpoint(cached):
    pool, cache, a = cached
    snap = pool.save_state(a.state_slot)
    bad = SEQ[:17] + [1.5] + SEQ[18:20]
    refused(lambda: cache.insert(bad, a, checkpoint=snap), "token ids must be ints", pool, cache)
    refused(lambda: cache.insert(SEQ + [0] * 20, a, snap), "the request holds", pool, cache)
    refused(lambda: cache.insert("abcd", a, snap), "tokens must be a sequence", pool, cache)
    check(pool, [a], cache, slots=[snap])
    pool.free_states([snap])


def test_cache_admit_and_evict_refuse_bad_arguments(cached):
    pool, cache, a = cached
    refused(lambda: cache.admit(SEQ, 0), "chunk must be >= 1", pool, cache)
    refused(lambda: cache.admit(SEQ, 2.0), "chunk must be an int", pool, cache)
    refused(lambda: cache.admit([], 4), "at least one token", pool, cache)
    refused(lambda: cache.admit(7, 4), "tokens must be a sequence", pool, cache)
    refused(lambda: cache.evict(-1), "num_bytes must be >= 0", pool, cache)
    refused(lambda: cache.evict(None), "num_bytes must be an int", pool, cache)
    refused(lambda: cache.match(SEQ[:4] + [None] * 4), "token ids must be ints", pool, cache)
    check(pool, [a], cache)


def test_the_caches_pages_are_not_a_requests_to_drop(cached):
    """The cache's holds and a request's holds are separate: a request's page the cache does
    not hold cannot be unreferenced, a cached page only as often as the cache took it."""
    pool, cache, a = cached
    mine = a.pages[-1]  # column 5: not cached
    assert mine not in cache.held()[0]
    refused(lambda: pool.unref_pages([mine]), "no holder taken by ref_pages", pool, cache)
    check(pool, [a], cache)
