"""``unimem_kernel.paged_rope_attention``: the q/k norms, RoPE and K/V store folded into the
split-KV attention, against ``rope_store_kv`` followed by ``paged_verify_attention`` (the op's
reference) on twin caches.

The new tokens' cache rows are NaN before the call, so an attention that read a key before its
program stored it shows NaN. Checked: decode and verify widths, new tokens across a split
boundary, GQA groups 1 / 2 / 4, full and partial rotary, the q/k norms, a window, sinks, a
padded lane (slots in the sink), a verify row redirected to the sink (its position then reads
what the cache holds, as in the two ops), fp32 / bf16 / fp16, and the fallback to the two ops
where a request needs two query tiles. Without the norms the output and the caches equal the
two ops' bit for bit; with them within an ulp of ``rstd``. CPU cases run the Triton
interpreter; the ``gpu`` cases run Gemma 3's decode (4 / 1 heads of 256, window 512, page
64) and a verify of 8 rows, eagerly and replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES
from test_paged_attention import make_batch, rel_err

from unimem_kernel.rope_attention import (
    paged_rope_attention,
    paged_rope_attention_reference,
)


def rope_inputs(lens, q_len, *, hq, hkv, d, dv, half, page, dtype, device, seed, norm,
                padded=(), to_sink=()):  # fmt: skip
    """Twin batches (caches, tables) with the new tokens' rows poisoned, the step's raw q / k
    / v, cos / sin of the positions (``half`` rotary pairs), the write slots (the table's,
    the sink for padded lanes and for the tokens in ``to_sink``) and the norm weights."""
    twins = [
        make_batch(
            lens,
            q_len,
            hq=hq,
            hkv=hkv,
            dk=d,
            dv=dv,
            page=page,
            dtype=dtype,
            device=device,
            seed=seed,
            padded=padded,
        )  # fmt: skip
        for _ in range(2)
    ]
    _, _, _, cu, seq, table = twins[0]
    gen = torch.Generator().manual_seed(seed + 1)
    bs, t = len(lens), len(lens) * q_len
    slots = torch.zeros(t, dtype=torch.int32)
    pos = torch.zeros(t, dtype=torch.int64)
    for b in range(bs):
        for i in range(q_len):
            p = int(seq[b]) - q_len + i
            pos[b * q_len + i] = p
            if b in padded or b * q_len + i in to_sink:  # a sink slot: the row keeps its data
                continue
            slots[b * q_len + i] = int(table[b, p // page]) * page + p % page
            for _, kc, vc, *_ in twins:  # the rows the step writes: NaN until it does
                kc[int(table[b, p // page]), p % page] = float("nan")
                vc[int(table[b, p // page]), p % page] = float("nan")
    q = torch.randn(t, hq, d, generator=gen).to(dtype).to(device)
    k = (torch.randn(t, hkv, d, generator=gen) * 2).to(dtype).to(device)
    v = torch.randn(t, hkv, dv, generator=gen).to(dtype).to(device)
    inv = 1e4 ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos.double()[:, None] * inv[None, :]
    rdt = torch.float32 if dtype == torch.float32 else dtype
    cos, sin = ang.cos().to(rdt).to(device), ang.sin().to(rdt).to(device)
    qk_norm = None
    if norm:
        w = (torch.randn(2, d, generator=gen) * 0.3).to(dtype).to(device)
        qk_norm = (w[0], w[1], 1e-6)
    step = (q, k, v, cos, sin)
    return twins, step, slots.to(device), qk_norm


def run(fn, twin, step, slots, qk_norm, q_len, **kw):
    q, k, v, cos, sin = step
    _, kc, vc, cu, seq, table = twin
    return fn(q, k, v, cos, sin, kc, vc, slots, cu, seq, table, q_len=q_len, qk_norm=qk_norm,
              **kw)  # fmt: skip


def same(a, b) -> bool:
    """Bitwise equal, NaN where the other is NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a), torch.nan_to_num(b)
    )


CASES = [
    # lens, q_len, hq, hkv, d, dv, half, dtype, window, sinks, norm, split, programs, to_sink
    ([40, 17, 1], 1, 4, 1, 32, 32, 16, torch.float32, None, False, True, 16, 4, ()),
    ([40, 17, 1], 1, 4, 1, 32, 32, 16, torch.float32, 12, False, False, 16, 4, ()),
    ([34, 21, 4], 4, 4, 2, 32, 16, 8, torch.bfloat16, 20, True, False, 16, 3, (1,)),
    ([34, 26, 3], 3, 2, 2, 16, 16, 8, torch.float16, None, False, True, 16, 2, ()),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_the_two_ops(triton_backend, device, case):
    lens, q_len, hq, hkv, d, dv, half, dtype, window, use_sinks, norm, split, progs, sink = case
    twins, step, slots, qk_norm = rope_inputs(
        lens, q_len, hq=hq, hkv=hkv, d=d, dv=dv, half=half, page=8, dtype=dtype, device=device,
        seed=len(lens) + 3 * q_len + d, norm=norm, padded=(2,), to_sink=sink,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if use_sinks else None
    kw = dict(max_seqlen_k=4096, scale=d**-0.5, window=window, sinks=sinks, split_size=split,
              kv_programs=progs)  # fmt: skip
    got = run(paged_rope_attention, twins[0], step, slots, qk_norm, q_len, **kw)
    want = run(paged_rope_attention_reference, twins[1], step, slots, qk_norm, q_len, **kw)
    assert torch.isfinite(got).all()  # no program read a new key before it was stored
    (_, kc, vc, *_), (_, kc_ref, vc_ref, *_) = twins
    assert same(vc, vc_ref)
    if norm:
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
        live = ~torch.isnan(kc_ref)
        assert torch.equal(live, ~torch.isnan(kc))
        torch.testing.assert_close(kc[live], kc_ref[live], rtol=1e-2, atol=1e-5)
    else:  # the same bits as the two ops
        assert same(kc, kc_ref)
        assert torch.equal(got, want)
    pad = got[2 * q_len : 3 * q_len]
    assert torch.equal(pad, torch.zeros_like(pad))


def test_two_query_tiles_fall_back(triton_backend, monkeypatch):
    """q_len 17 at a GQA group of 1: two query tiles per request, so the two ops run."""
    import unimem_kernel.rope_attention as pra

    twins, step, slots, qk_norm = rope_inputs(
        [40, 30], 17, hq=2, hkv=2, d=16, dv=16, half=8, page=8, dtype=torch.float32,
        device="cpu", seed=4, norm=True,
    )  # fmt: skip

    def fused(*a, **k):
        raise AssertionError("the fused launch ran with two query tiles")

    monkeypatch.setattr(pra, "launch_split_kv", fused)
    kw = dict(max_seqlen_k=64, scale=0.25, split_size=16, kv_programs=2)
    got = run(paged_rope_attention, twins[0], step, slots, qk_norm, 17, **kw)
    want = run(paged_rope_attention_reference, twins[1], step, slots, qk_norm, 17, **kw)
    assert torch.equal(got, want)


def test_bad_input(triton_backend):
    twins, (q, k, v, cos, sin), slots, _ = rope_inputs(
        [20, 9], 2, hq=4, hkv=2, d=16, dv=16, half=8, page=8, dtype=torch.float32,
        device="cpu", seed=3, norm=False,
    )  # fmt: skip
    _, kc, vc, cu, seq, table = twins[0]
    kw = dict(q_len=2, max_seqlen_k=32, scale=0.25)
    with pytest.raises(ValueError, match="cos"):
        paged_rope_attention(q, k, v, cos[:, :3], sin, kc, vc, slots, cu, seq, table, **kw)
    with pytest.raises(ValueError, match="q_len"):
        paged_rope_attention(q, k, v, cos, sin, kc, vc, slots, cu, seq, table, q_len=3,
                             max_seqlen_k=32, scale=0.25)  # fmt: skip
    with pytest.raises(ValueError, match="norm weight"):
        paged_rope_attention(q, k, v, cos, sin, kc, vc, slots, cu, seq, table,
                             qk_norm=(q[0, 0, :4], q[0, 0], 1e-6), **kw)  # fmt: skip


GPU_CASES = [
    # bs, q_len, hq, hkv, d, window, norm: Gemma 3's decode; a Qwen-like verify
    (1, 1, 4, 1, 256, 512, True),
    (8, 1, 4, 1, 256, 512, True),
    (8, 1, 4, 1, 256, None, False),
    (16, 8, 16, 4, 128, None, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_the_two_ops_in_a_graph(case):
    bs, q_len, hq, hkv, d, window, norm = case
    gen = torch.Generator().manual_seed(bs + d)
    lens = (300 + torch.randint(-200, 200, (bs,), generator=gen)).tolist()
    twins, step, slots, qk_norm = rope_inputs(
        lens, q_len, hq=hq, hkv=hkv, d=d, dv=d, half=d // 2, page=64, dtype=torch.bfloat16,
        device="cuda", seed=bs, norm=norm,
    )  # fmt: skip
    from unimem.attention.fa4_backend import split_kv_keys, split_kv_programs

    kw = dict(max_seqlen_k=32768, scale=d**-0.5, window=window, split_size=split_kv_keys(d),
              kv_programs=split_kv_programs(bs, hkv))  # fmt: skip
    want = run(paged_rope_attention_reference, twins[1], step, slots, qk_norm, q_len, **kw)
    got = run(paged_rope_attention, twins[0], step, slots, qk_norm, q_len, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    if norm:
        assert rel_err(got, want) < 1e-2
    else:
        assert torch.equal(got, want)
        assert same(twins[0][1], twins[1][1])
    assert same(twins[0][2], twins[1][2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(paged_rope_attention, twins[0], step, slots, qk_norm, q_len, **kw)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
