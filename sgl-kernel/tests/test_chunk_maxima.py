"""chunk_maxima: each whole chunk's largest value, NaN where a chunk holds one.

The Triton kernel equals the reference (``torch.amax`` over the chunks) bit for bit on rows of
mixed signs, ties, ``-inf`` chunks, ``+inf``, NaN, signed zeros, a tail left unread, float32 /
bf16 / float16, every power-of-two chunk from 1 to the largest it takes, and no rows; other
chunks and strided rows go to the reference; bad arguments are refused.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel._dispatch import OPS
from unimem_kernel.chunk_maxima import (
    MAX_KERNEL_CHUNK,
    chunk_maxima,
    chunk_maxima_reference,
    chunk_maxima_triton,
)


def _rows(n, vocab, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 4
    x[1 % n] = torch.randint(-3, 4, (vocab,), generator=g).float()  # ties everywhere
    x[2 % n, : vocab // 2] = -torch.inf  # whole chunks of -inf
    x[3 % n] = torch.where(torch.rand(vocab, generator=g) < 0.5, 0.0, -0.0)  # signed zeros
    x[4 % n, 5 % vocab] = torch.inf
    x[5 % n, 3 % vocab] = torch.nan
    x[5 % n, vocab - 1] = torch.nan  # in the tail when the chunk leaves one
    return x.to(dtype)


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(want, nan=0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, vocab, chunk, dtype",
    [(6, 4096, 128, torch.float32), (6, 1000, 8, torch.float32), (6, 777, 32, torch.bfloat16),
     (6, 300, 1, torch.float16), (3, 2 * MAX_KERNEL_CHUNK + 5, MAX_KERNEL_CHUNK, torch.float32),
     (6, 64, 64, torch.float32)],
)  # fmt: skip
def test_kernel_equals_reference(device, n, vocab, chunk, dtype):
    x = _rows(n, vocab, seed=vocab + chunk, dtype=dtype).to(device)
    want = chunk_maxima_reference(x, chunk)
    got = chunk_maxima_triton(x, chunk)
    _same(got, want)
    assert torch.isnan(want[5 % n]).any()  # the NaN chunk is there (not the tail's)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_and_chunks_longer_than_the_row(device):
    x = torch.randn(0, 256, device=device)
    assert chunk_maxima_triton(x, 16).shape == (0, 16)
    y = torch.randn(3, 10, device=device)
    assert chunk_maxima_triton(y, 16).shape == (3, 0)
    _same(chunk_maxima_triton(y, 8), chunk_maxima_reference(y, 8))


def test_other_chunks_and_strided_rows_take_the_reference(monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    calls = []
    monkeypatch.setattr(
        "unimem_kernel.chunk_maxima.chunk_maxima_triton",
        lambda x, chunk: calls.append(chunk) or chunk_maxima_reference(x, chunk),
    )
    x = torch.randn(4, 600)
    for chunk in (24, 2 * MAX_KERNEL_CHUNK):
        _same(chunk_maxima(x, chunk), chunk_maxima_reference(x, chunk))
    _same(chunk_maxima(x[:, ::2], 16), chunk_maxima_reference(x[:, ::2], 16))
    _same(chunk_maxima(x.double(), 16), chunk_maxima_reference(x.double(), 16))
    assert calls == []
    chunk_maxima(x, 16)
    assert calls == [16]  # a power of two on unit-stride float32 rows: the kernel
    assert "chunk_maxima" in OPS


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunk_maxima(torch.randn(2, 8), 0)
    with pytest.raises(ValueError, match="float"):
        chunk_maxima(torch.arange(8).view(2, 4), 2)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        chunk_maxima(torch.randn(8), 2)
