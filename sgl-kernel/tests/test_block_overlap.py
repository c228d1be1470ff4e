"""block_overlap: block verification's ``sum_v min(w p(v), q(v))`` per lane and column.

- The reference equals the definition over materialised ``p`` (the tempered, cut, normalised
  verify row) and ``q`` (the draft column over the target's vocabulary, zero off the draft
  vocabulary), for a reduced and a full draft vocabulary.
- The kernel (through the interpreter on CPU) gives the reference's values over several
  chunks a row, cut rows, a temperature-0 lane, bf16 logits and strided rows; bad shapes and
  dtypes are refused naming the argument.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.block_overlap import (
    SPLIT,
    block_overlap,
    block_overlap_reference,
    block_overlap_triton,
)


def _case(vocab: int, k: int, n: int = 3, g: int = 2, vw: int = 3, seed: int = 0, dev="cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n * vw + 1, vocab, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.3, 0.0][:n])
    rows = torch.arange(n * vw)
    t_rows = torch.where(temperature > 0, temperature, 1.0).repeat_interleave(vw)
    s = logits[rows] / t_rows[:, None]
    # a cut on every other row (the sampler's lower bound of the kept tempered values)
    cut = torch.full((n * vw + 1,), float("-inf"))
    cut[rows[::2]] = s[::2].quantile(0.7, dim=1)
    kept = s >= cut[rows][:, None]
    lse = torch.full((n * vw + 1,), 0.0)
    lse[rows] = torch.logsumexp(torch.where(kept, s, float("-inf")), dim=1)
    if k < vocab:
        d2t = torch.randperm(vocab, generator=gen)[:k]
        t2d = torch.full((vocab,), k, dtype=torch.int64)
        t2d[d2t] = torch.arange(k)
    else:
        d2t = t2d = None
    q = torch.softmax(torch.randn(n, g, k, generator=gen) * 2, -1)
    w = torch.rand(n, g, generator=gen)
    args = [logits, vw, temperature, cut, lse, q, t2d, d2t, w]
    return [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("reduced", [True, False])
def test_the_reference_is_the_definition(reduced):
    vocab = 50
    logits, vw, temperature, cut, lse, q, t2d, d2t, w = _case(vocab, 20 if reduced else vocab)
    n, g = w.shape
    got = block_overlap_reference(logits, vw, temperature, cut, lse, q, t2d, d2t, w)
    for b in range(n):
        for i in range(g):
            row = b * vw + i
            t = float(temperature[b]) or 1.0
            s = logits[row] / t
            p = torch.where(s >= cut[row], torch.exp(s - lse[row]), 0.0)
            qv = torch.zeros(vocab) if reduced else q[b, i].clone()
            if reduced:
                qv[d2t] = q[b, i]
            want = torch.minimum(w[b, i] * p, qv).sum()
            torch.testing.assert_close(got[b, i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduced", [True, False])
def test_the_kernel_gives_the_references_values(device, reduced):
    vocab = 2 * SPLIT + 300  # three chunks a row
    args = _case(vocab, 4000 if reduced else vocab, dev=device)
    want = block_overlap_reference(*args)
    torch.testing.assert_close(block_overlap_triton(*args), want, rtol=1e-4, atol=1e-6)
    bf16 = [args[0].bfloat16(), *args[1:]]
    torch.testing.assert_close(block_overlap_triton(*bf16), block_overlap_reference(*bf16),
                               rtol=1e-4, atol=1e-6)  # fmt: skip
    wide = torch.zeros(args[0].shape[0], vocab + 64, device=device)
    wide[:, :vocab] = args[0]
    strided = [wide[:, :vocab], *args[1:]]  # rows with a stride wider than the vocabulary
    torch.testing.assert_close(block_overlap_triton(*strided), want, rtol=1e-4, atol=1e-6)


def test_bad_arguments_are_refused():
    logits, vw, temperature, cut, lse, q, t2d, d2t, w = _case(40, 10)
    with pytest.raises(ValueError, match="t2d and d2t come together"):
        block_overlap(logits, vw, temperature, cut, lse, q, t2d, None, w)
    with pytest.raises(ValueError, match="w must be float32"):
        block_overlap(logits, vw, temperature, cut, lse, q, t2d, d2t, w.double())
    with pytest.raises(ValueError, match="q must be"):
        block_overlap(logits, vw, temperature, cut, lse, q[:, :1], t2d, d2t, w)
    with pytest.raises(ValueError, match="needs t2d"):
        block_overlap(logits, vw, temperature, cut, lse, q, None, None, w)
