"""Layouts: block offsets (aligned, disjoint, inside the envelope) and arena views (alias the
arena bytes exactly where the offsets say, with int64-safe offsets)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unimem.memory.layout import (
    BLOCK_ALIGN,
    MemoryLayout,
    PageLayout,
    SlotLayout,
    align_up,
)
from unimem.memory.spec import (
    AttentionLayerSpec,
    DraftLane,
    LayerKind,
    MemorySpec,
    StateLayerSpec,
)

FULL, SWA, STATE = LayerKind.FULL, LayerKind.SWA, LayerKind.STATE
BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
DTYPES = [BF16, FP16, FP32, FP8, torch.float8_e5m2]


def attn(kind, h, dk, dv, dtype=BF16, window=None):
    if kind is SWA and window is None:
        window = 64
    return AttentionLayerSpec(kind, h, dk, dv, dtype, window)


def hybrid() -> MemorySpec:
    """Asymmetric FULL rows, mixed dtypes, state with bf16 conv and fp32 ssm, draft lanes."""
    return MemorySpec(
        page_size=16,
        layers=(
            attn(FULL, 2, 128, 64),
            attn(SWA, 4, 64, 64, FP16),
            StateLayerSpec((24, 3), BF16, (2, 8, 16), FP32),
            attn(FULL, 1, 192, 128, FP8),
            StateLayerSpec((5, 3), FP16, (3, 5), BF16),
        ),
        draft_lanes=(
            DraftLane(FULL, attn(FULL, 2, 64, 32, FP32)),
            DraftLane(STATE, StateLayerSpec((7,), FP32, (1, 4, 4), FP32)),
            DraftLane(SWA, attn(SWA, 2, 16, 8, BF16, window=512)),
        ),
    )


# --------------------------------------------------------------------------- offsets


def test_page_offsets_asymmetric_rows():
    layout = PageLayout.build(hybrid(), FULL)
    # lane 0: K 16*2*128*2 = 8192, V 16*2*64*2 = 4096; lane 1 (fp8): K 16*192 = 3072,
    # V 16*128 = 2048; lane 2 (draft, fp32): K 16*2*64*4 = 8192, V 16*2*32*4 = 4096.
    assert layout.k_offsets == (0, 12288, 17408)
    assert layout.v_offsets == (8192, 15360, 25600)
    assert layout.unit_bytes == 29696
    assert layout.num_target == 2 and layout.num_lanes == 3
    assert layout.sources == ("layers[0]", "layers[3]", "draft_lanes[0]")
    assert layout.block_byte_ranges(0) == ((0, 8192), (8192, 12288))


def test_slot_offsets_padded():
    layout = SlotLayout.build(hybrid())
    # conv 24*3*2 = 144, ssm 2*8*16*4 = 1024; conv 5*3*2 = 30 -> 32, ssm 3*5*2 = 30 -> 32;
    # draft conv 7*4 = 28 -> 32, ssm 16*4 = 64.
    assert layout.conv_offsets == (0, 1168, 1232)
    assert layout.ssm_offsets == (144, 1200, 1264)
    assert layout.unit_bytes == 1328
    assert layout.block_byte_ranges(1) == ((1168, 1198), (1200, 1230))
    assert layout.sources == ("layers[2]", "layers[4]", "draft_lanes[1]")


def test_align_option():
    layout = PageLayout.build(hybrid(), SWA, align=128)
    assert layout.unit_bytes % 128 == 0
    assert all(o % 128 == 0 for o in layout.k_offsets + layout.v_offsets)
    # draft V block: 16*2*8*2 = 256 B; draft K: 512 B.
    with pytest.raises(ValueError, match="align must be a power of two >= 16"):
        PageLayout.build(hybrid(), SWA, align=8)
    with pytest.raises(ValueError, match="base must be a non-negative multiple of 128"):
        layout.k_view(torch.zeros(1 << 16, dtype=torch.uint8), 16, 1, 0)


def test_build_rejects_absent_or_wrong_kind():
    spec = MemorySpec(8, (attn(FULL, 1, 16, 16),))
    with pytest.raises(ValueError, match="no SWA layer"):
        PageLayout.build(spec, SWA)
    with pytest.raises(ValueError, match="kind must be FULL or SWA"):
        PageLayout.build(spec, STATE)
    with pytest.raises(ValueError, match="no STATE layer"):
        SlotLayout.build(spec)
    layout = MemoryLayout.build(spec)
    assert layout.swa is None and layout.state is None and layout.full is not None
    assert layout.kinds == (FULL,)
    with pytest.raises(ValueError, match="no STATE layer"):
        layout.unit_bytes(STATE)


def test_memory_layout_and_describe():
    spec = hybrid()
    layout = MemoryLayout.build(spec)
    assert layout.kinds == (FULL, SWA, STATE)
    assert layout.unit_bytes(FULL) == PageLayout.build(spec, FULL).unit_bytes
    assert layout.unit_bytes(SWA) == layout.swa.unit_bytes
    assert layout.unit_bytes(STATE) == layout.state.unit_bytes == 1328
    text = layout.describe()
    for kind in LayerKind:
        sub = layout.of(kind)
        assert f"unit_bytes {sub.unit_bytes}" in text
        for source in sub.sources:
            assert source in text
    assert "float8_e4m3fn" in text and "[16, 1, 192]" in text and "25600" in text


def test_align_up_is_exact_past_2_31():
    assert align_up(2**40 + 1, 16) == 2**40 + 16 and align_up(0, 16) == 0


def test_views_past_2_31_on_meta():
    """A 17 GiB arena on the meta device: no memory, but real int64 strides and offsets."""
    spec = hybrid()
    layout = MemoryLayout.build(spec)
    arena = torch.empty((1 << 34) + 7, dtype=torch.uint8, device="meta")
    page, slot = layout.full, layout.state
    base = (1 << 33) + 16
    n = ((1 << 34) - base) // page.unit_bytes
    v = page.v_view(arena, base, n, 1)
    assert v.shape == (n, 16, 1, 128) and v.dtype == FP8
    assert v.stride() == (page.unit_bytes, 128, 128, 1)
    assert v.storage_offset() == base + page.v_offsets[1]
    last = v[n - 1]
    last_start = base + (n - 1) * page.unit_bytes + page.v_offsets[1]
    assert last.storage_offset() == last_start > 2**33
    s = slot.ssm_view(arena, base, 5, 0)
    assert s.dtype == FP32 and s.storage_offset() * 4 == base + slot.ssm_offsets[0]
    with pytest.raises(ValueError, match="exceed the arena"):
        page.k_view(arena, base, n + 1, 0)


# --------------------------------------------------------------------------- views


def _check_blocks(layout) -> None:
    """Every block aligned, inside the envelope and disjoint from every other; tight."""
    ranges = []
    for lane in range(layout.num_lanes):
        for start, end in layout.block_byte_ranges(lane):
            assert start % layout.align == 0 and 0 <= start < end <= layout.unit_bytes
            ranges.append((start, end, lane))
    ranges.sort()
    for (_, end, _), (start, _, _) in zip(ranges, ranges[1:], strict=False):
        assert end <= start
    assert layout.unit_bytes % layout.align == 0
    assert layout.unit_bytes == align_up(ranges[-1][1], layout.align)


def _check_no_draft_target_overlap(layout) -> None:
    target = [r for ln in range(layout.num_target) for r in layout.block_byte_ranges(ln)]
    for lane in range(layout.num_target, layout.num_lanes):
        for ds, de in layout.block_byte_ranges(lane):
            assert all(de <= ts or te <= ds for ts, te in target)


def _block_views(layout, arena, base, n):
    """(lane, byte offset of the block in the envelope, expected dtype, view) per block."""
    out = []
    for lane in range(layout.num_lanes):
        spec = layout.lanes[lane]
        if isinstance(layout, PageLayout):
            blocks = [
                (layout.k_offsets[lane], spec.dtype, layout.k_view),
                (layout.v_offsets[lane], spec.dtype, layout.v_view),
            ]
        else:
            blocks = [
                (layout.conv_offsets[lane], spec.conv_dtype, layout.conv_view),
                (layout.ssm_offsets[lane], spec.ssm_dtype, layout.ssm_view),
            ]
        out += [(lane, off, dtype, make(arena, base, n, lane)) for off, dtype, make in blocks]
    return out


def _random_like(view_unit: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(view_unit.shape, generator=gen) + 0.5
    return x.to(view_unit.dtype)


def _check_aliasing(layout, base: int, n: int, seed: int) -> None:
    """Write through each block's view at one unit; exactly its bytes change, no other view."""
    gen = torch.Generator().manual_seed(seed)
    arena = torch.zeros(base + n * layout.unit_bytes + 13, dtype=torch.uint8)
    assert arena.data_ptr() % BLOCK_ALIGN == 0
    views = _block_views(layout, arena, base, n)
    for _, off, dtype, view in views:
        assert view.shape[0] == n and view.dtype == dtype
        assert view.stride()[0] * view.element_size() == layout.unit_bytes
        assert view[0].is_contiguous()
        assert view.data_ptr() - arena.data_ptr() == base + off
    for index, (_, off, _, view) in enumerate(views):
        u = int(torch.randint(n, (1,), generator=gen))
        before_arena = arena.clone()
        before = [w.clone() for *_, w in views]
        value = _random_like(view[u], gen)
        view[u] = value
        start = base + u * layout.unit_bytes + off
        nbytes = value.numel() * value.element_size()
        expect = before_arena.clone()
        expect[start : start + nbytes] = value.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(arena, expect)
        for other, (*_, w) in enumerate(views):
            if other != index:
                assert torch.equal(w.view(torch.uint8), before[other].view(torch.uint8))
        assert torch.equal(view[u].view(torch.uint8), value.view(torch.uint8))


def test_hybrid_views_alias_arena():
    spec = hybrid()
    for seed, kind in enumerate(LayerKind):
        layout = MemoryLayout.build(spec).of(kind)
        _check_blocks(layout)
        _check_no_draft_target_overlap(layout)
        _check_aliasing(layout, base=48, n=3, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_page_view_strides_per_dtype(dtype):
    per_row = 16 // dtype.itemsize
    spec = MemorySpec(4, (attn(FULL, 2, 4 * per_row, 2 * per_row, dtype),))
    layout = PageLayout.build(spec, FULL)
    arena = torch.zeros(64 + 5 * layout.unit_bytes + 3, dtype=torch.uint8)
    k, v = layout.k_view(arena, 64, 5, 0), layout.v_view(arena, 64, 5, 0)
    step = layout.unit_bytes // dtype.itemsize
    dk, dv = 4 * per_row, 2 * per_row
    assert k.shape == (5, 4, 2, dk) and v.shape == (5, 4, 2, dv)
    assert k.stride() == (step, 2 * dk, dk, 1) and v.stride() == (step, 2 * dv, dv, 1)
    assert k.storage_offset() * dtype.itemsize == 64
    assert v.storage_offset() * dtype.itemsize == 64 + layout.v_offsets[0]
    assert k.dtype == v.dtype == dtype
    _check_aliasing(layout, base=64, n=5, seed=1)


def test_state_views_mixed_dtypes():
    spec = MemorySpec(1, (StateLayerSpec((48, 3), BF16, (4, 16, 8), FP32),))
    layout = SlotLayout.build(spec)
    arena = torch.zeros(32 + 6 * layout.unit_bytes, dtype=torch.uint8)
    conv, ssm = layout.conv_view(arena, 32, 6, 0), layout.ssm_view(arena, 32, 6, 0)
    assert conv.shape == (6, 48, 3) and conv.dtype == BF16
    assert ssm.shape == (6, 4, 16, 8) and ssm.dtype == FP32
    assert conv.stride() == (layout.unit_bytes // 2, 3, 1)
    assert ssm.stride() == (layout.unit_bytes // 4, 128, 8, 1)
    ssm[2] = 1.0
    got = arena[32 + 2 * layout.unit_bytes + layout.ssm_offsets[0] :][: 4 * 16 * 8 * 4].view(FP32)
    assert torch.equal(got, torch.ones_like(got))
    assert conv.abs().sum() == 0 and ssm[1].abs().sum() == 0 and ssm[3].abs().sum() == 0


def test_view_relative_to_sliced_arena():
    """An arena that is itself a slice: offsets are relative to its first byte."""
    layout = PageLayout.build(hybrid(), SWA)
    buf = torch.zeros(4096 + 2 * layout.unit_bytes, dtype=torch.uint8)
    arena = buf[4096:]
    k = layout.k_view(arena, 0, 2, 1)
    assert k.data_ptr() == arena.data_ptr() + layout.k_offsets[1]
    k[1] = 2.0
    start = 4096 + layout.unit_bytes + layout.k_offsets[1]
    assert buf[start : start + layout.k_block_bytes(1)].any()
    assert not buf[:start].any()


def test_zero_units_view():
    layout = PageLayout.build(hybrid(), FULL)
    arena = torch.zeros(16, dtype=torch.uint8)
    assert layout.k_view(arena, 16, 0, 0).shape == (0, 16, 2, 128)


@pytest.mark.parametrize(
    "make_arena, base, n, match",
    [
        (lambda nb: torch.zeros(nb, dtype=torch.uint8), 8, 1, "base must be"),
        (lambda nb: torch.zeros(nb, dtype=torch.uint8), -16, 1, "base must be"),
        (lambda nb: torch.zeros(nb, dtype=torch.uint8), 0, -1, "num_units"),
        (lambda nb: torch.zeros(nb, dtype=torch.uint8), 16, 2, "exceed the arena"),
        (lambda nb: torch.zeros(nb, dtype=torch.int8), 0, 1, "uint8"),
        (lambda nb: torch.zeros(2, nb, dtype=torch.uint8), 0, 1, "1-D"),
        (lambda nb: torch.zeros(2 * nb, dtype=torch.uint8)[::2], 0, 1, "contiguous"),
        (lambda nb: torch.zeros(nb + 64, dtype=torch.uint8)[1:], 0, 1, "aligned"),
    ],
)
def test_view_rejects_bad_inputs(make_arena, base, n, match):
    layout = PageLayout.build(hybrid(), FULL)
    arena = make_arena(2 * layout.unit_bytes)
    with pytest.raises(ValueError, match=match):
        layout.v_view(arena, base, n, 0)


# --------------------------------------------------------------------------- random specs


@st.composite
def attention_layers(draw, kind):
    dtype = draw(st.sampled_from(DTYPES))
    h = draw(st.integers(1, 4))
    step = (16 // dtype.itemsize) // math.gcd(h, 16 // dtype.itemsize)
    dk, dv = (step * draw(st.integers(1, 6)) for _ in range(2))
    return AttentionLayerSpec(
        kind, h, dk, dv, dtype, draw(st.integers(1, 99)) if kind is SWA else None
    )


@st.composite
def state_layers(draw):
    shape = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)
    dtype = st.sampled_from(DTYPES[:4])
    return StateLayerSpec(draw(shape), draw(dtype), draw(shape), draw(dtype))


def layers_of(kind):
    return state_layers() if kind is STATE else attention_layers(kind)


@st.composite
def memory_specs(draw):
    kinds = draw(st.lists(st.sampled_from(list(LayerKind)), min_size=1, max_size=5))
    layers = tuple(draw(layers_of(k)) for k in kinds)
    present = [k for k in LayerKind if k in kinds]
    hosts = draw(st.lists(st.sampled_from(present), max_size=3))
    lanes = tuple(DraftLane(h, draw(layers_of(h))) for h in hosts)
    return MemorySpec(draw(st.sampled_from([1, 2, 4, 8])), layers, lanes)


@settings(max_examples=60, deadline=None)
@given(memory_specs(), st.sampled_from([16, 32, 128]))
def test_random_blocks_aligned_disjoint_inside(spec, align):
    layout = MemoryLayout.build(spec, align)
    assert layout.kinds == spec.kinds
    for kind in layout.kinds:
        sub = layout.of(kind)
        assert sub.lanes == spec.lanes(kind)
        _check_blocks(sub)
        _check_no_draft_target_overlap(sub)
    layout.describe()


@settings(max_examples=15, deadline=None)
@given(memory_specs(), st.integers(0, 3), st.integers(1, 3), st.integers(0, 99))
def test_random_views_alias_arena(spec, base_units, n, seed):
    layout = MemoryLayout.build(spec)
    for kind in layout.kinds:
        _check_aliasing(layout.of(kind), base=16 * base_units, n=n, seed=seed)
