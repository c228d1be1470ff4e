"""top_values: each row's w largest values, descending, by a radix select over many programs.

The kernel (through the interpreter on CPU) gives ``torch.topk``'s values exactly: rows of
mixed signs, ties (many equal values straddling the w-th place), -inf, -0.0 beside 0.0,
rows whose values cross several chunks, w = V, bf16 and float16 input, strided rows; bad
arguments are refused.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.top_values import (
    CHUNK,
    top_values,
    top_values_reference,
    top_values_triton,
)


def _rows(n, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 4
    x[1 % n] = torch.randint(-3, 4, (vocab,), generator=g).float()  # ties everywhere
    x[2 % n, : vocab // 2] = -torch.inf  # half the row masked
    x[3 % n] = torch.where(torch.rand(vocab, generator=g) < 0.5, 0.0, -0.0)  # signed zeros
    x[4 % n] = x[4 % n].abs() + 1e-3  # all positive
    x[5 % n] = -(x[5 % n].abs() + 1e-3)  # all negative
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, vocab, w, dtype",
    [(6, 300, 256, torch.float32), (6, 3000, 256, torch.float32), (6, 700, 700, torch.float32),
     (6, 2000, 64, torch.bfloat16), (6, 1500, 17, torch.float16), (2, 9000, 256, torch.float32),
     (7, 5, 1, torch.float32)],
)  # fmt: skip
def test_kernel_gives_topk_values(device, n, vocab, w, dtype):
    x = _rows(n, vocab, seed=vocab + w, dtype=dtype).to(device)
    want = top_values_reference(x, w)
    got = top_values_triton(x, w)
    assert got.dtype == x.dtype and got.shape == (n, w)
    assert torch.equal(got, want)


def test_rows_across_chunks():
    # the w-th largest value's ties spread over two chunks, the largest values in the last
    vocab = CHUNK + 900
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    x[:, 100:400] = 2.5
    x[:, CHUNK + 10 : CHUNK + 310] = 2.5
    x[:, -5:] = 9.0
    x[1] = -x[1]
    got = top_values_triton(x, 256)
    assert torch.equal(got, top_values_reference(x, 256))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_no_rows(device):
    x = _rows(6, 2500, seed=9).to(device)
    wide = torch.zeros(6, 2600, device=device)
    wide[:, :2500] = x
    view = wide[:, :2500]
    assert torch.equal(top_values_triton(view, 100), top_values_reference(x, 100))
    assert top_values_triton(x[:0], 10).shape == (0, 10)


def test_bad_arguments_are_refused():
    x = torch.randn(3, 50)
    with pytest.raises(ValueError, match="w must be in 1 .. V"):
        top_values(x, 51)
    with pytest.raises(ValueError, match="w must be in 1 .. V"):
        top_values(x, 0)
    with pytest.raises(ValueError, match="float"):
        top_values(torch.ones(3, 50, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match="float"):
        top_values(torch.randn(50), 5)
    assert torch.equal(top_values(x.double(), 7), top_values_reference(x.double(), 7))
