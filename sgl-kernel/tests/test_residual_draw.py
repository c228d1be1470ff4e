"""residual_draw: the last token of a sampled verify step in one pass over the logits.

- The kernel (through the interpreter on CPU) gives its torch reference's tokens over lanes
  that reach every case: a rejection's residual against a reduced-vocabulary proposal and
  against the full-vocabulary one, a replaced draft's point mass, the bonus row (``q`` off),
  a cut row, a temperature-0 lane, several chunks a row, bf16 logits, strided rows.
- The reference draws from ``norm(max(0, p - q))`` (chi-square over many keys, a vocabulary
  of 6), and from ``p`` where ``q >= p`` everywhere; a wrong normaliser fails the same test.
- ``tempered_token_stats``: its probabilities are ``tempered_token_probs``'s, its
  log-sum-exp and first argmax the kept tempered values' (a temperature-0 row's: the greedy
  token); asked for, the untempered log-sum-exp from the same pass, the rest unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.greedy_pick import (
    tempered_token_probs_reference,
    tempered_token_stats,
    tempered_token_stats_reference,
    tempered_token_stats_triton,
)
from unimem_kernel.residual_draw import (
    residual_draw,
    residual_draw_reference,
    residual_draw_triton,
)
from unimem_kernel.sampling import position_keys_reference


def _stats(logits, t_rows, cut):
    """Each row's kept tempered log-sum-exp (what the verify step's first pass returns)."""
    tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return tempered_token_stats_reference(logits, t_rows, tokens, cut)[1]


def _case(n, vw, vocab, k, device, dtype=torch.float32, seed=0):
    """``n`` lanes of ``vw`` rows; lane kinds cycle through: a rejection against a proposal
    close to the target (so that ``max(0, p - q)`` is a real residual), a temperature-0 lane,
    the bonus row, a replaced draft (point mass), a cut row."""
    g = torch.Generator().manual_seed(seed)
    gamma = vw - 1
    logits = (torch.randn(n * vw, vocab, generator=g) * 3).to(dtype)
    temperature = torch.tensor([0.7, 0.0, 1.3, 0.9, 0.5] * n)[:n]
    t_rows = temperature[:, None].expand(n, vw).reshape(-1)
    cut = torch.full((n * vw,), -math.inf)
    scaled = logits.float() / torch.where(t_rows > 0, t_rows, 1.0)[:, None]
    cut[4 * vw :: 5 * vw] = scaled[4 * vw :: 5 * vw].quantile(0.8, dim=-1)  # lane 4: a cut
    lse = _stats(logits, t_rows, cut)
    col = torch.tensor([0, 1, gamma, 1, 0] * n)[:n]
    end = torch.tensor([gamma, gamma, gamma, gamma, gamma] * n)[:n]
    end[2::5] = torch.minimum(col[2::5], end[2::5])  # the bonus row: col >= end
    if k < vocab:
        d2t = torch.randperm(vocab, generator=g)[:k]
        t2d = torch.full((vocab,), k, dtype=torch.int64)
        t2d[d2t] = torch.arange(k)
    else:
        d2t, t2d = torch.arange(vocab), None
    q = torch.softmax(torch.randn(n, gamma, k, generator=g) * 3, dim=-1)
    for b in range(n):  # a proposal near the target's row: 0.8 of it plus 0.2 of noise
        c = min(int(col[b]), gamma - 1)
        p = torch.softmax(scaled[b * vw + c], dim=-1)[d2t]
        q[b, c] = 0.8 * p / p.sum() + 0.2 * q[b, c]
    point = torch.zeros(n, gamma, dtype=torch.bool)
    point[3::5, 1 % gamma] = True
    draft = torch.randint(0, vocab, (n, gamma), generator=g)
    keys = position_keys_reference(torch.arange(n) * 31 + 3, torch.arange(n) + 100, 3)
    args = (logits, vw, col, end, temperature, cut, lse, q, t2d, point, draft, keys)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, vw, vocab, k, dtype",
    [(5, 3, 50, 20, torch.float32), (5, 4, 5000, 1200, torch.float32),
     (5, 2, 9000, 9000, torch.float32), (5, 3, 4100, 900, torch.bfloat16)],
)  # fmt: skip
def test_kernel_gives_the_references_tokens(device, n, vw, vocab, k, dtype):
    args = _case(n, vw, vocab, k, device, dtype, seed=vocab)
    want = residual_draw_reference(*args)
    got = residual_draw_triton(*args)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    logits, vw_, col, _, t = args[:5]
    rows = torch.arange(n, device=device) * vw_ + col
    greedy = t == 0  # a temperature-0 lane: its row's first argmax
    assert torch.equal(got[greedy], logits[rows[greedy]].float().argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab, k", [(4100, 900), (3000, 3000)])
def test_a_weight_divides_the_proposal(device, vocab, k):
    # block verification's draw from norm(max(0, w p - q)): the kernel's tokens are the
    # reference's, and the reference's are those of the proposal divided beforehand (the
    # point mass left at 1); its distribution is checked below
    args = _case(5, 3, vocab, k, device, seed=vocab + 1)
    weight = torch.tensor([0.35, 1.0, 0.05, 0.6, 0.8], device=device)
    want = residual_draw_reference(*args, weight)
    assert torch.equal(residual_draw_triton(*args, weight), want)
    q = args[7]
    divided = residual_draw_reference(*args[:7], q / weight[:, None, None], *args[8:])
    assert torch.equal(divided, want)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_an_empty_batch(device):
    args = _case(5, 3, 3000, 700, device, seed=5)
    logits = args[0]
    wide = torch.zeros(logits.shape[0], 3300, device=device)
    wide[:, :3000] = logits
    view = wide[:, :3000]
    assert view.stride(0) == 3300
    assert torch.equal(residual_draw_triton(view, *args[1:]), residual_draw_reference(*args))
    empty = residual_draw_triton(logits, 3, *(a[:0] for a in args[2:5]), *args[5:7],
                                 args[7][:0], args[8], *(a[:0] for a in args[9:]))  # fmt: skip
    assert empty.shape == (0,)


def _draws(p, q, lanes=24_000, point=False, weight=None):
    """``lanes`` draws of the reference from one row ``p`` (given as logits ``log p``) with
    proposal ``q`` (full vocabulary) and block verification's ``weight`` (a float or None),
    each with its own key."""
    vocab = p.numel()
    logits = torch.log(p)[None].expand(lanes, vocab).contiguous()
    ones = torch.ones(lanes)
    lse = torch.logsumexp(logits, dim=-1)
    keys = position_keys_reference(torch.arange(lanes), torch.full((lanes,), 7), 3)
    q3 = q[None, None].expand(lanes, 1, vocab).contiguous()
    pt = torch.full((lanes, 1), point)
    return residual_draw_reference(
        logits, 1, torch.zeros(lanes, dtype=torch.int64), torch.ones(lanes, dtype=torch.int64),
        ones, torch.full((lanes,), -math.inf), lse, q3, None, pt,
        torch.full((lanes, 1), 2, dtype=torch.int64), keys,
        None if weight is None else torch.full((lanes,), weight),
    )  # fmt: skip


def _chi2_pvalue(samples, probs):
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.06, 0.04])
Q = torch.tensor([0.10, 0.40, 0.05, 0.15, 0.20, 0.10])


def test_the_draw_follows_the_normalised_residual():
    r = torch.clamp(P - Q, min=0)
    assert _chi2_pvalue(_draws(P, Q), r / r.sum()) > 0.01


def test_a_weighted_draw_follows_the_weighted_residual():
    # w = 0.5: max(0, w p - q) keeps tokens 0 and 2 at 0.05 each; the unweighted residual
    # (0.20 and 0.15) is refused by the same test
    r = torch.clamp(0.5 * P - Q, min=0)
    assert _chi2_pvalue(_draws(P, Q, weight=0.5), r / r.sum()) > 0.01
    unweighted = torch.clamp(P - Q, min=0)
    assert _chi2_pvalue(_draws(P, Q), r / r.sum()) < 0.01
    assert _chi2_pvalue(_draws(P, Q, weight=0.5), unweighted / unweighted.sum()) < 0.01


def test_a_replaced_draft_subtracts_its_point_mass():
    point = torch.zeros_like(P)
    point[2] = 1.0  # the point mass on draft token 2: the residual is p with token 2 removed
    r = torch.clamp(P - point, min=0)
    assert _chi2_pvalue(_draws(P, Q, point=True), r / r.sum()) > 0.01


def test_no_residual_mass_draws_from_p():
    assert _chi2_pvalue(_draws(P, P.clone()), P) > 0.01


def test_a_wrong_normaliser_fails_the_same_test():
    # drawing from p itself (the residual forgotten) is caught by the same test
    r = torch.clamp(P - Q, min=0)
    assert _chi2_pvalue(_draws(P, torch.zeros_like(Q)), r / r.sum()) < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_tempered_token_stats_match_the_reference(device):
    g = torch.Generator().manual_seed(11)
    n, vocab = 6, 5000
    logits = (torch.randn(n, vocab, generator=g) * 3).to(device)
    t = torch.tensor([0.7, 0.0, 1.3, 0.5, 0.0, 1.0], device=device)
    tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
    tokens[1] = logits[1].argmax()
    scaled = logits / torch.where(t > 0, t, 1.0)[:, None]
    for cut in (None, scaled.quantile(0.9, dim=-1)):
        probs, lse, first = tempered_token_stats_triton(logits, t, tokens, cut)
        want_p, want_lse, want_first = tempered_token_stats_reference(logits, t, tokens, cut)
        torch.testing.assert_close(probs, want_p, rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(probs, tempered_token_probs_reference(logits, t, tokens, cut),
                                   rtol=2e-5, atol=1e-7)  # fmt: skip
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
        assert torch.equal(first, want_first)
        greedy = t == 0
        assert torch.equal(first[greedy], logits[greedy].argmax(dim=-1))
        # raw: the untempered, uncut log-sum-exp from the same pass; the rest unchanged
        *same, raw = tempered_token_stats_triton(logits, t, tokens, cut, raw=True)
        assert all(torch.equal(a, b) for a, b in zip(same, (probs, lse, first), strict=True))
        want_raw = tempered_token_stats_reference(logits, t, tokens, cut, raw=True)[3]
        torch.testing.assert_close(want_raw, torch.logsumexp(logits.double(), -1).float())
        torch.testing.assert_close(raw, want_raw, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    args = list(_case(5, 3, 50, 20, "cpu"))
    with pytest.raises(ValueError, match="needs t2d"):
        residual_draw(*args[:8], None, *args[9:])
    bad = list(args)
    bad[6] = args[6][:4]
    with pytest.raises(ValueError, match="lse must be"):
        residual_draw(*bad)
    bad = list(args)
    bad[1] = 4
    with pytest.raises(ValueError, match="logits rows"):
        residual_draw(*bad)
    bad = list(args)
    bad[8] = args[8].int()
    with pytest.raises(ValueError, match="t2d must be int64"):
        residual_draw(*bad)
    with pytest.raises(ValueError, match="weight must be"):
        residual_draw(*args, torch.ones(4))
    with pytest.raises(ValueError, match="weight must be float32"):
        residual_draw(*args, torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="temperature, tokens and cut must be"):
        tempered_token_stats(torch.randn(3, 10), torch.ones(2), torch.zeros(3, dtype=torch.long))
