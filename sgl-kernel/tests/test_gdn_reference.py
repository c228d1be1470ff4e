"""GDN mixer core (``unimem_kernel.gdn_reference``): conv and delta-rule forms agree with each
other and with literal definitions; verify touches no slot; strided slot views work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unimem_kernel import gdn_reference as gr

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rule_inputs(gen: torch.Generator, b: int, length: int, h: int, dk: int, dv: int):
    q = torch.randn(b, length, h, dk, generator=gen, dtype=F64)
    k = gr.l2norm(torch.randn(b, length, h, dk, generator=gen, dtype=F64))
    v = torch.randn(b, length, h, dv, generator=gen, dtype=F64)
    g = -2.0 * torch.rand(b, length, h, generator=gen, dtype=F64)
    beta = torch.rand(b, length, h, generator=gen, dtype=F64)
    return q, k, v, g, beta


def _strided_slots(n: int, shape: tuple[int, ...], dtype: torch.dtype, fill: float):
    """A ``[n, *shape]`` view with padding between slots (like a view into an arena)."""
    per = 1
    for d in shape:
        per *= d
    buf = torch.full((n, per + 7), fill, dtype=dtype)
    view = buf[:, 3 : 3 + per].unflatten(1, shape)
    assert not view.is_contiguous()
    return buf, view


def test_recurrent_matches_literal_definition():
    gen = _gen(0)
    q, k, v, g, beta = _rule_inputs(gen, 1, 9, 2, 5, 3)
    s0 = torch.randn(1, 2, 5, 3, generator=gen, dtype=F64)
    o, final = gr.gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    scale = 5**-0.5
    for h in range(2):
        s = s0[0, h].clone()
        for t in range(9):
            kt, vt, qt = k[0, t, h], v[0, t, h], q[0, t, h]
            sd = torch.exp(g[0, t, h]) * s
            s = sd + beta[0, t, h] * torch.outer(kt, vt - sd.T @ kt)
            torch.testing.assert_close(o[0, t, h], s.T @ (scale * qt), rtol=0, atol=1e-12)
        torch.testing.assert_close(final[0, h], s, rtol=0, atol=1e-12)
    assert torch.equal(s0, s0.clone())  # the initial state is not modified


@pytest.mark.parametrize("length", [1, 7, 64, 150])
@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_chunked_equals_recurrent(length: int, chunk: int):
    gen = _gen(length * 100 + chunk)
    q, k, v, g, beta = _rule_inputs(gen, 2, length, 3, 8, 6)
    s0 = torch.randn(2, 3, 8, 6, generator=gen, dtype=F64)
    o_r, s_r = gr.gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gr.gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    assert (o_r - o_c).abs().max() < 1e-10
    assert (s_r - s_c).abs().max() < 1e-10


def test_chunked_strong_decay_is_finite():
    gen = _gen(1)
    q, k, v, g, beta = _rule_inputs(gen, 1, 130, 2, 4, 4)
    g = g * 30  # exp(cumsum) underflows within a chunk
    s0 = torch.randn(1, 2, 4, 4, generator=gen, dtype=F64)
    o_r, s_r = gr.gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gr.gated_delta_rule_chunked(q, k, v, g, beta, s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert (o_r - o_c).abs().max() < 1e-10 and (s_r - s_c).abs().max() < 1e-10


def _conv_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of ``x [L, D]`` from zeros, via ``F.conv1d``."""
    k = w.shape[1]
    y = F.conv1d(x.t()[None], w[:, None, :], padding=k - 1, groups=x.shape[1])
    return y[0, :, : x.shape[0]].t()


def test_conv_extend_then_decode_equals_full_sequence():
    gen = _gen(2)
    d, kernel, lengths, steps = 6, 4, [1, 2, 5, 9], 4
    w = torch.randn(d, kernel, generator=gen, dtype=F64)
    seqs = [torch.randn(n + steps, d, generator=gen, dtype=F64) for n in lengths]
    _, state = _strided_slots(8, (d, kernel - 1), F64, float("nan"))  # stale NaN bytes
    slots = torch.tensor([6, 1, 3, 0], dtype=torch.int32)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = torch.cat([s[:n] for s, n in zip(seqs, lengths, strict=True)])
    y = gr.causal_conv1d_extend(
        x, w, state, slots, torch.tensor(cu), has_initial_state=torch.zeros(4, dtype=torch.bool)
    )
    outs = [[y[cu[i] : cu[i + 1]]] for i in range(4)]
    for t in range(steps):
        xt = torch.stack([s[n + t] for s, n in zip(seqs, lengths, strict=True)])
        yt = gr.causal_conv1d_decode(xt, w, state, slots)
        for i in range(4):
            outs[i].append(yt[i : i + 1])
    for i, s in enumerate(seqs):
        assert (torch.cat(outs[i]) - _conv_oracle(s, w)).abs().max() < 1e-12
        padded = torch.cat([torch.zeros(kernel - 1, d, dtype=F64), s])
        assert torch.equal(state[slots[i].item()], padded[-(kernel - 1) :].t())
    untouched = [j for j in range(8) if j not in slots.tolist()]
    assert torch.isnan(state[untouched]).all()


def test_conv_extend_continues_from_state_and_skips_empty_requests():
    gen = _gen(3)
    d, kernel = 5, 4
    w = torch.randn(d, kernel, generator=gen, dtype=F64)
    seq = torch.randn(11, d, generator=gen, dtype=F64)
    state = torch.zeros(3, d, kernel - 1, dtype=F64)
    keep = torch.randn(d, kernel - 1, generator=gen, dtype=F64)
    state[2] = keep
    slots = torch.tensor([0, 2])
    parts = []
    for a, b in [(0, 4), (4, 5), (5, 11)]:  # the middle chunk is shorter than K - 1
        x = seq[a:b]
        parts.append(gr.causal_conv1d_extend(x, w, state, slots, [0, b - a, b - a]))
    assert (torch.cat(parts) - _conv_oracle(seq, w)).abs().max() < 1e-12
    assert torch.equal(state[2], keep)  # zero tokens: state kept


def test_conv_verify_states_equal_step_by_step_decode_and_slot_untouched():
    gen = _gen(4)
    bs, tv, d, kernel = 3, 5, 7, 4
    w = torch.randn(d, kernel, generator=gen, dtype=F64)
    _, state = _strided_slots(5, (d, kernel - 1), F64, 0.0)
    state.copy_(torch.randn(state.shape, generator=gen, dtype=F64))
    before = state.clone()
    slots = torch.tensor([4, 0, 2])
    x = torch.randn(bs, tv, d, generator=gen, dtype=F64)
    scratch = torch.full((bs, tv, d, kernel - 1), float("nan"), dtype=F64)
    y = gr.causal_conv1d_verify(x, w, state, slots, scratch)
    assert torch.equal(state, before)
    step_state = state.clone()
    for t in range(tv):
        yt = gr.causal_conv1d_decode(x[:, t], w, step_state, slots)
        assert torch.equal(yt, y[:, t])
        assert torch.equal(step_state[slots], scratch[:, t])


def test_delta_rule_modes_agree_with_strided_slots():
    gen = _gen(5)
    h, dk, dv, tv = 2, 4, 3, 4
    lengths = [3, 70, 1]
    total = [n + tv for n in lengths]
    ins = [_rule_inputs(gen, 1, n, h, dk, dv) for n in total]
    _, ssm = _strided_slots(6, (h, dk, dv), F64, float("nan"))
    slots = torch.tensor([5, 2, 3])
    # extend the prompts from no initial state (NaN slot bytes must not leak)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cat = [torch.cat([x[j][0, :n] for x, n in zip(ins, lengths, strict=True)]) for j in range(5)]
    o_ext = gr.gated_delta_rule_extend(
        *cat, ssm, slots, torch.tensor(cu), has_initial_state=torch.zeros(3, dtype=torch.bool)
    )
    # verify tv tokens, then the same tokens by decode steps
    ver = [torch.stack([x[j][0, n:] for x, n in zip(ins, lengths, strict=True)]) for j in range(5)]
    before = ssm.clone()
    scratch = torch.empty(3, tv, h, dk, dv, dtype=F64)
    o_ver = gr.gated_delta_rule_verify(*ver, ssm, slots, scratch)
    assert torch.equal(ssm.nan_to_num(7.0), before.nan_to_num(7.0))
    for t in range(tv):
        o_dec = gr.gated_delta_rule_decode(*(x[:, t] for x in ver), ssm, slots)
        assert (o_dec - o_ver[:, t]).abs().max() < 1e-12
        assert (ssm[slots] - scratch[:, t]).abs().max() < 1e-12
    # everything equals one recurrent pass per sequence from zeros
    for i, x in enumerate(ins):
        o_ref, s_ref = gr.gated_delta_rule_recurrent(*x, torch.zeros(1, h, dk, dv, dtype=F64))
        got = torch.cat([o_ext[cu[i] : cu[i + 1]], o_ver[i]])
        assert (got - o_ref[0]).abs().max() < 1e-10
        assert (ssm[slots[i].item()] - s_ref[0]).abs().max() < 1e-10


def test_gdn_forward_modes_agree():
    """extend(prompt) + verify(tv) + commit + decode == one extend of each whole sequence."""
    gen = _gen(6)
    h, dk, dv, kernel = 2, 4, 3, 4
    conv_dim = h * (2 * dk + dv)
    w = torch.randn(conv_dim, kernel, generator=gen, dtype=F64) / 2
    lengths, tv = [6, 2], 3
    full = [n + tv + 1 for n in lengths]
    seqs = [
        (
            torch.randn(n, conv_dim, generator=gen, dtype=F64),
            -torch.rand(n, h, generator=gen, dtype=F64),
            torch.rand(n, h, generator=gen, dtype=F64),
        )
        for n in full
    ]
    slots = torch.tensor([1, 0])

    def fresh():
        conv = torch.zeros(2, conv_dim, kernel - 1, dtype=F64)
        return conv, torch.zeros(2, h, dk, dv, dtype=F64)

    def rows(a: list[int], b: list[int]):  # (mixed_qkv, g, beta) of rows a[i]:b[i], stacked
        return [torch.cat([s[j][a[i] : b[i]] for i, s in enumerate(seqs)]) for j in range(3)]

    conv, ssm = fresh()
    cu = torch.tensor([0, lengths[0], sum(lengths)])
    mixed, g, beta = rows([0, 0], lengths)
    o_ext = gr.gdn_forward("extend", mixed, w, g, beta, conv, ssm, slots, cu)
    cs = torch.empty(2, tv, conv_dim, kernel - 1, dtype=F64)
    ss = torch.empty(2, tv, h, dk, dv, dtype=F64)
    mixed, g, beta = rows(lengths, [n + tv for n in lengths])
    o_ver = gr.gdn_forward(
        "verify", mixed, w, g, beta, conv, ssm, slots, conv_scratch=cs, ssm_scratch=ss
    )
    conv.index_copy_(0, slots, cs[:, -1])  # commit all tv tokens
    ssm.index_copy_(0, slots, ss[:, -1])
    mixed, g, beta = rows([n - 1 for n in full], full)
    o_dec = gr.gdn_forward("decode", mixed, w, g, beta, conv, ssm, slots)
    for i in range(2):
        conv_b, ssm_b = fresh()
        one = slots[i : i + 1]
        o_b = gr.gdn_forward(
            "extend", *seqs[i][:1], w, *seqs[i][1:], conv_b, ssm_b, one, [0, full[i]]
        )
        got = torch.cat([o_ext[cu[i] : cu[i + 1]], o_ver[i * tv : (i + 1) * tv], o_dec[i : i + 1]])
        assert (got - o_b).abs().max() < 1e-10
        assert (ssm[slots[i]] - ssm_b[slots[i]]).abs().max() < 1e-10
        assert torch.equal(conv[slots[i]], conv_b[slots[i]])
    with pytest.raises(ValueError, match="mode"):
        gr.gdn_forward("prefill", mixed, w, g, beta, conv, ssm, slots)
