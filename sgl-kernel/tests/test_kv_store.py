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


# ------------------------------------------------------------------ RoPE + store in one pass


def rope_tables(t, half, dtype, device, gen):
    pos = torch.randint(0, 4096, (t,), generator=gen).double()
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos[:, None] * inv[None, :]
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "page_size, hq, hk, d, half, dtype, rot_dtype",
    [
        (8, 4, 2, 32, 16, torch.bfloat16, torch.float32),  # full rotary, GQA 2
        (4, 3, 1, 64, 8, torch.bfloat16, torch.float32),  # partial rotary (Qwen3-Next-like)
        (8, 2, 2, 16, 8, torch.bfloat16, torch.bfloat16),  # bf16 tables (Gemma, gpt-oss)
        (16, 2, 1, 16, 8, torch.float32, torch.float32),
    ],
)
def test_rope_store_kv_equals_rope_then_store(
    triton_backend, device, page_size, hq, hk, d, half, dtype, rot_dtype
):
    """The one-launch form returns ``rope_qk``'s q and leaves the arena byte for byte as
    ``rope_qk`` + ``store_kv_paged`` (sink rows zeros, poison elsewhere), and both match the
    reference (rope_qk_reference + the reference store) to the rounding of rope_qk."""
    from unimem_kernel import rope_qk
    from unimem_kernel.kv_store import rope_store_kv, rope_store_kv_reference

    gen = torch.Generator().manual_seed(11 + d + half)
    pages, t = 6, 11
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, : hq * d].view(t, hq, d)  # column slices of one projection, as the models
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    cos, sin = rope_tables(t, half, rot_dtype, device, gen)
    live = torch.randperm((pages - 1) * page_size, generator=gen)[: t - 3] + page_size
    slots = torch.cat([live[:4], torch.tensor([0, -1, 3 % page_size]), live[4:]])
    slots = slots.to(torch.int32).to(device)
    arena_f, kf, vf = arena_caches(pages, page_size, hk, d, d, dtype, device)
    q_fused = rope_store_kv(q, k, v, cos, sin, kf, vf, slots)
    arena_u, ku, vu = arena_caches(pages, page_size, hk, d, d, dtype, device)
    q_rot, k_rot = rope_qk(q, k, cos, sin)
    store_kv_paged(k_rot, v, ku, vu, slots)
    assert q_fused.is_contiguous() and q_fused.shape == (t, hq, d)
    assert torch.equal(q_fused, q_rot)
    assert torch.equal(arena_f.isnan(), arena_u.isnan())
    assert torch.equal(torch.nan_to_num(arena_f), torch.nan_to_num(arena_u))
    for off in {0, 3 % page_size}:  # the sink rows written (slots 0, -1 and 3): zeros
        assert not kf[0, off].float().abs().any() and not vf[0, off].float().abs().any()
    arena_r, kr, vr = arena_caches(pages, page_size, hk, d, d, dtype, device)
    q_ref = rope_store_kv_reference(q, k, v, cos, sin, kr, vr, slots)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_fused.float(), q_ref.float(), **tol)
    torch.testing.assert_close(
        torch.nan_to_num(arena_f.float()), torch.nan_to_num(arena_r.float()), **tol
    )


@pytest.mark.parametrize("device", DEVICES)
def test_rope_store_kv_falls_back_and_refuses_bad_input(triton_backend, device):
    """A cache dtype other than q's takes rope_qk + the store (same bytes); shape errors
    name the argument."""
    from unimem_kernel import rope_qk
    from unimem_kernel.kv_store import rope_store_kv

    gen = torch.Generator().manual_seed(5)
    t, h, d = 5, 2, 16
    q = torch.randn(t, h, d, generator=gen).to(device)
    k = torch.randn(t, h, d, generator=gen).to(device)
    v = torch.randn(t, h, d, generator=gen).to(device)
    cos, sin = rope_tables(t, d // 2, torch.float32, device, gen)
    slots = torch.tensor([4, 5, 0, 9, 10], dtype=torch.int32, device=device)
    arena_a, ka, va = arena_caches(4, 4, h, d, d, torch.bfloat16, device)
    q_a = rope_store_kv(q, k, v, cos, sin, ka, va, slots)
    arena_b, kb, vb = arena_caches(4, 4, h, d, d, torch.bfloat16, device)
    q_b, k_b = rope_qk(q, k, cos, sin)
    store_kv_paged(k_b, v, kb, vb, slots)
    assert torch.equal(q_a, q_b)
    assert torch.equal(torch.nan_to_num(arena_a), torch.nan_to_num(arena_b))
    with pytest.raises(ValueError, match="q must be"):
        rope_store_kv(q[:, :, :8], k, v, cos, sin, ka, va, slots)
    with pytest.raises(ValueError, match="slots"):
        rope_store_kv(q, k, v, cos, sin, ka, va, slots[:3])
    with pytest.raises(ValueError, match="cos must be"):
        _, kf, vf = arena_caches(4, 4, h, d, d, torch.float32, device)
        rope_store_kv(q, k, v, cos[:3], sin[:3], kf, vf, slots)


@pytest.mark.gpu
def test_rope_store_kv_gpu_verify_width():
    """The ``small`` preset's verify step on the GPU: 384 tokens, 16 query / 4 KV heads of
    128, fp32 tables, page 64, padded lanes in the sink: bitwise ``rope_qk`` + the store."""
    from unimem_kernel import rope_qk
    from unimem_kernel.kv_store import rope_store_kv

    gen = torch.Generator().manual_seed(4)
    page_size, hq, hk, d, t, pages = 64, 16, 4, 128, 384, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).bfloat16().cuda()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    cos, sin = rope_tables(t, d // 2, torch.float32, "cuda", gen)
    slots = (torch.randperm((pages - 1) * page_size, generator=gen)[:t] + page_size).int()
    slots[::17] = 0
    slots = slots.cuda()
    a_f, kf, vf = arena_caches(pages, page_size, hk, d, d, torch.bfloat16, "cuda")
    a_u, ku, vu = arena_caches(pages, page_size, hk, d, d, torch.bfloat16, "cuda")
    q_f = rope_store_kv(q, k, v, cos, sin, kf, vf, slots)
    q_u, k_u = rope_qk(q, k, cos, sin)
    store_kv_paged(k_u, v, ku, vu, slots)
    assert torch.equal(q_f, q_u)
    assert torch.equal(a_f.isnan(), a_u.isnan())
    assert torch.equal(torch.nan_to_num(a_f), torch.nan_to_num(a_u))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "hq, hk, d, half, dtype, rot_dtype, q_stride",
    [
        (2, 1, 16, 8, torch.bfloat16, torch.bfloat16, 1),  # Gemma: full rotary, bf16 tables
        (3, 1, 32, 4, torch.bfloat16, torch.float32, 2),  # Qwen3-Next: partial, q beside gate
        (2, 2, 16, 8, torch.float32, torch.float32, 1),
    ],
)
def test_rope_store_kv_with_qk_norm(triton_backend, device, hq, hk, d, half, dtype, rot_dtype,
                                    q_stride):  # fmt: skip
    """q/k zero-centred norms, RoPE and the K/V store in one launch against the reference
    (the norms, then rope_qk, then the store), with q read in place from a wider head view
    (Qwen3-Next's ``[query | gate]``); sink rows zeros; poison elsewhere kept."""
    from unimem_kernel.kv_store import rope_store_kv, rope_store_kv_reference

    gen = torch.Generator().manual_seed(3 + d + half)
    pages, page_size, t = 5, 4, 7
    width = hq * q_stride * d + 2 * hk * d
    proj = (torch.randn(t, width, generator=gen) * 3).to(dtype).to(device)
    q = proj[:, : hq * q_stride * d].view(t, hq, q_stride * d)[..., :d]
    k = proj[:, hq * q_stride * d : hq * q_stride * d + hk * d].view(t, hk, d)
    v = proj[:, hq * q_stride * d + hk * d :].view(t, hk, d)
    q_w = (torch.randn(d, generator=gen) * 0.3).to(dtype).to(device)
    k_w = (torch.randn(d, generator=gen) * 0.3).to(dtype).to(device)
    cos, sin = rope_tables(t, half, rot_dtype, device, gen)
    slots = torch.tensor([4, 0, 9, 13, -1, 17, 6], dtype=torch.int32, device=device)
    norm = (q_w, k_w, 1e-6)
    arena_f, kf, vf = arena_caches(pages, page_size, hk, d, d, dtype, device)
    q_fused = rope_store_kv(q, k, v, cos, sin, kf, vf, slots, qk_norm=norm)
    arena_r, kr, vr = arena_caches(pages, page_size, hk, d, d, dtype, device)
    q_ref = rope_store_kv_reference(q, k, v, cos, sin, kr, vr, slots, qk_norm=norm)
    assert torch.equal(arena_f.isnan(), arena_r.isnan())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_fused.float(), q_ref.float(), **tol)
    torch.testing.assert_close(
        torch.nan_to_num(arena_f.float()), torch.nan_to_num(arena_r.float()), **tol
    )
    assert not kf[0].float().nan_to_num(1.0).abs().sum(-1).sum(-1)[0]  # slot 0: zeros
    # without the fused path (reference backend) the same call is the reference, exactly
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNIMEM_KERNEL_BACKEND", "reference")
        arena_b, kb, vb = arena_caches(pages, page_size, hk, d, d, dtype, device)
        q_b = rope_store_kv(q, k, v, cos, sin, kb, vb, slots, qk_norm=norm)
    assert torch.equal(q_b, q_ref)
    assert torch.equal(torch.nan_to_num(arena_b), torch.nan_to_num(arena_r))
    with pytest.raises(ValueError, match="q norm weight"):
        rope_store_kv(q, k, v, cos, sin, kf, vf, slots, qk_norm=(q_w[:4], k_w, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hk, d, half, rot_dtype, q_stride", [
    (4, 1, 256, 128, torch.bfloat16, 1),  # Gemma 3 270M
    (16, 2, 256, 32, torch.float32, 2),  # Qwen3-Next: partial rotary, q beside its gate
])  # fmt: skip
def test_rope_store_kv_with_qk_norm_gpu(hq, hk, d, half, rot_dtype, q_stride):
    """Real head shapes, 48 tokens, bf16: close to the reference, and a token's q and
    cached K bits do not depend on the other tokens of the call."""
    from unimem_kernel.kv_store import rope_store_kv, rope_store_kv_reference

    gen = torch.Generator().manual_seed(2)
    t, page_size, pages = 48, 16, 8
    width = hq * q_stride * d + 2 * hk * d
    proj = (torch.randn(t, width, generator=gen) * 3).to(torch.bfloat16).cuda()
    q = proj[:, : hq * q_stride * d].view(t, hq, q_stride * d)[..., :d]
    k = proj[:, hq * q_stride * d : hq * q_stride * d + hk * d].view(t, hk, d)
    v = proj[:, hq * q_stride * d + hk * d :].view(t, hk, d)
    w = (torch.randn(2, d, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    cos, sin = rope_tables(t, half, rot_dtype, "cuda", gen)
    slots = (torch.arange(t, dtype=torch.int32) + page_size).cuda()
    norm = (w[0], w[1], 1e-6)
    _, kf, vf = arena_caches(pages, page_size, hk, d, d, torch.bfloat16, "cuda")
    qf = rope_store_kv(q, k, v, cos, sin, kf, vf, slots, qk_norm=norm)
    _, kr, vr = arena_caches(pages, page_size, hk, d, d, torch.bfloat16, "cuda")
    qr = rope_store_kv_reference(q, k, v, cos, sin, kr, vr, slots, qk_norm=norm)
    torch.testing.assert_close(qf.float(), qr.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kf[1:4].float(), kr[1:4].float(), rtol=2e-2, atol=2e-2)
    _, k1, v1 = arena_caches(pages, page_size, hk, d, d, torch.bfloat16, "cuda")
    q1 = rope_store_kv(q[5:6], k[5:6], v[5:6], cos[5:6], sin[5:6], k1, v1, slots[5:6],
                       qk_norm=norm)  # fmt: skip
    assert torch.equal(q1, qf[5:6]) and torch.equal(k1[1, 5], kf[1, 5])
