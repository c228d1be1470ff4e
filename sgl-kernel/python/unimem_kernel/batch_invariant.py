"""Batch-invariant GEMM, grouped GEMM, RMS norm and log-softmax (deterministic inference).

A row's result from these ops is bitwise independent of how many other rows share the call,
of where the row sits in the batch, and (grouped GEMM) of how the other rows are spread over
the experts. cuBLAS picks another algorithm, tile or split-K per ``M``, so a request's bf16
logits drift with the batch it is served in; these kernels do not.

How invariance is obtained:

- **GEMMs** (:func:`bi_matmul`, :func:`bi_linear`, :func:`bi_grouped_linear`): one fixed tile
  configuration per ``(dtype, K, N)`` (:func:`matmul_config`, never looking at ``M`` and never
  autotuned), no split-K, fp32 accumulation over ``K`` in ``BLOCK_K`` chunks always in
  ascending order, bias added in fp32 after the reduction. So each output element's reduction
  order is a function of ``K`` and the tile configuration only. The row count is not a
  specialised launch argument (``do_not_specialize``), so ``M == 1`` compiles to the same code
  as any other ``M``. The kernels assume (as every batch-invariant GEMM does) that the
  tensor-core MMA computes each output element from its own row and column alone, in an order
  that does not depend on the element's position inside the tile.
- **Row ops** (:func:`bi_rms_norm`, :func:`bi_log_softmax`): one program per row, a fixed
  ``BLOCK`` over the last dim (a function of that dim only) walked in fixed chunk order.

Every public op is a ``_dispatch.kernel_op``: Triton on CUDA (or when forced), else the
``*_reference`` torch function of identical semantics. The
references compute in fp32 with torch's own kernels: they agree with the Triton kernels to
rounding, not bitwise, and they are not batch-invariant themselves on CUDA. For float64
inputs every op is its exact torch counterpart in float64 (the CPU oracle).

Outputs are freshly allocated and owned by the caller (:func:`bi_grouped_linear` can write
into a caller-owned ``out``). No op reads device memory on the host, so all of them can be
captured in CUDA graphs (the launch grids depend on shapes only).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import grouped_row_tiles, kernel_op, next_pow2

__all__ = [
    "MatmulConfig",
    "bi_grouped_linear",
    "bi_grouped_linear_reference",
    "bi_linear",
    "bi_linear_reference",
    "bi_log_softmax",
    "bi_log_softmax_reference",
    "bi_matmul",
    "bi_matmul_reference",
    "bi_rms_norm",
    "bi_rms_norm_reference",
    "matmul_config",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (*_KERNEL_DTYPES, torch.float64)


class MatmulConfig(NamedTuple):
    """A GEMM tile configuration (Triton launch constants)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int  # row tiles per L2 swizzle group (launch order only, never numerics)


def matmul_config(dtype: torch.dtype, k: int, n: int) -> MatmulConfig:
    """The one tile configuration of a GEMM with inputs of ``dtype`` and reduction size ``k``
    into ``n`` columns. A pure function of its arguments: ``M`` is never an input, so every
    row count runs the same compiled kernel with the same reduction order.

    fp16/bf16: 128 x 128 output tiles, ``BLOCK_K`` 64, 8 warps, 3 stages (96 KiB of shared
    memory for the pipelined A and B tiles, within a Hopper SM's shared memory); the
    standard Hopper tensor-core tile, efficient for the prefill/verify row counts. For small
    ``n`` (under 4096 columns) the tile is 64 columns wide, so a decode step (one row tile)
    still spreads over at least 32 programs. fp32 (exact, ``ieee`` products, no TF32): 64 x 64
    tiles, ``BLOCK_K`` 32, 4 warps, 3 stages (48 KiB). ``k`` is accepted so that a future
    table may depend on it; today it does not.
    """
    del k
    if dtype == torch.float32:
        return MatmulConfig(64, 64, 32, 4, 3, 8)
    if dtype in (torch.float16, torch.bfloat16):
        return MatmulConfig(128, 128 if n >= 4096 else 64, 64, 8, 3, 8)
    raise ValueError(f"no Triton GEMM tiles for dtype {dtype}")


# The tile configuration the launchers use; tests swap it for smaller tiles so that the
# interpreter exercises several row, column and K tiles at tiny sizes.
_matmul_config = matmul_config


# ------------------------------------------------------------------- validation


def _check_float(name: str, t: torch.Tensor, allowed=_FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be one of {names}, got {t.dtype}")


def _check_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _resolve_out_dtype(a: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None:
        return a.dtype
    if a.dtype == torch.float64:
        if out_dtype != torch.float64:
            raise ValueError(f"out_dtype must be float64 for float64 inputs, got {out_dtype}")
        return out_dtype
    if out_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    return out_dtype


def _check_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> bool:
    """Validates a product's arguments; whether the kernels cover them (float64 runs the
    reference: the CPU oracle's exact counterpart)."""
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {tuple(a.shape)}")
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D [K, N], got shape {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, K] {tuple(a.shape)} and b [K, N] {tuple(b.shape)}: K differs")
    _check_float("a", a)
    if b.dtype != a.dtype:
        raise ValueError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    _check_device("b", b, a, "a")
    if bias is not None:
        if bias.shape != (b.shape[1],):
            raise ValueError(f"bias must have shape ({b.shape[1]},), got {tuple(bias.shape)}")
        _check_float("bias", bias)
        _check_device("bias", bias, a, "a")
    _resolve_out_dtype(a, out_dtype)
    return a.dtype != torch.float64


# ------------------------------------------------------------------- GEMM: Triton


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mma_chunk(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr, acc):
    # UPCAST (the interpreter only): the operands are widened to fp32 (exact; its dot cannot
    # multiply bf16) and the chunk is multiplied and summed over K explicitly, in ascending K
    # for every output: the interpreter's dot is numpy's matmul, whose BLAS may round a row
    # differently by its place in the tile (OpenBLAS 0.3.31 does), which would hide what the
    # CPU tests check — that this kernel's reduction does not depend on M. On the GPU the
    # tensor cores take the 16-bit operands directly with fp32 accumulation.
    if UPCAST:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=1)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _k_loop(
    a_rows, b_cols, stride_ak, stride_bk, mask_m, mask_n, k_end, K,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The one reduction of both GEMM kernels: ascending K chunks of BLOCK_K up to ``k_end``
    # (K, or 0 for rows that stay zero), the K tail zero-padded (adding exact zeros changes
    # nothing). Shared so that a row gets the same arithmetic in the plain and grouped GEMMs.
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = (k0 + rk).to(tl.int64)
        mask_k = kk < K
        a = tl.load(
            a_rows + kk[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        b = tl.load(
            b_cols + kk[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        acc = _mma_chunk(a, b, IEEE, UPCAST, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _bi_matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # 1-D launch, swizzled into groups of GROUP_M row tiles for L2 reuse of B: this only
    # changes which program computes a tile, never how a tile is computed.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = rm < M
    mask_n = rn < N
    a_rows = a_ptr + rm[:, None] * stride_am
    b_cols = b_ptr + rn[None, :] * stride_bn
    acc = _k_loop(
        a_rows, b_cols, stride_ak, stride_bk, mask_m, mask_n, K, K,
        IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def bi_matmul_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The Triton kernel of :func:`bi_matmul` (arguments already validated); any strides."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = _matmul_config(a.dtype, k, n)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _bi_matmul_kernel[grid](
        a, b, bias if bias is not None else c, c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, UPCAST=_interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


# ------------------------------------------------------------------- GEMM: reference


def bi_matmul_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a @ b (+ bias)``, batch-invariant: row ``i`` of the result is bitwise the same for
    any number of rows ``M`` and any position of the row in ``a``.

    ``a [M, K]`` and ``b [K, N]`` of one dtype (fp16, bf16, fp32; float64 runs the torch
    reference), any strides (``b`` is typically ``weight.t()``); ``bias [N]`` (any float dtype,
    added in fp32 after the reduction) or ``None``. Returns a new contiguous ``[M, N]`` tensor
    of ``out_dtype`` (default ``a``'s dtype), owned by the caller; ``M == 0`` gives an empty
    one. Products accumulate in fp32 (fp32 inputs: exact ``ieee`` products, no TF32), over
    ``K`` in fixed ascending chunks with the tiles of :func:`matmul_config`.

    The reference: ``a @ b`` in fp32 (float64 for float64), plus ``bias`` in that precision,
    cast to ``out_dtype``."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    c = a.to(acc) @ b.to(acc)
    if bias is not None:
        c = c + bias.to(acc)
    return c.to(out_dtype or a.dtype)


bi_matmul = kernel_op(
    "bi_matmul",
    triton=bi_matmul_triton,
    reference=bi_matmul_reference,
    device_of="a",
    check=_check_matmul,
)


def bi_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant: ``x [..., K]``, ``weight [N, K]`` (of
    ``x``'s dtype), ``bias [N]`` or ``None``; returns a new ``[..., N]`` tensor of ``x``'s
    dtype. It is :func:`bi_matmul` of ``x.reshape(-1, K)`` and ``weight.t()`` (a transposed
    view, no copy), reshaped back."""
    k = x.shape[-1]
    y = bi_matmul_reference(x.reshape(-1, k), weight.t(), bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def bi_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The Triton kernel of :func:`bi_linear` (arguments already validated)."""
    k = x.shape[-1]
    y = bi_matmul_triton(x.reshape(-1, k), weight.t(), bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., K]")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K = {x.shape[-1]}] for x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    return _check_matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias, None)


bi_linear = kernel_op(
    "bi_linear",
    triton=bi_linear_triton,
    reference=bi_linear_reference,
    device_of="x",
    check=_check_linear,
)


# ------------------------------------------------------------------- grouped GEMM: Triton


@triton.jit(do_not_specialize=["T"])
def _bi_grouped_kernel(
    x_ptr,
    rows_ptr,
    w_ptr,
    bias_ptr,
    offs_ptr,
    out_ptr,
    T,
    N,
    K,
    E,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_ot,
    HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    COLS_FASTEST: tl.constexpr,  # launch order only: grid (n, p) instead of (p, n)
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Segments: expert e < E owns rows [offs[e-1], offs[e]); segment E (the tail) owns rows
    # [offs[E-1], T), which are written as zeros. Each segment is cut into row tiles starting
    # at the segment's first row; program (p, n) takes the p-th row tile of all segments in
    # order (found on the device from offs: no host reads) and exits if there is none.
    # COLS_FASTEST numbers the programs column tile first, so the column tiles of one row tile
    # (one expert's weights) are launched side by side; each output tile's arithmetic is the
    # same either way.
    if COLS_FASTEST:
        pid_n = tl.program_id(0)
        p = tl.program_id(1)
    else:
        p = tl.program_id(0)
        pid_n = tl.program_id(1)
    seg = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + seg, mask=seg < E, other=0).to(tl.int32)
    ends = tl.where(seg < E, ends, T)
    starts = tl.load(offs_ptr + seg - 1, mask=(seg >= 1) & (seg <= E), other=0).to(tl.int32)
    counts = tl.maximum(ends - starts, 0)
    tiles = tl.where(seg <= E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)  # inclusive
    e = tl.sum((cum <= p).to(tl.int32), axis=0)
    if e > E:
        return
    sel = seg == e
    row0 = tl.sum(tl.where(sel, starts, 0), axis=0)
    row_end = tl.sum(tl.where(sel, ends, 0), axis=0)
    tile = p - tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
    is_tail = e == E

    rm = (row0 + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = rm < row_end
    mask_n = rn < N
    we = tl.minimum(e, E - 1).to(tl.int64)
    if GATHER:  # noqa: SIM108 (row i of the product reads row rows[i] of x)
        src = tl.load(rows_ptr + rm, mask=mask_m, other=0).to(tl.int64)
    else:
        src = rm
    x_rows = x_ptr + src[:, None] * stride_xt
    w_cols = w_ptr + we * stride_we + rn[None, :] * stride_wn
    k_end = tl.where(is_tail, 0, K)  # the tail's rows stay zero
    acc = _k_loop(
        x_rows, w_cols, stride_xk, stride_wk, mask_m, mask_n, k_end, K,
        IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(bias_ptr + we * stride_be + rn, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(is_tail, 0.0, bias)[None, :]
    o = out_ptr + rm[:, None] * stride_ot + rn[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def bi_grouped_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    *,
    config: MatmulConfig | None = None,
    cols_fastest: bool = False,
) -> torch.Tensor:
    """The Triton kernel of :func:`bi_grouped_linear` (arguments already validated).
    ``config``: the tile configuration (default :func:`matmul_config`'s, the batch-invariant
    one; another fixed configuration keeps each row independent of the others but rounds
    differently). ``rows`` (``[T]`` int, optional): product row ``i`` reads ``x[rows[i]]``
    (the gather of a MoE layer's token rows, done by the loads instead of a copy).
    ``cols_fastest``: launch the column tiles of a row tile side by side (grid ``(n, p)``);
    the launch order only, never the numbers (the same bits either way)."""
    t = x.shape[0] if rows is None else rows.shape[0]
    k = x.shape[1]
    e, n, _ = weight.shape
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    cfg = _matmul_config(x.dtype, k, n) if config is None else config
    row_tiles = grouped_row_tiles(t, e, cfg.block_m)
    col_tiles = triton.cdiv(n, cfg.block_n)
    grid = (col_tiles, row_tiles) if cols_fastest else (row_tiles, col_tiles)
    _bi_grouped_kernel[grid](
        x, rows if rows is not None else offs, weight, bias if bias is not None else out, offs,
        out, t, n, k, e,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, GATHER=rows is not None, IEEE=x.dtype == torch.float32,
        UPCAST=_interpreting(), COLS_FASTEST=cols_fastest,
        BLOCK_E=next_pow2(e + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------- grouped GEMM: reference


def bi_grouped_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped ``x @ weight[e].T`` over rows sorted by expert, batch-invariant.

    ``x [T, K]`` (fp16, bf16, fp32; float64 runs the reference), rows grouped by expert;
    ``weight [E, N, K]`` of ``x``'s dtype, any strides; ``offs [E]`` int32 on ``x``'s device,
    the cumulative END row of each expert (``torch._grouped_mm``'s convention: expert ``e``
    owns rows ``offs[e-1] .. offs[e]``, expert 0 from row 0). The kernel assumes ``offs`` is
    non-decreasing with ``offs[-1] <= T``; it never reads ``offs`` on the host (capturable).
    Rows at or past ``offs[-1]`` belong to no expert and are written as zeros. ``bias
    [E, N]`` (any float dtype, added in fp32 after the reduction) or ``None``. Returns ``out``
    (``[T, N]`` of ``x``'s dtype, caller-owned, contiguous rows) or a new tensor.

    A row's result depends only on the row and its expert's weight (and ``K``, ``N``): not on
    ``T``, on how many rows the other experts own, or on the row's position in its segment.
    ``bi_grouped_linear(xs, w, offs)`` replaces ``torch._grouped_mm(xs, w.transpose(-2, -1),
    offs=offs)``. With ``rows`` (``[T]`` int32/int64 on ``x``'s device, values in
    ``[0, x.shape[0])``, not checked on the device) the grouped rows are ``x[rows]``, read by
    the kernel's loads (no gathered copy): ``bi_grouped_linear(x, w, offs, rows=r) ==
    bi_grouped_linear(x[r], w, offs)``, bitwise.

    The reference: per expert, ``x @ weight[e].T`` in fp32 (float64 for float64) for all rows,
    kept on the rows the expert owns (no host reads of ``offs``; ``E`` full GEMMs: meant for
    tests)."""
    if rows is not None:
        x = x[rows]
    t, k = x.shape
    num_e, n, _ = weight.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = torch.arange(t, device=x.device, dtype=offs.dtype)
    owner = torch.searchsorted(offs, rows, right=True)  # E for rows past offs[-1]
    y = torch.zeros(t, n, dtype=acc, device=x.device)
    xa = x.to(acc)
    for e in range(num_e):
        ye = xa @ weight[e].to(acc).t()
        if bias is not None:
            ye = ye + bias[e].to(acc)
        y = torch.where((owner == e)[:, None], ye, y)
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)


def _check_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> bool:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {tuple(x.shape)}")
    if weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"weight must be [E, N, K = {x.shape[1]}], got shape {tuple(weight.shape)}"
        )
    num_e, n, _ = weight.shape
    if num_e == 0:
        raise ValueError("weight must hold at least one expert")
    t = x.shape[0]
    if rows is not None:
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rows must be 1-D int32/int64, got {rows.dtype} "
                             f"{tuple(rows.shape)}")  # fmt: skip
        _check_device("rows", rows, x, "x")
        t = rows.shape[0]
    _check_float("x", x)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    _check_device("weight", weight, x, "x")
    if offs.shape != (num_e,) or offs.dtype != torch.int32:
        raise ValueError(
            f"offs must be int32 of shape ({num_e},), got {offs.dtype} {tuple(offs.shape)}"
        )
    _check_device("offs", offs, x, "x")
    if bias is not None:
        if bias.shape != (num_e, n):
            raise ValueError(f"bias must have shape ({num_e}, {n}), got {tuple(bias.shape)}")
        _check_float("bias", bias)
        _check_device("bias", bias, x, "x")
    if out is not None:
        if out.shape != (t, n) or out.dtype != x.dtype:
            raise ValueError(
                f"out must be {x.dtype} of shape ({t}, {n}), got {out.dtype} {tuple(out.shape)}"
            )
        if n and out.stride(1) != 1:
            raise ValueError("out must have contiguous rows (stride 1 along N)")
        _check_device("out", out, x, "x")
    return x.dtype != torch.float64


bi_grouped_linear = kernel_op(
    "bi_grouped_linear",
    triton=bi_grouped_linear_triton,
    reference=bi_grouped_linear_reference,
    device_of="x",
    check=_check_grouped,
)


# ------------------------------------------------------------------- row ops


def _row_block(d: int) -> int:
    """The fixed chunk over a row's ``d`` elements (a function of ``d`` only)."""
    return min(next_pow2(d), 4096)


def _row_groups(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """``x [..., R, D]`` (unit stride along ``D``, ``dim >= 3``) as ``(x3 [G, R, D] view,
    R, stride between groups, stride between rows)`` when its leading dims flatten to one
    stride, so that row ``(g, r)`` sits at ``g * s_g + r * s_r`` (a per-head view of a wider
    projection's columns: rows ``t * W + h * S``, which no single row stride describes);
    None otherwise."""
    if x.dim() < 3 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    r = x.shape[-2]
    try:
        x3 = x.view(-1, r, x.shape[-1])
    except RuntimeError:
        return None
    return x3, r, x3.stride(0), x3.stride(1)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dim")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


@triton.jit
def _bi_rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, D, R, stride_g, stride_x, stride_y, eps,
    ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # row (g, r) of x at g * stride_g + r * stride_x (R rows a group); y rows contiguous
    row = tl.program_id(0).to(tl.int64)
    g = row // R
    x_row = x_ptr + g * stride_g + (row - g * R) * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, D, BLOCK):
        m = start + cols < D
        xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        sq += xv * xv
    rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / D + eps)
    for start in range(0, D, BLOCK):
        m = start + cols < D
        xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            wv = 1.0 + wv
        tl.store(y_row + start + cols, ((xv * rstd) * wv).to(y_ptr.dtype.element_ty), mask=m)


def bi_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = False
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last dim, batch-invariant; ``w = weight``,
    or ``1 + weight`` when ``zero_centered`` (Qwen3-Next's norms).

    ``x [..., D]`` (fp16, bf16, fp32; float64 runs the reference; unit stride along ``D``).
    Read in place when its rows sit at one stride, or at two: ``x [..., R, D]`` whose
    leading dims flatten to one stride (row ``(g, r)`` at ``g * s_g + r * s_r``, e.g.
    per-head norms of a head-split column range of a stacked q/k/v projection); any other
    layout is copied first. ``weight [D]`` (any float dtype) on ``x``'s device, ``eps`` a
    float. Math in fp32 (``x`` and ``weight`` upcast, ``1 + weight`` and the weight multiply
    in fp32, then cast back), as ``unimem.models.nn_ops.rms_norm``. Returns a new tensor of
    ``x``'s shape and dtype, owned by the caller. One program per row; the sum of squares
    walks ``D`` in fixed chunks of :func:`_row_block` ``(D)`` elements.

    The reference: ``unimem.models.nn_ops.rms_norm`` (or ``qwen_common.zero_centered_rms_norm``'s
    arithmetic when ``zero_centered``)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = x.to(acc)
    y = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + weight.to(acc)) if zero_centered else weight.to(acc)
    return (y * w).to(x.dtype)


def bi_rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = False
) -> torch.Tensor:
    """The Triton kernel of :func:`bi_rms_norm` (arguments already validated)."""
    d = x.shape[-1]
    groups = _row_groups(x)
    if groups is not None:
        src, r, stride_g, stride_x = groups
    else:  # rows of one stride (a copy only when they are not)
        src = _rows(x, "x")
        r, stride_g, stride_x = 1, src.stride(0), src.stride(0)
    n = x.numel() // d if d else 0
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n and d:
        _bi_rms_norm_kernel[(n,)](
            src, weight, y, d, r, stride_g, stride_x, y.stride(0), float(eps),
            ZERO_CENTERED=bool(zero_centered), BLOCK=_row_block(d),
        )  # fmt: skip
    return y.reshape(x.shape)


def _check_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = False
) -> bool:
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    _check_float("x", x)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
    _check_float("weight", weight)
    _check_device("weight", weight, x, "x")
    return x.dtype != torch.float64


bi_rms_norm = kernel_op(
    "bi_rms_norm",
    triton=bi_rms_norm_triton,
    reference=bi_rms_norm_reference,
    device_of="x",
    check=_check_rms_norm,
)


@triton.jit(do_not_specialize=["V"])
def _bi_log_softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)
    mx = tl.full((BLOCK,), -float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        xv = tl.load(x_row + start + cols, mask=start + cols < V, other=-float("inf"))
        mx = tl.maximum(mx, xv.to(tl.float32))
    row_max = tl.max(mx, axis=0)
    # A row of -inf: keep the shift finite so the result is -inf (or nan from a nan), as torch.
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    se = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        xv = tl.load(x_row + start + cols, mask=start + cols < V, other=-float("inf"))
        se += tl.exp(xv.to(tl.float32) - shift)
    lse = shift + tl.log(tl.sum(se, axis=0))
    for start in range(0, V, BLOCK):
        m = start + cols < V
        xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, xv - lse, mask=m)


def bi_log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x, dim=-1)`` computed in fp32, batch-invariant.

    ``x [..., V]`` (fp16, bf16, fp32; float64 runs the reference). Returns a new float32
    tensor of ``x``'s shape (float64 for float64 inputs), owned by the caller: ``x - max -
    log(sum(exp(x - max)))`` per row, one program per row, the max and the sum of exponentials
    each walked over ``V`` in fixed chunks of :func:`_row_block` ``(V)`` elements."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.log_softmax(x.to(acc), dim=-1)


def bi_log_softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of :func:`bi_log_softmax` (arguments already validated)."""
    x2 = _rows(x, "x")
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    v = x2.shape[1]
    if x2.shape[0] and v:
        _bi_log_softmax_kernel[(x2.shape[0],)](
            x2, y, v, x2.stride(0), y.stride(0), BLOCK=_row_block(v)
        )
    return y.reshape(x.shape)


def _check_log_softmax(x: torch.Tensor) -> bool:
    _rows(x, "x")
    _check_float("x", x)
    return x.dtype != torch.float64


bi_log_softmax = kernel_op(
    "bi_log_softmax",
    triton=bi_log_softmax_triton,
    reference=bi_log_softmax_reference,
    device_of="x",
    check=_check_log_softmax,
)
