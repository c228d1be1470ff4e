"""The pieces of sharding that need no second process: which slice a rank takes (from a full
tensor, or straight from a safetensors file), rank configs, vocabulary padding, and the
Qwen3-Next per-key-head layout (a rank's rows re-laid out equal the full re-layout's rows of
its heads)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from unimem.models.presets import preset
from unimem.models.qwen3_next import qkvz_rows_to_contiguous
from unimem.models.tensor_parallel import (
    Shard,
    TensorParallel,
    full_config,
    heads,
    local_config,
    shard,
    vocab_shard,
)


class _NoComm:
    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return [x]


def _tp(rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, _NoComm())


def test_take_and_read_give_the_same_slice(tmp_path):
    full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    rules = [
        shard(0, (1, 3), (5, 7)),
        shard(1, (0, 2), (3, 5)),
        vocab_shard(_tp(1, 2), 7),  # rows 4..6 plus one zero row
    ]
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for rule in rules:
            assert torch.equal(rule.read(f.get_slice("w")), rule.take(full))
    last = vocab_shard(_tp(1, 2), 7).take(full)
    assert last.shape == (4, 5) and torch.equal(last[:3], full[4:]) and not last[3].any()


def test_vocabulary_parts_cover_the_vocabulary_once():
    parts = [_tp(r, 3).vocab_part(10) for r in range(3)]
    assert parts == [(0, 4, 4), (4, 8, 4), (8, 10, 4)]


def test_rank_config_divides_heads_and_width():
    c = preset("tiny")
    local = local_config(c, _tp(1, 2))
    assert (local.n_q_heads, local.n_kv_heads, local.gdn_heads, local.gdn_key_heads) == (
        2,
        1,
        2,
        2,
    )
    assert local.ffn_dim == c.ffn_dim // 2 and local.vocab_size == c.vocab_size
    assert full_config(local, _tp(1, 2)).n_kv_heads == c.n_kv_heads
    with pytest.raises(ValueError, match=r"HybridConfig.n_kv_heads \(2\) must be divisible"):
        local_config(c, _tp(0, 4))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        heads(_tp(0, 4), 2, 8, "num_key_value_heads")


def test_qwen3_next_key_head_groups_are_contiguous_per_rank():
    hk, h, dk, dv, d = 4, 8, 3, 2, 5
    r = h // hk
    group = 2 * dk + 2 * r * dv
    w = torch.randn(hk * group, d, dtype=torch.float64)
    whole = qkvz_rows_to_contiguous(w, hk, h, dk, dv)
    for rank in range(2):
        tp = _tp(rank, 2)
        a, b = tp.part(hk, "linear_num_key_heads")
        mine = qkvz_rows_to_contiguous(Shard(0, ((a * group, b * group),)).take(w), 2, 4, dk, dv)
        q, k = heads(tp, hk, dk, "k"), heads(tp, hk, dk, "k", hk * dk)
        v, z = heads(tp, h, dv, "v", 2 * hk * dk), heads(tp, h, dv, "v", 2 * hk * dk + h * dv)
        assert torch.equal(mine, shard(0, q, k, v, z).take(whole))
