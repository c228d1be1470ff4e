"""Block verification's per-column overlap of a sampled verify step, in one pass over the logits.

Block verification (``unimem.speculative.spec_sampling``) needs, for every lane ``b`` and
draft column ``i`` below the chain's end, the residual mass ``sum_v max(0, w p(v) - q(v))``
at a weight ``w = w[b, i]``; since ``p`` sums to 1 that is ``w - sum_v min(w p(v), q(v))``.
``block_overlap(logits, vw, temperature, cut, lse, q, t2d, d2t, w)`` returns the overlap
``sum_v min(w p(v), q(v))`` ``[N, G]`` float32 without materialising ``p`` or ``q`` over the
target's vocabulary:

- ``p`` is row ``b * vw + i`` of ``logits [M, V]`` tempered (``s = logits / t`` with ``t =
  temperature[b]``, 1 where it is 0), the values ``s >= cut[row]`` kept, each ``exp(s -
  lse[row])`` — as :func:`unimem_kernel.residual_draw.residual_draw` reads it;
- ``q`` is column ``i`` of ``q [N, G, K]`` over the drafter's ``K``-token vocabulary: read
  through ``t2d [V]`` (the draft id of each target id, ``K`` off the draft vocabulary) by the
  kernel, gathered through ``d2t [K]`` (the target id of each draft id) by the reference;
  both None when ``K == V``. Off the draft vocabulary ``q`` is 0 and so is the overlap.

The kernel: per (lane, column, chunk of :data:`SPLIT` target ids) a partial sum, in one
launch on a fixed grid; the chunks are added in index order by one torch ``sum`` (no host
read: capturable). The reference (:func:`block_overlap_reference`) gathers ``[N, G, K]``
logits; the two agree to float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op

__all__ = ["SPLIT", "block_overlap", "block_overlap_reference", "block_overlap_triton"]

SPLIT = 8192
"""Target ids per program (32 programs a column at 262 144)."""
_BLOCK = 1024


@triton.jit
def _overlap_partial_kernel(
    x_ptr, stride_x, vw, G, t_ptr, cut_ptr, lse_ptr, q_ptr, stride_qr, t2d_ptr, K, w_ptr,
    part_ptr, V, n_split, SPLIT_: tl.constexpr, BLOCK: tl.constexpr, REDUCED: tl.constexpr,
):  # fmt: skip
    """Program ``(lane * G + column, sp)``: ``sum min(w p, q)`` over chunk ``sp`` of the
    target ids."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = r // G
    row = b * vw + r % G
    t = tl.load(t_ptr + b).to(tl.float32)
    t = tl.where(t > 0, t, 1.0)
    cut = tl.load(cut_ptr + row).to(tl.float32)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    w = tl.load(w_ptr + r).to(tl.float32)
    q_row = q_ptr + r * stride_qr
    acc = tl.zeros((BLOCK,), tl.float32)
    start = sp.to(tl.int64) * SPLIT_
    for off in range(0, SPLIT_, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        inside = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=inside, other=float("-inf"))
        s = tl.math.div_rn(x.to(tl.float32), t)
        p = tl.where(inside & (s >= cut), tl.exp(s - lse), 0.0)
        if REDUCED:
            d = tl.load(t2d_ptr + idx, mask=inside, other=K)
            qv = tl.load(q_row + d, mask=inside & (d < K), other=0.0)
        else:
            qv = tl.load(q_row + idx, mask=inside, other=0.0)
        acc += tl.minimum(w * p, qv)
    tl.store(part_ptr + r * n_split + sp, tl.sum(acc, axis=0))


def block_overlap_reference(
    logits: torch.Tensor,
    vw: int,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    t2d: torch.Tensor | None,
    d2t: torch.Tensor | None,
    w: torch.Tensor,
) -> torch.Tensor:
    """``[N, G]`` float32: ``sum_v min(w[b, i] p_{b,i}(v), q[b, i, v])`` (module docstring).
    ``logits [M, V]`` (any float dtype, computed in float32; ``M >= N * vw``), ``temperature
    [N]``, ``cut [M]``, ``lse [M]``, ``q [N, G, K]`` and ``w [N, G]`` float32 (``G < vw``),
    ``t2d [V]`` and ``d2t [K]`` int64, both or neither given (neither: ``K == V``)."""
    n, g = w.shape
    dev = logits.device
    rows = torch.arange(n, device=dev)[:, None] * vw + torch.arange(g, device=dev)[None, :]
    rows = rows.reshape(-1)
    x = logits[rows] if d2t is None else logits[rows[:, None], d2t[None, :]]
    t = temperature.float()
    t = torch.where(t > 0, t, 1.0).repeat_interleave(g)
    s = x.float() / t[:, None]
    p = torch.where(s >= cut[rows][:, None], torch.exp(s - lse[rows][:, None]), 0.0)
    qf = q.reshape(n * g, -1).float()
    return torch.minimum(w.reshape(-1, 1).float() * p, qf).sum(dim=1).reshape(n, g)


def block_overlap_triton(
    logits: torch.Tensor,
    vw: int,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    t2d: torch.Tensor | None,
    d2t: torch.Tensor | None,
    w: torch.Tensor,
) -> torch.Tensor:
    """Triton launcher of :func:`block_overlap` (arguments already checked): one launch and a
    sum over the chunks."""
    n, g = w.shape
    vocab = logits.shape[1]
    if n * g == 0:
        return torch.zeros(n, g, dtype=torch.float32, device=logits.device)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    qc = q.reshape(n * g, q.shape[2])
    qc = qc if qc.stride(1) == 1 else qc.contiguous()
    n_split = triton.cdiv(vocab, SPLIT)
    part = torch.empty(n * g, n_split, dtype=torch.float32, device=logits.device)
    _overlap_partial_kernel[(n * g, n_split)](
        x, x.stride(0), vw, g, temperature.contiguous(), cut.contiguous(), lse.contiguous(),
        qc, qc.stride(0), t2d if t2d is not None else cut, q.shape[2], w.contiguous(),
        part, vocab, n_split, SPLIT_=SPLIT, BLOCK=_BLOCK, REDUCED=t2d is not None,
    )  # fmt: skip
    return part.sum(dim=1).reshape(n, g)


def _check(
    logits: torch.Tensor,
    vw: int,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    t2d: torch.Tensor | None,
    d2t: torch.Tensor | None,
    w: torch.Tensor,
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [M, V] tensor, got {tuple(logits.shape)}")
    m, vocab = logits.shape
    if w.dim() != 2:
        raise ValueError(f"w must be [N, G], got {tuple(w.shape)}")
    n, g = w.shape
    if q.dim() != 3 or q.shape[:2] != (n, g):
        raise ValueError(f"q must be [{n}, {g}, K], got {tuple(q.shape)}")
    k = q.shape[2]
    if g >= vw or n * vw > m:
        raise ValueError(f"{n} lanes of {vw} rows with {g} columns need {n * vw} logits rows")
    if (t2d is None) != (d2t is None):
        raise ValueError("t2d and d2t come together (both None: the full vocabulary)")
    if t2d is None and k != vocab:
        raise ValueError(f"q over {k} draft ids needs t2d [{vocab}] and d2t [{k}]")
    if t2d is not None and (tuple(t2d.shape) != (vocab,) or tuple(d2t.shape) != (k,)):
        raise ValueError(f"t2d must be [{vocab}] and d2t [{k}]")
    for name, tensor, shape in (("temperature", temperature, (n,)), ("cut", cut, (m,)),
                                ("lse", lse, (m,))):  # fmt: skip
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(tensor.shape)}")
    if any(t.dtype != torch.float32 for t in (temperature, cut, lse, q, w)):
        raise ValueError("temperature, cut, lse, q and w must be float32")
    if any(t.device != logits.device for t in (temperature, cut, lse, q, w)):
        raise ValueError(f"every tensor must be on the logits' device ({logits.device})")


block_overlap = kernel_op(
    "block_overlap",
    triton=block_overlap_triton,
    reference=block_overlap_reference,
    device_of="logits",
    check=_check,
)
