"""FA4Backend (flash_attn.cute) through arena-strided views equals the torch reference.

GPU tests (``gpu`` marker; they also need flash-attn-4): bf16 caches carved from a uint8 arena
whose envelopes hold several layers (page stride > one layer's block), random non-identity
page tables, every page nobody owns filled with NaN (handed-out pages are zeroed first, as the
allocator does: FA4 loads whole tiles, and a NaN in a masked row still poisons the sum), and
the CUDA caching allocator's free memory filled with NaN before each run so an output element
FA4 fails to write shows up. Compared with ``TorchReferenceBackend`` (float32 math on the same
bf16 data) by relative error.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
from test_torch_backend import carve_views

from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.attention.torch_backend import TorchReferenceBackend

HAS_FA4 = importlib.util.find_spec("flash_attn") is not None and (
    importlib.util.find_spec("flash_attn.cute") is not None
)
needs_fa4 = pytest.mark.skipif(not HAS_FA4, reason="needs flash-attn-4 (flash_attn.cute)")
REL_TOL = 2e-2


def test_missing_fa4_gives_clear_error():
    if HAS_FA4:
        pytest.skip("flash-attn-4 is installed")
    from unimem.attention.fa4_backend import FA4Backend

    with pytest.raises(ImportError, match="flash-attn-4"):
        FA4Backend()


def poison_allocator(nbytes: int) -> None:
    """Fill ``nbytes`` of the caching allocator's memory with NaN and free it, so that the next
    allocations of that size class (FA4's output) start out as NaN."""
    blocks = [torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")]
    del blocks


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def build_gpu_case(ctx_lens, q_lens, *, page_size, hq, hkv, dk, dv, window=None, seed=0):
    """Like the CPU case: caches with each request's cached tokens, the step's q/k/v and
    metadata. Used pages are zeroed before being written; all other pages stay NaN."""
    g = torch.Generator().manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    bs = len(ctx_lens)
    totals = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    n_pages = [-(-t // page_size) for t in totals]
    num_phys = 1 + sum(n_pages) + 7
    _, k_cache, v_cache = carve_views(num_phys, page_size, hkv, dk, dv, dt, dev, lanes=3, lane=1)
    width = max(n_pages) + 3
    perm = (torch.randperm(num_phys - 1, generator=g) + 1).tolist()
    table = torch.zeros(bs, width, dtype=torch.int32)
    slots, qs, ks, vs = [], [], [], []
    for b in range(bs):
        oldest = 0 if window is None else max(0, totals[b] - q_lens[b] - window + 1)
        for c in range(n_pages[b]):
            if (c + 1) * page_size <= oldest:
                continue  # retired SWA page: the sink
            p = perm.pop()
            table[b, c] = p
            k_cache[p].zero_()
            v_cache[p].zero_()
        kb = torch.randn(totals[b], hkv, dk, generator=g).to(dt)
        vb = torch.randn(totals[b], hkv, dv, generator=g).to(dt)
        for j in range(totals[b]):
            p, off = int(table[b, j // page_size]), j % page_size
            if j < ctx_lens[b]:
                if p:
                    k_cache[p, off] = kb[j].to(dev)
                    v_cache[p, off] = vb[j].to(dev)
            else:
                slots.append(p * page_size + off)
        qs.append(torch.randn(q_lens[b], hq, dk, generator=g).to(dt))
        ks.append(kb[ctx_lens[b] :])
        vs.append(vb[ctx_lens[b] :])
    t = sum(q_lens)
    cu = lambda xs: torch.tensor([0, *xs]).cumsum(0).to(torch.int32).to(dev)  # noqa: E731
    slot_t = torch.tensor(slots, dtype=torch.int32, device=dev).reshape(t)
    meta = AttentionMetadata(
        cu_seqlens_q=cu(q_lens),
        cache_seqlens=torch.tensor(totals, dtype=torch.int32, device=dev),
        cu_seqlens_k=cu(totals),
        page_table=table.to(dev),
        swa_page_table=table.to(dev),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=width * page_size,
        num_tokens=t,
        page_size=page_size,
        full_write_slots=slot_t,
        swa_write_slots=slot_t,
        positions=torch.zeros(t, dtype=torch.int64, device=dev),
    )
    q, k, v = (torch.cat(x).to(dev) for x in (qs, ks, vs))
    return k_cache, v_cache, meta, q, k, v


MODES = {
    "decode": ([0, 70, 300, 1000, 129], [1, 1, 1, 1, 1]),
    "verify": ([5, 130, 64, 700], [4, 4, 4, 4]),
    "extend": ([0, 200, 33, 90], [40, 1, 77, 0]),
}


def run_and_compare(
    mode,
    page_size,
    window,
    hq,
    hkv,
    dk,
    dv,
    split_kv=False,
    sinks=False,
    narrow_tile=True,
    full_table=False,
):
    """``split_kv``: the step is marked uniform (decode, verify) and the backend takes its
    split-KV kernel for it; else FA4 itself. ``sinks``: random per-head attention sinks.
    ``narrow_tile``: the backend's option (FA4's 64-row tile for short steps).
    ``full_table``: the window applies to a FULL page table (every page of the context
    present: a FULL-hosted draft layer with a context window). Returns the backend's
    output."""
    from unimem.attention.fa4_backend import FA4Backend

    ctx, qn = MODES[mode]
    k_cache, v_cache, meta, q, k, v = build_gpu_case(
        ctx, qn, page_size=page_size, hq=hq, hkv=hkv, dk=dk, dv=dv,
        window=None if full_table else window,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(dk)
    swa = window is not None and not full_table
    backend = FA4Backend(split_kv_max_bs=16 if split_kv else 0, narrow_tile=narrow_tile)
    if split_kv:
        meta = dataclasses.replace(meta, uniform_q=True)
        layout = {"q_heads": hq, "head_dim": dk}
        assert backend.takes_split_kv(meta, **layout)
        assert not backend.takes_split_kv(meta, invariant=True, **layout)
    sink = None
    if sinks:
        sink = torch.randn(hq, generator=torch.Generator().manual_seed(4)).cuda()
    poison_allocator(64 << 20)
    out = backend.forward(
        q, k, v, k_cache, v_cache, meta, swa=swa, window=window, scale=scale, sinks=sink
    )
    torch.cuda.synchronize()
    assert out.shape == (meta.num_tokens, hq, dv) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "FA4 read a NaN (unowned page or unwritten output)"
    # the store went through the arena views: the reference reads the same caches
    ref = TorchReferenceBackend().attend(
        q, k_cache, v_cache, meta, swa=swa, window=window, scale=scale, sinks=sink
    )
    assert rel_err(out, ref) < REL_TOL
    # per request too (a single wrong page shows up even when the batch norm hides it)
    cu = meta.cu_seqlens_q.tolist()
    for b in range(meta.batch_size):
        if cu[b + 1] > cu[b]:
            assert rel_err(out[cu[b] : cu[b + 1]], ref[cu[b] : cu[b + 1]]) < REL_TOL, b
    return out


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("window", [None, 48, 100000])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_fa4_matches_reference_gqa(mode, page_size, window):
    run_and_compare(mode, page_size, window, hq=8, hkv=2, dk=128, dv=128)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_split_kv_path_matches_reference(mode, page_size, window):
    """Small uniform steps through the backend's split-KV kernel: the reference's outputs."""
    run_and_compare(mode, page_size, window, hq=8, hkv=2, dk=128, dv=128, split_kv=True)
    run_and_compare(mode, 64, window, hq=8, hkv=1, dk=192, dv=128, split_kv=True)
    # Qwen3-Next's attention (16 / 2 heads of 256) and gpt-oss's (64 / 8 of 64, sinks)
    run_and_compare(mode, page_size, window, hq=16, hkv=2, dk=256, dv=256, split_kv=True)
    run_and_compare(mode, 16, window, hq=64, hkv=8, dk=64, dv=64, split_kv=True, sinks=True)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("split_kv", [False, True])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_window_over_a_full_table_matches_reference(mode, split_kv):
    """A sliding window over a FULL page table (a FULL-hosted draft layer with a context
    window: all its pages present, the window a mask only), FA4 and the split-KV kernel, at
    the Gemma 3 drafter's head layout."""
    if split_kv and mode == "extend":
        pytest.skip("the split-KV kernel takes uniform decode/verify steps only")
    run_and_compare(mode, 64, 48, hq=4, hkv=1, dk=256, dv=256, split_kv=split_kv, full_table=True)


# (page size, Hq, Hkv, head dim, sinks): the small preset's attention, Qwen3-Next's, gpt-oss's
NARROW_LAYOUTS = [(64, 16, 4, 128, False), (64, 16, 2, 256, False), (16, 64, 8, 64, True)]


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("layout", NARROW_LAYOUTS, ids=["small", "qwen3_next", "gpt_oss"])
def test_narrow_tile_matches_reference_and_default_tile(mode, window, layout):
    """Short steps through FA4's 64-row tile: the reference's outputs, and bit for bit the
    same step's through FA4's default tile (what lets batch-invariant mode take it)."""
    from unimem.attention.fa4_backend import FA4Backend, narrow_query_tile

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the narrow tile is an SM90 path")
    page_size, hq, hkv, d, sinks = layout
    q_len = max(MODES[mode][1])
    assert narrow_query_tile(q_len, hq, hkv, d, d, local=window is not None) is not None
    assert FA4Backend()._narrow_fwd is not None, "FA4 4.0.0b36's internal forward changed"
    args = (mode, page_size, window, hq, hkv, d, d)
    narrow = run_and_compare(*args, sinks=sinks)
    default = run_and_compare(*args, sinks=sinks, narrow_tile=False)
    assert torch.equal(narrow, default)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_fa4_asymmetric_head_dims(mode, window):
    # (192, 128): SM90 accepts any (Dk, Dv) in 8..256 (multiples of 8); SM100 this pair.
    run_and_compare(mode, 64, window, hq=8, hkv=1, dk=192, dv=128)


@pytest.mark.gpu
@needs_fa4
def test_fa4_mha_small_head_dim():
    run_and_compare("verify", 16, None, hq=4, hkv=4, dk=64, dv=64)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("split_kv_max_bs", [0, 16])
@pytest.mark.parametrize("page_size", [64, 128])
def test_fa4_cuda_graph_replays_live_v2p(page_size, split_kv_max_bs):
    """builder.decode + forward captured in one CUDA graph; between replays the data of some
    pages moves (compaction: bytes copied, v2p rewritten, old pages poisoned) and lengths grow.
    Each replay equals the eager reference on the live tables. Through FA4 and through the
    split-KV kernel the backend takes for small decode steps."""
    from unimem.attention.fa4_backend import FA4Backend

    g = torch.Generator().manual_seed(1)
    dev, dt = "cuda", torch.bfloat16
    hq, hkv, d = 8, 2, 128
    rows, pages_per_row, bs = 4, 8, 3
    ctx = pages_per_row * page_size
    num_virt = 1 + rows * pages_per_row
    num_phys = 2 * num_virt + 1
    _, k_cache, v_cache = carve_views(num_phys, page_size, hkv, d, d, dt, dev)
    vpage = 1 + torch.arange(rows)[:, None] * pages_per_row + torch.arange(pages_per_row)
    tok = torch.arange(ctx)
    r2t = (vpage[:, tok // page_size] * page_size + tok % page_size).to(torch.int32).to(dev)
    v2p = torch.full((num_virt,), -1, dtype=torch.int32)
    v2p[1:] = torch.randperm(num_virt - 1, generator=g).to(torch.int32) + 1
    v2p = v2p.to(dev)
    for p in v2p[1:].tolist():  # handed-out pages: zeroed, then filled with history
        k_cache[p].normal_()
        v_cache[p].normal_()

    builder = MetadataBuilder(
        max_bs=bs, max_pages_per_req=pages_per_row, max_tokens=bs, page_size=page_size,
        swa=False, device=dev,
    )  # fmt: skip
    rpi = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    seq = torch.tensor([page_size - 1, 3 * page_size + 5, 1], dtype=torch.int32, device=dev)
    q = torch.randn(bs, hq, d, generator=g).to(dt).to(dev)
    k = torch.randn(bs, hkv, d, generator=g).to(dt).to(dev)
    v = torch.randn(bs, hkv, d, generator=g).to(dt).to(dev)
    backend = FA4Backend(split_kv_max_bs=split_kv_max_bs)
    scale = d**-0.5
    backend.warmup(k_cache, v_cache, num_q_heads=hq, q_lens=(1,), batch_sizes=(bs,))

    def step():
        meta = builder.decode(r2t, rpi, seq, v2p)
        return meta, backend.forward(
            q, k, v, k_cache, v_cache, meta, swa=False, window=None, scale=scale
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager first launch of every kernel (Triton compiles, FA4 warm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta, out = step()

    reference = TorchReferenceBackend()
    for it in range(3):
        poison_allocator(16 << 20)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        ref = reference.attend(q, k_cache, v_cache, meta, swa=False, window=None, scale=scale)
        assert rel_err(out, ref) < REL_TOL, it
        # compaction: move every live page of request row 0 to a fresh physical page
        free = sorted(set(range(1, num_phys)) - set(v2p.tolist()))
        for c, vp in enumerate(vpage[0].tolist()):
            old, new = int(v2p[vp]), free[c]
            k_cache[new].copy_(k_cache[old])
            v_cache[new].copy_(v_cache[old])
            k_cache[old].fill_(float("nan"))
            v_cache[old].fill_(float("nan"))
            v2p[vp] = new
        seq += 1
        q.normal_()
