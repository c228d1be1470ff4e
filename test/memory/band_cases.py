"""The two sequences of issue 48's band-overlap report, as functions that raise
``AssertionError`` explicitly (never ``assert``), so that they check the same under
``python -O`` (``test_band_regressions`` runs them both ways). Tests import this module by
name (pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

import torch
from pool_state import changed, pool_snapshot
from specs import SPECS, geometry

from unimem.cache import PrefixCache
from unimem.memory.checks import check_unified
from unimem.memory.unified import UnifiedMemory


def _fail(message: str) -> None:
    raise AssertionError(message)


def _no_shared_bytes(mem: UnifiedMemory) -> None:
    """No two bound units of any kinds share a byte (every id space, every kind)."""
    spans = []
    for kind, space in mem.spaces.items():
        ub = mem.layout.unit_bytes(kind)
        for p in torch.nonzero(space.p2v >= 0).flatten().tolist():
            lo = mem.base[kind] + p * ub
            spans.append((lo, lo + ub, kind))
    spans.sort()
    for a, b in zip(spans, spans[1:], strict=False):
        if b[0] < a[1]:
            _fail(f"units {a} and {b} share bytes")


def case_band_overlap() -> None:
    """issue 48, case 1 (shrunk from the stress test): admit(4) after a checkpoint round trip."""
    m = UnifiedMemory(geometry("unequal-p1"), 3440, max_requests=4, max_context=40, poison=True)
    a = m.admit(1)
    saved = [m.save_state(a.state_slot), m.save_state(a.state_slot)]
    m.free_states(saved)
    m.release([a])
    if m.fits_alone(4, 4):
        _fail("fits_alone(4, 4) should be False for this arena")
    before = pool_snapshot(m)
    gen = m._generation
    r = m.admit(4)
    if r is not None:
        _fail(f"admit(4) should not fit, got {r}")
    if m.free_rows != 4:
        _fail(f"a row leaked: {m.free_rows} free of 4")
    diff = changed(before, pool_snapshot(m))
    if diff:
        _fail(f"an out-of-memory admit changed {diff}")
    if m._generation != gen:
        _fail("a failed admit used a generation")
    check_unified(m)
    _no_shared_bytes(m)
    r = m.admit(3)  # what does fit is placed without overlap
    if r is None:
        _fail("admit(3) should fit")
    check_unified(m, [r])
    _no_shared_bytes(m)


def case_prefix_cache_sequence() -> None:
    """issue 48, case 2: the project's test spec through the prefix cache under pressure."""
    m = UnifiedMemory(SPECS["full+swa+state"], 7015, max_requests=6, max_context=48, poison=True)
    cache = PrefixCache(m, checkpoint_interval=1)
    tokens = [2, 1, 1, 1, 0, 0, 2, 0, 1, 2, 1, 1, 2, 1, 2, 2, 2]
    r = cache.admit(tokens, 2).mem
    if not m.grow([(r, 4)]):
        _fail("grow to 4 tokens should fit")
    cache.insert(tokens[:4], r)
    m.retire_swa([(r, 4)])
    if not m.grow([(r, 5)]):
        cache.evict(1 << 30)
        m.grow([(r, 5)])
    m.release([r])
    cache.check()
    before = pool_snapshot(m, cache)
    # The cache still holds one FULL page: a second FULL page cannot be placed above the STATE
    # and SWA units one request needs on these unit grids (FULL 1280 B, SWA 960 B), so
    # admit(1) is out of memory, and nothing changes.
    r = m.admit(1)
    if r is not None:
        _fail(f"admit(1) should not fit next to the cached page, got {r}")
    if m.free_rows != 6:
        _fail(f"a row leaked: {m.free_rows} free of 6")
    diff = changed(before, pool_snapshot(m, cache))
    if diff:
        _fail(f"an out-of-memory admit changed {diff}")
    cache.flush()
    r = m.admit(1)
    if r is None:
        _fail("admit(1) should fit once the cache is flushed")
    check_unified(m, [r])
    _no_shared_bytes(m)
