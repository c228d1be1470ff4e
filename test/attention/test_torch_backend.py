"""TorchReferenceBackend through arena-strided views equals dense attention.

Each case carves a K and a V view out of a uint8 arena whose page envelope holds several
layers (so the page stride is far larger than one layer's block), fills the whole arena with
NaN, zeroes the sink page, writes each request's cached tokens through a random non-identity
page table, and lets ``forward`` store the step's new tokens at their write slots. Every byte
the backend must not read (unused pages, slots past a request's length, other layers) is NaN,
so any stray read shows up in the output. The oracle is a per-query float64 softmax over
contiguous per-request K/V.
"""

from __future__ import annotations

import math

import pytest
import torch

from unimem.attention.metadata import AttentionMetadata
from unimem.attention.torch_backend import TorchReferenceBackend

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SINK_BYTES = 64  # reserved bytes before the first envelope (keeps offsets non-trivial)


def carve_views(num_pages, page_size, hkv, dk, dv, dtype, device, *, lanes=3, lane=1):
    """A NaN-filled uint8 arena of ``num_pages`` layer-major envelopes (``lanes`` layers of
    ``[P, H, Dk]`` K then ``[P, H, Dv]`` V, plus 16 bytes of padding) and the K/V views of
    layer ``lane``. The sink page's envelope is zero."""
    elt = torch.empty((), dtype=dtype).element_size()
    k_block = page_size * hkv * dk * elt
    v_block = page_size * hkv * dv * elt
    layer = k_block + v_block
    envelope = -(-(lanes * layer + 16) // 16) * 16
    arena = torch.full((SINK_BYTES + num_pages * envelope,), 0xFF, dtype=torch.uint8, device=device)
    arena[SINK_BYTES : SINK_BYTES + envelope] = 0
    typed = arena.view(dtype)
    k_off = SINK_BYTES + lane * layer
    k = typed.as_strided(
        (num_pages, page_size, hkv, dk), (envelope // elt, hkv * dk, dk, 1), k_off // elt
    )
    v = typed.as_strided(
        (num_pages, page_size, hkv, dv),
        (envelope // elt, hkv * dv, dv, 1),
        (k_off + k_block) // elt,
    )
    return arena, k, v


def dense_attention(q, k, v, *, window, scale):
    """Oracle: query ``i`` of ``q [n_q, Hq, Dk]`` at position ``n_k - n_q + i`` over
    ``k [n_k, Hkv, Dk]``, ``v [n_k, Hkv, Dv]`` in float64, with the visible keys of each query
    listed explicitly (``lo(i) .. p(i)``)."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    group = hq // hkv
    visible = torch.zeros(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        p = n_k - n_q + i
        lo = 0 if window is None else max(0, p - window + 1)
        visible[i, lo : p + 1] = True
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,nhd->hqn", q.double(), kk) * scale
    s = s.masked_fill(~visible.to(q.device), float("-inf"))
    return torch.einsum("hqn,nhd->qhd", torch.softmax(s, dim=-1), vv)


def build_case(
    ctx_lens,
    q_lens,
    *,
    page_size,
    hq,
    hkv,
    dk,
    dv,
    dtype=torch.float64,
    device="cpu",
    window=None,
    seed=0,
):
    """Caches holding each request's first ``ctx_lens[b]`` tokens, the step's new tokens
    (``q_lens[b]`` per request) as q/k/v, matching metadata, and the dense per-request K/V.

    With a window, pages whose every token is older than any query can see are *retired*:
    their table entry is the sink 0 and nothing is written for them."""
    g = torch.Generator().manual_seed(seed)
    bs = len(ctx_lens)
    totals = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    n_pages = [-(-t // page_size) for t in totals]
    spare = 5
    num_phys = 1 + sum(n_pages) + spare
    arena, k_cache, v_cache = carve_views(num_phys, page_size, hkv, dk, dv, dtype, device)
    width = max(n_pages) + 2
    perm = (torch.randperm(num_phys - 1, generator=g) + 1).tolist()
    table = torch.zeros(bs, width, dtype=torch.int32)
    dense_k, dense_v = [], []
    slots, q_parts, k_parts, v_parts = [], [], [], []
    for b in range(bs):
        total, n_q = totals[b], q_lens[b]
        oldest = 0 if window is None else max(0, total - n_q - window + 1)
        for c in range(n_pages[b]):
            retired = (c + 1) * page_size <= oldest
            table[b, c] = 0 if retired else perm.pop()
        kb = torch.randn(total, hkv, dk, generator=g, dtype=torch.float64).to(dtype)
        vb = torch.randn(total, hkv, dv, generator=g, dtype=torch.float64).to(dtype)
        dense_k.append(kb.to(device))
        dense_v.append(vb.to(device))
        for j in range(total):
            page, off = int(table[b, j // page_size]), j % page_size
            if j < ctx_lens[b]:
                if page != 0:
                    k_cache[page, off] = kb[j].to(device)
                    v_cache[page, off] = vb[j].to(device)
            else:
                slots.append(page * page_size + off)
        q_parts.append(torch.randn(n_q, hq, dk, generator=g, dtype=torch.float64).to(dtype))
        k_parts.append(kb[ctx_lens[b] :])
        v_parts.append(vb[ctx_lens[b] :])
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cache = torch.tensor(totals, dtype=torch.int32)
    cu_k = torch.tensor([0] + totals, dtype=torch.int32).cumsum(0).to(torch.int32)
    t = sum(q_lens)
    slot_t = torch.tensor(slots, dtype=torch.int32).reshape(t)
    meta = AttentionMetadata(
        cu_seqlens_q=cu_q.to(device),
        cache_seqlens=cache.to(device),
        cu_seqlens_k=cu_k.to(device),
        page_table=table.to(device),
        swa_page_table=table.to(device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(totals),
        num_tokens=t,
        page_size=page_size,
        full_write_slots=slot_t.to(device),
        swa_write_slots=slot_t.to(device),
        positions=torch.cat(
            [torch.arange(c, c + n) for c, n in zip(ctx_lens, q_lens, strict=True)]
        ).to(device),
    )
    q = torch.cat(q_parts).to(device)
    k = torch.cat(k_parts).to(device)
    v = torch.cat(v_parts).to(device)
    return dict(
        arena=arena,
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        q=q,
        k=k,
        v=v,
        dense_k=dense_k,
        dense_v=dense_v,
    )


def expected_output(case, *, window, scale):
    meta = case["meta"]
    cu = meta.cu_seqlens_q.tolist()
    parts = []
    for b in range(meta.batch_size):
        q_b = case["q"][cu[b] : cu[b + 1]]
        if q_b.shape[0]:
            parts.append(
                dense_attention(
                    q_b, case["dense_k"][b], case["dense_v"][b], window=window, scale=scale
                )
            )
    return torch.cat(parts)


MODES = {
    "decode": ([0, 7, 33, 100], [1, 1, 1, 1]),
    "verify": ([3, 16, 64, 90], [4, 4, 4, 4]),  # gamma + 1 = 4
    "extend": ([0, 13, 40, 7, 21], [5, 17, 1, 0, 30]),  # ragged, with and without prefix
}
HEADS = {"gqa_asym": (8, 2, 32, 16), "mha": (4, 4, 16, 16)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("window", [None, 5, 1000])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_reference_matches_dense(mode, page_size, window, heads, device):
    ctx_lens, q_lens = MODES[mode]
    hq, hkv, dk, dv = HEADS[heads]
    case = build_case(
        ctx_lens, q_lens, page_size=page_size, hq=hq, hkv=hkv, dk=dk, dv=dv,
        device=device, window=window, seed=page_size,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(dk)
    swa = window is not None
    out = TorchReferenceBackend().forward(
        case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["meta"],
        swa=swa, window=window, scale=scale,
    )  # fmt: skip
    assert out.shape == (sum(q_lens), hq, dv) and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    ref = expected_output(case, window=window, scale=scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_bf16_close_to_dense(device):
    case = build_case(
        [20, 50], [4, 4], page_size=16, hq=8, hkv=2, dk=64, dv=32, dtype=torch.bfloat16,
        device=device,
    )  # fmt: skip
    out = TorchReferenceBackend().forward(
        case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["meta"],
        swa=False, window=None, scale=0.125,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    ref = expected_output(case, window=None, scale=0.125)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2


def test_store_keeps_sink_zero_and_writes_through_strides():
    case = build_case([4, 9], [3, 2], page_size=4, hq=2, hkv=2, dk=8, dv=8)
    meta = case["meta"]
    # Redirect request 1's lanes to the sink, as a padded or unbound lane would be.
    slots = meta.full_write_slots.clone()
    slots[3:] = 0
    padded = AttentionMetadata(**{**meta.__dict__, "full_write_slots": slots})
    arena_before = case["arena"].clone()
    TorchReferenceBackend().store_kv(
        case["k"], case["v"], case["k_cache"], case["v_cache"], padded, swa=False
    )
    assert (case["k_cache"][0] == 0).all() and (case["v_cache"][0] == 0).all()
    for t in range(3):
        s = int(slots[t])
        assert torch.equal(case["k_cache"][s // 4, s % 4], case["k"][t])
        assert torch.equal(case["v_cache"][s // 4, s % 4], case["v"][t])
    # Only the three written token rows changed; other lanes, tails and pages are intact.
    changed = int((case["arena"] != arena_before).sum())
    assert 0 < changed <= 3 * (2 * 8 * 8 + 2 * 8 * 8)


def test_request_output_independent_of_batch():
    """A request's output is bit-identical alone and inside a batch (no cross-request ops)."""
    full = build_case([10, 37, 5], [4, 4, 4], page_size=16, hq=4, hkv=2, dk=16, dv=16, seed=3)
    backend = TorchReferenceBackend()
    meta = full["meta"]
    # Request 1 alone: same caches, a one-row view of the same metadata.
    alone = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
        cache_seqlens=meta.cache_seqlens[1:2],
        cu_seqlens_k=torch.tensor([0, int(meta.cache_seqlens[1])], dtype=torch.int32),
        page_table=meta.page_table[1:2],
        swa_page_table=None,
        max_seqlen_q=4,
        max_seqlen_k=int(meta.cache_seqlens[1]),
        num_tokens=4,
        page_size=16,
        full_write_slots=meta.full_write_slots[4:8],
        swa_write_slots=None,
        positions=meta.positions[4:8],
    )
    # The cached prefix is in place; the new tokens must be stored first.
    backend.store_kv(full["k"], full["v"], full["k_cache"], full["v_cache"], meta, swa=False)
    out_all = backend.attend(
        full["q"], full["k_cache"], full["v_cache"], meta, swa=False, window=None, scale=0.25
    )
    out_one = backend.attend(
        full["q"][4:8], full["k_cache"], full["v_cache"], alone, swa=False, window=None,
        scale=0.25,
    )  # fmt: skip
    assert torch.equal(out_all[4:8], out_one)


def test_shape_errors():
    case = build_case([3], [1], page_size=4, hq=2, hkv=2, dk=8, dv=8)
    backend = TorchReferenceBackend()
    with pytest.raises(ValueError, match="tokens"):
        backend.attend(
            case["q"][:0], case["k_cache"], case["v_cache"], case["meta"], swa=False,
            window=None, scale=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        backend.attend(
            case["q"], case["k_cache"], case["v_cache"], case["meta"], swa=False, window=0,
            scale=1.0,
        )  # fmt: skip
