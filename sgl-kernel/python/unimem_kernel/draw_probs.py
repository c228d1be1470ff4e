"""A sampled token together with the distribution it was drawn from, in two launches.

``draw_with_probs(logits, temperature, cut, keys)``, per row of ``logits [N, V]`` (any float
dtype, computed in float32): with ``t = temperature[n] > 0`` the tempered row ``s = logits /
t`` (divided as torch divides), the values ``s >= cut[n]`` kept, and

- ``tokens[n]``: the Gumbel-max draw over the kept values with the noise of ``keys[n]`` —
  :func:`unimem_kernel.sampling.gumbel_argmax` of ``(s, cut, keys)``, the same token;
- ``probs[n]``: ``softmax`` of the kept values (exact zeros elsewhere), float32;
- ``token_probs[n]``: ``probs[n, tokens[n]]``, the very value written there;

and for a row of temperature 0, its first ``argmax`` with the point mass on it (probability
1.0). This is what a speculative-sampling drafter keeps of each draft column: the proposal, its
distribution ``q`` and ``q(x)`` (:mod:`unimem.speculative.spec_sampling`). Composed of torch
ops (a softmax, an argmax, a one-hot, the log of the distribution and a draw over it) one
column cost ~30 launches, a DSPARK verify step's seven columns ~200 of its ~490.

Two launches on fixed grids, no host reads (capturable). The first splits every row into
chunks of :data:`SPLIT` values, one program each, and keeps per chunk the maximum of the kept
values with the rescaled sum of their exponentials (an online log-sum-exp), the best kept
score ``s + g`` with its first index, and the raw maximum with its first index. The second,
one program per chunk again, combines its row's partials in index order (so the token, the
log-sum-exp and the argmax do not depend on the split or on other rows) and writes its chunk of
``probs``; chunk 0 also writes the token and its probability. The probabilities agree with
torch's softmax to float32 rounding (``exp`` and the sum's order); the token is the draw's
(its noise may differ from the torch reference's in the last ulp, as the draw's does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.sampling import _uniform_u64, gumbel_argmax_reference

__all__ = [
    "SPLIT",
    "draw_with_probs",
    "draw_with_probs_reference",
    "draw_with_probs_triton",
]

SPLIT = 2048
"""Values of a row per program (a draft vocabulary of 32 768: 16 programs a row)."""
_BLOCK = 512
_BIG = tl.constexpr(2**62)


@triton.jit
def _draw_partial_kernel(
    x_ptr, t_ptr, c_ptr, k_ptr, part_ptr, idx_ptr, V, stride_x, n_split,
    SPLIT_: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(row, sp)``: chunk ``sp`` of the row's partials — ``part[.., 0..3]`` the kept
    maximum, the sum of ``exp(s - max)`` over kept values, the best kept score, the raw
    maximum; ``idx[.., 0..1]`` the best score's and the raw maximum's first indices."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    t = tl.load(t_ptr + row).to(tl.float32)
    live = t > 0
    cut = tl.where(live, tl.load(c_ptr + row).to(tl.float32), float("-inf"))
    t = tl.where(live, t, 1.0)
    key = tl.load(k_ptr + row).to(tl.uint64)
    mv = tl.full((BLOCK,), float("-inf"), tl.float32)
    sv = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.zeros((BLOCK,), tl.int64)
    raw = tl.full((BLOCK,), float("-inf"), tl.float32)
    raw_i = tl.zeros((BLOCK,), tl.int64)
    start = sp.to(tl.int64) * SPLIT_
    for off in range(0, SPLIT_, BLOCK):
        idx = start + off + cols
        inside = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=inside, other=float("-inf"))
        x = x.to(tl.float32)
        s = tl.math.div_rn(x, t)
        kept = inside & (s >= cut)
        sk = tl.where(kept, s, float("-inf"))
        # the online log-sum-exp of the kept values
        new_m = tl.maximum(mv, sk)
        alpha = tl.where(mv == new_m, 1.0, tl.exp(mv - new_m))
        e = tl.where(sk == float("-inf"), 0.0, tl.exp(sk - new_m))
        sv = sv * alpha + e
        mv = new_m
        # the Gumbel draw (the noise of unimem_kernel.sampling's draw at this index)
        g = -tl.log(-tl.log(_uniform_u64(key, idx.to(tl.uint64))))
        score = tl.where(kept, s + g, float("-inf"))
        best_i = tl.where(score > best, idx, best_i)  # strictly: a lane keeps its first
        best = tl.maximum(best, score)
        raw_i = tl.where(x > raw, idx, raw_i)
        raw = tl.maximum(raw, x)
    m = tl.max(mv, axis=0)
    s_sum = tl.sum(sv * tl.where(mv == m, 1.0, tl.exp(mv - m)), axis=0)
    b = tl.max(best, axis=0)
    r = tl.max(raw, axis=0)
    out = row * n_split + sp
    tl.store(part_ptr + out * 4 + 0, m)
    tl.store(part_ptr + out * 4 + 1, s_sum)
    tl.store(part_ptr + out * 4 + 2, b)
    tl.store(part_ptr + out * 4 + 3, r)
    tl.store(idx_ptr + out * 2 + 0, tl.min(tl.where(best == b, best_i, _BIG), axis=0))
    tl.store(idx_ptr + out * 2 + 1, tl.min(tl.where(raw == r, raw_i, _BIG), axis=0))


@triton.jit
def _draw_write_kernel(
    x_ptr, t_ptr, c_ptr, part_ptr, idx_ptr, tok_ptr, p_ptr, px_ptr, V, stride_x, stride_p,
    n_split, SPLIT_: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """Program ``(row, sp)``: the row's partials combined in index order, then chunk ``sp`` of
    ``probs``; chunk 0 writes the token and its probability."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    k = tl.arange(0, BS)
    mask = k < n_split
    base = row * n_split + k
    m = tl.load(part_ptr + base * 4 + 0, mask=mask, other=float("-inf"))
    s = tl.load(part_ptr + base * 4 + 1, mask=mask, other=0.0)
    b = tl.load(part_ptr + base * 4 + 2, mask=mask, other=float("-inf"))
    r = tl.load(part_ptr + base * 4 + 3, mask=mask, other=float("-inf"))
    bi = tl.load(idx_ptr + base * 2 + 0, mask=mask, other=_BIG)
    ri = tl.load(idx_ptr + base * 2 + 1, mask=mask, other=_BIG)
    big_m = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - big_m)), axis=0)
    lse = big_m + tl.log(total)
    top = tl.max(b, axis=0)
    drawn = tl.min(tl.where(b == top, bi, _BIG), axis=0)
    raw_top = tl.max(r, axis=0)
    greedy = tl.min(tl.where(r == raw_top, ri, _BIG), axis=0)
    t = tl.load(t_ptr + row).to(tl.float32)
    live = t > 0
    cut = tl.where(live, tl.load(c_ptr + row).to(tl.float32), float("-inf"))
    t = tl.where(live, t, 1.0)
    cols = tl.arange(0, BLOCK)
    start = sp.to(tl.int64) * SPLIT_
    for off in range(0, SPLIT_, BLOCK):
        idx = start + off + cols
        inside = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=inside, other=float("-inf"))
        sx = tl.math.div_rn(x.to(tl.float32), t)
        prob = tl.where(sx >= cut, tl.exp(sx - lse), 0.0)
        prob = tl.where(live, prob, tl.where(idx == greedy, 1.0, 0.0))
        tl.store(p_ptr + row * stride_p + idx, prob, mask=inside)
    if sp == 0:
        tok = tl.where(live, drawn, greedy)
        sx = tl.math.div_rn(tl.load(x_ptr + row * stride_x + tok).to(tl.float32), t)
        tl.store(tok_ptr + row, tok)
        tl.store(px_ptr + row, tl.where(live, tl.exp(sx - lse), 1.0))


def draw_with_probs_reference(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [N] int64, probs [N, V] float32, token_probs [N] float32)`` of ``logits [N,
    V]`` with per-row ``temperature [N]``, ``cut [N]`` (float32; ``-inf``: keep every value)
    and draw ``keys [N]`` (int64, :func:`unimem_kernel.sampling.position_keys`): module
    docstring."""
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    cut = torch.where(live, cut.float(), -math.inf)
    probs = torch.softmax(torch.where(scaled >= cut[:, None], scaled, -math.inf), dim=-1)
    greedy = torch.argmax(logits, dim=-1)
    drawn = gumbel_argmax_reference(
        scaled.contiguous(), cut.contiguous(), keys.long(), torch.empty_like(greedy)
    )
    onehot = torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0)
    probs = torch.where(live[:, None], probs, onehot)
    tokens = torch.where(live, drawn, greedy)
    return tokens, probs, probs.gather(1, tokens[:, None])[:, 0]


def draw_with_probs_triton(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`draw_with_probs` (arguments already checked): two launches."""
    n, v = logits.shape
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    dev = x.device
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    probs = torch.empty(n, v, dtype=torch.float32, device=dev)
    token_probs = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, probs, token_probs
    n_split = triton.cdiv(v, SPLIT)
    part = torch.empty(n, n_split, 4, dtype=torch.float32, device=dev)
    idx = torch.empty(n, n_split, 2, dtype=torch.int64, device=dev)
    t = temperature.float().contiguous()
    c = cut.float().contiguous()
    k = keys.long().contiguous()
    _draw_partial_kernel[(n, n_split)](x, t, c, k, part, idx, v, x.stride(0), n_split,
                                       SPLIT_=SPLIT, BLOCK=_BLOCK)  # fmt: skip
    _draw_write_kernel[(n, n_split)](
        x, t, c, part, idx, tokens, probs, token_probs, v, x.stride(0), probs.stride(0),
        n_split, SPLIT_=SPLIT, BLOCK=_BLOCK, BS=next_pow2(n_split),
    )  # fmt: skip
    return tokens, probs, token_probs


def _check(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [N, V] tensor, got {tuple(logits.shape)}")
    n = logits.shape[0]
    for name, r in (("temperature", temperature), ("cut", cut), ("keys", keys)):
        if r.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(r.shape)}")
        if r.device != logits.device:
            raise ValueError(f"{name} must be on the logits' device")
    if keys.is_floating_point():
        raise ValueError("keys must be an integer tensor")


draw_with_probs = kernel_op(
    "draw_with_probs",
    triton=draw_with_probs_triton,
    reference=draw_with_probs_reference,
    device_of="logits",
    check=_check,
)
