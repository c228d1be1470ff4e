"""MemorySpec: validation (one test per rule, messages name the field), lane queries, JSON."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unimem.memory.spec import (
    AttentionLayerSpec,
    DraftLane,
    LayerKind,
    MemorySpec,
    StateLayerSpec,
)

FULL, SWA, STATE = LayerKind.FULL, LayerKind.SWA, LayerKind.STATE
BF16 = torch.bfloat16


def full(h: int = 2, dk: int = 64, dv: int = 64, dtype: torch.dtype = BF16) -> AttentionLayerSpec:
    return AttentionLayerSpec(FULL, h, dk, dv, dtype)


def swa(window: int = 128, h: int = 2, dk: int = 64, dv: int = 64) -> AttentionLayerSpec:
    return AttentionLayerSpec(SWA, h, dk, dv, BF16, window=window)


def state(conv=(32, 3), ssm=(2, 8, 8)) -> StateLayerSpec:
    return StateLayerSpec(conv, BF16, ssm, torch.float32)


def hybrid() -> MemorySpec:
    """FULL, SWA, STATE, SWA, FULL, STATE + one draft lane per kind (FULL twice)."""
    return MemorySpec(
        page_size=16,
        layers=(full(), swa(64), state(), swa(256), full(dk=128, dv=64), state((16, 3))),
        draft_lanes=(
            DraftLane(FULL, full(h=1)),
            DraftLane(STATE, state((8, 3))),
            DraftLane(SWA, swa(512)),
            DraftLane(FULL, full(h=4)),
        ),
    )


# --------------------------------------------------------------------------- valid specs


def test_row_bytes_asymmetric():
    layer = AttentionLayerSpec(FULL, 4, 192, 128, BF16)
    assert layer.k_row_bytes == 4 * 192 * 2
    assert layer.v_row_bytes == 4 * 128 * 2
    assert layer.head_tma_aligned


def test_row_alignment_counts_heads():
    # 2 heads * 4 dims * 2 B = 16 B per row: valid, though one head's row is 8 B.
    layer = AttentionLayerSpec(FULL, 2, 4, 4, BF16)
    assert layer.k_row_bytes == 16
    assert not layer.head_tma_aligned


def test_state_spec():
    s = StateLayerSpec([64, 3], BF16, [4, 16, 32], torch.float32)
    assert s.kind is STATE
    assert s.conv_shape == (64, 3) and s.ssm_shape == (4, 16, 32)
    assert s.conv_bytes == 64 * 3 * 2 and s.ssm_bytes == 4 * 16 * 32 * 4


def test_queries_on_hybrid():
    spec = hybrid()
    ls, dl = spec.layers, spec.draft_lanes
    assert spec.kinds == (FULL, SWA, STATE)
    assert spec.has(FULL) and spec.has(SWA) and spec.has(STATE)
    assert spec.attention_lanes(FULL) == (ls[0], ls[4], dl[0].layer, dl[3].layer)
    assert spec.attention_lanes(SWA) == (ls[1], ls[3], dl[2].layer)
    assert spec.state_lanes() == (ls[2], ls[5], dl[1].layer)
    assert [spec.lane_of_layer(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [spec.lane_of_draft(j) for j in range(4)] == [2, 2, 2, 3]
    assert spec.num_target_lanes(FULL) == 2
    assert spec.max_window == 512
    hash(spec)


def test_kinds_order_and_absent_kind():
    spec = MemorySpec(1, [state(), full()])
    assert spec.kinds == (FULL, STATE)
    assert not spec.has(SWA)
    assert spec.attention_lanes(SWA) == ()
    assert spec.max_window is None
    assert isinstance(spec.layers, tuple)
    with pytest.raises(ValueError, match="kind must be FULL or SWA"):
        spec.attention_lanes(STATE)
    with pytest.raises(IndexError):
        spec.lane_of_layer(2)
    with pytest.raises(IndexError):
        spec.lane_of_draft(0)


# --------------------------------------------------------------------------- one test per rule


@pytest.mark.parametrize("page_size", [0, 12, -4, 3, True, 16.0])
def test_page_size_power_of_two(page_size):
    with pytest.raises(ValueError, match=r"^MemorySpec\.page_size must be a power of two"):
        MemorySpec(page_size, (full(),))


def test_page_size_message_shows_value():
    with pytest.raises(ValueError, match="got 12"):
        MemorySpec(12, (full(),))


def test_layers_nonempty():
    with pytest.raises(ValueError, match=r"^MemorySpec\.layers must be a non-empty tuple"):
        MemorySpec(16, ())


def test_layer_type():
    with pytest.raises(ValueError, match=r"^layers\[1\] must be an AttentionLayerSpec"):
        MemorySpec(16, (full(), {"kind": "full"}))


@pytest.mark.parametrize("field", ["num_kv_heads", "k_head_dim", "v_head_dim"])
@pytest.mark.parametrize("bad", [0, -8, 2.0])
def test_attention_dims_positive(field, bad):
    kwargs = dict(kind=FULL, num_kv_heads=2, k_head_dim=64, v_head_dim=64, dtype=BF16)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=rf"^AttentionLayerSpec\.{field} must be a positive int"):
        AttentionLayerSpec(**kwargs)


@pytest.mark.parametrize(
    "field, dims",
    [("k_head_dim", (1, 4, 8)), ("v_head_dim", (1, 8, 12))],
)
def test_misaligned_row(field, dims):
    h, dk, dv = dims
    with pytest.raises(ValueError, match=rf"^AttentionLayerSpec\.{field}: .* not a multiple of 16"):
        AttentionLayerSpec(FULL, h, dk, dv, BF16)


def test_misaligned_row_fp8():
    # 1 head * 8 dims * 1 B = 8 B: misaligned only because of the 1-byte dtype.
    AttentionLayerSpec(FULL, 1, 8, 8, BF16)
    with pytest.raises(ValueError, match=r"k_head_dim: .* = 8 bytes"):
        AttentionLayerSpec(FULL, 1, 8, 8, torch.float8_e4m3fn)


@pytest.mark.parametrize("window", [0, -1, None, 1.5])
def test_swa_window_positive(window):
    with pytest.raises(ValueError, match=r"^AttentionLayerSpec\.window must be > 0 for SWA"):
        AttentionLayerSpec(SWA, 2, 64, 64, BF16, window=window)


def test_full_window_none():
    with pytest.raises(ValueError, match=r"^AttentionLayerSpec\.window must be None for FULL"):
        AttentionLayerSpec(FULL, 2, 64, 64, BF16, window=128)


def test_attention_kind():
    with pytest.raises(ValueError, match=r"^AttentionLayerSpec\.kind must be"):
        AttentionLayerSpec(STATE, 2, 64, 64, BF16)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.complex64, "bfloat16"])
def test_attention_dtype_floating(dtype):
    with pytest.raises(ValueError, match=r"^AttentionLayerSpec\.dtype must be a floating"):
        AttentionLayerSpec(FULL, 2, 64, 64, dtype)


@pytest.mark.parametrize("field", ["conv_shape", "ssm_shape"])
@pytest.mark.parametrize("bad", [(), (4, 0), (-1,), 8, (2.0, 3)])
def test_state_shape_positive(field, bad):
    kwargs = dict(conv_shape=(8, 3), conv_dtype=BF16, ssm_shape=(2, 4, 4), ssm_dtype=BF16)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=rf"^StateLayerSpec\.{field} must be a non-empty tuple"):
        StateLayerSpec(**kwargs)


@pytest.mark.parametrize("field", ["conv_dtype", "ssm_dtype"])
def test_state_dtype_floating(field):
    kwargs = dict(conv_shape=(8, 3), conv_dtype=BF16, ssm_shape=(2, 4, 4), ssm_dtype=BF16)
    kwargs[field] = torch.int32
    with pytest.raises(ValueError, match=rf"^StateLayerSpec\.{field} must be a floating"):
        StateLayerSpec(**kwargs)


def test_state_shapes_need_no_alignment():
    s = StateLayerSpec((3, 3), torch.float8_e4m3fn, (1, 3, 5), torch.float16)
    assert s.conv_bytes == 9 and s.ssm_bytes == 30


def test_draft_lane_host_matches_layer():
    with pytest.raises(
        ValueError, match=r"^DraftLane\.host is SWA but DraftLane\.layer is of kind FULL"
    ):
        DraftLane(SWA, full())
    with pytest.raises(ValueError, match=r"^DraftLane\.host is FULL .* kind STATE"):
        DraftLane(FULL, state())
    with pytest.raises(ValueError, match=r"^DraftLane\.host must be a LayerKind"):
        DraftLane("full", full())
    with pytest.raises(ValueError, match=r"^DraftLane\.layer must be"):
        DraftLane(FULL, None)


@pytest.mark.parametrize(
    "layers, lane, host",
    [
        ((full(),), DraftLane(SWA, swa()), "SWA"),
        ((swa(), state()), DraftLane(FULL, full()), "FULL"),
        ((full(), swa()), DraftLane(STATE, state()), "STATE"),
    ],
)
def test_draft_lane_on_absent_kind(layers, lane, host):
    msg = rf"^draft_lanes\[1\]\.host is {host} but the model has no {host} layer$"
    ok = DraftLane(layers[0].kind, layers[0])
    with pytest.raises(ValueError, match=msg):
        MemorySpec(16, layers, (ok, lane))


def test_draft_lane_type():
    with pytest.raises(ValueError, match=r"^draft_lanes\[0\] must be a DraftLane"):
        MemorySpec(16, (full(),), (full(),))


def test_frozen():
    spec = hybrid()
    with pytest.raises(AttributeError):
        spec.page_size = 32


# --------------------------------------------------------------------------- JSON


def test_from_dict_names_layer_path():
    d = hybrid().to_dict()
    d["layers"][3]["window"] = 0
    with pytest.raises(ValueError, match=r"^layers\[3\]\.window must be > 0 for SWA, got 0$"):
        MemorySpec.from_dict(d)


def test_from_dict_names_draft_path():
    d = hybrid().to_dict()
    d["draft_lanes"][1]["layer"]["ssm_dtype"] = "int32"
    with pytest.raises(ValueError, match=r"^draft_lanes\[1\]\.layer\.ssm_dtype must be a floating"):
        MemorySpec.from_dict(d)
    d = hybrid().to_dict()
    d["draft_lanes"][0]["layer"]["dtype"] = "nope"
    with pytest.raises(ValueError, match=r"^draft_lanes\[0\]\.layer\.dtype must name a torch"):
        MemorySpec.from_dict(d)
    d["draft_lanes"][0]["host"] = "mla"
    with pytest.raises(ValueError, match=r"^draft_lanes\[0\]\.host must be one of"):
        MemorySpec.from_dict(d)


def test_from_dict_misaligned_and_page_size():
    d = hybrid().to_dict()
    d["layers"][0]["k_head_dim"] = 3
    with pytest.raises(ValueError, match=r"^layers\[0\]\.k_head_dim: "):
        MemorySpec.from_dict(d)
    d = hybrid().to_dict()
    d["page_size"] = 12
    with pytest.raises(ValueError, match=r"^MemorySpec\.page_size .* got 12$"):
        MemorySpec.from_dict(d)


# --------------------------------------------------------------------------- random specs

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@st.composite
def attention_layers(draw, kind):
    dtype = draw(st.sampled_from(DTYPES))
    h = draw(st.integers(1, 4))
    step = (16 // dtype.itemsize) // math.gcd(h, 16 // dtype.itemsize)
    dk, dv = (step * draw(st.integers(1, 6)) for _ in range(2))
    window = draw(st.integers(1, 300)) if kind is SWA else None
    return AttentionLayerSpec(kind, h, dk, dv, dtype, window)


@st.composite
def state_layers(draw):
    shape = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)
    dtype = st.sampled_from(DTYPES)
    return StateLayerSpec(draw(shape), draw(dtype), draw(shape), draw(dtype))


def layers_of(kind):
    return state_layers() if kind is STATE else attention_layers(kind)


@st.composite
def memory_specs(draw):
    kinds = draw(st.lists(st.sampled_from(list(LayerKind)), min_size=1, max_size=6))
    layers = tuple(draw(layers_of(k)) for k in kinds)
    hosts = draw(
        st.lists(st.sampled_from(sorted(set(kinds), key=list(LayerKind).index)), max_size=3)
    )
    lanes = tuple(DraftLane(h, draw(layers_of(h))) for h in hosts)
    return MemorySpec(draw(st.sampled_from([1, 2, 4, 8, 16])), layers, lanes)


@settings(max_examples=40, deadline=None)
@given(memory_specs())
def test_lane_indices_consistent(spec):
    for i, layer in enumerate(spec.layers):
        assert spec.lanes(layer.kind)[spec.lane_of_layer(i)] is layer
        assert spec.lane_of_layer(i) < spec.num_target_lanes(layer.kind)
    for j, lane in enumerate(spec.draft_lanes):
        assert spec.lanes(lane.host)[spec.lane_of_draft(j)] is lane.layer
        assert spec.lane_of_draft(j) >= spec.num_target_lanes(lane.host)
    total = sum(len(spec.lanes(k)) for k in LayerKind)
    assert total == len(spec.layers) + len(spec.draft_lanes)
    assert spec.kinds == tuple(k for k in LayerKind if k in {x.kind for x in spec.layers})


@settings(max_examples=40, deadline=None)
@given(memory_specs())
def test_dict_round_trip(spec):
    assert MemorySpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
