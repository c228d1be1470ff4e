"""Capacity benchmark core on a tiny budget: the unified arena holds as many requests at once
as the best static split (within 3 %) on every mix, and the benchmark's shortcuts (meta
sweep, fast CPU byte ops) agree with the real code."""

from __future__ import annotations

import pytest
import torch

import unimem_kernel as uk
from unimem.bench import capacity as bc
from unimem.models.config import memory_spec
from unimem.models.presets import preset

SPEC = memory_spec(preset("tiny"), 16)  # window 16: a long request keeps 2 SWA pages
BUDGET = 32 << 20
MIXES = bc.standard_mixes(long_range=(768, 2048), short_range=(16, 96), seed=0)


@pytest.fixture(scope="module")
def results():
    with bc.host_byte_ops():
        return [
            bc.measure_mix(
                SPEC,
                BUDGET,
                mix,
                "cpu",
                shares=bc.grid(0.05, 0.85, 0.1),
                ratios=bc.grid(0.1, 1.0, 0.1),
            )
            for mix in MIXES
        ]


@pytest.mark.parametrize("i", range(len(MIXES)), ids=[m.name for m in MIXES])
def test_unified_matches_best_static(results, i):
    r = results[i]
    assert r.static_best > 0 and r.static_default >= 0
    assert r.unified >= 0.97 * r.static_best, r
    # The exact optimum is an upper bound of every static split, the grid's included.
    assert r.static_exact >= r.static_grid >= r.static_default
    # And the byte-perfect arena bounds the real one.
    assert r.unified <= r.ideal_arena


def test_fast_byte_ops_match_the_reference():
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (64 * 10,), dtype=torch.uint8, generator=g)
    ids = torch.tensor([3, -1, 0, 7], dtype=torch.int32)
    src = torch.tensor([9, 8, -1], dtype=torch.int32)
    dst = torch.tensor([1, 2, -1], dtype=torch.int32)
    want = buf.clone()
    uk.fill_units_reference(want, 0, 64, ids, 0xAB)
    uk.copy_units_reference(want, 0, 64, src, dst)
    got = buf.clone()
    original = uk.fill_units
    with bc.host_byte_ops():
        assert uk.fill_units is not original
        uk.fill_units(got, 0, 64, ids, 0xAB)
        uk.copy_units(got, 0, 64, src, dst)
    assert torch.equal(got, want)
    assert uk.fill_units is original  # patches are undone on exit


def test_meta_static_counts_like_a_real_pool():
    mix = MIXES[2]
    bound = bc.request_bound(SPEC, BUDGET)
    counts = []
    with bc.host_byte_ops():
        for device in ("meta", "cpu"):
            pool = bc.static_pool(SPEC, BUDGET, 20, 0.4, bound, max(mix.lengths), device)
            counts.append(bc.count_admitted(pool, mix.lengths, bound))
    assert counts[0] == counts[1] > 0
