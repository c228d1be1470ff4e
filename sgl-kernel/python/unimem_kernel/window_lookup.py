"""Per-lane windows of row-major tables, with out-of-range entries read from one fallback cell.

``window_lookup(tables, rows, starts, width, offset)`` returns, for each table ``T [R, C]``,
``out [bs, width]`` with ``out[b, i] = T[rows[b], starts[b] + offset + i]`` where the row is in
``[0, R)`` and the column in ``[0, C)``, and ``T[0, C - 1]`` (the fallback cell) elsewhere. All
tables are read at the same cells, in one launch of ``bs`` programs — in torch the bounds,
the index arithmetic and one gather per table are about fifteen small kernels. It serves the
acceptance control of the benchmarks and validation (:mod:`unimem.speculative.control`), whose
tables keep "unknown" in the fallback cell, so a lane past its reference reads "unknown".

Contract (checked on the host from metadata only; fixed grid, no host reads: capturable):
``tables``: one or two contiguous 2-D tensors of one shape ``[R, C]`` (``R, C >= 1``), each
int32, int64, uint8 or bool; ``rows [bs]`` and ``starts [bs]`` int32/int64 (any values:
out-of-range ones read the fallback); ``width >= 0``; ``offset`` an int. Returns new
``[bs, width]`` tensors of the tables' dtypes. Integer work only: equal to
:func:`window_lookup_reference` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = ["window_lookup", "window_lookup_reference", "window_lookup_triton"]

_MAX_TABLES = 2
_DTYPES = (torch.int32, torch.int64, torch.uint8, torch.bool)


@triton.jit
def _window_lookup_kernel(
    t0_ptr,
    o0_ptr,
    t1_ptr,
    o1_ptr,
    rows_ptr,
    starts_ptr,
    R,
    C,
    offset,
    WIDTH: tl.constexpr,
    WP: tl.constexpr,  # next_pow2(WIDTH)
    N_TABLES: tl.constexpr,
):
    """Program ``b``: lane ``b``'s window of every table."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b).to(tl.int64)
    i = tl.arange(0, WP)
    imask = i < WIDTH
    p = tl.load(starts_ptr + b).to(tl.int64) + offset + i
    ok = (r >= 0) & (r < R) & (p >= 0) & (p < C)
    cell = tl.where(ok, r * C + p, C - 1)
    v = tl.load(t0_ptr + cell, mask=imask)
    tl.store(o0_ptr + b * WIDTH + i, v, mask=imask)
    if N_TABLES >= 2:
        v = tl.load(t1_ptr + cell, mask=imask)
        tl.store(o1_ptr + b * WIDTH + i, v, mask=imask)


def _check(tables: Sequence[torch.Tensor], rows: torch.Tensor, starts: torch.Tensor,
           width: int) -> None:  # fmt: skip
    if not 1 <= len(tables) <= _MAX_TABLES:
        raise ValueError(f"window_lookup takes 1 to {_MAX_TABLES} tables, got {len(tables)}")
    shape = tables[0].shape
    for k, t in enumerate(tables):
        if t.dim() != 2 or t.dtype not in _DTYPES:
            raise ValueError(f"tables[{k}] must be a 2-D int32/int64/uint8/bool tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
        if t.shape != shape:
            raise ValueError(f"tables[{k}] has shape {tuple(t.shape)}, tables[0] {tuple(shape)}")
        if not t.is_contiguous():
            raise ValueError(f"tables[{k}] must be contiguous")
        if t.device != rows.device:
            raise ValueError(f"tables[{k}] is on {t.device}, rows on {rows.device}")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"tables must have at least one row and column, got {tuple(shape)}")
    for name, v in (("rows", rows), ("starts", starts)):
        if v.dim() != 1 or v.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 vector, got {v.dtype} "
                             f"{tuple(v.shape)}")  # fmt: skip
    if starts.shape != rows.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and rows {tuple(rows.shape)} differ")
    if starts.device != rows.device:
        raise ValueError(f"starts is on {starts.device}, rows on {rows.device}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be a non-negative int, got {width!r}")


def window_lookup_reference(
    tables: Sequence[torch.Tensor],
    rows: torch.Tensor,
    starts: torch.Tensor,
    width: int,
    offset: int = 0,
) -> list[torch.Tensor]:
    """Lane ``b``'s ``width`` cells of each table (a sequence of one or two) from
    ``(rows[b], starts[b] + offset)`` (module docstring)."""
    n_rows, n_cols = tables[0].shape
    r = rows.long()[:, None]
    p = starts.long()[:, None] + offset + torch.arange(width, device=rows.device)[None, :]
    ok = (r >= 0) & (r < n_rows) & (p >= 0) & (p < n_cols)
    r, p = torch.where(ok, r, 0), torch.where(ok, p, n_cols - 1)
    return [t[r, p] for t in tables]


def window_lookup_triton(
    tables: Sequence[torch.Tensor],
    rows: torch.Tensor,
    starts: torch.Tensor,
    width: int,
    offset: int = 0,
) -> list[torch.Tensor]:
    """Triton launcher of :func:`window_lookup` (arguments already checked): one launch, one
    program per lane."""
    tables = tuple(tables)
    bs = rows.shape[0]
    outs = [torch.empty(bs, width, dtype=t.dtype, device=t.device) for t in tables]
    if bs == 0 or width == 0:
        return outs
    pairs = list(zip(tables, outs, strict=True))
    pairs += [pairs[0]] * (_MAX_TABLES - len(pairs))  # unused (N_TABLES): never dereferenced
    n_rows, n_cols = tables[0].shape
    _window_lookup_kernel[(bs,)](
        pairs[0][0], pairs[0][1], pairs[1][0], pairs[1][1], rows, starts, n_rows, n_cols,
        int(offset), WIDTH=width, WP=next_pow2(width), N_TABLES=len(tables), num_warps=1,
    )  # fmt: skip
    return outs


def _check_lookup(
    tables: Sequence[torch.Tensor],
    rows: torch.Tensor,
    starts: torch.Tensor,
    width: int,
    offset: int = 0,
) -> None:
    _check(tuple(tables), rows, starts, width)


window_lookup = kernel_op(
    "window_lookup",
    triton=window_lookup_triton,
    reference=window_lookup_reference,
    device_of="rows",
    check=_check_lookup,
)
