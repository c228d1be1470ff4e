"""A step's write window: where each new token's K/V goes, in physical FULL and SWA slots.

A decode or verify step writes ``width`` tokens per request (1 for decode, ``gamma + 1`` for a
chain verify) at positions ``seq_lens[b] + j``, ``j < width``. Their slots were reserved ahead
in the request table ``req_to_token[R, ctx]`` as *virtual* token ids
(``vtok = vpage * page_size + o``); this op gathers them and translates each through a space's
``v2p`` table (virtual page -> physical page, ``-1`` = unbound):

    phys_tok = v2p[vtok // page_size] * page_size + vtok % page_size

Flat outputs of ``bs * width`` entries, entry ``i = b * width + j``:

- ``out_full[i]``: physical FULL token slot (``full_v2p=None``: identity, slot = vtok);
- ``out_swa[i]``: physical SWA token slot through ``swa_v2p`` (both None, or both given);
- ``out_positions[i] = seq_lens[b] + j`` (int64: models feed positions to RoPE).

A position outside ``[0, ctx)``, a request row outside ``[0, R)``, a negative virtual token
id, a virtual page past the end of ``v2p`` and an unbound page all give slot 0: the first slot
of the sink page, whose contents nobody reads as live data. One launch on a fixed 1-D grid of
``ceil(bs * width / BLOCK)`` programs; no allocation, no host read, so the op is recorded in a
step's CUDA graph and re-reads ``req_to_token`` and ``v2p`` on every replay. Slots are formed
in int64 and stored in the output's dtype (int32 or int64). Triton does not specialise on
``bs * width``, ``width`` or table sizes; ``page_size``, identity and SWA on/off are
``constexpr`` (warm each variant eagerly before capture).

``gather_ragged_write_window`` is the same gather for a *packed* ragged verify: request ``b``
writes ``L_b`` tokens at ``seq_lens[b] .. seq_lens[b] + L_b - 1``, packed back to back at
entries ``cu_seqlens_q[b] ..`` of fixed-size outputs of ``num_rows`` entries (``num_rows >=
sum L_b``). The lengths are device data (``cu_seqlens_q``, written by the step's metadata
kernel); entries past ``cu_seqlens_q[bs]`` are padding rows: slot 0 (the sink) and position
0. Each entry finds its request by scanning the ``bs + 1`` prefix sums (``bs`` is small; no
host read, fixed grid of ``ceil(num_rows / BLOCK)`` programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

_MAX_BLOCK = 128  # one entry per thread: many small programs (see metadata.py)

# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _translate_slot(vtok, v2p_ptr, v2p_numel, PAGE_SIZE: tl.constexpr, IDENTITY: tl.constexpr):
    """Physical token slot of virtual token ids ``vtok`` (int64; negative = invalid), else 0."""
    ok = vtok >= 0
    t = tl.where(ok, vtok, 0)
    if IDENTITY:
        slot = t
    else:
        vpage = t // PAGE_SIZE
        ok = ok & (vpage < v2p_numel)
        phys = tl.load(v2p_ptr + vpage, mask=ok, other=-1).to(tl.int64)
        ok = ok & (phys >= 0)
        slot = phys * PAGE_SIZE + (t - vpage * PAGE_SIZE)
    return tl.where(ok, slot, 0)


@triton.jit(
    do_not_specialize=["r2t_rows", "r2t_width", "n", "width", "full_v2p_numel", "swa_v2p_numel"]
)
def _write_window_kernel(
    r2t_ptr,
    r2t_rows,
    r2t_width,
    r2t_stride_r,
    r2t_stride_c,
    rpi_ptr,
    seq_lens_ptr,
    n,
    width,
    full_v2p_ptr,
    full_v2p_numel,
    swa_v2p_ptr,
    swa_v2p_numel,
    out_full_ptr,
    out_swa_ptr,
    out_pos_ptr,
    PAGE_SIZE: tl.constexpr,
    FULL_IDENTITY: tl.constexpr,
    HAS_SWA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    b = i // width
    j = i - b * width
    req = tl.load(rpi_ptr + b, mask=m, other=-1).to(tl.int64)
    pos = tl.load(seq_lens_ptr + b, mask=m, other=0).to(tl.int64) + j
    ok = m & (req >= 0) & (req < r2t_rows) & (pos >= 0) & (pos < r2t_width)
    src = r2t_ptr + req * r2t_stride_r + pos * r2t_stride_c
    vtok = tl.load(src, mask=ok, other=-1).to(tl.int64)
    full = _translate_slot(vtok, full_v2p_ptr, full_v2p_numel, PAGE_SIZE, FULL_IDENTITY)
    tl.store(out_full_ptr + i, full.to(out_full_ptr.dtype.element_ty), mask=m)
    if HAS_SWA:
        swa = _translate_slot(vtok, swa_v2p_ptr, swa_v2p_numel, PAGE_SIZE, False)
        tl.store(out_swa_ptr + i, swa.to(out_swa_ptr.dtype.element_ty), mask=m)
    tl.store(out_pos_ptr + i, pos.to(out_pos_ptr.dtype.element_ty), mask=m)


@triton.jit(
    do_not_specialize=["r2t_rows", "r2t_width", "n", "bs", "full_v2p_numel", "swa_v2p_numel"]
)
def _ragged_window_kernel(
    r2t_ptr,
    r2t_rows,
    r2t_width,
    r2t_stride_r,
    r2t_stride_c,
    rpi_ptr,
    seq_lens_ptr,
    cu_ptr,
    n,
    bs,
    full_v2p_ptr,
    full_v2p_numel,
    swa_v2p_ptr,
    swa_v2p_numel,
    out_full_ptr,
    out_swa_ptr,
    out_pos_ptr,
    PAGE_SIZE: tl.constexpr,
    FULL_IDENTITY: tl.constexpr,
    HAS_SWA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    # request of entry i: the number of prefix-sum ends cu[k + 1] <= i (bs for padding rows)
    b = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, bs):
        end = tl.load(cu_ptr + k + 1)
        b += (end <= i).to(tl.int32)
    live = m & (b < bs)
    bb = tl.where(live, b, 0)
    start = tl.load(cu_ptr + bb, mask=live, other=0).to(tl.int64)
    req = tl.load(rpi_ptr + bb, mask=live, other=-1).to(tl.int64)
    pos = tl.load(seq_lens_ptr + bb, mask=live, other=0).to(tl.int64) + (i - start)
    pos = tl.where(live, pos, 0)
    ok = live & (req >= 0) & (req < r2t_rows) & (pos >= 0) & (pos < r2t_width)
    src = r2t_ptr + req * r2t_stride_r + pos * r2t_stride_c
    vtok = tl.load(src, mask=ok, other=-1).to(tl.int64)
    full = _translate_slot(vtok, full_v2p_ptr, full_v2p_numel, PAGE_SIZE, FULL_IDENTITY)
    tl.store(out_full_ptr + i, full.to(out_full_ptr.dtype.element_ty), mask=m)
    if HAS_SWA:
        swa = _translate_slot(vtok, swa_v2p_ptr, swa_v2p_numel, PAGE_SIZE, False)
        tl.store(out_swa_ptr + i, swa.to(out_swa_ptr.dtype.element_ty), mask=m)
    tl.store(out_pos_ptr + i, pos.to(out_pos_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------


def _check_args(
    req_to_token, req_pool_indices, seq_lens, width, swa_v2p, out_full, out_swa, out_positions
) -> int:
    """Shape and dtype checks (host metadata only, no device read); returns ``bs``."""
    bs = req_pool_indices.numel()
    n = bs * width
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D, got {tuple(req_to_token.shape)}")
    if (swa_v2p is None) != (out_swa is None):
        raise ValueError("swa_v2p and out_swa must be given together (or both None)")
    for t, name, need in (
        (req_pool_indices, "req_pool_indices", bs),
        (seq_lens, "seq_lens", bs),
        (out_full, "out_full", n),
        (out_swa, "out_swa", n),
        (out_positions, "out_positions", n),
    ):
        if t is None:
            continue
        if t.dim() != 1 or t.numel() < need or (need > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be 1-D, unit-stride, with at least {need} entries")
    for t, name in ((out_full, "out_full"), (out_swa, "out_swa")):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if out_positions.dtype != torch.int64:
        raise ValueError(f"out_positions must be int64, got {out_positions.dtype}")
    return bs


def gather_write_window_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    out_full: torch.Tensor,
    out_swa: torch.Tensor | None,
    out_positions: torch.Tensor,
) -> None:
    """Triton launcher of ``gather_write_window`` (one launch; none when ``bs * width == 0``)."""
    _check_args(
        req_to_token, req_pool_indices, seq_lens, width, swa_v2p, out_full, out_swa, out_positions
    )
    n = req_pool_indices.numel() * int(width)
    if n == 0:
        return
    block = min(next_pow2(n), _MAX_BLOCK)
    _write_window_kernel[(triton.cdiv(n, block),)](
        *_table_args(req_to_token),
        req_pool_indices,
        seq_lens,
        n,
        int(width),
        *_output_args(full_v2p, swa_v2p, out_full, out_swa, out_positions),
        **_launch_meta(page_size, full_v2p, swa_v2p, block),
    )


def _table_args(req_to_token: torch.Tensor) -> tuple:
    """The request table as both window kernels take it: pointer, shape, strides."""
    return (req_to_token, *req_to_token.shape, *req_to_token.stride())


def _output_args(full_v2p, swa_v2p, out_full, out_swa, out_positions) -> tuple:
    """The v2p tables (with their sizes) and the outputs, as both window kernels take them;
    an absent table or output is replaced by ``out_full`` (never read or written then)."""
    has_swa = swa_v2p is not None
    return (
        full_v2p if full_v2p is not None else out_full,
        full_v2p.numel() if full_v2p is not None else 0,
        swa_v2p if has_swa else out_full,
        swa_v2p.numel() if has_swa else 0,
        out_full,
        out_swa if has_swa else out_full,
        out_positions,
    )


def _launch_meta(page_size: int, full_v2p, swa_v2p, block: int) -> dict:
    """The constexprs and warps of both window kernels."""
    return dict(
        PAGE_SIZE=int(page_size),
        FULL_IDENTITY=full_v2p is None,
        HAS_SWA=swa_v2p is not None,
        BLOCK=block,
        num_warps=max(1, min(block // 32, 4)),
    )


def gather_ragged_write_window_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    out_full: torch.Tensor,
    out_swa: torch.Tensor | None,
    out_positions: torch.Tensor,
) -> None:
    """Triton launcher of ``gather_ragged_write_window`` (one launch; ``num_rows`` =
    ``out_full.numel()``; none when 0)."""
    bs, n = _check_ragged_args(
        req_to_token, req_pool_indices, seq_lens, cu_seqlens_q, swa_v2p, out_full, out_swa,
        out_positions,
    )  # fmt: skip
    if n == 0:
        return
    block = min(next_pow2(n), _MAX_BLOCK)
    _ragged_window_kernel[(triton.cdiv(n, block),)](
        *_table_args(req_to_token),
        req_pool_indices,
        seq_lens,
        cu_seqlens_q,
        n,
        bs,
        *_output_args(full_v2p, swa_v2p, out_full, out_swa, out_positions),
        **_launch_meta(page_size, full_v2p, swa_v2p, block),
    )


def _check_ragged_args(
    req_to_token, req_pool_indices, seq_lens, cu_seqlens_q, swa_v2p, out_full, out_swa,
    out_positions,
) -> tuple[int, int]:  # fmt: skip
    """Checks of the ragged gather (host metadata only); returns ``(bs, num_rows)``."""
    bs = req_pool_indices.numel()
    n = out_full.numel()
    _check_args(req_to_token, req_pool_indices, seq_lens, 0, swa_v2p, out_full, out_swa,
                out_positions)  # fmt: skip
    for t, name, need in (
        (cu_seqlens_q, "cu_seqlens_q", bs + 1),
        (out_positions, "out_positions", n),
        (out_swa, "out_swa", n),
    ):
        if t is None:
            continue
        if t.dim() != 1 or t.numel() < need or t.stride(0) != 1:
            raise ValueError(f"{name} must be 1-D, unit-stride, with at least {need} entries")
    if out_full.dim() != 1 or (n > 1 and out_full.stride(0) != 1):
        raise ValueError("out_full must be 1-D and unit-stride")
    return bs, n


# ---------------------------------------------------------------------------------------------
# torch reference (the oracle; also the CPU implementation)
# ---------------------------------------------------------------------------------------------


def _translate_slot_reference(vtok: torch.Tensor, v2p: torch.Tensor | None, page_size: int):
    ok = vtok >= 0
    t = vtok.clamp_min(0)
    if v2p is None:
        return torch.where(ok, t, 0)
    vpage = torch.div(t, page_size, rounding_mode="floor")
    ok = ok & (vpage < v2p.numel())
    if v2p.numel() == 0:
        return torch.zeros_like(t)
    phys = v2p[vpage.clamp_max(v2p.numel() - 1)].long()
    ok = ok & (phys >= 0)
    return torch.where(ok, phys * page_size + t % page_size, 0)


def _write_window_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    out_full: torch.Tensor,
    out_swa: torch.Tensor | None,
    out_positions: torch.Tensor,
) -> None:
    bs = req_pool_indices.numel()
    n = bs * int(width)
    if n == 0:
        return
    rows, ctx = req_to_token.shape
    req = req_pool_indices[:bs].long()[:, None]
    pos = seq_lens[:bs].long()[:, None] + torch.arange(width, device=req.device)[None, :]
    ok = (req >= 0) & (req < rows) & (pos >= 0) & (pos < ctx)
    if rows > 0 and ctx > 0:
        vtok = req_to_token[req.clamp(0, rows - 1), pos.clamp(0, ctx - 1)].long()
        vtok = torch.where(ok, vtok, -1)
    else:
        vtok = torch.full(pos.shape, -1, dtype=torch.long, device=pos.device)
    out_full[:n] = _translate_slot_reference(vtok, full_v2p, page_size).reshape(-1)
    if out_swa is not None:
        out_swa[:n] = _translate_slot_reference(vtok, swa_v2p, page_size).reshape(-1)
    out_positions[:n] = pos.reshape(-1)


def gather_write_window_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    out_full: torch.Tensor,
    out_swa: torch.Tensor | None,
    out_positions: torch.Tensor,
) -> None:
    """Gather and translate each request's next ``width`` write slots, in place.

    With ``bs = req_pool_indices.numel()``, for ``b < bs``, ``j < width``, ``i = b * width + j``:
    ``pos = seq_lens[b] + j``; ``vtok = req_to_token[req_pool_indices[b], pos]``;
    ``out_full[i]`` = physical FULL slot of ``vtok`` (``full_v2p=None``: identity);
    ``out_swa[i]`` = physical SWA slot through ``swa_v2p`` (both None, or both given);
    ``out_positions[i] = pos``. Sink rules: see the module docstring.

    Inputs: ``req_to_token [R, ctx]`` (may be a strided view), ``req_pool_indices [bs]``,
    ``seq_lens [bs]``, ``v2p`` tables 1-D; all int32. Outputs are flat, caller-owned, with at
    least ``bs * width`` entries (entries past that are not touched): ``out_full``/``out_swa``
    int32 or int64, ``out_positions`` int64.
    """
    _check_args(
        req_to_token, req_pool_indices, seq_lens, width, swa_v2p, out_full, out_swa, out_positions
    )
    _write_window_reference(
        req_to_token, req_pool_indices, seq_lens, width, page_size, full_v2p, swa_v2p,
        out_full, out_swa, out_positions,
    )  # fmt: skip


def gather_ragged_write_window_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    page_size: int,
    full_v2p: torch.Tensor | None,
    swa_v2p: torch.Tensor | None,
    out_full: torch.Tensor,
    out_swa: torch.Tensor | None,
    out_positions: torch.Tensor,
) -> None:
    """Gather and translate the write slots of a packed ragged verify, in place.

    With ``bs = req_pool_indices.numel()`` and ``n = out_full.numel()`` (the packed rows),
    entry ``i`` belongs to request ``b`` with ``cu_seqlens_q[b] <= i < cu_seqlens_q[b + 1]``:
    ``pos = seq_lens[b] + i - cu_seqlens_q[b]``, ``vtok = req_to_token[req_pool_indices[b],
    pos]``, ``out_full[i]`` / ``out_swa[i]`` its physical slots and ``out_positions[i] = pos``
    (sink rules as ``gather_write_window``). Entries ``i >= cu_seqlens_q[bs]`` (padding) get
    slot 0 and position 0. ``cu_seqlens_q [bs + 1]`` int32 non-decreasing from 0 (a device
    tensor: never read on the host here); other inputs as ``gather_write_window``; outputs
    flat, caller-owned: ``out_full`` (and ``out_swa``, ``out_positions``) of ``n`` entries."""
    bs, n = _check_ragged_args(
        req_to_token, req_pool_indices, seq_lens, cu_seqlens_q, swa_v2p, out_full, out_swa,
        out_positions,
    )  # fmt: skip
    if n == 0:
        return
    dev = out_full.device
    i = torch.arange(n, device=dev)
    cu = cu_seqlens_q[: bs + 1].long()
    b = (cu[None, 1:] <= i[:, None]).sum(dim=1) if bs > 0 else torch.zeros_like(i)
    live = b < bs
    bb = b.clamp(max=max(bs - 1, 0))
    rows, ctx = req_to_token.shape
    if bs == 0 or rows == 0 or ctx == 0:
        vtok = torch.full((n,), -1, dtype=torch.long, device=dev)
        pos = torch.zeros(n, dtype=torch.long, device=dev)
    else:
        req = req_pool_indices.long()[bb]
        pos = torch.where(live, seq_lens.long()[bb] + i - cu[bb], 0)
        ok = live & (req >= 0) & (req < rows) & (pos >= 0) & (pos < ctx)
        vtok = req_to_token[req.clamp(0, rows - 1), pos.clamp(0, ctx - 1)].long()
        vtok = torch.where(ok, vtok, -1)
    out_full.copy_(_translate_slot_reference(vtok, full_v2p, page_size))
    if out_swa is not None:
        out_swa.copy_(_translate_slot_reference(vtok, swa_v2p, page_size))
    out_positions.copy_(pos)


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


gather_write_window = kernel_op(
    "gather_write_window",
    triton=gather_write_window_triton,
    reference=gather_write_window_reference,
    device_of="out_full",
)


gather_ragged_write_window = kernel_op(
    "gather_ragged_write_window",
    triton=gather_ragged_write_window_triton,
    reference=gather_ragged_write_window_reference,
    device_of="out_full",
)
