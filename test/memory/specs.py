"""Small memory specs shared by the memory tests: every kind mix, draft lanes on every kind,
asymmetric K/V rows, mixed dtypes; and the stress geometries (:data:`GEOMETRIES`). Tests
import this module by name (pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

import torch

from unimem.memory.spec import AttentionLayerSpec, DraftLane, LayerKind, MemorySpec, StateLayerSpec

F, S, T = LayerKind.FULL, LayerKind.SWA, LayerKind.STATE
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def full_layer(h=2, dk=8, dv=8, dt=f32):
    return AttentionLayerSpec(F, h, dk, dv, dt)


def swa_layer(w, h=2, dk=8, dv=4, dt=f32):
    return AttentionLayerSpec(S, h, dk, dv, dt, window=w)


def state_layer():
    return StateLayerSpec((6, 3), bf16, (2, 4, 4), f32)


SPECS = {
    "full+state": MemorySpec(
        page_size=4,
        layers=(full_layer(), state_layer(), full_layer(dt=bf16)),
        draft_lanes=(DraftLane(T, state_layer()),),
    ),
    "full+swa": MemorySpec(
        page_size=1,
        layers=(full_layer(dk=16, dv=8), swa_layer(5)),
        draft_lanes=(DraftLane(F, full_layer(h=1, dk=16, dv=16)),),
    ),
    "full+swa+state": MemorySpec(
        page_size=4,
        layers=(swa_layer(6), state_layer(), full_layer(dk=16, dv=8), swa_layer(9, dt=bf16)),
        draft_lanes=(DraftLane(S, swa_layer(6)), DraftLane(F, full_layer())),
    ),
}
"""Two- and three-kind specs with draft lanes and asymmetric rows."""


def _tiny_spec(draft_layers: int, page_size: int) -> MemorySpec:
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.speculative.drafter import draft_config_for

    config = preset("tiny")
    lanes = draft_config_for(config, num_layers=draft_layers).lanes()
    return memory_spec(config, page_size, lanes)


def _unequal_p1() -> MemorySpec:
    """FULL unit 336 B, SWA 256 B, STATE 400 B, page size 1 (issue 48's band-overlap case)."""
    return MemorySpec(
        page_size=1,
        layers=(
            AttentionLayerSpec(F, 2, 16, 8, f32),
            StateLayerSpec((6, 3), bf16, (2, 4, 4), f32),
            AttentionLayerSpec(S, 2, 8, 4, f32, window=5),
            AttentionLayerSpec(F, 1, 16, 24, bf16),
            AttentionLayerSpec(S, 4, 4, 8, f16, window=3),
            StateLayerSpec((5, 4), f32, (3, 2, 8), bf16),
        ),
        draft_lanes=(
            DraftLane(F, AttentionLayerSpec(F, 1, 16, 16, bf16)),
            DraftLane(S, AttentionLayerSpec(S, 1, 8, 24, bf16, window=5)),
            DraftLane(T, StateLayerSpec((4, 2), f16, (2, 2, 2), f32)),
        ),
    )


def _equal_p4() -> MemorySpec:
    """Three kinds, FULL and SWA units of one size, page size 4 (issue 48's admit_many case)."""
    return MemorySpec(
        page_size=4,
        layers=(
            AttentionLayerSpec(F, 2, 8, 8, f32),
            AttentionLayerSpec(S, 2, 8, 8, f32, window=8),
            StateLayerSpec((4, 2), f32, (2, 4), f32),
        ),
    )


def _wide_p64() -> MemorySpec:
    """FULL + SWA at page size 64, window longer than a page, asymmetric bf16 rows."""
    return MemorySpec(
        page_size=64,
        layers=(
            AttentionLayerSpec(F, 1, 16, 8, bf16),
            AttentionLayerSpec(S, 1, 4, 8, f32, window=70),
        ),
    )


def _state_p16() -> MemorySpec:
    """FULL + STATE at page size 16, a STATE draft lane."""
    return MemorySpec(
        page_size=16,
        layers=(AttentionLayerSpec(F, 1, 8, 8, f16), StateLayerSpec((3, 2), f32, (2, 2, 4), f32)),
        draft_lanes=(DraftLane(T, StateLayerSpec((2, 2), f16, (1, 2, 2), f32)),),
    )


GEOMETRIES = {
    **{name: (lambda s=s: s) for name, s in SPECS.items()},
    "unequal-p1": _unequal_p1,
    "equal-p4": _equal_p4,
    "full+swa-p64": _wide_p64,
    "full+state-p16": _state_p16,
    "tiny-drafter1-p4": lambda: _tiny_spec(1, 4),
    "tiny-drafter2-p4": lambda: _tiny_spec(2, 4),
}
"""Name -> a function making the spec (built lazily: the tiny preset imports the models)."""

_SPEC_CACHE: dict[str, MemorySpec] = {}


def geometry(name: str) -> MemorySpec:
    if name not in _SPEC_CACHE:
        _SPEC_CACHE[name] = GEOMETRIES[name]()
    return _SPEC_CACHE[name]


_MINIMAL: dict[str, int] = {}


def minimal_arena(name: str) -> int:
    """``minimal_arena_bytes`` of geometry ``name``, computed once (by the real planner, also
    when a test later plants a fault in it)."""
    if name not in _MINIMAL:
        from unimem.memory.unified import minimal_arena_bytes

        _MINIMAL[name] = minimal_arena_bytes(geometry(name))
    return _MINIMAL[name]
