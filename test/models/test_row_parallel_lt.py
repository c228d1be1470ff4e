"""``row_parallel_linear_lt``: a row-parallel product with a zero bias (cuBLASLt's bias
epilogue on CUDA) where ``lt_route`` says so — a measured weight shape, whatever the rows —
has the plain product's values (on the CPU, in batch-invariant mode, and within the bf16
GEMM's rounding on the GPU) and is the plain product's call otherwise; the
small preset's MLP and Qwen3-Next's GDN / attention output projections route through it with
zero buffers that are not part of the weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unimem.models import batch_invariant
from unimem.models.presets import preset
from unimem.models.synthetic import Mlp
from unimem.models.tensor_parallel import (
    LT_ROUTE_SHAPES,
    SINGLE,
    lt_route,
    row_parallel_linear_lt,
)


def _case(device, dtype, n=24, k=96, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(device, dtype)
    w = (torch.randn(d, k, generator=g) / k**0.5).to(device, dtype)
    return x, w, torch.zeros(d, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_equals_the_plain_product(dtype):
    x, w, zero = _case("cpu", dtype)
    assert torch.equal(row_parallel_linear_lt(x, w, zero, SINGLE), F.linear(x, w))


def test_route_is_by_measured_weight_shape():
    for k, n in LT_ROUTE_SHAPES:
        assert lt_route(torch.empty(n, k, device="meta"))
        # the transposed shape (or any other) is not a measured one
        assert not lt_route(torch.empty(k, n, device="meta"))
    assert not lt_route(torch.empty(2048, 2048, device="meta"))


@pytest.mark.parametrize("rows", [1, 48, 384])
def test_cpu_route_taken_equals_the_plain_product(rows):
    k, n = sorted(LT_ROUTE_SHAPES)[0]
    x, w, zero = _case("cpu", torch.float32, n=rows, k=k, d=n, seed=3)
    assert lt_route(w)
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


def test_qwen3_next_zero_buffers_are_not_weights():
    import tiny_qwen3_next

    from unimem.models.qwen3_next import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM.from_hf_config(
        tiny_qwen3_next.config(), dtype=torch.float32, device="cpu"
    )
    zeros = {n: b for n, b in model.named_buffers() if n.endswith(("o_zero", "out_zero"))}
    kinds = {n.rsplit(".", 1)[1] for n in zeros}
    assert kinds == {"o_zero", "out_zero"}  # attention and GDN layers both have one
    d = model.config.d_model
    assert all(torch.equal(b, torch.zeros(d)) for b in zeros.values())
    assert not set(zeros) & set(model.state_dict())
    assert not set(zeros) & {n for n, _ in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("k", sorted({k for k, _ in LT_ROUTE_SHAPES}))
def test_cuda_bf16_matches_the_product_and_batch_invariant_mode_is_exact(k):
    # the measured shapes at the verify step's 384 rows
    n = next(n for kk, n in LT_ROUTE_SHAPES if kk == k)
    x, w, zero = _case("cuda", torch.bfloat16, n=384, k=k, d=n, seed=1)
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
