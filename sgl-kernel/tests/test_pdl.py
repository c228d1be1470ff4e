"""``unimem_kernel.pdl``: programmatic dependent launch changes no result.

CPU: never on there (nor in the interpreter), whatever ``UNIMEM_PDL`` says, nor with a Triton
that lacks the intrinsics. GPU: a chain of a layer's kernels (q/k/v ``norm_linear`` with its
norms, the RoPE + K/V store, the split-KV attention and its combine, ``o_proj``) for decode
steps of 1 and 8 requests and a verify step of 2 x 8 tokens, captured in a CUDA graph with PDL
on and replayed (the successor let in after the last store, or early), gives the bits of the
same chain launched plainly, on fresh random inputs with the outputs poisoned before each
replay.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from unimem_kernel import envs, pdl
from unimem_kernel.kv_store import rope_store_kv
from unimem_kernel.norm_gemv import norm_linear
from unimem_kernel.paged_attention import paged_verify_attention


def test_never_on_the_cpu(monkeypatch):
    for flag in ("1", "early", "0"):
        monkeypatch.setenv("UNIMEM_PDL", flag)
        assert pdl.mode(torch.zeros(1)) == pdl.OFF
    assert pdl.launch_options(pdl.OFF) == {}
    assert pdl.launch_options(pdl.EARLY) == {"launch_pdl": True}


def test_a_triton_without_pdl_turns_the_default_off_and_refuses_a_request(monkeypatch):
    """On an SM90 device (stood in for) with a Triton that lacks the intrinsics: off by
    default, a ValueError naming the version when UNIMEM_PDL asks for it."""
    gpu = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("UNIMEM_PDL", raising=False)
    assert pdl.mode(gpu) == pdl.EARLY or not pdl.triton_supports_pdl()
    monkeypatch.setattr(pdl, "triton_supports_pdl", lambda: False)
    assert pdl.mode(gpu) == pdl.OFF
    monkeypatch.setenv("UNIMEM_PDL", "early")
    with pytest.raises(ValueError, match="UNIMEM_PDL=early needs Triton 3.3"):
        pdl.mode(gpu)
    monkeypatch.setenv("UNIMEM_PDL", "0")
    assert pdl.mode(gpu) == pdl.OFF


def test_the_switch_parses_its_modes(monkeypatch):
    for flag, want in (("early", pdl.EARLY), ("1", pdl.AFTER_STORES), ("on", 1), ("off", 0)):
        monkeypatch.setenv("UNIMEM_PDL", flag)
        assert envs.get("UNIMEM_PDL") == want
    monkeypatch.setenv("UNIMEM_PDL", "late")
    with pytest.raises(ValueError, match="UNIMEM_PDL.*early"):
        envs.get("UNIMEM_PDL")


def _layer_chain(gen, bs=1, ctx=300, q_len=1):
    """Gemma 3 270M's attention half of a layer at ``bs`` requests of ``q_len`` new tokens
    each (1: decode; more: a verify step): inputs and a callable returning ``o_proj``'s
    output (and writing the caches)."""
    dev, bf = "cuda", torch.bfloat16
    d, hq, hkv, hd, page = 640, 4, 1, 256, 64
    t = bs * q_len

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(bf).to(dev)

    x, delta = rnd(t, d), rnd(t, d, scale=3.0)
    w_qkv, w_o = rnd((hq + 2 * hkv) * hd, d, scale=d**-0.5), rnd(d, hq * hd, scale=0.03)
    nw, pw, qw, kw = (rnd(n, scale=0.3) for n in (d, d, hd, hd))
    pages_per = -(-(ctx + q_len) // page)
    kc = rnd(1 + bs * pages_per, page, hkv, hd)
    vc = rnd(1 + bs * pages_per, page, hkv, hd)
    kc[0], vc[0] = 0, 0
    table = (torch.arange(bs * pages_per, dtype=torch.int32) + 1).reshape(bs, pages_per).to(dev)
    seq = torch.full((bs,), ctx + q_len, dtype=torch.int32, device=dev)
    pos = ctx + torch.arange(q_len, device=dev)
    slots = (table[:, pos // page] * page + pos % page).reshape(t).to(torch.int32)
    ang = torch.rand(t, hd // 2, generator=gen).to(dev) * 100
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=dev) * q_len

    def run():
        _, qkv = norm_linear(x, w_qkv, nw, 1e-6, delta=delta, post_weight=pw, zero_centered=True)
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        q = rope_store_kv(q.view(t, hq, hd), k.view(t, hkv, hd), v.view(t, hkv, hd), cos,
                          sin, kc, vc, slots, qk_norm=(qw, kw, 1e-6))  # fmt: skip
        o = paged_verify_attention(q, kc, vc, cu, seq, table, q_len=q_len, max_seqlen_k=32768,
                                   scale=0.0625, window=512, split_size=64,
                                   kv_programs=16)  # fmt: skip
        return norm_linear(o.reshape(t, hq * hd), w_o, None, 1e-6)[1]

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("bs,q_len", [(1, 1), (8, 1), (2, 8)])
def test_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch, bs, q_len):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM90+")
    outs = {}
    for flag in ("0", "1", "early"):
        monkeypatch.setenv("UNIMEM_PDL", flag)
        run = _layer_chain(torch.Generator().manual_seed(bs), bs=bs, q_len=q_len)
        run()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        outs[flag] = out.clone()
    for flag in ("1", "early"):
        assert torch.isfinite(outs[flag]).all()
        assert torch.equal(outs["0"], outs[flag]), flag
