"""Named synthetic configurations of the seeded hybrid model (:mod:`unimem.models.synthetic`):
``tiny`` for CPU tests in float64, ``small`` for one GPU in bf16, ``gpu_test`` for the GPU
tests (bf16, small and quick to build)."""

from __future__ import annotations

import torch

from unimem.models.config import HybridConfig

# ---------------------------------------------------------------------- presets


def _tiny() -> HybridConfig:
    # Every kind twice, asymmetric K/V head dims, GQA, float64 so that no reduction order can
    # ever flip a greedy token. Small window so that short test sequences exercise it.
    return HybridConfig(
        vocab_size=512,
        d_model=256,
        n_q_heads=4,
        n_kv_heads=2,
        head_dim_k=64,
        head_dim_v=32,
        ffn_dim=512,
        layer_pattern=("full", "gdn", "swa", "gdn", "swa", "full"),
        window=16,
        gdn_heads=4,
        gdn_head_dim_k=32,
        gdn_head_dim_v=48,
        conv_kernel=4,
        rope_theta=10000.0,
        rms_eps=1e-6,
        dtype=torch.float64,
        max_context=2048,
    )


def _small() -> HybridConfig:
    # One GPU: ~0.9 B parameters in bf16. Symmetric head dims of 128, the best-supported
    # shape of GPU attention kernels; GQA 4:1; 8 GDN, 4 SWA, 4 FULL layers.
    return HybridConfig(
        vocab_size=32000,
        d_model=2048,
        n_q_heads=16,
        n_kv_heads=4,
        head_dim_k=128,
        head_dim_v=128,
        ffn_dim=5632,
        layer_pattern=("gdn", "swa", "gdn", "full") * 4,
        window=512,
        gdn_heads=16,
        gdn_head_dim_k=128,
        gdn_head_dim_v=128,
        conv_kernel=4,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        dtype=torch.bfloat16,
        max_context=32768,
    )


def _gpu_test() -> HybridConfig:
    # The GPU tests' model: bf16, every layer kind, head dims FA4 pages well (128), small
    # enough to build and capture quickly.
    return HybridConfig(
        vocab_size=4096,
        d_model=512,
        n_q_heads=4,
        n_kv_heads=2,
        head_dim_k=128,
        head_dim_v=128,
        ffn_dim=1024,
        layer_pattern=("gdn", "swa", "gdn", "full"),
        window=64,
        gdn_heads=4,
        gdn_head_dim_k=64,
        gdn_head_dim_v=64,
        conv_kernel=4,
        dtype=torch.bfloat16,
        max_context=4096,
    )


_PRESETS = {"tiny": _tiny, "small": _small, "gpu_test": _gpu_test}


def preset_names() -> tuple[str, ...]:
    """Names accepted by :func:`preset`."""
    return tuple(_PRESETS)


def preset(name: str) -> HybridConfig:
    """The named configuration: ``tiny`` (CPU, float64, 6 layers), ``gpu_test`` (bf16, 4 layers:
    the GPU tests) or ``small`` (one GPU, bf16, 16 layers). Raises ``ValueError`` listing the
    valid names for an unknown one."""
    try:
        return _PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(_PRESETS)}") from None
