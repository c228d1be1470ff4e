"""Id-space ops: bind, unbind, translate (tokens, slots) and compact units of one id space.

An *id space* is a pair of int32 device tables that are allocated once and only mutated in
place (their addresses are stable for CUDA graphs):

- ``v2p[V]``: virtual id -> physical unit, ``-1`` when unbound;
- ``p2v[P]``: physical unit -> virtual id, ``-1`` for a hole (free unit) or the sink.

Free physical units live on a device *free stack* ``phys_free[P]`` (int32) whose first
``phys_top`` entries are the free ids. The host never reads the stack: it knows how many ids it
holds (``phys_top``) because it decided every push and pop, and passes that count to each op as a
plain int. Virtual ids may come from a second stack, ``virt_free``, managed the same way.

Every op here is one launch, allocates nothing, and never reads device memory on the host.
Each has a torch reference (``*_reference``) with identical semantics; the public op runs the
Triton kernel on CUDA tensors and the reference otherwise (``_dispatch.kernel_op``).

Request tables: ``req_to_token[R, ctx]`` (int32) holds one virtual token id per token,
``vtok = vpage * page_size + offset``. Ops that touch it address whole pages by
``(unit_rows[i], unit_cols[i])``: request row and page column (token ``col * page_size + o``).

Each op below reads top-down: its Triton kernel, the launcher (``*_triton``, which tests call
directly), the torch reference it must equal, and the public op.

Kernel conventions:

- Host counts (``phys_top``, ``n``, region bounds) and the request table's strides and
  width are runtime arguments that Triton does not specialise on (``do_not_specialize``), so
  a new count never triggers a compile; that matters inside CUDA-graph capture, where a
  first compile breaks the capture. Id-list pointers are
  not specialised on their 16-byte alignment either (``do_not_specialize_on_alignment``):
  callers pass slices of one packed upload, whose alignment changes with the counts, and an
  unaligned variant would be compiled mid-run for each new combination (gathers of int32
  ids gain nothing from the alignment). ``page_size`` is a
  ``constexpr``: one variant per page size, warmed eagerly by the caller.
- Triton's ``//`` and ``%`` truncate toward zero, so ids are checked for ``>= 0`` explicitly
  before any division or gather; a masked lane never touches memory.
- Table offsets that can exceed 2^31 (request-table rows times their stride) are int64.
- On ids the contract rules out (negative or unbound where the caller promised bound ones) the
  kernels skip the table writes instead of writing out of bounds; the references make no
  promise there, so such inputs are outside what the tests compare.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

# Tile sizes. One program handles BLOCK_UNITS units (bind/unbind; fewer for big pages, so a
# tile stays at about _TILE request-table entries), BLOCK_TOKENS tokens (translate) or sweeps
# the whole region/stack in chunks of BLOCK_COMPACT (compact, a single program).
_BLOCK_UNITS = 128
_TILE = 2048
_BLOCK_TOKENS = 1024
_BLOCK_COMPACT = 2048


def _check_table(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or t.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# bind_units: pop physical (and virtual) ids, bind them, write the request table
# ---------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "phys_start", "n", "virt_start", "req_stride_row", "req_stride_tok", "req_width"
    ],
    do_not_specialize_on_alignment=[
        "phys_free_ptr", "vids_ptr", "virt_free_ptr", "rows_ptr", "cols_ptr"
    ],
)  # fmt: skip
def _bind_units_kernel(
    v2p_ptr,
    p2v_ptr,
    phys_free_ptr,
    phys_start,  # phys_top - n: the first popped stack entry
    n,
    vids_ptr,
    virt_free_ptr,
    virt_start,  # virt_top - n
    req_ptr,
    rows_ptr,
    cols_ptr,
    req_stride_row,
    req_stride_tok,
    req_width,
    PAGE_SIZE: tl.constexpr,
    HAS_VIRT: tl.constexpr,
    HAS_REQ: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    ok = i < n
    phys = tl.load(phys_free_ptr + phys_start + i, mask=ok, other=-1)
    if HAS_VIRT:
        vid = tl.load(virt_free_ptr + virt_start + i, mask=ok, other=-1)
        tl.store(vids_ptr + i, vid, mask=ok)
    else:
        vid = tl.load(vids_ptr + i, mask=ok, other=-1)
    tl.store(v2p_ptr + vid, phys, mask=ok & (vid >= 0))
    tl.store(p2v_ptr + phys, vid, mask=ok & (phys >= 0))
    if HAS_REQ:
        o = tl.arange(0, BLOCK_P)
        row = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
        col = tl.load(cols_ptr + i, mask=ok, other=0).to(tl.int64)
        tok = col[:, None] * PAGE_SIZE + o[None, :]  # [BLOCK_U, BLOCK_P] token columns
        val = vid.to(tl.int64)[:, None] * PAGE_SIZE + o[None, :]
        m = ok[:, None] & (o[None, :] < PAGE_SIZE) & (tok >= 0) & (tok < req_width)
        ptrs = req_ptr + row[:, None] * req_stride_row + tok * req_stride_tok
        tl.store(ptrs, val, mask=m)


def bind_units_triton(
    v2p: torch.Tensor,
    p2v: torch.Tensor,
    phys_free: torch.Tensor,
    phys_top: int,
    n: int,
    vids: torch.Tensor,
    virt_free: torch.Tensor | None = None,
    virt_top: int = 0,
    req_to_token: torch.Tensor | None = None,
    unit_rows: torch.Tensor | None = None,
    unit_cols: torch.Tensor | None = None,
    page_size: int = 1,
) -> None:
    """Triton launcher of ``bind_units`` (one launch; none when ``n == 0``)."""
    if n <= 0:
        return
    if n > phys_top or (virt_free is not None and n > virt_top):
        raise ValueError(f"cannot pop {n} ids (phys_top={phys_top}, virt_top={virt_top})")
    for name, t in (("v2p", v2p), ("p2v", p2v), ("phys_free", phys_free), ("vids", vids)):
        _check_table(name, t)
    has_virt = virt_free is not None
    if has_virt:
        _check_table("virt_free", virt_free)
    has_req = req_to_token is not None
    if has_req:
        if unit_rows is None or unit_cols is None:
            raise ValueError("req_to_token needs unit_rows and unit_cols")
        _check_table("unit_rows", unit_rows)
        _check_table("unit_cols", unit_cols)
        if req_to_token.dim() != 2:
            raise ValueError("req_to_token must be 2-D")
        req, rows, cols = req_to_token, unit_rows, unit_cols
        stride_row, stride_tok, width = req.stride(0), req.stride(1), req.shape[1]
    else:  # placeholders, never touched (HAS_REQ is a constexpr); the table, not a slice of
        # ids, stands in for req_to_token: its pointer is specialised on alignment, a slice's
        # alignment varies with the counts (a variant would compile mid-run)
        req, rows, cols, stride_row, stride_tok, width = v2p, vids, vids, 0, 0, 0
    block_p = next_pow2(page_size) if has_req else 1
    block_u = max(1, min(_BLOCK_UNITS, _TILE // block_p))
    _bind_units_kernel[(triton.cdiv(n, block_u),)](
        v2p,
        p2v,
        phys_free,
        phys_top - n,
        n,
        vids,
        virt_free if has_virt else vids,
        virt_top - n if has_virt else 0,
        req,
        rows,
        cols,
        stride_row,
        stride_tok,
        width,
        PAGE_SIZE=page_size,
        HAS_VIRT=has_virt,
        HAS_REQ=has_req,
        BLOCK_U=block_u,
        BLOCK_P=block_p,
    )


def bind_units_reference(
    v2p: torch.Tensor,
    p2v: torch.Tensor,
    phys_free: torch.Tensor,
    phys_top: int,
    n: int,
    vids: torch.Tensor,
    virt_free: torch.Tensor | None = None,
    virt_top: int = 0,
    req_to_token: torch.Tensor | None = None,
    unit_rows: torch.Tensor | None = None,
    unit_cols: torch.Tensor | None = None,
    page_size: int = 1,
) -> None:
    """Pop ``n`` physical ids and bind them to ``n`` virtual ids.

    - ``phys[i] = phys_free[phys_top - n + i]`` for ``i < n`` (the top ``n`` stack entries);
    - if ``virt_free`` is given, the virtual ids are popped the same way and written to
      ``vids[:n]`` (an output); otherwise ``vids[:n]`` is an input;
    - ``v2p[vids[i]] = phys[i]`` and ``p2v[phys[i]] = vids[i]``;
    - if ``req_to_token`` is given, each bound page is also written into the request table:
      ``req_to_token[unit_rows[i], unit_cols[i] * page_size + o] = vids[i] * page_size + o``
      for ``o < page_size`` (tokens past the table width are skipped).

    The caller then lowers its counts: ``phys_top -= n`` (and ``virt_top -= n``). Preconditions
    (the caller's, not checked on device): ``n <= phys_top`` (and ``<= virt_top``); the given
    virtual ids are distinct and unbound.
    """
    if n == 0:
        return
    phys = phys_free[phys_top - n : phys_top].long()
    if virt_free is not None:
        vids[:n].copy_(virt_free[virt_top - n : virt_top])
    v = vids[:n].long()
    v2p[v] = phys.to(v2p.dtype)
    p2v[phys] = v.to(p2v.dtype)
    if req_to_token is not None:
        if unit_rows is None or unit_cols is None:
            raise ValueError("bind_units_reference: req_to_token needs unit_rows and unit_cols")
        offs = torch.arange(page_size, device=v.device)
        cols = unit_cols[:n].long()[:, None] * page_size + offs[None, :]
        rows = unit_rows[:n].long()[:, None].expand_as(cols)
        vals = v[:, None] * page_size + offs[None, :]
        ok = cols < req_to_token.shape[1]
        req_to_token[rows[ok], cols[ok]] = vals[ok].to(req_to_token.dtype)


# ---------------------------------------------------------------------------------------------
# unbind_units: unbind virtual ids (given, or read from the request table) and push the units
# ---------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=["phys_top", "n", "virt_top", "req_stride_row", "req_stride_tok"],
    do_not_specialize_on_alignment=[
        "phys_free_ptr", "vids_ptr", "rows_ptr", "cols_ptr", "virt_free_ptr"
    ],
)  # fmt: skip
def _unbind_units_kernel(
    v2p_ptr,
    p2v_ptr,
    phys_free_ptr,
    phys_top,
    n,
    vids_ptr,
    req_ptr,
    rows_ptr,
    cols_ptr,
    req_stride_row,
    req_stride_tok,
    virt_free_ptr,
    virt_top,
    PAGE_SIZE: tl.constexpr,
    FROM_REQ: tl.constexpr,
    HAS_VIRT: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    ok = i < n
    if FROM_REQ:
        row = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
        col = tl.load(cols_ptr + i, mask=ok, other=0).to(tl.int64)
        ptrs = req_ptr + row * req_stride_row + col * PAGE_SIZE * req_stride_tok
        tok = tl.load(ptrs, mask=ok, other=-1)
        # `//` truncates: a negative token would map to page 0, so it is masked instead.
        vid = tl.where(tok >= 0, tok // PAGE_SIZE, -1)
    else:
        vid = tl.load(vids_ptr + i, mask=ok, other=-1)
    bound = ok & (vid >= 0)
    phys = tl.load(v2p_ptr + vid, mask=bound, other=-1)
    tl.store(v2p_ptr + vid, -1, mask=bound)
    tl.store(p2v_ptr + phys, -1, mask=ok & (phys >= 0))
    tl.store(phys_free_ptr + phys_top + i, phys, mask=ok)
    if HAS_VIRT:
        tl.store(virt_free_ptr + virt_top + i, vid, mask=ok)


def unbind_units_triton(
    v2p: torch.Tensor,
    p2v: torch.Tensor,
    phys_free: torch.Tensor,
    phys_top: int,
    n: int,
    vids: torch.Tensor | None = None,
    req_to_token: torch.Tensor | None = None,
    unit_rows: torch.Tensor | None = None,
    unit_cols: torch.Tensor | None = None,
    page_size: int = 1,
    virt_free: torch.Tensor | None = None,
    virt_top: int = 0,
) -> None:
    """Triton launcher of ``unbind_units`` (one launch; none when ``n == 0``)."""
    if n <= 0:
        return
    if phys_top + n > phys_free.numel():
        raise ValueError(f"pushing {n} ids overflows the free stack (phys_top={phys_top})")
    for name, t in (("v2p", v2p), ("p2v", p2v), ("phys_free", phys_free)):
        _check_table(name, t)
    from_req = vids is None
    if from_req:
        if req_to_token is None or unit_rows is None or unit_cols is None:
            raise ValueError("without vids, req_to_token, unit_rows and unit_cols are needed")
        _check_table("unit_rows", unit_rows)
        _check_table("unit_cols", unit_cols)
        if req_to_token.dim() != 2:
            raise ValueError("req_to_token must be 2-D")
        req, rows, cols = req_to_token, unit_rows, unit_cols
        stride_row, stride_tok = req.stride(0), req.stride(1)
        vids_arg = rows  # placeholder, never touched
    else:
        _check_table("vids", vids)
        # the table stands in for req_to_token (never touched): see bind_units_triton
        req, rows, cols, stride_row, stride_tok = v2p, vids, vids, 0, 0
        vids_arg = vids
    has_virt = virt_free is not None
    if has_virt:
        _check_table("virt_free", virt_free)
        if virt_top + n > virt_free.numel():
            raise ValueError(f"pushing {n} ids overflows virt_free (virt_top={virt_top})")
    _unbind_units_kernel[(triton.cdiv(n, _BLOCK_UNITS),)](
        v2p,
        p2v,
        phys_free,
        phys_top,
        n,
        vids_arg,
        req,
        rows,
        cols,
        stride_row,
        stride_tok,
        virt_free if has_virt else phys_free,
        virt_top if has_virt else 0,
        PAGE_SIZE=page_size,
        FROM_REQ=from_req,
        HAS_VIRT=has_virt,
        BLOCK_U=_BLOCK_UNITS,
    )


def unbind_units_reference(
    v2p: torch.Tensor,
    p2v: torch.Tensor,
    phys_free: torch.Tensor,
    phys_top: int,
    n: int,
    vids: torch.Tensor | None = None,
    req_to_token: torch.Tensor | None = None,
    unit_rows: torch.Tensor | None = None,
    unit_cols: torch.Tensor | None = None,
    page_size: int = 1,
    virt_free: torch.Tensor | None = None,
    virt_top: int = 0,
) -> None:
    """Unbind ``n`` virtual ids and push their physical units onto the free stack.

    The virtual ids are ``vids[:n]``, or, when ``vids`` is None, read from the request table:
    ``vid[i] = req_to_token[unit_rows[i], unit_cols[i] * page_size] // page_size``.
    For each: ``p = v2p[vid]``; ``v2p[vid] = -1``; ``p2v[p] = -1``;
    ``phys_free[phys_top + i] = p``; and if ``virt_free`` is given,
    ``virt_free[virt_top + i] = vid`` (the virtual id is released too).

    The caller then raises its counts by ``n``. Preconditions (the caller's): every vid is bound
    and they are distinct (free per unit, never per token, so no unit is pushed twice).
    """
    if n == 0:
        return
    if vids is None:
        if req_to_token is None or unit_rows is None or unit_cols is None:
            raise ValueError(
                "unbind_units_reference: without vids, pass req_to_token, unit_rows, unit_cols"
            )
        tok = req_to_token[unit_rows[:n].long(), unit_cols[:n].long() * page_size]
        v = torch.div(tok.long(), page_size, rounding_mode="floor")
    else:
        v = vids[:n].long()
    phys = v2p[v].long()
    v2p[v] = -1
    p2v[phys] = -1
    phys_free[phys_top : phys_top + n] = phys.to(phys_free.dtype)
    if virt_free is not None:
        virt_free[virt_top : virt_top + n] = v.to(virt_free.dtype)


# ---------------------------------------------------------------------------------------------
# translate_tokens: virtual token ids -> physical token ids (the sink for anything unbound)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["numel"], do_not_specialize_on_alignment=["vtok_ptr", "out_ptr"])
def _translate_tokens_kernel(
    vtok_ptr, v2p_ptr, out_ptr, numel, num_pages, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    t = tl.load(vtok_ptr + i, mask=ok, other=-1).to(tl.int64)
    # `//` and `%` truncate toward zero: negative tokens must not reach them unmasked.
    page = tl.where(t >= 0, t // PAGE_SIZE, -1)
    inb = ok & (page >= 0) & (page < num_pages)
    phys = tl.load(v2p_ptr + page, mask=inb, other=-1).to(tl.int64)
    res = tl.where(phys >= 0, phys * PAGE_SIZE + t % PAGE_SIZE, 0)
    tl.store(out_ptr + i, res, mask=ok)


def translate_tokens_triton(
    vtok: torch.Tensor, v2p: torch.Tensor, page_size: int, out: torch.Tensor
) -> None:
    """Triton launcher of ``translate_tokens`` (one launch; none for an empty ``vtok``)."""
    if vtok.shape != out.shape:
        raise ValueError(f"vtok {tuple(vtok.shape)} and out {tuple(out.shape)} differ in shape")
    if not (vtok.is_contiguous() and out.is_contiguous()):
        raise ValueError("vtok and out must be contiguous")
    _check_table("v2p", v2p)
    numel = vtok.numel()
    if numel == 0:
        return
    _translate_tokens_kernel[(triton.cdiv(numel, _BLOCK_TOKENS),)](
        vtok, v2p, out, numel, v2p.numel(), PAGE_SIZE=page_size, BLOCK=_BLOCK_TOKENS
    )


def translate_tokens_reference(
    vtok: torch.Tensor, v2p: torch.Tensor, page_size: int, out: torch.Tensor
) -> None:
    """``out[i] = v2p[vtok[i] // page_size] * page_size + vtok[i] % page_size``.

    A negative ``vtok``, a page past the end of ``v2p`` or an unbound page (``-1``) gives 0,
    the sink. ``vtok`` and ``out`` are int32 of the same shape (any shape, contiguous).
    """
    t = vtok.reshape(-1).long()
    page = torch.div(t, page_size, rounding_mode="floor")
    inb = (t >= 0) & (page < v2p.numel())
    phys = torch.where(inb, v2p[page.clamp(0, v2p.numel() - 1)].long(), -1)
    res = torch.where(phys >= 0, phys * page_size + t % page_size, 0)
    out.reshape(-1).copy_(res.to(out.dtype))


# ---------------------------------------------------------------------------------------------
# translate_slots: virtual unit ids -> physical units (-1 for anything unbound)
# ---------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=["numel", "num_ids"], do_not_specialize_on_alignment=["v_ptr", "out_ptr"]
)
def _translate_slots_kernel(v_ptr, v2p_ptr, out_ptr, numel, num_ids, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    v = tl.load(v_ptr + i, mask=ok, other=-1).to(tl.int64)
    inb = ok & (v >= 0) & (v < num_ids)
    phys = tl.load(v2p_ptr + v, mask=inb, other=-1)
    tl.store(out_ptr + i, tl.where(inb, phys, -1).to(out_ptr.dtype.element_ty), mask=ok)


def translate_slots_triton(v: torch.Tensor, v2p: torch.Tensor, out: torch.Tensor) -> None:
    """Triton launcher of ``translate_slots`` (one launch; none for an empty ``v``)."""
    if v.shape != out.shape:
        raise ValueError(f"v {tuple(v.shape)} and out {tuple(out.shape)} differ in shape")
    if not (v.is_contiguous() and out.is_contiguous()):
        raise ValueError("v and out must be contiguous")
    _check_table("v2p", v2p)
    numel = v.numel()
    if numel == 0:
        return
    _translate_slots_kernel[(triton.cdiv(numel, _BLOCK_TOKENS),)](
        v, v2p, out, numel, v2p.numel(), BLOCK=_BLOCK_TOKENS
    )


def translate_slots_reference(v: torch.Tensor, v2p: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = v2p[v[i]]``: the physical unit of virtual id ``v[i]`` (a state slot), ``-1``
    where ``v[i]`` is negative (a padded lane), past the end of ``v2p`` or unbound. ``v`` and
    ``out`` are integer tensors of one shape (contiguous); ``v2p`` an int32 table."""
    t = v.reshape(-1).long()
    inb = (t >= 0) & (t < v2p.numel())
    phys = torch.where(inb, v2p[t.clamp(0, v2p.numel() - 1)].long(), -1)
    out.reshape(-1).copy_(phys.to(out.dtype))


# ---------------------------------------------------------------------------------------------
# compact_band: pair a region's live units with holes outside it and rebind them
# ---------------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=["phys_top", "region_lo", "region_hi"],
    do_not_specialize_on_alignment=["src_out_ptr", "dst_out_ptr"],
)
def _compact_band_kernel(
    v2p_ptr,
    p2v_ptr,
    phys_free_ptr,
    phys_top,
    region_lo,
    region_hi,
    src_out_ptr,
    dst_out_ptr,
    BLOCK: tl.constexpr,
):
    # A single program: how many units are live (L) and how long the filtered stack is (F) are
    # only known here, and each pass needs the totals of the one before it.
    offs = tl.arange(0, BLOCK)
    k = region_hi - region_lo

    # Pass 1: filter the stack in place, stably, to the ids outside the region. The write
    # position of an entry never exceeds its read position, so a chunk may be stored over the
    # stack once it is fully loaded: the barrier separates the chunk's loads (by every thread)
    # from its stores. Later chunks read only positions past everything stored so far.
    n_keep = tl.zeros((), dtype=tl.int32)
    for start in range(0, phys_top, BLOCK):
        idx = start + offs
        inb = idx < phys_top
        ids = tl.load(phys_free_ptr + idx, mask=inb, other=-1)
        keep = (inb & ((ids < region_lo) | (ids >= region_hi))).to(tl.int32)
        pos = n_keep + tl.cumsum(keep, axis=0) - keep
        tl.debug_barrier()
        tl.store(phys_free_ptr + pos, ids, mask=keep != 0)
        n_keep += tl.sum(keep, axis=0)

    # Pass 2: the live units of the region, ascending, into src_out[:L].
    n_live = tl.zeros((), dtype=tl.int32)
    for start in range(0, k, BLOCK):
        unit = region_lo + start + offs
        inr = unit < region_hi
        vid = tl.load(p2v_ptr + unit, mask=inr, other=-1)
        live = (inr & (vid != -1)).to(tl.int32)
        pos = n_live + tl.cumsum(live, axis=0) - live
        tl.store(src_out_ptr + pos, unit, mask=live != 0)
        n_live += tl.sum(live, axis=0)

    # Pass 3 reads src_out and the filtered stack, written above by other threads.
    tl.debug_barrier()

    # Pass 3: pair source j with filtered-stack entry F - L + j, rebind, pad the rest with -1.
    # Sources are in the region and destinations outside it, so no pair touches another's
    # p2v entry, and each v2p entry is written once.
    dst_base = n_keep - n_live
    for start in range(0, k, BLOCK):
        j = start + offs
        in_k = j < k
        pair = j < n_live
        src = tl.load(src_out_ptr + j, mask=pair, other=-1)
        dst = tl.load(phys_free_ptr + dst_base + j, mask=pair & (dst_base + j >= 0), other=-1)
        vid = tl.load(p2v_ptr + src, mask=pair, other=-1)
        tl.store(dst_out_ptr + j, dst, mask=in_k)
        tl.store(src_out_ptr + j, -1, mask=in_k & (j >= n_live))
        tl.store(v2p_ptr + vid, dst, mask=pair & (vid >= 0))
        tl.store(p2v_ptr + src, -1, mask=pair)
        tl.store(p2v_ptr + dst, vid, mask=pair & (dst >= 0))


def compact_band_triton(
    v2p: torch.Tensor,
    p2v: torch.Tensor,
    phys_free: torch.Tensor,
    phys_top: int,
    region_lo: int,
    region_hi: int,
    src_out: torch.Tensor,
    dst_out: torch.Tensor,
    *,
    block: int = _BLOCK_COMPACT,
) -> None:
    """Triton launcher of ``compact_band``: one single-program launch; none when ``k <= 0``.

    ``block`` (a power of two) is the chunk the program sweeps the stack and the region in;
    tests lower it to exercise the chunk loops at small sizes. Cost is linear in ``phys_top``
    on one SM (the block and warps were chosen by measurement: docs/decisions.md,
    compaction).
    """
    k = region_hi - region_lo
    if k <= 0:
        return
    for name, t in (
        ("v2p", v2p),
        ("p2v", p2v),
        ("phys_free", phys_free),
        ("src_out", src_out),
        ("dst_out", dst_out),
    ):
        _check_table(name, t)
    if src_out.numel() < k or dst_out.numel() < k:
        raise ValueError(f"src_out/dst_out need at least {k} entries")
    if region_lo < 0 or region_hi > p2v.numel() or phys_top > phys_free.numel():
        raise ValueError(f"region [{region_lo}, {region_hi}) or phys_top={phys_top} out of range")
    # num_stages=1: no software pipelining of the chunk loops. Pass 1 filters the stack in
    # place and is correct without it too (a chunk only reads past every earlier store), but
    # nothing is gained by prefetching in a loop this short, and it keeps the order plain.
    _compact_band_kernel[(1,)](
        v2p,
        p2v,
        phys_free,
        phys_top,
        region_lo,
        region_hi,
        src_out,
        dst_out,
        BLOCK=block,
        num_warps=8,
        num_stages=1,
    )


def compact_band_reference(
    v2p: torch.Tensor,
    p2v: torch.Tensor,
    phys_free: torch.Tensor,
    phys_top: int,
    region_lo: int,
    region_hi: int,
    src_out: torch.Tensor,
    dst_out: torch.Tensor,
) -> None:
    """Evacuate the physical region ``[region_lo, region_hi)`` of a band into its holes.

    With ``k = region_hi - region_lo``:

    1. ``live`` = the units of the region with ``p2v != -1``, ascending; ``L = len(live)``;
    2. the free stack ``phys_free[:phys_top]`` is filtered, stably, to the ids outside the region
       (written back to its front);
    3. the top ``L`` entries of the filtered stack become the destinations, in stack order;
    4. ``src_out[:L] = live``, ``dst_out[:L] = destinations``, ``src_out[L:k] = dst_out[L:k] = -1``;
    5. every pair is rebound: ``v = p2v[s]``; ``v2p[v] = d``; ``p2v[d] = v``; ``p2v[s] = -1``.

    The new stack top is ``phys_top - k`` whatever ``L`` is, so the host knows it without a
    read. The caller copies the bytes with ``copy_units(src_out, dst_out)`` next in stream order
    and shrinks the band's extent by the region. Preconditions: the stack holds exactly the
    band's free units (so ``phys_top >= k`` guarantees enough holes); ``src_out``/``dst_out``
    have at least ``k`` entries.
    """
    k = region_hi - region_lo
    if k <= 0:
        return
    region = torch.arange(region_lo, region_hi, device=p2v.device)
    live = region[p2v[region_lo:region_hi] != -1]
    stack = phys_free[:phys_top].long()
    keep = stack[(stack < region_lo) | (stack >= region_hi)]
    phys_free[: keep.numel()] = keep.to(phys_free.dtype)
    n_live = live.numel()
    dst = keep[keep.numel() - n_live :]
    src_out[:k] = -1
    dst_out[:k] = -1
    src_out[:n_live] = live.to(src_out.dtype)
    dst_out[:n_live] = dst.to(dst_out.dtype)
    if n_live:
        v = p2v[live].long()
        v2p[v] = dst.to(v2p.dtype)
        p2v[live] = -1
        p2v[dst] = v.to(p2v.dtype)


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


bind_units = kernel_op(
    "bind_units", triton=bind_units_triton, reference=bind_units_reference, device_of="v2p"
)


unbind_units = kernel_op(
    "unbind_units", triton=unbind_units_triton, reference=unbind_units_reference, device_of="v2p"
)


translate_tokens = kernel_op(
    "translate_tokens",
    triton=translate_tokens_triton,
    reference=translate_tokens_reference,
    device_of="vtok",
)


translate_slots = kernel_op(
    "translate_slots",
    triton=translate_slots_triton,
    reference=translate_slots_reference,
    device_of="v",
)


compact_band = kernel_op(
    "compact_band", triton=compact_band_triton, reference=compact_band_reference, device_of="p2v"
)
