"""The static baseline: fixed pools, physical ids in the request table, SWA by mapping."""

from __future__ import annotations

import pytest
import torch

from unimem.memory.spec import AttentionLayerSpec, LayerKind, MemorySpec, StateLayerSpec
from unimem.memory.static import StaticMemory

F, S = LayerKind.FULL, LayerKind.SWA

SPEC = MemorySpec(
    page_size=4,
    layers=(
        AttentionLayerSpec(F, 2, 8, 8, torch.float32),
        AttentionLayerSpec(S, 2, 8, 4, torch.float32, window=6),
        StateLayerSpec((6, 3), torch.float32, (2, 4, 4), torch.float32),
    ),
)


def _mem(**kw):
    args = dict(num_full_pages=10, num_swa_pages=5, num_state_slots=3, max_requests=4)
    args.update(kw)
    return StaticMemory(SPEC, max_context=40, poison=True, **args)


def test_request_table_holds_physical_ids_and_swa_maps_them():
    mem = _mem()
    req = mem.admit(9)
    assert req is not None and len(req.pages) == 3
    row = mem.req_to_token[req.row, :12]
    want = torch.tensor([p * 4 + o for p in req.pages for o in range(4)], dtype=torch.int32)
    assert torch.equal(row, want)
    swa = mem.swa_v2p[torch.tensor(req.pages)]
    assert bool((swa > 0).all()) and swa.unique().numel() == 3
    # Handed-out units are zeroed even in poison mode; the rest stays poisoned.
    k, v = mem.kv_cache(F, 0)
    assert not bool(k[torch.tensor(req.pages)].isnan().any())
    assert bool(k[torch.tensor([9, 10])].isnan().all())
    conv, ssm = mem.state_cache(0)
    assert not bool(ssm[req.state_slot].any())


def test_out_of_capacity_is_a_value_and_changes_nothing():
    mem = _mem()
    a = mem.admit(20)  # 5 FULL + 5 SWA pages: SWA pool exhausted
    assert a is not None
    assert mem.admit(4) is None
    assert not mem.grow([(a, 24)])
    assert len(a.pages) == 5
    assert mem.retire_swa([(a, 20)]) == 3  # columns 0..2 are behind the window
    assert mem.grow([(a, 24)])
    b = mem.admit(4)
    assert b is not None
    mem.release([a, b])
    assert mem.used_bytes() == 0
    assert mem.admit(20) is not None


def test_state_slots_limit_admission():
    mem = _mem(num_state_slots=1)
    assert mem.admit(1) is not None
    assert mem.admit(1) is None


def test_too_long_request_is_an_error():
    with pytest.raises(ValueError, match="max_context"):
        _mem().admit(41)


def test_from_budget_splits_and_rejects_impossible_budgets():
    mem = StaticMemory.from_budget(
        SPEC, 64 * 1024, num_state_slots=4, swa_to_full=0.5, max_requests=4, max_context=40
    )
    assert mem.capacity[S] == int(mem.capacity[F] * 0.5)
    assert mem.stats.capacity_bytes <= 64 * 1024
    with pytest.raises(ValueError, match="budget"):
        StaticMemory.from_budget(
            SPEC, 1024, num_state_slots=4, swa_to_full=0.5, max_requests=4, max_context=40
        )
