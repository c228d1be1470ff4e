"""unimem.models.batch_invariant: the process-wide switch behind
``--enable-deterministic-inference``. On the CPU the tests register the overrides for the CPU
key and run the Triton kernels through the interpreter (tiny sizes); the GPU variant checks a
whole model's logits, one request alone against the same request in batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unimem.models import batch_invariant
from unimem.models.nn_ops import rms_norm
from unimem_kernel import bi_matmul_reference


@pytest.fixture
def cpu_mode(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    batch_invariant.enable(("CPU",))
    yield
    batch_invariant.disable()


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_off_by_default_and_switches_cleanly():
    assert not batch_invariant.enabled()
    batch_invariant.enable(("CPU",))
    try:
        assert batch_invariant.enabled()
        assert batch_invariant.overridden_device_types() == ("CPU",)
        batch_invariant.enable(("CPU",))  # idempotent
        with pytest.raises(ValueError, match="already on"):
            batch_invariant.enable(("CUDA",))
    finally:
        batch_invariant.disable()
    assert not batch_invariant.enabled() and batch_invariant.overridden_device_types() == ()
    with pytest.raises(ValueError, match="device_types"):
        batch_invariant.enable(("TPU",))
    with pytest.raises(ValueError, match="device_types"):
        batch_invariant.enable(())


def test_linear_and_matmul_route_to_the_invariant_kernel(cpu_mode):
    x, w, b = _rand(9, 24, seed=1), _rand(40, 24, seed=2), _rand(40, seed=3)
    for got, bias in ((F.linear(x, w, b), b), (F.linear(x, w), None), (x @ w.t(), None)):
        want = bi_matmul_reference(x, w.t(), bias)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # addmm with alpha / beta other than 1 keeps torch's meaning
    got = torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0)
    want = 2.0 * (x.double() @ w.t().double()) + 0.5 * b.double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_row_alone_equals_it_inside_batches(cpu_mode):
    """Bitwise: F.linear and the RMS norm of one row, alone and at several positions of
    batches of several sizes."""
    w = _rand(48, 32, seed=4)
    norm_w = _rand(32, seed=5)
    row = _rand(1, 32, seed=6)
    alone = F.linear(row, w)
    alone_norm = rms_norm(row, norm_w, 1e-6)
    for n, pos in ((3, 0), (3, 2), (17, 9), (40, 39)):
        batch = _rand(n, 32, seed=7 + n)
        batch[pos] = row[0]
        assert torch.equal(F.linear(batch, w)[pos : pos + 1], alone)
        assert torch.equal(rms_norm(batch, norm_w, 1e-6)[pos : pos + 1], alone_norm)


def test_norm_semantics_unchanged(cpu_mode):
    x, w = _rand(5, 32, seed=8), _rand(32, seed=9)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)


def test_float64_is_untouched_when_the_cpu_key_is_not_overridden():
    """The engine's mode overrides CUDA only: CPU float64 math is torch's, bit for bit."""
    batch_invariant.enable(("CUDA",))
    try:
        x, w = _rand(7, 16, seed=10, dtype=torch.float64), _rand(12, 16, seed=11).double()
        assert torch.equal(F.linear(x, w), x @ w.t())
        nw = _rand(16, seed=12).double()
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
        assert torch.equal(rms_norm(x, nw, 1e-6), want)
    finally:
        batch_invariant.disable()


@pytest.mark.gpu
def test_gpu_lm_head_rows_do_not_depend_on_the_batch():
    """bf16 on the GPU at the gpu_test preset's LM head: the logits of one hidden row alone
    equal its logits inside batches of 6 to 64 rows (the vendor GEMM picks other algorithms
    for these sizes)."""
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel

    cfg = preset("gpu_test")
    dev = torch.device("cuda")
    model = HybridModel(cfg, seed=3, device=dev)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, cfg.d_model, generator=g).to(dev, cfg.dtype)
    with batch_invariant.use_batch_invariant():
        alone = F.linear(hidden[5:6], model.lm_head)
        for n in (6, 7, 48, 64):
            assert torch.equal(F.linear(hidden[:n], model.lm_head)[5:6], alone)


def test_refused_with_the_fused_ops_switched_off(monkeypatch):
    monkeypatch.setenv("UNIMEM_FUSED_OPS", "off")
    with pytest.raises(ValueError, match="UNIMEM_FUSED_OPS"):
        batch_invariant.enable(("CPU",))
    assert not batch_invariant.enabled()
