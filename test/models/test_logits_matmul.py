"""``logits_matmul``: float32 logits of a bf16 LM head straight from the GEMM on CUDA (closer to
the exact product than rounding to bf16 first), the product-then-cast elsewhere — on the CPU,
for float64, and in batch-invariant mode (whose GEMM override must see an ``aten::mm``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unimem.models import batch_invariant
from unimem.models.tensor_parallel import logits_matmul


def _case(device, dtype, n=24, d=256, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(device, dtype)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(device, dtype)
    return h, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_is_the_product_then_the_cast(dtype):
    h, w = _case("cpu", dtype)
    out = torch.float64 if dtype == torch.float64 else torch.float32
    got = logits_matmul(h, w, out)
    assert got.dtype == out
    assert torch.equal(got, F.linear(h, w).to(out))


@pytest.mark.gpu
def test_cuda_bf16_writes_float32_from_the_gemm():
    h, w = _case("cuda", torch.bfloat16, n=384, d=2048, v=32000, seed=1)
    got = logits_matmul(h, w, torch.float32)
    exact = h.double() @ w.double().t()
    rounded = F.linear(h, w).float()
    assert got.dtype == torch.float32 and got.shape == (384, 32000)
    err_new = float((got.double() - exact).abs().max())
    err_old = float((rounded.double() - exact).abs().max())
    assert err_new <= err_old  # no bf16 rounding of the result
    # float32 accumulation of exact bf16 products: within K * eps32 of sum |h_i w_i|
    scale = float((h.double().abs() @ w.double().abs().t()).max())
    assert err_new <= 2048 * torch.finfo(torch.float32).eps * scale


@pytest.mark.gpu
def test_cuda_batch_invariant_mode_keeps_its_gemm():
    h, w = _case("cuda", torch.bfloat16, n=48, d=512, v=4096, seed=2)
    with batch_invariant.use_batch_invariant():
        got = logits_matmul(h, w, torch.float32)
        want = F.linear(h, w).to(torch.float32)
    assert torch.equal(got, want)
