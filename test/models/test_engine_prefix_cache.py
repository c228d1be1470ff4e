"""``unimem.Engine`` with its prefix cache (on by default) on tiny random checkpoints of every
supported architecture: prompts sharing a prefix resume from the cache (``cached_tokens`` >
0) and give the greedy outputs of transformers and of the engine with the cache off, through
the static pools and through a unified arena tight enough that the cache is evicted; a flush
returns the pool to empty. DSPARK's adaptive verify lengths through ``unimem.Engine`` give
the greedy outputs of fixed lengths. The arguments' checks."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import tiny_tokenizer
import torch

import unimem
from unimem.engine.args import EngineArgs
from unimem.memory.spec import LayerKind

ARCHS = ["gemma3", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
PAGE = 4
PREFIX = 24  # shared by every prompt: six pages, past the SWA window of 8
TRACK = 8  # mamba_track_interval: a checkpoint every two pages (STATE models)
OUT = 8
LOGPROB_TOL = 1e-4
GREEDY = {"max_new_tokens": OUT, "ignore_eos": True}


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab, (PREFIX,), generator=g).tolist()
    out = []
    for i, n in enumerate([3, 5, 9, 2, 6]):
        tail = torch.randint(4, vocab, (n,), generator=g).tolist()
        tail[0] = 4 + i  # distinct right after the prefix
        out.append(prefix + tail)
    return out


def _hf_greedy(hf, prompts) -> list[list[int]]:
    outs = []
    for ids in prompts:
        seq = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=OUT,
            min_new_tokens=OUT,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(seq[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    builder = importlib.import_module(f"tiny_{request.param}")
    path = tmp_path_factory.mktemp(f"{request.param}_prefix")
    hf = builder.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    prompts = _prompts(hf.config.vocab_size)
    return request.param, path, prompts, _hf_greedy(hf, prompts)


def _engine(path, **kw):
    base = dict(model_path=str(path), device="cpu", dtype="float32", page_size=PAGE)
    if not kw.get("disable_radix_cache"):
        base["mamba_track_interval"] = TRACK
    return unimem.Engine(**{**base, **kw})


def _lps(out) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize(
    "memory",
    [
        dict(max_total_tokens=1024, max_running_requests=4),
        # not every request fits at once, nor with the cache: entries are evicted
        dict(enable_unified_memory=True, max_total_tokens=64, max_running_requests=3),
    ],
    ids=["static", "unified-tight"],
)
def test_shared_prefix_hits_the_cache_with_the_cache_off_outputs(checkpoint, memory):
    _, path, prompts, expected = checkpoint
    off = _engine(path, disable_radix_cache=True, **memory)
    assert off.cache is None and off.get_server_info()["prefix_cache"] is None
    ref = off.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    off.shutdown()
    assert [o["output_ids"] for o in ref] == expected  # transformers
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in ref)

    on = _engine(path, **memory)
    assert on.cache is not None
    first = on.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True)
    rest = on.generate(input_ids=prompts[1:], sampling_params=GREEDY, return_logprob=True)
    outs = [first, *rest]
    assert [o["output_ids"] for o in outs] == expected
    for i, (got, want) in enumerate(zip(outs, ref, strict=True)):
        diff = max(abs(a - b) for a, b in zip(_lps(got), _lps(want), strict=True))
        assert diff < LOGPROB_TOL, f"prompt {i}"
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 0
    if "enable_unified_memory" not in memory:  # room for everything: every later one hits
        assert cached[1:] == [PREFIX] * len(rest)
    assert sum(cached) > 0 and all(c % PAGE == 0 and c <= PREFIX for c in cached)
    stats = on.get_server_info()["prefix_cache"]
    assert stats["hit_tokens"] == sum(cached) and stats["hit_rate"] > 0
    if "enable_unified_memory" in memory:
        assert stats["evictions"] > 0
    assert stats["checkpoint_interval_pages"] == (
        TRACK // PAGE if on.pool.spec.has(LayerKind.STATE) else 1
    )
    assert on.pool.used_bytes() > 0  # the cache holds the prefix while idle
    assert on.flush_cache()
    assert on.pool.used_bytes() == 0
    assert on.get_server_info()["prefix_cache"]["cached_pages"] == 0
    on.shutdown()


def test_the_default_checkpoint_interval_and_the_reserved_state_slots(checkpoint):
    _, path, _, _ = checkpoint
    on = unimem.Engine(
        model_path=str(path), device="cpu", dtype="float32", page_size=16, max_total_tokens=256
    )
    off = unimem.Engine(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        page_size=16,
        max_total_tokens=256,
        disable_radix_cache=True,
    )
    stateful = on.pool.spec.has(LayerKind.STATE)
    assert on.cache.checkpoint_interval == (512 // 16 if stateful else 1)
    # the static split adds one state slot per running request for checkpoints
    on_bytes, off_bytes = on.pool.stats.capacity_bytes, off.pool.stats.capacity_bytes
    assert (on_bytes > off_bytes) == stateful and on_bytes >= off_bytes
    on.shutdown()
    off.shutdown()


# ---------------------------------------------------------------------- adaptive verify lengths


@pytest.mark.parametrize("budget", [None, 5])
def test_adaptive_verify_lengths_equal_fixed_through_the_engine(checkpoint, budget):
    _, path, prompts, expected = checkpoint
    spec = dict(speculative_algorithm="DSPARK", speculative_num_draft_tokens=4)
    memory = dict(max_total_tokens=1024, max_running_requests=4)
    fixed = _engine(path, **memory, **spec)
    assert not fixed.core.chain.adaptive
    want = [o["output_ids"] for o in fixed.generate(input_ids=prompts, sampling_params=GREEDY)]
    fixed.shutdown()
    adaptive = _engine(
        path,
        **memory,
        **spec,
        speculative_verify_lengths="adaptive",
        speculative_verify_budget=budget,
    )
    chain = adaptive.core.chain
    assert chain.adaptive and chain.verify_budget == budget
    got = adaptive.generate(input_ids=prompts[0], sampling_params=GREEDY)
    got = [got, *adaptive.generate(input_ids=prompts[1:], sampling_params=GREEDY)]
    assert [o["output_ids"] for o in got] == want == expected
    assert sum(o["meta_info"]["cached_tokens"] for o in got) > 0  # with the cache on
    adaptive.shutdown()


def test_adaptive_needs_a_drafter_with_a_confidence_head(checkpoint, tmp_path):
    from unimem.speculative.checkpoint import save_drafter
    from unimem.speculative.drafter import DsparkDrafter, draft_config_for

    _, path, _, _ = checkpoint
    plain = _engine(path, max_total_tokens=1024)
    model = plain.model
    config = dataclasses.replace(draft_config_for(model.config), confidence=False)
    save_drafter(
        DsparkDrafter(config, model.embed_weight, model.lm_head_weight, seed=3),
        tmp_path / "drafter",
    )
    plain.shutdown()
    spec = dict(
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=4,
        speculative_draft_model_path=str(tmp_path / "drafter"),
    )
    with pytest.raises(ValueError, match=f"confidence head; the checkpoint {tmp_path}/drafter"):
        _engine(path, max_total_tokens=1024, speculative_verify_lengths="adaptive", **spec)
    fixed = _engine(path, max_total_tokens=1024, **spec)  # fixed lengths need no head
    fixed.shutdown()


# ---------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative_verify_lengths="adaptive"), "needs speculative_algorithm DSPARK"),
        (
            dict(speculative_algorithm="DSPARK", speculative_verify_lengths="short"),
            "speculative_verify_lengths must be one of",
        ),
        (
            dict(speculative_algorithm="DSPARK", speculative_verify_budget=8),
            "speculative_verify_budget needs speculative_verify_lengths adaptive",
        ),
        (
            dict(
                speculative_algorithm="DSPARK",
                speculative_verify_lengths="adaptive",
                speculative_verify_budget=0,
            ),
            "speculative_verify_budget must be a positive int",
        ),
        (dict(mamba_track_interval=6), "mamba_track_interval must be a multiple of page_size"),
        (dict(mamba_track_interval=0), "mamba_track_interval must be a positive int"),
        (
            dict(mamba_track_interval=32, disable_radix_cache=True),
            "mamba_track_interval needs the radix cache",
        ),
        (dict(disable_radix_cache="yes"), "disable_radix_cache must be a bool"),
    ],
)
def test_cache_and_verify_length_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(model_path="/m", page_size=16, **kwargs)


def test_the_arguments_default_to_sglangs():
    args = EngineArgs.from_kwargs(model_path="/m")
    assert args.disable_radix_cache is False  # the radix cache is on, as in SGLang
    assert args.speculative_verify_lengths == "fixed"
    assert args.checkpoint_interval_pages == 512 // 16
    args = EngineArgs.from_kwargs(model_path="/m", page_size=1024, mamba_track_interval=1024)
    assert args.checkpoint_interval_pages == 1
