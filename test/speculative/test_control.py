"""Acceptance control: seeded, per (seed, rid, position), independent of the batch."""

from __future__ import annotations

import pytest
import torch

from unimem.speculative.control import AcceptanceControl, uniform_draws

REFS = {0: list(range(100, 140)), 1: list(range(200, 230)), 3: list(range(300, 350))}


def test_draws_are_a_pure_function_of_seed_rid_position():
    rids = torch.tensor([0, 1, 3, 0])
    pos = torch.tensor([5, 5, 5, 6])
    a = uniform_draws(7, rids, pos)
    assert torch.equal(a, uniform_draws(7, rids, pos))
    # one at a time, in another order: the same draws
    for i in (3, 1, 0, 2):
        assert uniform_draws(7, rids[i : i + 1], pos[i : i + 1]).item() == a[i].item()
    assert not torch.equal(a, uniform_draws(8, rids, pos))
    assert ((a >= 0) & (a < 1)).all()
    # neighbouring rids and positions decorrelate
    assert len(set(a.tolist())) == 4


def test_draws_are_uniform():
    rids = torch.arange(50).repeat_interleave(400)
    pos = torch.arange(400).repeat(50)
    u = uniform_draws(0, rids, pos)
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max().item() < 0.01


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8, 1.0])
def test_replacement_rate_and_reference_tokens(rate):
    control = AcceptanceControl(rate, seed=3, references=REFS)
    rids = torch.tensor([0, 1, 3]).repeat_interleave(30)
    pos = torch.arange(30).repeat(3)
    drafted = torch.full_like(pos, -7)
    out = control.apply(drafted, rids, pos)
    replaced = out != -7
    ref = control.reference(rids, pos)
    assert torch.equal(out[replaced], ref[replaced])
    frac = replaced.double().mean().item()
    if rate in (0.0, 1.0):
        assert frac == rate
    else:
        assert abs(frac - rate) < 0.15


def test_unknown_positions_and_rids_keep_the_drafted_token():
    control = AcceptanceControl(1.0, seed=0, references=REFS)
    rids = torch.tensor([1, 1, 2, 9, 0, -1])
    pos = torch.tensor([29, 30, 0, 0, 10_000, 0])
    out = control.apply(torch.full((6,), 5), rids, pos)
    assert out.tolist() == [229, 5, 5, 5, 5, 5]


def test_batch_composition_does_not_change_decisions():
    control = AcceptanceControl(0.5, seed=11, references=REFS)
    g = torch.Generator().manual_seed(0)
    rids = torch.tensor([0, 1, 3, 3, 0, 1])
    pos = torch.randint(0, 30, (6,), generator=g)
    drafted = torch.randint(0, 50, (6,), generator=g)
    whole = control.apply(drafted, rids, pos)
    perm = torch.randperm(6, generator=g)
    assert torch.equal(control.apply(drafted[perm], rids[perm], pos[perm]), whole[perm])
    for i in range(6):
        one = control.apply(drafted[i : i + 1], rids[i : i + 1], pos[i : i + 1])
        assert one.item() == whole[i].item()


def test_bad_rate():
    with pytest.raises(ValueError, match="rate"):
        AcceptanceControl(1.5, 0, REFS)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_decide_window_equals_decide_over_the_window(dtype):
    """A step's decisions for ``gamma`` columns (``decide_window``, one launch on CUDA) are
    ``decide`` at ``seq_len + 1 + i``: padding lanes (rid -1), rids without a reference and
    positions past the reference's end included."""
    control = AcceptanceControl(0.8, seed=5, references=REFS)
    rids = torch.tensor([0, 1, 3, -1, 2, 7, 0], dtype=dtype)
    seq_lens = torch.tensor([0, 25, 12, 4, 3, 1, 38], dtype=dtype)
    ref, take = control.decide_window(rids, seq_lens, 7, offset=1)
    want_ref, want_take = control.decide(
        rids[:, None], seq_lens.long()[:, None] + 1 + torch.arange(7)
    )
    assert ref.dtype == torch.int64 and take.dtype == torch.bool
    assert torch.equal(ref, want_ref) and torch.equal(take, want_take)
    assert (ref[3] == -1).all() and not take[3].any()  # padding lane: unknown, never taken
    assert ref[0].tolist() == list(range(101, 108))
