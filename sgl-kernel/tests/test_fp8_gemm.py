"""FP8 block-scaled GEMMs (:mod:`unimem_kernel.fp8_gemm`): the Triton kernels against their
torch references (interpreter on the CPU, tiny shapes; the same tests on CUDA), the reference
against the dequantised float64 product, and row independence of the invariant tile."""

from __future__ import annotations

import pytest
import torch
from fp8_operands import assert_product_close, fp8_weights
from kernel_devices import DEVICES

from unimem_kernel.fp8_gemm import (
    FP8_DTYPE,
    LT_MIN_N,
    LT_MIN_ROWS,
    LT_WIDE_MIN_ROWS,
    LT_WIDE_N,
    Fp8GemmConfig,
    collapse_block_scales,
    device_capability,
    expand_block_scales,
    fp8_gemm,
    fp8_gemm_config,
    fp8_gemm_lt,
    fp8_gemm_reference,
    fp8_grouped_linear,
    fp8_linear,
    fp8_quantize_groups,
    fp8_quantize_groups_reference,
    nearest_swept_config,
    quantize_blocks,
    use_lt,
)


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
    wq, ws = fp8_weights(n, k, gen)
    bias = torch.randn(n, generator=gen).bfloat16()
    y = fp8_linear(x.to(device), wq.to(device), ws.to(device), bias.to(device))
    xq, xs = _kernel_quantized(x, device)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32, bias=bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert_product_close(y, ref)
    y32 = fp8_gemm(
        xq.to(device), xs.to(device), wq.to(device), ws.to(device), out_dtype=torch.float32,
        bias=bias.to(device),
    )  # fmt: skip
    assert_product_close(y32, ref)


def test_reference_is_the_dequantised_product():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 300, generator=gen)
    wq, ws = fp8_weights(40, 300, gen)
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
    wq, ws = fp8_weights(n, k, gen, (e,))
    offs = torch.tensor(ends, dtype=torch.int32)
    rows = torch.randperm(t, generator=gen) if gather else None
    dev = torch.device(device)
    y = fp8_grouped_linear(
        x.to(dev), wq.to(dev), ws.to(dev), offs.to(dev), None if rows is None else rows.to(dev)
    )
    xq, xs = _kernel_quantized(x, device)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32, offs=offs, rows=rows)
    assert y.shape == (t, n)
    assert_product_close(y, ref)
    assert torch.all(y[ends[-1] :] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_tile_rows_do_not_depend_on_the_batch(device, triton_backend):
    gen = torch.Generator().manual_seed(4)
    k, n = 256, 64
    x = torch.randn(70, k, generator=gen).bfloat16().to(device)
    wq, ws = (t.to(device) for t in fp8_weights(n, k, gen))
    full = fp8_linear(x, wq, ws, invariant=True)
    for rows in (slice(0, 1), slice(3, 9), slice(33, 70)):
        part = fp8_linear(x[rows], wq, ws, invariant=True)
        assert torch.equal(part, full[rows])


def test_shape_errors_name_the_operand():
    gen = torch.Generator().manual_seed(5)
    wq, ws = fp8_weights(8, 128, gen)
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
    wq, ws = (t.to(dev) for t in fp8_weights(256, 512, gen))
    gq, gs = (t.to(dev) for t in fp8_weights(128, 512, gen, (4,)))
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
    wq, ws = (t.to(dev) for t in fp8_weights(200, 384, gen))
    gq, gs = (t.to(dev) for t in fp8_weights(96, 384, gen, (3,)))
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
    wq, ws = fp8_weights(n, k, gen)
    bias = torch.randn(n, generator=gen).bfloat16()
    xq, xs = _kernel_quantized(x, device)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32, bias=bias)
    dev = torch.device(device)
    y = fp8_gemm(
        xq.to(dev), xs.to(dev), wq.to(dev), ws.to(dev), out_dtype=torch.float32,
        bias=bias.to(dev),
    )  # fmt: skip
    assert_product_close(y, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["16x32,4,2,3", "16x16,4,2,8"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_split_k_sum_in_the_kernel_equals_the_second_launch(
    device, spec, with_bias, triton_backend, monkeypatch
):
    """Split-K's ordered sum by the tile's last program (``UNIMEM_FP8_SPLIT_SUM=kernel``)
    gives the second launch's bits (``separate``), bias added once, at bf16 and float32
    outputs; its arrival counters are back at zero after each product, so products in a row
    (and, on CUDA, a CUDA graph's replays on fresh inputs) stay right."""
    from unimem_kernel.fp8_gemm import tile_counters

    monkeypatch.setenv("UNIMEM_FP8_GEMM_CONFIG", spec)
    gen = torch.Generator().manual_seed(11)
    k, n, m = 1100, 72, 3  # 9 groups: 3 runs of 3, or 8 runs (the last of one partial group)
    dev = torch.device(device)
    wq, ws = (t.to(dev) for t in fp8_weights(n, k, gen))
    bias = torch.randn(n, generator=gen).bfloat16().to(dev) if with_bias else None

    def product(x, out_dtype, mode):
        monkeypatch.setenv("UNIMEM_FP8_SPLIT_SUM", mode)
        xq, xs = fp8_quantize_groups(x)
        return fp8_gemm(xq, xs, wq, ws, out_dtype=out_dtype, bias=bias)

    for out_dtype in (torch.bfloat16, torch.float32):
        for _ in range(2):
            x = (torch.randn(m, k, generator=gen) * 3).bfloat16().to(dev)
            want = product(x, out_dtype, "separate")
            got = product(x, out_dtype, "kernel")
            assert torch.equal(got, want)
            assert torch.equal(product(x, out_dtype, "auto"), want)
            assert torch.isfinite(got).all() and got.abs().sum() > 0
            assert not tile_counters(dev, 1).any()
    if dev.type == "cuda":
        monkeypatch.setenv("UNIMEM_FP8_SPLIT_SUM", "kernel")
        static = (torch.randn(m, k, generator=gen) * 3).bfloat16().to(dev)
        product(static, torch.bfloat16, "kernel")  # compiled, counters made, before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = product(static, torch.bfloat16, "kernel")
        for _ in range(3):
            x = (torch.randn(m, k, generator=gen) * 3).bfloat16().to(dev)
            static.copy_(x)
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, product(x, torch.bfloat16, "separate"))
        assert not tile_counters(dev, 1).any()


def test_tile_counters_grow_and_keep_what_graphs_may_hold():
    """One zeroed counter buffer per device, grown (never shrunk) when a product has more
    tiles; a replaced buffer stays alive (a CUDA graph captured with it still reads it)."""
    from unimem_kernel.fp8_gemm import _kept, tile_counters

    dev = torch.device("cpu")
    first = tile_counters(dev, 16)
    assert first is not None and first.dtype == torch.int32 and not first.any()
    assert tile_counters(dev, first.numel()) is first
    grown = tile_counters(dev, first.numel() + 1)
    assert grown.numel() >= 2 * first.numel() and not grown.any()
    assert any(k is first for k in _kept)
    assert tile_counters(dev, 1) is grown


def test_split_sum_auto_sums_in_the_kernel_from_its_measured_run_count(monkeypatch):
    from unimem_kernel.fp8_gemm import SPLIT_SUM_MIN_RUNS, _sums_in_kernel

    monkeypatch.delenv("UNIMEM_FP8_SPLIT_SUM", raising=False)  # auto
    assert SPLIT_SUM_MIN_RUNS == 8
    assert _sums_in_kernel(8) and not _sums_in_kernel(7) and not _sums_in_kernel(2)
    monkeypatch.setenv("UNIMEM_FP8_SPLIT_SUM", "kernel")
    assert _sums_in_kernel(2)
    monkeypatch.setenv("UNIMEM_FP8_SPLIT_SUM", "separate")
    assert not _sums_in_kernel(8)


def test_gemm_config_spec_round_trips_and_bad_specs_are_named(monkeypatch):
    cfg = Fp8GemmConfig.parse("32x128,4,3,2")
    assert cfg == Fp8GemmConfig(32, 128, 4, 3, 2) and Fp8GemmConfig.parse(cfg.spec()) == cfg
    for bad in ("32x128,4,3", "48x64,4,3,1", "32x64,4,3,-1"):
        with pytest.raises(ValueError, match="fp8 GEMM config"):
            Fp8GemmConfig.parse(bad)
    monkeypatch.setenv("UNIMEM_FP8_GEMM_CONFIG", "32x128,4,3,2")
    assert fp8_gemm_config(300) == cfg
    assert fp8_gemm_config(300, invariant=True).split_k == 1


def test_row_counts_between_swept_ones_take_the_nearest_swept_tile_on_a_log_scale():
    a, b, c = (Fp8GemmConfig.parse(x) for x in ("16x32,4,4,4", "64x32,4,3,1", "64x256,8,3,1"))
    swept = [(16, a), (48, b), (384, c)]
    # switches at sqrt(16 * 48) = 27.7 and sqrt(48 * 384) = 135.8; above 384 the defaults
    rows = (0, 1, 16, 27, 28, 64, 128, 135, 136, 256, 384, 385, 8192)
    picks = {r: nearest_swept_config(swept, r) for r in rows}
    assert picks == {
        0: a, 1: a, 16: a, 27: a, 28: b, 64: b, 128: b, 135: b, 136: c, 256: c, 384: c,
        385: None, 8192: None,
    }  # fmt: skip
    assert nearest_swept_config([(48, b)], 20) == b


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


# ------------------------------------------------------------------- cuBLASLt dispatch

_LT_YES = dict(rows=384, n=3072, k=2048)
"""A product :func:`use_lt` sends to cuBLASLt on SM90 (the verify step's qkv at 48 x 8 rows)."""


def _lt(**kw) -> bool:
    args = {**_LT_YES, "invariant": False, "capability": (9, 0), "has_blocks": True, **kw}
    rows, n, k = args.pop("rows"), args.pop("n"), args.pop("k")
    return use_lt(rows, n, k, **args)


def test_use_lt_says_yes_only_when_every_condition_holds(monkeypatch):
    monkeypatch.delenv("UNIMEM_FP8_LT_MIN_ROWS", raising=False)
    assert _lt() and _lt(out_dtype=torch.float16)
    assert _lt(rows=LT_MIN_ROWS) and not _lt(rows=LT_MIN_ROWS - 4)
    # by shape: wide weights from fewer rows, narrow ones never
    assert _lt(rows=LT_WIDE_MIN_ROWS, n=LT_WIDE_N) and not _lt(rows=LT_WIDE_MIN_ROWS - 4, n=8224)
    assert not _lt(rows=LT_WIDE_MIN_ROWS, n=LT_WIDE_N - 16)
    assert _lt(n=LT_MIN_N) and not _lt(n=LT_MIN_N - 16) and not _lt(rows=4096, n=512)
    for capability in (None, (8, 9), (10, 0), (12, 0), (9, 1)):  # CPU, Ada, Blackwell
        assert not _lt(capability=capability), capability
    assert not _lt(invariant=True)  # batch-invariant mode keeps the Triton fixed tile
    assert not _lt(has_blocks=False)  # no block table (not block-uniform, or not FP8 dense)
    assert not _lt(out_dtype=torch.float32)
    assert not _lt(rows=386)  # the activation scales' M extent: a multiple of 4
    assert _lt(n=8224) and _lt(n=3072 + 16)  # N need not fill its last 128-row block
    assert not _lt(n=3072 + 8)  # but is a multiple of 16 (LT_N_ALIGN)
    assert not _lt(k=2048 + 128) and _lt(k=2048 + 512)  # K / 128 a multiple of 4
    monkeypatch.setenv("UNIMEM_FP8_LT_MIN_ROWS", "48")  # the rows rule for every shape
    assert _lt(rows=48) and not _lt(rows=44) and _lt(rows=48, n=512)
    assert not _lt(rows=44, n=LT_WIDE_N)
    assert not _lt(rows=48, invariant=True) and not _lt(rows=48, capability=None)
    monkeypatch.setenv("UNIMEM_FP8_LT_MIN_ROWS", "100000")
    assert not _lt()
    monkeypatch.setenv("UNIMEM_FP8_LT_MIN_ROWS", "-1")
    with pytest.raises(ValueError, match="UNIMEM_FP8_LT_MIN_ROWS"):
        _lt()


def test_collapse_block_scales_is_the_inverse_of_the_expansion_for_uniform_blocks():
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(384, 512, generator=gen)
    _, blocks = quantize_blocks(w)  # [3, 4]
    rows = expand_block_scales(blocks, 384)
    table = collapse_block_scales(rows, 512)
    assert table is not None and table.is_contiguous() and table.dtype == torch.float32
    assert torch.equal(table, blocks)
    assert table.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    one = collapse_block_scales(rows[:128], 512)  # a single block row: still a copy
    assert torch.equal(one, blocks[:1])
    assert one.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    # rows moved within a block keep it uniform; rows moved across blocks do not
    within = rows[torch.cat([torch.arange(127, -1, -1), torch.arange(128, 384)])]
    assert torch.equal(collapse_block_scales(within, 512), blocks)
    across = rows.clone()
    across[[5, 200]] = across[[200, 5]]
    assert collapse_block_scales(across, 512) is None
    # a short last block is one more table row (uniform over the rows it has); K off the
    # 128 grid, a short block whose rows differ, and a NaN scale give no table
    assert torch.equal(collapse_block_scales(rows[:320], 512), blocks)
    assert torch.equal(collapse_block_scales(rows[:272], 512), blocks)
    mixed = rows[:320].clone()
    mixed[300] = mixed[300] * 2
    assert collapse_block_scales(mixed, 512) is None
    assert collapse_block_scales(rows[:, :3], 300) is None
    nan = rows.clone()
    nan[0, 0] = float("nan")
    assert collapse_block_scales(nan, 512) is None
    with pytest.raises(ValueError, match="row scales"):
        collapse_block_scales(rows, 1024)


@pytest.mark.parametrize("device", DEVICES)
def test_m_major_scales_are_the_row_major_ones_transposed(device, triton_backend):
    """``m_major=True``: the quantisation launch writes the scales ``[M, KG]`` with strides
    ``(1, M)`` (cuBLASLt's layout) directly, the same bits as the row-major ones; the
    Triton GEMM reads either layout."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(37, 300, generator=gen) * 3).bfloat16().to(device)
    q, s = fp8_quantize_groups(x)
    qm, sm = fp8_quantize_groups(x, m_major=True)
    assert s.stride() == (3, 1) and sm.shape == (37, 3) and sm.stride() == (1, 37)
    assert torch.equal(qm.view(torch.uint8), q.view(torch.uint8))
    bits = lambda t: t.t().contiguous().view(torch.int32)  # noqa: E731
    assert torch.equal(bits(sm), bits(s))
    rq, rs = fp8_quantize_groups_reference(x.cpu(), m_major=True)
    assert rs.stride() == (1, 37) and torch.equal(rs.view(torch.int32), s.cpu().view(torch.int32))
    wq, ws = (t.to(device) for t in fp8_weights(32, 300, gen))
    row_major = fp8_gemm(q, s, wq, ws, out_dtype=torch.float32)
    assert torch.equal(fp8_gemm(qm, sm, wq, ws, out_dtype=torch.float32), row_major)


def test_fp8_linear_off_sm90_ignores_the_block_table():
    """Off SM90 (here: CPU tensors), a block table changes nothing."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(8, 128, generator=gen).bfloat16()
    w = torch.randn(128, 128, generator=gen)
    wq, blocks = quantize_blocks(w)
    ws = expand_block_scales(blocks, 128)
    plain = fp8_linear(x, wq, ws)
    assert torch.equal(fp8_linear(x, wq, ws, block_scales=blocks), plain)


def test_lt_operand_errors_name_the_operand():
    """``fp8_gemm_lt`` checks its operands before cuBLASLt sees them (CPU tensors here): the
    layouts and the :data:`LT_ALIGN` sizes it needs (``K / 128`` off a multiple of 4 gives
    wrong products there, ``M`` off one an error)."""
    gen = torch.Generator().manual_seed(17)

    def call(m=8, n=256, k=512, m_major=True, out_dtype=torch.bfloat16, blocks=None):
        xq, xs = fp8_quantize_groups_reference(torch.randn(m, k, generator=gen), m_major)
        wq, table = quantize_blocks(torch.randn(n, k, generator=gen))
        return fp8_gemm_lt(xq, xs, wq, table if blocks is None else blocks, out_dtype=out_dtype)

    for kw in (dict(k=640), dict(m=6), dict(n=264)):
        with pytest.raises(ValueError, match="must be a multiple"):
            call(**kw)
    with pytest.raises(ValueError, match="strides"):
        call(m_major=False)
    with pytest.raises(ValueError, match="block_scales"):
        call(blocks=torch.ones(1, 4))
    with pytest.raises(ValueError, match="out_dtype"):
        call(out_dtype=torch.float32)


def _sm90() -> torch.device:
    dev = torch.device("cuda")
    if device_capability(dev) != (9, 0):
        pytest.skip("cuBLASLt's 1x128 / 128x128 block scaling: SM90 only")
    return dev


def _lt_operands(m: int, n: int, k: int, dev: torch.device, seed: int):
    """``(x [m, k] bf16, wq [n, k] e4m3, ws [n, KG] row scales, blocks [ceil(n/128), KG])``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16().to(dev)
    wq, blocks = quantize_blocks(torch.randn(n, k, generator=gen) / k**0.5)
    return x, wq.to(dev), expand_block_scales(blocks, n).to(dev), blocks.to(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(384, 640, 1024), (260, 3072, 2048), (384, 8224, 2048)])
def test_lt_gemm_matches_reference(m, n, k):
    """cuBLASLt's block-scaled product against the reference on the same quantised operands
    (the M-major scales of the quantisation launch, the block table); an odd number of
    128-row blocks, ``M`` not a multiple of 8, ``N`` ending in a short block (the small
    preset's GDN input projection)."""
    dev = _sm90()
    x, wq, ws, blocks = _lt_operands(m, n, k, dev, seed=13)
    xq, xs = fp8_quantize_groups(x, m_major=True)
    y = fp8_gemm_lt(xq, xs, wq, blocks, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = fp8_gemm_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), out_dtype=torch.float32)
    assert_product_close(y, ref)
    with pytest.raises(ValueError, match="strides"):
        fp8_gemm_lt(xq, xs.contiguous(), wq, blocks, out_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_lt_gemm_adds_a_bias_in_its_epilogue():
    """``fp8_gemm_lt``'s ``bias`` (not used by ``fp8_linear``'s dispatch, which keeps biased
    products on the Triton kernel): the reference's product plus the bias."""
    dev = _sm90()
    x, wq, ws, blocks = _lt_operands(256, 384, 512, dev, seed=14)
    bias = torch.randn(384, generator=torch.Generator().manual_seed(14)).bfloat16().to(dev)
    xq, xs = fp8_quantize_groups(x, m_major=True)
    y = fp8_gemm_lt(xq, xs, wq, blocks, out_dtype=torch.bfloat16, bias=bias)
    ref = fp8_gemm_reference(
        xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), out_dtype=torch.float32, bias=bias.cpu()
    )
    assert_product_close(y, ref)


@pytest.mark.gpu
def test_dispatched_fp8_linear_at_384_rows_replays_in_a_cuda_graph():
    """At 384 rows on SM90 ``fp8_linear`` with a block table runs cuBLASLt (the bits of
    :func:`fp8_gemm_lt`), close to the Triton kernel's product; inside a CUDA graph it
    writes its (poisoned) output with the eager bits; batch invariance keeps the Triton
    tile."""
    dev = _sm90()
    m, n, k = 384, 3072, 2048
    x, wq, ws, blocks = _lt_operands(m, n, k, dev, seed=15)
    assert use_lt(m, n, k, invariant=False, capability=(9, 0), has_blocks=True)
    eager = fp8_linear(x, wq, ws, block_scales=blocks)
    xq, xs = fp8_quantize_groups(x, m_major=True)
    assert torch.equal(eager, fp8_gemm_lt(xq, xs, wq, blocks, out_dtype=torch.bfloat16))
    rq, rs = fp8_quantize_groups(x)
    assert_product_close(eager, fp8_gemm_reference(
        rq.cpu(), rs.cpu(), wq.cpu(), ws.cpu(), out_dtype=torch.float32))  # fmt: skip
    fixed = fp8_linear(x, wq, ws, invariant=True, block_scales=blocks)
    assert torch.equal(fixed, fp8_linear(x, wq, ws, invariant=True))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (cuBLASLt handle, Triton compile) outside
        fp8_linear(x, wq, ws, block_scales=blocks)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, wq, ws, block_scales=blocks)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(16)).bfloat16().to(dev))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, wq, ws, block_scales=blocks))
    assert not torch.equal(out, eager)
