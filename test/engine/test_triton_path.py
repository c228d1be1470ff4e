"""The engine's step with every kernel forced onto its Triton implementation (the CPU
interpreter): the same tokens as the torch references — the dispatch path that runs on
GPUs, exercised in this layer's CPU tests."""

from __future__ import annotations

import dataclasses

import torch

import unimem_kernel.gdn as gdn_ops
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel


def _run(model, cfg, prompts):
    pool = UnifiedMemory(memory_spec(cfg, 16), 1 << 20, 2, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), max_running=2, chunk_size=32)
    reqs = [eng.submit(p, 4) for p in prompts]
    eng.run()
    return [r.output for r in reqs]


def test_engine_through_triton_kernels_equals_references(monkeypatch):
    # the ``tiny`` preset's layer kinds at interpreter-friendly widths
    cfg = dataclasses.replace(preset("tiny"), d_model=32, ffn_dim=64, vocab_size=64,
                              head_dim_k=16, head_dim_v=8, gdn_heads=2, gdn_head_dim_k=8,
                              gdn_head_dim_v=16)  # fmt: skip
    model = HybridModel(cfg, seed=6)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, cfg.vocab_size, (2, 20), generator=g).tolist()
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "reference")
    expected = _run(model, cfg, prompts)

    launched = []
    real = gdn_ops.gdn_forward_triton

    def spy(*args, **kwargs):
        launched.append(args[0])  # the step kind
        return real(*args, **kwargs)

    monkeypatch.setattr(gdn_ops, "gdn_forward_triton", spy)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    assert _run(model, cfg, prompts) == expected
    assert {"extend", "decode"} <= set(launched)
