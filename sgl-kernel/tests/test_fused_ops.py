"""Fused elementwise model ops (``unimem_kernel.fused``): each Triton kernel against its torch
reference, and bitwise row invariance.

Bounds (elementwise; "ulp" = one unit in the last place of the reference value's dtype,
``|got - ref| <= k * 2**-p * |ref|`` with ``p`` = 7 for bf16, 23 for fp32, plus a tiny absolute
floor for values near zero):

- the rounding structure is torch's exactly: on the interpreter (CPU) every op whose math
  avoids transcendental functions and row reductions is **bitwise** equal to its reference:
  ``add_rms_norm``'s ``new_x``, ``rope_qk`` (fp32 and bf16, fp32 or bf16 rotation dtype);
  ``silu_mul`` is bitwise equal to the literal torch expression evaluated with the
  interpreter's ``exp`` (numpy's); against torch's own CPU ``silu`` (whose vectorised ``exp``
  rounds differently from numpy's in ~40% of fp32 inputs, 1 ulp) it is within 2 fp32 ulp for
  fp32 and 1 bf16 ulp for bf16;
- the RMS norms (``add_rms_norm``'s ``normed``, ``gated_rms_norm``): fp32 within 1e-6
  normwise (the sum of squares in another order, ``rsqrt``), bf16 within 1 ulp (2 for the
  gated norm, which rounds twice);
- ``gdn_gates``: fp32 within 8 ulp (``exp`` and the Kahan ``log1p``), bf16 state within 1 ulp;
- ``gelu_tanh_mul``: fp32 within 1e-6 absolute on O(1) products (``tanh`` from ``exp``), bf16
  within 1 ulp.

Invariance is ``torch.equal``: a row alone and inside batches of 3, 8 and 17 rows, at several
positions. On CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, root
conftest) with ``UNIMEM_KERNEL_BACKEND=triton`` forced per test; sizes are tiny (the row
chunk is lowered to 16 in one test to walk the multi-chunk path). The ``gpu``-marked tests use
real sizes (``D = 2048``, ``T = 384``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_devices import DEVICES, INTERPRET

from unimem_kernel import fused as fu
from unimem_kernel import fused_activations, fused_norms

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")]
MANTISSA = {F32: 23, BF16: 7, torch.float16: 10}
EPS = 1e-6


def rand(gen, *shape, dtype=F32, device="cpu", scale=1.0):
    x = torch.randn(*shape, generator=gen) * scale
    x = torch.where(x == 0, torch.full_like(x, 0.5), x)  # non-zero
    return x.to(dtype=dtype, device=device)


def assert_ulp(got, ref, ulps, floor=1e-30):
    """``|got - ref| <= ulps`` units in the last place of ``ref``'s dtype, elementwise."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    g, r = got.double(), ref.double()
    bound = ulps * 2.0 ** -MANTISSA[ref.dtype] * r.abs() + floor
    bad = (g - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, max {float((g - r).abs().max())}"


def rel_err(got, ref):
    ref = ref.double()
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------- add_rms_norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_add_rms_norm_matches_reference(triton_backend, device, dtype, zero_centered):
    g = _gen(1)
    wide = rand(g, 7, 50, dtype=dtype, device=device, scale=2.0)
    x = wide[:, 3:40]  # strided rows, odd D = 37
    delta = rand(g, 7, 37, dtype=dtype, device=device)
    w = rand(g, 37, dtype=dtype, device=device) * 0.2 + 1.0
    s, y = fu.add_rms_norm(x, delta, w, EPS, zero_centered=zero_centered)
    s0, y0 = fu.add_rms_norm_reference(x, delta, w, EPS, zero_centered=zero_centered)
    assert torch.equal(s, s0)  # x + delta, rounded as torch rounds it
    if dtype == F32:
        assert rel_err(y, y0) <= 1e-6
    else:
        assert_ulp(y, y0, 1)


def test_add_rms_norm_multi_chunk_path(triton_backend, monkeypatch):
    """Rows longer than the chunk walk it twice (the chunk lowered to 16: D = 37 is 3)."""
    monkeypatch.setattr(fused_norms, "_row_block", lambda d: 16)
    g = _gen(2)
    for dtype in (F32, BF16):
        x, delta = rand(g, 5, 37, dtype=dtype), rand(g, 5, 37, dtype=dtype)
        w = rand(g, 37, dtype=dtype)
        s, y = fu.add_rms_norm(x, delta, w, EPS)
        s0, y0 = fu.add_rms_norm_reference(x, delta, w, EPS)
        assert torch.equal(s, s0)
        if dtype == F32:
            assert rel_err(y, y0) <= 1e-6
        else:
            assert_ulp(y, y0, 1)
    # the same rows in one chunk give the same new_x and (to rounding) the same norm
    monkeypatch.setattr(fused_norms, "_row_block", lambda d: 64)
    s1, y1 = fu.add_rms_norm(x, delta, w, EPS)
    assert torch.equal(s1, s) and rel_err(y1, y0) <= 1e-2


def test_add_rms_norm_leading_dims_and_fp32_weight(triton_backend):
    g = _gen(3)
    x, delta = rand(g, 2, 3, 24, dtype=BF16), rand(g, 2, 3, 24, dtype=BF16)
    w = rand(g, 24)  # gpt-oss keeps its norm weights in fp32
    s, y = fu.add_rms_norm(x, delta, w, EPS)
    s0, y0 = fu.add_rms_norm_reference(x, delta, w, EPS)
    assert s.shape == y.shape == (2, 3, 24) and torch.equal(s, s0)
    assert_ulp(y, y0, 1)


# ------------------------------------------------------------------- gated activations


def _silu_mul_numpy_exp(gate, up):
    """``F.silu(gate) * up`` with numpy's exp (the interpreter's): torch's rounding steps."""
    gf = gate.float()
    e = torch.from_numpy(np.exp((-gf).numpy()))
    act = (gf / (1.0 + e)).to(gate.dtype)
    return (act.float() * up.float()).to(gate.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_torchs_expression_bitwise(triton_backend, dtype):
    if not INTERPRET:
        pytest.skip("the interpreter's exp is numpy's")
    g = _gen(4)
    gu = rand(g, 9, 2 * 45, dtype=dtype, scale=3.0)
    got = fu.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(got, _silu_mul_numpy_exp(gate, up))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(triton_backend, device, dtype):
    g = _gen(5)
    wide = rand(g, 6, 100, dtype=dtype, device=device, scale=3.0)
    gu = wide[:, 5:95]  # strided [T, 2F], F = 45
    got = fu.silu_mul(gu)
    ref = fu.silu_mul_reference(gu)
    assert got.shape == (6, 45) and got.is_contiguous()
    # f32: the GPU's exp is ex2.approx of x·log2(e) (the product rounds, so the relative
    # error grows with |x|: ~|x| ulps at worst); gates reach |x| ~ 10 here. The H200 measured
    # 3 of 270 elements beyond 2 ulps (9.5e-7).
    assert_ulp(got, ref, 16 if dtype == F32 else 1, floor=1e-12)
    # the two-operand form (separate gate and up projections)
    gate, up = (
        rand(g, 4, 33, dtype=dtype, device=device),
        rand(g, 4, 33, dtype=dtype, device=device),
    )
    assert_ulp(fu.silu_mul(gate, up), F.silu(gate) * up, 2 if dtype == F32 else 1, floor=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_reference(triton_backend, device, dtype):
    g = _gen(6)
    gate = rand(g, 5, 41, dtype=dtype, device=device, scale=2.5)
    up = rand(g, 5, 41, dtype=dtype, device=device)
    got = fu.gelu_tanh_mul(gate, up)
    ref = F.gelu(gate, approximate="tanh") * up
    if dtype == F32:
        assert float((got - ref).abs().max()) <= 1e-6
    else:
        assert_ulp(got, ref, 1, floor=1e-6)
    gu = torch.cat([gate, up], dim=-1)
    assert torch.equal(fu.gelu_tanh_mul(gu), got)


# ------------------------------------------------------------------- GDN gates


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", DTYPES)
def test_gdn_gates_match_reference(triton_backend, device, state_dtype):
    g = _gen(7)
    proj = rand(g, 11, 40, dtype=BF16, device=device, scale=4.0)
    b, a = proj[:, 20:29], proj[:, 31:40]  # column slices of the projection (strided)
    a = a.clone()
    a[0, :3] = torch.tensor([25.0, -30.0, 19.5], dtype=BF16)  # softplus threshold, tails
    A_log = (1 + 15 * torch.rand(9, generator=g)).log().to(device)
    dt_bias = rand(g, 9, device=device) - 4.0
    got_g, got_b = fu.gdn_gates(a, b, A_log, dt_bias, state_dtype)
    ref_g, ref_b = fu.gdn_gates_reference(a, b, A_log, dt_bias, state_dtype)
    assert got_g.dtype == got_b.dtype == state_dtype and got_g.shape == (11, 9)
    assert_ulp(got_g, ref_g, 8 if state_dtype == F32 else 1, floor=1e-30)
    assert_ulp(got_b, ref_b, 8 if state_dtype == F32 else 1, floor=1e-30)


# ------------------------------------------------------------------- gated RMS norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("round_before_weight", [False, True], ids=["unimem", "hf"])
def test_gated_rms_norm_matches_reference(triton_backend, device, dtype, round_before_weight):
    g = _gen(8)
    t, h, d = 5, 3, 19
    o = rand(g, t, h, d, dtype=dtype, device=device)
    proj = rand(g, t, 100, dtype=dtype, device=device, scale=2.0)
    z = proj[:, 10 : 10 + h * d].reshape(t, h, d)  # a reshaped column slice, as the mixers
    w = rand(g, d, dtype=dtype, device=device) * 0.3 + 1.0
    got = fu.gated_rms_norm(o, w, z, EPS, round_before_weight=round_before_weight)
    ref = fu.gated_rms_norm_reference(o, w, z, EPS, round_before_weight=round_before_weight)
    assert got.shape == (t, h * d)
    if dtype == F32:
        assert rel_err(got, ref) <= 1e-6
    else:
        assert_ulp(got, ref, 2, floor=1e-6)


def test_gated_rms_norm_references_are_the_model_code():
    """The two flavours' references are today's model code, bit for bit (float64 and bf16)."""
    from unimem.models import qwen_common
    from unimem.models.nn_ops import rms_norm

    g = _gen(9)
    for dtype in (F64, BF16):
        o, z = rand(g, 4, 2, 16, dtype=dtype), rand(g, 4, 2, 16, dtype=dtype)
        w = rand(g, 16, dtype=dtype)
        acc = F64 if dtype == F64 else F32
        synthetic = (rms_norm(o, w, EPS).to(acc) * F.silu(z.to(acc))).to(dtype).reshape(4, -1)
        assert torch.equal(fu.gated_rms_norm_reference(o, w, z, EPS), synthetic)
        hf = qwen_common.gated_rms_norm(o, w, z, EPS).reshape(4, -1)
        assert torch.equal(fu.gated_rms_norm_reference(o, w, z, EPS, round_before_weight=True), hf)


# ------------------------------------------------------------------- attention output gate


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [4096, 32], ids=["heads_in_one_tile", "a_tile_per_head"])
def test_sigmoid_gate_matches_reference(triton_backend, monkeypatch, device, dtype, tile):
    """``o * sigmoid(gate)`` with the gate a column slice of the stacked q/gate projection (as
    ``GatedAttention`` holds it): the kernel's ``exp`` against torch's, so bf16 within 1 ulp and
    fp32 within 1e-6; ``tile`` 32 gives each head its own program."""
    monkeypatch.setattr(fused_activations, "_SIGMOID_GATE_TILE", tile)
    g = _gen(21)
    t, h, d = 5, 3, 19
    o = rand(g, t, h, d, dtype=dtype, device=device)
    qg = rand(g, t, h, 2 * d, dtype=dtype, device=device, scale=3.0)
    gate = qg[..., d:]  # strides (h * 2d, 2d, 1)
    got = fu.sigmoid_gate(o, gate)
    ref = fu.sigmoid_gate_reference(o, gate)
    assert got.shape == (t, h * d) and got.is_contiguous()
    if dtype == F32:
        assert rel_err(got, ref) <= 1e-6
    else:
        assert_ulp(got, ref, 1, floor=1e-6)


def test_sigmoid_gate_reference_is_the_model_code():
    g = _gen(22)
    o, qg = rand(g, 4, 2, 8, dtype=BF16), rand(g, 4, 2, 16, dtype=BF16)
    gate = qg[..., 8:]
    model = o.reshape(4, 16) * torch.sigmoid(gate.reshape(4, 16))  # GatedAttention's old line
    assert torch.equal(fu.sigmoid_gate_reference(o, gate), model)
    o64, gate64 = o.double(), gate.double()  # float64 runs the reference
    assert torch.equal(
        fu.sigmoid_gate(o64, gate64), o64.reshape(4, 16) * gate64.reshape(4, 16).sigmoid()
    )


def test_sigmoid_gate_bad_arguments_are_named():
    o = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"o must be \[T, H, D\]"):
        fu.sigmoid_gate(o.reshape(2, 12), o.reshape(2, 12))
    with pytest.raises(ValueError, match="gate must have o's shape"):
        fu.sigmoid_gate(o, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="gate must have o's dtype"):
        fu.sigmoid_gate(o, o.to(BF16))


# ------------------------------------------------------------------- RoPE


def _cos_sin(g, t, half, dtype=F32, device="cpu"):
    ang = torch.rand(t, 1, generator=g) * 50 * torch.arange(1, half + 1) / half
    return ang.cos().to(dtype=dtype, device=device), ang.sin().to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [16, 6], ids=["full", "partial"])
def test_rope_qk_matches_reference(triton_backend, device, dtype, rotary):
    g = _gen(10)
    t, hq, hk, d = 4, 3, 2, 16
    qkv = rand(g, t, (hq + 2 * hk) * d, dtype=dtype, device=device)
    q = qkv[:, : hq * d].reshape(t, hq, d)  # column slices of a fused projection
    k = qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d)
    cos, sin = _cos_sin(g, t, rotary // 2, device=device)
    (gq, gk), (rq, rk) = fu.rope_qk(q, k, cos, sin), fu.rope_qk_reference(q, k, cos, sin)
    assert gq.is_contiguous() and gk.is_contiguous()
    if device == "cpu":  # no FMA contraction in the interpreter: torch's bits
        assert torch.equal(gq, rq) and torch.equal(gk, rk)
    else:
        assert_ulp(gq, rq, 2, floor=1e-6)
        assert_ulp(gk, rk, 2, floor=1e-6)
    assert torch.equal(gq[..., rotary:], q[..., rotary:])


@pytest.mark.parametrize("device", DEVICES)
def test_rope_qk_in_a_bf16_rotation_dtype(triton_backend, device):
    """Gemma / gpt-oss pass cos and sin in the model dtype: each op rounds to it."""
    g = _gen(11)
    q, k = rand(g, 3, 2, 8, dtype=BF16, device=device), rand(g, 3, 1, 8, dtype=BF16, device=device)
    cos, sin = _cos_sin(g, 3, 4, dtype=BF16, device=device)
    (gq, gk), (rq, rk) = fu.rope_qk(q, k, cos, sin), fu.rope_qk_reference(q, k, cos, sin)
    assert torch.equal(gq, rq) and torch.equal(gk, rk)


# ------------------------------------------------------------------- row invariance


def _ops(g, d, dtype, device):
    """(name, batched call on T rows) for every op: each takes T rows of fresh inputs."""
    w = rand(g, d, dtype=dtype, device=device)
    h, dh = 2, d // 2

    def arn(x, y):
        return torch.cat(fu.add_rms_norm(x, y, w, EPS, zero_centered=True), dim=-1)

    def gated(x, y):
        t = x.shape[0]
        return fu.gated_rms_norm(x.reshape(t, h, dh), w[:dh], y.reshape(t, h, dh), EPS)

    def rope(x, y):
        t = x.shape[0]
        c, s = y[:, : dh // 2].float().cos(), y[:, : dh // 2].float().sin()
        q, k = fu.rope_qk(x.reshape(t, h, dh), y.reshape(t, h, dh), c, s)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1)], dim=-1)

    def gates(x, y):
        return torch.cat(fu.gdn_gates(x[:, :4], y[:, :4], w[:4].float(), w[4:8].float()), -1)

    return [
        ("add_rms_norm", arn),
        ("silu_mul", lambda x, y: fu.silu_mul(torch.cat([x, y], dim=-1))),
        ("gelu_tanh_mul", lambda x, y: fu.gelu_tanh_mul(x, y)),
        ("gated_rms_norm", gated),
        ("rope_qk", rope),
        ("gdn_gates", gates),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16", marks=pytest.mark.slow)]
)
def test_a_row_alone_equals_it_inside_batches(triton_backend, device, dtype):
    g = _gen(12)
    d = 32
    for name, op in _ops(g, d, dtype, device):
        x1, y1 = (
            rand(g, 1, d, dtype=dtype, device=device),
            rand(g, 1, d, dtype=dtype, device=device),
        )
        alone = op(x1, y1)
        for n in (3, 8, 17):
            for pos in sorted({0, n // 2, n - 1}):
                x, y = (
                    rand(g, n, d, dtype=dtype, device=device),
                    rand(g, n, d, dtype=dtype, device=device),
                )
                x[pos], y[pos] = x1[0], y1[0]
                assert torch.equal(op(x, y)[pos], alone[0]), (name, n, pos)


# ------------------------------------------------------------------- dispatch, validation


def test_cpu_without_forcing_runs_the_reference_bitwise(monkeypatch):
    monkeypatch.delenv("UNIMEM_KERNEL_BACKEND", raising=False)
    g = _gen(13)
    x, delta, w = rand(g, 3, 10), rand(g, 3, 10), rand(g, 10)
    s, y = fu.add_rms_norm(x, delta, w, EPS)
    s0, y0 = fu.add_rms_norm_reference(x, delta, w, EPS)
    assert torch.equal(s, s0) and torch.equal(y, y0)
    gu = rand(g, 3, 10)
    assert torch.equal(fu.silu_mul(gu), F.silu(gu[:, :5]) * gu[:, 5:])


def test_float64_always_runs_the_reference(triton_backend):
    """The CPU oracle: float64 models keep their bits even with the kernels forced."""
    from unimem.models.nn_ops import apply_rope, rms_norm

    g = _gen(14)
    x, delta, w = rand(g, 3, 10, dtype=F64), rand(g, 3, 10, dtype=F64), rand(g, 10, dtype=F64)
    s, y = fu.add_rms_norm(x, delta, w, EPS)
    assert torch.equal(s, x + delta) and torch.equal(y, rms_norm(x + delta, w, EPS))
    gu = rand(g, 3, 10, dtype=F64)
    assert torch.equal(fu.silu_mul(gu), F.silu(gu[:, :5]) * gu[:, 5:])
    q, k = rand(g, 2, 2, 8, dtype=F64), rand(g, 2, 1, 8, dtype=F64)
    c, s_ = _cos_sin(g, 2, 4, dtype=F64)
    gq, gk = fu.rope_qk(q, k, c, s_)
    assert torch.equal(gq, apply_rope(q, c, s_)) and torch.equal(gk, apply_rope(k, c, s_))
    a, b = rand(g, 2, 3, dtype=F64), rand(g, 2, 3, dtype=F64)
    al, dtb = rand(g, 3, dtype=F64), rand(g, 3, dtype=F64)
    gg, bb = fu.gdn_gates(a, b, al, dtb)
    assert torch.equal(gg, -al.exp() * F.softplus(a + dtb)) and torch.equal(bb, b.sigmoid())


def test_arguments_are_validated():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="delta"):
        fu.add_rms_norm(x, torch.randn(3, 7), torch.randn(8), EPS)
    with pytest.raises(ValueError, match="delta"):
        fu.add_rms_norm(x, x.to(BF16), torch.randn(8), EPS)
    with pytest.raises(ValueError, match="weight"):
        fu.add_rms_norm(x, x, torch.randn(7), EPS)
    with pytest.raises(ValueError, match="gate_up"):
        fu.silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="up"):
        fu.silu_mul(x, torch.randn(3, 4))
    with pytest.raises(ValueError, match="gate_up"):
        fu.gelu_tanh_mul(torch.zeros(3, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="A_log"):
        fu.gdn_gates(x, x, torch.randn(7), torch.randn(8))
    with pytest.raises(ValueError, match="b must"):
        fu.gdn_gates(x, torch.randn(3, 7), torch.randn(8), torch.randn(8))
    o = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="z must"):
        fu.gated_rms_norm(o, torch.randn(8), torch.randn(2, 3, 7), EPS)
    with pytest.raises(ValueError, match="o must"):
        fu.gated_rms_norm(x, torch.randn(8), x, EPS)
    c = torch.randn(2, 4)
    with pytest.raises(ValueError, match="k must"):
        fu.rope_qk(o[:, :, :8], torch.randn(2, 1, 6), c, c)
    with pytest.raises(ValueError, match="cos"):
        fu.rope_qk(o, o, torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError, match="sin"):
        fu.rope_qk(o, o, c, torch.randn(2, 3))


# ------------------------------------------------------------------- real sizes (GPU)

T_REAL, D_REAL, GDN_HEADS, GDN_DV = 384, 2048, 16, 128


@pytest.mark.gpu
def test_real_sizes_on_gpu(triton_backend):
    g = _gen(15)
    dev, dt = "cuda", BF16
    x, delta = (
        rand(g, T_REAL, D_REAL, dtype=dt, device=dev),
        rand(g, T_REAL, D_REAL, dtype=dt, device=dev),
    )
    w = rand(g, D_REAL, dtype=dt, device=dev)
    s, y = fu.add_rms_norm(x, delta, w, EPS, zero_centered=True)
    s0, y0 = fu.add_rms_norm_reference(x, delta, w, EPS, zero_centered=True)
    assert torch.equal(s, s0)
    assert_ulp(y, y0, 1, floor=1e-6)
    gu = rand(g, T_REAL, 2 * 5632, dtype=dt, device=dev, scale=3.0)
    assert_ulp(fu.silu_mul(gu), fu.silu_mul_reference(gu), 1, floor=1e-6)
    assert_ulp(fu.gelu_tanh_mul(gu), fu.gelu_tanh_mul_reference(gu), 1, floor=1e-5)
    o = rand(g, T_REAL, GDN_HEADS, GDN_DV, dtype=dt, device=dev)
    z = rand(g, T_REAL, GDN_HEADS, GDN_DV, dtype=dt, device=dev)
    wn = rand(g, GDN_DV, dtype=dt, device=dev)
    for rb in (False, True):
        got = fu.gated_rms_norm(o, wn, z, EPS, round_before_weight=rb)
        ref = fu.gated_rms_norm_reference(o, wn, z, EPS, round_before_weight=rb)
        assert_ulp(got, ref, 2, floor=1e-5)
    a, b = (
        rand(g, T_REAL, GDN_HEADS, dtype=dt, device=dev),
        rand(g, T_REAL, GDN_HEADS, dtype=dt, device=dev),
    )
    al, dtb = rand(g, GDN_HEADS, device=dev).abs(), rand(g, GDN_HEADS, device=dev) - 4
    for got, ref in zip(
        fu.gdn_gates(a, b, al, dtb), fu.gdn_gates_reference(a, b, al, dtb), strict=True
    ):
        assert_ulp(got, ref, 8, floor=1e-30)
    q, k = (
        rand(g, T_REAL, 16, 128, dtype=dt, device=dev),
        rand(g, T_REAL, 4, 128, dtype=dt, device=dev),
    )
    cos, sin = _cos_sin(g, T_REAL, 64, device=dev)
    for got, ref in zip(
        fu.rope_qk(q, k, cos, sin), fu.rope_qk_reference(q, k, cos, sin), strict=True
    ):
        assert_ulp(got, ref, 1, floor=1e-5)
    # Qwen3-Next's gated attention: 16 heads of 256, the gate a slice of the q/gate product
    ao = rand(g, T_REAL, 16, 256, dtype=dt, device=dev)
    gate = rand(g, T_REAL, 16, 512, dtype=dt, device=dev, scale=3.0)[..., 256:]
    gated = fu.sigmoid_gate(ao, gate)
    assert_ulp(gated, fu.sigmoid_gate_reference(ao, gate), 1, floor=1e-6)
    assert torch.equal(fu.sigmoid_gate(ao[9:10], gate[9:10])[0], gated[9])
    # invariance at real sizes: one row alone == that row inside all 384
    s1, y1 = fu.add_rms_norm(x[100:101], delta[100:101], w, EPS, zero_centered=True)
    assert torch.equal(y1[0], y[100]) and torch.equal(s1[0], s[100])
    assert torch.equal(
        fu.gated_rms_norm(o[7:8], wn, z[7:8], EPS)[0], fu.gated_rms_norm(o, wn, z, EPS)[7]
    )


@pytest.mark.gpu
def test_fp16_rounds_as_torch_on_gpu(triton_backend):
    """fp16 takes the GPU rounding's other branch (``cvt.rn.f16.f32``): ``add_rms_norm``'s
    ``new_x`` and RoPE in an fp16 rotation dtype equal torch bitwise, as in bf16."""
    g, dev, f16 = _gen(23), "cuda", torch.float16
    x, delta = rand(g, 33, 96, dtype=f16, device=dev), rand(g, 33, 96, dtype=f16, device=dev)
    w = rand(g, 96, dtype=f16, device=dev)
    s, y = fu.add_rms_norm(x, delta, w, EPS)
    s0, y0 = fu.add_rms_norm_reference(x, delta, w, EPS)
    assert torch.equal(s, s0)
    assert_ulp(y, y0, 1, floor=1e-6)
    q, k = rand(g, 3, 2, 8, dtype=f16, device=dev), rand(g, 3, 1, 8, dtype=f16, device=dev)
    cos, sin = _cos_sin(g, 3, 4, dtype=f16, device=dev)
    (gq, gk), (rq, rk) = fu.rope_qk(q, k, cos, sin), fu.rope_qk_reference(q, k, cos, sin)
    assert torch.equal(gq, rq) and torch.equal(gk, rk)
    o, qg = rand(g, 5, 3, 16, dtype=f16, device=dev), rand(g, 5, 3, 32, dtype=f16, device=dev)
    gate = qg[..., 16:]
    assert_ulp(fu.sigmoid_gate(o, gate), fu.sigmoid_gate_reference(o, gate), 1, floor=1e-6)


def test_the_switch_runs_the_references(monkeypatch):
    """UNIMEM_FUSED_OPS=off: the unfused torch code even where the kernels would run."""
    from unimem_kernel import fused

    t = torch.zeros(2, 4)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("UNIMEM_FUSED_OPS", "off")
    assert not fused.use_triton(t)
    monkeypatch.setenv("UNIMEM_FUSED_OPS", "on")
    assert fused.use_triton(t)
    monkeypatch.setenv("UNIMEM_FUSED_OPS", "maybe")
    with pytest.raises(ValueError, match="UNIMEM_FUSED_OPS"):
        fused.use_triton(t)


# ------------------------------------------------------------------- norm_add_rms_norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("chunk", [None, 16])
def test_norm_add_rms_norm_matches_reference(
    triton_backend, device, dtype, zero_centered, chunk, monkeypatch
):
    """Post-norm -> add -> next norm in one pass against the reference (the norm, then
    add_rms_norm_reference), in one chunk and walking a row in chunks of 16 (D = 37);
    without a next weight only the sum comes back."""
    if chunk is not None:
        monkeypatch.setattr(fused_norms, "_row_block", lambda d: chunk)
    g = _gen(7)
    wide = rand(g, 6, 50, dtype=dtype, device=device, scale=2.0)
    x = wide[:, 5:42]  # strided rows, odd D = 37
    delta = rand(g, 6, 37, dtype=dtype, device=device, scale=5.0)
    pw = rand(g, 37, dtype=dtype, device=device) * 0.2
    nw = rand(g, 37, dtype=dtype, device=device) * 0.2
    s, y = fu.norm_add_rms_norm(x, delta, pw, nw, EPS, zero_centered=zero_centered)
    s0, y0 = fu.norm_add_rms_norm_reference(x, delta, pw, nw, EPS, zero_centered=zero_centered)
    if dtype == F32:
        assert rel_err(s, s0) <= 1e-6 and rel_err(y, y0) <= 1e-5
    else:  # the post-norm may differ by an ulp, then the sum by one
        assert_ulp(s, s0, 2, floor=2.0**-7)
        assert rel_err(y, y0) <= 2e-2
    s1, none = fu.norm_add_rms_norm(x, delta, pw, None, EPS, zero_centered=zero_centered)
    assert none is None and torch.equal(s1, s)
    # a row alone equals the same row in a batch (row-local)
    s2, y2 = fu.norm_add_rms_norm(x[2:3], delta[2:3], pw, nw, EPS, zero_centered=zero_centered)
    assert torch.equal(s2, s[2:3]) and torch.equal(y2, y[2:3])


def test_norm_add_rms_norm_reference_is_gemma_chain():
    """The reference is, literally, Gemma's post-norm followed by add_rms_norm (float64)."""
    g = _gen(8)
    x, delta = rand(g, 3, 12, dtype=F64), rand(g, 3, 12, dtype=F64)
    pw, nw = rand(g, 12, dtype=F64), rand(g, 12, dtype=F64)
    s, y = fu.norm_add_rms_norm(x, delta, pw, nw, EPS, zero_centered=True)
    n = delta * torch.rsqrt(delta.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + pw)
    s0, y0 = fu.add_rms_norm_reference(x, n, nw, EPS, zero_centered=True)
    assert torch.equal(s, s0) and torch.equal(y, y0)
    with pytest.raises(ValueError, match="next_weight"):
        fu.norm_add_rms_norm(x, delta, pw, nw[:5], EPS)


# ------------------------------------------------------------------- clamped_swiglu


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_matches_reference(triton_backend, device, dtype):
    """gpt-oss's clamped SwiGLU over the two column halves of a gate/up product, values on
    both sides of the clamp: bf16 within 1 ulp of the torch code (the sigmoid's exp), fp32
    within 1e-6."""
    g = _gen(9)
    h = rand(g, 5, 2 * 24, dtype=dtype, device=device, scale=6.0)
    gate, up = h.chunk(2, dim=-1)
    y = fu.clamped_swiglu(gate, up, 1.702, 7.0)
    y0 = fu.clamped_swiglu_reference(gate, up, 1.702, 7.0)
    assert y.is_contiguous() and y.shape == (5, 24)
    if dtype == F32:
        assert rel_err(y, y0) <= 1e-6
    else:
        assert_ulp(y, y0, 1, floor=2.0**-20)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_takes_the_rows_expert_biases(triton_backend, device, dtype):
    """gpt-oss's gate/up biases inside the activation: row i gets bias[expert[i]]'s gate and
    up halves first, bit for bit the activation of ``h + bias[expert]`` (the layer's old
    gather and add), kernel and reference alike; bad biases are named."""
    g = _gen(12)
    h = rand(g, 7, 2 * 24, dtype=dtype, device=device, scale=6.0)
    bias = rand(g, 5, 2 * 24, dtype=dtype, device=device, scale=2.0)
    expert = torch.tensor([4, 0, 0, 2, 1, 4, 3], device=device)
    gate, up = h.chunk(2, dim=-1)
    hb_gate, hb_up = (h + bias[expert]).chunk(2, dim=-1)
    for fn in (fu.clamped_swiglu, fu.clamped_swiglu_reference):
        got = fn(gate, up, 1.702, 7.0, bias=bias, expert=expert)
        assert torch.equal(got, fn(hb_gate, hb_up, 1.702, 7.0))
    assert not torch.equal(got, fu.clamped_swiglu_reference(gate, up, 1.702, 7.0))
    with pytest.raises(ValueError, match="bias and expert go together"):
        fu.clamped_swiglu(gate, up, 1.702, 7.0, bias=bias)
    with pytest.raises(ValueError, match="bias must be"):
        fu.clamped_swiglu(gate, up, 1.702, 7.0, bias=bias[:, :-2], expert=expert)
    with pytest.raises(ValueError, match="expert must be"):
        fu.clamped_swiglu(gate, up, 1.702, 7.0, bias=bias, expert=expert[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [640, 5376])  # Gemma 3 270M; 27B (the chunked path)
def test_norm_add_rms_norm_gpu(d):
    """Real widths on the GPU: within the bounds above of the reference, and a row's bits do
    not depend on the batch (1 row vs 48)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(48, d, generator=g, device="cuda").to(BF16)
    h = (torch.randn(48, d, generator=g, device="cuda") * 30).to(BF16)
    pw = (torch.randn(d, generator=g, device="cuda") * 0.3).to(BF16)
    nw = (torch.randn(d, generator=g, device="cuda") * 0.3).to(BF16)
    s, y = fu.norm_add_rms_norm(x, h, pw, nw, EPS, zero_centered=True)
    s0, y0 = fu.norm_add_rms_norm_reference(x, h, pw, nw, EPS, zero_centered=True)
    assert_ulp(s.cpu(), s0.cpu(), 2, floor=2.0**-4)
    assert rel_err(y, y0) <= 2e-2
    s1, y1 = fu.norm_add_rms_norm(x[7:8], h[7:8], pw, nw, EPS, zero_centered=True)
    assert torch.equal(s1, s[7:8]) and torch.equal(y1, y[7:8])


@pytest.mark.gpu
def test_clamped_swiglu_gpu():
    g = torch.Generator(device="cuda").manual_seed(1)
    h = (torch.randn(48, 2 * 2880, generator=g, device="cuda") * 6).to(BF16)
    gate, up = h.chunk(2, dim=-1)
    y = fu.clamped_swiglu(gate, up, 1.702, 7.0)
    assert_ulp(y.cpu(), fu.clamped_swiglu_reference(gate, up, 1.702, 7.0).cpu(), 1, 2.0**-20)
