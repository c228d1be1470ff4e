"""Pure-torch reference attention over paged (arena-strided) caches: the CPU backend and the
oracle the GPU backends are tested against.

Each request is computed on its own, with the same ops whatever else is in the batch: gather
its pages through the page table into contiguous ``[L, Hkv, D]`` keys and values, repeat KV
heads for GQA, mask (causal, and the sliding window when given), softmax, weighted sum. Scores
and softmax run in float64 for float64 inputs (the CPU engine) and in float32 otherwise; the
output is cast back to the input dtype. Nothing reduces across requests, so a request's output
is bit-identical whether it runs alone or in any batch: the static and unified memory modes
(same data, different physical pages) give identical results.

Only the columns a request needs are gathered: pages ``[first, ceil(L / page_size))``, where
``first`` is the page of the oldest key any of its queries can see (0 without a window), and
only the live ``L`` token rows of them are read. Slots past a request's length in its last
page, and pages outside its table, are never read.

It reads the lengths on the host (``tolist``): free on CPU, a synchronisation on GPU, where this
backend is an eager, slow reference and must not be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from unimem.attention.backend import AttentionBackend, check_attention_args
from unimem.attention.metadata import AttentionMetadata

__all__ = ["TorchReferenceBackend", "attend_one_request"]


def attend_one_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_key_pos: int,
    *,
    window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one request's ``q [n_q, Hq, Dk]`` over contiguous ``k [n_k, Hkv, Dk]``,
    ``v [n_k, Hkv, Dv]`` whose row ``r`` holds key position ``first_key_pos + r``; the queries
    are the last ``n_q`` positions (``first_key_pos + n_k - n_q ..``). ``sinks [Hq]``: per-head
    logits that join the softmax without a value. Returns ``[n_q, Hq, Dv]`` in ``q``'s
    dtype."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = hq // hkv
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), kf) * scale
    end = first_key_pos + n_k
    q_pos = torch.arange(end - n_q, end, device=q.device)
    k_pos = torch.arange(first_key_pos, end, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc)[:, None, None].expand(-1, n_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


class TorchReferenceBackend(AttentionBackend):
    """Reference backend (CPU and GPU, eager): see the module docstring."""

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        swa: bool,
        window: int | None,
        scale: float,
        sinks: torch.Tensor | None = None,
        invariant: bool = False,  # one computation per request in every step: always invariant
    ) -> torch.Tensor:
        check_attention_args(q, k_cache, v_cache, meta, window, sinks)
        table = meta.table(swa)
        page_size = meta.page_size
        num_heads = q.shape[1]
        out = q.new_empty(q.shape[0], num_heads, v_cache.shape[3])
        cu_q = meta.cu_seqlens_q.tolist()
        lens = meta.cache_seqlens.tolist()
        for b, seq_len in enumerate(lens):
            q0, q1 = cu_q[b], cu_q[b + 1]
            n_q = q1 - q0
            if n_q == 0:
                continue
            if n_q > seq_len:
                raise ValueError(f"request {b}: {n_q} queries but only {seq_len} keys")
            lo = 0 if window is None else max(0, seq_len - n_q - window + 1)
            first_page = lo // page_size
            n_pages = -(-seq_len // page_size)
            pages = table[b, first_page:n_pages].long()
            base = first_page * page_size
            k = k_cache[pages].flatten(0, 1)[lo - base : seq_len - base]
            v = v_cache[pages].flatten(0, 1)[lo - base : seq_len - base]
            out[q0:q1] = attend_one_request(
                q[q0:q1], k, v, lo, window=window, scale=scale, sinks=sinks
            )
        return out
