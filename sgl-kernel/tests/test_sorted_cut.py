"""sorted_cut: the sampler's top-k / top-p / min-p cut-off in one launch gives its torch
reference's value on rows that reach every filter (top-k off, inside and past the row, top-p
off and on, min-p, a tail of -inf, one value, rows longer than a block)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.sorted_cut import sorted_cut, sorted_cut_reference, sorted_cut_triton


def _case(n, width, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    desc = (torch.randn(n, width, generator=g) * 3).sort(dim=-1, descending=True)[0]
    if width > 4:
        desc[1, width // 2 :] = -math.inf  # masked tokens sort last
    top_k = torch.randint(-1, min(width, 300) + 2, (n,), generator=g, dtype=torch.int32)
    top_k[0] = width + 5  # past the row: every rank
    top_p = torch.rand(n, generator=g).clamp(min=0.2)
    top_p[2 % n] = 1.0  # off
    min_p = torch.rand(n, generator=g) * 0.1
    min_p[3 % n] = 0.0
    return tuple(t.to(device) for t in (desc, top_k, top_p, min_p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, width", [(6, 1), (7, 256), (5, 3000), (8, 2048)])
def test_kernel_gives_the_references_cut_off(device, n, width):
    args = _case(n, width, device, seed=width)
    want = sorted_cut_reference(*args)
    got = sorted_cut_triton(*args)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    desc = args[0]
    assert bool(((got[:, None] == desc).any(dim=-1)).all())  # a value of its row


def test_filters_keep_what_they_should():
    desc = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    lp = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))[None]  # weights as log-probs
    one = torch.ones(1)
    zero = torch.zeros(1)
    k = torch.tensor([2], dtype=torch.int32)
    off = torch.tensor([0], dtype=torch.int32)
    assert sorted_cut(desc, k, one, zero).item() == 2.0  # top-k 2
    assert sorted_cut(desc, off, one, zero).item() == -1.0  # nothing cut
    # top-p 0.8: 0.5 + 0.25 < 0.8, so the third rank is the last one needed
    assert sorted_cut(lp, off, torch.tensor([0.8]), zero).item() == lp[0, 2].item()
    # min-p 0.4: weights 0.5 and 0.25 reach 0.4 x 0.5, 0.15 does not
    assert sorted_cut(lp, off, one, torch.tensor([0.4])).item() == lp[0, 1].item()


def test_bad_arguments_are_refused():
    desc, k, p, m = _case(3, 10, "cpu")
    with pytest.raises(ValueError, match="desc must be"):
        sorted_cut(desc[0], k, p, m)
    with pytest.raises(ValueError, match="top_p must be"):
        sorted_cut(desc, k, p[:2], m)
    with pytest.raises(ValueError, match="top_k must be an integer"):
        sorted_cut(desc, k.float(), p, m)
