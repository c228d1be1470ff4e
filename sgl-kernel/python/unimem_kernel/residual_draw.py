"""The last token of a sampled verify step, drawn over the target's vocabulary in one pass.

Speculative sampling commits, per lane, the accepted drafts and then one token drawn from the
verify row the chain stopped at (``unimem.speculative.spec_sampling``): after a rejection at
column ``c`` from the residual ``norm(max(0, p_c - q_c))``; after a full chain (``c`` at the
chain's end) from ``p_c`` itself; and from ``p_c`` too where the residual has no mass.

``residual_draw(logits, vw, col, end, temperature, cut, lse, q, t2d, point, draft, keys,
weight=None)``
draws that token for every lane ``b`` without materialising ``p``, ``q`` or the residual:

- ``p`` is row ``r = b * vw + col[b]`` of ``logits [M, V]`` tempered (``s = logits / t``,
  divided as torch divides, ``t = temperature[b]``), the values ``s >= cut[r]`` kept, each
  ``exp(s - lse[r])`` — ``lse [M]`` the log-sum-exp of each row's kept values, as
  :func:`unimem_kernel.greedy_pick.tempered_token_stats` returns it with the drafts'
  probabilities;
- ``q`` is the proposal of column ``col[b]`` when ``col[b] < end[b]`` (else 0: the bonus
  row): ``q [N, G, K]`` over the drafter's ``K``-token vocabulary read through ``t2d [V]``
  (int64: the draft id of each target id, ``K`` off the draft vocabulary — the drafter's
  ``t2d`` buffer; ``None`` when ``K == V``), or the point mass on ``draft[b, col[b]]``
  where ``point[b, col[b]]`` (the acceptance control replaced that draft); with ``weight
  [N]`` (float32, optional) the drafter's proposal divided by ``weight[b]`` first (block
  verification's ``norm(max(0, w p - q))`` is ``norm(max(0, p - q / w))``; the point mass
  stays 1, which no ``w p`` reaches);
- the token is the Gumbel-max draw over ``log(max(0, p - q))`` with the noise of
  ``keys[b]`` (the uniform of :func:`unimem_kernel.sampling.hash_uniform`), which draws from
  the normalised residual without computing its mass; where no token has ``p > q``, the same
  draw over ``log p`` (equivalently over ``s``, a constant apart). A lane of temperature 0 gets
  its row's first argmax (the caller keeps greedy lanes' own tokens).

Two launches on fixed grids, no host reads (capturable): per (lane, chunk of :data:`SPLIT`
values) the best residual score and the best ``p`` score with their first indices; per lane
the chunks combined in index order. What the composed torch code did in ~20 launches and ~15
passes over a ``[bs, V]`` row (gather the row, temper, softmax, scatter the proposal, the
point mass, clamp, sum, normalise, log, draw) is one read of the row. The reference
(:func:`residual_draw_reference`) is that composition; tokens agree but for draws decided
within float32 rounding (the kernel's ``p`` is ``exp(s - lse)``, the reference's a softmax).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.sampling import _uniform_u64, gumbel_noise

__all__ = [
    "SPLIT",
    "residual_draw",
    "residual_draw_reference",
    "residual_draw_triton",
]

SPLIT = 4096
"""Values of a row per program of the first launch (64 programs a lane at 262 144)."""
_BLOCK = 1024
_BIG = tl.constexpr(2**62)


@triton.jit
def _residual_partial_kernel(
    x_ptr, stride_x, vw, col_ptr, end_ptr, t_ptr, cut_ptr, lse_ptr, q_ptr, stride_qn,
    stride_qc, t2d_ptr, K, point_ptr, draft_ptr, G, keys_ptr, w_ptr, part_ptr, idx_ptr, V,
    n_split, SPLIT_: tl.constexpr, BLOCK: tl.constexpr, REDUCED: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    """Program ``(lane, sp)``: over chunk ``sp`` of the lane's row, ``part[.., 0]`` the best
    residual score ``log(p - q) + g`` (``-inf`` where no ``p > q``) and ``part[.., 1]`` the
    best ``p`` score ``s + g`` (``s`` alone on a temperature-0 lane), ``idx`` their first
    indices."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    col = tl.load(col_ptr + b).to(tl.int64)
    end = tl.load(end_ptr + b).to(tl.int64)
    row = b * vw + col
    t = tl.load(t_ptr + b).to(tl.float32)
    live = t > 0
    cut = tl.where(live, tl.load(cut_ptr + row).to(tl.float32), float("-inf"))
    t = tl.where(live, t, 1.0)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    q_on = live & (col < end)
    cq = tl.minimum(col, G - 1)
    is_point = tl.load(point_ptr + b * G + cq) != 0
    ptok = tl.load(draft_ptr + b * G + cq).to(tl.int64)
    key = tl.load(keys_ptr + b).to(tl.uint64)
    if SCALED:
        w = tl.load(w_ptr + b).to(tl.float32)
    q_row = q_ptr + b * stride_qn + cq * stride_qc
    cols = tl.arange(0, BLOCK)
    best_r = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_ri = tl.zeros((BLOCK,), tl.int64)
    best_p = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_pi = tl.zeros((BLOCK,), tl.int64)
    start = sp.to(tl.int64) * SPLIT_
    for off in range(0, SPLIT_, BLOCK):
        idx = start + off + cols
        inside = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=inside, other=float("-inf"))
        s = tl.math.div_rn(x.to(tl.float32), t)
        kept = inside & (s >= cut)
        p = tl.where(kept, tl.exp(s - lse), 0.0)
        if REDUCED:
            d = tl.load(t2d_ptr + idx, mask=inside, other=K)
            qv = tl.load(q_row + d, mask=inside & (d < K), other=0.0)
        else:
            qv = tl.load(q_row + idx, mask=inside, other=0.0)
        if SCALED:
            qv = tl.math.div_rn(qv, w)
        qv = tl.where(is_point, tl.where(idx == ptok, 1.0, 0.0), qv)
        qv = tl.where(q_on, qv, 0.0)
        g = -tl.log(-tl.log(_uniform_u64(key, idx.to(tl.uint64))))
        r = p - qv
        rs = tl.where(kept & (r > 0), tl.log(r) + g, float("-inf"))
        rs = tl.where(live, rs, float("-inf"))
        ps = tl.where(kept, s + tl.where(live, g, 0.0), float("-inf"))
        best_ri = tl.where(rs > best_r, idx, best_ri)  # strictly: a lane keeps its first
        best_r = tl.maximum(best_r, rs)
        best_pi = tl.where(ps > best_p, idx, best_pi)
        best_p = tl.maximum(best_p, ps)
    top_r = tl.max(best_r, axis=0)
    top_p = tl.max(best_p, axis=0)
    out = b * n_split + sp
    tl.store(part_ptr + out * 2 + 0, top_r)
    tl.store(part_ptr + out * 2 + 1, top_p)
    tl.store(idx_ptr + out * 2 + 0, tl.min(tl.where(best_r == top_r, best_ri, _BIG), axis=0))
    tl.store(idx_ptr + out * 2 + 1, tl.min(tl.where(best_p == top_p, best_pi, _BIG), axis=0))


@triton.jit
def _residual_pick_kernel(part_ptr, idx_ptr, out_ptr, n_split, BS: tl.constexpr):
    """Program ``lane``: its chunks combined in index order — the residual draw where some
    token has ``p > q``, else the draw over ``p``."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BS)
    mask = k < n_split
    base = b * n_split + k
    r = tl.load(part_ptr + base * 2 + 0, mask=mask, other=float("-inf"))
    p = tl.load(part_ptr + base * 2 + 1, mask=mask, other=float("-inf"))
    ri = tl.load(idx_ptr + base * 2 + 0, mask=mask, other=_BIG)
    pi = tl.load(idx_ptr + base * 2 + 1, mask=mask, other=_BIG)
    top_r = tl.max(r, axis=0)
    top_p = tl.max(p, axis=0)
    tok_r = tl.min(tl.where(r == top_r, ri, _BIG), axis=0)
    tok_p = tl.min(tl.where(p == top_p, pi, _BIG), axis=0)
    tl.store(out_ptr + b, tl.where(top_r > float("-inf"), tok_r, tok_p))


def residual_draw_reference(
    logits: torch.Tensor,
    vw: int,
    col: torch.Tensor,
    end: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    t2d: torch.Tensor | None,
    point: torch.Tensor,
    draft: torch.Tensor,
    keys: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` int64: each lane's last token (module docstring). ``logits [M, V]`` (any float
    dtype, computed in float32; ``M >= N * vw``: lane ``b``'s rows are ``b * vw ..``),
    ``col [N]`` and ``end [N]`` (int64: the row drawn from, in ``0 .. G``, and the chain's
    end — ``q`` counts as 0 at ``col >= end``), ``temperature [N]`` float32, ``cut [M]`` and
    ``lse [M]`` float32 (per logits row: the kept values' lower bound, ``-inf`` for none, and
    their log-sum-exp), ``q [N, G, K]`` float32, ``t2d [V]`` int64 or None (``K == V``),
    ``point [N, G]`` bool, ``draft [N, G]`` int64 target ids, ``keys [N]`` int64, ``weight
    [N]`` float32 or None (the proposal's divisor). ``G >= 1``."""
    n, vocab = col.shape[0], logits.shape[1]
    lane = torch.arange(n, device=logits.device)
    row = lane * vw + col.long()
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    s = logits[row].float() / t[:, None]
    kept = s >= torch.where(live, cut[row].float(), -math.inf)[:, None]
    p = torch.where(kept, torch.exp(s - lse[row].float()[:, None]), 0.0)
    cq = col.long().clamp(max=q.shape[1] - 1)
    qd = q[lane, cq].float()  # [N, K]
    if weight is not None:
        qd = qd / weight.float()[:, None]
    if t2d is None:
        qt = qd
    else:
        k = qd.shape[1]
        qt = torch.where(t2d < k, qd[:, t2d.clamp(max=k - 1)], 0.0)
    ptok = draft[lane, cq].long()
    onehot = torch.zeros_like(qt).scatter_(1, ptok[:, None], 1.0)
    qt = torch.where(point[lane, cq][:, None], onehot, qt)
    qt = qt * (live & (col.long() < end.long())).float()[:, None]
    g = gumbel_noise(keys.long(), vocab)
    r = p - qt
    rs = torch.where(live[:, None] & kept & (r > 0), torch.log(r) + g, -math.inf)
    ps = torch.where(kept, s + torch.where(live[:, None], g, 0.0), -math.inf)
    some = torch.isfinite(rs).any(dim=-1)
    return torch.where(some, rs.argmax(dim=-1), ps.argmax(dim=-1))


def residual_draw_triton(
    logits: torch.Tensor,
    vw: int,
    col: torch.Tensor,
    end: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    t2d: torch.Tensor | None,
    point: torch.Tensor,
    draft: torch.Tensor,
    keys: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`residual_draw` (arguments already checked): two launches."""
    n, vocab = col.shape[0], logits.shape[1]
    dev = logits.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    qc = q if q.stride(2) == 1 else q.contiguous()
    n_split = triton.cdiv(vocab, SPLIT)
    part = torch.empty(n, n_split, 2, dtype=torch.float32, device=dev)
    idx = torch.empty(n, n_split, 2, dtype=torch.int64, device=dev)
    point_u8 = point.contiguous().view(torch.uint8)
    _residual_partial_kernel[(n, n_split)](
        x, x.stride(0), vw, col.contiguous(), end.contiguous(), temperature.contiguous(),
        cut.contiguous(), lse.contiguous(), qc, qc.stride(0), qc.stride(1),
        t2d if t2d is not None else col, q.shape[2], point_u8, draft.contiguous(), q.shape[1],
        keys.contiguous(), weight.contiguous() if weight is not None else temperature, part,
        idx, vocab, n_split, SPLIT_=SPLIT, BLOCK=_BLOCK, REDUCED=t2d is not None,
        SCALED=weight is not None,
    )  # fmt: skip
    _residual_pick_kernel[(n,)](part, idx, out, n_split, BS=next_pow2(n_split), num_warps=1)
    return out


def _check(
    logits: torch.Tensor,
    vw: int,
    col: torch.Tensor,
    end: torch.Tensor,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    t2d: torch.Tensor | None,
    point: torch.Tensor,
    draft: torch.Tensor,
    keys: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [M, V] tensor, got {tuple(logits.shape)}")
    m, vocab = logits.shape
    n = col.shape[0]
    if q.dim() != 3 or q.shape[0] != n or q.shape[1] < 1:
        raise ValueError(f"q must be [{n}, G >= 1, K], got {tuple(q.shape)}")
    g, k = q.shape[1], q.shape[2]
    if vw < 1 or n * vw > m:
        raise ValueError(f"{n} lanes of {vw} rows need {n * vw} logits rows, got {m}")
    shapes = {
        "col": (col, (n,)), "end": (end, (n,)), "temperature": (temperature, (n,)),
        "cut": (cut, (m,)), "lse": (lse, (m,)), "point": (point, (n, g)),
        "draft": (draft, (n, g)), "keys": (keys, (n,)),
    }  # fmt: skip
    if weight is not None:
        shapes["weight"] = (weight, (n,))
    if t2d is not None:
        shapes["t2d"] = (t2d, (vocab,))
    elif k != vocab:
        raise ValueError(f"q over {k} draft ids needs t2d [{vocab}] (target id -> draft id)")
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(tensor.shape)}")
        if tensor.device != logits.device:
            raise ValueError(f"{name} must be on the logits' device ({logits.device})")
    if q.device != logits.device:
        raise ValueError(f"q must be on the logits' device ({logits.device})")
    if any(t.dtype != torch.float32 for t in (temperature, cut, lse, q)):
        raise ValueError("temperature, cut, lse and q must be float32")
    if weight is not None and weight.dtype != torch.float32:
        raise ValueError("weight must be float32")
    if point.dtype != torch.bool:
        raise ValueError("point must be bool")
    if t2d is not None and t2d.dtype != torch.int64:
        raise ValueError("t2d must be int64")
    if any(t.dtype != torch.int64 for t in (col, end, draft, keys)):
        raise ValueError("col, end, draft and keys must be int64")


residual_draw = kernel_op(
    "residual_draw",
    triton=residual_draw_triton,
    reference=residual_draw_reference,
    device_of="logits",
    check=_check,
)
