"""build_decode_metadata / build_extend_metadata: Triton kernel vs torch reference vs a naive
per-element oracle written from the contract, on fresh random inputs.

Every output starts filled with garbage, so an entry the op should write but does not shows up,
and everything the op must not touch (rows >= bs, entries past bs + 1, columns outside a view)
is compared against that garbage. On CPU the kernel runs through the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

import unimem_kernel.metadata as md
from unimem_kernel.metadata import (
    build_decode_metadata,
    build_decode_metadata_reference,
    build_extend_metadata,
    build_extend_metadata_reference,
)

# Triton runs on CPU tensors only through the interpreter (set by the root conftest when there is
# no GPU); on a GPU machine the compiled kernel is tested through the ``cuda`` variants.
GARBAGE = 0x7FFF_FFF0


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")


# ---------------------------------------------------------------------------------------------
# random cases
# ---------------------------------------------------------------------------------------------


def make_tables(
    seed: int,
    *,
    bs: int,
    page_size: int,
    ctx_pages: int,
    identity: bool,
    swa: bool,
    device: str,
    r2t_col_stride: int = 1,
):
    """Request table, lane indices and v2p tables with every hazard the contract names.

    Row 0 is the padding row (all zeros); padded lanes point at it. Each other row holds
    ``ctx_pages`` virtual pages in random order; some page starts are poisoned with -1 (not
    reserved) or with a virtual page past the end of ``v2p``. ``full_v2p`` is a random
    permutation with some unbound entries; ``swa_v2p`` has about half its pages retired (-1).
    """
    g = torch.Generator().manual_seed(seed)
    p = page_size
    rows = bs + 3
    ctx = ctx_pages * p
    n_virt = rows * ctx_pages + 8
    v2p_len = n_virt - 4  # the last virtual pages have no v2p entry: out of range -> sink
    base = torch.full((rows, ctx * r2t_col_stride + 3), -7, dtype=torch.int32)
    r2t = base[:, 1 : 1 + ctx * r2t_col_stride : r2t_col_stride]
    r2t[0] = 0
    vpages = 1 + torch.randperm(n_virt - 1, generator=g)
    for r in range(1, rows):
        vp = vpages[(r - 1) * ctx_pages : r * ctx_pages]
        r2t[r] = (vp[:, None] * p + torch.arange(p)[None, :]).reshape(-1).to(torch.int32)
    starts = torch.arange(ctx_pages) * p
    for r in range(1, rows):
        k = int(torch.randint(0, ctx_pages, (1,), generator=g))
        r2t[r, starts[k]] = -1
        k = int(torch.randint(0, ctx_pages, (1,), generator=g))
        r2t[r, starts[k]] = (v2p_len + 1) * p  # virtual page past the end of v2p
    full_v2p = torch.zeros(v2p_len, dtype=torch.int32)
    full_v2p[1:] = 1 + torch.randperm(v2p_len - 1, generator=g).to(torch.int32)
    full_v2p[torch.rand(v2p_len, generator=g) < 0.1] = -1
    swa_v2p = torch.zeros(v2p_len, dtype=torch.int32)
    swa_v2p[1:] = 1 + torch.randperm(v2p_len - 1, generator=g).to(torch.int32)
    swa_v2p[torch.rand(v2p_len, generator=g) < 0.5] = -1
    rpi = (1 + torch.randperm(rows - 1, generator=g)[:bs]).to(torch.int32)
    if bs > 2:
        rpi[-1] = 0  # padded lane
    dev = torch.device(device)
    return (
        base.to(dev)[:, 1 : 1 + ctx * r2t_col_stride : r2t_col_stride],
        rpi.to(dev),
        None if identity else full_v2p.to(dev),
        swa_v2p.to(dev) if swa else None,
        g,
    )


def garbage_outputs(max_bs: int, width: int, swa_width: int | None, device: str):
    """Garbage-filled outputs; page tables are column-offset views with a padded row stride."""
    dev = torch.device(device)
    cache = torch.full((max_bs,), GARBAGE, dtype=torch.int32, device=dev)
    cu_k = torch.full((max_bs + 1,), GARBAGE, dtype=torch.int32, device=dev)
    cu_q = torch.full((max_bs + 1,), GARBAGE, dtype=torch.int32, device=dev)
    pt_base = torch.full((max_bs, width + 3), GARBAGE, dtype=torch.int32, device=dev)
    spt_base = None
    if swa_width is not None:
        spt_base = torch.full((max_bs, swa_width + 2), GARBAGE, dtype=torch.int32, device=dev)
    return {"cache": cache, "cu_k": cu_k, "cu_q": cu_q, "pt_base": pt_base, "spt_base": spt_base}


def views(o, width, swa_width):
    pt = o["pt_base"][:, 1 : 1 + width]
    spt = None if o["spt_base"] is None else o["spt_base"][:, 2 : 2 + swa_width]
    return pt, spt


def clone_outputs(o):
    return {k: (None if v is None else v.clone()) for k, v in o.items()}


def assert_outputs_equal(a, b):
    for k in a:
        if a[k] is not None:
            assert torch.equal(a[k].cpu(), b[k].cpu()), k


# ---------------------------------------------------------------------------------------------
# naive oracle: the contract, one element at a time
# ---------------------------------------------------------------------------------------------


def naive_page(r2t, req, col, page_size, v2p):
    rows = len(r2t)
    ctx = len(r2t[0]) if rows else 0
    if not (0 <= req < rows) or col * page_size >= ctx:
        return 0
    vtok = r2t[req][col * page_size]
    if vtok < 0:
        return 0
    vpage = vtok // page_size
    if v2p is None:
        return vpage
    if vpage >= len(v2p):
        return 0
    return max(v2p[vpage], 0)


def check_naive(r2t, rpi, totals, page_size, full_v2p, swa_v2p, o, width, swa_width, bs):
    r2t_l = r2t.cpu().tolist()
    fv = None if full_v2p is None else full_v2p.cpu().tolist()
    sv = None if swa_v2p is None else swa_v2p.cpu().tolist()
    rpi_l = rpi.cpu().tolist()
    pt, spt = views(o, width, swa_width)
    pt, spt = pt.cpu(), None if spt is None else spt.cpu()
    assert o["cache"][:bs].cpu().tolist() == totals
    run = [0]
    for t in totals:
        run.append(run[-1] + t)
    assert o["cu_k"][: bs + 1].cpu().tolist() == run
    assert (o["cache"][bs:] == GARBAGE).all() and (o["cu_k"][bs + 1 :] == GARBAGE).all()
    for b in range(bs):
        n_pages = -(-totals[b] // page_size) if totals[b] > 0 else 0
        for tbl, v2p, w in ((pt, fv, width), (spt, sv, swa_width)):
            if tbl is None:
                continue
            want = [
                naive_page(r2t_l, rpi_l[b], c, page_size, v2p) if c < n_pages else 0
                for c in range(w)
            ]
            assert tbl[b].tolist() == want, (b, totals[b])
    assert (o["pt_base"][bs:] == GARBAGE).all()
    assert (o["pt_base"][:, 0] == GARBAGE).all() and (o["pt_base"][:, 1 + width :] == GARBAGE).all()
    if o["spt_base"] is not None:
        assert (o["spt_base"][bs:] == GARBAGE).all()
        assert (o["spt_base"][:, :2] == GARBAGE).all()


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------


def run_decode(device, seed, *, bs, page_size, width, swa_width, identity, ctx_pages=6, **kw):
    r2t, rpi, fv, sv, g = make_tables(
        seed,
        bs=bs,
        page_size=page_size,
        ctx_pages=ctx_pages,
        identity=identity,
        swa=swa_width is not None,
        device=device,
        **kw,
    )
    extra = int(torch.randint(0, page_size + 2, (1,), generator=g))
    # rows shorter than the table, longer than the table and longer than req_to_token
    hi = (max(width, ctx_pages) + 2) * page_size
    seq_lens = torch.randint(0, hi, (bs,), generator=g, dtype=torch.int32).to(device)
    max_bs = bs + 2
    out = garbage_outputs(max_bs, width, swa_width, device)
    ref = clone_outputs(out)
    pt, spt = views(out, width, swa_width)
    build_decode_metadata(
        r2t, rpi, seq_lens, extra, page_size, fv, sv, out["cache"], out["cu_k"], pt, spt
    )
    pt, spt = views(ref, width, swa_width)
    build_decode_metadata_reference(
        r2t, rpi, seq_lens, extra, page_size, fv, sv, ref["cache"], ref["cu_k"], pt, spt
    )
    assert_outputs_equal(out, ref)
    totals = [s + extra for s in seq_lens.cpu().tolist()]
    check_naive(r2t, rpi, totals, page_size, fv, sv, out, width, swa_width, bs)
    assert (out["cu_q"] == GARBAGE).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("identity", [False, True], ids=["v2p", "identity"])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
def test_decode_matches_reference(device, page_size, identity, swa):
    seed = page_size * 4 + 2 * identity + swa
    run_decode(
        device,
        seed,
        bs=5,
        page_size=page_size,
        width=7,
        swa_width=7 if swa else None,
        identity=identity,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_decode_tables_of_different_widths_and_column_blocks(device, monkeypatch):
    # several column blocks per row; the SWA table is narrower than the FULL one
    monkeypatch.setattr(md, "_MAX_BLOCK_COLS", 4)
    run_decode(device, 11, bs=4, page_size=16, width=11, swa_width=6, identity=False)
    run_decode(device, 12, bs=4, page_size=16, width=5, swa_width=13, identity=False)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_strided_req_to_token(device):
    run_decode(
        device, 21, bs=3, page_size=16, width=8, swa_width=8, identity=False, r2t_col_stride=3
    )


@pytest.mark.parametrize("device", DEVICES)
def test_decode_prefix_sum_in_chunks(device, monkeypatch):
    # bs larger than the cumsum block: chunks carrying a running total
    monkeypatch.setattr(md, "_MAX_BLOCK_BS", 4)
    run_decode(device, 31, bs=11, page_size=16, width=3, swa_width=3, identity=False)


@pytest.mark.slow  # the fast tier runs the chunked cumsum with a block of 4 (above)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_large_batch(device):
    # bs past the default cumsum block (1024) with a one-column table
    run_decode(device, 41, bs=1030, page_size=64, width=1, swa_width=None, identity=False)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_empty_batch(device):
    r2t, _, fv, sv, _ = make_tables(
        5, bs=2, page_size=16, ctx_pages=2, identity=False, swa=True, device=device
    )
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    out = garbage_outputs(3, 2, 2, device)
    pt, spt = views(out, 2, 2)
    build_decode_metadata(r2t, empty, empty, 1, 16, fv, sv, out["cache"], out["cu_k"], pt, spt)
    assert out["cu_k"].cpu().tolist() == [0, GARBAGE, GARBAGE, GARBAGE]
    assert (out["cache"] == GARBAGE).all() and (out["pt_base"] == GARBAGE).all()
    assert (out["spt_base"] == GARBAGE).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_outside_req_to_token_read_the_sink(device):
    r2t, rpi, fv, sv, _ = make_tables(
        6, bs=3, page_size=16, ctx_pages=3, identity=False, swa=True, device=device
    )
    rpi = torch.tensor([-1, 1, r2t.shape[0]], dtype=torch.int32, device=device)
    seq_lens = torch.full((3,), 40, dtype=torch.int32, device=device)
    out = garbage_outputs(3, 3, 3, device)
    pt, spt = views(out, 3, 3)
    build_decode_metadata(r2t, rpi, seq_lens, 1, 16, fv, sv, out["cache"], out["cu_k"], pt, spt)
    assert (pt[0] == 0).all() and (pt[2] == 0).all()
    assert (spt[0] == 0).all() and (spt[2] == 0).all()


def test_argument_errors():
    r2t, rpi, fv, sv, _ = make_tables(
        7, bs=2, page_size=16, ctx_pages=2, identity=False, swa=True, device="cpu"
    )
    seq_lens = torch.ones(2, dtype=torch.int32)
    out = garbage_outputs(2, 2, 2, "cpu")
    pt, spt = views(out, 2, 2)
    with pytest.raises(ValueError, match="together"):
        build_decode_metadata(
            r2t, rpi, seq_lens, 1, 16, fv, sv, out["cache"], out["cu_k"], pt, None
        )
    with pytest.raises(ValueError, match="int32"):
        build_decode_metadata(
            r2t, rpi, seq_lens, 1, 16, fv, None, out["cache"].long(), out["cu_k"], pt, None
        )
    with pytest.raises(ValueError, match="rows"):
        build_decode_metadata(
            r2t, rpi, seq_lens, 1, 16, fv, None, out["cache"], out["cu_k"], pt[:1], None
        )


def test_cpu_dispatch_defaults_to_reference(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    monkeypatch.setattr(md, "_launch_metadata", None)  # would fail if called
    run_decode("cpu", 8, bs=3, page_size=16, width=4, swa_width=4, identity=False)


# ---------------------------------------------------------------------------------------------
# extend / variable-length verify
# ---------------------------------------------------------------------------------------------


def run_extend(device, seed, *, bs, page_size, width, swa_width, identity, ctx_pages=6):
    r2t, rpi, fv, sv, g = make_tables(
        seed,
        bs=bs,
        page_size=page_size,
        ctx_pages=ctx_pages,
        identity=identity,
        swa=swa_width is not None,
        device=device,
    )
    hi = (max(width, ctx_pages) + 1) * page_size
    prefix = torch.randint(0, hi, (bs,), generator=g, dtype=torch.int32)
    extend = torch.randint(0, 2 * page_size + 3, (bs,), generator=g, dtype=torch.int32)
    extend[torch.rand(bs, generator=g) < 0.3] = 0  # zero-length extends
    prefix, extend = prefix.to(device), extend.to(device)
    out = garbage_outputs(bs + 2, width, swa_width, device)
    ref = clone_outputs(out)
    pt, spt = views(out, width, swa_width)
    build_extend_metadata(
        r2t, rpi, prefix, extend, page_size, fv, sv,
        out["cu_q"], out["cache"], out["cu_k"], pt, spt,
    )  # fmt: skip
    pt, spt = views(ref, width, swa_width)
    build_extend_metadata_reference(
        r2t, rpi, prefix, extend, page_size, fv, sv,
        ref["cu_q"], ref["cache"], ref["cu_k"], pt, spt,
    )  # fmt: skip
    assert_outputs_equal(out, ref)
    ext = extend.cpu().tolist()
    totals = [p + e for p, e in zip(prefix.cpu().tolist(), ext, strict=True)]
    check_naive(r2t, rpi, totals, page_size, fv, sv, out, width, swa_width, bs)
    run = [0]
    for e in ext:
        run.append(run[-1] + e)
    assert out["cu_q"][: bs + 1].cpu().tolist() == run
    assert (out["cu_q"][bs + 1 :] == GARBAGE).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("identity", [False, True], ids=["v2p", "identity"])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
def test_extend_matches_reference(device, page_size, identity, swa):
    seed = 1000 + page_size * 4 + 2 * identity + swa
    run_extend(
        device,
        seed,
        bs=6,
        page_size=page_size,
        width=7,
        swa_width=7 if swa else None,
        identity=identity,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_extend_prefix_sums_in_chunks(device, monkeypatch):
    monkeypatch.setattr(md, "_MAX_BLOCK_BS", 2)
    monkeypatch.setattr(md, "_MAX_BLOCK_COLS", 2)
    run_extend(device, 51, bs=7, page_size=16, width=5, swa_width=5, identity=False)
