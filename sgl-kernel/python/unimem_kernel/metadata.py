"""Attention metadata from live tables: lengths, prefix sums and physical page tables.

Two ops, one kernel:

- ``build_decode_metadata``: every request attends to ``seq_lens[b] + extra`` tokens
  (``extra`` = 1 for decode, ``gamma + 1`` for a fixed-length verify);
- ``build_extend_metadata``: request ``b`` adds ``extend_lens[b]`` tokens after
  ``prefix_lens[b]`` cached ones (prefill, extend, and variable-length verify with
  prefix = seq_lens and extend = the number of tokens each request verifies).

Both read *virtual* token ids from ``req_to_token[R, ctx]`` (``vtok = vpage * page_size + o``)
and translate the first token of every page through a space's ``v2p`` table (virtual page ->
physical page, ``-1`` = unbound or retired) into a page table of *physical* pages:

    page_table[b, c] = max(v2p[req_to_token[req_pool_indices[b], c * page_size] // page_size], 0)

for ``c < ceil(total[b] / page_size)``, and 0 for every other column up to the table's width
(the **tail contract**: no stale id from an earlier replay survives). A negative virtual token
id, a virtual page past the end of ``v2p``, an unbound entry, a page column whose first token
lies past the width of ``req_to_token`` and a request row outside ``[0, R)`` all give the sink
page 0. ``v2p=None`` means identity (the static-pool baseline: page = vtok // page_size).
Rows ``>= bs`` of every output, and entries past ``bs`` (``bs + 1`` for prefix sums), are left
untouched.

Why one kernel: the op is recorded inside the CUDA graph of a decode or verify step, so it
takes fixed-address inputs and caller-owned outputs, allocates nothing, never reads device
memory on the host, and launches once on a grid that depends only on ``(bs, table width)``.
Every replay re-reads the live ``v2p`` tables. The grid is ``(bs + 1, ceil(width /
BLOCK_COLS))``: program ``(b + 1, k)`` fills columns ``[k * BLOCK_COLS, (k + 1) * BLOCK_COLS)``
of row ``b`` of both page tables, tail included. Program ``(0, 0)`` writes the lengths and
their exclusive prefix sums with ``tl.cumsum`` over a power-of-two block (chunks of
``_MAX_BLOCK_BS`` with a running total past that), so nothing is serial in ``bs``.

All tables are int32 (ids stay below 2^31); index products are formed in int64. Triton does
not specialise on ``bs``, ``extra`` or table sizes (``do_not_specialize``), so a new batch size
compiles nothing; ``page_size``, identity and SWA on/off are ``constexpr``: warm each variant
eagerly before capture (a first compile inside capture breaks it).

The file reads top-down: the kernel, its launchers (``*_triton``, which tests call through
``UNIMEM_KERNEL_BACKEND=triton``), the torch references they must equal (``*_reference``, also
the CPU implementation), and the public ops (``_dispatch.kernel_op``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

# One column per thread, 128 columns per program: many small programs beat fewer wide ones
# (the op is bound by scattered loads; chosen by measurement, docs/decisions.md).
_MAX_BLOCK_COLS = 128
_MAX_BLOCK_BS = 1024

# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _translate_page(vtok, v2p_ptr, v2p_numel, PAGE_SIZE: tl.constexpr, IDENTITY: tl.constexpr):
    """Physical page of virtual token ids ``vtok`` (int64; negative = invalid), sink 0 else."""
    ok = vtok >= 0
    vpage = tl.where(ok, vtok, 0) // PAGE_SIZE
    if IDENTITY:
        phys = tl.where(ok, vpage, 0)
    else:
        ok = ok & (vpage < v2p_numel)
        phys = tl.load(v2p_ptr + vpage, mask=ok, other=0).to(tl.int64)
        phys = tl.maximum(phys, 0)
    return phys


@triton.jit(
    do_not_specialize=[
        "r2t_rows", "r2t_width", "extra", "bs", "full_v2p_numel", "swa_v2p_numel",
        "pt_width", "spt_width",
    ]
)  # fmt: skip
def _metadata_kernel(
    r2t_ptr,
    r2t_rows,
    r2t_width,
    r2t_stride_r,
    r2t_stride_c,
    rpi_ptr,
    lens_ptr,
    ext_ptr,
    extra,
    bs,
    full_v2p_ptr,
    full_v2p_numel,
    swa_v2p_ptr,
    swa_v2p_numel,
    cu_q_ptr,
    cache_ptr,
    cu_k_ptr,
    pt_ptr,
    pt_width,
    pt_stride_r,
    pt_stride_c,
    spt_ptr,
    spt_width,
    spt_stride_r,
    spt_stride_c,
    PAGE_SIZE: tl.constexpr,
    HAS_EXT: tl.constexpr,
    FULL_IDENTITY: tl.constexpr,
    HAS_SWA: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_BS: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_b - 1  # program row 0 computes the prefix sums; row b + 1 fills table row b

    # Lengths and exclusive prefix sums: one extra program, block-parallel cumsum, running
    # beside the row programs rather than ahead of one of them (it is dispatched first).
    if (pid_b == 0) & (pid_c == 0):
        tl.store(cu_k_ptr, 0)
        if HAS_EXT:
            tl.store(cu_q_ptr, 0)
        offs = tl.arange(0, BLOCK_BS)
        run_k = tl.sum(tl.zeros([BLOCK_BS], dtype=tl.int32), axis=0)
        run_q = run_k
        for start in range(0, bs, BLOCK_BS):
            idx = start + offs
            m = idx < bs
            total = tl.load(lens_ptr + idx, mask=m, other=0).to(tl.int32) + extra
            if HAS_EXT:
                e = tl.load(ext_ptr + idx, mask=m, other=0).to(tl.int32)
                total += e
                tl.store(cu_q_ptr + idx + 1, tl.cumsum(e, axis=0) + run_q, mask=m)
                run_q += tl.sum(e, axis=0)
            total = tl.where(m, total, 0)
            tl.store(cache_ptr + idx, total, mask=m)
            tl.store(cu_k_ptr + idx + 1, tl.cumsum(total, axis=0) + run_k, mask=m)
            run_k += tl.sum(total, axis=0)

    # Row b, columns of block pid_c, of both page tables (tail included).
    if (b >= 0) & (b < bs):
        req = tl.load(rpi_ptr + b).to(tl.int64)
        total = tl.load(lens_ptr + b).to(tl.int32) + extra
        if HAS_EXT:
            total += tl.load(ext_ptr + b).to(tl.int32)
        n_pages = (total + (PAGE_SIZE - 1)) // PAGE_SIZE  # <= 0 when total <= 0
        # A row outside req_to_token reads nothing (folded into the scalar bound).
        n_pages = tl.where((req >= 0) & (req < r2t_rows), n_pages, 0)
        cols = pid_c * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        tok = cols.to(tl.int64) * PAGE_SIZE
        live = (cols < n_pages) & (tok < r2t_width)
        r2t_row = r2t_ptr + req * r2t_stride_r
        vtok = tl.load(r2t_row + tok * r2t_stride_c, mask=live, other=-1).to(tl.int64)
        row = b.to(tl.int64)
        phys = _translate_page(vtok, full_v2p_ptr, full_v2p_numel, PAGE_SIZE, FULL_IDENTITY)
        tl.store(
            pt_ptr + row * pt_stride_r + cols * pt_stride_c,
            phys.to(tl.int32),
            mask=cols < pt_width,
        )
        if HAS_SWA:
            sphys = _translate_page(vtok, swa_v2p_ptr, swa_v2p_numel, PAGE_SIZE, False)
            tl.store(
                spt_ptr + row * spt_stride_r + cols * spt_stride_c,
                sphys.to(tl.int32),
                mask=cols < spt_width,
            )


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------


def _check_vec(t: torch.Tensor, name: str, n: int) -> None:
    if t.dim() != 1 or t.numel() < n:
        raise ValueError(f"{name} must be 1-D with at least {n} entries, got {tuple(t.shape)}")
    if n > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must have unit stride")


def _check_int32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")


def _check_args(
    req_to_token,
    req_pool_indices,
    lens,
    ext,
    full_v2p,
    swa_v2p,
    cu_seqlens_q,
    cache_seqlens,
    cu_seqlens_k,
    page_table,
    swa_page_table,
) -> int:
    """Shape and dtype checks (host metadata only, no device read); returns ``bs``."""
    bs = req_pool_indices.numel()
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D, got {tuple(req_to_token.shape)}")
    _check_vec(req_pool_indices, "req_pool_indices", bs)
    _check_vec(lens, "seq_lens/prefix_lens", bs)
    if ext is not None:
        _check_vec(ext, "extend_lens", bs)
        _check_vec(cu_seqlens_q, "cu_seqlens_q", bs + 1)
        _check_int32(cu_seqlens_q, "cu_seqlens_q")
    _check_vec(cache_seqlens, "cache_seqlens", bs)
    _check_vec(cu_seqlens_k, "cu_seqlens_k", bs + 1)
    _check_int32(cache_seqlens, "cache_seqlens")
    _check_int32(cu_seqlens_k, "cu_seqlens_k")
    if (swa_v2p is None) != (swa_page_table is None):
        raise ValueError("swa_v2p and swa_page_table must be given together (or both None)")
    for t, name in ((page_table, "page_table"), (swa_page_table, "swa_page_table")):
        if t is None:
            continue
        _check_int32(t, name)
        if t.dim() != 2 or t.shape[0] < bs:
            raise ValueError(f"{name} must be 2-D with at least {bs} rows, got {tuple(t.shape)}")
    for t, name in ((full_v2p, "full_v2p"), (swa_v2p, "swa_v2p")):
        if t is not None and t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got {tuple(t.shape)}")
    return bs


def _num_warps(block_cols: int) -> int:
    return max(1, min(block_cols // 32, 8))


def _metadata_grid(bs: int, width: int) -> tuple[tuple[int, int], int]:
    """The launch grid and column block for ``bs`` rows of tables ``width`` columns wide."""
    block_cols = min(next_pow2(width), _MAX_BLOCK_COLS)
    return (bs + 1, max(triton.cdiv(width, block_cols), 1)), block_cols


def _launch_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    ext: torch.Tensor | None,
    extra: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    swa_page_table: torch.Tensor | None,
) -> None:
    """One launch of ``_metadata_kernel`` (arguments already checked)."""
    bs = req_pool_indices.numel()
    has_swa = swa_page_table is not None
    width = max(page_table.shape[1], swa_page_table.shape[1] if has_swa else 0)
    grid, block_cols = _metadata_grid(bs, width)
    spt = swa_page_table if has_swa else page_table
    _metadata_kernel[grid](
        req_to_token,
        req_to_token.shape[0],
        req_to_token.shape[1],
        req_to_token.stride(0),
        req_to_token.stride(1),
        req_pool_indices,
        lens,
        ext if ext is not None else lens,
        int(extra),
        bs,
        full_v2p if full_v2p is not None else page_table,
        full_v2p.numel() if full_v2p is not None else 0,
        swa_v2p if has_swa else page_table,
        swa_v2p.numel() if has_swa else 0,
        cu_seqlens_q if ext is not None else cu_seqlens_k,
        cache_seqlens,
        cu_seqlens_k,
        page_table,
        page_table.shape[1],
        page_table.stride(0),
        page_table.stride(1),
        spt,
        spt.shape[1],
        spt.stride(0),
        spt.stride(1),
        PAGE_SIZE=int(page_size),
        HAS_EXT=ext is not None,
        FULL_IDENTITY=full_v2p is None,
        HAS_SWA=has_swa,
        BLOCK_COLS=block_cols,
        BLOCK_BS=min(next_pow2(bs), _MAX_BLOCK_BS),
        num_warps=_num_warps(block_cols),
    )


def build_decode_metadata_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extra: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    swa_page_table: torch.Tensor | None,
) -> None:
    """Triton launcher of ``build_decode_metadata`` (one launch, also for ``bs == 0``)."""
    _check_args(
        req_to_token, req_pool_indices, seq_lens, None, full_v2p, swa_v2p, None,
        cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip
    _launch_metadata(
        req_to_token, req_pool_indices, seq_lens, None, extra, page_size, full_v2p, swa_v2p,
        None, cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip


def build_extend_metadata_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    swa_page_table: torch.Tensor | None,
) -> None:
    """Triton launcher of ``build_extend_metadata`` (one launch, also for ``bs == 0``)."""
    _check_args(
        req_to_token, req_pool_indices, prefix_lens, extend_lens, full_v2p, swa_v2p,
        cu_seqlens_q, cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip
    _launch_metadata(
        req_to_token, req_pool_indices, prefix_lens, extend_lens, 0, page_size, full_v2p,
        swa_v2p, cu_seqlens_q, cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# torch reference (the oracle; also the CPU implementation)
# ---------------------------------------------------------------------------------------------


def _translate_page_reference(vtok: torch.Tensor, v2p: torch.Tensor | None, page_size: int):
    ok = vtok >= 0
    vpage = torch.div(vtok.clamp_min(0), page_size, rounding_mode="floor")
    if v2p is None:
        return torch.where(ok, vpage, 0)
    ok = ok & (vpage < v2p.numel())
    if v2p.numel() == 0:
        return torch.zeros_like(vpage)
    phys = v2p[vpage.clamp_max(v2p.numel() - 1)].long()
    return torch.where(ok, phys.clamp_min(0), 0)


def _metadata_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    ext: torch.Tensor | None,
    extra: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    swa_page_table: torch.Tensor | None,
) -> None:
    bs = req_pool_indices.numel()
    total = lens[:bs].long() + int(extra)
    if ext is not None:
        e = ext[:bs].long()
        total = total + e
        cu_seqlens_q[0] = 0
        cu_seqlens_q[1 : bs + 1] = torch.cumsum(e, 0).to(cu_seqlens_q.dtype)
    cache_seqlens[:bs] = total.to(cache_seqlens.dtype)
    cu_seqlens_k[0] = 0
    cu_seqlens_k[1 : bs + 1] = torch.cumsum(total, 0).to(cu_seqlens_k.dtype)
    if bs == 0:
        return
    rows, ctx = req_to_token.shape
    width = max(page_table.shape[1], swa_page_table.shape[1] if swa_page_table is not None else 0)
    dev = req_to_token.device
    cols = torch.arange(width, device=dev)
    tok = cols * page_size
    n_pages = torch.div(total + page_size - 1, page_size, rounding_mode="floor")
    req = req_pool_indices[:bs].long()
    live = (
        (cols[None, :] < n_pages[:, None])
        & (tok[None, :] < ctx)
        & ((req >= 0) & (req < rows))[:, None]
    )
    if rows > 0 and ctx > 0:
        vtok = req_to_token[req.clamp(0, rows - 1)[:, None], tok.clamp_max(ctx - 1)[None, :]]
        vtok = torch.where(live, vtok.long(), -1)
    else:
        vtok = torch.full((bs, width), -1, dtype=torch.long, device=dev)
    w = page_table.shape[1]
    page_table[:bs, :w] = _translate_page_reference(vtok[:, :w], full_v2p, page_size).to(
        page_table.dtype
    )
    if swa_page_table is not None:
        w = swa_page_table.shape[1]
        swa_page_table[:bs, :w] = _translate_page_reference(vtok[:, :w], swa_v2p, page_size).to(
            swa_page_table.dtype
        )


def build_decode_metadata_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extra: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    swa_page_table: torch.Tensor | None,
) -> None:
    """Decode / fixed-length-verify metadata, written in place.

    With ``bs = req_pool_indices.numel()`` and ``total[b] = seq_lens[b] + extra``:

    - ``cache_seqlens[b] = total[b]`` for ``b < bs``;
    - ``cu_seqlens_k[:bs + 1]`` = exclusive prefix sum of ``total`` (starts at 0);
    - ``page_table[b, c]`` = physical FULL page of column ``c`` through ``full_v2p`` (``None`` =
      identity) for ``c < ceil(total[b] / page_size)``, 0 for every other column (tail);
    - ``swa_page_table`` likewise through ``swa_v2p`` (both None, or both given).

    Inputs: ``req_to_token [R, ctx]`` (may be a strided view), ``req_pool_indices [bs]``,
    ``seq_lens [bs]``, ``full_v2p``/``swa_v2p`` 1-D; all int32. ``extra`` and ``page_size`` are
    Python ints. Outputs are int32 and caller-owned; page tables may be wider than needed and
    may be views with any row stride. Rows ``>= bs`` (entries past ``bs`` / ``bs + 1``) are not
    touched. See the module docstring for the sink rules.
    """
    _check_args(
        req_to_token, req_pool_indices, seq_lens, None, full_v2p, swa_v2p, None,
        cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip
    _metadata_reference(
        req_to_token, req_pool_indices, seq_lens, None, extra, page_size, full_v2p, swa_v2p,
        None, cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip


def build_extend_metadata_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    swa_page_table: torch.Tensor | None,
) -> None:
    """Extend / prefill / variable-length-verify metadata, written in place.

    Request ``b`` adds ``extend_lens[b]`` tokens (0 allowed) after ``prefix_lens[b]`` cached
    ones; ``total[b] = prefix_lens[b] + extend_lens[b]``:

    - ``cu_seqlens_q[:bs + 1]`` = exclusive prefix sum of ``extend_lens``;
    - ``cache_seqlens[b] = total[b]``; ``cu_seqlens_k[:bs + 1]`` = exclusive prefix sum of it;
    - ``page_table`` / ``swa_page_table`` exactly as in ``build_decode_metadata_reference``
      with ``total``.

    Variable-length verify is this op with ``prefix_lens = seq_lens`` and ``extend_lens`` = the
    number of tokens each request verifies. Dtypes, views and untouched rows as in decode.
    """
    _check_args(
        req_to_token, req_pool_indices, prefix_lens, extend_lens, full_v2p, swa_v2p,
        cu_seqlens_q, cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip
    _metadata_reference(
        req_to_token, req_pool_indices, prefix_lens, extend_lens, 0, page_size, full_v2p,
        swa_v2p, cu_seqlens_q, cache_seqlens, cu_seqlens_k, page_table, swa_page_table,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


build_decode_metadata = kernel_op(
    "build_decode_metadata",
    triton=build_decode_metadata_triton,
    reference=build_decode_metadata_reference,
    device_of="page_table",
)


build_extend_metadata = kernel_op(
    "build_extend_metadata",
    triton=build_extend_metadata_triton,
    reference=build_extend_metadata_reference,
    device_of="page_table",
)
