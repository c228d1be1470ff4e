"""``unimem_kernel.norm_gemv``: norms, projection and gated activation of a few rows in one
launch, against its torch reference (the unfused chain).

Bounds: the kernel rounds where the chain rounds; only the GEMM's and the norms' summation
orders differ. fp32: normwise relative error 1e-5 (the output and the stream). bf16: every
element within 2 ulp of the reference (the GEMM output rounds once, the activation's product
once more) plus a floor of 2 ulp of the row's largest value for elements near zero, where a
different summation order moves a small result by more than its own ulp; the stream within
1 ulp. The row tile is lowered in one test to walk several ``K`` steps and column blocks with
a ragged last one. On CPU the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``,
root conftest) with ``UNIMEM_KERNEL_BACKEND=triton``; the ``gpu`` tests use Gemma 3 270M's
shapes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import norm_gemv as nl

F32, BF16 = torch.float32, torch.bfloat16
MANTISSA = {F32: 23, BF16: 7}
EPS = 1e-6
SMALL_TILE = nl.NormLinearConfig(16, 16, 4, 2)
ONE_ROW_TILE = nl.NormLinearConfig(4, 16, 4, 2)  # one row: BN below the tensor cores' 16


def rand(gen, *shape, dtype, device, scale=1.0):
    x = torch.randn(*shape, generator=gen) * scale
    x = torch.where(x == 0, torch.full_like(x, 0.5), x)
    return x.to(dtype=dtype, device=device)


def inputs(m, k, n, dtype, device, mode, seed=0):
    """``(x, weight, norm_weight, kwargs)`` of one case: ``mode`` 0 plain, 1 a norm in front,
    2 post-norm + add + norm in front (Gemma), 3 add + norm in front (the Qwen form)."""
    gen = torch.Generator().manual_seed(seed)
    x = rand(gen, m, k, dtype=dtype, device=device)
    w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    nw = rand(gen, k, dtype=dtype, device=device, scale=0.3) if mode >= 1 else None
    kw = {}
    if mode >= 2:
        kw["delta"] = rand(gen, m, k, dtype=dtype, device=device, scale=3.0)
    if mode == 2:
        kw["post_weight"] = rand(gen, k, dtype=dtype, device=device, scale=0.3)
    return x, w, nw, kw


def assert_close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    g, r = got.double(), ref.double()
    if dtype == F32:
        err = ((g - r).norm() / r.norm()).item()
        assert err <= 1e-5, err
        return
    ulp = 2.0 ** -MANTISSA[dtype]
    bound = 2 * ulp * r.abs() + 2 * ulp * r.abs().amax(dim=-1, keepdim=True)
    bad = (g - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off, max {(g - r).abs().max()}"


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")


SLOW = pytest.mark.slow

# Row counts and dtypes of test_matches_reference. The fast tier: one row (the one-row tile)
# in float32 and 17 rows (two row tiles, the second ragged) in bf16, every mode each; the slow
# tier adds the other pairs and 3 rows (one partial tile: its masked rows are 17's too).
M_DTYPES = [
    pytest.param(1, F32, id="1-f32"),
    pytest.param(1, BF16, id="1-bf16", marks=SLOW),
    pytest.param(3, F32, id="3-f32", marks=SLOW),
    pytest.param(3, BF16, id="3-bf16", marks=SLOW),
    pytest.param(17, F32, id="17-f32", marks=SLOW),
    pytest.param(17, BF16, id="17-bf16"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,act,zero_centered",
    [
        (0, None, False),
        (1, "silu", False),
        (2, "gelu_tanh", True),
        (2, None, True),
        (1, None, True),
        (3, "silu", False),
        (3, None, False),
    ],  # fmt: skip
)
@pytest.mark.parametrize("m,dtype", M_DTYPES)
def test_matches_reference(device, dtype, mode, act, zero_centered, m):
    k, n = (40, 2 * 40) if device == "cpu" else (640, 2 * 2048)
    x, w, nw, kw = inputs(m, k, n, dtype, device, mode, seed=m + 10 * mode)
    kw.update(zero_centered=zero_centered, act=act)
    tile = (ONE_ROW_TILE if m == 1 else SMALL_TILE) if device == "cpu" else None
    stream, out = nl.norm_linear_triton(x, w, nw, EPS, config=tile, **kw)
    ref_stream, ref_out = nl.norm_linear_reference(x, w, nw, EPS, **kw)
    assert out.shape == (m, n // 2 if act else n)
    assert_close(out, ref_out, dtype)
    if mode >= 2:
        if dtype == F32:
            assert_close(stream, ref_stream, dtype)
        else:
            ulp = 2.0 ** -MANTISSA[dtype]
            diff = (stream.double() - ref_stream.double()).abs()
            assert (diff <= ulp * ref_stream.double().abs() + 1e-30).all()
    else:
        assert stream is None and ref_stream is None


@pytest.mark.parametrize("mode,act", [(2, "gelu_tanh"), (0, None), (3, "silu")])
@pytest.mark.parametrize(
    "block_k,m",
    [
        pytest.param(64, 1),  # a one-row tile covering all of K (a small model's tables')
        pytest.param(64, 3, marks=SLOW),
        pytest.param(16, 1, marks=SLOW),
        pytest.param(16, 3),  # the first of three K steps, then the rest
    ],
)
def test_first_k_tile_loaded_ahead(mode, act, m, block_k):
    """The kernel loads the first ``BLOCK_K`` of its weights before the norms (all of ``K``
    for a tile that covers it, the one-row tables' tiles at a small model's shapes; the
    first of three steps here otherwise) and walks the rest: the same results as the
    reference within the summation-order bound, and the same stream bits as another tile."""
    x, w, nw, kw = inputs(m, 40, 48, BF16, "cpu", mode, seed=m + mode)
    kw.update(zero_centered=True, act=act)
    tile = nl.NormLinearConfig(4 if m == 1 else 16, block_k, 4, 2)
    stream, out = nl.norm_linear_triton(x, w, nw, EPS, config=tile, **kw)
    ref_stream, ref_out = nl.norm_linear_reference(x, w, nw, EPS, **kw)
    assert_close(out, ref_out, BF16)
    if mode >= 2:
        assert torch.equal(stream, nl.norm_linear_triton(x, w, nw, EPS, config=SMALL_TILE, **kw)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_do_not_mix(device):
    """A row's output depends on its own input only: rows among 2 and among 7 others of one
    row tile (16 rows), bitwise."""
    k, n = (40, 48) if device == "cpu" else (640, 1536)
    x, w, nw, kw = inputs(8, k, n, BF16, device, 2, seed=3)
    tile = SMALL_TILE if device == "cpu" else None
    s_all, y_all = nl.norm_linear_triton(x, w, nw, EPS, config=tile, **kw)
    few = slice(4, 7)
    sub = {"delta": kw["delta"][few], "post_weight": kw["post_weight"]}
    s3, y3 = nl.norm_linear_triton(x[few], w, nw, EPS, config=tile, **sub)
    assert torch.equal(y3, y_all[few]) and torch.equal(s3, s_all[few])


def test_dispatch_and_errors():
    x, w, nw, kw = inputs(2, 8, 6, F32, "cpu", 2)
    assert nl.norm_linear.runs_triton(x, w, nw, EPS, **kw)
    big = torch.zeros(nl.MAX_ROWS + 1, 8)
    assert not nl.norm_linear.runs_triton(big, w, None, EPS)  # past the row tile: reference
    assert not nl.norm_linear.runs_triton(x.double(), w.double(), None, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        nl.norm_linear(x, w[:, :4], None, EPS)
    with pytest.raises(ValueError, match="even"):
        nl.norm_linear(x, w[:5], None, EPS, act="silu")
    with pytest.raises(ValueError, match="act must be"):
        nl.norm_linear(x, w, None, EPS, act="relu")
    with pytest.raises(ValueError, match="delta needs norm_weight"):
        nl.norm_linear(x, w, None, EPS, delta=kw["delta"], post_weight=kw["post_weight"])
    with pytest.raises(ValueError, match="without delta"):
        nl.norm_linear(x, w, nw, EPS, post_weight=kw["post_weight"])
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        nl.norm_linear(x, w, nw[:3], EPS)


def test_config_parse_and_force(monkeypatch):
    cfg = nl.NormLinearConfig.parse("32,64,4,3")
    assert cfg == nl.NormLinearConfig(32, 64, 4, 3) and cfg.spec() == "32,64,4,3"
    for bad in ("32,64,4", "24,64,4,3", "2,64,4,3", "16,8,4,3", "32,64,3,3", "a,b,c,d"):
        with pytest.raises(ValueError, match="norm_linear config"):
            nl.NormLinearConfig.parse(bad)
    dev = torch.device("cpu")
    assert nl.norm_linear_config(1, 1536, 640, None, dev) == nl.DEFAULT_ONE_ROW_CONFIG
    assert nl.norm_linear_config(8, 1536, 640, None, dev) == nl.DEFAULT_CONFIG
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_CONFIG", "64,32,8,2")
    assert nl.norm_linear_config(1, 1536, 640, None, dev) == nl.NormLinearConfig(64, 32, 8, 2)


def test_the_tuned_table_parses():
    """The committed table (``norm_gemv_configs.json``): per GPU and ``"N,K,act"`` key, row
    limits ascending, every tile valid."""
    import json

    table = json.loads(nl.TUNED_CONFIGS.read_text())
    assert table, "the tuned table is empty"
    for gpu in table:
        for key, rows in nl._tuned(gpu).items():
            n, k, act = key.split(",")
            assert int(n) > 0 and int(k) > 0 and (act == "none" or act in nl.ACTS)
            limits = [r for r, _ in rows]
            assert limits == sorted(limits) and all(
                isinstance(c, nl.NormLinearConfig) for _, c in rows
            )
