"""``unimem_kernel.kv_store.store_kv_paged``: the Triton kernel against its torch reference.

The caches are strided views into one poisoned (NaN) byte arena, page stride = an envelope
larger than one layer's block, as the pools lay them out; K/V are column slices of a fused
projection (non-contiguous rows). Checked, bitwise (the kernel only copies and casts, RNE as
torch's ``.to``): the written rows, that sink slots (page 0, and negative slots) get zeros,
and that every byte outside the written rows keeps its poison. CPU runs through the Triton
interpreter (``TRITON_INTERPRET=1``, root conftest) with ``UNIMEM_KERNEL_BACKEND=triton``;
the ``gpu``-marked case uses the ``small`` preset's verify width (384 tokens, 4 heads x 128).
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.kv_store import store_kv_paged, store_kv_paged_reference


def arena_caches(pages, page_size, h, dk, dv, dtype, device):
    """K and V views into a NaN-poisoned arena, layer-major envelope with spare room."""
    esz = torch.tensor([], dtype=dtype).element_size()
    k_block, v_block = page_size * h * dk, page_size * h * dv
    envelope = k_block + v_block + 3 * 16 // esz  # another layer's bytes would sit here
    arena = torch.full((pages * envelope + 64,), float("nan"), dtype=dtype, device=device)
    k = arena.as_strided((pages, page_size, h, dk), (envelope, h * dk, dk, 1), 8)
    v = arena.as_strided((pages, page_size, h, dv), (envelope, h * dv, dv, 1), 8 + k_block)
    return arena, k, v


def projection_slices(t, h, dk, dv, dtype, device, gen):
    """k [T, H, Dk] and v [T, H, Dv] as column slices of one fused [T, q | k | v] output."""
    q_dim = 3 * dk
    qkv = torch.randn(t, q_dim + h * (dk + dv), generator=gen).to(dtype).to(device)
    qkv = torch.where(qkv == 0, torch.full_like(qkv, 0.25), qkv)
    k = qkv[:, q_dim : q_dim + h * dk].view(t, h, dk)
    v = qkv[:, q_dim + h * dk :].view(t, h, dv)
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "page_size, h, dk, dv, in_dtype, cache_dtype, slot_dtype",
    [
        (16, 2, 32, 16, torch.float32, torch.float32, torch.int64),  # asymmetric rows
        (4, 3, 8, 8, torch.float32, torch.bfloat16, torch.int32),  # cast, odd head count
        (8, 1, 64, 64, torch.bfloat16, torch.bfloat16, torch.int32),
    ],
)
def test_store_kv_matches_reference(
    triton_backend, device, page_size, h, dk, dv, in_dtype, cache_dtype, slot_dtype
):
    gen = torch.Generator().manual_seed(7)
    pages, t = 6, 13
    k, v = projection_slices(t, h, dk, dv, in_dtype, device, gen)
    live = torch.randperm((pages - 1) * page_size, generator=gen)[: t - 4] + page_size
    sink = torch.tensor([0, page_size - 1, -1, 2 % page_size])  # sink page and a negative
    slots = torch.cat([live[:5], sink[:2], live[5:], sink[2:]]).to(slot_dtype).to(device)
    outs = []
    for fn in (store_kv_paged, store_kv_paged_reference):
        arena, kc, vc = arena_caches(pages, page_size, h, dk, dv, cache_dtype, device)
        fn(k, v, kc, vc, slots)
        outs.append((arena, kc, vc))
    (a_tri, k_tri, v_tri), (a_ref, _, _) = outs
    assert torch.equal(a_tri.isnan(), a_ref.isnan())
    assert torch.equal(torch.nan_to_num(a_tri), torch.nan_to_num(a_ref))
    s = slots.long().cpu()
    for i in range(t):
        page, off = divmod(max(int(s[i]), 0), page_size)
        if page == 0:
            continue
        assert torch.equal(k_tri[page, off].cpu(), k[i].to(cache_dtype).cpu())
        assert torch.equal(v_tri[page, off].cpu(), v[i].to(cache_dtype).cpu())
    # sink rows written zeros; poison survives outside every written row
    for off in {0, page_size - 1, 2 % page_size}:
        assert torch.equal(k_tri[0, off].cpu(), torch.zeros(h, dk, dtype=cache_dtype))
        assert torch.equal(v_tri[0, off].cpu(), torch.zeros(h, dv, dtype=cache_dtype))
    written = {(int(x) // page_size, int(x) % page_size) for x in s.clamp_min(0)}
    untouched = [(p, o) for p in range(pages) for o in range(page_size) if (p, o) not in written]
    assert untouched and all(k_tri[p, o].isnan().all() for p, o in untouched)
    assert a_tri[:8].isnan().all()  # bytes before the first page


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_empty_and_bad_input(triton_backend, device):
    _, kc, vc = arena_caches(3, 4, 2, 8, 8, torch.float32, device)
    empty = torch.empty(0, 2, 8, device=device)
    store_kv_paged(empty, empty, kc, vc, torch.empty(0, dtype=torch.int32, device=device))
    k = torch.randn(3, 2, 8, device=device)
    with pytest.raises(ValueError, match="slots"):
        store_kv_paged(k, k, kc, vc, torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="do not match caches"):
        store_kv_paged(k[:, :1], k, kc, vc, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="int32 or int64"):
        store_kv_paged(k, k, kc, vc, torch.zeros(3, device=device))


@pytest.mark.gpu
def test_store_kv_gpu_verify_width():
    gen = torch.Generator().manual_seed(3)
    page_size, h, d, t, pages = 64, 4, 128, 384, 64
    k, v = projection_slices(t, h, d, d, torch.bfloat16, "cuda", gen)
    slots = (torch.randperm((pages - 1) * page_size, generator=gen)[:t] + page_size).int()
    slots[::17] = 0  # padded lanes into the sink
    slots = slots.cuda()
    a_tri, kt, vt = arena_caches(pages, page_size, h, d, d, torch.bfloat16, "cuda")
    a_ref, kr, vr = arena_caches(pages, page_size, h, d, d, torch.bfloat16, "cuda")
    store_kv_paged(k, v, kt, vt, slots)
    store_kv_paged_reference(k, v, kr, vr, slots)
    assert torch.equal(a_tri.isnan(), a_ref.isnan())
    assert torch.equal(torch.nan_to_num(a_tri), torch.nan_to_num(a_ref))
