"""Each row's ``w`` largest values, in descending order, by a radix select over many programs.

``top_values(x, w)``: ``x [N, V]`` (any float dtype), ``1 <= w <= V`` -> ``[N, w]`` in
``x``'s dtype, equal to ``torch.topk(x, w, dim=-1, sorted=True).values`` (the values, not
their indices). The sampler's bounded cut-off (:mod:`unimem.models.sampler`) takes the 256
largest logits of every row it samples — a sampled verify step's ``bs x (gamma + 1)`` rows of
262 144 logits — and ``torch.topk`` selects them with one thread block a row (PyTorch spreads
a row over several blocks only when the rows are few), which at hundreds of rows costs
milliseconds for what is a few passes over the logits.

The kernel maps each float to an unsigned 32-bit key with the same order (``_order_key``:
the sign bit flipped for non-negative values, every bit for negative ones) and finds the key
of the ``w``-th largest value one 8-bit digit at a time, from the top: per digit, programs
over ``(row, chunk of CHUNK values)`` count the values whose key agrees with the digits found
so far into a 256-bin histogram per row and digit (atomic adds of the non-empty bins); from
those histograms every later program resolves the digits found so far itself (the bin the
``w``-th largest falls in, and how many of the values still needed lie in it), so no launch
sits between two passes. After four digits the threshold key ``T`` is exact and so is
``need``, the number of values equal to ``T``'s value among the ``w``. A last pass writes
every value with a key above ``T`` (``w - need`` of them) into the row's output at positions
an atomic counter hands out, the remaining ``need`` places take ``T``'s value, and a bitonic sort of
the ``[N, w]`` output puts them in order. Five reads of ``x`` and seven launches in all (a
scratch buffer zeroed, four histograms, the gather, the sort), every program busy whatever
``N`` is; no host reads, fixed shapes: capturable. Equal keys are equal values (``-0.0``
and ``0.0`` are different keys, equal values), so the result is the reference's value for
value. Rows must not hold NaN (a NaN with its sign bit set would order as the smallest
value; ``torch.topk`` takes every NaN as the largest). float64 goes to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = ["CHUNK", "top_values", "top_values_reference", "top_values_triton"]

CHUNK = 8192
"""Values of a row per program of the histogram and gather passes (32 programs a row of
262 144)."""
_BLOCK = 1024
_BINS = 256
_DIGITS = 4  # 8-bit digits of a 32-bit key


@triton.jit
def _order_key(x):
    """float32 -> uint32 with the floats' order: non-negative values get their sign bit set,
    negative ones every bit flipped."""
    u = x.to(tl.uint32, bitcast=True)
    flip = tl.where((u >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return u ^ flip


@triton.jit
def _value_of(key):
    """The inverse of :func:`_order_key`."""
    u = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key).to(tl.uint32)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _resolved(hist_ptr, row, w, DIGITS: tl.constexpr, BINS: tl.constexpr):
    """``(prefix, need)`` after the row's first ``DIGITS`` digits: per digit, from its
    histogram ``hist[digit, row]``, the bin where the count of values from the top first
    reaches ``need`` (the digit of the ``need``-th largest value still open), and ``need``
    less the values in the bins above it. ``prefix``: the digits found, in place (uint32)."""
    bins = tl.arange(0, BINS)
    prefix = tl.zeros((), tl.uint32)
    need = w
    for j in tl.static_range(DIGITS):
        h = tl.load(hist_ptr + (j * tl.num_programs(0) + row) * BINS + bins)
        above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # values in the bins above each bin
        hit = (above < need) & (above + h >= need)
        digit = tl.max(tl.where(hit, bins, -1), axis=0)
        need -= tl.sum(tl.where(bins == digit, above, 0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * j))
    return prefix, need


@triton.jit
def _digit_hist_kernel(x_ptr, stride_x, V, w, hist_ptr, DIGIT: tl.constexpr,
                       CHUNK_: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):  # fmt: skip
    """Program ``(row, chunk)``: the histogram of key digit ``DIGIT`` (8 bits, from the top)
    over the chunk's values whose key agrees with the digits resolved so far (each program
    resolves them again from the earlier histograms: no launch in between), added into
    ``hist[DIGIT, row]`` (non-empty bins only)."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * CHUNK_
    prefix, _ = _resolved(hist_ptr, row, w, DIGIT, BINS)
    shift: tl.constexpr = 24 - 8 * DIGIT
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((2 * BINS,), tl.int32)
    for off in range(0, CHUNK_, BLOCK):
        idx = start + off + cols
        inside = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=inside, other=0.0).to(tl.float32)
        key = _order_key(x)
        digit = ((key >> shift) & 0xFF).to(tl.int32)
        if DIGIT > 0:
            inside = inside & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        # values outside (past V, or off the prefix) land in the upper half, never added
        acc += tl.histogram(tl.where(inside, digit, BINS), 2 * BINS)
    bins = tl.arange(0, 2 * BINS)
    out = hist_ptr + (DIGIT * tl.num_programs(0) + row) * BINS
    tl.atomic_add(out + bins, acc, mask=(bins < BINS) & (acc > 0))


@triton.jit
def _gather_kernel(x_ptr, stride_x, V, w, hist_ptr, count_ptr, out_ptr, stride_o,
                   DIGITS: tl.constexpr, CHUNK_: tl.constexpr, BLOCK: tl.constexpr,
                   BINS: tl.constexpr, WP: tl.constexpr):  # fmt: skip
    """Program ``(row, chunk)``: the chunk's values with a key above the threshold ``T``
    (resolved from the histograms), written to ``out[row]`` at the places ``count[row]``
    hands out (``w - need`` of them over the row); chunk 0 also writes ``T``'s value into
    the row's last ``need`` places."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    threshold, need = _resolved(hist_ptr, row, w, DIGITS, BINS)
    if chunk == 0:
        place = tl.arange(0, WP)
        fill = (place >= w - need) & (place < w)
        tied = tl.zeros((WP,), tl.uint32) + threshold
        tl.store(out_ptr + row * stride_o + place, _value_of(tied), mask=fill)
    start = chunk.to(tl.int64) * CHUNK_
    cols = tl.arange(0, BLOCK)
    for off in range(0, CHUNK_, BLOCK):
        idx = start + off + cols
        inside = idx < V
        x = tl.load(x_ptr + row * stride_x + idx, mask=inside, other=0.0).to(tl.float32)
        above = inside & (_order_key(x) > threshold)
        flags = above.to(tl.int32)
        n = tl.sum(flags, axis=0)
        if n > 0:
            base = tl.atomic_add(count_ptr + row, n)
            place = base + tl.cumsum(flags, axis=0) - 1
            tl.store(out_ptr + row * stride_o + place, x, mask=above)


@triton.jit
def _sort_rows_kernel(v_ptr, stride_v, out_ptr, stride_o, w, WP: tl.constexpr):
    """Program ``row``: the row's ``w`` values in descending order (a bitonic sort of
    ``WP >= w`` places, the spare ones ``-inf``)."""
    row = tl.program_id(0).to(tl.int64)
    place = tl.arange(0, WP)
    v = tl.load(v_ptr + row * stride_v + place, mask=place < w, other=float("-inf"))
    tl.store(out_ptr + row * stride_o + place, tl.sort(v, descending=True), mask=place < w)


def top_values_reference(x: torch.Tensor, w: int) -> torch.Tensor:
    """``[N, w]``: each row's ``w`` largest values of ``x [N, V]``, descending (module
    docstring); ``1 <= w <= V``."""
    return torch.topk(x, w, dim=-1, largest=True, sorted=True).values


def top_values_triton(x: torch.Tensor, w: int) -> torch.Tensor:
    """Triton launcher of :func:`top_values` (arguments already checked): a zeroed scratch
    buffer, four histogram launches, one gather and a sort of ``[N, w]``."""
    n, vocab = x.shape
    dev = x.device
    if n == 0:
        return x.new_empty(0, w)
    xc = x if x.stride(1) == 1 else x.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    scratch = torch.zeros(_DIGITS * n * _BINS + n, dtype=torch.int32, device=dev)
    hist, count = scratch[: _DIGITS * n * _BINS], scratch[_DIGITS * n * _BINS :]
    for digit in range(_DIGITS):
        _digit_hist_kernel[(n, chunks)](
            xc, xc.stride(0), vocab, w, hist, DIGIT=digit, CHUNK_=CHUNK, BLOCK=_BLOCK,
            BINS=_BINS,
        )  # fmt: skip
    out = torch.empty(n, w, dtype=torch.float32, device=dev)
    _gather_kernel[(n, chunks)](
        xc, xc.stride(0), vocab, w, hist, count, out, out.stride(0), DIGITS=_DIGITS,
        CHUNK_=CHUNK, BLOCK=_BLOCK, BINS=_BINS, WP=next_pow2(w),
    )  # fmt: skip
    desc = torch.empty(n, w, dtype=torch.float32, device=dev)
    _sort_rows_kernel[(n,)](out, out.stride(0), desc, desc.stride(0), w, WP=next_pow2(w))
    return desc.to(x.dtype)


def _check(x: torch.Tensor, w: int) -> bool | None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a float [N, V] tensor, got {tuple(x.shape)} {x.dtype}")
    if not 1 <= w <= x.shape[1]:
        raise ValueError(f"w must be in 1 .. V ({x.shape[1]}), got {w}")
    if x.dtype == torch.float64:
        return False  # float64 keys are 64 bits: the reference
    return None


top_values = kernel_op(
    "top_values",
    triton=top_values_triton,
    reference=top_values_reference,
    device_of="x",
    check=_check,
    switch="UNIMEM_TOP_VALUES",
)
