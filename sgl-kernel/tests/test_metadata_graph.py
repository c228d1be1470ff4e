"""The metadata and write-window ops inside a captured CUDA graph (GPU only).

Each op is warmed up eagerly (Triton compiles on first launch, which must not happen inside
capture), captured once with garbage-filled outputs, then replayed after in-place changes to
its inputs: ``v2p`` permuted, SWA pages retired, ``seq_lens`` made shorter and longer,
``req_pool_indices`` repointed. After every replay the outputs must equal the torch reference
run on the same inputs, so a stale entry from an earlier replay (e.g. a tail column left by a
longer row) fails the test.
"""

from __future__ import annotations

import pytest
import torch

from unimem_kernel.metadata import (
    build_decode_metadata,
    build_decode_metadata_reference,
    build_extend_metadata,
    build_extend_metadata_reference,
)
from unimem_kernel.write_window import gather_write_window, gather_write_window_reference

pytestmark = pytest.mark.gpu

GARBAGE = 0x7FFF_FFF0
ROWS, CTX_PAGES, N_VIRT = 24, 10, 400


class Tables:
    """Device tables the graph reads; every mutation happens in place."""

    def __init__(self, page_size: int, bs: int, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.p = page_size
        self.bs = bs
        ctx = CTX_PAGES * page_size
        r2t = torch.zeros(ROWS, ctx, dtype=torch.int32)
        vpages = 1 + torch.randperm(N_VIRT - 1, generator=self.g)
        for r in range(1, ROWS):
            vp = vpages[(r - 1) * CTX_PAGES : r * CTX_PAGES]
            r2t[r] = (vp[:, None] * page_size + torch.arange(page_size)).reshape(-1).int()
        self.r2t = r2t.cuda()
        self.full_v2p = torch.zeros(N_VIRT, dtype=torch.int32, device="cuda")
        self.swa_v2p = torch.zeros(N_VIRT, dtype=torch.int32, device="cuda")
        self.rpi = torch.zeros(bs, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.zeros(bs, dtype=torch.int32, device="cuda")
        self.extend_lens = torch.zeros(bs, dtype=torch.int32, device="cuda")
        self.permute_v2p()
        self.swa_v2p.copy_(self.full_v2p)
        self.repoint_rows()
        self.set_lengths(long=True)

    def permute_v2p(self):
        perm = torch.zeros(N_VIRT, dtype=torch.int32)
        perm[1:] = 1 + torch.randperm(N_VIRT - 1, generator=self.g).int()
        self.full_v2p.copy_(perm)

    def retire_swa(self):
        idx = torch.randperm(N_VIRT, generator=self.g)[: N_VIRT // 3]
        self.swa_v2p[idx.cuda()] = -1

    def repoint_rows(self):
        rows = (1 + torch.randperm(ROWS - 1, generator=self.g)[: self.bs]).int()
        rows[-1] = 0  # padded lane
        self.rpi.copy_(rows)

    def set_lengths(self, long: bool):
        hi = (CTX_PAGES + 2) * self.p if long else 2 * self.p
        self.seq_lens.copy_(torch.randint(0, hi, (self.bs,), generator=self.g).int())
        ext = torch.randint(0, 2 * self.p, (self.bs,), generator=self.g).int()
        ext[::3] = 0
        self.extend_lens.copy_(ext)

    def mutations(self):
        """Each yields after changing something in place."""
        self.permute_v2p()
        yield "permute v2p"
        self.retire_swa()
        yield "retire swa"
        self.set_lengths(long=False)
        yield "shorter"
        self.repoint_rows()
        yield "repoint rows"
        self.set_lengths(long=True)
        self.permute_v2p()
        yield "longer + permute"
        self.set_lengths(long=False)
        self.retire_swa()
        self.repoint_rows()
        yield "everything"


def garbage_like(t):
    return torch.full_like(t, GARBAGE)


def capture(fn):
    """Warm up on a side stream (compiles the kernel), then capture one call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def make_outputs(max_bs, width, swa):
    cache = torch.empty(max_bs, dtype=torch.int32, device="cuda")
    cu_k = torch.empty(max_bs + 1, dtype=torch.int32, device="cuda")
    cu_q = torch.empty(max_bs + 1, dtype=torch.int32, device="cuda")
    pt_base = torch.empty(max_bs, width + 2, dtype=torch.int32, device="cuda")
    spt = torch.empty(max_bs, width, dtype=torch.int32, device="cuda") if swa else None
    return [cache, cu_k, cu_q, pt_base, spt]


def fill_garbage(outs):
    for t in outs:
        if t is not None:
            t.fill_(GARBAGE)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
@pytest.mark.parametrize("identity", [False, True], ids=["v2p", "identity"])
def test_decode_graph_replay_tracks_live_tables(page_size, swa, identity):
    bs, max_bs, width, extra = 7, 9, CTX_PAGES + 1, 3
    t = Tables(page_size, bs, seed=page_size + 2 * swa + identity)
    outs = make_outputs(max_bs, width, swa)
    cache, cu_k, _, pt_base, spt = outs
    pt = pt_base[:, 1 : 1 + width]
    fv = None if identity else t.full_v2p
    sv = t.swa_v2p if swa else None

    def step():
        build_decode_metadata(
            t.r2t, t.rpi, t.seq_lens, extra, page_size, fv, sv, cache, cu_k, pt, spt
        )

    graph = capture(step)
    fill_garbage(outs)
    ref = make_outputs(max_bs, width, swa)
    fill_garbage(ref)
    for what in [None, *t.mutations()]:
        graph.replay()
        torch.cuda.synchronize()
        rpt = ref[3][:, 1 : 1 + width]
        build_decode_metadata_reference(
            t.r2t, t.rpi, t.seq_lens, extra, page_size, fv, sv, ref[0], ref[1], rpt, ref[4]
        )
        for a, b in zip(outs, ref, strict=True):
            if a is not None:
                assert torch.equal(a, b), what


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
def test_extend_graph_replay_tracks_live_tables(page_size, swa):
    bs, max_bs, width = 6, 8, CTX_PAGES + 1
    t = Tables(page_size, bs, seed=100 + page_size + swa)
    outs = make_outputs(max_bs, width, swa)
    cache, cu_k, cu_q, pt_base, spt = outs
    pt = pt_base[:, 1 : 1 + width]
    sv = t.swa_v2p if swa else None

    def step():
        build_extend_metadata(
            t.r2t, t.rpi, t.seq_lens, t.extend_lens, page_size, t.full_v2p, sv,
            cu_q, cache, cu_k, pt, spt,
        )  # fmt: skip

    graph = capture(step)
    fill_garbage(outs)
    ref = make_outputs(max_bs, width, swa)
    fill_garbage(ref)
    for what in [None, *t.mutations()]:
        graph.replay()
        torch.cuda.synchronize()
        rpt = ref[3][:, 1 : 1 + width]
        build_extend_metadata_reference(
            t.r2t, t.rpi, t.seq_lens, t.extend_lens, page_size, t.full_v2p, sv,
            ref[2], ref[0], ref[1], rpt, ref[4],
        )  # fmt: skip
        for a, b in zip(outs, ref, strict=True):
            if a is not None:
                assert torch.equal(a, b), what


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_write_window_graph_replay_tracks_live_tables(page_size, swa, dtype):
    bs, width = 5, 4
    t = Tables(page_size, bs, seed=200 + page_size + swa)
    n = bs * width + 2

    def outputs():
        full = torch.empty(n, dtype=dtype, device="cuda")
        swa_out = torch.empty(n, dtype=dtype, device="cuda") if swa else None
        pos = torch.empty(n, dtype=torch.int64, device="cuda")
        return [full, swa_out, pos]

    outs = outputs()
    sv = t.swa_v2p if swa else None

    def step():
        gather_write_window(t.r2t, t.rpi, t.seq_lens, width, page_size, t.full_v2p, sv, *outs)

    graph = capture(step)
    fill_garbage(outs)
    ref = outputs()
    fill_garbage(ref)
    for what in [None, *t.mutations()]:
        graph.replay()
        torch.cuda.synchronize()
        gather_write_window_reference(
            t.r2t, t.rpi, t.seq_lens, width, page_size, t.full_v2p, sv, *ref
        )
        for a, b in zip(outs, ref, strict=True):
            if a is not None:
                assert torch.equal(a, b), what


def _capture_cost(fn) -> int:
    """Bytes the caching allocator holds after capturing ``fn`` (warmed up first)."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    cost = torch.cuda.memory_allocated() - before
    del graph
    return cost


def test_capture_allocates_nothing():
    """Capturing the builders takes no more memory than capturing an in-place torch op (the
    graph machinery's own bookkeeping): they allocate no temporaries."""
    t = Tables(16, 4, seed=7)
    outs = make_outputs(4, CTX_PAGES, True)
    cache, cu_k, cu_q, pt_base, spt = outs
    pt = pt_base[:, :CTX_PAGES]
    full = torch.empty(8, dtype=torch.int32, device="cuda")
    pos = torch.empty(8, dtype=torch.int64, device="cuda")
    baseline = _capture_cost(lambda: cache.add_(1))
    decode = _capture_cost(
        lambda: build_decode_metadata(
            t.r2t, t.rpi, t.seq_lens, 1, 16, t.full_v2p, t.swa_v2p, cache, cu_k, pt, spt
        )
    )
    extend = _capture_cost(
        lambda: build_extend_metadata(
            t.r2t,
            t.rpi,
            t.seq_lens,
            t.extend_lens,
            16,
            t.full_v2p,
            None,
            cu_q,
            cache,
            cu_k,
            pt,
            None,
        )  # fmt: skip
    )
    window = _capture_cost(
        lambda: gather_write_window(
            t.r2t, t.rpi, t.seq_lens, 2, 16, t.full_v2p, None, full, None, pos
        )
    )
    assert decode == extend == window == baseline
