"""draw_with_probs: the two-launch kernel (through the interpreter on CPU) gives its torch
reference's tokens and distributions; each token is the Gumbel draw's over the same kept
values, and its probability the value written into its row."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.draw_probs import (
    draw_with_probs,
    draw_with_probs_reference,
    draw_with_probs_triton,
)
from unimem_kernel.sampling import gumbel_argmax_triton, position_keys_reference


def _case(n, vocab, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype).to(device)
    temperature = torch.tensor([0.7, 0.0, 1.3, 0.5, 0.0, 1.0][:n] * (n // 6 + 1))[:n]
    scaled = logits.float().cpu() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    cut = scaled.quantile(0.9, dim=-1) if vocab > 1 else scaled[:, 0]
    cut[::3] = -math.inf  # every third row keeps everything
    keys = position_keys_reference(torch.arange(n) * 31 - 4, torch.arange(n) + 100, 1)
    return logits, temperature.to(device), cut.to(device), keys.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, vocab, dtype",
    [(6, 7, torch.float32), (5, 1000, torch.float32), (6, 2048, torch.bfloat16),
     (4, 5000, torch.float32),
     # 16 chunks of SPLIT: the slow tier (5000's three, the last ragged, reach the same code)
     pytest.param(3, 32768, torch.bfloat16, marks=pytest.mark.slow)],
)  # fmt: skip
def test_kernel_gives_the_references_tokens_and_distributions(device, n, vocab, dtype):
    logits, t, cut, keys = _case(n, vocab, device, dtype, seed=vocab)
    want_tok, want_p, want_px = draw_with_probs_reference(logits, t, cut, keys)
    tok, p, px = draw_with_probs_triton(logits, t, cut, keys)
    assert tok.dtype == torch.int64 and p.dtype == px.dtype == torch.float32
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(p, want_p, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(px, want_px, rtol=2e-5, atol=1e-6)
    assert torch.equal(px, p.gather(1, tok[:, None])[:, 0])  # the very value written
    live = t > 0
    # a sampled row's token is the Gumbel draw over the same kept values; a greedy row's its
    # first argmax with the point mass on it
    scaled = logits.float() / torch.where(live, t, 1.0)[:, None]
    drawn = gumbel_argmax_triton(
        scaled.contiguous(), torch.where(live, cut, -math.inf).contiguous(), keys,
        torch.empty(n, dtype=torch.int64, device=device),
    )  # fmt: skip
    assert torch.equal(tok[live], drawn[live])
    assert torch.equal(tok[~live], torch.argmax(logits[~live], dim=-1))
    assert torch.equal(p[~live].sum(dim=-1), torch.ones(int((~live).sum()), device=device))
    assert ((p[live] > 0) == (scaled[live] >= cut[live, None])).all()
    torch.testing.assert_close(p.sum(dim=-1), torch.ones(n, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_an_empty_batch(device):
    logits, t, cut, keys = _case(4, 3000, device, seed=5)
    wide = torch.zeros(4, 3500, device=device)
    wide[:, :3000] = logits
    view = wide[:, :3000]
    assert view.stride(0) == 3500
    got = draw_with_probs_triton(view, t, cut, keys)
    want = draw_with_probs_reference(logits, t, cut, keys)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=2e-5, atol=1e-6)
    tok, p, px = draw_with_probs_triton(logits[:0], t[:0], cut[:0], keys[:0])
    assert tok.shape == (0,) and p.shape == (0, 3000) and px.shape == (0,)


def test_bad_arguments_are_refused():
    logits, t, cut, keys = _case(3, 10, "cpu")
    with pytest.raises(ValueError, match="logits must be"):
        draw_with_probs(logits[0], t, cut, keys)
    with pytest.raises(ValueError, match="cut must be"):
        draw_with_probs(logits, t, cut[:2], keys)
    with pytest.raises(ValueError, match="keys must be an integer"):
        draw_with_probs(logits, t, cut, keys.float())
