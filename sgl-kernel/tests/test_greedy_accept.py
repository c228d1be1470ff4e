"""``unimem_kernel.greedy_accept``: the fused argmax + greedy acceptance of a verify step against
its torch reference and against the serving code's ``torch.argmax`` + ``greedy_accept``.

Checked, bit for bit and dtype for dtype (``tokens`` int64, ``accepted`` int32, ``bonus``
int64): fresh random logits with planted draft matches so that ``accepted`` takes every value
``0..gamma`` across the lanes; integer-valued logits full of exact ties, and ties planted
within a block, across blocks, across chunks and at a chunk boundary (the first index wins,
as in ``torch.argmax``); vocabularies that are not a multiple of ``BLOCK_V`` (and chunks past
the vocabulary's end); a strided slice of a wider tensor; ``gamma = 0``; ``bs = 0``; drafts
of several integer dtypes and strides; bad inputs refused by name. CPU runs through the
Triton interpreter with ``UNIMEM_KERNEL_BACKEND=triton`` and, where marked, a ``BLOCK_V`` of
32 so that a tiny vocabulary spans several blocks and chunks; the ``gpu`` case runs the real
size (48 lanes, gamma 7, V 32 000) and inside a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

import unimem_kernel.greedy_accept as ga
from unimem.speculative.accept import greedy_accept
from unimem_kernel.greedy_accept import greedy_verify_accept, greedy_verify_accept_reference

SMALL_BLOCK = 32  # V = 300 -> 10 blocks, NSPLIT = 8 chunks of 64 (two blocks each), 3 empty


@pytest.fixture
def small_block(monkeypatch):
    monkeypatch.setattr(ga, "_BLOCK_V", SMALL_BLOCK)


def planted(bs, gamma, v, device, seed, ties=False):
    """Logits ``[bs * (gamma + 1), v]`` and drafts whose lane ``b`` matches the target's
    argmax on exactly its first ``b % (gamma + 1)`` drafts (``v >= 2``)."""
    gen = torch.Generator().manual_seed(seed)
    rows = bs * (gamma + 1)
    if ties:  # a handful of distinct values: every row's maximum occurs many times
        logits = torch.randint(0, 4, (rows, v), generator=gen).float()
    else:
        logits = torch.randn(rows, v, generator=gen) * 3
    tokens = torch.argmax(logits, dim=-1).reshape(bs, gamma + 1)
    draft = torch.randint(0, v, (bs, gamma), generator=gen)
    for b in range(bs):
        a = b % (gamma + 1)
        draft[b, :a] = tokens[b, :a]
        if a < gamma:
            draft[b, a] = (tokens[b, a] + 1) % v
    return logits.to(device), draft.to(device)


def assert_same(got, want):
    names = ("tokens", "accepted", "bonus")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert torch.equal(g.cpu(), w.cpu()), name


def check(logits, draft):
    got = greedy_verify_accept(logits, draft)
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int32
    assert got[2].dtype == torch.int64
    assert all(t.device == logits.device for t in got)
    assert_same(got, greedy_verify_accept_reference(logits, draft))
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", ["small", "default"])
@pytest.mark.parametrize(
    "bs, gamma, v, ties",
    [
        (9, 3, 300, False),  # V not a multiple of BLOCK_V; empty chunks past V
        (5, 4, 257, True),  # exact ties everywhere
        (4, 0, 100, False),  # gamma = 0: the bonus is row 0's argmax
        (0, 3, 64, False),  # bs = 0: empty outputs
    ],
)
def test_matches_reference(triton_backend, monkeypatch, device, block, bs, gamma, v, ties):
    if block == "small":
        monkeypatch.setattr(ga, "_BLOCK_V", SMALL_BLOCK)
    logits, draft = planted(bs, gamma, v, device, seed=bs * 1000 + v, ties=ties)
    tokens, accepted, bonus = check(logits, draft)
    assert tokens.shape == (bs, gamma + 1) and accepted.shape == bonus.shape == (bs,)
    want = torch.arange(bs) % (gamma + 1)
    assert torch.equal(accepted.cpu().long(), want)
    if bs > gamma:
        assert set(accepted.tolist()) == set(range(gamma + 1))


@pytest.mark.parametrize("device", DEVICES)
def test_ties_keep_the_first_index(triton_backend, small_block, device):
    v = 300  # BLOCK_V 32, chunks of 64: [0, 64), [64, 128), ..., [256, 300), 3 empty
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, v, generator=gen)
    ties = {
        0: [5, 20],  # within one block
        1: [40, 10],  # two blocks of one chunk
        2: [200, 70, 130],  # three chunks
        3: [64, 63],  # the two sides of a chunk boundary
        4: [299, 290],  # the ragged last block
        5: [257, 299],  # the ragged last chunk
    }
    for r, cols in ties.items():
        logits[r, cols] = 50.0
    logits[6] = float("-inf")  # all -inf: index 0, as torch.argmax
    logits[7, [100, 3]] = float("inf")
    logits = logits.to(device)
    draft = torch.zeros(2, 3, dtype=torch.int64, device=device)
    tokens, _, _ = check(logits, draft)
    want = [min(ties[r]) for r in range(6)] + [0, 3]
    assert tokens.flatten().tolist() == want


@pytest.mark.parametrize("device", DEVICES)
def test_strided_logits(triton_backend, small_block, device):
    bs, gamma, v = 6, 2, 150
    logits, draft = planted(bs, gamma, v, device, seed=3, ties=True)
    wide = torch.full((bs * (gamma + 1), v + 37), 99.0, device=device)
    wide[:, 5 : 5 + v] = logits
    view = wide[:, 5 : 5 + v]  # row stride v + 37, unit last stride: read in place
    assert view.stride() == (v + 37, 1)
    assert_same(check(view, draft), greedy_verify_accept_reference(logits, draft))
    cols = logits.T.contiguous().T  # last stride != 1: copied first
    assert cols.stride(-1) != 1
    assert_same(check(cols, draft), greedy_verify_accept_reference(logits, draft))


@pytest.mark.parametrize("device", DEVICES)
def test_draft_dtypes_and_strides(triton_backend, small_block, device):
    bs, gamma, v = 4, 3, 200  # v < 256: the drafts fit uint8; accepted takes 0..3
    logits, draft = planted(bs, gamma, v, device, seed=5)
    want = greedy_verify_accept_reference(logits, draft)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        assert_same(check(logits, draft.to(dtype)), want)
    wide = torch.full((bs, 2 * gamma), -1, dtype=torch.int32, device=device)
    wide[:, ::2] = draft.int()
    assert_same(check(logits, wide[:, ::2]), want)  # column stride 2
    padded = draft.clone()
    padded[:, 0] = -1  # a padding id never matches a token
    _, accepted, bonus = check(logits, padded)
    assert accepted.eq(0).all()
    assert torch.equal(bonus, want[0][:, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_matches_serving_greedy_accept(monkeypatch, small_block, device, backend):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", backend)
    for bs, gamma, v, ties in [(7, 5, 300, False), (6, 2, 90, True), (3, 0, 40, False)]:
        logits, draft = planted(bs, gamma, v, device, seed=gamma + v, ties=ties)
        tokens, accepted, bonus = greedy_verify_accept(logits, draft)
        want_tokens = torch.argmax(logits, dim=-1).reshape(bs, gamma + 1)
        want = greedy_accept(draft, want_tokens)
        assert torch.equal(tokens, want_tokens) and tokens.dtype == want_tokens.dtype
        assert torch.equal(accepted, want.accepted) and accepted.dtype == want.accepted.dtype
        assert torch.equal(bonus, want.bonus) and bonus.dtype == want.bonus.dtype


def test_refuses_bad_inputs(triton_backend):
    logits, draft = planted(2, 3, 50, "cpu", seed=0)
    with pytest.raises(ValueError, match="logits must be a 2-D float"):
        greedy_verify_accept(logits[0], draft)
    with pytest.raises(ValueError, match="logits must be a 2-D float"):
        greedy_verify_accept(logits.long(), draft)
    # other float dtypes run the reference (the float64 CPU models)
    for other in (logits.double(), logits.bfloat16()):
        got = greedy_verify_accept(other, draft)
        want = greedy_verify_accept_reference(other, draft)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match=r"logits must have bs \* \(gamma \+ 1\)"):
        greedy_verify_accept(logits[:-1], draft)
    with pytest.raises(ValueError, match=r"logits must have bs \* \(gamma \+ 1\)"):
        greedy_verify_accept(logits, draft[:, :2])
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        greedy_verify_accept(logits[:, :0], draft)
    with pytest.raises(ValueError, match="draft must be a 2-D integer"):
        greedy_verify_accept(logits, draft[0])
    with pytest.raises(ValueError, match="draft must be a 2-D integer"):
        greedy_verify_accept(logits, draft.float())
    with pytest.raises(ValueError, match="draft must be a 2-D integer"):
        greedy_verify_accept(logits, draft.bool())
    with pytest.raises(ValueError, match="one device"):
        greedy_verify_accept(logits, draft.to("meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True])
def test_gpu_real_size_in_a_cuda_graph(ties):
    bs, gamma, v = 48, 7, 32000
    logits, draft = planted(bs, gamma, v, "cuda", seed=1, ties=ties)
    check(logits, draft)  # also compiles both kernels before the capture
    static_logits, static_draft = logits.clone(), draft.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_verify_accept(static_logits, static_draft)
    for seed in (2, 3):
        new_logits, new_draft = planted(bs, gamma, v, "cuda", seed=seed, ties=ties)
        static_logits.copy_(new_logits)
        static_draft.copy_(new_draft)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, greedy_verify_accept_reference(new_logits, new_draft))
        assert set(out[1].tolist()) == set(range(gamma + 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", ["small", "default"])
def test_lse_in_the_same_pass(triton_backend, monkeypatch, device, block):
    """``lse=True``: the same tokens, accepted prefixes and bonus tokens, and every row's
    log-sum-exp equal to ``torch.logsumexp`` (float64) to float32 rounding — rows with
    ``-inf`` blocks and chunks, a chunk of ``-inf`` only, a row of ``-inf`` only (``-inf``),
    logits far from zero (the sums are rescaled, never overflow), a ragged last block."""
    if block == "small":
        monkeypatch.setattr(ga, "_BLOCK_V", SMALL_BLOCK)
    bs, gamma, v = 4, 2, 300
    logits, draft = planted(bs, gamma, v, "cpu", seed=11)
    logits[0, :100] = float("-inf")  # the first chunks (and blocks) -inf only
    logits[1, 150:] = float("-inf")  # the last chunks -inf only
    logits[2] = float("-inf")  # the whole row
    logits[3] = logits[3] * 40 + 900.0  # exp(x) overflows float32 without the rescaling
    logits[5, 7] = 80.0  # one logit far above the rest
    logits, draft = logits.to(device), draft.to(device)
    got = greedy_verify_accept(logits, draft, lse=True)
    assert len(got) == 4
    assert_same(got[:3], greedy_verify_accept_reference(logits, draft))
    lse = got[3]
    assert lse.dtype == torch.float32 and lse.shape == (bs * (gamma + 1),)
    want = torch.logsumexp(logits.double().cpu(), dim=-1)
    assert lse[2].item() == float("-inf")
    finite = torch.isfinite(want)
    assert torch.isfinite(lse.cpu()[finite]).all()
    err = (lse.cpu().double()[finite] - want[finite]).abs() / want[finite].abs().clamp_min(1.0)
    assert err.max().item() < 4e-6, err
    ref = greedy_verify_accept_reference(logits, draft, lse=True)
    assert ref[3].dtype == torch.float32
    assert torch.allclose(ref[3].cpu().double()[finite], want[finite], rtol=4e-6)


def test_lse_empty_batch(triton_backend):
    logits = torch.zeros(0, 64)
    draft = torch.zeros(0, 3, dtype=torch.int64)
    out = greedy_verify_accept(logits, draft, lse=True)
    assert len(out) == 4 and out[3].shape == (0,)
