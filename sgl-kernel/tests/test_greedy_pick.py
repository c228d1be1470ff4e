"""``unimem_kernel.greedy_pick.greedy_logprob``: the argmax token and its log-probability in
one pass, against the torch reference (argmax, gather, logsumexp). The token is exact (ties
to the first index, across chunk boundaries); the log-probability within float32 rounding;
a row alone equals the same row in a batch. The chunk is lowered so that tiny rows span
several chunks on the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import greedy_pick as gp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_logprob_matches_reference(triton_backend, device, dtype, monkeypatch):
    monkeypatch.setattr(gp, "SPLIT", 64)
    monkeypatch.setattr(gp, "_BLOCK", 16)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=g) * 4).to(dtype).to(device)
    logits[1, 70] = logits[1, 200] = logits[1].max() + 1  # a tie across chunks: the first
    logits[2, :] = 0.5  # all equal: index 0
    logits[3, 299] = 50.0  # the last column, in a partial chunk
    out = torch.full((5, 3), -7.0, device=device)
    tok, lp = gp.greedy_logprob(logits, out[:, 1])
    tok0, lp0 = gp.greedy_logprob_reference(logits)
    assert torch.equal(tok, tok0) and tok.dtype == torch.int64
    assert tok[1] == 70 and tok[2] == 0 and tok[3] == 299
    assert lp.data_ptr() == out[:, 1].data_ptr() and (out[:, 0] == -7.0).all()
    if dtype == torch.float32:
        torch.testing.assert_close(lp, lp0, rtol=1e-5, atol=1e-5)
    else:  # other dtypes take the reference (its logsumexp rounds to their dtype)
        assert torch.equal(lp, lp0)
    t1, l1 = gp.greedy_logprob(logits[3:4])
    assert torch.equal(t1, tok[3:4]) and torch.equal(l1, lp[3:4])


def test_greedy_logprob_refuses_bad_input():
    with pytest.raises(ValueError, match="logits"):
        gp.greedy_logprob(torch.zeros(3))
    with pytest.raises(ValueError, match="out_logprobs"):
        gp.greedy_logprob(torch.zeros(2, 4), torch.zeros(3))


@pytest.mark.gpu
def test_greedy_logprob_gpu_gemma_vocab():
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(48, 262144, generator=g, device="cuda") * 8
    tok, lp = gp.greedy_logprob(logits)
    tok0, lp0 = gp.greedy_logprob_reference(logits)
    assert torch.equal(tok, tok0)
    torch.testing.assert_close(lp, lp0, rtol=1e-5, atol=1e-5)
    t1, l1 = gp.greedy_logprob(logits[17:18])
    assert torch.equal(t1, tok[17:18]) and torch.equal(l1, lp[17:18])


@pytest.mark.parametrize("device", DEVICES)
def test_tempered_token_probs(triton_backend, device, monkeypatch):
    """One pass over tempered logits: a row of temperature t > 0 gives softmax(x / t) at its
    token (float64 reference, relative 1e-5; tokens of high and of tiny probability, a row
    with -inf logits); a row of temperature 0 gives 1.0 for its first argmax (ties) and 0.0
    for any other token; rows never mix."""
    from unimem_kernel.greedy_pick import tempered_token_probs, tempered_token_probs_reference

    if device == "cpu":  # several chunks of several blocks, a ragged last one
        monkeypatch.setattr(gp, "SPLIT", 1024)
        monkeypatch.setattr(gp, "_BLOCK", 256)
    gen = torch.Generator().manual_seed(21)
    n, v = 8, 9000 if device == "cpu" else 262144
    logits = torch.randn(n, v, generator=gen) * 4
    logits[2, : v // 2] = float("-inf")
    logits[5, [17, 4000]] = 30.0  # a tie: 17 is the first argmax
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.25, 0.0, 2.0, 0.0])
    top = logits.argmax(dim=-1)
    tokens = top.clone()
    tokens[0] = logits[0].argmin()  # a tiny probability
    tokens[2] = v - 1
    tokens[5] = 17
    tokens[7] = (top[7] + 1) % v  # a greedy row's non-argmax token
    tokens[6] = 3
    logits, temperature, tokens = logits.to(device), temperature.to(device), tokens.to(device)
    got = tempered_token_probs(logits, temperature, tokens).cpu()
    assert got.dtype == torch.float32
    x = logits.double().cpu()
    t = temperature.double().cpu()
    live = t > 0
    want = torch.softmax(x / torch.where(live, t, 1.0)[:, None], dim=-1)
    want = want.gather(1, tokens.cpu()[:, None])[:, 0]
    assert torch.allclose(got[live].double(), want[live], rtol=1e-5, atol=0)
    assert got[~live].tolist() == [1.0, 1.0, 0.0]
    ref = tempered_token_probs_reference(logits, temperature, tokens).cpu()
    assert torch.allclose(got, ref, rtol=1e-5, atol=0)
    half = tempered_token_probs(logits[4:], temperature[4:], tokens[4:]).cpu()
    assert torch.equal(half, got[4:])


def test_tempered_token_probs_refuses_bad_input():
    from unimem_kernel.greedy_pick import tempered_token_probs

    with pytest.raises(ValueError, match="logits"):
        tempered_token_probs(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature, tokens and cut"):
        tempered_token_probs(torch.zeros(2, 4), torch.zeros(3), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("device", DEVICES)
def test_tempered_token_probs_with_a_cut(triton_backend, device, monkeypatch):
    """With a cut-off (here each row's 50th largest tempered logit, as top-k 50 gives): the
    softmax over the kept values only (float64 reference), the token exactly at the cut kept,
    a token just below it 0.0; greedy rows ignore the cut."""
    from unimem_kernel.greedy_pick import tempered_token_probs, tempered_token_probs_reference

    if device == "cpu":
        monkeypatch.setattr(gp, "SPLIT", 1024)
        monkeypatch.setattr(gp, "_BLOCK", 256)
    gen = torch.Generator().manual_seed(5)
    n, v, k = 6, 5000 if device == "cpu" else 262144, 50
    logits = (torch.randn(n, v, generator=gen) * 3).to(device)
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.9, 0.3, 0.0], device=device)
    t = torch.where(temperature > 0, temperature, 1.0)
    scaled = logits / t[:, None]
    desc, order = torch.sort(scaled, dim=-1, descending=True)
    cut = desc[:, k - 1].contiguous()
    tokens = order[:, 0].clone()
    tokens[1] = order[1, k - 1]  # exactly at the cut: kept
    tokens[3] = order[3, k]  # just below it: cut
    tokens[5] = order[5, 1]  # a greedy row's second-best token
    got = tempered_token_probs(logits, temperature, tokens, cut).cpu()
    ref = tempered_token_probs_reference(logits, temperature, tokens, cut).cpu()
    s64 = logits.double().cpu() / t.double().cpu()[:, None]
    kept = torch.where(s64 >= s64.gather(1, order[:, k - 1 : k].cpu()), s64, -torch.inf)
    want = torch.softmax(kept, dim=-1).gather(1, tokens.cpu()[:, None])[:, 0]
    live = (temperature > 0).cpu()
    assert got[3].item() == 0.0 and got[1].item() > 0.0
    assert torch.allclose(got[live].double(), want[live], rtol=1e-5, atol=0)
    assert torch.allclose(got, ref, rtol=1e-5, atol=0)
    assert got[~live].tolist() == [1.0, 0.0]
