"""The engine reads each step's results one step late: step k's tokens and accepted lengths
are read after step k + 1 was launched, which ran from device state alone; planning in
between uses upper bounds. With a prefix cache over a model with STATE layers too: its
checkpoints are state snapshots taken right after the step that reaches the anchor."""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.cache import PrefixCache
from unimem.engine.core import EngineCore
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, HybridModel(cfg, seed=4)


def _prompts(cfg, n, length):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _record(eng: EngineCore) -> list[tuple[str, int]]:
    """Log ("launch", k) when step k's results are staged and ("read", k) when the host
    reads them."""
    log: list[tuple[str, int]] = []
    stage = eng.results.stage

    def staged(out, bs):
        result = stage(out, bs)
        k = sum(1 for e in log if e[0] == "launch")
        log.append(("launch", k))
        read = result.read

        def logged_read():
            log.append(("read", k))
            return read()

        result.read = logged_read
        return result

    eng.results.stage = staged
    return log


def _reference(model, prompts, n):
    out = {}
    for rid, p in enumerate(prompts):
        toks = list(p)
        for _ in range(n):
            toks.append(int(model.reference_forward([torch.tensor(toks)])[0][-1].argmax()))
        out[rid] = toks[len(p) :]
    return out


@pytest.mark.parametrize("speculative", [False, True])
def test_step_k_is_read_after_step_k_plus_1_is_launched(tiny, speculative):
    cfg, model = tiny
    prompts = _prompts(cfg, 3, 20)
    chain, lanes = None, ()
    if speculative:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=2)
        chain, lanes = DsparkChain(drafter, 3), drafter.config.lanes()
    pool = UnifiedMemory(memory_spec(cfg, 16, lanes), 8 << 20, 3, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), 3, 64, chain=chain)
    log = _record(eng)
    lanes_run = []
    launch = eng.runner.launch
    eng.runner.launch = lambda batch, in_flight=None: (
        lanes_run.append(len(batch.reqs)) or launch(batch, in_flight)
    )
    for p in prompts:
        eng.submit(p, 12)
    done = eng.run()
    assert {r.rid: r.output for r in done} == _reference(model, prompts, 12)
    launches = [k for kind, k in log if kind == "launch"]
    assert launches == list(range(len(launches))) and len(launches) == eng.steps
    for k in launches[:-1]:  # with memory to spare nothing forces an early read
        assert log.index(("read", k)) > log.index(("launch", k + 1))
    assert log[-1] == ("read", launches[-1])
    if speculative:
        # at most one verify step per request runs past its end (launched before its finish
        # was read); its results are dropped and it is not counted
        extends = sum(r.forward_steps - r.verify_steps for r in done)
        extra = sum(lanes_run) - extends - sum(r.verify_steps for r in done)
        assert 0 <= extra <= len(done)


@pytest.mark.parametrize("speculative", [False, True])
def test_prefix_cache_checkpoints_are_snapshots_taken_at_launch(tiny, speculative):
    """With a prefix cache over GDN layers, results are read one step late as well: the
    state checkpoint of an anchor comes from a snapshot taken right after the step that
    reached it (the slot itself has moved on by the time the step is read). Later requests
    resume from those checkpoints and their outputs equal a run without the cache; every
    snapshot not used as a checkpoint is freed."""
    cfg, model = tiny
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, cfg.vocab_size, (48,), generator=g).tolist()
    tails = torch.randint(0, cfg.vocab_size, (6, 7), generator=g).tolist()
    prompts = [shared + t for t in tails]
    chain, lanes = None, ()
    if speculative:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=2)
        chain, lanes = DsparkChain(drafter, 3), drafter.config.lanes()
    spec = memory_spec(cfg, 16, lanes)
    outputs = []
    for cached in (True, False):
        pool = UnifiedMemory(spec, 8 << 20, 2, cfg.max_context)
        cache = PrefixCache(pool, 1) if cached else None
        eng = EngineCore(model, pool, TorchReferenceBackend(), 2, 32, chain=chain, cache=cache)
        log = _record(eng)
        for p in prompts:
            eng.submit(p, 20)
        done = eng.run()
        outputs.append({r.rid: r.output for r in done})
        launches = [k for kind, k in log if kind == "launch"]
        early = [k for k in launches[:-1] if log.index(("read", k)) < log.index(("launch", k + 1))]
        # A step is read before the next launch only when nothing could be planned without
        # it: every running request finishing in it (at most once per finished request).
        assert len(early) <= len(prompts) and len(early) < len(launches) // 4
        if cached:
            assert cache.stats.checkpoints_saved > 0
            assert sum(r.cached_tokens for r in done) >= 4 * 48
            cache.check()
            cache.flush()
        assert pool.used_bytes() == 0  # no snapshot slot leaked
    assert outputs[0] == outputs[1]
