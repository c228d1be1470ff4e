"""The attention backend interface: store a step's K/V into paged caches, then attend.

Caches. ``k_cache [num_pages, page_size, Hkv, Dk]`` and ``v_cache [num_pages, page_size,
Hkv, Dv]`` are per-layer views, typically ``as_strided`` into the arena: the page stride is the
page envelope (not ``page_size * Hkv * D``), and within a page the ``[page_size, Hkv, D]`` block
is contiguous. ``Dk`` may differ from ``Dv``. Physical page 0 is the sink: all zeros, read for
padded and tail columns, never live data.

Contract of ``forward(q, k, v, k_cache, v_cache, meta, swa=, window=, scale=)``:

1. ``store_kv``: new token ``t``'s ``k[t]``/``v[t]`` go to physical slot
   ``s = meta.write_slots(swa)[t]`` (page ``s // page_size``, offset ``s % page_size``). A slot
   in the sink page (``s < page_size``: padded lanes, unbound pages) receives zeros instead, so
   the sink stays all zeros whatever the padding holds.
2. attend: request ``b`` owns queries ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]`` (its last
   ``q_len_b`` tokens) and ``cache_seqlens[b]`` keys read through ``meta.table(swa)``: key
   position ``j`` is in page ``table[b, j // page_size]`` at offset ``j % page_size``. Query
   ``i`` sits at position ``p = cache_seqlens[b] - q_len_b + i`` and attends keys ``j <= p``;
   with a ``window`` ``W``, only keys ``j > p - W`` (``W`` keys including itself).
   ``out = softmax(scale * q k^T) v`` per head; GQA: query head ``h`` reads KV head
   ``h // (Hq // Hkv)``.

``swa`` selects the SWA page table and write slots (else FULL); ``window`` is independent of it
(None = full causal). Shapes: ``q [T, Hq, Dk]``, ``k [T, Hkv, Dk]``, ``v [T, Hkv, Dv]``,
``T = meta.num_tokens``; returns ``o [T, Hq, Dv]`` in ``q``'s dtype.

``invariant`` (a keyword of ``attend`` and ``forward``): the caller runs in batch-invariant mode
(``--enable-deterministic-inference``): a query row must get the same bits in every step kind
(extend, decode, verify) and batch, so a backend that picks kernels by step shape must not do so
(it uses one kernel for every step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from unimem.attention.metadata import AttentionMetadata
from unimem_kernel.kv_store import rope_store_kv, store_kv_paged

__all__ = ["AttentionBackend", "check_attention_args", "store_kv_paged"]


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Shape checks shared by backends (host metadata only, no device read)."""
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1]):
        raise ValueError(f"sinks must be [Hq = {q.shape[1]}], got {tuple(sinks.shape)}")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected q [T, Hq, Dk] and caches [pages, page_size, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, metadata has {meta.num_tokens}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    if k_cache.shape[1] != meta.page_size:
        raise ValueError(f"cache page size {k_cache.shape[1]} != metadata {meta.page_size}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head dim {q.shape[2]} != k_cache head dim {k_cache.shape[3]}")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")


class AttentionBackend(ABC):
    """Stores K/V at a step's write slots and attends through paged caches (module contract).

    ``store_kv`` and ``attend`` may be called separately (e.g. a layer that only writes
    context K/V, or attends twice); ``forward`` is store then attend. Neither allocates
    long-lived state; a backend that can run inside a CUDA graph says so in its docstring.
    """

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        swa: bool,
    ) -> None:
        """Write ``k [T, Hkv, Dk]``, ``v [T, Hkv, Dv]`` at ``meta.write_slots(swa)`` (shapes
        checked by :func:`~unimem_kernel.kv_store.store_kv_paged`)."""
        store_kv_paged(k, v, k_cache, v_cache, meta.write_slots(swa))

    def rope_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        swa: bool,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """RoPE on ``q`` and ``k`` (``unimem_kernel.rope_qk``'s contract; after their
        zero-centred norms when ``qk_norm = (q_weight, k_weight, eps)``), then what
        :meth:`store_kv` does with the rotated ``k`` and ``v``, in one pass
        (:func:`~unimem_kernel.kv_store.rope_store_kv`: the rotated K goes straight into
        the cache). Returns the rotated ``q``. A backend that overrides :meth:`store_kv`
        must override this too."""
        return rope_store_kv(
            q, k, v, cos, sin, k_cache, v_cache, meta.write_slots(swa), qk_norm=qk_norm
        )

    @abstractmethod
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
        invariant: bool = False,
    ) -> torch.Tensor:
        """Attention of ``q [T, Hq, Dk]`` over the paged caches; returns ``[T, Hq, Dv]``.
        ``sinks [Hq]`` (float32): per-head logits that join every softmax without a value
        (gpt-oss's attention sinks); None for none. ``invariant``: see the module
        docstring."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        swa: bool,
        window: int | None,
        scale: float,
        sinks: torch.Tensor | None = None,
        invariant: bool = False,
    ) -> torch.Tensor:
        """``store_kv`` then ``attend`` (see the module docstring for the full contract)."""
        self.store_kv(k, v, k_cache, v_cache, meta, swa=swa)
        return self.attend(
            q, k_cache, v_cache, meta, swa=swa, window=window, scale=scale, sinks=sinks,
            invariant=invariant,
        )  # fmt: skip
