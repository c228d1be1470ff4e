"""``unimem_kernel.draft_pick``: the drafter's fused left-to-right pick against its torch
reference (``DsparkDrafter.pick``'s loop).

Checked: the picked tokens on fresh random logits (several vocabulary sizes, so the sweep
walks one or several blocks and a ragged last block), with and without the acceptance
control's replacements (which must condition the next column), ties resolved to the first
index as ``torch.argmax`` does, a row's picks independent of the other rows, and bad shapes
refused by name. The bias is an fp32 dot over ``R`` in another order than torch's matmul, so
the tests draw logits whose top two differ by far more than a bias ulp (random normals have
no near-ties at these sizes). CPU runs through the Triton interpreter with
``UNIMEM_KERNEL_BACKEND=triton``; the ``gpu`` case uses the ``small`` preset's sizes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.draft_pick import markov_pick, markov_pick_reference


def inputs(bs, g, v, r, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(bs, g, v, generator=gen) * 3
    u = torch.randn(v, r, generator=gen).to(dtype)
    w = (torch.randn(v, r, generator=gen) / r**0.5).to(dtype)
    anchors = torch.randint(0, v, (bs,), generator=gen)
    return [t.to(device) for t in (base, anchors, u, w)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bs, g, v, r, dtype",
    [
        (3, 4, 100, 16, torch.float32),  # one ragged block
        (2, 3, 2500, 8, torch.float32),  # several blocks, ragged last
        (4, 5, 1300, 16, torch.bfloat16),  # bf16 bias, rounded as the matmul's output
        (1, 2, 64, 5, torch.float32),  # rank not a power of two
    ],
)
def test_markov_pick_matches_reference(triton_backend, device, bs, g, v, r, dtype):
    base, anchors, u, w = inputs(bs, g, v, r, dtype, device, seed=bs * 100 + v)
    got = markov_pick(base, anchors, u, w)
    ref = markov_pick_reference(base, anchors, u, w)
    assert got.dtype == torch.int64 and got.shape == (bs, g)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_markov_pick_with_control_conditions_the_next_column(triton_backend, device):
    bs, g, v, r = 4, 6, 700, 8
    base, anchors, u, w = inputs(bs, g, v, r, torch.float32, device, seed=11)
    gen = torch.Generator().manual_seed(12)
    ref = torch.randint(0, v, (bs, g), generator=gen).to(device)
    take = (torch.rand(bs, g, generator=gen) < 0.5).to(device)
    take[0] = True
    take[1] = False
    got = markov_pick(base, anchors, u, w, ref, take)
    assert torch.equal(got, markov_pick_reference(base, anchors, u, w, ref, take))
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], markov_pick(base, anchors, u, w)[1])
    # a replacement changes what the next column is conditioned on
    free = markov_pick(base, anchors, u, w)
    assert not torch.equal(got[2:], free[2:]) or not take[2:].any()


@pytest.mark.parametrize("device", DEVICES)
def test_markov_pick_ties_and_row_independence(triton_backend, device):
    bs, g, v, r = 5, 2, 1500, 4
    base, anchors, u, w = inputs(bs, g, v, r, torch.float32, device, seed=21)
    w = torch.zeros_like(w)  # no bias: the pick is argmax(base) per column
    base[0, 0, 1200] = base[0, 0, 7] = base[0, 0, 1030] = 100.0  # ties across blocks
    base[1, 1, 3] = base[1, 1, 4] = 100.0  # ties within a block
    got = markov_pick(base, anchors, u, w)
    assert got[0, 0] == 7 and got[1, 1] == 3
    assert torch.equal(got, markov_pick_reference(base, anchors, u, w))
    for b in range(bs):
        alone = markov_pick(base[b : b + 1], anchors[b : b + 1], u, w)
        assert torch.equal(alone[0], got[b])


def test_markov_pick_refuses_bad_shapes():
    base, anchors, u, w = inputs(2, 3, 50, 4, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="base"):
        markov_pick(base[0], anchors, u, w)
    with pytest.raises(ValueError, match="anchors"):
        markov_pick(base, anchors[:1], u, w)
    with pytest.raises(ValueError, match="u and w"):
        markov_pick(base, anchors, u, w[:, :2])
    with pytest.raises(ValueError, match="together"):
        markov_pick(base, anchors, u, w, ref=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="ref and take"):
        markov_pick(base, anchors, u, w, torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool))


@pytest.mark.gpu
def test_markov_pick_gpu_small_preset_sizes():
    base, anchors, u, w = inputs(48, 7, 32000, 16, torch.bfloat16, "cuda", seed=5)
    got = markov_pick(base, anchors, u, w)
    ref = markov_pick_reference(base, anchors, u, w)
    # the kernel's fp32 bias may round to another bf16 value than cuBLAS's matmul output
    # in rare cases, which can flip a near-tie (and then condition the row's later columns
    # differently): allow at most two of the 48 rows to differ
    bad = (got != ref).any(dim=1).nonzero().flatten().tolist()
    assert len(bad) <= 2, bad
