"""``unimem_kernel.paged_attention``: the split-KV paged decode/verify attention against its
torch reference, the reference against a naive per-row softmax, and bitwise pattern
independence.

Caches are strided views into one NaN-poisoned arena (page stride = an envelope larger than
one layer's block, as the pools lay them out): only live key rows hold data, page 0 (the sink)
is zeros, so a read of anything else shows up as NaN. Checked: plain causal, sliding windows,
sinks, ``Dk != Dv``, GQA groups 1, 2, 3 and 4, ``q_len`` 1, 3, 4 and 17 (two row tiles),
contexts up to ~100 keys over several splits per program, a padded lane (``cache_seqlens =
q_len``, a table of zeros: finite zeros out), ``out=``, strided q, bad input; then that a
query row's output is bitwise
the same whatever verify window holds it (windows starting at every offset around it, widths
1, 3 and 4, other ``max_seqlen_k``, other lanes in the batch). CPU runs through the Triton
interpreter (``TRITON_INTERPRET=1``, root conftest; ``UNIMEM_KERNEL_BACKEND=triton``) with
splits of 16 or 32 keys; the ``gpu`` cases run the ``small`` preset's verify (48 requests x 8
rows, 16/4 heads of 128, page 64, ~520 and ~2000 keys, bf16), inside a CUDA graph, and against
FlashAttention-4 when ``flash_attn.cute`` imports.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.paged_attention import (
    paged_verify_attention,
    paged_verify_attention_reference,
)

# ------------------------------------------------------------------ inputs


def arena_caches(pages, page_size, hkv, dk, dv, dtype, device):
    """K and V views into a NaN-poisoned arena (layer-major envelope with spare room); the
    sink page 0 is zeroed."""
    esz = torch.tensor([], dtype=dtype).element_size()
    k_block, v_block = page_size * hkv * dk, page_size * hkv * dv
    envelope = 2 * (k_block + v_block) + 32 // esz  # another layer's blocks would sit here
    arena = torch.full((pages * envelope + 64,), float("nan"), dtype=dtype, device=device)
    k = arena.as_strided((pages, page_size, hkv, dk), (envelope, hkv * dk, dk, 1), 16 // esz)
    v = arena.as_strided(
        (pages, page_size, hkv, dv), (envelope, hkv * dv, dv, 1), 16 // esz + k_block
    )
    k[0] = 0
    v[0] = 0
    return k, v


def make_batch(lens, q_len, *, hq, hkv, dk, dv, page, dtype, device, seed, width=None,
               padded=()):  # fmt: skip
    """A batch of ``len(lens)`` requests, request ``b`` holding ``lens[b]`` keys (random K/V
    in randomly placed pages, every other slot NaN), ``q_len`` query rows each. Lanes in
    ``padded`` are padding: ``cache_seqlens = q_len`` and a table row of zeros."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(lens)
    n_pages = [-(-n // page) for n in lens]
    width = width or max(n_pages) + 1
    pages = 1 + sum(n_pages)
    kc, vc = arena_caches(pages, page, hkv, dk, dv, dtype, device)
    perm = (torch.randperm(pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(bs, width, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    for b, n in enumerate(lens):
        if b in padded:
            seq[b] = q_len
            continue
        for c in range(n_pages[b]):
            pg = perm.pop()
            table[b, c] = pg
            live = min(page, n - c * page)
            kc[pg, :live] = torch.randn(live, hkv, dk, generator=gen).to(dtype).to(device)
            vc[pg, :live] = torch.randn(live, hkv, dv, generator=gen).to(dtype).to(device)
    q = torch.randn(bs * q_len, hq, dk, generator=gen).to(dtype).to(device)
    cu = torch.arange(bs + 1, dtype=torch.int32) * q_len
    return q, kc, vc, cu.to(device), seq.to(device), table.to(device)


def rel_err(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def naive(q, kc, vc, seq, table, q_len, scale, window, sinks):
    """Per (request, query, head): gather the visible keys one by one, float64 softmax."""
    bs = seq.shape[0]
    hq, hkv, page = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.zeros(q.shape[0], hq, vc.shape[3], dtype=torch.float64)
    for b in range(bs):
        n = int(seq[b])
        for i in range(q_len):
            p = n - q_len + i
            keys = [j for j in range(p + 1) if window is None or j > p - window]
            for h in range(hq):
                kv = h // (hq // hkv)
                logits, vals = [], []
                for j in keys:
                    pg, off = int(table[b, j // page]), j % page
                    k = kc[pg, off, kv].double()
                    logits.append(scale * float(q[b * q_len + i, h].double() @ k))
                    vals.append(vc[pg, off, kv].double())
                extra = [float(sinks[h])] if sinks is not None else []
                mx = max(logits + extra)
                den = sum(math.exp(x - mx) for x in logits + extra)
                for x, v in zip(logits, vals, strict=True):
                    out[b * q_len + i, h] += math.exp(x - mx) / den * v
    return out


def call(fn, args, q_len, scale, **kw):
    q, kc, vc, cu, seq, table = args
    return fn(q, kc, vc, cu, seq, table, q_len=q_len, scale=scale, **kw)


# ------------------------------------------------------------------ the reference


@pytest.mark.parametrize("window, use_sinks", [(None, False), (5, True), (None, True)])
def test_reference_matches_naive_softmax(window, use_sinks):
    q_len, hq, hkv = 3, 6, 2
    args = make_batch([13, 7, 3], q_len, hq=hq, hkv=hkv, dk=8, dv=12, page=4,
                      dtype=torch.float64, device="cpu", seed=1, padded=(2,))  # fmt: skip
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(2)) if use_sinks else None
    got = call(paged_verify_attention_reference, args, q_len, 0.3, max_seqlen_k=16,
               window=window, sinks=sinks)  # fmt: skip
    q, kc, vc, _, seq, table = args
    want = naive(q, kc, vc, seq, table, q_len, 0.3, window, sinks)
    assert got.dtype == torch.float64 and got.shape == (9, hq, 12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[6:], torch.zeros_like(got[6:]))  # the padded lane: zeros


# ------------------------------------------------------------------ kernel vs reference

SLOW = pytest.mark.slow
CASES = [
    # lens, q_len, hq, hkv, dk, dv, dtype, window, sinks, split, programs
    pytest.param(([100, 37, 4], 4, 4, 2, 32, 32, torch.float32, None, False, 32, 2), marks=SLOW),
    ([90, 45, 3], 3, 4, 2, 64, 32, torch.float32, 20, True, 16, 4),  # Dk != Dv
    ([77, 16, 1], 1, 6, 2, 32, 32, torch.float32, 7, False, 32, 3),  # decode, group 3
    ([98, 60, 4], 4, 4, 1, 64, 64, torch.bfloat16, None, True, 16, 2),  # group 4
    ([70, 33, 3], 3, 4, 2, 32, 64, torch.float16, 33, False, 16, 8),  # idle programs
    ([60, 41, 17], 17, 2, 2, 32, 32, torch.float32, 25, True, 16, 2),  # 2 row tiles of 16
]  # case 0 is the slow tier (the others reach its paths)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_reference(triton_backend, device, case):
    lens, q_len, hq, hkv, dk, dv, dtype, window, use_sinks, split, programs = case
    args = make_batch(lens, q_len, hq=hq, hkv=hkv, dk=dk, dv=dv, page=16, dtype=dtype,
                      device=device, seed=len(lens) * 7 + q_len, padded=(2,))  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if use_sinks else None
    scale = dk**-0.5
    kw = dict(max_seqlen_k=4096, window=window, sinks=sinks, split_size=split,
              kv_programs=programs)  # fmt: skip
    got = call(paged_verify_attention, args, q_len, scale, **kw)
    q, kc, vc, cu, seq, table = args
    ref_args = (q.float(), kc.float(), vc.float(), cu, seq, table)
    want = call(paged_verify_attention_reference, ref_args, q_len, scale, max_seqlen_k=4096,
                window=window, sinks=sinks)  # fmt: skip
    assert got.dtype == dtype and got.shape == (len(lens) * q_len, hq, dv)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got, want) < tol
    pad = got[2 * q_len : 3 * q_len]
    assert torch.equal(pad, torch.zeros_like(pad))  # the padded lane reads the zero sink


@pytest.mark.parametrize("device", DEVICES)
def test_out_strided_q_and_empty_batch(triton_backend, device):
    q_len, hq = 2, 4
    args = make_batch([40, 21], q_len, hq=hq, hkv=2, dk=32, dv=32, page=16,
                      dtype=torch.float32, device=device, seed=11)  # fmt: skip
    q, kc, vc, cu, seq, table = args
    wide = torch.zeros(q.shape[0], hq, 48, device=device)
    wide[:, :, 8:40] = q
    out = torch.full((q.shape[0], hq, 32), float("nan"), device=device)
    got = paged_verify_attention(wide[:, :, 8:40], kc, vc, cu, seq, table, q_len=q_len,
                                 max_seqlen_k=64, scale=0.2, out=out, split_size=16)  # fmt: skip
    assert got is out
    want = call(paged_verify_attention_reference, args, q_len, 0.2, max_seqlen_k=64)
    assert rel_err(got, want) < 1e-5
    empty = paged_verify_attention(
        q[:0], kc, vc, cu[:1], seq[:0], table[:0], q_len=q_len, max_seqlen_k=64, scale=0.2
    )
    assert empty.shape == (0, hq, 32)


def test_bad_input(triton_backend):
    q_len = 2
    q, kc, vc, cu, seq, table = make_batch([20, 9], q_len, hq=4, hkv=2, dk=16, dv=16,
                                           page=16, dtype=torch.float32, device="cpu",
                                           seed=3)  # fmt: skip
    kw = dict(q_len=q_len, max_seqlen_k=32, scale=0.25)

    def run(*a, **over):
        base = dict(kw)
        base.update(over)
        return paged_verify_attention(*a, **base)

    with pytest.raises(ValueError, match="bs \\* q_len"):
        run(q[:3], kc, vc, cu, seq, table)
    with pytest.raises(ValueError, match="q_len must be"):
        run(q, kc, vc, cu, seq, table, q_len=0)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        run(q, kc, vc, cu, seq, table, max_seqlen_k=None)
    with pytest.raises(ValueError, match="window"):
        run(q, kc, vc, cu, seq, table, window=0)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        run(q, kc, vc, cu, seq.long(), table)
    with pytest.raises(ValueError, match="page_table must be int32"):
        run(q, kc, vc, cu, seq, table.long())
    with pytest.raises(ValueError, match="page_table must be"):
        run(q, kc, vc, cu, seq, table[:1])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        run(q, kc, vc, cu[:2], seq, table)
    with pytest.raises(ValueError, match="dtypes differ"):
        run(q.half(), kc, vc, cu, seq, table)
    with pytest.raises(ValueError, match="head dim"):
        run(q[:, :, :8], kc, vc, cu, seq, table)
    with pytest.raises(ValueError, match="not a multiple of KV heads"):
        run(q[:, :3], kc, vc, cu, seq, table)
    with pytest.raises(ValueError, match="sinks"):
        run(q, kc, vc, cu, seq, table, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="out must be"):
        run(q, kc, vc, cu, seq, table, out=torch.empty(4, 4, 8))
    with pytest.raises(ValueError, match="expected q"):
        run(q[0], kc, vc, cu, seq, table)
    strided = torch.zeros(kc.shape[0], 16, 2, 32)[..., ::2]  # last stride 2
    with pytest.raises(ValueError, match="unit stride"):
        run(q, strided, strided, cu, seq, table)
    with pytest.raises(ValueError, match="power-of-two key block"):
        run(q, kc, vc, cu, seq, table, split_size=48)
    with pytest.raises(ValueError, match="kv_programs"):
        run(q, kc, vc, cu, seq, table, kv_programs=0)
    with pytest.raises(ValueError, match="int32"):
        run(q.int(), strided.int(), strided.int(), cu, seq, table)


# ------------------------------------------------------------------ pattern independence


def pattern_rows(device, *, n_keys, positions, widths, hq, hkv, d, page, dtype, window,
                 sinks, seed, max_seqlens, **kw):  # fmt: skip
    """Output of each query position in ``positions`` from every verify window of each width
    in ``widths`` that holds it (the window's first row at every possible offset), for one
    request whose cache holds keys for all ``n_keys`` positions (later keys are "future"
    rows another window would see; slots past ``n_keys`` are NaN). A second lane with other
    data rides along. Calls cycle through ``max_seqlens`` (0: the window's own length).
    Returns ``{position: [outputs]}``."""
    args = make_batch([n_keys, n_keys // 2 + 3], 1, hq=hq, hkv=hkv, dk=d, dv=d, page=page,
                      dtype=dtype, device=device, seed=seed)  # fmt: skip
    _, kc, vc, _, _, table = args
    gen = torch.Generator().manual_seed(seed + 1)
    q_pos = torch.randn(n_keys, hq, d, generator=gen).to(dtype).to(device)  # q of position p
    q_other = torch.randn(16, hq, d, generator=gen).to(dtype).to(device)
    rows = {p: [] for p in positions}
    calls = 0
    for w in widths:
        for first in range(min(positions) - w + 1, max(positions) + 1):
            seq = torch.tensor([first + w, n_keys // 2 + 3], dtype=torch.int32, device=device)
            q = torch.cat([q_pos[first : first + w], q_other[:w]])
            cu = torch.arange(3, dtype=torch.int32, device=device) * w
            msk = max_seqlens[calls % len(max_seqlens)] or first + w
            o = paged_verify_attention(q, kc, vc, cu, seq, table, q_len=w, max_seqlen_k=msk,
                                       scale=d**-0.5, window=window, sinks=sinks, **kw)  # fmt: skip
            calls += 1
            for i in range(w):
                if first + i in rows:
                    rows[first + i].append(o[i].clone())
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n_keys, first_pos, window, use_sinks, programs, widths",
    [
        pytest.param(80, 46, None, False, 3, (4, 3, 1), marks=SLOW),
        (100, 78, 62, True, 3, (4, 3, 1)),
        pytest.param(80, 46, 30, False, 8, (4, 1), marks=SLOW),
    ],
)
def test_pattern_independence_bitwise(
    triton_backend, device, n_keys, first_pos, window, use_sinks, programs, widths
):
    """Four positions straddling a split boundary (splits of 16): rows of one window see
    different numbers of blocks and splits; each row's bits must not care. Without a window
    (3 programs) program 0 takes splits 0 and 3. With window 62 at 78..81 the tile's first
    visible split moves between windows (0 or 1) while each row sees five splits over three
    programs: the merge order must stay that of the absolute splits. With 8 programs
    ``max_seqlen_k`` clamps them to 4 or leaves 8 (4 idle): the same bits."""
    hq = 4
    sinks = torch.linspace(-1.0, 1.0, hq, device=device) if use_sinks else None
    positions = range(first_pos, first_pos + 4)
    rows = pattern_rows(device, n_keys=n_keys, positions=positions, widths=widths, hq=hq,
                        hkv=2, d=32, page=16, dtype=torch.float32, window=window, sinks=sinks,
                        seed=21, max_seqlens=(2048, 0, 96), split_size=16,
                        kv_programs=programs)  # fmt: skip
    for p, outs in rows.items():
        assert len(outs) == sum(widths)
        assert torch.isfinite(outs[0]).all()
        for i, o in enumerate(outs[1:], 1):
            assert torch.equal(o, outs[0]), f"position {p}: window {i} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_pattern_independence_bitwise_gpu(window):
    """The same at the ``small`` preset's head shapes in bf16 with the default splits:
    positions around the 512-key boundary, verify widths 8 and 4 and decode."""
    sinks = torch.linspace(-2.0, 2.0, 16, device="cuda")
    rows = pattern_rows("cuda", n_keys=600, positions=range(509, 515), widths=(8, 4, 1),
                        hq=16, hkv=4, d=128, page=64, dtype=torch.bfloat16, window=window,
                        sinks=sinks, seed=4, max_seqlens=(32768, 0, 1024))  # fmt: skip
    for p, outs in rows.items():
        for i, o in enumerate(outs[1:], 1):
            assert torch.equal(o, outs[0]), f"position {p}: window {i} differs"


# ------------------------------------------------------------------ GPU: the real size


def real_batch(ctx, *, q_len=8, bs=48, seed=0, finite_tail=False):
    """The ``small`` preset's verify: bs 48, 16/4 heads of 128, page 64, bf16, arena views;
    contexts ``ctx`` +- 16 per request, lane 47 padding."""
    gen = torch.Generator().manual_seed(seed)
    lens = (ctx + torch.randint(-16, 17, (bs,), generator=gen)).tolist()
    args = make_batch(lens, q_len, hq=16, hkv=4, dk=128, dv=128, page=64,
                      dtype=torch.bfloat16, device="cuda", seed=seed, padded=(bs - 1,))  # fmt: skip
    if finite_tail:  # FA4 loads whole pages: rows past a request's length must be finite
        _, kc, vc, *_ = args
        kc.nan_to_num_(0.0)
        vc.nan_to_num_(0.0)
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [520, 2000])
@pytest.mark.parametrize("window, use_sinks", [(None, False), (512, True)])
@pytest.mark.parametrize("q_len", [8, 1])
def test_gpu_real_size(ctx, window, use_sinks, q_len):
    args = real_batch(ctx, q_len=q_len, seed=ctx)
    sinks = torch.randn(16, device="cuda") if use_sinks else None
    kw = dict(max_seqlen_k=32768, window=window, sinks=sinks)
    got = call(paged_verify_attention, args, q_len, 128**-0.5, **kw)
    q, kc, vc, cu, seq, table = args
    want = call(paged_verify_attention_reference, (q.float(), kc.float(), vc.float(), cu, seq,
                table), q_len, 128**-0.5, **kw)  # fmt: skip
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2
    pad = got[47 * q_len :]
    assert torch.equal(pad, torch.zeros_like(pad))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Captured once, replayed after the lengths and tables change on the device."""
    args = real_batch(520, seed=1)
    q, kc, vc, cu, seq, table = args
    run = lambda: paged_verify_attention(
        q, kc, vc, cu, seq, table, q_len=8, max_seqlen_k=32768, scale=128**-0.5, window=512
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    seq[:47].sub_(24)  # shorter requests, the same pages (lane 47 stays padding)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [520, 2000])
@pytest.mark.parametrize("window, use_sinks", [(None, False), (512, True)])
def test_gpu_matches_fa4(ctx, window, use_sinks):
    fa4 = pytest.importorskip("flash_attn.cute")
    q_len = 8
    args = real_batch(ctx, q_len=q_len, seed=ctx + 1, finite_tail=True)
    q, kc, vc, cu, seq, table = args
    sinks = torch.randn(16, device="cuda") if use_sinks else None
    extra = {} if sinks is None else {"learnable_sink": sinks}
    left = None if window is None else window - 1
    res = fa4.flash_attn_varlen_func(
        q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=q_len, max_seqlen_k=table.shape[1] * 64,
        seqused_k=seq, page_table=table, softmax_scale=128**-0.5, causal=True,
        window_size=(left, None if left is None else 0), num_splits=1, pack_gqa=None, **extra,
    )  # fmt: skip
    want = res[0] if isinstance(res, tuple) else res
    got = call(paged_verify_attention, args, q_len, 128**-0.5, max_seqlen_k=32768,
               window=window, sinks=sinks)  # fmt: skip
    assert rel_err(got, want) < 1e-2
