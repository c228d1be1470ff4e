"""``unimem_kernel.lane_commit``: a step's per-lane writes in one launch, against its torch
reference and against the torch composition the engine ran before (``DeviceRequestState.write``
plus the output copies and the commit mask).

Every destination starts poisoned with random values, so that a missed or stray write shows;
comparisons are exact (integer work). Checked: verify steps with every accepted length
``0 .. W - 1`` across the lanes, padding lanes on row 0 (several of them, mixed with live
lanes), a strided ``tokens`` view, int32 and int64 rows and write slots, output buffers
larger than the step; decode steps (no ``accepted``, ``W = 1``); ``bs = 0``; bad inputs refused
by name. CPU runs the Triton interpreter; the ``gpu`` case runs the kernel on CUDA, also
inside a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.lane_commit import commit_lanes, commit_lanes_reference

ROWS = 40  # request-table rows


def step(bs, w, device, seed, *, verify=True, rows_dtype=torch.int32, slot_dtypes=(torch.int32,)):
    """Random inputs of a step of ``bs`` lanes (every third lane padding on row 0) and poisoned
    destinations, as a dict of keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    live = torch.randperm(ROWS - 1, generator=gen)[:bs] + 1
    rows = torch.where(torch.arange(bs) % 3 == 2, 0, live).to(rows_dtype)
    wide = torch.randint(0, 50_000, (bs, w + 3), generator=gen)
    args = {
        "rows": rows,
        "seq_lens": torch.randint(1, 4_000, (bs,), generator=gen, dtype=torch.int32),
        "next_tokens": torch.randint(0, 50_000, (bs,), generator=gen),
        "tokens": wide[:, 1 : w + 1],  # a strided view
        "state_seq_lens": torch.randint(-9, 9, (ROWS,), generator=gen, dtype=torch.int32),
        "state_next_tokens": torch.randint(-9, 9, (ROWS,), generator=gen),
        "out_tokens": torch.randint(-9, 9, (bs + 5, w + 2), generator=gen),
        "out_counts": torch.randint(-9, 9, (bs + 5,), generator=gen, dtype=torch.int32),
        "accepted": (torch.arange(bs) % w).to(torch.int32)[torch.randperm(bs, generator=gen)]
        if verify
        else None,
        "write_slots": tuple(
            torch.randint(1, 10_000, (bs * w,), generator=gen, dtype=dt) for dt in slot_dtypes
        ),
    }
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()} | {
        "write_slots": tuple(s.to(device) for s in args["write_slots"])
    }


def clone(args):
    return {
        k: (v.clone() if isinstance(v, torch.Tensor) else tuple(s.clone() for s in v))
        if v is not None
        else None
        for k, v in args.items()
    }


def former_engine_code(a):
    """What the engine ran before: ``DeviceRequestState.write``, the output copies and
    ``where(commit_mask)`` on the write slots."""
    bs, w = a["tokens"].shape
    acc = a["accepted"] if a["accepted"] is not None else torch.zeros_like(a["seq_lens"])
    idx, live = a["rows"].long(), a["rows"] > 0
    a["state_seq_lens"][idx] = torch.where(live, (a["seq_lens"] + acc + 1).to(torch.int32), 0)
    a["state_next_tokens"][idx] = torch.where(live, a["next_tokens"].long(), 0)
    a["out_tokens"][:bs, :w] = a["tokens"]
    a["out_counts"][:bs] = acc + 1
    cols = torch.arange(w, device=acc.device)
    keep = (cols[None, :] <= acc.long()[:, None]).reshape(-1)
    return [torch.where(keep, s, 0) for s in a["write_slots"]]


def assert_same_writes(got_args, got_kept, want_args, want_kept):
    for name in ("state_seq_lens", "state_next_tokens", "out_tokens", "out_counts"):
        g, w = got_args[name], want_args[name]
        assert g.dtype == w.dtype, name
        assert torch.equal(g.cpu(), w.cpu()), name
    assert len(got_kept) == len(want_kept)
    for g, w in zip(got_kept, want_kept, strict=True):
        assert g.dtype == w.dtype
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bs,w,rows_dtype,slot_dtypes",
    [
        (12, 8, torch.int32, (torch.int32, torch.int32)),
        (7, 5, torch.int64, (torch.int64,)),
        (16, 3, torch.int32, ()),
    ],
)
def test_verify_step_matches_reference_and_former_code(
    triton_backend, device, bs, w, rows_dtype, slot_dtypes
):
    a = step(bs, w, device, seed=bs, rows_dtype=rows_dtype, slot_dtypes=slot_dtypes)
    ref, old = clone(a), clone(a)
    got_kept = commit_lanes(**a)
    want_kept = commit_lanes_reference(**ref)
    assert_same_writes(a, got_kept, ref, want_kept)
    assert_same_writes(a, got_kept, old, former_engine_code(old))
    # the writes happened: live rows advanced, padding row 0 zero, rows nobody owns untouched
    rows = a["rows"].long().cpu()
    acc = a["accepted"].cpu()
    for b in range(bs):
        if rows[b] > 0:
            assert a["state_seq_lens"][rows[b]] == a["seq_lens"][b] + acc[b] + 1
    if (rows == 0).any():
        assert a["state_seq_lens"][0] == 0 and a["state_next_tokens"][0] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_commits_one_token(triton_backend, device):
    a = step(9, 1, device, seed=3, verify=False, slot_dtypes=())
    ref, old = clone(a), clone(a)
    kept = commit_lanes(**a)
    assert kept == []
    assert_same_writes(a, kept, ref, commit_lanes_reference(**ref))
    assert_same_writes(a, kept, old, former_engine_code(old))
    assert a["out_counts"][:9].tolist() == [1] * 9


@pytest.mark.parametrize("device", DEVICES)
def test_empty_step_writes_nothing(triton_backend, device):
    a = step(0, 4, device, seed=4)
    before = clone(a)
    kept = commit_lanes(**a)
    assert [k.shape for k in kept] == [(0,)]
    assert_same_writes(a, [], before, [])


@pytest.mark.gpu
def test_inside_a_cuda_graph():
    dev = torch.device("cuda")
    a = step(24, 8, dev, seed=5, slot_dtypes=(torch.int32, torch.int32))
    commit_lanes(**clone(a))  # compile outside the capture
    graph_args = clone(a)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kept = commit_lanes(**graph_args)
    ref = clone(a)
    want = commit_lanes_reference(**ref)
    g.replay()
    torch.cuda.synchronize()
    assert_same_writes(graph_args, kept, ref, want)


def test_bad_inputs_are_refused_by_name():
    a = step(4, 3, "cpu", seed=6)

    def refused(match, **change):
        with pytest.raises(ValueError, match=match):
            commit_lanes(**(clone(a) | change))

    refused("seq_lens must be a 1-D int32", seq_lens=a["seq_lens"].long())
    refused("next_tokens must be a 1-D int64 vector of 4", next_tokens=a["next_tokens"][:3])
    refused(r"tokens must be int64 \[bs = 4, W\]", tokens=a["tokens"].int())
    refused("at least one column", tokens=a["tokens"][:, :0])
    refused("out_tokens .* cannot hold", out_tokens=a["out_tokens"][:, :2])
    refused("out_counts holds 2 lanes", out_counts=a["out_counts"][:2])
    refused("accepted must be a 1-D int32", accepted=a["accepted"].long())
    refused("at most 2 write-slot vectors", write_slots=a["write_slots"] * 3)
    refused(r"write_slots\[0\] must be a 1-D", write_slots=(a["write_slots"][0][:5],))
    refused("state_next_tokens must be a 1-D int64 vector of 40",
            state_next_tokens=a["state_next_tokens"][:7])  # fmt: skip
    refused("out_counts must be contiguous", out_counts=torch.zeros(20, dtype=torch.int32)[::2])
