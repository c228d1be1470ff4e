"""``expert_linear`` (the MoE layer's grouped GEMM, kernel chosen by regime): the choice is a
function of the shapes and the ``UNIMEM_MOE_GEMM`` override; on a GPU both paths equal a
float32 per-expert product within bf16 rounding, on fresh random inputs with uneven groups
(an empty expert, one expert over the 64-row tile), at decode sizes and at prefill sizes."""

from __future__ import annotations

import pytest
import torch

from unimem_kernel import expert_gemm_config, expert_linear
from unimem_kernel.expert_gemm import _TILES


def test_choice_by_rows_per_expert(monkeypatch):
    monkeypatch.delenv("UNIMEM_MOE_GEMM", raising=False)
    small, large = _TILES[0][1], _TILES[1][1]
    assert expert_gemm_config(3072, 64, torch.bfloat16) == small  # 48 rows per expert
    assert expert_gemm_config(64 * 64, 64, torch.bfloat16) == small
    assert expert_gemm_config(64 * 65, 64, torch.bfloat16) == large
    assert expert_gemm_config(64 * 128, 64, torch.bfloat16) == large
    assert expert_gemm_config(64 * 129, 64, torch.bfloat16) is None  # prefill: CUTLASS
    assert expert_gemm_config(16, 64, torch.float32) is None  # no Triton tile for fp32 here
    monkeypatch.setenv("UNIMEM_MOE_GEMM", "vendor")
    assert expert_gemm_config(3072, 64, torch.bfloat16) is None
    monkeypatch.setenv("UNIMEM_MOE_GEMM", "triton")
    assert expert_gemm_config(10**6, 64, torch.bfloat16) == large
    monkeypatch.setenv("UNIMEM_MOE_GEMM", "fast")
    with pytest.raises(ValueError, match="UNIMEM_MOE_GEMM must be auto, triton or vendor"):
        expert_gemm_config(16, 4, torch.bfloat16)


def _case(counts: list[int], n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = torch.randn(t, k, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(len(counts), n, k, generator=g) / k**0.5).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    ref = torch.empty(t, n, device="cuda")
    lo = 0
    for e, c in enumerate(counts):
        ref[lo : lo + c] = x[lo : lo + c].float() @ w[e].float().t()
        lo += c
    return x, w, offs, ref


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "triton", "vendor"])
@pytest.mark.parametrize(
    "counts,n,k",
    [([48, 0, 130, 7, 63, 64, 1, 65], 1024, 2048), ([40] * 16, 2048, 512), ([700, 300], 256, 96)],
)
def test_gpu_equals_float32_reference(monkeypatch, path, counts, n, k):
    monkeypatch.setenv("UNIMEM_MOE_GEMM", path)
    x, w, offs, ref = _case(counts, n, k, seed=sum(counts) + n)
    y = expert_linear(x, w, offs)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert not y.isnan().any()
    rel = float((y.float() - ref).abs().max() / ref.abs().max())
    assert rel < 1e-2  # bf16 output rounding (2^-8) with float32 accumulation


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["triton", "vendor"])
def test_gpu_rows_read_in_place_equal_the_gathered_copy(monkeypatch, path):
    monkeypatch.setenv("UNIMEM_MOE_GEMM", path)
    counts, n, k = [48, 0, 130, 7, 63, 64, 1, 65], 1024, 2048
    x, w, offs, _ = _case(counts, n, k, seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = x[: sum(counts) // 4]
    rows = torch.randint(0, tokens.shape[0], (sum(counts),), generator=g).cuda()
    assert torch.equal(expert_linear(tokens, w, offs, rows), expert_linear(tokens[rows], w, offs))
