"""A decode or verify step's q/k norms, RoPE, K/V store and split-KV attention: two launches.

:func:`paged_rope_attention` is :func:`~unimem_kernel.kv_store.rope_store_kv` followed by
:func:`~unimem_kernel.paged_attention.paged_verify_attention` over the same caches, with the
first launch folded into the second's split-KV launch (the combine stays). At one request a
Gemma 3 layer's RoPE + store launch cost about 2 µs of kernel and 1 µs of graph gap against
the attention's 7-10 µs (H100, ``docs/results.md``); here no program waits for another:

- every split-KV program loads its tile's raw queries and rotates them (after their
  zero-centred norms with ``qk_norm``) in registers (``fused_rope.norm_rope_rows``);
- the program whose splits hold a new token's position (split ``pos // SPLIT``, program
  ``split % P``) rotates that token's key for its KV head, stores it and the value at the
  token's write slot (zeros in the sink page, as ``rope_store_kv`` does), and passes a
  barrier before its loop reads its keys from the cache; no other program reads those
  positions, so nothing crosses programs.

Contract: the arguments of ``rope_store_kv`` (``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T,
Hkv, Dv]``, ``cos, sin [T, R/2]``, the caches, ``slots [T]``, ``qk_norm``) and of
``paged_verify_attention`` (``cu_seqlens_q``, ``cache_seqlens``, ``page_table``, ``q_len``,
``max_seqlen_k``, ``scale``, ``window``, ``sinks``, ``out``, the work split); returns ``o [T,
Hq, Dv]`` (with ``partials``, launch 1's :class:`~unimem_kernel.paged_attention.AttentionPartials`
for a consumer that merges them in its own launch; one partial holding the output where the
two ops ran) and leaves the rotated keys and the values in the caches. Each token's slot must be
where the table places its position (the write window's slots are), or the sink.

Numerics: the rotation rounds every product and sum as ``rope_store_kv`` does, so without
``qk_norm`` the cache and the output equal the two ops' bit for bit; with it, the norm's sum
of squares is one reduction over the head (``rope_store_kv`` adds two halves' sums), which
may move ``rstd`` by an ulp. The same query tile, splits and merge as
``paged_verify_attention``: its pattern independence holds here too.

Where the split-KV kernel takes more than one query tile per request (a verify wider than 16
rows, or a GQA group over 8 with more than 8 rows), or its query tile is too large to rotate
in registers without spilling (more than 64 rows of heads of 256: Qwen3-Next's verify), and
off the Triton path, the two ops run one after the other: the reference
(:func:`~unimem_kernel.paged_attention.rope_fusable` decides).
"""

from __future__ import annotations

import torch

from unimem_kernel._dispatch import kernel_op
from unimem_kernel.fused_common import FUSED_SWITCH
from unimem_kernel.kv_store import _check_rope_store, rope_store_kv
from unimem_kernel.paged_attention import (
    AttentionPartials,
    _check,
    launch_split_kv,
    paged_verify_attention,
    rope_fusable,
)

__all__ = ["paged_rope_attention", "paged_rope_attention_reference", "paged_rope_attention_triton"]


def paged_rope_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    q_len: int,
    max_seqlen_k: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    kv_programs: int | None = None,
    partials: bool = False,
) -> torch.Tensor | AttentionPartials:
    """The q/k norms (with ``qk_norm``), RoPE and the K/V store, then split-KV paged
    attention (module docstring): :func:`~unimem_kernel.kv_store.rope_store_kv` and
    :func:`~unimem_kernel.paged_attention.paged_verify_attention`, one after the other."""
    q_rot = rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm=qk_norm)
    o = paged_verify_attention(
        q_rot, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, q_len=q_len,
        max_seqlen_k=max_seqlen_k, scale=scale, window=window, sinks=sinks, out=out,
        split_size=split_size, kv_programs=kv_programs,
    )  # fmt: skip
    return AttentionPartials.of_output(o) if partials else o


def paged_rope_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    q_len: int,
    max_seqlen_k: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    kv_programs: int | None = None,
    partials: bool = False,
) -> torch.Tensor | AttentionPartials:
    """Triton launcher of :func:`paged_rope_attention` (arguments checked): the split-KV
    launch with the RoPE and the store inside, then the combine; the two ops where the tile
    cannot take them (``paged_attention.rope_fusable``)."""
    if not rope_fusable(q.shape[1], k_cache.shape[2], q_len, q.shape[2]):
        return paged_rope_attention_reference(
            q, k, v, cos, sin, k_cache, v_cache, slots, cu_seqlens_q, cache_seqlens,
            page_table, q_len=q_len, max_seqlen_k=max_seqlen_k, scale=scale, window=window,
            sinks=sinks, qk_norm=qk_norm, out=out, split_size=split_size,
            kv_programs=kv_programs, partials=partials,
        )  # fmt: skip
    rope = {"k": k, "v": v, "cos": cos, "sin": sin, "slots": slots, "qk_norm": qk_norm}
    return launch_split_kv(
        q, k_cache, v_cache, cache_seqlens, page_table, q_len=q_len, max_seqlen_k=max_seqlen_k,
        scale=scale, window=window, sinks=sinks, out=out, split_size=split_size,
        kv_programs=kv_programs, rope=rope, partials=partials,
    )  # fmt: skip


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    q_len: int,
    max_seqlen_k: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    kv_programs: int | None = None,
    partials: bool = False,
) -> bool:
    kernels = _check_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm=qk_norm)
    _check(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, q_len, max_seqlen_k,
           scale, window, sinks, out)  # fmt: skip
    return kernels and q.dtype != torch.float64


paged_rope_attention = kernel_op(
    "paged_rope_attention",
    triton=paged_rope_attention_triton,
    reference=paged_rope_attention_reference,
    device_of="q",
    check=_check_args,
    switch=FUSED_SWITCH,
)
