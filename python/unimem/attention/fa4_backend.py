"""FlashAttention-4 (CuTe DSL, ``flash_attn.cute``) over arena-strided paged caches. GPU only.

Installed as ``flash-attn-4`` (tested against 4.0.0b36); imported lazily in the constructor so
that importing this module never needs it.

One call of ``flash_attn.cute.flash_attn_varlen_func`` per layer, with paged KV:

    flash_attn_varlen_func(
        q [T, Hq, Dk], k_cache [num_pages, page_size, Hkv, Dk], v_cache [..., Dv],
        cu_seqlens_q=[bs+1] int32, seqused_k=cache_seqlens [bs] int32,
        page_table=[bs, W] int32, max_seqlen_q=, max_seqlen_k=,
        softmax_scale=, causal=True, window_size=(W - 1, 0) or (None, None),
        num_splits=, pack_gqa=)

Facts relied on, read in the flash-attn-4 4.0.0b36 wheel (paths inside it; the upstream
repository Dao-AILab/flash-attention holds the same files):

- ``flash_attn/cute/interface.py`` ``flash_attn_varlen_func``: the 4th positional parameter is
  ``qv`` (MLA), so everything after ``v`` is passed by keyword here. It returns
  ``(out, lse)``; ``lse`` is None unless ``return_lse``. Its docstring: with paged KV loaded
  by TMA (a page holds whole key tiles) rows past ``seqused_k`` in a sequence's last page are
  loaded too, so they must be finite (the allocator zeroes pages it hands out); pages a
  sequence does not use may hold anything. ``max_seqlen_q/k`` host ints "must cover every
  CUDA graph replay" (we pass the builder's bounds).
- ``interface.py`` ``_flash_attn_fwd``: with ``page_table``, ``k``/``v`` are
  ``(num_pages, page_size, Hkv, D)``/``(..., Dv)``, ``cu_seqlens_k`` must be None (key
  lengths from ``seqused_k``), ``page_table`` is int32 ``(batch, max_pages_per_seq)`` with
  unit last stride; ``cu_seqlens_q``/``seqused_k`` int32 unit stride; q/k/v one dtype (fp16 or
  bf16). ``maybe_contiguous`` copies only tensors whose last stride is not 1, and
  ``cute_dsl_utils.py`` ``to_cute_tensor`` marks layouts dynamic except the unit-stride last
  dim (``assumed_align=16``): an arena view with the envelope as page stride is passed as is,
  and one compiled kernel serves every page stride. The view's data pointer must be 16-byte
  aligned and every non-unit stride a multiple of 16 bytes (TMA; the layout guarantees both).
  ``paged_kv.py`` forms row addresses from the tensor's own strides (``elem_pointer``), in
  int64, and reads page 0 for rows past ``seqused_k``.
- ``_validate_head_dims``: SM90 accepts any ``Dk``, ``Dv`` in 8..256 that are multiples of 8
  (bf16), so ``Dk != Dv`` (e.g. 192/128) is fine; SM100 accepts 8..128, (192, 128) or
  (256, 256). ``flash_fwd_sm90.py``: the cp.async paged path needs head dims that are
  multiples of 16 ("Paged KV does not support irregular head dim").
- ``_resolve_causal_local_window``: ``causal=True`` sets ``window_size_right = 0``; a
  ``window_size_left`` that is not None then makes the kernel *local*, with the
  bottom-right-aligned mask ``p - left <= j <= p + right`` where query ``i`` of a request sits
  at ``p = seqused_k - q_len + i``. Our window ``W`` (``j > p - W``) is
  ``window_size=(W - 1, 0)``; no window is ``(None, None)``.
- Paged path choice: ``paged_kv_tma = page_size == tile_n``. On SM90 ``tile_n`` is 128 for head
  dim <= 128 (``_tile_size_fwd_sm90``), so page 128 loads pages by TMA and 16/64 take the
  cp.async ``PagedKVManager`` path; both are supported on SM90 in this version (page sizes
  16, 64 and 128 run). SM90 asserts ``not is_split_kv``: keep ``num_splits=1``.
- Compile key (``_flash_attn_fwd``): dtype, head dims, GQA ratio, causal/local, which
  optional tensors are None (window *values* are runtime), tile sizes, split-KV, pack_gqa,
  arch, ``paged_kv_tma``, ``is_static_persistent`` (true when ``max_seqlen_q * Hq / Hkv``
  fits one query tile) and whether ``batch > 256`` (``BIN_BATCH_SEARCH_THRESH``: a
  batch-lookup aid is then built per call). So decode, verify and extend widths, and batch
  sizes on either side of 256, can be distinct kernels.

Split-KV for small decode/verify steps. FA4 on SM90 has no split-KV: one CTA per (request, KV
head) walks all its keys, so with few requests it leaves most of the GPU idle and its time is one
CTA's walk over the context, whatever the number of requests. A step whose metadata is
``uniform_q`` (decode, verify and the drafter's block) with at most ``split_kv_max_bs``
requests and at most :data:`SPLIT_KV_MAX_Q` rows per request attends instead through
:func:`unimem_kernel.paged_verify_attention` (splits of :func:`split_kv_keys` keys at absolute
positions, :func:`split_kv_programs` programs per (request, KV head), a fixed merge order).
Where FA4 catches up depends on the batch size and the head layout, so a step also needs
``batch x query heads x head dim`` <= :data:`SPLIT_KV_MAX_WORK`; both limits were chosen by
measurement (``docs/decisions.md``). The choice depends on the step's batch size, so a row's
bits can depend on its batch bucket: with ``invariant`` (batch-invariant mode) every step
takes FA4, as extend does, and rows do not.

Narrow query tile for short steps (SM90). FA4 sizes its query tile for prefill: 128 rows
(192 at head dim 64) in two consumer warpgroups. A decode or verify step packs only
``max_seqlen_q x Hq / Hkv`` rows per (request, KV head) — 32 for the small preset's verify
(8 tokens x 4 query heads), 64 for Qwen3-Next's and gpt-oss's — so most of the tile is padding
and each CTA carries a warpgroup that does no useful work. When those rows fit
:data:`NARROW_TILE_ROWS`, :func:`narrow_query_tile` gives a 64-row tile with FA4's own key-tile
width for the head dim, run by one consumer warpgroup (``num_threads`` 256). FA4's public
function takes no tile, so that call goes through ``flash_attn.cute.interface._flash_attn_fwd``
(private; in 4.0.0b36 it takes ``tile_mn`` and ``num_threads`` and is what the public function
calls); chosen by measurement at the three head layouts (``docs/decisions.md``). The tile
decides which rows share a CTA, not how a row reduces its keys: its outputs equal the
default tile's bit for bit (the GPU tests assert it at the three layouts), so batch-invariant
mode takes it too and a row still gets the same bits in extend (default tile), decode and
verify. Where the installed FA4 lacks that function or those parameters, the public call runs
(with a warning); on other GPUs than SM90 it always does.

CUDA graphs. Every variant (dtype, head dims, GQA ratio, window or not, query width class)
compiles on its first call (seconds); a first call inside ``torch.cuda.graph`` breaks the
capture. Call ``warmup`` eagerly for every variant a graph will record. The output tensor is
allocated by FA4 on each call (inside a graph: from the graph's pool, fixed address).

Compiled variants on disk. FA4 keeps what it compiles in memory only unless its persistent
cache is on (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, read when ``flash_attn.cute`` is
imported), so every server start compiled every variant again. :func:`enable_fa4_disk_cache`
(run before FA4's first import here) turns it on under ``<UNIMEM_CACHE_DIR>/fa4`` unless the
user set either of FA4's two variables (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0`` keeps it
off). FA4 files its entries under a fingerprint of its own sources and of the Python, CUTLASS
and TVM-FFI versions, and its compile keys hold the GPU architecture (flash-attn-4
4.0.0b36, ``flash_attn/cute/cache_utils.py``, ``interface.py``), so a changed install or GPU
compiles afresh instead of loading a stale kernel.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable

import torch

from unimem.attention.backend import AttentionBackend, check_attention_args
from unimem.attention.metadata import AttentionMetadata
from unimem_kernel import envs
from unimem_kernel.paged_attention import paged_verify_attention

__all__ = [
    "SPLIT_KV_KEYS",
    "SPLIT_KV_MAX_BS",
    "SPLIT_KV_MAX_Q",
    "SPLIT_KV_MAX_WORK",
    "NARROW_TILE_ROWS",
    "FA4Backend",
    "enable_fa4_disk_cache",
    "narrow_query_tile",
    "split_kv_batch",
    "split_kv_keys",
    "split_kv_programs",
    "takes_split_kv",
]

SPLIT_KV_MAX_BS = 16
"""Default ``FA4Backend.split_kv_max_bs``: the largest decode/verify batch that attends through
the split-KV kernel (chosen by measurement against FA4, ``docs/decisions.md``)."""

SPLIT_KV_MAX_WORK = 16 * 16 * 128
"""Most ``batch x query heads x head dim`` of a step that takes the split-KV kernel (with
``split_kv_max_bs``): the small preset's 16 requests of 16 heads of 128, 8 requests at
Qwen3-Next's and gpt-oss's head layouts (chosen by measurement against FA4,
``docs/decisions.md``)."""

SPLIT_KV_KEYS = 128
"""Keys per split of the split-KV kernel (chosen by measurement, ``docs/decisions.md``)."""

SPLIT_KV_MAX_Q = 16
"""Most query rows per request the split-KV path takes (a verify of up to 15 drafts)."""

NARROW_TILE_ROWS = 64
"""Most packed query rows per (request, KV head) — ``max_seqlen_q x Hq / Hkv`` with GQA
packing — that FA4 runs in the narrow 64-row tile (:func:`narrow_query_tile`)."""


def narrow_query_tile(
    max_seqlen_q: int, q_heads: int, kv_heads: int, dk: int, dv: int, *, local: bool
) -> tuple[int, int] | None:
    """FA4's ``(tile_m, tile_n)`` for a step whose requests have at most ``max_seqlen_q`` query
    rows, or ``None`` for FA4's default tiles (module docstring). The narrow tile applies when
    the packed rows (``max_seqlen_q x q_heads / kv_heads``; GQA packing is FA4's default) fit
    :data:`NARROW_TILE_ROWS` and the head dims are one of the layouts it was chosen at
    (``dk == dv`` in 64, 128, 256); its key tile is the one FA4 picks on SM90 for that head
    dim and masking (128 up to head dim 128; 80, or 64 with a window, at 256 — 128 at 256
    does not fit in shared memory with one consumer warpgroup)."""
    if dk != dv or dk not in (64, 128, 256) or kv_heads < 1 or q_heads % kv_heads:
        return None
    if max_seqlen_q * (q_heads // kv_heads) > NARROW_TILE_ROWS:
        return None
    if dk <= 128:
        return NARROW_TILE_ROWS, 128
    return NARROW_TILE_ROWS, 64 if local else 80


_NARROW_TILE_THREADS = 256  # one producer and one consumer warpgroup


def _narrow_tile_forward() -> Callable[..., object] | None:
    """FA4's internal forward when it takes ``tile_mn`` and ``num_threads`` on this GPU (SM90),
    else ``None`` with a warning (module docstring)."""
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return None
    enable_fa4_disk_cache()
    from flash_attn.cute import interface

    fwd = getattr(interface, "_flash_attn_fwd", None)  # private: checked, not assumed
    needed = {"tile_mn", "num_threads", "window_size_left", "window_size_right", "page_table"}
    if fwd is None or not needed <= set(inspect.signature(fwd).parameters):
        warnings.warn(
            "flash_attn.cute.interface._flash_attn_fwd does not take tile_mn / num_threads in "
            "this FA4 version: decode and verify steps use FA4's default query tile "
            "(tested: flash-attn-4 4.0.0b36)",
            stacklevel=3,
        )
        return None
    return fwd


def split_kv_keys(head_dim: int) -> int:
    """Keys per split of the split-KV kernel for heads of ``head_dim``: :data:`SPLIT_KV_KEYS`
    up to 128, half that above. The kernel's key block is half as long above 128 (shared
    memory), so both keep two blocks per split; at Gemma 3's heads of 256 a decode call took
    13.0 us with 64 keys against 16.8 with 128 (H100, ``docs/decisions.md``)."""
    return SPLIT_KV_KEYS if head_dim <= 128 else SPLIT_KV_KEYS // 2


def split_kv_programs(bs: int, kv_heads: int) -> int:
    """Programs per (request, KV head) of the split-KV kernel for ``bs`` requests of
    ``kv_heads`` KV heads: ``64 / bs``, at most ``256 / (bs * kv_heads)``, between 4 and 16
    (chosen by measurement at the small preset's, Qwen3-Next's and gpt-oss's head layouts,
    ``docs/decisions.md``)."""
    bs = max(bs, 1)
    return max(4, min(16, 64 // bs, 256 // (bs * max(kv_heads, 1))))


FA4_CACHE_SWITCH = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
FA4_CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def enable_fa4_disk_cache() -> bool:
    """Turn FA4's persistent compile cache on under ``<UNIMEM_CACHE_DIR>/fa4`` (module
    docstring) unless the user set :data:`FA4_CACHE_SWITCH` or :data:`FA4_CACHE_DIR`, or
    ``flash_attn.cute`` is already imported (FA4 has read them then). Whether it set them."""
    if "flash_attn.cute" in sys.modules:
        return False
    if os.environ.get(FA4_CACHE_SWITCH) is not None or os.environ.get(FA4_CACHE_DIR):
        return False
    os.environ[FA4_CACHE_DIR] = str(envs.cache_root() / "fa4")
    os.environ[FA4_CACHE_SWITCH] = "1"
    return True


_INSTALL_HINT = (
    "FA4Backend needs FlashAttention-4 (module flash_attn.cute), e.g. "
    "`pip install flash-attn-4==4.0.0b36` on a machine with an SM90/SM100 GPU"
)


def split_kv_batch(bs: int, max_bs: int, *, q_heads: int, head_dim: int) -> bool:
    """Whether a uniform step of ``bs`` requests with ``q_heads`` query heads of ``head_dim``
    is small enough for the split-KV kernel: 1 .. ``max_bs`` requests and ``bs x q_heads x
    head_dim`` at most :data:`SPLIT_KV_MAX_WORK`."""
    return 1 <= bs <= max_bs and bs * q_heads * head_dim <= SPLIT_KV_MAX_WORK


def takes_split_kv(
    meta: AttentionMetadata,
    max_bs: int,
    invariant: bool = False,
    *,
    q_heads: int,
    head_dim: int,
) -> bool:
    """Whether a step of ``meta`` attends through the split-KV kernel: a uniform step (decode,
    verify: ``meta.uniform_q``) of 1 .. ``max_bs`` requests and at most
    :data:`SPLIT_KV_MAX_Q` rows each, with ``batch x q_heads x head_dim`` at most
    :data:`SPLIT_KV_MAX_WORK`, outside batch-invariant mode (``invariant``)."""
    return (
        meta.uniform_q
        and not invariant
        and split_kv_batch(meta.batch_size, max_bs, q_heads=q_heads, head_dim=head_dim)
        and meta.max_seqlen_q <= SPLIT_KV_MAX_Q
    )


class FA4Backend(AttentionBackend):
    """Paged attention through ``flash_attn.cute.flash_attn_varlen_func`` (module docstring).

    ``num_splits``: split-KV factor passed to FA4 (1 = none; SM90 supports only 1; values
    other than 1 make FA4 allocate partial buffers per call). ``pack_gqa``: None lets FA4
    decide (packs query heads of one KV head into one tile when ``Hq > Hkv``).

    ``split_kv_max_bs``: decode/verify steps (``meta.uniform_q``) of at most this many
    requests — and within :data:`SPLIT_KV_MAX_WORK` for their head layout — attend through the
    split-KV Triton kernel instead (module docstring; 0: never).

    ``narrow_tile``: steps whose packed query rows fit :data:`NARROW_TILE_ROWS` run FA4 with
    the 64-row tile of :func:`narrow_query_tile` (module docstring; the same bits as the
    default tile); False keeps FA4's default tile everywhere.

    Store: the base class ``store_kv`` (``unimem_kernel.store_kv_paged``: one Triton launch
    for K and V through the strided views; capturable). Attend: capturable once warmed up.
    """

    def __init__(
        self,
        *,
        num_splits: int = 1,
        pack_gqa: bool | None = None,
        split_kv_max_bs: int = SPLIT_KV_MAX_BS,
        narrow_tile: bool = True,
    ) -> None:
        enable_fa4_disk_cache()
        try:
            from flash_attn.cute import flash_attn_varlen_func
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT}: {e}") from e
        if not torch.cuda.is_available():
            raise RuntimeError("FA4Backend needs a CUDA device")
        if not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
        if not isinstance(split_kv_max_bs, int) or split_kv_max_bs < 0:
            raise ValueError(f"split_kv_max_bs must be an int >= 0, got {split_kv_max_bs!r}")
        self._varlen = flash_attn_varlen_func
        self.num_splits = num_splits
        self.pack_gqa = pack_gqa
        self.split_kv_max_bs = split_kv_max_bs
        # with pack_gqa forced off the packed-rows rule does not hold: default tiles
        use_narrow = narrow_tile and pack_gqa is not False and num_splits == 1
        self._narrow_fwd = _narrow_tile_forward() if use_narrow else None

    def takes_split_kv(
        self, meta: AttentionMetadata, invariant: bool = False, *, q_heads: int, head_dim: int
    ) -> bool:
        """Whether ``attend`` runs ``meta``'s step of ``q_heads`` query heads of ``head_dim``
        through the split-KV kernel (:func:`takes_split_kv` with this backend's
        ``split_kv_max_bs``)."""
        return takes_split_kv(
            meta, self.split_kv_max_bs, invariant, q_heads=q_heads, head_dim=head_dim
        )

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
        check_attention_args(q, k_cache, v_cache, meta, window, sinks)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FA4 needs fp16/bf16, got {q.dtype}")
        if not (q.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
        if self.takes_split_kv(meta, invariant, q_heads=q.shape[1], head_dim=q.shape[2]):
            bs, kv_heads = meta.batch_size, k_cache.shape[2]
            return paged_verify_attention(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.cache_seqlens, meta.table(swa),
                q_len=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, scale=float(scale),
                window=window, sinks=sinks, split_size=split_kv_keys(q.shape[2]),
                kv_programs=split_kv_programs(bs, kv_heads),
            )  # fmt: skip
        left = None if window is None else window - 1
        right = None if left is None else 0
        args = {
            "cu_seqlens_q": meta.cu_seqlens_q,
            "max_seqlen_q": meta.max_seqlen_q,
            "max_seqlen_k": meta.max_seqlen_k,
            "seqused_k": meta.cache_seqlens,
            "page_table": meta.table(swa),
            "softmax_scale": float(scale),
            "causal": True,
            "pack_gqa": self.pack_gqa,
        }
        if sinks is not None:
            args["learnable_sink"] = sinks
        tile = None
        if self._narrow_fwd is not None:  # same bits as the default tile: also when invariant
            tile = narrow_query_tile(
                meta.max_seqlen_q, q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[3],
                local=window is not None,
            )  # fmt: skip
        if tile is not None:
            res = self._narrow_fwd(
                q, k_cache, v_cache, window_size_left=left, window_size_right=right,
                tile_mn=tile, num_threads=_NARROW_TILE_THREADS, **args,
            )  # fmt: skip
        else:
            res = self._varlen(
                q, k_cache, v_cache, window_size=(left, right), num_splits=self.num_splits,
                **args,
            )  # fmt: skip
        return res[0] if isinstance(res, tuple) else res

    def warmup(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        num_q_heads: int,
        q_lens: Iterable[int] = (1,),
        windows: Iterable[int | None] = (None,),
        batch_sizes: Iterable[int] = (1,),
        scale: float | None = None,
        sinks: bool = False,
    ) -> None:
        """Compile (eagerly) every variant a CUDA graph will record, for this cache layout.

        Runs ``attend`` once per (batch size) x (query width) x (window) on requests whose keys
        all sit in the sink page 0 (read only: the caches are not written). Pass the batch
        sizes and query widths the graphs are captured at: FA4's compile key depends on
        whether ``max_seqlen_q * Hq / Hkv`` fits one query tile and on whether the batch
        exceeds 256 (a batch-lookup aid), besides dtype, head dims, GQA ratio, window or not
        (not its value) and page size == key tile. Call once per distinct (dtype, Hq, Hkv,
        Dk, Dv, page size) before capture; later calls of a compiled variant only launch.
        ``sinks``: compile the variants with learnable sinks too.
        """
        page_size, dk = k_cache.shape[1], k_cache.shape[3]
        dev = k_cache.device
        scale = dk**-0.5 if scale is None else scale
        windows = tuple(windows)
        zeros = torch.zeros(num_q_heads, dtype=torch.float32, device=dev)
        for bs in batch_sizes:
            for q_len in q_lens:
                meta = _sink_metadata(bs, q_len, page_size, dev)
                q = torch.zeros(bs * q_len, num_q_heads, dk, dtype=k_cache.dtype, device=dev)
                for window in windows:
                    for sink in (None, zeros) if sinks else (None,):
                        self.attend(
                            q,
                            k_cache,
                            v_cache,
                            meta,
                            swa=False,
                            window=window,
                            scale=scale,
                            sinks=sink,
                        )
        torch.cuda.synchronize(dev)


def _sink_metadata(bs: int, q_len: int, page_size: int, dev: torch.device) -> AttentionMetadata:
    """Metadata of ``bs`` requests of ``q_len`` tokens each, all read from the sink page 0."""
    n_pages = -(-q_len // page_size)
    t = bs * q_len
    i32 = dict(dtype=torch.int32, device=dev)
    cu = torch.arange(bs + 1, **i32) * q_len
    slots = torch.zeros(t, **i32)
    return AttentionMetadata(
        cu_seqlens_q=cu,
        cache_seqlens=torch.full((bs,), q_len, **i32),
        cu_seqlens_k=cu.clone(),
        page_table=torch.zeros(bs, n_pages, **i32),
        swa_page_table=None,
        max_seqlen_q=q_len,
        max_seqlen_k=n_pages * page_size,
        num_tokens=t,
        page_size=page_size,
        full_write_slots=slots,
        swa_write_slots=None,
        positions=torch.zeros(t, dtype=torch.int64, device=dev),
    )
