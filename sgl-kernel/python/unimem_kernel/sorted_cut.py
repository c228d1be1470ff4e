"""The sampler's top-k / top-p / min-p cut-off over a row's values in descending order.

``sorted_cut(desc, top_k, top_p, min_p)``: per row of ``desc [N, W]`` (float32, each row in
descending order — a whole sorted row, or its ``W`` largest values), the last value the filters
keep, which the sampler then keeps every value at or above:

- top-k: the ranks ``< top_k`` (all ``W`` where ``top_k <= 0``);
- top-p: among those, the smallest prefix whose probability mass reaches ``top_p`` of the kept
  ranks' mass (the renormalised top-k distribution; off where ``top_p >= 1``);
- min-p: probability at least ``min_p`` times the largest;
- rank 0 is always kept.

Every filter compares probabilities with each other, so each value's weight is taken relative to
the row's largest, ``exp(desc - desc[:, 0])`` (no normaliser; ``-inf`` values weigh 0). The
kept ranks form a prefix (the weights fall with the rank, the mass before a rank grows), so the
result is ``desc[row, kept - 1]``.

The torch reference is ~20 small ops over ``[N, W]`` (a cumulative sum, comparisons, sums, a
gather) — at 256 values a row each a separate launch, and a sampled DSPARK step takes a
cut-off per draft column and per chunk of verify rows. The Triton kernel is one launch: a
program per row, two passes over its values in blocks (the kept ranks' mass; then the running
mass before each rank and the count of kept ranks). Its running sums add in another order than
``torch.cumsum``'s, so a rank whose mass lands within float32 rounding of ``top_p`` may be
kept by one and not the other; anywhere else the two agree value for value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = ["sorted_cut", "sorted_cut_reference", "sorted_cut_triton"]

_BLOCK = 1024
"""Values per block of a row (a row of at most this many values is one block)."""


@triton.jit
def _sorted_cut_kernel(desc_ptr, stride_d, k_ptr, p_ptr, m_ptr, out_ptr, W,
                       BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = desc_ptr + row * stride_d
    top = tl.load(base).to(tl.float32)
    k = tl.load(k_ptr + row).to(tl.int64)
    k = tl.where(k > 0, tl.minimum(k, W), W)
    top_p = tl.load(p_ptr + row).to(tl.float32)
    min_p = tl.load(m_ptr + row).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    total = 0.0
    for off in range(0, W, BLOCK):  # the kept ranks' mass
        r = off + cols
        d = tl.load(base + r, mask=r < k, other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.where(r < k, tl.exp(d - top), 0.0), axis=0)
    bound = tl.where(top_p >= 1.0, float("inf"), top_p * total)  # top-p off: every rank
    carry = 0.0
    kept = 0
    for off in range(0, W, BLOCK):  # the mass before each rank; the kept ranks counted
        r = off + cols
        d = tl.load(base + r, mask=r < W, other=float("-inf")).to(tl.float32)
        prob = tl.where(r < W, tl.exp(d - top), 0.0)
        pk = tl.where(r < k, prob, 0.0)
        before = tl.cumsum(pk, axis=0) - pk + carry
        keep = (r < k) & (before < bound) & (prob >= min_p)
        keep = keep | (r == 0)
        kept += tl.sum(keep.to(tl.int32), axis=0)
        carry += tl.sum(pk, axis=0)
    tl.store(out_ptr + row, tl.load(base + (kept - 1)).to(tl.float32))


def sorted_cut_reference(
    desc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """``[N]`` float32: each row's last kept value (module docstring). ``desc [N, W]`` float32,
    descending per row, ``W >= 1``; ``top_k [N]`` integer (``<= 0``: off), ``top_p [N]`` and
    ``min_p [N]`` float32."""
    width = desc.shape[1]
    probs = torch.exp(desc - desc[:, :1])
    ranks = torch.arange(width, device=desc.device)[None, :]
    k = torch.where(top_k[:, None] > 0, top_k[:, None].long(), width)
    keep = ranks < k
    pk = probs * keep
    before = torch.cumsum(pk, dim=-1) - pk  # mass of higher-ranked kept values
    total = pk.sum(dim=-1, keepdim=True)
    keep &= (before < top_p[:, None] * total) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep |= ranks == 0
    last = keep.sum(dim=-1, keepdim=True) - 1  # kept ranks form a prefix
    return desc.gather(1, last)[:, 0].float()


def sorted_cut_triton(
    desc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Triton launcher of :func:`sorted_cut` (arguments already checked): one launch."""
    n, width = desc.shape
    out = torch.empty(n, dtype=torch.float32, device=desc.device)
    if n:
        d = desc if desc.stride(1) == 1 else desc.contiguous()
        block = min(_BLOCK, next_pow2(width))
        _sorted_cut_kernel[(n,)](d, d.stride(0), top_k.contiguous(), top_p.contiguous(),
                                 min_p.contiguous(), out, width, BLOCK=block)  # fmt: skip
    return out


def _check(
    desc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> bool:
    if desc.dim() != 2 or desc.shape[1] == 0:
        raise ValueError(f"desc must be [N, W] with W >= 1, got {tuple(desc.shape)}")
    n = desc.shape[0]
    for name, t in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
        if t.device != desc.device:
            raise ValueError(f"{name} must be on desc's device ({desc.device})")
    if top_k.is_floating_point():
        raise ValueError("top_k must be an integer tensor")
    return desc.dtype == torch.float32 and top_p.dtype == min_p.dtype == torch.float32


sorted_cut = kernel_op(
    "sorted_cut",
    triton=sorted_cut_triton,
    reference=sorted_cut_reference,
    device_of="desc",
    check=_check,
)
