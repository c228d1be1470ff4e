"""top_values: each row's w largest values, descending, by chunk maxima.

The select gives ``torch.topk``'s values exactly whatever the chunk: rows of mixed signs, ties
(many equal values straddling the w-th place, or whole rows of one value), -inf, NaN, -0.0
beside 0.0, the w largest values crowded into one chunk, a tail of values left over after the
chunks, bf16 and float16 input, strided rows, no rows; the default chunk balances the two
selections; bad arguments are refused.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.top_values import (
    CHUNKED_MIN_RATIO,
    MAX_CHUNK,
    ROW_CHUNK_CAPS,
    default_chunk,
    top_values,
)


def top_values_reference(x, w):
    """The semantics: ``torch.topk``'s values."""
    return torch.topk(x, w, dim=-1, sorted=True).values


def _rows(n, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 4
    x[1 % n] = torch.randint(-3, 4, (vocab,), generator=g).float()  # ties everywhere
    x[2 % n, : vocab // 2] = -torch.inf  # half the row masked
    x[3 % n] = torch.where(torch.rand(vocab, generator=g) < 0.5, 0.0, -0.0)  # signed zeros
    top = min(100, vocab // 4)
    x[4 % n, vocab // 8 : vocab // 8 + top] = 50.0 + torch.arange(float(top))  # in few chunks
    x[5 % n] = 1.5  # one value throughout
    x[6 % n, 7 % vocab] = torch.nan
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, vocab, w, chunk, dtype",
    [(7, 4096, 16, None, torch.float32), (7, 4099, 16, 8, torch.float32),
     (7, 3000, 64, 16, torch.bfloat16), (7, 2000, 17, 32, torch.float16),
     (7, 2048, 256, 8, torch.float32), (7, 2048, 16, 128, torch.float32),
     (7, 500, 100, 4, torch.float32), (7, 5, 1, 2, torch.float32)],
)  # fmt: skip
@pytest.mark.parametrize("maxima", ["torch", "kernel"])
def test_gives_topk_values(device, n, vocab, w, chunk, dtype, maxima, monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")  # "kernel": the interpreter on CPU
    x = _rows(n, vocab, seed=vocab + w, dtype=dtype).to(device)
    want = top_values_reference(x, w)
    got = top_values(x, w, chunk, maxima=maxima)
    assert got.dtype == x.dtype and got.shape == (n, w)
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=0, equal_nan=True)


def test_every_chunk_size_agrees():
    # the kept chunks' candidates and the tail, for every chunk that leaves w chunks
    x = _rows(7, 1000, seed=11)
    want = top_values_reference(x, 20)
    for chunk in range(1, 51):
        got = top_values(x, 20, chunk)
        assert torch.allclose(got, want, rtol=0, atol=0, equal_nan=True), chunk


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_no_rows(device):
    x = _rows(7, 2500, seed=9).to(device)
    wide = torch.zeros(7, 2600, device=device)
    wide[:, :2500] = x
    view = wide[:, :2500]
    got = top_values(view, 30, 16)
    assert torch.allclose(got, top_values_reference(x, 30), rtol=0, atol=0, equal_nan=True)
    assert top_values(x[:0], 10, 16).shape == (0, 10)


def test_default_chunk_leaves_eight_chunks_a_kept_value():
    assert default_chunk(262_144, 256) == MAX_CHUNK == 128  # 2 048 maxima, 32 768 candidates
    assert default_chunk(151_936, 256) == 64  # Qwen's vocabulary: 2 374 chunks and a tail
    assert default_chunk(32_768, 256) == 16
    assert default_chunk(CHUNKED_MIN_RATIO * 256, 256) == 8  # the shortest chunked rows
    assert default_chunk(CHUNKED_MIN_RATIO * 256 - 1, 256) == 1  # short rows: torch.topk whole
    assert default_chunk(1 << 24, 256) == MAX_CHUNK  # capped at the largest measured
    for vocab, w in [(262_144, 256), (151_936, 256), (32_768, 256), (200_000, 64)]:
        chunk = default_chunk(vocab, w)
        assert vocab // chunk >= 8 * w and chunk & (chunk - 1) == 0
    x = torch.randn(3, 151_936)
    assert torch.equal(top_values(x, 256), top_values_reference(x, 256))


def test_default_chunk_is_smaller_for_many_rows_with_the_kernels_maxima():
    # the kernel reads a row at its bandwidth whatever the chunk: more rows, shorter chunks
    assert ROW_CHUNK_CAPS == ((192, 32), (64, 64))
    for rows, chunk in [(1, 128), (48, 128), (63, 128), (64, 64), (128, 64), (191, 64),
                        (192, 32), (384, 32), (4096, 32)]:  # fmt: skip
        assert default_chunk(262_144, 256, rows) == chunk, rows
    assert default_chunk(262_144, 256, 384, maxima="torch") == MAX_CHUNK  # amax: long chunks
    assert default_chunk(151_936, 256, 384) == 32
    assert default_chunk(151_936, 256, 96) == 64  # already at the cap
    assert default_chunk(32_768, 256, 384) == 16  # already below the many-rows chunk
    assert default_chunk(CHUNKED_MIN_RATIO * 256 - 1, 256, 384) == 1
    for rows in (64, 192):
        x = torch.randn(rows, 16_384)
        assert torch.equal(top_values(x, 32), top_values_reference(x, 32))


def test_bad_arguments_are_refused():
    x = torch.randn(3, 50)
    with pytest.raises(ValueError, match="1 <= w <= V"):
        top_values(x, 51)
    with pytest.raises(ValueError, match="1 <= w <= V"):
        top_values(x, 0)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        top_values(torch.randn(50), 5)
    with pytest.raises(ValueError, match="chunk"):
        top_values(x, 5, 0)
    with pytest.raises(ValueError, match="maxima must be"):
        top_values(x, 5, 2, maxima="triton")
