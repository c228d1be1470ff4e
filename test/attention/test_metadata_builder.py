"""MetadataBuilder: capture-stable buffers, tail contract, and values equal to a manual
computation; end to end with the reference backend, static (identity) and unified
(translated) memory give bit-identical attention outputs that equal dense attention."""

from __future__ import annotations

import pytest
import torch
from test_torch_backend import carve_views, dense_attention

from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.attention.torch_backend import TorchReferenceBackend

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
P = 4  # page size
ROWS, CTX = 5, 32  # request table
PAGES_PER_ROW = CTX // P


def make_tables(device, seed=0):
    """Request table with virtual page ``1 + r * PAGES_PER_ROW + c`` for row ``r``, column
    ``c``; a random FULL v2p (a few pages unbound) and SWA v2p (a few more retired)."""
    g = torch.Generator().manual_seed(seed)
    num_virt = 1 + ROWS * PAGES_PER_ROW
    vpage = 1 + torch.arange(ROWS)[:, None] * PAGES_PER_ROW + torch.arange(PAGES_PER_ROW)
    tok = torch.arange(CTX)
    r2t = (vpage[:, tok // P] * P + tok % P).to(torch.int32)
    r2t[4, 20:] = -1  # a row with unreserved tail
    full_v2p = (torch.randperm(num_virt + 7, generator=g)[:num_virt] + 1).to(torch.int32)
    full_v2p[0] = -1
    full_v2p[vpage[1, 6]] = -1  # unbound
    swa_v2p = (torch.randperm(num_virt + 3, generator=g)[:num_virt] + 1).to(torch.int32)
    swa_v2p[vpage[0, 0]] = -1  # retired
    swa_v2p[vpage[2, :2]] = -1
    return r2t.to(device), full_v2p.to(device), swa_v2p.to(device)


def phys_page(vtok, v2p):
    if vtok < 0:
        return 0
    vp = vtok // P
    if v2p is None:
        return vp
    return max(int(v2p[vp]), 0) if vp < len(v2p) else 0


def phys_slot(vtok, v2p):
    if vtok < 0:
        return 0
    if v2p is None:
        return vtok
    vp = vtok // P
    p = int(v2p[vp]) if vp < len(v2p) else -1
    return p * P + vtok % P if p >= 0 else 0


def expected(r2t, rpi, prefix, new, full_v2p, swa_v2p, width):
    """Manual metadata: lengths, prefix sums, page tables (tail 0), slots and positions."""
    r2t, full, swa = r2t.cpu().tolist(), full_v2p.cpu().tolist(), swa_v2p.cpu().tolist()
    totals = [a + b for a, b in zip(prefix, new, strict=True)]
    tables = {"full": [], "swa": []}
    for name, v2p in (("full", full), ("swa", swa)):
        for b, r in enumerate(rpi):
            n = -(-totals[b] // P)
            row = [phys_page(r2t[r][c * P], v2p) if c < n else 0 for c in range(width)]
            tables[name].append(row)
    slots = {"full": [], "swa": []}
    positions = []
    for b, r in enumerate(rpi):
        for j in range(new[b]):
            pos = prefix[b] + j
            positions.append(pos)
            vtok = r2t[r][pos] if pos < CTX else -1
            slots["full"].append(phys_slot(vtok, full))
            slots["swa"].append(phys_slot(vtok, swa))
    cum = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
    return dict(
        cu_seqlens_q=cum(new),
        cache_seqlens=totals,
        cu_seqlens_k=cum(totals),
        page_table=tables["full"],
        swa_page_table=tables["swa"],
        full_write_slots=slots["full"],
        swa_write_slots=slots["swa"],
        positions=positions,
    )


def check(meta: AttentionMetadata, want: dict) -> None:
    for name, values in want.items():
        got = getattr(meta, name)
        assert got.cpu().tolist() == values, name


def pointers(meta: AttentionMetadata) -> dict:
    return {
        name: getattr(meta, name).data_ptr()
        for name in (
            "cu_seqlens_q", "cache_seqlens", "cu_seqlens_k", "page_table", "swa_page_table",
            "full_write_slots", "swa_write_slots", "positions",
        )
    }  # fmt: skip


def i32(xs, device):
    return torch.tensor(xs, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_same_buffers_every_call_tails_cleared_values_exact(device):
    r2t, full_v2p, swa_v2p = make_tables(device)
    builder = MetadataBuilder(
        max_bs=4, max_pages_per_req=10, max_tokens=40, page_size=P, swa=True, device=device
    )
    width = 10
    # 1) decode, 4 requests with long contexts (fills many columns)
    rpi, seq = [0, 1, 2, 3], [27, 25, 30, 12]
    m1 = builder.decode(r2t, i32(rpi, device), i32(seq, device), full_v2p, swa_v2p)
    check(m1, expected(r2t, rpi, seq, [1] * 4, full_v2p, swa_v2p, width))
    assert (m1.max_seqlen_q, m1.num_tokens, m1.max_seqlen_k) == (1, 4, 10 * P)
    # 2) verify, 2 requests, short: stale columns of rows 0-1 must be cleared
    rpi, seq = [3, 0], [2, 5]
    m2 = builder.verify(
        r2t, i32(rpi, device), i32(seq, device), full_v2p, swa_v2p, gamma=3, max_seqlen_k=9
    )
    check(m2, expected(r2t, rpi, seq, [4, 4], full_v2p, swa_v2p, width))
    assert (m2.max_seqlen_q, m2.num_tokens, m2.max_seqlen_k) == (4, 8, 9)
    # 3) ragged extend with a zero-length request and a prefix; row 4 has an unreserved tail
    rpi, prefix, new = [4, 2, 1], [16, 0, 9], [6, 0, 13]
    m3 = builder.extend(
        r2t, i32(rpi, device), i32(prefix, device), i32(new, device), full_v2p, swa_v2p,
        num_tokens=19, max_seqlen_q=13,
    )  # fmt: skip
    check(m3, expected(r2t, rpi, prefix, new, full_v2p, swa_v2p, width))
    # decode and verify say their query blocks are uniform; a ragged extend does not
    assert m1.uniform_q and m2.uniform_q and not m3.uniform_q
    # Every tensor is a slice of the same owned buffer, call after call.
    assert pointers(m1) == pointers(m2) == pointers(m3)
    assert m1.page_table.data_ptr() == builder.buffers.page_table.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_identity_and_swa_alias(device):
    r2t, _, _ = make_tables(device)
    builder = MetadataBuilder(
        max_bs=2, max_pages_per_req=8, max_tokens=8, page_size=P, swa=True, device=device
    )
    meta = builder.decode(r2t, i32([1, 3], device), i32([6, 17], device), None, None)
    # identity: physical page = virtual page; SWA aliases FULL
    assert meta.page_table[0, :2].tolist() == [1 + PAGES_PER_ROW, 2 + PAGES_PER_ROW]
    assert meta.swa_page_table is meta.page_table
    assert meta.swa_write_slots is meta.full_write_slots
    assert meta.full_write_slots.tolist() == [int(r2t[1, 6]), int(r2t[3, 17])]
    no_swa = MetadataBuilder(
        max_bs=2, max_pages_per_req=8, max_tokens=8, page_size=P, swa=False, device=device
    )
    meta = no_swa.decode(r2t, i32([1], device), i32([6], device), None)
    assert meta.swa_page_table is None
    with pytest.raises(ValueError, match="SWA"):
        meta.table(swa=True)


def test_capacity_errors():
    r2t, v2p, _ = make_tables("cpu")
    builder = MetadataBuilder(
        max_bs=2, max_pages_per_req=8, max_tokens=4, page_size=P, swa=False, device="cpu"
    )
    with pytest.raises(ValueError, match="max_bs"):
        builder.decode(r2t, i32([0, 1, 2], "cpu"), i32([1, 1, 1], "cpu"), v2p)
    with pytest.raises(ValueError, match="max_tokens"):
        builder.verify(r2t, i32([0, 1], "cpu"), i32([1, 1], "cpu"), v2p, gamma=3)
    with pytest.raises(ValueError, match="max_pages_per_req"):
        MetadataBuilder(
            max_bs=1, max_pages_per_req=0, max_tokens=1, page_size=P, swa=False, device="cpu"
        )


# ---------------------------------------------------------------------------------------------
# end to end: builder + reference backend, static vs unified memory
# ---------------------------------------------------------------------------------------------

HQ, HKV, DK, DV = 4, 2, 16, 8
WINDOW = 6


class Memory:
    """One FULL and one SWA layer's caches; ``unified`` translates through random v2p tables,
    static uses virtual pages as physical ones."""

    def __init__(self, unified: bool, device):
        self.r2t = make_tables(device)[0]  # rows 0, 2, 4 stay within their reserved tokens
        num_phys = 1 + ROWS * PAGES_PER_ROW + 8
        if unified:
            g = torch.Generator().manual_seed(11)
            n = 1 + ROWS * PAGES_PER_ROW
            self.full_v2p = (torch.randperm(num_phys - 1, generator=g)[:n] + 1).to(torch.int32)
            self.swa_v2p = (torch.randperm(num_phys - 1, generator=g)[:n] + 1).to(torch.int32)
            self.full_v2p, self.swa_v2p = self.full_v2p.to(device), self.swa_v2p.to(device)
        else:
            self.full_v2p = self.swa_v2p = None
        dt = torch.float64
        self.full = carve_views(num_phys, P, HKV, DK, DV, dt, device)[1:]
        self.swa = carve_views(num_phys, P, HKV, DK, DV, dt, device, lane=2)[1:]
        self.builder = MetadataBuilder(
            max_bs=3, max_pages_per_req=PAGES_PER_ROW, max_tokens=32, page_size=P, swa=True,
            device=device,
        )  # fmt: skip


def run_steps(memory: Memory, device):
    """Prefill (extend), two decodes and a gamma=2 verify on requests in rows 0, 2, 4; returns
    the FULL and SWA layer outputs of every step and the per-request dense K/V history."""
    g = torch.Generator().manual_seed(5)
    rows = [0, 2, 4]
    hist = {name: [[torch.empty(0, HKV, d, dtype=torch.float64)] * 3 for d in (DK, DV)]
            for name in ("full", "swa")}  # fmt: skip
    outs, refs = [], []
    lens = [0, 0, 0]
    backend = TorchReferenceBackend()
    rpi = i32(rows, device)

    def step(meta, new):
        t = sum(new)
        q = torch.randn(t, HQ, DK, generator=g, dtype=torch.float64)
        for name, window in (("full", None), ("swa", WINDOW)):
            k = torch.randn(t, HKV, DK, generator=g, dtype=torch.float64)
            v = torch.randn(t, HKV, DV, generator=g, dtype=torch.float64)
            k_cache, v_cache = getattr(memory, name)
            o = backend.forward(
                q.to(device), k.to(device), v.to(device), k_cache, v_cache, meta,
                swa=name == "swa", window=window, scale=DK**-0.5,
            )  # fmt: skip
            outs.append(o.cpu())
            start = 0
            for b in range(3):
                hk, hv = hist[name]
                hk[b] = torch.cat([hk[b], k[start : start + new[b]]])
                hv[b] = torch.cat([hv[b], v[start : start + new[b]]])
                if new[b]:
                    refs.append(
                        dense_attention(
                            q[start : start + new[b]], hk[b], hv[b], window=window,
                            scale=DK**-0.5,
                        )
                    )  # fmt: skip
                start += new[b]
            refs_out = torch.cat(refs[-sum(1 for n in new if n) :])
            torch.testing.assert_close(o.cpu(), refs_out, rtol=1e-10, atol=1e-12)
        for b in range(3):
            lens[b] += new[b]

    b = memory.builder
    new = [5, 11, 3]
    meta = b.extend(
        memory.r2t, rpi, i32(lens, device), i32(new, device), memory.full_v2p, memory.swa_v2p,
        num_tokens=sum(new), max_seqlen_q=max(new),
    )  # fmt: skip
    step(meta, new)
    for _ in range(2):
        meta = b.decode(memory.r2t, rpi, i32(lens, device), memory.full_v2p, memory.swa_v2p)
        step(meta, [1, 1, 1])
    meta = b.verify(memory.r2t, rpi, i32(lens, device), memory.full_v2p, memory.swa_v2p, gamma=2)
    step(meta, [3, 3, 3])
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_static_and_unified_are_bit_identical_and_exact(device):
    static = run_steps(Memory(unified=False, device=device), device)
    unified = run_steps(Memory(unified=True, device=device), device)
    assert len(static) == len(unified) == 8
    for a, b in zip(static, unified, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_builder_runs_the_triton_kernels_on_cpu(monkeypatch):
    """The same checks with the builder's Triton kernels forced on CPU (the interpreter),
    so the dispatch path that runs on GPUs is exercised in this layer's CPU tests too."""
    import unimem_kernel.metadata as metadata_ops

    launched = []
    for name in ("build_decode_metadata_triton", "build_extend_metadata_triton"):
        real = getattr(metadata_ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            launched.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(metadata_ops, name, spy)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    test_same_buffers_every_call_tails_cleared_values_exact("cpu")
    test_static_and_unified_are_bit_identical_and_exact("cpu")
    assert set(launched) == {"build_decode_metadata_triton", "build_extend_metadata_triton"}
