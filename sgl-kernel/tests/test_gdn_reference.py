"""GDN mixer core (``unimem_kernel.gdn_reference``): conv and delta-rule forms agree with each
other and with literal definitions; verify touches no slot; strided slot views work; grouped key
heads (``Hk < H``) equal the ungrouped layer on explicitly ``repeat_interleave``'d q, k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unimem_kernel import gdn_reference as gr

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rule_inputs(
    gen: torch.Generator, b: int, length: int, h: int, dk: int, dv: int, hk: int | None = None
):
    """q, k with ``hk`` heads (default ``h``), v, g, beta with ``h``."""
    hk = h if hk is None else hk
    q = torch.randn(b, length, hk, dk, generator=gen, dtype=F64)
    k = gr.l2norm(torch.randn(b, length, hk, dk, generator=gen, dtype=F64))
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


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)])
def test_recurrent_matches_literal_definition(heads: tuple[int, int]):
    """Per value head ``h``, with key head ``h // (H // Hk)`` (HuggingFace's Qwen3-Next)."""
    nh, nk = heads
    gen = _gen(0)
    q, k, v, g, beta = _rule_inputs(gen, 1, 9, nh, 5, 3, hk=nk)
    s0 = torch.randn(1, nh, 5, 3, generator=gen, dtype=F64)
    s0_before = s0.clone()
    o, final = gr.gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    scale = 5**-0.5
    for h in range(nh):
        s = s0[0, h].clone()
        j = h // (nh // nk)
        for t in range(9):
            kt, vt, qt = k[0, t, j], v[0, t, h], q[0, t, j]
            sd = torch.exp(g[0, t, h]) * s
            s = sd + beta[0, t, h] * torch.outer(kt, vt - sd.T @ kt)
            torch.testing.assert_close(o[0, t, h], s.T @ (scale * qt), rtol=0, atol=1e-12)
        torch.testing.assert_close(final[0, h], s, rtol=0, atol=1e-12)
    assert torch.equal(s0, s0_before)  # the initial state is not modified


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


def test_conv_silu_activation_is_applied_before_the_one_rounding():
    """``activation="silu"``: SiLU on the float32 accumulator, then one rounding to the input
    dtype (``causal_conv1d_fn``'s activation), in every mode; anything else is refused."""
    gen = _gen(14)
    bs, tv, d, kernel = 3, 4, 6, 4
    w = torch.randn(d, kernel, generator=gen).to(torch.bfloat16)
    state = torch.randn(bs, d, kernel - 1, generator=gen).to(torch.bfloat16)
    slots = torch.arange(bs)
    x = torch.randn(bs, tv, d, generator=gen).to(torch.bfloat16)
    # the float32 accumulator of the plain conv, from float32 copies of the same bf16 values
    acc = gr.causal_conv1d_verify(
        x.float(), w.float(), state.float(), slots, torch.empty(bs, tv, d, kernel - 1)
    )
    want = F.silu(acc).to(torch.bfloat16)
    scratch = torch.empty(bs, tv, d, kernel - 1, dtype=torch.bfloat16)
    y = gr.causal_conv1d_verify(x, w, state, slots, scratch, "silu")
    assert torch.equal(y, want)
    assert not torch.equal(y, F.silu(acc.to(torch.bfloat16).float()).to(torch.bfloat16))
    y0 = gr.causal_conv1d_decode(x[:, 0], w, state.clone(), slots, "silu")
    assert torch.equal(y0, want[:, 0])
    ye = gr.causal_conv1d_extend(
        x.reshape(bs * tv, d), w, state.clone(), slots, [0, tv, 2 * tv, 3 * tv], None, "silu"
    )
    assert torch.equal(ye, want.reshape(bs * tv, d))
    with pytest.raises(ValueError, match="activation"):
        gr.causal_conv1d_decode(x[:, 0], w, state, slots, "gelu")


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


# ---------------------------------------------------------------------- grouped key heads


def _same(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Equal up to float64 rounding (reductions over differently strided views may round
    differently; a wrong head mapping is off by O(1))."""
    return all(a.shape == b.shape and (a - b).abs().max() < 1e-12 for a, b in pairs)


def _expand(x: torch.Tensor, h: int) -> torch.Tensor:
    """``[..., Hk, D]`` -> ``[..., H, D]``: key head ``j`` repeated for value heads
    ``j * r .. (j + 1) * r - 1`` (``r = H // Hk``), as HuggingFace's Qwen3-Next."""
    return x.repeat_interleave(h // x.shape[-2], dim=-2)


def _expand_channels(x: torch.Tensor, dim: int, h: int, hk: int, dk: int) -> torch.Tensor:
    """Channels ``[q: Hk*Dk | k: Hk*Dk | v]`` along ``dim`` -> ``[q: H*Dk | k: H*Dk | v]``."""
    x = x.movedim(dim, -1)
    kd = hk * dk
    q, k, v = x[..., :kd], x[..., kd : 2 * kd], x[..., 2 * kd :]
    q, k = (_expand(t.unflatten(-1, (hk, dk)), h).flatten(-2) for t in (q, k))
    return torch.cat([q, k, v], dim=-1).movedim(-1, dim)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (6, 3)])
def test_grouped_rule_equals_ungrouped_on_expanded_qk(heads: tuple[int, int]):
    h, hk = heads
    gen = _gen(7 + h + hk)
    q, k, v, g, beta = _rule_inputs(gen, 2, 19, h, 4, 3, hk=hk)
    s0 = torch.randn(2, h, 4, 3, generator=gen, dtype=F64)
    qe, ke = _expand(q, h), _expand(k, h)
    states, states_e = (
        torch.empty(2, 19, h, 4, 3, dtype=F64),
        torch.empty(2, 19, h, 4, 3, dtype=F64),
    )
    o, s = gr.gated_delta_rule_recurrent(q, k, v, g, beta, s0, states_out=states)
    o_e, s_e = gr.gated_delta_rule_recurrent(qe, ke, v, g, beta, s0, states_out=states_e)
    assert _same((o, o_e), (s, s_e), (states, states_e))
    o_c, s_c = gr.gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=8)
    o_ce, s_ce = gr.gated_delta_rule_chunked(qe, ke, v, g, beta, s0, chunk_size=8)
    assert _same((o_c, o_ce), (s_c, s_ce))
    assert (o_c - o).abs().max() < 1e-10 and (s_c - s).abs().max() < 1e-10


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)])
def test_grouped_gdn_forward_equals_ungrouped_on_expanded_channels(heads: tuple[int, int]):
    """extend (ragged, with and without initial state) -> verify (scratch) -> decode with ``Hk``
    key heads equals the ungrouped layer (``num_k_heads`` unset) whose q/k channels of
    ``mixed_qkv``, conv weight and conv state are ``repeat_interleave``'d to ``H`` heads."""
    h, hk = heads
    dk, dv, kernel, tv = 3, 2, 4, 3
    gen = _gen(8 + hk)
    dim, dim_e = gr.mixed_qkv_dim(h, dk, dv, hk), gr.mixed_qkv_dim(h, dk, dv)
    assert dim == 2 * hk * dk + h * dv

    def ex(x: torch.Tensor, d: int) -> torch.Tensor:
        return _expand_channels(x, d, h, hk, dk)

    w = torch.randn(dim, kernel, generator=gen, dtype=F64) / 2
    conv = torch.randn(5, dim, kernel - 1, generator=gen, dtype=F64)
    ssm = torch.randn(5, h, dk, dv, generator=gen, dtype=F64) / 2
    conv_e, ssm_e = ex(conv, 1), ssm.clone()
    slots = torch.tensor([3, 0, 4])

    def rows(n: int):
        x = torch.randn(n, dim, generator=gen, dtype=F64)
        return (
            x,
            -torch.rand(n, h, generator=gen, dtype=F64),
            torch.rand(n, h, generator=gen, dtype=F64),
        )

    # extend: 5 tokens from a state, none, 9 tokens without an initial state (> chunk of 4)
    cu = torch.tensor([0, 5, 5, 14])
    init = torch.tensor([True, True, False])
    x, g, beta = rows(14)
    o = gr.gdn_forward("extend", x, w, g, beta, conv, ssm, slots, cu, has_initial_state=init,
                       chunk_size=4, num_k_heads=hk)  # fmt: skip
    o_e = gr.gdn_forward("extend", ex(x, 1), ex(w, 0), g, beta, conv_e, ssm_e, slots, cu,
                         has_initial_state=init, chunk_size=4)  # fmt: skip
    assert _same((o, o_e), (ssm, ssm_e)) and torch.equal(ex(conv, 1), conv_e)
    # verify tv tokens per request into scratch (slots untouched)
    x, g, beta = rows(3 * tv)
    cs, ss = (
        torch.empty(3, tv, dim, kernel - 1, dtype=F64),
        torch.empty(3, tv, h, dk, dv, dtype=F64),
    )
    cs_e, ss_e = torch.empty(3, tv, dim_e, kernel - 1, dtype=F64), torch.empty_like(ss)
    o = gr.gdn_forward("verify", x, w, g, beta, conv, ssm, slots, conv_scratch=cs,
                       ssm_scratch=ss, num_k_heads=hk)  # fmt: skip
    o_e = gr.gdn_forward("verify", ex(x, 1), ex(w, 0), g, beta, conv_e, ssm_e, slots,
                         conv_scratch=cs_e, ssm_scratch=ss_e)  # fmt: skip
    assert _same((o, o_e), (ss, ss_e)) and torch.equal(ex(cs, 2), cs_e)
    assert _same((ssm, ssm_e)) and torch.equal(ex(conv, 1), conv_e)  # not touched
    # decode
    x, g, beta = rows(3)
    o = gr.gdn_forward("decode", x, w, g, beta, conv, ssm, slots, num_k_heads=hk)
    o_e = gr.gdn_forward("decode", ex(x, 1), ex(w, 0), g, beta, conv_e, ssm_e, slots)
    assert _same((o, o_e), (ssm, ssm_e)) and torch.equal(ex(conv, 1), conv_e)
    assert o.shape == (3, h, dv)


def test_grouped_heads_are_validated():
    h, dk, dv = 4, 3, 2
    conv = torch.zeros(2, gr.mixed_qkv_dim(h, dk, dv, 3), 3, dtype=F64)
    ssm = torch.zeros(2, h, dk, dv, dtype=F64)
    x = torch.zeros(2, conv.shape[1], dtype=F64)
    w = torch.zeros(conv.shape[1], 4, dtype=F64)
    gb = torch.zeros(2, h, dtype=F64)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="num_k_heads 3 must divide the number of value heads 4"):
        gr.gdn_forward("decode", x, w, gb, gb, conv, ssm, slots, num_k_heads=3)
    with pytest.raises(ValueError, match=r"conv_dim 26 != 2 \* Hk \* Dk \+ H \* Dv = .* = 20"):
        gr.gdn_forward("decode", x, w, gb, gb, conv, ssm, slots, num_k_heads=2)
    with pytest.raises(ValueError, match="conv_dim 26 != .* = 32"):
        gr.gdn_forward("decode", x, w, gb, gb, conv, ssm, slots)  # Hk defaults to H
    q = torch.zeros(1, 1, 3, dk, dtype=F64)
    v = torch.zeros(1, 1, h, dv, dtype=F64)
    g1 = torch.zeros(1, 1, h, dtype=F64)
    with pytest.raises(ValueError, match="num_k_heads 3 must divide the number of value heads 4"):
        gr.gated_delta_rule_recurrent(q, q, v, g1, g1, ssm[:1])
    with pytest.raises(ValueError, match="num_k_heads 3 must divide"):
        gr.gated_delta_rule_chunked(q, q, v, g1, g1, ssm[:1])
