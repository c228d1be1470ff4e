"""StableOutputs: one buffer per name, sized by its first (largest) call, reused as prefix
views; mismatches are refused with the name."""

from __future__ import annotations

import pytest
import torch

from unimem.models.stable_outputs import StableOutputs


def test_smaller_calls_share_the_first_calls_buffer():
    kept = StableOutputs()
    big = torch.randn(8, 3)
    view = kept.keep("h", big)
    assert torch.equal(view, big) and view.data_ptr() != big.data_ptr()
    small = torch.randn(5, 3)
    again = kept.keep("h", small)
    assert torch.equal(again, small)
    assert again.data_ptr() == view.data_ptr()  # the same memory, a prefix of it
    assert torch.equal(view[5:], big[5:])  # rows past the smaller call untouched
    assert kept.nbytes() == 8 * 3 * 4


def test_a_transposed_value_is_kept_contiguous():
    kept = StableOutputs()
    value = torch.randn(3, 6).T
    view = kept.keep("t", value)
    assert view.is_contiguous() and torch.equal(view, value)


@pytest.mark.parametrize(
    "second",
    [torch.randn(9, 3), torch.randn(4, 2), torch.randn(4, 3, dtype=torch.float64)],
    ids=["more rows", "row shape", "dtype"],
)
def test_mismatches_are_refused_naming_the_output(second):
    kept = StableOutputs()
    kept.keep("verify.final", torch.randn(8, 3))
    with pytest.raises(ValueError, match="'verify.final'.*record the largest width first"):
        kept.keep("verify.final", second)
