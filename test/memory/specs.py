"""Small memory specs shared by the memory tests: every kind mix, draft lanes on every kind,
asymmetric K/V rows, mixed dtypes. Tests import this module by name (pytest puts this folder
on ``sys.path``)."""

from __future__ import annotations

import torch

from unimem.memory.spec import AttentionLayerSpec, DraftLane, LayerKind, MemorySpec, StateLayerSpec

F, S, T = LayerKind.FULL, LayerKind.SWA, LayerKind.STATE
f32, bf16 = torch.float32, torch.bfloat16


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
