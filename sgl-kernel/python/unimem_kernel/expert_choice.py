"""A MoE router's softmax, top-k and renormalisation in one launch (one program per token).

Semantics (``router_topk_reference``, the torch code of Qwen3-Next's and Qwen3.5-MoE's sparse
block): ``logits [T, E]`` (any float dtype) ->

    probs = softmax(float32(logits), dim=-1)
    weights, ids = topk(probs, k)          # descending
    weights = weights / weights.sum(-1)    # only when ``renormalize``

returning ``(weights [T, k] float32, ids [T, k] int64)``. The kernel computes the same
quantities in float32; they agree with the reference to rounding (its exponentials and sums
are its own, so weights differ by a few ulp and the ids only where two probabilities are
within that), with one rule where torch has none: among equal probabilities the lower
expert index comes first (``torch.topk`` leaves the order of ties unspecified). Each
token's result depends only on its own row: batch-invariant as it stands.

It replaces the router's five launches per layer (the float32 cast, softmax, the top-k's
radix select and sort, the sum and the division). Grid ``(T,)``; ``BLOCK_E`` = the experts
padded to a power of two (up to 4096; more experts take the reference); ``k`` unrolled.
Nothing is read on the host: the route is captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = ["router_topk", "router_topk_reference", "router_topk_triton"]

_MAX_EXPERTS = 4096


@triton.jit
def _router_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    K: tl.constexpr, K_BLOCK: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    x = tl.load(logits_ptr + t * stride_l + cols, mask=live, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # 0 for the padding
    probs = e / tl.sum(e, axis=0)
    left = tl.where(live, probs, -1.0)  # probabilities are >= 0: padding never wins
    total = 0.0
    offs = tl.arange(0, K_BLOCK)
    top_w = tl.zeros([K_BLOCK], dtype=tl.float32)
    top_i = tl.zeros([K_BLOCK], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, cols, BLOCK_E), axis=0)  # lowest index on ties
        top_w = tl.where(offs == j, best, top_w)
        top_i = tl.where(offs == j, idx.to(tl.int64), top_i)
        total += best
        left = tl.where(cols == idx, -1.0, left)
    if RENORMALIZE:
        top_w = top_w / total
    tl.store(w_ptr + t * K + offs, top_w, mask=offs < K)
    tl.store(ids_ptr + t * K + offs, top_i, mask=offs < K)


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    e = logits.shape[1]
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"k must be an int in [1, E = {e}], got {k!r}")


def router_topk_reference(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, ids [T, k] int64)`` of the router ``logits [T, E]`` (module
    docstring; float64 logits stay float64 and run the reference, as ``E > _MAX_EXPERTS``
    does). The outputs are new tensors."""
    _check(logits, k)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(acc), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def router_topk_triton(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`router_topk` (arguments already checked; ``E <=
    _MAX_EXPERTS``): one program per token."""
    t, e = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _router_kernel[(t,)](
        logits, weights, ids, e, logits.stride(0),
        K=k, K_BLOCK=next_pow2(k), RENORMALIZE=bool(renormalize), BLOCK_E=next_pow2(e),
        num_warps=4 if e > 512 else 1,
    )  # fmt: skip
    return weights, ids


def _check_args(logits: torch.Tensor, k: int, renormalize: bool) -> bool:
    _check(logits, k)
    return logits.dtype != torch.float64 and logits.shape[1] <= _MAX_EXPERTS


router_topk = kernel_op(
    "router_topk",
    triton=router_topk_triton,
    reference=router_topk_reference,
    device_of="logits",
    check=_check_args,
)
