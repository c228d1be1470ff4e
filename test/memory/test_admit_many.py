"""``MemoryPool.admit_many``: a batch of admissions leaves the pool exactly as that many
``admit`` calls one by one — the same rows, pages, slots and generations, the same request
table, usage and peak, the same translation tables and free stacks (the device pops a run's
units at once, in the order single pops would) — and a batch that does not fit admits its
longest prefix that does, as those admissions one by one would; bad counts are refused up
front."""

from __future__ import annotations

import pytest
import torch
from pool_state import changed, pool_snapshot
from specs import SPECS

from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory


def _static(spec):
    return StaticMemory(spec, num_full_pages=64, num_swa_pages=64, num_state_slots=5,
                        max_requests=6, max_context=64, poison=True)  # fmt: skip


def _unified(spec):
    return UnifiedMemory(spec, 256 * 1024, max_requests=6, max_context=64, poison=True)


POOLS = {"static": _static, "unified": _unified}


def _snapshot(mem, reqs):
    tables = [mem.req_to_token.clone()]
    for name in ("swa_v2p", "full_v2p", "state_v2p"):
        t = getattr(mem, name, None)
        if isinstance(t, torch.Tensor):
            tables.append(t.clone())
    handles = [(r.row, r.state_slot, list(r.pages), r.swa_start, r.generation) for r in reqs]
    return handles, tables, mem.used_bytes(), mem.stats.peak_bytes


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("spec", SPECS)
def test_admit_many_equals_admits_one_by_one(pool, spec):
    counts = [9, 1, 16, 5]
    one, many = POOLS[pool](SPECS[spec]), POOLS[pool](SPECS[spec])
    warm = [one.admit(3), many.admit(3)]  # a request already there, released: ids returned
    one.release([warm[0]])
    many.release([warm[1]])
    singles = [one.admit(n) for n in counts]
    assert all(r is not None for r in singles)
    batch = many.admit_many(counts)
    a, b = _snapshot(one, singles), _snapshot(many, batch)
    assert a[0] == b[0]  # handles
    assert torch.equal(a[1][0], b[1][0])  # the request table
    for x, y in zip(a[1][1:], b[1][1:], strict=True):  # virtual -> physical: the same
        assert torch.equal(x, y)
    assert a[2:] == b[2:]
    assert not changed(pool_snapshot(one), pool_snapshot(many))  # everything else too
    one.release(singles)
    many.release(batch)
    assert one.used_bytes() == many.used_bytes() == 0


SMALL = {
    "static": _static,  # 5 state slots for 6 requests
    "unified": lambda spec: UnifiedMemory(spec, 32 * 1024, max_requests=6, max_context=64),
}


@pytest.mark.parametrize("pool", SMALL)
def test_admit_many_admits_the_longest_prefix_that_fits(pool):
    spec = SPECS["full+state"]
    one, many = SMALL[pool](spec), SMALL[pool](spec)
    counts = [32] * 6
    singles = []
    for n in counts:
        r = one.admit(n)
        if r is None:
            break
        singles.append(r)
    batch = many.admit_many(counts)
    assert 0 < len(batch) == len(singles) < len(counts)
    assert _snapshot(one, singles)[0] == _snapshot(many, batch)[0]
    assert one.used_bytes() == many.used_bytes()
    assert many.admit_many([]) == []


def test_admit_many_refuses_bad_counts_and_changes_nothing():
    mem = _static(SPECS["full+swa+state"])
    for bad in ([4, 0], [4, 65], [4, 2.5]):
        with pytest.raises(ValueError, match=r"token_counts\[1\]"):
            mem.admit_many(bad)
    assert mem.used_bytes() == 0
    assert len(mem.admit_many([4, 4])) == 2
