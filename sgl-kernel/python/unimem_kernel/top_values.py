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

Five torch launches (the maxima — :mod:`.chunk_maxima`'s reference, or its kernel on
request —, a top-``w`` of them, the gather, the final top-``w``, and a copy for a tail), fixed
shapes, no host reads: capturable in CUDA graphs. The cost is one read of the row plus two
selections over ``V / chunk`` and ``w * chunk`` values; the default chunk
(:func:`default_chunk`) is the one measured fastest. Rows too short for ``w`` chunks go to
``torch.topk`` whole.
"""

from __future__ import annotations

import math

import torch

from unimem_kernel.chunk_maxima import chunk_maxima, chunk_maxima_reference

__all__ = ["CHUNKED_MIN_RATIO", "MAX_CHUNK", "default_chunk", "top_values"]

CHUNKED_MIN_RATIO = 64
"""A row is selected by chunk maxima only when ``V >= CHUNKED_MIN_RATIO * w`` (the default
chunk is then at least 8 values); shorter rows are one ``torch.topk``, which the extra
launches would not beat."""

MAX_CHUNK = 128
"""The largest default chunk: the largest one measured (``bench_top_values.py``)."""


def default_chunk(vocab: int, w: int) -> int:
    """The chunk :func:`top_values` uses for rows of ``vocab`` values and ``w`` of them kept:
    the largest power of two that leaves at least ``8 * w`` chunks, at most
    :data:`MAX_CHUNK` — 128 for 262 144 values and ``w = 256`` (2 048 maxima, 32 768
    candidates), 64 for 151 936. Measured on an H200 (``docs/results/top_values_h200.json``,
    float32, chunks 8 to 128 against ``torch.topk``): at 384 rows of 262 144 values 128 takes
    574 us, 64 628 us and 32 (the chunk that makes both selections 8 192 wide) 951 us,
    against ``torch.topk``'s 1 198 — the maxima's reduction over few contiguous values is
    what a small chunk makes slow, not the selections; at 48 rows 141 / 166 / 225 against
    250 us; at one row 128 ties ``torch.topk`` (80 us) where 32 loses (97). ``1`` (no chunks:
    ``torch.topk`` over the whole row) when ``vocab < CHUNKED_MIN_RATIO * w``."""
    if w < 1 or vocab < CHUNKED_MIN_RATIO * w:
        return 1
    return min(MAX_CHUNK, 1 << int(math.log2(vocab // (8 * w))))


def top_values(
    x: torch.Tensor, w: int, chunk: int | None = None, maxima: str = "torch"
) -> torch.Tensor:
    """Each row's ``w`` largest values in descending order (module docstring). ``x [N, V]``
    with unit stride along ``V`` (a slice of rows is fine); ``chunk`` overrides
    :func:`default_chunk` (benchmarks sweep it; ``1`` is ``torch.topk`` whole); ``maxima``:
    how the chunk maxima are taken — ``"torch"`` (``amax``), or ``"kernel"``
    (:func:`unimem_kernel.chunk_maxima.chunk_maxima`'s Triton kernel on CUDA; not yet timed
    on a GPU, hence not the default). Either way the same values."""
    if x.dim() != 2:
        raise ValueError(f"top_values takes [N, V] rows, got shape {tuple(x.shape)}")
    n, vocab = x.shape
    if not 1 <= w <= vocab:
        raise ValueError(f"top_values needs 1 <= w <= V, got w = {w} for V = {vocab}")
    if chunk is None:
        chunk = default_chunk(vocab, w)
    if chunk < 1:
        raise ValueError(f"top_values: chunk must be >= 1, got {chunk}")
    if maxima not in ("torch", "kernel"):
        raise ValueError(f"top_values: maxima must be 'torch' or 'kernel', got {maxima!r}")
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
