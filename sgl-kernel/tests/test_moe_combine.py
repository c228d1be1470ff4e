"""``moe_combine`` (the MoE layer's weight + unsort + slot sum in one launch) against its torch
reference: bitwise (float32 sums in slot order, each product rounded to ``y``'s dtype) on
fresh random inputs, under the Triton interpreter and on a GPU; NaN-poisoned outputs show any
unwritten entry; the old three-pass code (multiply, ``index_copy_``, sum over the slots in
float32 order) gives the same bits; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import expert_combine as mc_mod
from unimem_kernel import moe_combine, moe_combine_reference


def _case(t, k, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(t * k, d, generator=g).to(device, dtype)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
    ids = torch.randint(0, 7, (t * k,), generator=g)
    order = torch.argsort(ids, stable=True).to(device)  # a sort by expert, as the layer's
    return y, order, w


def _old_three_passes(y, order, w):
    """The MoE layer's tail before this kernel (its batch-invariant branch)."""
    t, k = w.shape
    y = y * w.reshape(-1)[order, None].to(y.dtype)
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)
    acc = unsorted[:, 0].float()
    for j in range(1, k):
        acc = acc + unsorted[:, j].float()
    return acc.to(y.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "t,k,d", [(1, 1, 8), (5, 2, 40), pytest.param(9, 8, 96, marks=pytest.mark.slow)]
)
def test_kernel_equals_reference_bitwise(monkeypatch, device, dtype, t, k, d):
    monkeypatch.setattr(mc_mod, "_BLOCK_D", 32)  # several column blocks at small d
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    y, order, w = _case(t, k, d, dtype, device, seed=t * 100 + k * 10 + d)
    got = moe_combine(y, order, w)
    want = moe_combine_reference(y, order, w)
    assert got.dtype == dtype and got.shape == (t, d)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(want, _old_three_passes(y, order, w))
    # against float64 math: the rounding of one product per slot and one sum
    exact = torch.zeros(t, d, dtype=torch.float64, device=device)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=device))
    for j in range(k):
        exact += y[inv[torch.arange(t, device=device) * k + j]].double() * w[:, j, None].double()
    tol = 4 * k * torch.finfo(dtype).eps * float(exact.abs().max())
    assert float((got.double() - exact).abs().max()) <= tol


def test_strided_inputs_and_empty_batches(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "reference")
    y, order, w = _case(4, 3, 16, torch.float32, "cpu", seed=1)
    wide = torch.stack([w, w], dim=-1).reshape(4, 6)[:, ::2]  # non-contiguous weights
    assert torch.equal(moe_combine(y, order, wide), moe_combine_reference(y, order, w))
    empty = moe_combine(y[:0], order[:0], w[:0])
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_interpreter_or_gpu_strided_weights(monkeypatch, device):
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    y, order, w = _case(6, 4, 24, torch.bfloat16, device, seed=2)
    wide = torch.stack([w, w], dim=-1).reshape(6, 8)[:, ::2]
    assert torch.equal(moe_combine(y, order, wide), moe_combine_reference(y, order, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t,k,d", [(3, 2, 40), pytest.param(9, 8, 96, marks=pytest.mark.slow)])
def test_shared_expert_joins_the_pass(monkeypatch, device, dtype, t, k, d):
    # Qwen3-Next's block: routed + sigmoid(h @ w_gate^T) * shared, with d over two column
    # programs and the gate's dot product over several chunks
    monkeypatch.setattr(mc_mod, "_BLOCK_D", 32)
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    y, order, w = _case(t, k, d, dtype, device, seed=t + k + d)
    g = torch.Generator().manual_seed(d)
    shared, h = (torch.randn(t, d, generator=g).to(device, dtype) for _ in range(2))
    gate_w = (torch.randn(1, d, generator=g) / d**0.5).to(device, dtype)
    kw = {"shared": shared, "gate_input": h, "gate_weight": gate_w}
    got = moe_combine(y, order, w, **kw)
    want = moe_combine_reference(y, order, w, **kw)
    assert got.dtype == dtype and not got.isnan().any()
    # the routed sum is bitwise; the gate's dot product is the kernel's own float32 sum, so
    # the gated term can differ by its rounding (an ulp of the output, rarely two)
    exact = moe_combine_reference(y.double(), order, w.double(), shared=shared.double(),
                                  gate_input=h.double(), gate_weight=gate_w.double())  # fmt: skip
    scale = float(exact.abs().max())
    eps = torch.finfo(dtype).eps
    assert float((got.double() - exact).abs().max()) <= 8 * eps * scale
    assert float((got.double() - want.double()).abs().max()) <= 4 * eps * scale
    assert torch.equal(moe_combine(y, order, w), moe_combine_reference(y, order, w))
    with pytest.raises(ValueError, match="go together"):
        moe_combine(y, order, w, shared=shared)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t,k,d", [(1, 1, 8), (5, 2, 40), (6, 4, 72)])
def test_output_biases_join_the_pass(monkeypatch, device, dtype, t, k, d):
    """gpt-oss's down biases: ``bias[expert[i]]`` added to sorted row ``i`` first, bit for
    bit the layer's old ``y + bias[expert]`` then the weighted sum."""
    monkeypatch.setattr(mc_mod, "_BLOCK_D", 32)
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    g = torch.Generator().manual_seed(t * 7 + d)
    ids = torch.randint(0, 7, (t * k,), generator=g)
    order = torch.argsort(ids, stable=True)
    expert = ids[order].to(device)  # the expert of each sorted row, as moe_route gives it
    order = order.to(device)
    y = torch.randn(t * k, d, generator=g).to(device, dtype)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
    bias = (torch.randn(7, d, generator=g) * 3).to(device, dtype)
    got = moe_combine(y, order, w, bias=bias, expert=expert)
    want = _old_three_passes(y + bias[expert], order, w)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(moe_combine_reference(y, order, w, bias=bias, expert=expert), want)
    assert not torch.equal(got, moe_combine(y, order, w))  # the biases count
    with pytest.raises(ValueError, match="bias and expert go together"):
        moe_combine(y, order, w, bias=bias)
    with pytest.raises(ValueError, match="expert must be"):
        moe_combine(y, order, w, bias=bias, expert=expert[:-1])
    with pytest.raises(ValueError, match="bias must be"):
        moe_combine(y, order, w, bias=bias[:, :-1], expert=expert)


def test_bad_arguments_are_named():
    y, order, w = _case(4, 2, 8, torch.float32, "cpu", seed=3)
    with pytest.raises(ValueError, match="weights must be"):
        moe_combine(y, order, w.reshape(-1))
    with pytest.raises(ValueError, match="y must be"):
        moe_combine(y[:5], order, w)
    with pytest.raises(ValueError, match="order must be"):
        moe_combine(y, order[:5], w)
    with pytest.raises(ValueError, match="order must be"):
        moe_combine(y, order.float(), w)
    with pytest.raises(ValueError, match="floating point"):
        moe_combine(y.long(), order, w)
