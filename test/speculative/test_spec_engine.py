"""DSPARK chain speculation end to end on CPU (float64 ``tiny`` preset, torch backend).

- static vs unified memory with speculation, in an arena small enough to force compaction
  and retraction: identical output ids, identical per-request verify counts and accept
  lengths; and the speculative output equals the non-speculative output for every request;
- the drafter's context, read through the draft lanes while pages move, equals a dense
  recomputation from the target's hidden states: context K/V were written for the committed
  positions and nothing else leaked in;
- the measured accept length follows the acceptance control (p = 0.8, gamma = 7: ~4.16), and
  the extremes p = 1 (every draft accepted) and p = 0 (the raw drafter) stay exact.
"""

from __future__ import annotations

import pytest
import torch

from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.forward_context import WholeSequenceContext, masked_attention
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.validate.protocol import ValidateConfig, validate

# ------------------------------------------------------------------ the validation protocol


@pytest.mark.parametrize(
    "page_size, input_len, arena_mb",
    [(16, 40, 1.3), (1, 40, 1.0), pytest.param(64, 100, 4.0, marks=pytest.mark.slow)],
)
def test_static_and_unified_match_with_dspark_under_pressure(page_size, input_len, arena_mb):
    cfg = ValidateConfig(
        requests=6,
        input_len=input_len,
        output_len=24,
        page_size=page_size,
        arena_mb=arena_mb,
        max_running=4,
        chunk_size=32,
        spec="dspark",
        gamma=7,
        accept_rate=0.8,
    )
    report = validate(cfg)
    n = report["requests"]
    assert report["exact_match"] == n == 6, report["mismatches"]
    assert report["verify_counts_match"] == n
    assert report["accept_lengths_match"] == n
    s, u = report["static"], report["unified"]
    assert s["verify_steps"] == u["verify_steps"] > 0
    assert s["accept_length"] == u["accept_length"] > 1.5
    assert s["output_tokens"] == u["output_tokens"] == 6 * 24
    # the speculative outputs are the non-speculative outputs
    assert report["spec_matches_reference"] == n, report["spec_mismatches"]
    # the arena was small enough that the unified run moved data and retracted
    assert u["compactions"] > 0
    assert u["retractions"] > 0


# ------------------------------------------------------------------ engine-level helpers


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = HybridModel(cfg, seed=5)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=9)
    return cfg, model, drafter


def _prompts(cfg, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _reference(model, prompts, output_len, max_running=8):
    """Non-speculative greedy outputs (static memory, no draft lanes)."""
    cfg = model.config
    spec = memory_spec(cfg, 16)
    pool = StaticMemory(spec, 256, 256, max_running, max_running, cfg.max_context)
    eng = EngineCore(model, pool, TorchReferenceBackend(), max_running, 64)
    for p in prompts:
        eng.submit(p, output_len)
    eng.run()
    return {r.rid: r.output for r in eng.scheduler.finished}


def _spec_engine(model, drafter, pool, gamma, control, max_running=8, chunk=64):
    chain = DsparkChain(drafter, gamma, control)
    return EngineCore(model, pool, TorchReferenceBackend(), max_running, chunk, chain=chain)


def _spec_pool(cfg, drafter, arena_bytes=None, max_running=8):
    spec = memory_spec(cfg, 16, draft_lanes=drafter.config.lanes())
    if arena_bytes is None:
        return StaticMemory(spec, 256, 256, max_running, max_running, cfg.max_context)
    return UnifiedMemory(spec, arena_bytes, max_running, cfg.max_context)


def _control(rate, prompts, ref, seed=0):
    return AcceptanceControl(rate, seed, {rid: prompts[rid] + ref[rid] for rid in ref})


# ------------------------------------------------------------------ drafter context


class _CaptureContext(WholeSequenceContext):
    def __init__(self, config, length):
        super().__init__(config, length)
        self.hidden = {}

    def capture_hidden(self, layer_idx, hidden):
        self.hidden[layer_idx] = hidden


def _dense_block_logits(model, drafter, tokens, n, gamma):
    """The drafter's base logits for the block anchored at position ``n`` of ``tokens``,
    computed densely: context K/V from the target's hidden states over ``tokens[:n]``
    (whole-sequence oracle), block attention as one masked softmax per layer."""
    dc = drafter.config
    ctx = _CaptureContext(model.config, n)
    model.forward(torch.tensor(tokens[:n]), ctx)
    kvs = drafter.context_kv([ctx.hidden[i] for i in dc.target_layers], torch.arange(n))
    positions = torch.arange(n, n + gamma)

    def attend(j, q, k, v):
        keys = torch.cat([kvs[j][0], k])
        values = torch.cat([kvs[j][1], v])
        k_pos = torch.arange(n + gamma)
        scale = q.shape[-1] ** -0.5
        return masked_attention(q, keys, values, positions, k_pos, dc.layer_window(j), scale)

    anchor = torch.tensor([tokens[n]])
    return drafter.block_logits(anchor, positions, attend)[0]


def test_draft_context_through_lanes_equals_dense_recomputation(tiny):
    """Every draft forward of a unified run with compaction and retraction, recomputed
    densely from the final token sequence: the draft lanes held exactly the context K/V of
    the committed positions (prefill and committed verify rows), at the right physical slots
    after every move, and the block K/V of the step."""
    cfg, model, drafter = tiny
    gamma = 5
    prompts = _prompts(cfg, 4, 40, seed=1)
    ref = _reference(model, prompts, 20 + gamma)
    pool = _spec_pool(cfg, drafter, arena_bytes=int(1.3 * (1 << 20)), max_running=4)
    eng = _spec_engine(model, drafter, pool, gamma, _control(0.6, prompts, ref), max_running=4)
    for p in prompts:
        eng.submit(p, 20)

    steps = []  # (rid, committed length) of each lane of each verify step
    logits = []  # block_logits of each verify step, [bs, gamma, vocab]
    block_forward = drafter.block_forward

    def recording_block_forward(anchors, positions, attend):
        out = block_forward(anchors, positions, attend)
        # the eager runner's lanes are the batch (no padding); lengths are the block starts
        rids = eng.runner.lanes.rids(anchors.shape[0]).tolist()
        steps.append(list(zip(rids, positions[::gamma].tolist(), strict=True)))
        logits.append(out[0].clone())
        return out

    drafter.block_forward = recording_block_forward
    try:
        eng.run()
    finally:
        del drafter.block_forward
    assert pool.stats.compactions > 0 and eng.scheduler.retractions > 0
    outputs = {r.rid: r.output for r in eng.scheduler.finished}
    assert outputs == {rid: out[:20] for rid, out in ref.items()}
    assert len(steps) == len(logits) > 0
    checked = 0
    for batch, got in zip(steps, logits, strict=True):
        for b, (rid, n) in enumerate(batch):
            if b % 2 and checked > 8:  # a sample keeps the test fast
                continue
            tokens = prompts[rid] + outputs[rid]
            if n >= len(tokens):
                continue  # a step past the end, launched before the host read the finish
            want = _dense_block_logits(model, drafter, tokens, n, gamma)
            torch.testing.assert_close(got[b], want, rtol=0, atol=1e-9)
            checked += 1
    assert checked > 10


# ------------------------------------------------------------------ acceptance control


def test_accept_length_follows_the_acceptance_control(tiny):
    """p = 0.8, gamma = 7: a drafter that never agrees by itself commits on average
    1 + sum_{k=1..7} 0.8^k = 4.16 tokens per step; chance agreement can only add a little."""
    cfg, model, drafter = tiny
    gamma, rate, output_len = 7, 0.8, 160
    prompts = _prompts(cfg, 8, 8, seed=2)
    ref = _reference(model, prompts, output_len + gamma)
    control = _control(rate, prompts, ref)
    eng = _spec_engine(model, drafter, _spec_pool(cfg, drafter), gamma, control)
    for p in prompts:
        eng.submit(p, output_len)
    done = eng.run()
    assert {r.rid: r.output for r in done} == {rid: out[:output_len] for rid, out in ref.items()}
    steps = sum(r.verify_steps for r in done)
    accept = sum(r.verified_tokens for r in done) / steps
    expected = 1 + sum(rate**k for k in range(1, gamma + 1))
    assert steps >= 250
    assert abs(accept - expected) < 0.35, (accept, expected, steps)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_extreme_accept_rates_stay_exact(tiny, rate):
    """p = 1: every step accepts all gamma drafts (the state committed is the last verify
    row's). p = 0: the raw seeded drafter, which rarely agrees (mostly the bonus token alone).
    Both give the non-speculative output."""
    cfg, model, drafter = tiny
    gamma, output_len = 4, 21
    prompts = _prompts(cfg, 3, 24, seed=3)
    ref = _reference(model, prompts, output_len + gamma)
    control = _control(rate, prompts, ref)
    eng = _spec_engine(model, drafter, _spec_pool(cfg, drafter), gamma, control)
    for p in prompts:
        eng.submit(p, output_len)
    done = eng.run()
    assert {r.rid: r.output for r in done} == {rid: out[:output_len] for rid, out in ref.items()}
    for r in done:
        if rate == 1.0:
            # the prefill gives the first token; then gamma + 1 per step
            assert r.verify_steps == -(-(output_len - 1) // (gamma + 1))
            assert r.verified_tokens == r.verify_steps * (gamma + 1)
        else:
            assert r.verify_steps >= (output_len - 1) // 2
