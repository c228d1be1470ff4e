"""When the FA4 backend hands a step to the split-KV kernel (pure host logic: runs on the CPU;
the kernel's numbers are tested in ``test_fa4_backend.py`` and
``sgl-kernel/tests/test_paged_attention.py``)."""

from __future__ import annotations

import torch

from unimem.attention.fa4_backend import (
    NARROW_TILE_ROWS,
    SPLIT_KV_KEYS,
    SPLIT_KV_MAX_BS,
    SPLIT_KV_MAX_Q,
    SPLIT_KV_MAX_WORK,
    narrow_query_tile,
    split_kv_keys,
    split_kv_programs,
)
from unimem.attention.fa4_backend import takes_split_kv as _takes
from unimem.attention.metadata import MetadataBuilder


def takes_split_kv(meta, max_bs, invariant=False, q_heads=16, head_dim=128):
    """The policy at the small preset's layout (16 query heads of 128)."""
    return _takes(meta, max_bs, invariant, q_heads=q_heads, head_dim=head_dim)


def _builder(max_bs: int) -> MetadataBuilder:
    return MetadataBuilder(
        max_bs=max_bs, max_pages_per_req=8, max_tokens=max_bs * 17, page_size=4, swa=False,
        device="cpu",
    )  # fmt: skip


def _tables(rows: int):
    r2t = torch.arange(rows * 32, dtype=torch.int32).reshape(rows, 32) + 4
    return r2t, torch.arange(rows * 8 + 2, dtype=torch.int32)


def test_small_uniform_steps_only():
    rows = SPLIT_KV_MAX_BS + 1
    r2t, v2p = _tables(rows)
    b = _builder(rows)

    def idx(n):
        return torch.arange(n, dtype=torch.int32), torch.full((n,), 9, dtype=torch.int32)

    for n in (1, 2, SPLIT_KV_MAX_BS):
        rpi, seq = idx(n)
        assert takes_split_kv(b.decode(r2t, rpi, seq, v2p), SPLIT_KV_MAX_BS)
        assert takes_split_kv(b.verify(r2t, rpi, seq, v2p, gamma=7), SPLIT_KV_MAX_BS)
        # batch-invariant mode: every step kind takes one kernel (FA4)
        assert not takes_split_kv(b.decode(r2t, rpi, seq, v2p), SPLIT_KV_MAX_BS, invariant=True)
        # switched off
        assert not takes_split_kv(b.decode(r2t, rpi, seq, v2p), 0)
    rpi, seq = idx(SPLIT_KV_MAX_BS + 1)
    assert not takes_split_kv(b.decode(r2t, rpi, seq, v2p), SPLIT_KV_MAX_BS)
    # wider than the kernel's query block
    rpi, seq = idx(2)
    wide = b.verify(r2t, rpi, seq, v2p, gamma=SPLIT_KV_MAX_Q)
    assert wide.max_seqlen_q == SPLIT_KV_MAX_Q + 1
    assert not takes_split_kv(wide, SPLIT_KV_MAX_BS)
    # an extend is ragged even when every chunk has the same length
    ext = b.extend(r2t, rpi, seq, torch.full((2,), 3, dtype=torch.int32), v2p, num_tokens=6,
                   max_seqlen_q=3)  # fmt: skip
    assert not takes_split_kv(ext, SPLIT_KV_MAX_BS)


def test_programs_per_kv_head():
    assert [split_kv_programs(b, 4) for b in (1, 2, 4, 8, 16, 24, 48)] == [16, 16, 16, 8, 4, 4, 4]
    # 64 / bs, at most 256 / (bs x KV heads), 4 .. 16: the best measured per layout
    assert [split_kv_programs(b, 8) for b in (1, 2, 4, 8)] == [16, 16, 8, 4]  # gpt-oss
    assert [split_kv_programs(b, 2) for b in (1, 2, 4, 8)] == [16, 16, 16, 8]  # Qwen3-Next


def test_keys_per_split_keep_two_key_blocks():
    """The kernel's key block halves above head dim 128 (64 -> 32 keys), so does the split:
    two blocks per split at every head dim (Gemma 3's and Qwen3-Next's 256 take 64 keys)."""
    assert [split_kv_keys(d) for d in (64, 128, 256)] == [SPLIT_KV_KEYS, SPLIT_KV_KEYS, 64]
    assert SPLIT_KV_KEYS == 128


def test_the_head_layout_bounds_the_batch():
    """batch x query heads x head dim <= SPLIT_KV_MAX_WORK: 16 requests at the small preset's
    16 x 128, 8 at Qwen3-Next's 16 x 256 and at gpt-oss's 64 x 64."""
    rows = SPLIT_KV_MAX_BS + 1
    r2t, v2p = _tables(rows)
    b = _builder(rows)
    assert SPLIT_KV_MAX_WORK == 16 * 16 * 128
    for heads, dim, most in ((16, 128, 16), (16, 256, 8), (64, 64, 8), (8, 64, 16)):
        for n in (most, most + 1):
            rpi = torch.arange(n, dtype=torch.int32)
            seq = torch.full((n,), 9, dtype=torch.int32)
            meta = b.verify(r2t, rpi, seq, v2p, gamma=7)
            want = n <= most and n <= SPLIT_KV_MAX_BS
            assert takes_split_kv(meta, SPLIT_KV_MAX_BS, q_heads=heads, head_dim=dim) == want


def test_narrow_query_tile_for_short_steps_of_measured_layouts():
    # packed rows = q rows x query heads per KV head; FA4's key tile for the head dim
    assert narrow_query_tile(8, 16, 4, 128, 128, local=False) == (NARROW_TILE_ROWS, 128)
    assert narrow_query_tile(16, 16, 4, 128, 128, local=True) == (64, 128)  # 64 rows
    assert narrow_query_tile(8, 16, 2, 256, 256, local=False) == (64, 80)  # Qwen3-Next
    assert narrow_query_tile(8, 16, 2, 256, 256, local=True) == (64, 64)
    assert narrow_query_tile(8, 64, 8, 64, 64, local=True) == (64, 128)  # gpt-oss
    assert narrow_query_tile(1, 16, 16, 128, 128, local=False) == (64, 128)  # MHA decode


def test_narrow_query_tile_not_for_long_steps_or_other_head_dims():
    assert narrow_query_tile(17, 16, 4, 128, 128, local=False) is None  # 68 packed rows
    assert narrow_query_tile(9, 16, 2, 256, 256, local=False) is None
    assert narrow_query_tile(512, 16, 4, 128, 128, local=False) is None  # extend
    assert narrow_query_tile(8, 8, 1, 192, 128, local=False) is None  # Dk != Dv
    assert narrow_query_tile(1, 8, 1, 96, 96, local=False) is None  # not measured
    assert narrow_query_tile(1, 6, 4, 128, 128, local=False) is None  # ragged GQA ratio
