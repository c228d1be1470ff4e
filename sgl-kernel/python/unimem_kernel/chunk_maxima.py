"""Each row's chunk maxima: the first pass of the select by chunk maxima (:mod:`.top_values`).

``chunk_maxima(x, chunk)``: ``x [N, V]`` (any float dtype, unit stride along ``V``) ->
``[N, V // chunk]`` in ``x``'s dtype, entry ``[n, j]`` the largest of ``x[n, j * chunk :
(j + 1) * chunk]`` — NaN where the chunk holds one (as ``torch.amax`` has it; the select
needs it: NaN is the largest value to ``torch.topk``). The ``V % chunk`` values past the
last whole chunk are not read.

Why a kernel: torch's reduction over a few contiguous values per output reads the row far
below the card's bandwidth — at 32-value chunks 0.89 ms for a verify step's 384 rows of
262 144 float32 logits on an H200 (~0.45 TB/s; ``docs/results/step_real_topk64_48_chunk32_
h200.json``), where one read of those 400 MB takes ~0.1 ms. One program here reduces a tile
of ``BLOCK_C`` whole chunks with contiguous loads: never slower than ``amax`` at any chunk
on an H100, and at 384 rows it makes 32-value chunks the fastest select (349 us against 589
for ``amax`` at its best chunk; ``docs/results/top_values_h100.json``, timed by
``sgl-kernel/benchmark/bench_top_values.py --maxima torch,kernel``). The select's default.

The Triton side takes power-of-two chunks of at most :data:`MAX_KERNEL_CHUNK` values; other
chunks, strided rows and float64 go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op

__all__ = [
    "MAX_KERNEL_CHUNK",
    "chunk_maxima",
    "chunk_maxima_reference",
    "chunk_maxima_triton",
]

MAX_KERNEL_CHUNK = 1024
"""The largest chunk the kernel takes (a program's tile is ``BLOCK_C x chunk`` values)."""

_TILE = 4096
"""Values a program reduces: ``BLOCK_C = _TILE // chunk`` chunks (at least one)."""


@triton.jit
def _chunk_max_kernel(x_ptr, out_ptr, stride_x, stride_o, C, CHUNK: tl.constexpr,
                      BLOCK_C: tl.constexpr):  # fmt: skip
    """Program ``(row, block)``: the maxima of chunks ``block * BLOCK_C ..`` of ``row``."""
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ks = tl.arange(0, CHUNK)
    inside = cs < C
    offs = cs.to(tl.int64)[:, None] * CHUNK + ks[None, :]
    v = tl.load(x_ptr + row * stride_x + offs, mask=inside[:, None], other=float("-inf"))
    v = v.to(tl.float32)  # exact for every float dtype the op takes
    top = tl.max(v, axis=1)
    has_nan = tl.max((v != v).to(tl.int32), axis=1) > 0
    top = tl.where(has_nan, float("nan"), top)
    tl.store(out_ptr + row * stride_o + cs, top.to(out_ptr.dtype.element_ty), mask=inside)


def chunk_maxima_reference(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[N, V // chunk]``: the largest value of each whole chunk of ``chunk`` values of each
    row of ``x [N, V]`` (NaN where it holds one), in ``x``'s dtype (module docstring)."""
    n, vocab = x.shape
    chunks = vocab // chunk
    return x.narrow(1, 0, chunks * chunk).unflatten(1, (chunks, chunk)).amax(dim=-1)


def chunk_maxima_triton(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Triton launcher of :func:`chunk_maxima` (arguments checked: a power-of-two chunk of at
    most :data:`MAX_KERNEL_CHUNK`, unit stride along ``V``): one launch."""
    n, vocab = x.shape
    chunks = vocab // chunk
    out = torch.empty(n, chunks, dtype=x.dtype, device=x.device)
    if n == 0 or chunks == 0:
        return out
    block_c = max(1, _TILE // chunk)
    grid = (n, triton.cdiv(chunks, block_c))
    _chunk_max_kernel[grid](x, out, x.stride(0), out.stride(0), chunks, CHUNK=chunk,
                            BLOCK_C=block_c, num_warps=4)  # fmt: skip
    return out


def _check(x: torch.Tensor, chunk: int) -> bool:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"chunk_maxima takes float [N, V] rows, got {x.dtype} {tuple(x.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk_maxima: chunk must be >= 1, got {chunk}")
    return (
        chunk & (chunk - 1) == 0
        and chunk <= MAX_KERNEL_CHUNK
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (x.shape[1] < 2 or x.stride(1) == 1)
    )


chunk_maxima = kernel_op(
    "chunk_maxima",
    triton=chunk_maxima_triton,
    reference=chunk_maxima_reference,
    device_of="x",
    check=_check,
)
