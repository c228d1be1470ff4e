"""``row_parallel_linear_lt``: a row-parallel product with a zero bias (cuBLASLt's bias
epilogue on CUDA) has the plain product's values — on the CPU, in batch-invariant mode, and
within the bf16 GEMM's rounding on the GPU — and the small preset's MLP routes its down
projection through it with a zero buffer that is not part of the weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unimem.models import batch_invariant
from unimem.models.presets import preset
from unimem.models.synthetic import Mlp
from unimem.models.tensor_parallel import SINGLE, row_parallel_linear_lt


def _case(device, dtype, n=24, k=96, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(device, dtype)
    w = (torch.randn(d, k, generator=g) / k**0.5).to(device, dtype)
    return x, w, torch.zeros(d, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_equals_the_plain_product(dtype):
    x, w, zero = _case("cpu", dtype)
    assert torch.equal(row_parallel_linear_lt(x, w, zero, SINGLE), F.linear(x, w))


def test_bf16_cpu_within_one_rounding_of_the_plain_product():
    x, w, zero = _case("cpu", torch.bfloat16)
    got = row_parallel_linear_lt(x, w, zero, SINGLE).float()
    ref = F.linear(x, w).float()
    assert float((got - ref).abs().max()) <= 2**-7 * float(ref.abs().max())


def test_mlp_zero_buffer_is_not_a_weight():
    c = preset("tiny")
    mlp = Mlp(c)
    assert torch.equal(mlp.down_zero, torch.zeros(c.d_model, dtype=c.dtype))
    assert "down_zero" not in mlp.state_dict()
    assert all(name != "down_zero" for name, _ in mlp.named_parameters())


@pytest.mark.gpu
def test_cuda_bf16_matches_the_product_and_batch_invariant_mode_is_exact():
    # the small preset's down projection at the verify step's 384 rows
    x, w, zero = _case("cuda", torch.bfloat16, n=384, k=5632, d=2048, seed=1)
    exact = x.double() @ w.double().t()
    got = row_parallel_linear_lt(x, w, zero, SINGLE)
    rel = float((got.double() - exact).abs().max() / exact.abs().max())
    assert rel < 1e-2
    batch_invariant.enable()
    try:
        plain = F.linear(x, w)
        lt = row_parallel_linear_lt(x, w, zero, SINGLE)
    finally:
        batch_invariant.disable()
    assert torch.equal(lt, plain)
