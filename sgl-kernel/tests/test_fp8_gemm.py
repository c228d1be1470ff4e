"""FP8 block-scaled GEMMs (:mod:`unimem_kernel.fp8_gemm`): the Triton kernels against their
torch references (interpreter on the CPU, tiny shapes; the same tests on CUDA), the reference
against the dequantised float64 product, and row independence of the invariant tile."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.fp8_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8GemmConfig,
    fp8_gemm,
    fp8_gemm_config,
    fp8_gemm_reference,
    fp8_grouped_linear,
    fp8_linear,
    fp8_quantize_groups,
    fp8_quantize_groups_reference,
    num_groups,
)


def _weights(n: int, k: int, gen: torch.Generator, lead: tuple[int, ...] = ()):
    w = torch.randn(*lead, n, k, generator=gen) / k**0.5
    kg = num_groups(k)
    pad = torch.zeros(*lead, n, kg * 128)
    pad[..., :k] = w
    s = pad.view(*lead, n, kg, 128).abs().amax(-1) / FP8_MAX
    q = (pad.view(*lead, n, kg, 128) / s[..., None]).view(*lead, n, kg * 128)[..., :k]
    return q.to(FP8_DTYPE), s.float()


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    k = q.shape[-1]
    return q.double() * s.double().repeat_interleave(128, dim=-1)[..., :k]


def _kernel_quantized(x: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantised by the kernel under test (on the CPU): the GEMM tests compare the
    GEMM alone against the reference on the same e4m3 operands (the quantisation itself is
    compared bit for bit by the test below), so an activation rounding the other way never
    hides, or excuses, a GEMM difference."""
    q, s = fp8_quantize_groups(x.to(device))
    return q.cpu(), s.cpu()


def _assert_gemm_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel's product against the float32 reference on the same operands: only the
    order (and, on tensor cores, the precision) of the float32 accumulation differs, plus one
    rounding to ``y``'s dtype (one bf16 ulp: the interpreter's cast truncates)."""
    rtol = 2**-7 if y.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.cpu().float(), ref, rtol=rtol, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_groups_kernel_matches_reference(device, triton_backend):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 200, generator=gen) * 3).bfloat16()
    x[1, 128:] = 0  # an all-zero partial group
    q, s = fp8_quantize_groups(x.to(device))
    rq, rs = fp8_quantize_groups_reference(x)
    assert q.dtype == FP8_DTYPE and q.shape == (5, 200) and s.shape == (5, 2)
    torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0)
    assert torch.equal(q.cpu().float(), rq.float())
    # the largest |value| of each group maps to +-448; dequantised within e4m3's half ulp
    deq = _dequant(rq, rs)
    assert torch.allclose(deq, x.double(), rtol=2**-4, atol=1e-30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 7, 40])
def test_dense_gemm_kernel_matches_reference(device, m, triton_backend):
    gen = torch.Generator().manual_seed(1)
    k, n = 200, 72  # a partial K group and a partial column tile
    x = torch.randn(m, k, generator=gen).bfloat16()
    wq, ws = _weights(n, k, gen)
    bias = torch.randn(n, generator=gen).bfloat16()
    y = fp8_linear(x.to(device), wq.to(device), ws.to(device), bias.to(device))
    xq, xs = _kernel_quantized(x, device)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32, bias=bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _assert_gemm_close(y, ref)
    y32 = fp8_gemm(
        xq.to(device), xs.to(device), wq.to(device), ws.to(device), out_dtype=torch.float32,
        bias=bias.to(device),
    )  # fmt: skip
    _assert_gemm_close(y32, ref)


def test_reference_is_the_dequantised_product():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 300, generator=gen)
    wq, ws = _weights(40, 300, gen)
    xq, xs = fp8_quantize_groups_reference(x)
    y = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32)
    exact = _dequant(xq, xs) @ _dequant(wq, ws).t()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    # and close to the unquantised product (e4m3: ~2^-4 relative per operand)
    full = x.double() @ _dequant(wq, ws).t()
    assert (y.double() - full).abs().max() < 0.1 * full.abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize(
    "ends, t",
    [
        ([4, 4, 9], 11),  # expert 1 empty, rows 9.. the tail
        ([0] * 20 + [1] * 7 + [3] * 13, 3),  # decode-like: 40 experts, 3 rows, 2 experts used
    ],
)
def test_grouped_gemm_kernel_matches_reference(device, gather, ends, t, triton_backend):
    gen = torch.Generator().manual_seed(3)
    e, k, n = len(ends), 160, 48
    x = torch.randn(t, k, generator=gen).bfloat16()
    wq, ws = _weights(n, k, gen, (e,))
    offs = torch.tensor(ends, dtype=torch.int32)
    rows = torch.randperm(t, generator=gen) if gather else None
    dev = torch.device(device)
    y = fp8_grouped_linear(
        x.to(dev), wq.to(dev), ws.to(dev), offs.to(dev), None if rows is None else rows.to(dev)
    )
    xq, xs = _kernel_quantized(x, device)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32, offs=offs, rows=rows)
    assert y.shape == (t, n)
    _assert_gemm_close(y, ref)
    assert torch.all(y[ends[-1] :] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_tile_rows_do_not_depend_on_the_batch(device, triton_backend):
    gen = torch.Generator().manual_seed(4)
    k, n = 256, 64
    x = torch.randn(70, k, generator=gen).bfloat16().to(device)
    wq, ws = (t.to(device) for t in _weights(n, k, gen))
    full = fp8_linear(x, wq, ws, invariant=True)
    for rows in (slice(0, 1), slice(3, 9), slice(33, 70)):
        part = fp8_linear(x[rows], wq, ws, invariant=True)
        assert torch.equal(part, full[rows])


def test_shape_errors_name_the_operand():
    gen = torch.Generator().manual_seed(5)
    wq, ws = _weights(8, 128, gen)
    xq, xs = fp8_quantize_groups_reference(torch.randn(2, 64))
    with pytest.raises(ValueError, match="fp8 weight must be"):
        fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32)
    xq, xs = fp8_quantize_groups_reference(torch.randn(2, 128))
    with pytest.raises(ValueError, match="scales must be"):
        fp8_gemm(xq, xs, wq, ws[:, :0], out_dtype=torch.float32)


@pytest.mark.gpu
def test_fp8_linear_and_grouped_replay_in_a_cuda_graph():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(6)
    wq, ws = (t.to(dev) for t in _weights(256, 512, gen))
    gq, gs = (t.to(dev) for t in _weights(128, 512, gen, (4,)))
    x = torch.randn(48, 512, generator=gen).bfloat16().to(dev)
    offs = torch.tensor([10, 20, 30, 48], dtype=torch.int32, device=dev)
    rows = torch.randperm(48, generator=gen).to(dev)
    eager = (fp8_linear(x, wq, ws), fp8_grouped_linear(x, gq, gs, offs, rows))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        fp8_linear(x, wq, ws), fp8_grouped_linear(x, gq, gs, offs, rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (fp8_linear(x, wq, ws), fp8_grouped_linear(x, gq, gs, offs, rows))
    x.copy_(torch.randn(48, 512, generator=gen).bfloat16().to(dev))
    graph.replay()
    torch.cuda.synchronize()
    again = (fp8_linear(x, wq, ws), fp8_grouped_linear(x, gq, gs, offs, rows))
    for a, b in zip(out, again, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(out[0], eager[0])


@pytest.mark.gpu
def test_fused_activation_quantization_gives_the_same_bits(monkeypatch):
    """UNIMEM_FP8_ACT_QUANT=fused (the GEMM quantises the activations in its loads) gives
    the bits of the separate quantisation launch, dense and grouped."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    wq, ws = (t.to(dev) for t in _weights(200, 384, gen))
    gq, gs = (t.to(dev) for t in _weights(96, 384, gen, (3,)))
    x = (torch.randn(37, 384, generator=gen) * 4).bfloat16().to(dev)
    offs = torch.tensor([5, 5, 30], dtype=torch.int32, device=dev)
    rows = torch.randperm(37, generator=gen).to(dev)
    monkeypatch.setenv("UNIMEM_FP8_ACT_QUANT", "separate")
    sep = (fp8_linear(x, wq, ws), fp8_grouped_linear(x, gq, gs, offs, rows))
    monkeypatch.setenv("UNIMEM_FP8_ACT_QUANT", "fused")
    fused = (fp8_linear(x, wq, ws), fp8_grouped_linear(x, gq, gs, offs, rows))
    for a, b in zip(sep, fused, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["16x32,4,2,3", "64x64,4,3,1", "16x16,4,2,0"])
def test_forced_tiles_and_split_k_match_reference(device, spec, triton_backend, monkeypatch):
    """Any tile (``UNIMEM_FP8_GEMM_CONFIG``), with split-K summing runs of groups in a second
    launch (a partial last run, bias added once), gives the reference's product."""
    monkeypatch.setenv("UNIMEM_FP8_GEMM_CONFIG", spec)
    gen = torch.Generator().manual_seed(8)
    k, n, m = 900, 40, 5  # 8 groups in 3 runs of 3, 3, 2 (the last group partial)
    x = torch.randn(m, k, generator=gen).bfloat16()
    wq, ws = _weights(n, k, gen)
    bias = torch.randn(n, generator=gen).bfloat16()
    xq, xs = _kernel_quantized(x, device)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32, bias=bias)
    dev = torch.device(device)
    y = fp8_gemm(
        xq.to(dev), xs.to(dev), wq.to(dev), ws.to(dev), out_dtype=torch.float32,
        bias=bias.to(dev),
    )  # fmt: skip
    _assert_gemm_close(y, ref)


def test_gemm_config_spec_round_trips_and_bad_specs_are_named(monkeypatch):
    cfg = Fp8GemmConfig.parse("32x128,4,3,2")
    assert cfg == Fp8GemmConfig(32, 128, 4, 3, 2) and Fp8GemmConfig.parse(cfg.spec()) == cfg
    for bad in ("32x128,4,3", "48x64,4,3,1", "32x64,4,3,-1"):
        with pytest.raises(ValueError, match="fp8 GEMM config"):
            Fp8GemmConfig.parse(bad)
    monkeypatch.setenv("UNIMEM_FP8_GEMM_CONFIG", "32x128,4,3,2")
    assert fp8_gemm_config(300) == cfg
    assert fp8_gemm_config(300, invariant=True).split_k == 1


def test_quantisation_is_a_multiply_by_the_ieee_reciprocal():
    """``q = x * (448 / a)`` and ``s = a / 448`` with ``a`` the group's amax, both IEEE
    divisions of float32 (so any device's torch and the kernels agree bit for bit)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 256, generator=gen) * 7
    q, s = fp8_quantize_groups_reference(x)
    a = x.view(3, 2, 128).abs().amax(-1)
    assert torch.equal(s, (a.double() / 448).float())
    inv = (448 / a.double()).float()
    want = (x.view(3, 2, 128) * inv[..., None]).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(q.float(), want.view(3, 256).float())
