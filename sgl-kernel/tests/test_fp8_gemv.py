"""The few-row FP8 product (:mod:`unimem_kernel.fp8_gemv`): its in-kernel quantisation gives
the separate launch's e4m3 values, its products match the torch reference (dense, grouped,
gathered, with biases, partial last groups, tail rows), ``fp8_linear`` /
``fp8_grouped_linear`` take it at one dense row or a few expert rows, never under batch
invariance, and it replays in a CUDA graph. Interpreter on the CPU (tiny shapes), the same
tests on CUDA."""

from __future__ import annotations

import importlib

import pytest
import torch
from fp8_operands import assert_product_close, fp8_weights
from kernel_devices import DEVICES

from unimem_kernel.fp8_gemm import (
    FP8_DTYPE,
    fp8_gemm_reference,
    fp8_grouped_linear,
    fp8_linear,
    fp8_quantize_groups_reference,
)
from unimem_kernel.fp8_gemv import (
    MAX_GROUPS,
    TARGET_PROGRAMS,
    Fp8GemvConfig,
    fp8_gemv,
    fp8_gemv_config,
    takes_gemv,
)

CONFIGS = [None, Fp8GemvConfig(4, 1, 1, 1), Fp8GemvConfig(16, 8, 4, 3)]
"""The tile sized by the product, one group a step, and more groups a step than ``K`` has."""


@pytest.mark.parametrize("device", DEVICES)
def test_in_kernel_quantisation_gives_the_separate_launchs_values(device, triton_backend):
    """With a weight that is the identity on one group, the product returns each activation's
    e4m3 value times its scale: the quantisation's values, tiny (subnormal), huge and tied
    ones included, equal the reference quantisation's."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 128, generator=gen) * torch.logspace(-6, 3, 128)  # 9 decades a row
    x[0, :4] = torch.tensor([448.0 * 3, 0.0, -1e-30, 1e-8])
    x[1, 5] = 0.5 + 2**-5  # a tie between two e4m3 values (amax below sets the scale 1)
    x[1] = x[1].clamp(-400, 400)
    x[1, 0] = 448.0
    eye = torch.eye(128).to(FP8_DTYPE)
    ones = torch.ones(128, 1)
    y = fp8_gemv(x.to(dev), eye.to(dev), ones.to(dev), config=Fp8GemvConfig(128, 1, 4, 1))
    q, s = fp8_quantize_groups_reference(x)
    want = q.float() * s  # exact: e4m3 values times a power-of-two-ish scale, in float32
    assert torch.equal(y.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "4x1", "16x8"])
@pytest.mark.parametrize("m", [1, 3])
def test_dense_product_matches_reference(device, config, m, triton_backend):
    gen = torch.Generator().manual_seed(2 + m)
    k, n = 700, 37  # 6 groups, the last partial; a partial last column tile
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    wq, ws = fp8_weights(n, k, gen)
    bias = torch.randn(n, generator=gen).bfloat16()
    dev = torch.device(device)
    for b in (None, bias):
        ref = fp8_gemm_reference(x, None, wq, ws, out_dtype=torch.float32, bias=b)
        y = fp8_gemv(
            x.to(dev), wq.to(dev), ws.to(dev), bias=None if b is None else b.to(dev),
            config=config,
        )  # fmt: skip
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert_product_close(y, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gather", [False, True])
def test_grouped_product_matches_reference(device, gather, triton_backend):
    """Rows by expert (``offs``, an empty expert, tail rows past ``offs[-1]`` left zero),
    optionally gathered, with per-expert biases."""
    gen = torch.Generator().manual_seed(4)
    e, n, k, t = 4, 24, 300, 9
    x = (torch.randn(t, k, generator=gen) * 2).float()
    wq, ws = fp8_weights(n, k, gen, (e,))
    bias = torch.randn(e, n, generator=gen)
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)  # expert 1 empty; rows 7, 8: tail
    rows = torch.randperm(t, generator=gen) if gather else None
    ref = fp8_gemm_reference(
        x, None, wq, ws, out_dtype=torch.float32, bias=bias, offs=offs, rows=rows
    )  # fmt: skip
    dev = torch.device(device)
    y = fp8_gemv(
        x.to(dev), wq.to(dev), ws.to(dev), offs.to(dev),
        None if rows is None else rows.to(dev), bias.to(dev), config=Fp8GemvConfig(8, 2, 2, 2),
    )  # fmt: skip
    assert_product_close(y, ref)
    assert not y[7:].cpu().any()


def test_operand_errors_name_the_operand():
    gen = torch.Generator().manual_seed(5)
    wq, ws = fp8_weights(8, 256, gen)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="x must be"):
        fp8_gemv(x[0], wq, ws)
    with pytest.raises(ValueError, match="weight must be"):
        fp8_gemv(torch.randn(2, 128), wq, ws)
    with pytest.raises(ValueError, match="scales must be"):
        fp8_gemv(x, wq, ws[:, :1])
    with pytest.raises(ValueError, match="offs must be"):
        fp8_gemv(x, wq[None], ws[None], torch.tensor([2]))
    with pytest.raises(ValueError, match="bias must be"):
        fp8_gemv(x, wq, ws, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="BN and G are powers of 2"):
        Fp8GemvConfig.parse("6,2,4,2")
    with pytest.raises(ValueError, match="is not 'BN,G,warps,stages'"):
        Fp8GemvConfig.parse("8,2")


def test_config_is_sized_by_the_product_unless_forced(monkeypatch):
    """``BLOCK_N``: the smallest power of two from 4 to 32 that keeps the programs at most
    TARGET_PROGRAMS; ``GROUPS``: all of K up to MAX_GROUPS; or the forced tile."""
    monkeypatch.delenv("UNIMEM_FP8_GEMV_CONFIG", raising=False)
    assert TARGET_PROGRAMS == 1536 and MAX_GROUPS == 8
    assert fp8_gemv_config(12288, 2048, 1) == Fp8GemvConfig(8, 8, 4, 1)
    assert fp8_gemv_config(2048, 4096, 1) == Fp8GemvConfig(4, 8, 4, 1)
    assert fp8_gemv_config(2048, 512, 1) == Fp8GemvConfig(4, 4, 4, 1)
    assert fp8_gemv_config(2048, 512, 10) == Fp8GemvConfig(16, 4, 4, 1)
    assert fp8_gemv_config(151936, 200, 64) == Fp8GemvConfig(32, 2, 4, 1)
    monkeypatch.setenv("UNIMEM_FP8_GEMV_CONFIG", "16,8,8,3")
    assert fp8_gemv_config(2048, 512, 1) == Fp8GemvConfig(16, 8, 8, 3)
    cfg = Fp8GemvConfig(8, 4, 2, 1)
    assert Fp8GemvConfig.parse(cfg.spec()) == cfg


def test_linears_take_it_by_rows_per_weight_and_never_when_invariant(monkeypatch, triton_backend):
    """``takes_gemv``: at most ``UNIMEM_FP8_GEMV_ROWS`` dense rows or
    ``UNIMEM_FP8_GEMV_PAIRS`` grouped ones, the Triton side in use, not batch-invariant;
    ``fp8_linear`` and ``fp8_grouped_linear`` then call it once (and only it)."""
    x = torch.randn(4, 256)
    monkeypatch.setenv("UNIMEM_FP8_GEMV_ROWS", "2")
    monkeypatch.setenv("UNIMEM_FP8_GEMV_PAIRS", "12")
    assert takes_gemv(x, 2, False, False) and not takes_gemv(x, 3, False, False)
    assert takes_gemv(x, 12, True, False) and not takes_gemv(x, 13, True, False)
    assert not takes_gemv(x, 1, False, True) and not takes_gemv(x, 0, False, False)
    monkeypatch.setenv("UNIMEM_FP8_GEMV_ROWS", "0")
    assert not takes_gemv(x, 1, False, False)
    monkeypatch.setenv("UNIMEM_FP8_GEMV_ROWS", "1")
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "reference")
    assert not takes_gemv(x, 1, False, False)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")

    calls = []
    gemv_module = importlib.import_module("unimem_kernel.fp8_gemv")
    real = gemv_module.fp8_gemv
    monkeypatch.setattr(gemv_module, "fp8_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(6)
    wq, ws = fp8_weights(16, 256, gen)
    gq, gs = fp8_weights(16, 256, gen, (2,))
    offs = torch.tensor([1, 3], dtype=torch.int32)
    y = fp8_linear(x[:1].bfloat16(), wq, ws)
    g = fp8_grouped_linear(x[:3], gq, gs, offs)
    assert len(calls) == 2
    f32 = torch.float32
    assert_product_close(y, fp8_gemm_reference(x[:1].bfloat16(), None, wq, ws, out_dtype=f32))
    assert_product_close(g, fp8_gemm_reference(x[:3], None, gq, gs, out_dtype=f32, offs=offs))
    fp8_linear(x[:1].bfloat16(), wq, ws, invariant=True)
    fp8_linear(x[:2].bfloat16(), wq, ws)  # 2 rows > 1
    fp8_grouped_linear(x.repeat(5, 1), gq, gs, offs)  # 20 rows > 12
    assert len(calls) == 2


@pytest.mark.gpu
def test_gemv_replays_in_a_cuda_graph():
    """Recorded after a first call, replays compute from the current inputs (poisoned
    outputs in between), dense and grouped with a gather, at one and four rows."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    wq, ws = (t.to(dev) for t in fp8_weights(2048, 1024, gen))
    gq, gs = (t.to(dev) for t in fp8_weights(256, 1024, gen, (16,)))
    x = torch.randn(4, 1024, generator=gen).bfloat16().to(dev)
    offs = torch.tensor([0, 1, 1, 2] + [4] * 12, dtype=torch.int32, device=dev)
    rows = torch.tensor([3, 0, 2, 1], device=dev)

    def products():
        return (fp8_gemv(x[:1], wq, ws), fp8_gemv(x, wq, ws), fp8_gemv(x, gq, gs, offs, rows))

    products()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = products()
    for _ in range(2):
        x.copy_((torch.randn(4, 1024, generator=gen) * 3).bfloat16())
        for o in out:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = (
            fp8_gemm_reference(x[:1], None, wq, ws, out_dtype=torch.float32),
            fp8_gemm_reference(x, None, wq, ws, out_dtype=torch.float32),
            fp8_gemm_reference(x, None, gq, gs, out_dtype=torch.float32, offs=offs, rows=rows),
        )
        for got, want, eager in zip(out, ref, products(), strict=True):
            assert_product_close(got, want)
            assert torch.equal(got, eager)
