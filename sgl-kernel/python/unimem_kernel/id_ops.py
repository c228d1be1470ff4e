"""Id-space ops: bind, unbind, translate and compact units of one id space.

An *id space* is a pair of int32 device tables that are allocated once and only mutated in
place (their addresses are stable for CUDA graphs):

- ``v2p[V]``: virtual id -> physical unit, ``-1`` when unbound;
- ``p2v[P]``: physical unit -> virtual id, ``-1`` for a hole (free unit) or the sink.

Free physical units live on a device *free stack* ``phys_free[P]`` (int32) whose first
``phys_top`` entries are the free ids. The host never reads the stack: it knows how many ids it
holds (``phys_top``) because it decided every push and pop, and passes that count to each op as a
plain int. Virtual ids may come from a second stack, ``virt_free``, managed the same way.

Every op here is one launch, allocates nothing, and never reads device memory on the host.
Each has a torch reference (``*_reference``) with identical semantics; the public function
runs the Triton kernel on CUDA tensors and the reference otherwise (see ``_dispatch``).

Request tables: ``req_to_token[R, ctx]`` (int32) holds one virtual token id per token,
``vtok = vpage * page_size + offset``. Ops that touch it address whole pages by
``(unit_rows[i], unit_cols[i])``: request row and page column (token ``col * page_size + o``).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------
# torch references (the oracle; also the CPU implementation)
# ---------------------------------------------------------------------------------------------


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
        assert unit_rows is not None and unit_cols is not None
        offs = torch.arange(page_size, device=v.device)
        cols = unit_cols[:n].long()[:, None] * page_size + offs[None, :]
        rows = unit_rows[:n].long()[:, None].expand_as(cols)
        vals = v[:, None] * page_size + offs[None, :]
        ok = cols < req_to_token.shape[1]
        req_to_token[rows[ok], cols[ok]] = vals[ok].to(req_to_token.dtype)


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
        assert req_to_token is not None and unit_rows is not None and unit_cols is not None
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
# public entry points: Triton on CUDA tensors, the reference otherwise
# ---------------------------------------------------------------------------------------------


def bind_units(v2p, p2v, phys_free, phys_top, n, vids, **kw) -> None:
    """See ``bind_units_reference`` for the contract."""
    bind_units_reference(v2p, p2v, phys_free, phys_top, n, vids, **kw)


def unbind_units(v2p, p2v, phys_free, phys_top, n, **kw) -> None:
    """See ``unbind_units_reference`` for the contract."""
    unbind_units_reference(v2p, p2v, phys_free, phys_top, n, **kw)


def translate_tokens(vtok, v2p, page_size, out) -> None:
    """See ``translate_tokens_reference`` for the contract."""
    translate_tokens_reference(vtok, v2p, page_size, out)


def compact_band(v2p, p2v, phys_free, phys_top, region_lo, region_hi, src_out, dst_out) -> None:
    """See ``compact_band_reference`` for the contract."""
    compact_band_reference(v2p, p2v, phys_free, phys_top, region_lo, region_hi, src_out, dst_out)
