"""Unit byte ops: the Triton launchers equal their torch references on random arenas.

On CPU the launchers run in the Triton interpreter (small sizes); the ``cuda`` variants are
marked ``gpu``. Arenas are compared whole, so bytes outside the touched units (the region
before ``base``, the tail, untouched units) must be left alone too. Arenas that start at an odd
offset exercise the narrower word views; a small ``block`` splits units across programs.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import unit_ops

# Triton runs on CPU tensors only through the interpreter (set by the root conftest when there is
# no GPU); on a GPU machine the compiled kernels are tested through the ``cuda`` variants.


def make_arena(
    gen: torch.Generator, base: int, unit_bytes: int, units: int, offset: int, device: str
) -> torch.Tensor:
    """Random bytes: ``base`` bytes, ``units`` units and a 5-byte tail, starting ``offset``
    bytes into an aligned allocation (so the arena itself may be misaligned)."""
    size = offset + base + units * unit_bytes + 5
    return torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).to(device)[offset:]


def random_pairs(
    gen: torch.Generator, units: int, n: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` pairs of distinct units (no unit both a source and a destination), about a
    quarter of them padded with ``-1`` on one side or both. The first pair, never padded,
    involves the largest unit."""
    rest = torch.randperm(units - 1, generator=gen)[: 2 * n - 1] if n else torch.empty(0)
    chosen = torch.cat([torch.tensor([units - 1]), rest.long()])[: 2 * n]
    if n and bool(torch.randint(0, 2, (), generator=gen)):
        chosen[0], chosen[n] = chosen[n].clone(), chosen[0].clone()  # largest as destination
    src, dst = chosen[:n].clone(), chosen[n : 2 * n].clone()
    pad = torch.randint(0, 8, (n,), generator=gen)
    pad[:1] = 7
    src[pad == 0] = -1
    dst[pad == 1] = -1
    src[pad == 2] = -1
    dst[pad == 2] = -1
    return src.int().to(device), dst.int().to(device)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


GEOMETRIES = [  # (base, unit_bytes, units)
    (0, 16, 9),
    (32, 48, 12),
    (16, 256, 7),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base,unit_bytes,units", GEOMETRIES)
@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("block", [None, 2])
def test_copy_units(device, base, unit_bytes, units, offset, block):
    gen = torch.Generator().manual_seed(100 + unit_bytes + offset + (block or 0))
    for n in [0, 1, units // 2]:
        buf = make_arena(gen, base, unit_bytes, units, offset, device)
        src, dst = random_pairs(gen, units, n, device)
        ref, tri = buf.clone(), buf.clone()
        unit_ops.copy_units_reference(ref, base, unit_bytes, src, dst)
        unit_ops.copy_units_triton(tri, base, unit_bytes, src, dst, block=block)
        assert_same(ref, tri)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base,unit_bytes,units", GEOMETRIES)
@pytest.mark.parametrize("offset", [0, 1, 4])
@pytest.mark.parametrize("byte_value", [0x00, 0xFF, 0x80, 0x01])
def test_fill_units(device, base, unit_bytes, units, offset, byte_value):
    gen = torch.Generator().manual_seed(200 + unit_bytes + offset + byte_value)
    for n in [0, 1, units // 2]:
        buf = make_arena(gen, base, unit_bytes, units, offset, device)
        ids = torch.randperm(units, generator=gen)[:n]
        ids[torch.randint(0, 4, (n,), generator=gen) == 0] = -1
        if n:
            ids[-1] = units - 1
        ids = ids.int().to(device)
        ref, tri = buf.clone(), buf.clone()
        unit_ops.fill_units_reference(ref, base, unit_bytes, ids, byte_value)
        unit_ops.fill_units_triton(tri, base, unit_bytes, ids, byte_value, block=4)
        assert_same(ref, tri)


@pytest.mark.parametrize("device", DEVICES)
def test_fill_poison_is_nan(device):
    """0xFF fills make NaN in every float format the arena holds."""
    buf = torch.zeros(64, dtype=torch.uint8, device=device)
    ids = torch.tensor([1], dtype=torch.int32, device=device)
    unit_ops.fill_units_triton(buf, 0, 32, ids, 0xFF)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        vals = buf[32:].view(dtype)
        assert bool(vals.isnan().all())
    assert bool((buf[:32] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_word_view(device):
    """Aligned arenas move int64 words, 16-byte vectors when base and unit allow; misaligned
    views fall back to narrower words; the view never covers bytes past the arena."""
    arena = torch.zeros(16 * 64 + 3, dtype=torch.uint8, device=device)
    assert arena.data_ptr() % 16 == 0
    words, w, vec = unit_ops._word_view(arena, 32, 64)
    assert (w, vec, words.dtype, words.numel()) == (8, 2, torch.int64, (16 * 64) // 8)
    assert words.data_ptr() == arena.data_ptr()
    assert unit_ops._word_view(arena, 8, 64)[1:] == (8, 1)
    assert unit_ops._word_view(arena[8:], 32, 64)[1:] == (8, 1)
    assert unit_ops._word_view(arena[4:], 32, 64)[1:] == (4, 1)
    assert unit_ops._word_view(arena[2:], 32, 64)[1:] == (2, 1)
    assert unit_ops._word_view(arena[1:], 32, 64)[1:] == (1, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_one_big_unit_spans_many_programs(device):
    """A unit much larger than a program's chunk (here 64 KiB over 16 KiB chunks)."""
    gen = torch.Generator().manual_seed(300)
    base, unit_bytes = 16, 64 * 1024
    buf = make_arena(gen, base, unit_bytes, 3, 0, device)
    src, dst = (torch.tensor([x], dtype=torch.int32, device=device) for x in (2, 0))
    ref, tri = buf.clone(), buf.clone()
    unit_ops.copy_units_reference(ref, base, unit_bytes, src, dst)
    unit_ops.copy_units_triton(tri, base, unit_bytes, src, dst)
    assert_same(ref, tri)
    unit_ops.fill_units_triton(tri, base, unit_bytes, src, 0)
    assert bool((tri[base + 2 * unit_bytes : base + 3 * unit_bytes] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_public_entry_points_use_triton_when_forced(monkeypatch, device):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    calls = []
    for name in ("copy_units", "fill_units"):
        launcher = getattr(unit_ops, f"{name}_triton")

        def spy(*args, _launcher=launcher, _name=name, **kwargs):
            calls.append(_name)
            _launcher(*args, **kwargs)

        monkeypatch.setattr(unit_ops, f"{name}_triton", spy)
    gen = torch.Generator().manual_seed(400)
    buf = make_arena(gen, 16, 32, 6, 0, device)
    ref, tri = buf.clone(), buf.clone()
    src = torch.tensor([1, -1, 4], dtype=torch.int32, device=device)
    dst = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    unit_ops.copy_units_reference(ref, 16, 32, src, dst)
    unit_ops.copy_units(tri, 16, 32, src, dst)
    unit_ops.fill_units_reference(ref, 16, 32, dst, 0xFF)
    unit_ops.fill_units(tri, 16, 32, dst, 0xFF)
    assert_same(ref, tri)
    assert calls == ["copy_units", "fill_units"]


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_offsets_past_2_gib(offset):
    """Unit offsets past 2^31 bytes (and, with 1-byte words, past 2^31 elements)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    unit_bytes, units = 1 << 20, 2050  # the last units start past 2^31 bytes
    base = 16
    buf = torch.empty(offset + base + units * unit_bytes, dtype=torch.uint8, device="cuda")
    buf = buf[offset:]
    gen = torch.Generator(device="cuda").manual_seed(500)
    pattern = torch.randint(
        0, 256, (2, unit_bytes), generator=gen, dtype=torch.uint8, device="cuda"
    )
    last, first = units - 1, 3
    at = lambda u: slice(base + u * unit_bytes, base + (u + 1) * unit_bytes)
    buf[at(first)] = pattern[0]
    buf[at(last)] = pattern[1]
    ids = lambda *xs: torch.tensor(xs, dtype=torch.int32, device="cuda")
    unit_ops.copy_units_triton(buf, base, unit_bytes, ids(last, first), ids(first + 1, last - 1))
    assert torch.equal(buf[at(first + 1)], pattern[1])
    assert torch.equal(buf[at(last - 1)], pattern[0])
    unit_ops.fill_units_triton(buf, base, unit_bytes, ids(-1, last), 0xFF)
    assert bool((buf[at(last)] == 0xFF).all())
    assert torch.equal(buf[at(last - 1)], pattern[0])
