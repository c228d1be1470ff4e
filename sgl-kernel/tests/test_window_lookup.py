"""``unimem_kernel.window_lookup``: per-lane windows of one or two tables in one launch, against
its torch reference, exactly.

Checked: int64 and bool tables together (the acceptance control's pair), int32 and uint8;
windows inside the table, crossing its last column, starting before column 0 (negative
offsets), rows out of range on both sides (they read the fallback cell ``[0, C - 1]``); int32
and int64 rows and starts; ``width`` 1 and not a power of two; ``bs = 0`` and ``width = 0``;
bad inputs refused by name. CPU runs the Triton interpreter; ``gpu`` runs CUDA, also inside a
captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.window_lookup import window_lookup, window_lookup_reference


def tables(r, c, dtypes, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for dt in dtypes:
        if dt == torch.bool:
            out.append(torch.rand(r, c, generator=gen) < 0.5)
        else:
            out.append(torch.randint(0, 120, (r, c), generator=gen).to(dt))
    return out


def lanes(bs, r, c, seed, dtype=torch.int64):
    """Rows in ``[-2, r + 2)`` and starts in ``[-4, c + 2)``: in range and out of it."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2, r + 2, (bs,), generator=gen).to(dtype)
    starts = torch.randint(-4, c + 2, (bs,), generator=gen).to(dtype)
    return rows, starts


def check(ts, rows, starts, width, offset, device):
    ts = [t.to(device) for t in ts]
    rows, starts = rows.to(device), starts.to(device)
    got = window_lookup(ts, rows, starts, width, offset)
    want = window_lookup_reference(ts, rows, starts, width, offset)
    assert len(got) == len(want) == len(ts)
    for g, w, t in zip(got, want, ts, strict=True):
        assert g.dtype == t.dtype and g.shape == (rows.shape[0], width)
        assert torch.equal(g.cpu(), w.cpu())
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtypes,width,offset,idx_dtype",
    [
        ((torch.int64, torch.bool), 7, 1, torch.int64),
        ((torch.int32,), 5, -3, torch.int32),
        ((torch.uint8, torch.int64), 1, 0, torch.int32),
    ],
)
def test_matches_reference(triton_backend, device, dtypes, width, offset, idx_dtype):
    ts = tables(6, 11, dtypes, seed=width)
    rows, starts = lanes(40, 6, 11, seed=offset + 9, dtype=idx_dtype)
    check(ts, rows, starts, width, offset, device)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_cells_read_the_fallback(triton_backend, device):
    (t,) = tables(3, 5, (torch.int64,), seed=1)
    t[0, 4] = -1  # the fallback cell
    rows = torch.tensor([1, -1, 3, 2])
    starts = torch.tensor([3, 0, 0, -2])
    (got,) = check([t], rows, starts, 4, 0, device)
    got = got.cpu()
    assert got[0].tolist() == [t[1, 3].item(), t[1, 4].item(), -1, -1]  # past the last column
    assert got[1].tolist() == [-1] * 4 and got[2].tolist() == [-1] * 4  # rows out of range
    assert got[3].tolist() == [-1, -1, t[2, 0].item(), t[2, 1].item()]  # before column 0


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lookups(triton_backend, device):
    ts = tables(2, 3, (torch.int64, torch.bool), seed=2)
    rows, starts = lanes(0, 2, 3, seed=3)
    check(ts, rows, starts, 4, 0, device)
    rows, starts = lanes(5, 2, 3, seed=3)
    check(ts, rows, starts, 0, 0, device)


@pytest.mark.gpu
def test_inside_a_cuda_graph():
    dev = torch.device("cuda")
    ts = [t.to(dev) for t in tables(48, 600, (torch.int64, torch.bool), seed=4)]
    rows, starts = (x.to(dev) for x in lanes(48, 48, 600, seed=5))
    window_lookup(ts, rows, starts, 7, 1)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = window_lookup(ts, rows, starts, 7, 1)
    new_rows, new_starts = (x.to(dev) for x in lanes(48, 48, 600, seed=6))
    rows.copy_(new_rows)
    starts.copy_(new_starts)
    g.replay()
    torch.cuda.synchronize()
    for g_, w in zip(got, window_lookup_reference(ts, rows, starts, 7, 1), strict=True):
        assert torch.equal(g_, w)


def test_bad_inputs_are_refused_by_name():
    ts = tables(3, 4, (torch.int64, torch.bool), seed=7)
    rows, starts = lanes(5, 3, 4, seed=8)
    with pytest.raises(ValueError, match="takes 1 to 2 tables"):
        window_lookup(ts * 2, rows, starts, 2)
    with pytest.raises(ValueError, match=r"tables\[0\] must be a 2-D int32/int64/uint8/bool"):
        window_lookup([ts[0].float()], rows, starts, 2)
    with pytest.raises(ValueError, match=r"tables\[1\] has shape"):
        window_lookup([ts[0], ts[1][:, :2].contiguous()], rows, starts, 2)
    with pytest.raises(ValueError, match=r"tables\[0\] must be contiguous"):
        window_lookup([ts[0].t()], rows, starts, 2)
    with pytest.raises(ValueError, match="rows must be a 1-D int32/int64"):
        window_lookup(ts, rows.float(), starts, 2)
    with pytest.raises(ValueError, match="starts .* and rows .* differ"):
        window_lookup(ts, rows, starts[:3], 2)
    with pytest.raises(ValueError, match="width must be a non-negative int"):
        window_lookup(ts, rows, starts, -1)
