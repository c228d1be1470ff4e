"""Split-KV paged attention for decode and verify steps (flash-decoding), in two launches.

A decode or verify step attends ``q_len`` (1..16) new query rows per request over its paged
KV. FlashAttention-4 on SM90 has no split-KV: it runs one CTA per (request, KV head), each
walking its keys in sequence, which is latency-bound at these widths (48 requests x 4 KV heads
= 192 CTAs on 132 SMs). Here every (request, KV head) is served by ``P`` programs that read
disjoint parts of its keys at once, then a second launch combines their partial softmaxes.

Contract (``unimem.attention.backend``'s, restricted to a uniform query width):

- ``q [T, Hq, Dk]`` with ``T = bs * q_len``, request-major: request ``b``'s rows are ``b *
  q_len .. (b + 1) * q_len`` (``cu_seqlens_q`` must be ``arange(bs + 1) * q_len``; it is
  checked for shape, never read: ``q_len`` is the host int). Any row and head strides, unit
  last stride (else copied).
- ``k_cache [num_pages, page_size, Hkv, Dk]``, ``v_cache [num_pages, page_size, Hkv, Dv]``:
  strided views (the page stride is the arena's envelope), unit last stride; every address is
  formed in int64 from the views' own strides. Page 0 is the all-zero sink.
- ``cache_seqlens [bs]`` int32: keys of request ``b`` (its new rows included); ``page_table
  [bs, W]`` int32: key ``j`` of request ``b`` is at offset ``j % page_size`` of physical page
  ``page_table[b, j // page_size]``. Padded lanes have ``cache_seqlens = q_len`` and a row of
  zeros (the sink): their outputs are finite (zeros, as the sink is zero).
- Query ``i`` of request ``b`` sits at ``p = cache_seqlens[b] - q_len + i`` and attends keys
  ``j <= p``; with ``window`` ``W`` only ``j > p - W``. GQA: query head ``h`` reads KV head
  ``h // (Hq // Hkv)``. ``out = softmax(scale * q k^T) v``; ``sinks [Hq]`` (gpt-oss's
  learnable sinks, FA4's ``learnable_sink``): one more logit per head, unscaled, that joins
  the softmax denominator and carries no value. A row that sees no key (only when
  ``cache_seqlens[b] < q_len``, a caller error) gives zeros.
- Returns ``o [T, Hq, Dv]`` in q's dtype (``out`` if given: that shape and dtype, unit last
  stride). q and the caches share one dtype: bf16, fp16 or fp32 (fp32 dots run in IEEE
  precision). Head dims up to 256 (64, 128, 256 in use); ``Dk != Dv`` is fine.
- ``max_seqlen_k``: a host upper bound of ``cache_seqlens`` (may be far larger, e.g. 32768).
  Keys past ``W * page_size`` do not exist (``cache_seqlens`` must not exceed it).

Work split. Keys are cut into *splits* of ``SPLIT`` keys at absolute positions (split ``s`` =
keys ``[s * SPLIT, (s + 1) * SPLIT)``; ``SPLIT`` a multiple of the page size and of the key
block ``BLOCK_N``). Program ``(r, p)`` of launch 1 serves row tile ``r`` (a request, a KV
head and up to ``BLOCK_M / group`` of its queries: every query head of that KV head packed
into one ``BLOCK_M``-row tile, so K/V are loaded once per split for all of them) and takes
the splits ``s = p, p + P, p + 2P, ...`` that hold keys the tile can see, in increasing order,
``BLOCK_N`` keys at a time: an online softmax in fp32 (``exp2``, ``log2 e`` folded into the
scale), ``tl.dot`` for ``q k^T`` and ``p v``. It writes its rows' ``(m, l, acc)`` to fp32
partials ``[T, Hq, P, Dv]``. Launch 2 (one program per token and head) loads the ``P``
partials at once (row ``p`` of a tile of at least 16 rows; rows with no visible key are
masked off and move no bytes), sums them in one fixed-shape tree, adds the sink and divides:
one load round trip where a loop over the partials paid ``P`` of them. The grid is ``(bs *
Hkv * ceil(q_len / (BLOCK_M / group)), P)`` then ``(T, Hq)``: host ints only, with
``P = min(kv_programs, ceil(max_seqlen_k / SPLIT))``, so a huge ``max_seqlen_k`` costs no
empty programs. Nothing is read on the host and the partials are ``torch.empty``: the call
can be recorded in a CUDA graph (the kernels compile on their first call: warm up outside).

Pattern independence (bitwise). A query row's output depends only on its position, its
keys, its q row and the fixed configuration (``SPLIT``, ``BLOCK_N``, ``P``, group and head
dims): not on ``q_len``, not on where the row sits in its window or tile, not on
``cache_seqlens`` past its own position, not on ``max_seqlen_k``. Because:

- the row tile has a fixed shape (``BLOCK_M`` depends on the GQA group only) and a row's
  arithmetic never mixes other rows (dots, row max and row sum are per row); ``q_len`` and the
  window are runtime arguments, not specialised: one compiled kernel serves every width;
- blocks and splits sit at absolute key positions, so a key always lands in the same column
  of the same block of the same split, and split ``s`` always goes to program ``s mod P``;
- a block that a row cannot see (past its position, before its window) is an exact no-op for
  it: its scores are ``-inf``, its probabilities exact zeros (``where``), the rescale factor is
  exactly 1 (``where(m_new == m, 1, ...)``) and ``acc + dot(0, v)`` adds exact zeros. Blocks
  skipped for the whole tile (before the earliest row's window, past the last row) are hence
  the same as blocks processed;
- a partial with no visible key (``m = -inf``) has weight exactly 0 and its ``acc`` is not
  read (its row of the merge holds exact zeros), so ``P`` clamped by ``max_seqlen_k`` (the
  same splits on the same programs, fewer empty ones) and empty programs change nothing; the
  merge's tree has the same shape for every ``P`` up to 16.

``paged_verify_attention_reference`` is the torch reference (float32 math, float64 for
float64 inputs; gathers every page of the table, vectorised, no host read) with the same
semantics.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from unimem_kernel import pdl
from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = [
    "paged_verify_attention",
    "paged_verify_attention_reference",
    "paged_verify_attention_triton",
]

_LOG2E = math.log2(math.e)
_SPLIT = 64  # keys per split (rounded up to a multiple of the page size); read at call time
_BLOCK_N = 64  # keys per loop step (at most the split)
_KV_PROGRAMS = 4  # programs per (request, KV head, row tile): the P above
# partials the combine sums in one fixed-shape tree (at least): the same tree for every P up
# to it, so clamping P by max_seqlen_k changes no bit
_COMBINE_ROWS = 16


def _block_m(group: int) -> int:
    """Rows of the query tile: 16 queries of ``group`` heads (a verify of up to 16 rows in
    one tile), 16..128 rows. A function of the group only: never of ``q_len``."""
    return max(16, min(128, next_pow2(16 * group)))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. UPCAST (the interpreter only): widened to fp32 and summed over
    K explicitly, in ascending K for every output, as ``batch_invariant._mma_chunk`` does: the
    interpreter's dot is numpy's matmul, which cannot multiply bf16 and whose BLAS may round a
    row differently by its place in the tile (that would hide what the pattern-independence
    test checks). On the GPU the tensor cores take the operands directly."""
    if UPCAST:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["q_len", "window", "nprog", "num_mt", "table_w"])
def _split_kv_kernel(
    q_ptr,  # [T, HQ, DK] (unit last stride)
    kc_ptr,  # [pages, PAGE, HKV, DK] strided view (unit last stride)
    vc_ptr,  # [pages, PAGE, HKV, DV]
    seqlens_ptr,  # [bs] int32
    table_ptr,  # [bs, W] int32
    part_o_ptr,  # [T, HQ, nprog, DV] fp32
    part_m_ptr,  # [T, HQ, nprog] fp32 (log2 units)
    part_l_ptr,  # [T, HQ, nprog] fp32
    q_len,
    window,
    nprog,
    num_mt,
    qk_scale,  # scale * log2(e)
    table_w,
    q_st,
    q_sh,
    kc_sp,
    kc_so,
    kc_sh,
    vc_sp,
    vc_so,
    vc_sh,
    tab_sb,
    tab_sw,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BDK: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(r, p)``: row tile ``r`` = (request ``b``, KV head, query tile ``mt``) over
    the splits ``s = p (mod nprog)`` it can see; writes the rows' ``(m, l, acc)``. Under
    PDL its index arithmetic and the sequence length (no kernel taking part in PDL writes
    lengths or page tables) precede the wait for the predecessor; the queries and the
    caches follow it."""
    QPT: tl.constexpr = BLOCK_M // GROUP  # queries per tile
    BPS: tl.constexpr = SPLIT // BLOCK_N  # blocks per split
    pid = tl.program_id(0)
    p = tl.program_id(1)
    mt = pid % num_mt
    bh = pid // num_mt
    hkv = bh % HKV
    b = (bh // HKV).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    qi_loc = rows // GROUP
    g = rows % GROUP
    qi = mt * QPT + qi_loc
    row_ok = (qi_loc < QPT) & (qi < q_len)
    seqlen = tl.load(seqlens_ptr + b)
    pos = tl.where(row_ok, seqlen - q_len + qi, -1)  # padding rows see nothing

    # the keys this tile can see: [lo, kv_end)
    first_pos = seqlen - q_len + mt * QPT
    kv_end = tl.maximum(tl.minimum(first_pos + QPT, seqlen), 0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    blk_lo = lo // BLOCK_N
    blk_hi = (kv_end + BLOCK_N - 1) // BLOCK_N
    s_lo = blk_lo // BPS
    s_hi = (blk_hi + BPS - 1) // BPS
    s0 = s_lo + (p - s_lo % nprog + nprog) % nprog  # first split >= s_lo of this program
    n_iter = ((tl.maximum(s_hi - s0, 0) + nprog - 1) // nprog) * BPS

    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    h = hkv * GROUP + g
    t = b * q_len + qi
    q_rows = q_ptr + t.to(tl.int64) * q_st + h.to(tl.int64) * q_sh
    pdl.wait(PDL)
    q = tl.load(q_rows[:, None] + dk[None, :], mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    kc_head = kc_ptr + hkv.to(tl.int64) * kc_sh
    vc_head = vc_ptr + hkv.to(tl.int64) * vc_sh
    tab_row = table_ptr + b * tab_sb
    for it in range(0, n_iter):
        s = s0 + (it // BPS) * nprog
        n0 = (s * BPS + it % BPS) * BLOCK_N
        j = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (j >= lo) & (j < kv_end)  # keys outside are invisible to every row here
        if PAGE >= BLOCK_N:  # the whole block in one page
            blk_page = n0 // PAGE
            page = tl.load(tab_row + blk_page * tab_sw, mask=(n0 < kv_end) & (blk_page < table_w),
                           other=0).to(tl.int64)  # fmt: skip
        else:
            jp = j // PAGE
            page = tl.load(tab_row + jp * tab_sw, mask=kv_ok & (jp < table_w), other=0)
            page = page.to(tl.int64)
        off = (j % PAGE).to(tl.int64)
        k = tl.load(
            kc_head + (page * kc_sp + off * kc_so)[:, None] + dk[None, :],
            mask=kv_ok[:, None] & (dk < DK)[None, :],
            other=0.0,
        )
        v = tl.load(
            vc_head + (page * vc_sp + off * vc_so)[:, None] + dv[None, :],
            mask=kv_ok[:, None] & (dv < DV)[None, :],
            other=0.0,
        )
        sc = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION, UPCAST)
        sc = sc * qk_scale
        vis = j[None, :] <= pos[:, None]
        if HAS_WINDOW:
            vis = vis & (j[None, :] > pos[:, None] - window)
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf
        # a block this row cannot see leaves (m, l, acc) exactly as they were
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_use))
        pr = tl.where(vis, tl.exp2(sc - m_use[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = _dot(pr.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new

    at = (t.to(tl.int64) * HQ + h) * nprog + p
    tl.store(part_m_ptr + at, m_i, mask=row_ok)
    tl.store(part_l_ptr + at, l_i, mask=row_ok)
    live = row_ok & (m_i > float("-inf"))  # the combine reads acc only where m is finite
    tl.store(part_o_ptr + at[:, None] * DV + dv[None, :], acc,
             mask=live[:, None] & (dv < DV)[None, :])  # fmt: skip
    pdl.launch_dependents(PDL)


@triton.jit(do_not_specialize=["nprog"])
def _combine_kernel(
    part_o_ptr,  # [T, HQ, nprog, DV] fp32
    part_m_ptr,  # [T, HQ, nprog] fp32
    part_l_ptr,
    sinks_ptr,  # [HQ] fp32 (unused without HAS_SINKS)
    o_ptr,  # [T, HQ, DV] (unit last stride)
    nprog,
    o_st,
    o_sh,
    HQ: tl.constexpr,
    DV: tl.constexpr,
    BP: tl.constexpr,
    BDV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(t, h)``: token ``t``, head ``h``: every partial in one load (``BP >=
    nprog`` rows, those with no visible key masked off, so they move no bytes), the sink in
    the denominator, a fixed-shape sum over the partials, divide, cast, store."""
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ps = tl.arange(0, BP)
    dv = tl.arange(0, BDV)
    base = (t * HQ + h) * nprog
    m = tl.load(part_m_ptr + base + ps, mask=ps < nprog, other=float("-inf"))
    live = m > float("-inf")
    mx = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634
        mx = tl.maximum(mx, sink)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(live, tl.where(m == mx, 1.0, tl.exp2(m - mx_safe)), 0.0)
    l_p = tl.load(part_l_ptr + base + ps, mask=live, other=0.0)
    a = tl.load(part_o_ptr + (base + ps)[:, None] * DV + dv[None, :],
                mask=live[:, None] & (dv < DV)[None, :], other=0.0)  # fmt: skip
    den = tl.sum(w * l_p, axis=0)
    if HAS_SINKS:
        den = den + tl.where(sink > float("-inf"), tl.exp2(sink - mx_safe), 0.0)
    num = tl.sum(w[:, None] * a, axis=0)
    out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)
    o = o_ptr + t * o_st + h.to(tl.int64) * o_sh + dv
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=dv < DV)
    pdl.launch_dependents(PDL)


# ------------------------------------------------------------------ checks and the reference


def _check(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, q_len, max_seqlen_k,
           scale, window, sinks, out) -> None:  # fmt: skip
    """Shape, dtype and device checks (host metadata only, no device read)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected q [T, Hq, Dk] and caches [pages, page_size, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if not isinstance(q_len, int) or isinstance(q_len, bool) or q_len < 1:
        raise ValueError(f"q_len must be a positive int, got {q_len!r}")
    if not isinstance(max_seqlen_k, int) or isinstance(max_seqlen_k, bool) or max_seqlen_k < 1:
        raise ValueError(f"max_seqlen_k must be a positive int, got {max_seqlen_k!r}")
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window <= 0
    ):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if cache_seqlens.dim() != 1 or page_table.dim() != 2:
        raise ValueError(
            f"expected cache_seqlens [bs] and page_table [bs, W], got "
            f"{tuple(cache_seqlens.shape)}, {tuple(page_table.shape)}"
        )
    bs = cache_seqlens.shape[0]
    if page_table.shape[0] != bs or page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [bs = {bs}, W >= 1], got {tuple(page_table.shape)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != bs + 1:
        raise ValueError(
            f"cu_seqlens_q must be [bs + 1 = {bs + 1}], got {tuple(cu_seqlens_q.shape)}"
        )
    if q.shape[0] != bs * q_len:
        raise ValueError(
            f"q has {q.shape[0]} rows, expected bs * q_len = {bs} * {q_len} = {bs * q_len}"
        )
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cache_seqlens", cache_seqlens),
                    ("page_table", page_table)):  # fmt: skip
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head dim {q.shape[2]} != k_cache head dim {k_cache.shape[3]}")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    dk, dv = k_cache.shape[3], v_cache.shape[3]
    if not (1 <= dk <= 256 and 1 <= dv <= 256):
        raise ValueError(f"head dims must be in 1..256, got Dk {dk}, Dv {dv}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"q must be fp16, bf16, fp32 (or fp64: the reference), got {q.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if sinks is not None and (
        sinks.dim() != 1 or sinks.shape[0] != hq or not sinks.dtype.is_floating_point
    ):
        raise ValueError(
            f"sinks must be a float tensor [Hq = {hq}], got {tuple(sinks.shape)} {sinks.dtype}"
        )
    if out is not None and (out.shape != (q.shape[0], hq, dv) or out.dtype != q.dtype):
        raise ValueError(
            f"out must be [{q.shape[0]}, {hq}, {dv}] {q.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("cu_seqlens_q", cu_seqlens_q),
               ("cache_seqlens", cache_seqlens), ("page_table", page_table), ("sinks", sinks),
               ("out", out)]  # fmt: skip
    for name, t in tensors:
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def paged_verify_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    q_len: int,
    max_seqlen_k: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    kv_programs: int | None = None,
) -> torch.Tensor:
    """Paged attention of ``bs`` requests of ``q_len`` query rows each (module docstring);
    returns ``o [bs * q_len, Hq, Dv]`` in q's dtype (``out`` when given).

    The kernels: two launches, capturable (float64 runs the reference). ``split_size`` (keys
    per split, default 64; rounded up to a multiple of the page size) and ``kv_programs``
    (programs per row tile, default 4) set their work split; the output bits depend on them
    (and on nothing of the request beyond each row's own keys), so keep them fixed where
    outputs are compared. The reference gathers every page of the table (``[bs, W *
    page_size]`` keys), zeroes keys past ``cache_seqlens`` and runs a masked softmax in float32
    (float64 for float64 inputs), GQA by grouping the query heads; no host read; the work
    split has no effect there."""
    _check(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, q_len, max_seqlen_k,
           scale, window, sinks, out)  # fmt: skip
    bs, w = page_table.shape
    ps, hkv, dk = k_cache.shape[1:]
    hq, dv = q.shape[1], v_cache.shape[3]
    group = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    res = out if out is not None else q.new_empty(q.shape[0], hq, dv)
    if bs == 0:
        return res
    pages = page_table.long()
    n_k = w * ps
    kpos = torch.arange(n_k, device=dev)
    seq = cache_seqlens.long()
    key_ok = (kpos[None, :] < seq[:, None])[:, :, None, None]  # [bs, n_k, 1, 1]
    k = torch.where(key_ok, k_cache[pages].reshape(bs, n_k, hkv, dk).to(acc), 0.0)
    v = torch.where(key_ok, v_cache[pages].reshape(bs, n_k, hkv, dv).to(acc), 0.0)
    qf = q.to(acc).reshape(bs, q_len, hkv, group, dk)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k) * scale
    qpos = seq[:, None] - q_len + torch.arange(q_len, device=dev)[None, :]  # [bs, q_len]
    vis = kpos[None, None, :] <= qpos[:, :, None]
    if window is not None:
        vis = vis & (kpos[None, None, :] > qpos[:, :, None] - window)
    scores = scores.masked_fill(~vis[:, None, None], float("-inf"))
    mx = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(acc).reshape(1, hkv, group, 1, 1)
        mx = torch.maximum(mx, sink)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    e = torch.exp(scores - mx)
    den = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sink - mx)
    probs = torch.where(den > 0, e / den, torch.zeros_like(e))
    o = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(bs * q_len, hq, dv)
    res.copy_(o)
    return res


# ------------------------------------------------------------------ the launcher


def paged_verify_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    q_len: int,
    max_seqlen_k: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    kv_programs: int | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`paged_verify_attention` (arguments already checked; not
    float64): a split-KV launch and a combine launch."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dim must have unit stride")
    split_size = _SPLIT if split_size is None else split_size
    kv_programs = _KV_PROGRAMS if kv_programs is None else kv_programs
    if not isinstance(split_size, int) or split_size < 1:
        raise ValueError(f"split_size must be a positive int, got {split_size!r}")
    if not isinstance(kv_programs, int) or kv_programs < 1:
        raise ValueError(f"kv_programs must be a positive int, got {kv_programs!r}")
    bs = cache_seqlens.shape[0]
    t, hq, dk = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[3]
    group = hq // hkv
    dev = q.device
    o = out if out is not None else torch.empty(t, hq, dv, dtype=q.dtype, device=dev)
    if o.stride(-1) != 1:
        raise ValueError("out's last dim must have unit stride")
    if bs == 0:
        return o
    if q.stride(-1) != 1:
        q = q.contiguous()
    split = triton.cdiv(split_size, ps) * ps
    # head dims over 128: half the key block keeps K + V stages at ~80 KB of shared memory
    block_n = min(_BLOCK_N if max(dk, dv) <= 128 else _BLOCK_N // 2, split)
    if split % block_n != 0 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(
            f"split_size {split} (a multiple of page size {ps}) must be a multiple of a "
            f"power-of-two key block >= 16 (block {block_n})"
        )
    nprog = max(1, min(kv_programs, triton.cdiv(max_seqlen_k, split)))
    block_m = _block_m(group)
    qpt = block_m // group
    num_mt = triton.cdiv(q_len, qpt)
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    part_o = torch.empty(t, hq, nprog, dv, dtype=torch.float32, device=dev)
    part_ml = torch.empty(2, t, hq, nprog, dtype=torch.float32, device=dev)
    seq = cache_seqlens if cache_seqlens.stride(0) == 1 else cache_seqlens.contiguous()
    warps = 8 if block_m * max(bdk, bdv) > 64 * 128 else 4
    pdl_mode = pdl.mode(q)
    _split_kv_kernel[(bs * hkv * num_mt, nprog)](
        q, k_cache, v_cache, seq, page_table, part_o, part_ml[0], part_ml[1],
        q_len, 0 if window is None else window, nprog, num_mt, float(scale) * _LOG2E,
        page_table.shape[1], q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), page_table.stride(1),
        HQ=hq, HKV=hkv, GROUP=group, PAGE=ps, DK=dk, DV=dv, BDK=bdk, BDV=bdv,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, HAS_WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=_interpreting(),
        PDL=pdl_mode, num_warps=warps, num_stages=2, **pdl.launch_options(pdl_mode),
    )  # fmt: skip
    sinks_arg = part_ml if sinks is None else sinks.to(torch.float32).contiguous()
    _combine_kernel[(t, hq)](
        part_o, part_ml[0], part_ml[1], sinks_arg, o, nprog, o.stride(0), o.stride(1),
        HQ=hq, DV=dv, BP=max(_COMBINE_ROWS, next_pow2(nprog)), BDV=next_pow2(dv),
        HAS_SINKS=sinks is not None, PDL=pdl_mode, num_warps=4, **pdl.launch_options(pdl_mode),
    )  # fmt: skip
    return o


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    q_len: int,
    max_seqlen_k: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    kv_programs: int | None = None,
) -> bool:
    _check(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, q_len, max_seqlen_k,
           scale, window, sinks, out)  # fmt: skip
    return q.dtype != torch.float64


paged_verify_attention = kernel_op(
    "paged_verify_attention",
    triton=paged_verify_attention_triton,
    reference=paged_verify_attention_reference,
    device_of="q",
    check=_check_args,
)
