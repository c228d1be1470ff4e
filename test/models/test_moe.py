"""Grouped-GEMM expert MLP equals the per-expert loop (CPU float32: torch._grouped_mm runs
there too)."""

import pytest
import torch
import torch.nn.functional as F

from unimem.models.moe import expert_mlp, expert_mlp_reference, grouped_mm_supported


def _swiglu(gate, up, bias=None, expert=None):
    """SwiGLU; with ``bias`` / ``expert``, each row's expert's gate/up biases added first
    (the activation protocol of :data:`unimem.models.moe.GatedAct`)."""
    if bias is not None:
        f = gate.shape[-1]
        rows = bias[expert]
        gate, up = gate + rows[:, :f], up + rows[:, f:]
    return F.silu(gate) * up


def _case(t, d, i, e, k, seed, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    logits = torch.randn(t, e, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    wgu = torch.randn(e, 2 * i, d, generator=g) / d**0.5
    wd = torch.randn(e, d, i, generator=g) / i**0.5
    bgu = torch.randn(e, 2 * i, generator=g) if bias else None
    bd = torch.randn(e, d, generator=g) if bias else None
    return x, ids, w, wgu, wd, bgu, bd


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (17, 8, 2), (40, 6, 3)])
def test_grouped_equals_loop(t, e, k, bias):
    x, ids, w, wgu, wd, bgu, bd = _case(t, 32, 24, e, k, seed=t + e, bias=bias)
    assert grouped_mm_supported(x)
    got = expert_mlp(x, ids, w, wgu, wd, act=_swiglu, b_gate_up=bgu, b_down=bd)
    ref = expert_mlp_reference(x, ids, w, wgu, wd, act=_swiglu, b_gate_up=bgu, b_down=bd)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    # an independent dense oracle: every token through its chosen experts one by one
    dense = torch.zeros_like(x)
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            h = wgu[ex] @ x[tok] + (bgu[ex] if bias else 0)
            y = wd[ex] @ _swiglu(h[:24], h[24:]) + (bd[ex] if bias else 0)
            dense[tok] += w[tok, j] * y
    assert torch.allclose(got, dense, atol=1e-5, rtol=1e-5)


def test_experts_without_tokens_and_unused_rows():
    # every token picks expert 3: the other groups are empty
    x, _, w, wgu, wd, _, _ = _case(9, 16, 8, 5, 2, seed=3, bias=False)
    ids = torch.tensor([[3, 1]] * 9)
    got = expert_mlp(x, ids, w, wgu, wd, act=_swiglu)
    ref = expert_mlp_reference(x, ids, w, wgu, wd, act=_swiglu)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_float64_takes_the_reference():
    x, ids, w, wgu, wd, _, _ = _case(5, 16, 8, 4, 2, seed=4, bias=False)
    x, wgu, wd = x.double(), wgu.double(), wd.double()
    assert not grouped_mm_supported(x)
    got = expert_mlp(x, ids, w, wgu, wd, act=_swiglu)
    assert torch.equal(got, expert_mlp_reference(x, ids, w, wgu, wd, act=_swiglu))


def test_bad_shapes_are_named():
    x, ids, w, wgu, wd, _, _ = _case(5, 16, 8, 4, 2, seed=5, bias=False)
    with pytest.raises(ValueError, match="expert weights"):
        expert_mlp(x, ids, w, wgu[:, :, :8], wd, act=_swiglu)
    with pytest.raises(ValueError, match="topk_ids"):
        expert_mlp(x, ids[:3], w, wgu, wd, act=_swiglu)
