"""``unimem_kernel.draft_pick``: the drafter's fused left-to-right pick against its torch
reference (``DsparkDrafter.pick``'s loop) and against the one-lane-per-program kernel it
replaced (kept here, as ``_previous_markov_pick``, for that comparison only).

Checked: the picked tokens on fresh random logits (several vocabulary sizes, so the sweep
walks one or several blocks and a ragged last block), with and without the acceptance
control's replacements (which must condition the next column), ties resolved to the first
index as ``torch.argmax`` does, a row's picks independent of the other rows, and bad shapes
refused by name; ``u`` with rows past the candidates; lane groups with a ragged last group
(``bs`` not a multiple of ``LANES``),
several blocks per chunk and chunks past the vocabulary's end (``BLOCK_V`` and ``NSPLIT``
lowered); the same picks as the previous kernel, bit for bit, ties and near-ties included.
The bias is an fp32 dot over ``R`` in another order than torch's matmul, so the tests
against the reference draw logits whose top two differ by far more than a bias ulp (random
normals have no near-ties at these sizes). CPU runs through the Triton interpreter with
``UNIMEM_KERNEL_BACKEND=triton``; the ``gpu`` cases use the ``small`` preset's sizes (48
lanes, 7 columns, V 32 000, R 16, bf16 ``U`` and ``W``).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_devices import DEVICES

import unimem_kernel.draft_pick as dp
from unimem_kernel._dispatch import next_pow2
from unimem_kernel.draft_pick import markov_pick, markov_pick_reference
from unimem_kernel.fused import _round

# ------------------------------------------------------------------- the previous kernel
# One program per (lane, vocabulary chunk), BLOCK_V 1024, NSPLIT 16: the kernel this module
# had before lane groups, verbatim but for names, for the bit-for-bit comparison.


@triton.jit
def _prev_column_argmax(base_row, u, w_ptr, w_sv, offs_r, rmask, lo, hi, BLOCK_V: tl.constexpr):
    bias_ty = w_ptr.dtype.element_ty
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = lo.to(tl.int64)
    for v0 in range(lo, hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vmask = offs < hi
        w = tl.load(
            w_ptr + offs.to(tl.int64)[:, None] * w_sv + offs_r[None, :],
            mask=vmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(tl.float32)
        bias = _round(tl.sum(w * u[None, :], axis=1), bias_ty).to(tl.float32)
        logit = tl.load(base_row + offs, mask=vmask, other=float("-inf")) + bias
        logit = tl.where(vmask, logit, float("-inf"))
        blk_max = tl.max(logit, axis=0)
        blk_idx = tl.min(tl.where(logit == blk_max, offs, hi), axis=0).to(tl.int64)
        better = blk_max > best_val
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
    return best_val, best_idx


@triton.jit
def _prev_column_token(part_val, part_idx, ref_ptr, take_ptr, b, col, ref_sb, take_sb,
                       NSPLIT: tl.constexpr, HAS_CONTROL: tl.constexpr):  # fmt: skip
    offs_s = tl.arange(0, NSPLIT)
    vals = tl.load(part_val + offs_s)
    idxs = tl.load(part_idx + offs_s)
    top = tl.max(vals, axis=0)
    tok = tl.min(tl.where(vals == top, idxs, 0x7FFFFFFFFFFFFFFF), axis=0)
    if HAS_CONTROL:
        take = tl.load(take_ptr + b * take_sb + col).to(tl.int1)
        ref = tl.load(ref_ptr + b * ref_sb + col).to(tl.int64)
        tok = tl.where(take, ref, tok)
    return tok


@triton.jit(do_not_specialize=["V", "col", "chunk"])
def _prev_markov_pick_kernel(base_ptr, anchors_ptr, u_ptr, w_ptr, ref_ptr, take_ptr,
                             part_val_ptr, part_idx_ptr, out_ptr, V, col, chunk, base_sb,
                             base_sg, u_sv, w_sv, ref_sb, take_sb, out_sb, G: tl.constexpr,
                             R: tl.constexpr, BR: tl.constexpr, NSPLIT: tl.constexpr,
                             BLOCK_V: tl.constexpr, HAS_CONTROL: tl.constexpr,
                             FIRST: tl.constexpr, FINAL: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    parts = b * (G * NSPLIT)
    if FIRST:
        prev = tl.load(anchors_ptr + b).to(tl.int64)
    else:
        at = parts + (col - 1) * NSPLIT
        prev = _prev_column_token(part_val_ptr + at, part_idx_ptr + at, ref_ptr, take_ptr, b,
                                  col - 1, ref_sb, take_sb, NSPLIT, HAS_CONTROL)  # fmt: skip
        tl.store(out_ptr + b * out_sb + (col - 1), prev, mask=s == 0)
    if not FINAL:
        offs_r = tl.arange(0, BR)
        rmask = offs_r < R
        u = tl.load(u_ptr + prev * u_sv + offs_r, mask=rmask, other=0.0).to(tl.float32)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, V)
        val, idx = _prev_column_argmax(base_ptr + b * base_sb + col * base_sg, u, w_ptr, w_sv,
                                       offs_r, rmask, lo, hi, BLOCK_V)  # fmt: skip
        at = parts + col * NSPLIT + s
        tl.store(part_val_ptr + at, val)
        tl.store(part_idx_ptr + at, idx)


def _previous_markov_pick(base, anchors, u, w, ref=None, take=None):
    """The previous ``markov_pick``'s Triton path (inputs as its contract; no checks)."""
    bs, g, v = base.shape
    out = torch.empty(bs, g, dtype=torch.int64, device=base.device)
    u, w = u.contiguous(), w.contiguous()
    has_control = ref is not None
    block_v = min(1024, next_pow2(v))
    nsplit = min(16, next_pow2(triton.cdiv(v, block_v)))
    chunk = triton.cdiv(triton.cdiv(v, nsplit), block_v) * block_v
    part_val = torch.empty(bs, g, nsplit, dtype=torch.float32, device=base.device)
    part_idx = torch.empty(bs, g, nsplit, dtype=torch.int64, device=base.device)
    ctl = (ref, take) if has_control else (anchors, anchors)
    for col in range(g + 1):
        _prev_markov_pick_kernel[(bs, 1 if col == g else nsplit)](
            base, anchors, u, w, *ctl, part_val, part_idx, out, v, col, chunk,
            base.stride(0), base.stride(1), u.stride(0), w.stride(0),
            ref.stride(0) if has_control else 0, take.stride(0) if has_control else 0,
            out.stride(0), G=g, R=u.shape[1], BR=next_pow2(u.shape[1]), NSPLIT=nsplit,
            BLOCK_V=block_v, HAS_CONTROL=has_control, FIRST=col == 0, FINAL=col == g,
            num_warps=4,
        )  # fmt: skip
    return out


# ------------------------------------------------------------------- tests


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


@pytest.mark.parametrize("device", DEVICES)
def test_markov_pick_u_with_rows_past_the_candidates(triton_backend, device):
    """``u`` may have rows past ``V`` (a reduced draft vocabulary's out-of-vocabulary row):
    an anchor or a taken reference there conditions the next column through that row."""
    base, anchors, u, w = inputs(3, 4, 100, 8, torch.float32, device, seed=7)
    gen = torch.Generator().manual_seed(8)
    u = torch.cat([u, torch.randn(1, 8, generator=gen).to(device) * 4])  # row 100
    anchors = torch.tensor([100, 5, 100], device=device)
    ref = torch.full((3, 4), 100, dtype=torch.int64, device=device)
    take = torch.zeros(3, 4, dtype=torch.bool, device=device)
    take[1, 1] = True
    got = markov_pick(base, anchors, u, w, ref, take)
    assert torch.equal(got, markov_pick_reference(base, anchors, u, w, ref, take))
    assert int(got[1, 1]) == 100


def test_markov_pick_refuses_bad_shapes():
    base, anchors, u, w = inputs(2, 3, 50, 4, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="base"):
        markov_pick(base[0], anchors, u, w)
    with pytest.raises(ValueError, match="anchors"):
        markov_pick(base, anchors[:1], u, w)
    with pytest.raises(ValueError, match="u must be"):
        markov_pick(base, anchors, u, w[:, :2])
    with pytest.raises(ValueError, match="u must be"):
        markov_pick(base, anchors, u[:-1], w[:-1])
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


def control(bs, g, v, device, seed):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randint(0, v, (bs, g), generator=gen).to(device)
    take = (torch.rand(bs, g, generator=gen) < 0.3).to(device)
    return ref, take


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "block_v, nsplit, dtype, with_control",
    [
        # V 3000: 4 chunks of 768 = 3 blocks of 256, the last chunk's last block ragged
        pytest.param(256, 4, torch.float32, False, marks=pytest.mark.slow),
        pytest.param(256, 4, torch.bfloat16, True, marks=pytest.mark.slow),
        # 16 chunks of one block of 256: 12 in the vocabulary (the 12th ragged), 4 past its end
        (256, 16, torch.float32, True),
    ],
)
def test_markov_pick_lane_groups_ragged(triton_backend, monkeypatch, device, block_v, nsplit,
                                        dtype, with_control):  # fmt: skip
    """bs 11 in groups of 8 (the last group has 3 live lanes, 5 dead) and of 4 (3 groups, 1
    dead lane): the picks equal the reference's, exact ties included (the first index wins
    across blocks and chunks), and a lane's picks do not depend on its group's other
    lanes."""
    monkeypatch.setattr(dp, "_BLOCK_V", block_v)
    monkeypatch.setattr(dp, "_NSPLIT", nsplit)
    bs, g, v, r = 11, 3, 3000, 16
    base, anchors, u, w = inputs(bs, g, v, r, dtype, device, seed=31 + nsplit)
    ctl = control(bs, g, v, device, seed=32) if with_control else (None, None)
    want = markov_pick_reference(base, anchors, u, w, *ctl)
    # integer logits and no bias: every maximum occurs many times, in several blocks
    tied = torch.randint(0, 3, base.shape, generator=torch.Generator().manual_seed(33))
    tied, zero = tied.float().to(device), torch.zeros_like(w)
    want_tied = markov_pick_reference(tied, anchors, u, zero, *ctl)
    for lanes in (8, 4):
        monkeypatch.setattr(dp, "_LANES", lanes)
        got = markov_pick(base, anchors, u, w, *ctl)
        assert got.dtype == torch.int64 and got.shape == (bs, g)
        assert torch.equal(got, want), lanes
        assert torch.equal(markov_pick(tied, anchors, u, zero, *ctl), want_tied), lanes
    # the last lane alone: a group of one
    last = [t[-1:] if t is not None else None for t in ctl]
    assert torch.equal(markov_pick(base[-1:], anchors[-1:], u, w, *last), want[-1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow  # the kernel it replaced; the fast tier compares with the reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_markov_pick_equals_previous_kernel(triton_backend, device, dtype):
    """Bit for bit the previous one-lane-per-program kernel's picks: random logits, with the
    control, exact ties (within a block, across blocks and chunks) and near-ties (logits
    that the bias alone separates, by about one bias ulp)."""
    bs, g, v, r = 11, 3, 3000, 16
    base, anchors, u, w = inputs(bs, g, v, r, dtype, device, seed=41)
    ref, take = control(bs, g, v, device, seed=42)
    assert torch.equal(markov_pick(base, anchors, u, w), _previous_markov_pick(base, anchors, u, w))
    assert torch.equal(
        markov_pick(base, anchors, u, w, ref, take),
        _previous_markov_pick(base, anchors, u, w, ref, take),
    )
    # exact ties: integer logits and no bias (the first index wins everywhere)
    tied = torch.randint(0, 3, base.shape, generator=torch.Generator().manual_seed(43))
    tied = tied.float().to(device)
    zero = torch.zeros_like(w)
    got = markov_pick(tied, anchors, u, zero)
    assert torch.equal(got, _previous_markov_pick(tied, anchors, u, zero))
    assert torch.equal(got, markov_pick_reference(tied, anchors, u, zero))
    # near-ties: base cancels column 0's bias up to a tiny noise, so the picks follow the
    # bias's last bits
    bias0 = (u[anchors.long()].float() @ w.float().T).to(dtype).float()
    noise = torch.randn(bs, v, generator=torch.Generator().manual_seed(44)).to(device)
    near = base.clone()
    near[:, 0] = -bias0 + 1e-6 * noise
    assert torch.equal(markov_pick(near, anchors, u, w), _previous_markov_pick(near, anchors, u, w))


@pytest.mark.gpu
def test_markov_pick_gpu_equals_previous_kernel_at_small_preset_sizes():
    """At the real size (6 groups of 8 lanes x 64 chunks of one block of 512), the picks are
    the previous kernel's bit for bit: random logits, with the control, and near-ties that
    the bias's last bit decides (base cancels cuBLAS's bias of column 0 up to a tiny noise, so
    any entry where a kernel's bias differs by an ulp becomes its pick)."""
    bs, g, v, r = 48, 7, 32000, 16
    for seed in range(3):
        base, anchors, u, w = inputs(bs, g, v, r, torch.bfloat16, "cuda", seed=50 + seed)
        ref, take = control(bs, g, v, "cuda", seed=60 + seed)
        assert torch.equal(
            markov_pick(base, anchors, u, w), _previous_markov_pick(base, anchors, u, w)
        )
        assert torch.equal(
            markov_pick(base, anchors, u, w, ref, take),
            _previous_markov_pick(base, anchors, u, w, ref, take),
        )
        near = base.clone()
        noise = torch.randn(bs, v, generator=torch.Generator().manual_seed(70 + seed))
        near[:, 0] = -(u[anchors] @ w.T).float() + 1e-6 * noise.cuda()
        assert torch.equal(
            markov_pick(near, anchors, u, w), _previous_markov_pick(near, anchors, u, w)
        )
