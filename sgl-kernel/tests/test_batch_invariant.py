"""Batch-invariant kernels (``unimem_kernel.batch_invariant``): each Triton kernel against its
torch reference, and bitwise batch invariance of every op.

Accuracy bounds (normwise: ``max |got - ref| / max |ref|``, the reference in fp32 or float64):
fp32 inputs 1e-5 (fp32 rounding of a K-term sum in another order), bf16 inputs 1e-2 (the bf16
rounding of the output, 2**-8 relative, plus the accumulation order). Invariance is always
``torch.equal``: a row computed alone, and inside batches of other sizes at other positions
(grouped GEMM: inside other expert distributions), gives the same bits.

On CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, root conftest), with
``UNIMEM_KERNEL_BACKEND=triton`` forced per test. Sizes stay tiny (K, N <= 64, M <= 40) and
the GEMM tiles are lowered to 16 x 16 x 16 (the row chunk to 16) so that a call spans several
row, column and K tiles. The ``cuda`` variants are marked ``gpu`` and use the real tiles; so do
the tests at realistic sizes (K = 2048, N = 4096, bf16, M up to 1000).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_devices import DEVICES

from unimem_kernel import batch_invariant as bi

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")]
# bf16 in the slow tier: the batch-invariance sweeps (bit equality over many batch sizes) and
# the strided-view checks, whose dtype only changes the loads' casts
SWEEP_DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16", marks=pytest.mark.slow)]
BOUND = {F32: 1e-5, BF16: 1e-2}
BATCH_SIZES = [1, 3, 8, 17, 40]


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton kernels; on CPU (the interpreter) lower the tiles."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    if not torch.cuda.is_available():
        monkeypatch.setattr(
            bi, "_matmul_config", lambda d, k, n: bi.MatmulConfig(16, 16, 16, 4, 2, 2)
        )
        monkeypatch.setattr(bi, "_row_block", lambda d: 16)


def rand(gen: torch.Generator, *shape: int, dtype=F32, device="cpu", scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    if ref.numel() == 0:
        return 0.0
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def weight_t(gen, n, k, dtype, device, transposed):
    """``b [K, N]``: ``W.t()`` of a ``W [N, K]`` (non-contiguous), or a contiguous copy."""
    w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    return w.t() if transposed else w.t().contiguous()


# ------------------------------------------------------------------- GEMM


def by_dtype(cases, fast):
    """Every case in float32 and in bf16; ``fast[i]`` names the dtypes of case ``i`` the fast
    tier runs (the others: the slow tier). The costlier cases run in one dtype each there,
    the two covering both; the cheap ones in both."""
    return [
        pytest.param(
            dtype, *case, id=f"{did}-{i}", marks=() if did in fast[i] else pytest.mark.slow
        )
        for i, case in enumerate(cases)
        for dtype, did in ((F32, "f32"), (BF16, "bf16"))
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, m, k, n, has_bias, transposed",
    by_dtype(
        [
            (37, 45, 29, True, True),  # odd K and N, several tiles each way
            (40, 64, 64, False, True),
            (1, 33, 50, True, False),  # contiguous b
            (0, 16, 24, True, True),  # M = 0
        ],
        fast=[{"f32"}, {"bf16"}, {"f32", "bf16"}, {"f32", "bf16"}],
    ),
)
def test_matmul_matches_reference(triton_backend, device, dtype, m, k, n, has_bias, transposed):
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    a = rand(gen, m, k, dtype=dtype, device=device)
    b = weight_t(gen, n, k, dtype, device, transposed)
    bias = rand(gen, n, device=device) if has_bias else None
    got = bi.bi_matmul(a, b, bias)
    assert got.shape == (m, n) and got.dtype == dtype and got.device.type == device
    ref = bi.bi_matmul_reference(a.double(), b.double(), None if bias is None else bias.double())
    assert rel_err(got, ref) <= BOUND[dtype]
    # out_dtype: the fp32 accumulator kept
    got32 = bi.bi_matmul(a, b, bias, out_dtype=F32)
    assert got32.dtype == F32 and rel_err(got32, ref) <= (1e-5 if dtype == F32 else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_matches_f_linear(triton_backend, device):
    gen = torch.Generator().manual_seed(3)
    x = rand(gen, 2, 5, 40, device=device)
    w = rand(gen, 24, 40, device=device, scale=0.2)
    bias = rand(gen, 24, device=device)
    got = bi.bi_linear(x, w, bias)
    assert got.shape == (2, 5, 24)
    assert rel_err(got, F.linear(x.double(), w.double(), bias.double())) <= 1e-5
    assert rel_err(bi.bi_linear(x, w), F.linear(x.double(), w.double())) <= 1e-5
    assert torch.equal(bi.bi_linear(x, w, bias), got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWEEP_DTYPES)
def test_matmul_rows_are_batch_invariant(triton_backend, device, dtype):
    gen = torch.Generator().manual_seed(11)
    k, n = 45, 40
    b = weight_t(gen, n, k, dtype, device, transposed=True)
    bias = rand(gen, n, device=device)
    probes = rand(gen, 3, k, dtype=dtype, device=device)
    alone = [bi.bi_matmul(probes[i : i + 1], b, bias)[0] for i in range(3)]
    for size in BATCH_SIZES:
        for i, pos in enumerate({0, size // 2, size - 1}):
            batch = rand(gen, size, k, dtype=dtype, device=device)
            batch[pos] = probes[i]
            assert torch.equal(bi.bi_matmul(batch, b, bias)[pos], alone[i]), (size, pos)


# ------------------------------------------------------------------- grouped GEMM


def grouped_case(gen, counts, k, n, dtype, device, tail=0, transposed_weight=False):
    """Rows sorted by expert (``counts[e]`` rows each, then ``tail`` rows of no expert)."""
    e = len(counts)
    t = sum(counts) + tail
    x = rand(gen, t, k, dtype=dtype, device=device)
    if transposed_weight:  # [E, K, N] storage seen as [E, N, K]
        w = rand(gen, e, k, n, dtype=dtype, device=device, scale=k**-0.5).transpose(1, 2)
    else:
        w = rand(gen, e, n, k, dtype=dtype, device=device, scale=k**-0.5)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return x, w, offs


def test_grouped_row_tiles_bound_every_routing():
    """The launch bound covers the tiles of any split of ``t`` rows over ``e`` experts and
    the tail, and never exceeds the old ``cdiv(t, bm) + e + 1``."""
    from unimem_kernel._dispatch import grouped_row_tiles

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        e = int(torch.randint(1, 600, (1,), generator=gen))
        t = int(torch.randint(0, 80, (1,), generator=gen))
        bm = int(2 ** torch.randint(4, 8, (1,), generator=gen))
        seg = torch.randint(0, e + 1, (t,), generator=gen)  # segment e: the tail
        counts = torch.bincount(seg, minlength=e + 1)
        tiles = int(((counts + bm - 1) // bm).sum())
        assert tiles <= grouped_row_tiles(t, e, bm) <= -(-t // bm) + e + 1
    assert grouped_row_tiles(10, 512, 16) == 11  # one token, top-10 of 512 experts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, counts, tail, has_bias, transposed_weight",
    by_dtype(
        [
            ([3, 0, 17, 1, 9], 0, True, False),  # an empty expert, one-row expert, odd sizes
            ([0, 20, 0, 5], 4, False, True),  # tail rows past offs[-1]: zeros
            ([0, 0, 0], 0, True, False),  # T = 0
            # decode-like: many experts, few rows (the launch's row tiles bounded by the rows)
            ([0] * 17 + [1] + [0] * 9 + [2] + [0] * 12, 1, True, False),
            ([1] * 5 + [0] * 30, 0, False, False),
        ],
        fast=[{"bf16"}, {"f32"}, {"f32", "bf16"}, {"f32"}, {"bf16"}],
    ),
)
def test_grouped_matches_reference(
    triton_backend, device, dtype, counts, tail, has_bias, transposed_weight
):
    gen = torch.Generator().manual_seed(sum(counts) + tail)
    k, n = 45, 37
    x, w, offs = grouped_case(gen, counts, k, n, dtype, device, tail, transposed_weight)
    bias = rand(gen, len(counts), n, device=device) if has_bias else None
    got = bi.bi_grouped_linear(x, w, offs, bias)
    assert got.shape == (x.shape[0], n) and got.dtype == dtype
    ref = bi.bi_grouped_linear_reference(
        x.double(), w.double(), offs, None if bias is None else bias.double()
    )
    assert rel_err(got, ref) <= BOUND[dtype]
    assert torch.equal(got[sum(counts) :], torch.zeros_like(got[sum(counts) :]))
    out = torch.full_like(got, float("nan"))
    assert bi.bi_grouped_linear(x, w, offs, bias, out=out) is out
    assert torch.equal(out, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rows_gathered_by_the_loads(triton_backend, device, dtype):
    """``rows=r`` reads ``x[r]`` in place: the same bits as the gathered copy (a MoE layer's
    pairs: each token's row repeated, in expert order), also with a tile configuration that
    is not the batch-invariant one, and the reference agrees."""
    gen = torch.Generator().manual_seed(9)
    k, n, counts = 45, 37, [5, 0, 11, 8]
    x_tok = rand(gen, 7, k, dtype=dtype, device=device)
    _, w, offs = grouped_case(gen, counts, k, n, dtype, device)
    rows = torch.randint(0, 7, (sum(counts),), generator=gen).to(device)
    got = bi.bi_grouped_linear(x_tok, w, offs, rows=rows)
    assert torch.equal(got, bi.bi_grouped_linear(x_tok[rows], w, offs))
    ref = bi.bi_grouped_linear_reference(x_tok.double(), w.double(), offs, rows=rows)
    assert rel_err(got, ref) <= BOUND[dtype]
    cfg = bi.MatmulConfig(16, 32, 16, 4, 2, 1)
    other = bi.bi_grouped_linear_triton(x_tok, w, offs, config=cfg, rows=rows)
    assert torch.equal(other, bi.bi_grouped_linear_triton(x_tok[rows], w, offs, config=cfg))
    # the launch order (column tiles fastest) changes no bit
    swapped = bi.bi_grouped_linear_triton(x_tok, w, offs, config=cfg, rows=rows, cols_fastest=True)
    assert torch.equal(swapped, other)
    with pytest.raises(ValueError, match="rows must be 1-D int32/int64"):
        bi.bi_grouped_linear(x_tok, w, offs, rows=rows.float())


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_is_a_drop_in_for_torch_grouped_mm(triton_backend, device):
    """``bi_grouped_linear(xs, w, offs)`` for ``torch._grouped_mm(xs, w.mT, offs=offs)``
    (float32 on CPU, bf16 on CUDA: what ``unimem.models.moe.expert_mlp`` runs)."""
    dtype = BF16 if device == "cuda" else F32
    gen = torch.Generator().manual_seed(5)
    x, w, offs = grouped_case(gen, [5, 0, 19, 8], 48, 32, dtype, device)
    want = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    assert rel_err(bi.bi_grouped_linear(x, w, offs), want) <= BOUND[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWEEP_DTYPES)
def test_grouped_rows_are_invariant_to_the_expert_distribution(triton_backend, device, dtype):
    """A row of expert 2 gives the same bits alone, with the other experts empty, with one
    row, with many, at the start, middle or end of its segment, with or without tail rows."""
    gen = torch.Generator().manual_seed(17)
    k, n, e = 40, 35, 4
    _, w, _ = grouped_case(gen, [1] * e, k, n, dtype, device)
    bias = rand(gen, e, n, device=device)
    probe = rand(gen, k, dtype=dtype, device=device)

    def run(counts, pos, tail=0):
        x, _, offs = grouped_case(gen, counts, k, n, dtype, device, tail)
        row = sum(counts[:2]) + pos
        x[row] = probe
        return bi.bi_grouped_linear(x, w, offs, bias)[row]

    alone = run([0, 0, 1, 0], 0)
    for counts, tail in [
        ([0, 0, 3, 0], 0),
        ([1, 1, 8, 1], 2),
        ([17, 0, 5, 0], 0),
        ([0, 20, 17, 3], 0),
        ([2, 3, 18, 17], 1),
    ]:
        for pos in {0, counts[2] // 2, counts[2] - 1}:
            assert torch.equal(run(counts, pos, tail), alone), (counts, tail, pos)


# ------------------------------------------------------------------- row ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWEEP_DTYPES)
def test_zero_centered_rms_norm_on_a_head_view(triton_backend, device, dtype):
    # Qwen3-Next's per-head q norm: x is the q half of a [T, H, 2 * Dh] projection (a view
    # whose rows are 2 * Dh apart), the weight zero-centred (1 + w)
    gen = torch.Generator().manual_seed(7)
    qg = rand(gen, 5, 3, 2 * 32, dtype=dtype, device=device, scale=3.0)
    q = qg[..., :32]
    weight = rand(gen, 32, device=device).to(dtype)
    got = bi.bi_rms_norm(q, weight, 1e-6, zero_centered=True)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    ref = bi.bi_rms_norm_reference(q.double(), weight.double(), 1e-6, zero_centered=True)
    assert rel_err(got, ref) <= BOUND[dtype]
    plain = bi.bi_rms_norm_reference(q.double(), 1.0 + weight.double(), 1e-6)
    assert torch.equal(ref, plain)
    for t in range(5):  # each row alone gives the same bits
        alone = bi.bi_rms_norm(q[t : t + 1], weight, 1e-6, zero_centered=True)
        assert torch.equal(alone[0], got[t])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 37, 64])
def test_rms_norm_matches_reference(triton_backend, device, dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = rand(gen, 2, 3, d, dtype=dtype, device=device, scale=3.0)
    weight = rand(gen, d, device=device).to(dtype)
    got = bi.bi_rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    ref = bi.bi_rms_norm_reference(x.double(), weight.double(), 1e-6)
    assert rel_err(got, ref) <= BOUND[dtype]
    assert bi.bi_rms_norm(x[:0], weight, 1e-6).shape == (0, 3, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 50, 64])
def test_log_softmax_matches_reference(triton_backend, device, dtype, v):
    gen = torch.Generator().manual_seed(v)
    x = rand(gen, 4, v, dtype=dtype, device=device, scale=5.0)
    if v > 1:
        x[1, : v // 2] = -float("inf")  # a masked vocabulary
    got = bi.bi_log_softmax(x)
    assert got.dtype == F32 and got.shape == x.shape
    ref = bi.bi_log_softmax_reference(x.double())
    finite = ref.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert float((got[finite].double() - ref[finite]).abs().max()) <= 1e-5 * max(
        1.0, float(ref[finite].abs().max())
    )
    assert bi.bi_log_softmax(x[:0]).shape == (0, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWEEP_DTYPES)
def test_row_ops_are_batch_invariant(triton_backend, device, dtype):
    gen = torch.Generator().manual_seed(23)
    d = 53
    weight = rand(gen, d, device=device)
    probe = rand(gen, d, dtype=dtype, device=device, scale=2.0)
    norm_alone = bi.bi_rms_norm(probe[None], weight, 1e-5)[0]
    lsm_alone = bi.bi_log_softmax(probe[None])[0]
    for size in BATCH_SIZES:
        for pos in {0, size // 2, size - 1}:
            batch = rand(gen, size, d, dtype=dtype, device=device, scale=2.0)
            batch[pos] = probe
            assert torch.equal(bi.bi_rms_norm(batch, weight, 1e-5)[pos], norm_alone)
            assert torch.equal(bi.bi_log_softmax(batch)[pos], lsm_alone)


# ------------------------------------------------------------------- dispatch and validation


def test_cpu_auto_runs_the_references_and_float64_is_exact(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    gen = torch.Generator().manual_seed(1)
    a, w, bias = rand(gen, 5, 12), rand(gen, 7, 12), rand(gen, 7)
    assert torch.equal(bi.bi_matmul(a, w.t(), bias), bi.bi_matmul_reference(a, w.t(), bias))
    x, wg, offs = grouped_case(gen, [2, 3], 12, 7, F32, "cpu")
    assert torch.equal(
        bi.bi_grouped_linear(x, wg, offs), bi.bi_grouped_linear_reference(x, wg, offs)
    )
    assert torch.equal(bi.bi_rms_norm(a, a[0], 1e-6), bi.bi_rms_norm_reference(a, a[0], 1e-6))
    assert torch.equal(bi.bi_log_softmax(a), bi.bi_log_softmax_reference(a))
    # float64 (any backend): the exact torch op in float64
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    a64, w64 = a.double(), w.double()
    assert torch.equal(bi.bi_linear(a64, w64, bias.double()), F.linear(a64, w64, bias.double()))
    assert torch.equal(bi.bi_log_softmax(a64), torch.log_softmax(a64, -1))


def test_bad_arguments_are_refused():
    a, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="a must be 2-D"):
        bi.bi_matmul(a[0], w.t())
    with pytest.raises(ValueError, match="K differs"):
        bi.bi_matmul(a, w)
    with pytest.raises(ValueError, match="b must have a's dtype"):
        bi.bi_matmul(a, w.t().to(BF16))
    with pytest.raises(ValueError, match="a must be one of"):
        bi.bi_matmul(a.int(), w.t().int())
    with pytest.raises(ValueError, match="bias must have shape"):
        bi.bi_matmul(a, w.t(), torch.randn(5))
    with pytest.raises(ValueError, match="out_dtype"):
        bi.bi_matmul(a, w.t(), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="weight must be"):
        bi.bi_linear(a, w.t())
    wg = torch.randn(3, 6, 8)
    offs = torch.tensor([1, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="offs must be int32"):
        bi.bi_grouped_linear(a, wg, offs.long())
    with pytest.raises(ValueError, match="offs must be int32"):
        bi.bi_grouped_linear(a, wg, offs[:2])
    with pytest.raises(ValueError, match="weight must be"):
        bi.bi_grouped_linear(a, wg[:, :, :5], offs)
    with pytest.raises(ValueError, match="bias must have shape"):
        bi.bi_grouped_linear(a, wg, offs, bias=torch.randn(6))
    with pytest.raises(ValueError, match="out must be"):
        bi.bi_grouped_linear(a, wg, offs, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="weight must have shape"):
        bi.bi_rms_norm(a, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="x must be one of"):
        bi.bi_log_softmax(a.long())


def test_tile_configuration_ignores_the_row_count():
    """One configuration per (dtype, K, N), no autotuning: ``M`` is not even an argument."""
    for dtype in (F32, BF16, torch.float16):
        for k, n in [(2048, 4096), (2048, 2048), (4096, 2048), (2048, 32000)]:
            cfg = bi.matmul_config(dtype, k, n)
            assert cfg == bi.matmul_config(dtype, k, n)
            assert cfg.block_m in (64, 128) and cfg.block_k in (32, 64)
    assert not hasattr(bi._bi_matmul_kernel, "configs")  # not a triton.autotune


# ------------------------------------------------------------------- GPU, realistic sizes

GPU_ROWS = [1, 7, 48, 384, 1000]


@pytest.mark.gpu
def test_gpu_linear_is_batch_invariant_at_realistic_sizes(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    gen = torch.Generator().manual_seed(0)
    k, n = 2048, 4096
    x = rand(gen, max(GPU_ROWS), k, dtype=BF16, device="cuda")
    w = rand(gen, n, k, dtype=BF16, device="cuda", scale=k**-0.5)
    bias = rand(gen, n, dtype=BF16, device="cuda")
    full = bi.bi_linear(x, w, bias)
    for m in GPU_ROWS:
        assert torch.equal(bi.bi_linear(x[:m], w, bias), full[:m]), m
        # the same rows at other positions: the batch rolled by 5
        rolled = bi.bi_linear(torch.roll(x[:m], 5, dims=0), w, bias)
        assert torch.equal(torch.roll(rolled, -5, dims=0), full[:m]), m
    for r in (0, 47, 999):
        assert torch.equal(bi.bi_linear(x[r : r + 1], w, bias)[0], full[r])
    assert rel_err(full, F.linear(x.float(), w.float(), bias.float())) <= BOUND[BF16]


@pytest.mark.gpu
def test_gpu_fp32_matches_torch(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    gen = torch.Generator().manual_seed(1)
    k, n = 2048, 4096
    x = rand(gen, 384, k, device="cuda")
    w = rand(gen, n, k, device="cuda", scale=k**-0.5)
    bias = rand(gen, n, device="cuda")
    got = bi.bi_linear(x, w, bias)
    assert rel_err(got, F.linear(x, w, bias)) <= BOUND[F32]
    assert rel_err(got, F.linear(x.double(), w.double(), bias.double())) <= BOUND[F32]
    for m in (1, 7, 48):
        assert torch.equal(bi.bi_linear(x[:m], w, bias), got[:m])


@pytest.mark.gpu
def test_gpu_grouped_is_invariant_and_matches_grouped_mm(monkeypatch):
    """64 experts, top-8 routing of 48 and 384 tokens (as ``expert_mlp`` sorts the pairs)."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    gen = torch.Generator().manual_seed(2)
    e, k, n, top = 64, 2048, 1024, 8
    w = rand(gen, e, n, k, dtype=BF16, device="cuda", scale=k**-0.5)
    results = {}
    for t in (48, 384):
        ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)]).cuda()
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(e, dtype=torch.int32, device="cuda")
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = rand(gen, t * top, k, dtype=BF16, device="cuda")
        got = bi.bi_grouped_linear(xs, w, offs)
        want = torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs)
        assert rel_err(got, want) <= BOUND[BF16]
        results[t] = (xs, flat[order], got)
    # every row of the 48-token batch, alone with its expert, gives the same bits
    xs, experts, got = results[48]
    for row in range(0, xs.shape[0], 37):
        counts = torch.zeros(e, dtype=torch.int32, device="cuda")
        counts[experts[row]] = 1
        alone = bi.bi_grouped_linear(
            xs[row : row + 1], w, torch.cumsum(counts, 0, dtype=torch.int32)
        )
        assert torch.equal(alone[0], got[row]), row


@pytest.mark.gpu
def test_gpu_grouped_runs_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    gen = torch.Generator().manual_seed(3)
    e, k, n, t = 8, 256, 512, 64
    w = rand(gen, e, n, k, dtype=BF16, device="cuda")
    x = rand(gen, t, k, dtype=BF16, device="cuda")
    offs = torch.tensor([8 * (i + 1) for i in range(e)], dtype=torch.int32, device="cuda")
    out = torch.empty(t, n, dtype=BF16, device="cuda")
    bi.bi_grouped_linear(x, w, offs, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bi.bi_grouped_linear(x, w, offs, out=out)
    offs.copy_(torch.tensor([0, 0, 10, 30, 30, 50, 60, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, bi.bi_grouped_linear(x, w, offs))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [2048, 151936])
def test_gpu_row_ops_are_batch_invariant(monkeypatch, d):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    gen = torch.Generator().manual_seed(4)
    x = rand(gen, 384, d, dtype=BF16, device="cuda", scale=3.0)
    weight = rand(gen, d, dtype=BF16, device="cuda")
    norm, lsm = bi.bi_rms_norm(x, weight, 1e-6), bi.bi_log_softmax(x)
    assert rel_err(norm, bi.bi_rms_norm_reference(x.double(), weight.double(), 1e-6)) <= 1e-2
    assert rel_err(lsm, bi.bi_log_softmax_reference(x.double())) <= 1e-5
    for m in (1, 7, 48):
        assert torch.equal(bi.bi_rms_norm(x[:m], weight, 1e-6), norm[:m])
        assert torch.equal(bi.bi_log_softmax(x[-m:]), lsm[-m:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWEEP_DTYPES)
def test_rms_norm_on_head_views_of_a_stacked_projection(triton_backend, device, dtype):
    # Qwen3-Next's attention with q, k and v as one GEMM: q is the query half of the
    # [T, Hq, 2 * Dh] columns and k the [T, Hkv, Dh] columns of a [T, W] output, so a row
    # (t, h) sits at t * W + h * S: two strides, read in place
    gen = torch.Generator().manual_seed(11)
    t, hq, hkv, dh = 5, 3, 2, 32
    w = hq * 2 * dh + 2 * hkv * dh
    qkv = rand(gen, t, w, dtype=dtype, device=device, scale=3.0)
    q = qkv[:, : hq * 2 * dh].view(t, hq, 2 * dh)[..., :dh]
    k = qkv[:, hq * 2 * dh : hq * 2 * dh + hkv * dh].view(t, hkv, dh)
    weight = rand(gen, dh, device=device).to(dtype)
    for x in (q, k):
        assert bi._row_groups(x) is not None  # no copy
        got = bi.bi_rms_norm(x, weight, 1e-6, zero_centered=True)
        assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
        ref = bi.bi_rms_norm_reference(x.double(), weight.double(), 1e-6, zero_centered=True)
        assert rel_err(got, ref) <= BOUND[dtype]
        # the same bits as the norm of a contiguous copy and of each token alone
        assert torch.equal(got, bi.bi_rms_norm(x.contiguous(), weight, 1e-6, zero_centered=True))
        for i in range(t):
            alone = bi.bi_rms_norm(x[i : i + 1], weight, 1e-6, zero_centered=True)
            assert torch.equal(alone[0], got[i])
    # leading dims that do not flatten to one stride: copied first, the same result
    a = rand(gen, 4, 5, 6, dh, dtype=dtype, device=device)
    odd = a.permute(1, 0, 2, 3)[:, :, :3]
    assert bi._row_groups(odd) is None
    got = bi.bi_rms_norm(odd, weight, 1e-6)
    assert torch.equal(got, bi.bi_rms_norm(odd.contiguous(), weight, 1e-6))
