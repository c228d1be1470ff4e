"""gather_write_window: Triton kernel vs torch reference vs a naive per-element oracle written
from the contract, on fresh random inputs. Outputs start as garbage; entries past
``bs * width`` must keep it. On CPU the kernel runs through the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.write_window import gather_write_window, gather_write_window_reference

# Triton runs on CPU tensors only through the interpreter (set by the root conftest when there is
# no GPU); on a GPU machine the compiled kernel is tested through the ``cuda`` variants.
GARBAGE = 0x7FFF_FFF0


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")


def make_case(seed, *, bs, page_size, ctx_pages, identity, swa, device, r2t_col_stride=1):
    """Request table with poisoned entries (-1, past the end of v2p), a padding row 0 that
    padded lanes point at, a permuted ``full_v2p`` with unbound entries and a ``swa_v2p`` with
    about half its pages retired."""
    g = torch.Generator().manual_seed(seed)
    p = page_size
    rows = bs + 2
    ctx = ctx_pages * p
    n_virt = rows * ctx_pages + 6
    v2p_len = n_virt - 3
    base = torch.full((rows, ctx * r2t_col_stride + 2), -5, dtype=torch.int32)
    r2t = base[:, 1 : 1 + ctx * r2t_col_stride : r2t_col_stride]
    r2t[0] = 0
    vpages = 1 + torch.randperm(n_virt - 1, generator=g)
    for r in range(1, rows):
        vp = vpages[(r - 1) * ctx_pages : r * ctx_pages]
        r2t[r] = (vp[:, None] * p + torch.arange(p)[None, :]).reshape(-1).to(torch.int32)
    poison = torch.rand(r2t.shape, generator=g)
    r2t[poison < 0.05] = -1
    r2t[(poison >= 0.05) & (poison < 0.1)] = (v2p_len + 2) * p + 1
    r2t[0] = 0
    full_v2p = torch.zeros(v2p_len, dtype=torch.int32)
    full_v2p[1:] = 1 + torch.randperm(v2p_len - 1, generator=g).to(torch.int32)
    full_v2p[torch.rand(v2p_len, generator=g) < 0.1] = -1
    swa_v2p = torch.zeros(v2p_len, dtype=torch.int32)
    swa_v2p[1:] = 1 + torch.randperm(v2p_len - 1, generator=g).to(torch.int32)
    swa_v2p[torch.rand(v2p_len, generator=g) < 0.5] = -1
    rpi = (1 + torch.randperm(rows - 1, generator=g)[:bs]).to(torch.int32)
    if bs > 2:
        rpi[-1] = 0  # padded lane
    # positions inside, at the end of and past req_to_token, and one negative start
    seq_lens = torch.randint(0, ctx + 3, (bs,), generator=g, dtype=torch.int32)
    seq_lens[0] = -2
    dev = torch.device(device)
    return (
        base.to(dev)[:, 1 : 1 + ctx * r2t_col_stride : r2t_col_stride],
        rpi.to(dev),
        seq_lens.to(dev),
        None if identity else full_v2p.to(dev),
        swa_v2p.to(dev) if swa else None,
    )


def naive_slot(r2t, req, pos, page_size, v2p):
    rows = len(r2t)
    if not (0 <= req < rows) or not (0 <= pos < len(r2t[0])):
        return 0
    vtok = r2t[req][pos]
    if vtok < 0:
        return 0
    if v2p is None:
        return vtok
    vpage = vtok // page_size
    if vpage >= len(v2p) or v2p[vpage] < 0:
        return 0
    return v2p[vpage] * page_size + vtok % page_size


def run_case(device, seed, *, bs, width, page_size, identity, swa, dtype, **kw):
    r2t, rpi, seq_lens, fv, sv = make_case(
        seed, bs=bs, page_size=page_size, ctx_pages=3, identity=identity, swa=swa,
        device=device, **kw,
    )  # fmt: skip
    n = bs * width
    size = n + 3

    def outs():
        full = torch.full((size,), GARBAGE, dtype=dtype, device=device)
        swa_out = torch.full((size,), GARBAGE, dtype=dtype, device=device) if swa else None
        pos = torch.full((size,), GARBAGE, dtype=torch.int64, device=device)
        return full, swa_out, pos

    out, ref = outs(), outs()
    gather_write_window(r2t, rpi, seq_lens, width, page_size, fv, sv, *out)
    gather_write_window_reference(r2t, rpi, seq_lens, width, page_size, fv, sv, *ref)
    for a, b in zip(out, ref, strict=True):
        if a is not None:
            assert torch.equal(a.cpu(), b.cpu())

    r2t_l, rpi_l, sl = r2t.cpu().tolist(), rpi.cpu().tolist(), seq_lens.cpu().tolist()
    fv_l = None if fv is None else fv.cpu().tolist()
    sv_l = None if sv is None else sv.cpu().tolist()
    full, swa_out, pos = (None if t is None else t.cpu().tolist() for t in out)
    for b in range(bs):
        for j in range(width):
            i = b * width + j
            p = sl[b] + j
            assert pos[i] == p
            assert full[i] == naive_slot(r2t_l, rpi_l[b], p, page_size, fv_l), (b, j)
            if swa:
                assert swa_out[i] == naive_slot(r2t_l, rpi_l[b], p, page_size, sv_l), (b, j)
    for t in out:
        if t is not None:
            assert (t[n:] == GARBAGE).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("identity", [False, True], ids=["v2p", "identity"])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
def test_write_window_matches_reference(device, page_size, identity, swa):
    seed = page_size * 4 + 2 * identity + swa
    run_case(
        device, seed, bs=5, width=4, page_size=page_size, identity=identity, swa=swa,
        dtype=torch.int32,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 8])
def test_write_window_int64_slots_and_strided_table(device, width):
    run_case(
        device, 100 + width, bs=6, width=width, page_size=16, identity=False, swa=True,
        dtype=torch.int64, r2t_col_stride=2,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_write_window_several_programs(device, monkeypatch):
    import unimem_kernel.write_window as ww

    monkeypatch.setattr(ww, "_MAX_BLOCK", 4)
    run_case(device, 7, bs=5, width=3, page_size=16, identity=False, swa=True, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_write_window_rows_outside_table(device):
    r2t, _, _, fv, sv = make_case(
        3, bs=2, page_size=16, ctx_pages=2, identity=False, swa=True, device=device
    )
    rpi = torch.tensor([-1, r2t.shape[0]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([0, 3], dtype=torch.int32, device=device)
    full = torch.full((4,), GARBAGE, dtype=torch.int32, device=device)
    swa_out = full.clone()
    pos = torch.zeros(4, dtype=torch.int64, device=device)
    gather_write_window(r2t, rpi, seq_lens, 2, 16, fv, sv, full, swa_out, pos)
    assert (full == 0).all() and (swa_out == 0).all()
    assert pos.cpu().tolist() == [0, 1, 3, 4]


def test_write_window_argument_errors():
    r2t, rpi, seq_lens, fv, sv = make_case(
        4, bs=2, page_size=16, ctx_pages=2, identity=False, swa=True, device="cpu"
    )
    full = torch.zeros(4, dtype=torch.int32)
    pos = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="together"):
        gather_write_window(r2t, rpi, seq_lens, 2, 16, fv, sv, full, None, pos)
    with pytest.raises(ValueError, match="int64"):
        gather_write_window(r2t, rpi, seq_lens, 2, 16, fv, None, full, None, pos.int())
    with pytest.raises(ValueError, match="at least 4"):
        gather_write_window(r2t, rpi, seq_lens, 2, 16, fv, None, full[:3], None, pos)


# ------------------------------------------------------------------ packed (ragged) verify


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("identity", [False, True], ids=["v2p", "identity"])
@pytest.mark.parametrize("swa", [True, False], ids=["swa", "noswa"])
def test_ragged_write_window_matches_reference_and_contract(device, page_size, identity, swa):
    """Packed rows of uneven lengths (0 included) over a fixed row count: the Triton kernel
    equals the reference and a naive oracle; rows past the packed total write slot 0 and
    position 0; entries past the row count keep their garbage."""
    from unimem_kernel.write_window import (
        gather_ragged_write_window,
        gather_ragged_write_window_reference,
    )

    bs = 5
    r2t, rpi, seq_lens, fv, sv = make_case(
        page_size + 2 * identity + swa, bs=bs, page_size=page_size, ctx_pages=3,
        identity=identity, swa=swa, device=device,
    )  # fmt: skip
    lens = [3, 0, 1, 4, 2]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = sum(lens) + 4  # four padding rows
    size = rows + 3

    def outs():
        full = torch.full((size,), GARBAGE, dtype=torch.int32, device=device)
        swa_out = torch.full((size,), GARBAGE, dtype=torch.int32, device=device) if swa else None
        pos = torch.full((size,), GARBAGE, dtype=torch.int64, device=device)
        return full, swa_out, pos

    out, ref = outs(), outs()
    views = lambda o: [None if t is None else t[:rows] for t in o]  # noqa: E731
    cu_d = cu.to(device)
    gather_ragged_write_window(r2t, rpi, seq_lens, cu_d, page_size, fv, sv, *views(out))
    gather_ragged_write_window_reference(r2t, rpi, seq_lens, cu_d, page_size, fv, sv, *views(ref))
    for a, b in zip(out, ref, strict=True):
        if a is not None:
            assert torch.equal(a.cpu(), b.cpu())
    r2t_l, rpi_l, sl = r2t.cpu().tolist(), rpi.cpu().tolist(), seq_lens.cpu().tolist()
    fv_l = None if fv is None else fv.cpu().tolist()
    sv_l = None if sv is None else sv.cpu().tolist()
    full, swa_out, pos = (None if t is None else t.cpu().tolist() for t in out)
    i = 0
    for b, n in enumerate(lens):
        for j in range(n):
            p = sl[b] + j
            assert pos[i] == p
            assert full[i] == naive_slot(r2t_l, rpi_l[b], p, page_size, fv_l), (b, j)
            if swa:
                assert swa_out[i] == naive_slot(r2t_l, rpi_l[b], p, page_size, sv_l), (b, j)
            i += 1
    for k in range(i, rows):  # padding rows: the sink, position 0
        assert full[k] == 0 and pos[k] == 0 and (not swa or swa_out[k] == 0)
    for t in out:
        if t is not None:
            assert (t[rows:] == GARBAGE).all()
