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


@pytest.mark.parametrize(
    "length_range",
    [
        # prompts of [4, 5, 12, 20, 5] tokens: 46 in the bucket of 64; request 3 (past the
        # window of 16) alone in the bucket of 32
        pytest.param((3, 29), id="64_tokens"),
        # [16, 19, 22, 15, 11]: 83 tokens in the bucket of 128, request 3 alone in that of 16
        pytest.param((5, 30), id="128_tokens", marks=pytest.mark.slow),
    ],
)
def test_padded_extends_keep_the_invariance(cpu_mode, monkeypatch, length_range):
    """A model without recurrent state: short extends padded to a bucket
    (``UNIMEM_EXTEND_GRAPHS=on``, run eagerly here) give the ragged extends' tokens and
    log-probabilities, and a request admitted alone (its own bucket) those it gets admitted
    with four others. (FA4's side of this is ``test_deterministic_gpu.py``'s.)"""
    cfg = dataclasses.replace(preset("tiny"), dtype=torch.float32, d_model=32, ffn_dim=64,
                              vocab_size=64, head_dim_k=16, head_dim_v=16, n_q_heads=2,
                              n_kv_heads=1, layer_pattern=("swa", "full"))  # fmt: skip
    model = HybridModel(cfg, seed=11)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(*length_range, (5,), generator=g).tolist()  # 5 prompts, one bucket
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def run(mode: str, idx: list[int]) -> list[tuple[list[int], list[float]]]:
        monkeypatch.setenv("UNIMEM_EXTEND_GRAPHS", mode)
        pool = UnifiedMemory(memory_spec(cfg, 16), 2 << 20, 9, cfg.max_context)
        eng = EngineCore(model, pool, TorchReferenceBackend(), 9, 256, logprobs=True)
        assert bool(eng.runner.extend_lanes) is (mode == "on")
        reqs = [eng.submit(prompts[i], 2) for i in idx]
        eng.run()
        return [(list(r.output), list(r.output_logprobs)) for r in reqs]

    ragged = run("off", list(range(5)))
    assert run("on", list(range(5))) == ragged
    assert run("on", [3]) == [ragged[3]]
