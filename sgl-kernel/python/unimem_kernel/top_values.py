"""Each row's ``w`` largest values, in descending order, reading most of the row only once.

``top_values(x, w)``: ``x [N, V]`` (any float dtype, unit stride along ``V``), ``1 <= w <= V``
-> ``[N, w]`` in ``x``'s dtype, equal to ``torch.topk(x, w, dim=-1, sorted=True).values`` (the
values, not their indices: that is its reference, and the path of short rows). The sampler's
bounded cut-off (:mod:`unimem.models.sampler`) takes the 256 largest logits of every row it
samples — a sampled verify step's ``bs x (gamma + 1)`` rows of 262 144 logits — and
``torch.topk`` over such rows costs ~1.3 ms at 384 of them on an H100 for what is one pass
over 400 MB.

The select by chunk maxima: split each row into ``V // chunk`` chunks of ``chunk`` values
(the ``V % chunk`` values left over form a tail); take every chunk's maximum (one
bandwidth-bound pass over the row); keep the ``w`` chunks with the largest maxima; the
answer is the ``w`` largest values of those chunks and the tail (``w * chunk + V % chunk``
candidates instead of ``V``). Exact, ties included: a value ``y`` outside the kept chunks
and the tail is at most its own chunk's maximum, which is at most every kept chunk's
maximum — ``w`` distinct values of the candidates at least ``y`` — so for any threshold the
candidates hold as many values at or above it as the top ``w`` of the row does. NaN is the
largest value for ``amax`` and ``torch.topk`` alike, so rows holding NaN agree too.

Five torch launches (the maxima — :mod:`.chunk_maxima`'s Triton kernel on CUDA, its
reference ``amax`` elsewhere or on request —, a top-``w`` of them, the gather, the final
top-``w``, and a copy for a tail), fixed shapes, no host reads: capturable in CUDA graphs. The
cost is one read of the row plus two selections over ``V / chunk`` and ``w * chunk`` values;
the default chunk (:func:`default_chunk`) is the one measured fastest. Rows too short for
``w`` chunks go to ``torch.topk`` whole.
"""

from __future__ import annotations

import math

import torch

from unimem_kernel.chunk_maxima import chunk_maxima, chunk_maxima_reference

__all__ = [
    "CHUNKED_MIN_RATIO",
    "MAX_CHUNK",
    "ROW_CHUNK_CAPS",
    "default_chunk",
    "top_values",
]

CHUNKED_MIN_RATIO = 64
"""A row is selected by chunk maxima only when ``V >= CHUNKED_MIN_RATIO * w`` (the default
chunk is then at least 8 values); shorter rows are one ``torch.topk``, which the extra
launches would not beat."""

MAX_CHUNK = 128
"""The largest default chunk: the largest one measured (``bench_top_values.py``)."""

ROW_CHUNK_CAPS = ((192, 32), (64, 64))
"""``(rows, cap)``, most rows first: from ``rows`` rows on, the kernel's maxima take chunks of
at most ``cap`` (:func:`default_chunk`) — the fastest chunk measured at those row counts."""


def default_chunk(vocab: int, w: int, rows: int = 1, maxima: str = "kernel") -> int:
    """The chunk :func:`top_values` uses for ``rows`` rows of ``vocab`` values, ``w`` of them
    kept, the maxima taken by ``maxima``: the largest power of two that leaves at least
    ``8 * w`` chunks, at most :data:`MAX_CHUNK` — 128 for 262 144 values and ``w = 256``
    (2 048 maxima, 32 768 candidates), 64 for 151 936 — and with the kernel's maxima at most
    the cap :data:`ROW_CHUNK_CAPS` gives ``rows`` (64 from 64 rows on, 32 from 192). ``1``
    (no chunks: ``torch.topk`` over the whole row) when ``vocab < CHUNKED_MIN_RATIO * w``.

    Measured (``bench_top_values.py``, float32, ``w = 256``, 262 144 values; µs per call
    against ``torch.topk``): with ``amax`` a small chunk is slow — torch's reduction over few
    contiguous values (H200, ``docs/results/top_values_h200.json``: at 384 rows 574 us at
    chunk 128, 951 at 32, ``torch.topk`` 1 198). The kernel reads the row at its bandwidth
    whatever the chunk, so the selections decide (H100, ``top_values_h100.json`` and
    ``top_values_rows_h100.json``; chunks 32 / 64 / 128): one row 101 / - / 79; 48 rows 150 /
    133 / 134; 64 rows 160 / 148 / 151; 96 rows 182 / 164 / 174; 128 rows 205 / 184 / 209;
    192 rows 234 / 236 / 267; 256 rows 277 / 303 / 343; 384 rows 346 / 372 / 506
    (``amax`` at 128: 589; ``torch.topk`` 1 263). A verify step at gamma 7 has 8 rows a
    request: 64 rows is 8 requests, 192 is 24. At 151 936 values and 384 rows 32 takes
    287 us, 64 302."""
    if w < 1 or vocab < CHUNKED_MIN_RATIO * w:
        return 1
    chunk = min(MAX_CHUNK, 1 << int(math.log2(vocab // (8 * w))))
    if maxima == "kernel":
        for least, cap in ROW_CHUNK_CAPS:
            if rows >= least:
                return min(chunk, cap)
    return chunk


def top_values(
    x: torch.Tensor, w: int, chunk: int | None = None, maxima: str = "kernel"
) -> torch.Tensor:
    """Each row's ``w`` largest values in descending order (module docstring). ``x [N, V]``
    with unit stride along ``V`` (a slice of rows is fine); ``chunk`` overrides
    :func:`default_chunk` (benchmarks sweep it; ``1`` is ``torch.topk`` whole); ``maxima``:
    how the chunk maxima are taken — ``"kernel"``
    (:func:`unimem_kernel.chunk_maxima.chunk_maxima`: its Triton kernel on CUDA, ``amax``
    elsewhere) or ``"torch"`` (``amax`` always, to measure it). Either way the same values."""
    if x.dim() != 2:
        raise ValueError(f"top_values takes [N, V] rows, got shape {tuple(x.shape)}")
    n, vocab = x.shape
    if not 1 <= w <= vocab:
        raise ValueError(f"top_values needs 1 <= w <= V, got w = {w} for V = {vocab}")
    if maxima not in ("torch", "kernel"):
        raise ValueError(f"top_values: maxima must be 'torch' or 'kernel', got {maxima!r}")
    if chunk is None:
        chunk = default_chunk(vocab, w, n, maxima)
    if chunk < 1:
        raise ValueError(f"top_values: chunk must be >= 1, got {chunk}")
    chunks = vocab // chunk
    if chunk == 1 or chunks < w or n == 0:
        return torch.topk(x, w, dim=-1, sorted=True).values
    if x.stride(1) != 1:
        x = x.contiguous()
    body = x.narrow(1, 0, chunks * chunk).unflatten(1, (chunks, chunk))  # [N, C, chunk] view
    take = chunk_maxima if maxima == "kernel" else chunk_maxima_reference
    kept = torch.topk(take(x, chunk), w, dim=-1, sorted=False).indices  # [N, w]
    candidates = body.gather(1, kept[:, :, None].expand(n, w, chunk)).flatten(1)
    if vocab > chunks * chunk:
        candidates = torch.cat([candidates, x[:, chunks * chunk :]], dim=1)
    return torch.topk(candidates, w, dim=-1, sorted=True).values
