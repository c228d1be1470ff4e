"""The engine with batch-invariant execution switched on, on the CPU: the overrides are
registered for the CPU key and every kernel runs through the Triton interpreter (GEMMs through
``bi_matmul``, the fused row ops, the GDN kernels with one tile configuration), so the mode's
whole path through the engine — the runner's GDN flag, ``F.linear`` / ``@`` of the model and
the drafter inside ``inference_mode`` — runs here, not only on the GPU. A request decoded alone
equals the same request decoded beside others, with DSPARK. (Whether bf16 rows on a
GPU need the mode is what ``test_deterministic_gpu.py`` shows; on the CPU in float32 this
checks the plumbing and the invariance the mode promises.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import unimem_kernel
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.unified import UnifiedMemory
from unimem.models import batch_invariant
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for


@pytest.fixture
def cpu_mode(monkeypatch):
    """The mode on the CPU key; counts the GEMMs the override sends to ``bi_matmul``."""
    calls = []
    real = unimem_kernel.bi_matmul

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(unimem_kernel, "bi_matmul", counted)
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    batch_invariant.enable(("CPU",))
    yield calls
    batch_invariant.disable()


def test_a_request_alone_equals_it_among_others(cpu_mode):
    speculative = True  # DSPARK: prefill, verify steps, drafter GEMMs, the GDN commit
    # the ``tiny`` preset's layer kinds at interpreter-friendly widths: every GEMM, row op and
    # GDN kernel runs through the Triton interpreter
    cfg = dataclasses.replace(preset("tiny"), dtype=torch.float32, d_model=32, ffn_dim=64,
                              vocab_size=64, head_dim_k=16, head_dim_v=8,
                              layer_pattern=("full", "gdn", "swa"), gdn_heads=2,
                              gdn_head_dim_k=8, gdn_head_dim_v=16)  # fmt: skip
    model = HybridModel(cfg, seed=6)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, cfg.vocab_size, (2, 8), generator=g).tolist()
    lanes, drafter = (), None
    if speculative:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
        lanes = drafter.config.lanes()

    def run(batch: list[list[int]]) -> list[list[int]]:
        chain = DsparkChain(drafter, 3) if speculative else None
        pool = UnifiedMemory(memory_spec(cfg, 16, lanes), 2 << 20, 3, cfg.max_context)
        eng = EngineCore(model, pool, TorchReferenceBackend(), 3, 32, chain=chain)
        reqs = [eng.submit(p, 4) for p in batch]
        eng.run()
        return [r.output for r in reqs]

    alone = run(prompts[1:2])[0]
    assert cpu_mode, "the GEMMs did not go through bi_matmul"
    assert run(prompts)[1] == alone
