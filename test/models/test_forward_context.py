"""``ForwardContext.logits_rows``: the rows that need logits, gathered only where a gather
is needed (extend: each request's last row); decode and verify hand back ``x`` itself."""

from __future__ import annotations

import torch

from unimem.models.forward_context import DenseCache, DenseContext, ForwardMode
from unimem.models.presets import preset


def test_logits_rows_gathers_only_in_extend():
    cache = DenseCache(preset("tiny"), max_requests=3)
    x = torch.randn(7, 5)
    extend = DenseContext(cache, [0, 2], [3, 4], ForwardMode.EXTEND)
    assert torch.equal(extend.logits_rows(x), x[[2, 6]])
    for mode, slots, counts in (
        (ForwardMode.DECODE, [0, 1, 2], [1, 1, 1]),
        (ForwardMode.VERIFY, [0, 1], [2, 2]),
    ):
        ctx = DenseContext(cache, slots, counts, mode)
        z = torch.randn(sum(counts), 5)
        assert ctx.logits_rows(z) is z  # every row, in order: no copy
        assert torch.equal(ctx.logits_rows(z), z[ctx.logits_indices])
