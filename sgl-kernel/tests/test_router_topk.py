"""``router_topk`` (a MoE router's softmax, top-k and renormalisation in one launch) against its
torch reference, under the Triton interpreter and on a GPU: the same expert ids and weights
within float32 rounding on fresh random logits (float32 and bf16, Qwen3-Next's 512 experts
top-10 included, k not a power of two), with and without renormalisation; ties go to the
lower expert index; NaN-free outputs of the right dtypes; bad arguments named."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import router_topk, router_topk_reference


def _backend(monkeypatch, device):
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "t,e,k,renorm",
    [(6, 64, 8, True), (5, 512, 10, True), (7, 32, 4, False), (3, 3, 3, True), (9, 60, 1, False)],
)
def test_kernel_equals_reference(monkeypatch, device, dtype, t, e, k, renorm):
    _backend(monkeypatch, device)
    g = torch.Generator().manual_seed(t * 1000 + e + k)
    # each row: distinct values of the dtype (ties are the next test's), in [-3, 3]
    pool = torch.linspace(-3, 3, 20000).to(dtype).unique()
    logits = torch.stack([pool[torch.randperm(len(pool), generator=g)[:e]] for _ in range(t)])
    logits = logits.to(device)
    w, ids = router_topk(logits, k, renorm)
    w_ref, ids_ref = router_topk_reference(logits, k, renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (t, k)
    assert not w.isnan().any()
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=4e-7 * e, atol=1e-9)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(t, device=device), rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_take_the_lower_expert(monkeypatch, device):
    _backend(monkeypatch, device)
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0], [0.5, 0.5, 0.5, 0.5, 0.5]], device=device)
    w, ids = router_topk(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_logits_and_empty_batch(monkeypatch, device):
    _backend(monkeypatch, device)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 40, generator=g).to(device)
    logits = wide[:, :20]  # rows of stride 40
    w, ids = router_topk(logits, 4, True)
    w_ref, ids_ref = router_topk_reference(logits.contiguous(), 4, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)
    w0, ids0 = router_topk(logits[:0], 4, True)
    assert w0.shape == (0, 4) and ids0.shape == (0, 4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"logits must be \[T, E\]"):
        router_topk(torch.zeros(4), 1, True)
    with pytest.raises(ValueError, match="floating point"):
        router_topk(torch.zeros(2, 4, dtype=torch.int64), 1, True)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, E = 4\]"):
        router_topk(torch.zeros(2, 4), 5, True)
