"""``moe_route`` (the MoE layer's stable counting sort of (token, slot) pairs by expert) against
its torch reference (``argsort(stable=True)``, the scatter count and the cumulative sum the
layer ran before): equal outputs, exactly, on fresh random routings — distinct experts per
token as a router's ``topk`` gives, repeated experts, every pair on one expert, empty batches —
under the Triton interpreter and on a GPU, with poisoned output buffers so an unwritten entry
shows; several blocks and several scan chunks at small sizes; the permutation's own
properties; ``moe_combine`` with the route's inverse equals it without; bad arguments named.
Both forms run each case: the place kernel scanning the count kernel's table itself (a decode
or verify step) and the scan kernel's launch between them (a prefill chunk)."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import expert_route as er
from unimem_kernel import moe_combine, moe_route, moe_route_reference

_POISON = -7


def _topk_like(t: int, k: int, e: int, g: torch.Generator) -> torch.Tensor:
    """``[T, k]`` distinct experts per token, from random scores (as a router's topk)."""
    return torch.randn(t, e, generator=g).topk(k, dim=-1).indices


def _poisoned(monkeypatch) -> None:
    def empty(n, dtype, device):
        return torch.full((n,), _POISON, dtype=dtype, device=device)

    monkeypatch.setattr(er, "_empty", empty)


def _assert_route(got: er.ExpertRoute, ids: torch.Tensor, e: int) -> None:
    want = moe_route_reference(ids.cpu(), e)
    for name, a, b in zip(er.ExpertRoute._fields, got, want, strict=True):
        assert a.dtype == b.dtype, name
        assert torch.equal(a.cpu(), b), name
    p = ids.numel()
    assert torch.equal(got.inverse[got.order].cpu(), torch.arange(p))
    flat = ids.reshape(-1).cpu()
    assert torch.equal(flat[got.order.cpu()], got.expert.cpu())
    assert bool((got.expert[1:] >= got.expert[:-1]).all()) if p > 1 else True


_FORMS = ["scan_in_place", "scan_kernel"]
# tokens, experts a token, experts; (1, 10, 512) is one token of Qwen3-Next-80B's routing in
# one 16-pair program (_MIN_BLOCK), (9, 10, 512) 90 pairs in one 128-pair program
_ROUTINGS = [
    (1, 1, 1), (7, 2, 4), (48, 8, 64), (40, 10, 512), (33, 4, 32), (25, 1, 3), (1, 10, 512),
    (9, 10, 512),
]  # fmt: skip


def _setup(
    monkeypatch, device: str, form: str, block: int | None = None, scan: int | None = None
) -> None:
    _poisoned(monkeypatch)
    # the place kernel scans tables up to a bound; 0 sends every routing through the scan kernel
    monkeypatch.setattr(er, "_PLACE_SCAN_ELEMENTS", 1 << 30 if form == "scan_in_place" else 0)
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    if block is not None:
        monkeypatch.setattr(er, "_BLOCK", block)
    if scan is not None:
        monkeypatch.setattr(er, "_SCAN_ELEMENTS", scan)


@pytest.mark.parametrize("form", _FORMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,k,e", _ROUTINGS)
def test_kernel_equals_reference(monkeypatch, device, form, t, k, e):
    _setup(monkeypatch, device, form)
    g = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    ids = _topk_like(t, k, e, g).to(device)
    _assert_route(moe_route(ids, e), ids, e)


@pytest.mark.parametrize("form", _FORMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_many_blocks_and_scan_chunks(monkeypatch, device, form, dtype):
    # 16-pair blocks and a scan that holds 2 rows of 64 padded experts at a time: 19 blocks,
    # 10 scan chunks; repeated experts within a token and within a block
    _setup(monkeypatch, device, form, block=16, scan=128)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (50, 6), generator=g).to(device, dtype)
    _assert_route(moe_route(ids, 40), ids, 40)


@pytest.mark.parametrize("form", _FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_skewed_routings(monkeypatch, device, form):
    _setup(monkeypatch, device, form, block=16)
    one = torch.zeros(37, 3, dtype=torch.int64, device=device)  # every pair on expert 0
    _assert_route(moe_route(one, 5), one, 5)
    last = torch.full((20, 2), 7, dtype=torch.int64, device=device)  # all on the last expert
    got = moe_route(last, 8)
    _assert_route(got, last, 8)
    assert got.ends.tolist() == [0] * 7 + [40]


@pytest.mark.parametrize("form", _FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(monkeypatch, device, form):
    _setup(monkeypatch, device, form)
    ids = torch.zeros(0, 4, dtype=torch.int64, device=device)
    got = moe_route(ids, 6)
    assert all(x.numel() == 0 for x in got[:4])
    assert got.ends.tolist() == [0] * 6


@pytest.mark.parametrize("device", DEVICES)
def test_combine_with_the_routes_inverse(monkeypatch, device):
    if device == "cpu":
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    g = torch.Generator().manual_seed(3)
    t, k, e, d = 9, 4, 16, 48
    ids = _topk_like(t, k, e, g).to(device)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
    y = torch.randn(t * k, d, generator=g).to(device, torch.bfloat16)
    route = moe_route(ids, e)
    with_inverse = moe_combine(y, route.order, w, route.inverse)
    assert torch.equal(with_inverse, moe_combine(y, route.order, w))


@pytest.mark.gpu
def test_gpu_qwen3_next_prefill_sizes():
    # a prefill chunk of Qwen3-Next's real routing (512 experts, top 10): 4 096 tokens, through
    # the scan kernel; and a verify step of 48 requests x 8 tokens over the bench checkpoint's
    # 64 experts (top 8), scanned by the place kernel
    g = torch.Generator().manual_seed(11)
    ids = _topk_like(4096, 10, 512, g).cuda()
    _assert_route(moe_route(ids, 512), ids, 512)
    ids = _topk_like(384, 8, 64, g).cuda()
    assert er._PLACE_SCAN_ELEMENTS >= 32 * 64
    _assert_route(moe_route(ids, 64), ids, 64)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, k\]"):
        moe_route(torch.zeros(4, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="int32 or int64"):
        moe_route(torch.zeros(2, 2), 3)
    with pytest.raises(ValueError, match="num_experts"):
        moe_route(torch.zeros(2, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        moe_route_reference(torch.tensor([[0, 3]]), 3)
    with pytest.raises(ValueError, match="inverse must be"):
        moe_combine(torch.zeros(4, 2), torch.arange(4), torch.ones(2, 2), torch.arange(3))
