"""Draft lanes fused into the target's pages: a write through a draft lane's view touches only
that lane's blocks of that page — never a target block of the same page — and vice versa.
Checked on the raw bytes of poisoned static and unified pools, for every lane of the FULL and
SWA pages, including a write through the attention backend's store at a step's write slots."""

from __future__ import annotations

import pytest
import torch

from unimem.attention.backend import store_kv_paged
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.speculative.drafter import DraftConfig, draft_config_for

PAGE = 16


def _pool(kind: str):
    cfg = preset("tiny")
    dc = draft_config_for(cfg)
    spec = memory_spec(cfg, PAGE, draft_lanes=dc.lanes())
    if kind == "static":
        pool = StaticMemory(spec, 12, 12, 4, 4, cfg.max_context, poison=True)
    else:
        pool = UnifiedMemory(spec, 3 << 20, 4, cfg.max_context, poison=True)
    reqs = [pool.admit(3 * PAGE), pool.admit(2 * PAGE)]
    return pool, reqs


def _buffer_and_base(pool, kind: LayerKind) -> tuple[torch.Tensor, int]:
    if isinstance(pool, UnifiedMemory):
        return pool.arena, pool.base[kind]
    return pool.pools[kind], 0


def _phys(pool, kind: LayerKind, vpage: int) -> int:
    v2p = pool.full_v2p if kind is LayerKind.FULL else pool.swa_v2p
    return vpage if v2p is None else int(v2p[vpage])


def _block_mask(pool, kind: LayerKind, phys: int, lanes: list[int]) -> torch.Tensor:
    """Bytes of the K and V blocks of ``lanes`` in physical page ``phys``."""
    buf, base = _buffer_and_base(pool, kind)
    layout = pool.layout.of(kind)
    mask = torch.zeros(buf.numel(), dtype=torch.bool)
    start = base + phys * layout.unit_bytes
    for lane in lanes:
        for lo, hi in layout.block_byte_ranges(lane):
            mask[start + lo : start + hi] = True
    return mask


@pytest.mark.parametrize("pool_kind", ["static", "unified"])
@pytest.mark.parametrize("kind", [LayerKind.FULL, LayerKind.SWA])
def test_each_lane_writes_only_its_own_blocks(pool_kind, kind):
    pool, reqs = _pool(pool_kind)
    layout = pool.layout.of(kind)
    assert layout.num_lanes == layout.num_target + 1  # tiny: 2 target lanes + 1 draft lane
    buf, _ = _buffer_and_base(pool, kind)
    phys = _phys(pool, kind, reqs[0].pages[1])
    assert phys > 0
    for lane in range(layout.num_lanes):
        before = buf.clone()
        k, v = pool.kv_cache(kind, lane)
        k[phys] = torch.randn(k.shape[1:], dtype=k.dtype)
        v[phys] = torch.randn(v.shape[1:], dtype=v.dtype)
        own = _block_mask(pool, kind, phys, [lane])
        changed = buf != before
        assert changed.any()
        assert not (changed & ~own).any(), f"lane {lane} wrote outside its blocks"
        # in particular: draft lanes never touch target blocks of the page, and vice versa
        others = [x for x in range(layout.num_lanes) if x != lane]
        assert not (changed & _block_mask(pool, kind, phys, others)).any()


@pytest.mark.parametrize("pool_kind", ["static", "unified"])
def test_store_at_write_slots_through_a_draft_lane(pool_kind):
    """The engine's path: ``store_kv_paged`` at physical write slots of a request's window,
    through the draft lane's view of each host kind, changes only the draft blocks of the
    written pages — and leaves the target blocks, the other pages and the poison as they were."""
    pool, reqs = _pool(pool_kind)
    spec = pool.spec
    vtoks = pool.req_to_token[reqs[0].row, 5 : 5 + 2 * PAGE - 3].long()  # spans 2 pages
    for j, lane in enumerate(spec.draft_lanes):
        kind = lane.host
        buf, _ = _buffer_and_base(pool, kind)
        v2p = pool.full_v2p if kind is LayerKind.FULL else pool.swa_v2p
        pages = vtoks // PAGE if v2p is None else v2p[vtoks // PAGE].long()
        slots = pages * PAGE + vtoks % PAGE
        k_cache, v_cache = pool.kv_cache(kind, spec.lane_of_draft(j))
        before = buf.clone()
        n = slots.numel()
        k = torch.randn(n, *k_cache.shape[2:], dtype=k_cache.dtype)
        v = torch.randn(n, *v_cache.shape[2:], dtype=v_cache.dtype)
        store_kv_paged(k, v, k_cache, v_cache, slots)
        lane_idx = spec.lane_of_draft(j)
        own = torch.zeros_like(before, dtype=torch.bool)
        for p in sorted(set(pages.tolist())):
            own |= _block_mask(pool, kind, p, [lane_idx])
        changed = buf != before
        assert changed.any() and not (changed & ~own).any()
        assert torch.equal(k_cache[pages, slots % PAGE], k)
        assert torch.equal(v_cache[pages, slots % PAGE], v)


def test_draft_config_lanes_and_validation():
    cfg = preset("tiny")
    dc = draft_config_for(cfg)
    lanes = dc.lanes()
    assert [lane.host for lane in lanes] == [LayerKind.FULL, LayerKind.SWA]
    assert lanes[1].layer.window == dc.window <= cfg.window
    spec = memory_spec(cfg, PAGE, draft_lanes=lanes)
    assert [spec.lane_of_draft(j) for j in range(2)] == [2, 2]  # after the 2 target lanes
    with pytest.raises(ValueError, match="layer_hosts"):
        DraftConfig(512, 256, ("gdn",), (1,), 4, 2, 64, 32, 512)
    with pytest.raises(ValueError, match="window"):
        DraftConfig(512, 256, ("swa",), (1,), 4, 2, 64, 32, 512)
    with pytest.raises(ValueError, match="target_layers"):
        DraftConfig(512, 256, ("full",), (1, 1), 4, 2, 64, 32, 512)
    wide = DraftConfig(512, 256, ("swa",), (1,), 4, 2, 64, 32, 512, window=cfg.window + 1)
    with pytest.raises(ValueError, match="largest SWA window"):
        wide.check_target(512, 256, cfg.num_layers, cfg.window)
    with pytest.raises(ValueError, match="out of range"):
        dc.check_target(512, 256, 3, cfg.window)
