"""What every rank of the tensor-parallel tests runs (imported by name in spawned ranks).

:func:`run_cases` runs the same requests through each case — a model (a tiny checkpoint in
float64, or the synthetic ``tiny`` preset) and a memory (static pools, or a unified arena
small enough to compact) — on this rank's shard (``groups`` None: the unsharded model, in
this process), checking after every step that the ranks' allocator states agree.
"""

from __future__ import annotations

import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.engine.distributed import TPGroups, check_agreement, vocab_tables
from unimem.engine.pools import plan_pools
from unimem.models.config import memory_spec
from unimem.models.loader import load_checkpoint
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.models.tensor_parallel import SINGLE, full_config
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for

OUT = 10
GAMMA = 3


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (9, 12, 17, 21, 26, 33)]


def build(source: str, groups: TPGroups | None):
    tp = groups.tensor_parallel() if groups is not None else SINGLE
    if source == "synthetic":
        return HybridModel(preset("tiny"), seed=0, tp=tp)
    return load_checkpoint(source, dtype="float64", tp=tp).model


def run(model, memory: str, groups: TPGroups | None, dspark: bool = False) -> dict:
    """One case: outputs, compactions and steps."""
    chain, lanes = None, ()
    if dspark:
        embed, lm_head = vocab_tables(model)
        dc = draft_config_for(full_config(model.config, model.tp))
        chain = DsparkChain(DsparkDrafter(dc, embed, lm_head, seed=17), GAMMA)
        lanes = dc.lanes()
    spec = memory_spec(model.config, 4, lanes)
    unified = memory == "unified"
    # unified: a budget that binds (not every request fits at once): the split moves
    plan = plan_pools(spec, 64 if unified else 1024, 3 if unified else 6)
    pool = plan.build(unified, model.config.max_context, "cpu")
    core = EngineCore(model, pool, TorchReferenceBackend(), plan.max_running, 64, chain=chain)
    reqs = [core.submit(p, OUT) for p in prompts(model.config.vocab_size)]
    while core.step():
        if groups is not None:
            check_agreement(core, groups)
    return {
        "outputs": [r.output for r in reqs],
        "compactions": pool.stats.compactions,
        "steps": core.steps,
    }


def run_cases(groups: TPGroups | None, cases: list[tuple[str, str, bool]]) -> dict:
    """``{(source, memory, dspark): result}`` for every case; with ``groups``, also the
    shapes of this rank's shards (``"shapes"``) and what the agreement check says when rank
    1's counters are made to differ (``"disagreement"``)."""
    out: dict = {}
    models: dict = {}
    for source, memory, dspark in cases:
        if source not in models:
            models[source] = build(source, groups)
        out[(source, memory, dspark)] = run(models[source], memory, groups, dspark)
    if groups is None:
        return out
    model = next(iter(models.values()))
    out["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out["disagreement"] = _disagreement(model, groups)
    return out


def _disagreement(model, groups: TPGroups) -> str | None:
    spec = memory_spec(model.config, 4)
    pool = plan_pools(spec, 64, 3).build(True, model.config.max_context, "cpu")
    core = EngineCore(model, pool, TorchReferenceBackend(), 3, 64)
    core.submit(prompts(model.config.vocab_size)[0], 2)
    core.step()
    if groups.rank == 1:
        pool.stats.compactions += 1  # a counter only rank 1 changed
    try:
        check_agreement(core, groups)
    except RuntimeError as e:
        return str(e)
    return None


def ranks_seen(groups: TPGroups) -> list[int]:
    """Every rank's number, gathered over the control group (a rendezvous check)."""
    return [int(b) for b in groups.all_gather_bytes(str(groups.rank).encode())]
