"""Per-request verify lengths (confidence head + ragged "compact" verify), on CPU.

- The length allocation maximises the expected committed tokens under the row budget (brute
  force on small cases), every lane's chosen set is a prefix, padded lanes keep one row; the
  packed layout maps rows to lanes and to the uniform ``[W, gamma + 1]`` layout.
- ``greedy_accept`` / ``chain_accept`` with a ``limit`` are the accept of the truncated chain.
- Speculative sampling stays exact with ragged lengths chosen from the past (the chi-square
  harness of ``test_spec_sampling``), and a length rule that looks at the draft it decides
  about fails the same test.
- End to end (float64 ``tiny``, torch backend): greedy outputs with adaptive lengths equal
  non-speculative outputs and fixed-gamma outputs at several budgets; static == unified with
  compaction (and retraction) forced; the device-planned step with lengths changed on the
  device every step (no host planning, fixed row count with padding rows) equals a host-planned
  eager step with exactly those rows, greedy and sampled.
- Confidence head: saved and loaded with drafter checkpoints; a checkpoint without one loads
  with it disabled and runs fixed lengths; distillation improves its held-out calibration.

The GPU half (graph replay with lengths changing every step == eager, the sync-debug loop)
is in ``test_ragged_verify_gpu.py`` (marked ``gpu``).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from test_spec_sampling import (
    ANCHOR,
    LANES,
    START,
    _chains,
    _filtered,
    _pvalues,
    _run_chains,
    _seeds,
)

from unimem.attention.metadata import MetadataBuilder
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.engine.sampling import SamplingOptions
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import HybridConfig, memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative import spec_sampling as ss
from unimem.speculative.accept import greedy_accept
from unimem.speculative.chain import DsparkChain
from unimem.speculative.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_drafter, save_drafter
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.speculative.verify_lengths import (
    allocate_lengths,
    expected_tokens,
    packed_layout,
    packed_rows,
)
from unimem.training.distill import (
    DistillConfig,
    confidence_calibration,
    copy_drafter,
    distill,
    greedy_rollouts,
    random_prompts,
)
from unimem.validate.protocol import ValidateConfig, validate

# ------------------------------------------------------------------ allocation and layout


def _brute_force_best(surv: torch.Tensor, live: list[bool], rows: int) -> float:
    w, gamma = surv.shape
    best = -1.0
    choices = [range(1, gamma + 2) if live[b] else [1] for b in range(w)]
    for lens in itertools.product(*choices):
        if sum(lens) > rows:
            continue
        val = float(expected_tokens(surv, torch.tensor(lens)).sum())
        best = max(best, val)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_maximises_expected_tokens_under_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    w, gamma = 4, 3
    surv = torch.rand(w, gamma, generator=g)
    if seed % 2:
        surv[0] = 1.0  # ties: a prefix all the same
        surv[1, 1] = 0.0
    live = [True, True, seed != 2, True]
    for rows in range(w, w * (gamma + 1) + 1):
        lens = allocate_lengths(surv, torch.tensor(live), rows)
        assert lens.dtype == torch.int32
        assert all(1 <= n <= gamma + 1 for n in lens.tolist())
        assert all(n == 1 for n, ok in zip(lens.tolist(), live, strict=True) if not ok)
        live_cap = w + gamma * sum(live)
        assert int(lens.sum()) == min(rows, live_cap)
        got = float(expected_tokens(surv, lens).sum())
        assert got == pytest.approx(_brute_force_best(surv, live, rows), abs=1e-12)


def test_allocation_chosen_sets_are_prefixes_under_ties():
    surv = torch.ones(3, 4)  # every gain equal: stable order = lane-major, depth ascending
    lens = allocate_lengths(surv, torch.tensor([True, True, True]), 3 + 6)
    assert lens.tolist() == [5, 3, 1]


def test_packed_rows_and_layout():
    assert packed_rows(4, 8, None) == 32
    assert packed_rows(4, 8, 10) == 10
    assert packed_rows(4, 8, 2) == 4  # one row per lane at least
    assert packed_rows(4, 8, 100) == 32
    with pytest.raises(ValueError, match="verify budget"):
        packed_rows(4, 8, 0)
    lens = torch.tensor([3, 1, 2], dtype=torch.int32)
    p = packed_layout(lens, 8, 4)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert p.valid.tolist() == [True] * 6 + [False] * 2
    assert p.lane[:6].tolist() == [0, 0, 0, 1, 2, 2]
    assert p.offset.tolist() == [0, 1, 2, 0, 0, 1, 0, 0]
    assert p.uniform_index.tolist() == [0, 1, 2, 4, 8, 9, 12, 12]


def test_verify_ragged_metadata_equals_extend_plus_padding_rows():
    """``MetadataBuilder.verify_ragged`` (device lengths, fixed rows) == ``extend`` (host
    planned, exact rows) on the live rows; padding rows write the sink at position 0."""
    g = torch.Generator().manual_seed(3)
    ps, rows_, ctx = 4, 6, 40
    r2t = (1 + torch.randperm(rows_ * ctx, generator=g)).reshape(rows_, ctx).to(torch.int32)
    v2p = torch.randint(-1, 500, (rows_ * ctx // ps + 2,), generator=g, dtype=torch.int32)
    swa = torch.where(torch.rand(v2p.shape, generator=g) < 0.3, -1, v2p).to(torch.int32)
    rpi = torch.tensor([2, 5, 1], dtype=torch.int32)
    seq = torch.tensor([7, 0, 20], dtype=torch.int32)
    lens = torch.tensor([3, 1, 4], dtype=torch.int32)
    kw = dict(max_bs=4, max_pages_per_req=ctx // ps, max_tokens=16, page_size=ps, swa=True)
    a = MetadataBuilder(device="cpu", **kw).verify_ragged(
        r2t, rpi, seq, lens, v2p, swa, num_tokens=12, max_seqlen_q=5
    )
    b = MetadataBuilder(device="cpu", **kw).extend(
        r2t, rpi, seq, lens, v2p, swa, num_tokens=8, max_seqlen_q=4
    )
    for name in ("cu_seqlens_q", "cache_seqlens", "cu_seqlens_k", "page_table", "swa_page_table"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("full_write_slots", "swa_write_slots", "positions"):
        got, want = getattr(a, name), getattr(b, name)
        assert torch.equal(got[:8], want), name
        assert (got[8:] == 0).all(), name


# ------------------------------------------------------------------ accept with a limit


def test_greedy_accept_with_a_limit_is_the_truncated_chain():
    g = torch.Generator().manual_seed(0)
    bs, gamma = 64, 5
    target = torch.randint(0, 3, (bs, gamma + 1), generator=g)
    draft = torch.where(
        torch.rand(bs, gamma, generator=g) < 0.8,
        target[:, :gamma],
        torch.randint(0, 3, (bs, gamma), generator=g),
    )
    limit = torch.randint(0, gamma + 1, (bs,), generator=g)
    acc, bonus = greedy_accept(draft, target, limit)
    for b in range(bs):
        k = int(limit[b])
        a1, b1 = greedy_accept(draft[b : b + 1, :k], target[b : b + 1, : k + 1])
        assert int(acc[b]) == int(a1[0]) and int(bonus[b]) == int(b1[0])
    full = greedy_accept(draft, target, torch.full((bs,), gamma))
    plain = greedy_accept(draft, target)
    assert torch.equal(full.accepted, plain.accepted) and torch.equal(full.bonus, plain.bonus)


def test_chain_accept_with_a_limit_is_the_truncated_chain():
    target, drafter = _chains()
    p_of, q_of = _filtered(target, 1.0, 1.0), _filtered(drafter, 1.0, 1.0)
    bs, gamma = 256, 4
    g = torch.Generator().manual_seed(1)
    draft = torch.randint(0, 8, (bs, gamma), generator=g)
    prev = torch.cat([torch.full((bs, 1), ANCHOR), draft], 1)
    p, q = p_of[prev], q_of[prev[:, :gamma]]
    seeds = _seeds(bs)
    pos = START + 1 + torch.arange(gamma + 1)[None, :].expand(bs, -1)
    limit = torch.randint(0, gamma + 1, (bs,), generator=g)
    got = ss.chain_accept(draft, q, p, seeds, pos, limit)
    for b in range(bs):
        k = int(limit[b])
        if k == 0:  # no draft verified: the bonus drawn from p at the first position
            keys = ss.stream_keys(seeds[b : b + 1], pos[b : b + 1, 0], ss.STREAM_RESIDUAL)
            assert int(got.accepted[b]) == 0
            assert int(got.tokens[b, 0]) == int(ss.draw(p[b : b + 1, 0], keys)[0])
            continue
        one = ss.chain_accept(
            draft[b : b + 1, :k], q[b : b + 1, :k], p[b : b + 1, : k + 1],
            seeds[b : b + 1], pos[b : b + 1, : k + 1],
        )  # fmt: skip
        a = int(one.accepted[0])
        assert int(got.accepted[b]) == a
        assert torch.equal(got.tokens[b, : a + 1], one.tokens[0, : a + 1])
    none = ss.chain_accept(draft, q, p, seeds, pos)
    full = ss.chain_accept(draft, q, p, seeds, pos, torch.full((bs,), gamma))
    assert torch.equal(none.accepted, full.accepted) and torch.equal(none.tokens, full.tokens)


# ------------------------------------------------------------------ exactness, ragged lengths


def _ragged_speculative(gamma, temperature, top_p, rule, lanes=LANES):
    """``[lanes, OUT]`` tokens by chain speculative sampling (the harness of
    ``test_spec_sampling``) where each step verifies only the drafts ``rule`` allows:
    ``rule(i, prev, tok, lane_hash)`` -> bool [lanes] whether draft ``i`` may be verified."""
    target, drafter = _chains()
    p_of = _filtered(target, temperature, top_p)
    q_of = _filtered(drafter, temperature, top_p)
    seeds = _seeds(lanes)
    cols = torch.arange(gamma + 1)

    def verify(last, n):
        prev, draft, q = last, [], []
        limit = torch.full((lanes,), gamma)
        open_ = torch.ones(lanes, dtype=torch.bool)
        for i in range(gamma):
            pos = n + i + 1
            qi = q_of[prev]
            tok = ss.draw(qi, ss.stream_keys(seeds, pos, ss.STREAM_DRAFT))
            lane_hash = (seeds * 31 + n * 7 + i) % 5
            allow = rule(i, prev, tok, lane_hash, p_of, q_of)
            limit = torch.where(open_ & ~allow, i, limit)
            open_ = open_ & allow
            draft.append(tok)
            q.append(qi)
            prev = tok
        draft_t, q_t = torch.stack(draft, 1), torch.stack(q, 1)
        p = p_of[torch.cat([last[:, None], draft_t], 1)]
        res = ss.chain_accept(draft_t, q_t, p, seeds, n[:, None] + 1 + cols, limit)
        assert bool((res.accepted.long() <= limit).all())
        return res

    return _run_chains(gamma, lanes, verify)


def _from_the_past(i, prev, tok, lane_hash, p_of, q_of):
    """Verify draft ``i`` unless the token before it (the anchor or draft ``i - 1``) or a
    per-lane/step hash says stop — what the confidence allocation depends on."""
    return (prev % 3 != 0) & (lane_hash != 0)


def _peeking(i, prev, tok, lane_hash, p_of, q_of):
    """Verify draft ``i`` only if the target likes it at least as much as the drafter did:
    a rule that looks at the draft it decides about (not exact)."""
    p = p_of[prev].gather(1, tok[:, None])[:, 0]
    q = q_of[prev].gather(1, tok[:, None])[:, 0]
    return p >= q


@pytest.mark.parametrize("gamma, temperature, top_p", [(3, 1.0, 1.0), (5, 0.8, 0.9)])
def test_speculative_sampling_stays_exact_with_ragged_lengths(gamma, temperature, top_p):
    tokens = _ragged_speculative(gamma, temperature, top_p, _from_the_past)
    pv = _pvalues(tokens, temperature, top_p)
    assert min(pv.values()) > 0.01, pv


def test_a_length_rule_that_peeks_at_its_draft_fails_the_harness():
    pv = _pvalues(_ragged_speculative(3, 1.0, 1.0, _peeking), 1.0, 1.0)
    assert min(pv.values()) < 1e-6, pv


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = HybridModel(cfg, seed=5)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=9)
    return cfg, model, drafter


def _prompts(cfg, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=g).tolist()


def _pool(cfg, drafter, arena_bytes=None, max_running=8):
    lanes = drafter.config.lanes() if drafter is not None else ()
    spec = memory_spec(cfg, 16, draft_lanes=lanes)
    if arena_bytes is None:
        return StaticMemory(spec, 256, 256, max_running, max_running, cfg.max_context)
    return UnifiedMemory(spec, arena_bytes, max_running, cfg.max_context)


def _run(model, pool, prompts, output_len, chain=None, max_running=8, sampling=None):
    eng = EngineCore(model, pool, TorchReferenceBackend(), max_running, 64, chain=chain)
    reqs = [eng.submit(p, output_len, sampling=sampling) for p in prompts]
    eng.run()
    return reqs, eng


def _stats(reqs, eng):
    steps = sum(r.verify_steps for r in reqs)
    return {
        "mean_verify_length": sum(r.verified_rows for r in reqs) / steps,
        "accept_length": sum(r.verified_tokens for r in reqs) / steps,
        "tokens_verified_per_step": eng.scheduler.verified_rows / eng.scheduler.verify_batches,
    }


def test_adaptive_greedy_equals_non_speculative_and_fixed(tiny):
    cfg, model, drafter = tiny
    gamma = 4
    prompts = _prompts(cfg, 6, 30, seed=3)
    ref, _ = _run(model, _pool(cfg, None), prompts, 24)
    want = [r.output for r in ref]
    fixed, eng_f = _run(model, _pool(cfg, drafter), prompts, 24, DsparkChain(drafter, gamma))
    assert [r.output for r in fixed] == want
    assert _stats(fixed, eng_f)["mean_verify_length"] == gamma + 1
    for budget in (None, 20, 11, 6):
        chain = DsparkChain(drafter, gamma, verify_lengths="adaptive", verify_budget=budget)
        assert chain.adaptive
        reqs, eng = _run(model, _pool(cfg, drafter), prompts, 24, chain)
        assert [r.output for r in reqs] == want, budget
        stats = _stats(reqs, eng)
        if budget is None:  # no cut: every lane verifies gamma + 1, as fixed
            assert stats["mean_verify_length"] == gamma + 1
            assert [r.verify_steps for r in reqs] == [r.verify_steps for r in fixed]
            assert [r.verified_tokens for r in reqs] == [r.verified_tokens for r in fixed]
        else:
            assert stats["tokens_verified_per_step"] <= budget
            assert 1 <= stats["mean_verify_length"] < gamma + 1
            rows = {r.verified_rows / r.verify_steps for r in reqs}
            if budget == 6:  # one row per request of the batch of 6: no drafts verified
                assert rows == {1.0} and stats["accept_length"] == 1.0
            else:
                assert len(rows) > 1  # lengths differ between requests


def test_static_equals_unified_with_compaction_forced_adaptive():
    report = validate(
        ValidateConfig(
            requests=6,
            input_len=40,
            output_len=24,
            page_size=16,
            arena_mb=1.3,
            max_running=4,
            chunk_size=32,
            spec="dspark",
            gamma=5,
            accept_rate=0.6,
            verify_lengths="adaptive",
            verify_budget=10,
        )
    )
    n = report["requests"]
    assert report["verify_lengths"] == "adaptive"
    assert report["exact_match"] == n == 6, report["mismatches"]
    assert report["spec_matches_reference"] == n, report["spec_mismatches"]
    s, u = report["static"], report["unified"]
    assert u["compactions"] > 0
    for side in (s, u):
        assert 1 <= side["mean_verify_length"] < 6
        assert side["tokens_verified_per_step"] <= 10
        assert side["accept_length"] >= 1
        assert side["ms_per_step"] == 1e3 * side["seconds"] / side["steps"]
        assert 1 <= side["lanes_per_verify_batch"] <= 4  # max_running


def _lockstep(model, cfg, drafter, prompts, gamma, output_len, sampling, seed):
    """Two engines over the same requests: A (device-planned) takes each verify step's
    lengths from a device tensor the test rewrites before every step — the host never plans
    them and the step's row count stays ``bs * (gamma + 1)`` with padding rows; B (the
    host-planned oracle) is told the same lengths as host ints and builds exact metadata."""
    chains = [DsparkChain(drafter, gamma, verify_lengths="adaptive") for _ in range(2)]
    engines = [
        EngineCore(model, _pool(cfg, drafter), TorchReferenceBackend(), 4, 64, chain=c)
        for c in chains
    ]
    reqs = [[e.submit(p, output_len, sampling=sampling) for p in prompts] for e in engines]
    a, b = engines
    override = torch.ones(4, dtype=torch.int32)
    a.runner.verify_lens_override = override
    g = torch.Generator().manual_seed(seed)
    seen = []
    while True:
        lens = torch.randint(1, gamma + 2, (4,), generator=g, dtype=torch.int32)
        override.copy_(lens)  # a device write; A's host side learns nothing
        b.runner.planned_lengths = lens.tolist()
        more = [e.step() for e in engines]
        assert more[0] == more[1]
        if not more[0]:
            break
        out_a, out_b = a.runner.out, b.runner.out
        assert torch.equal(out_a.counts, out_b.counts)
        assert torch.equal(out_a.verify_lens, out_b.verify_lens)
        for lane, count in enumerate(out_a.counts.tolist()):
            assert torch.equal(out_a.tokens[lane, :count], out_b.tokens[lane, :count])
        seen.append(tuple(out_a.verify_lens.tolist()))
    assert len(set(seen)) > 5  # the lengths really changed from step to step
    return [[r.output for r in rs] for rs in reqs], reqs


def test_device_planned_lengths_equal_host_planned_eager(tiny):
    cfg, model, drafter = tiny
    prompts = _prompts(cfg, 4, 24, seed=5)
    (out_a, out_b), reqs = _lockstep(model, cfg, drafter, prompts, 4, 20, None, 0)
    assert out_a == out_b
    ref, _ = _run(model, _pool(cfg, None), prompts, 20)
    assert out_a == [r.output for r in ref]
    assert any(r.verified_rows < 5 * r.verify_steps for r in reqs[0])


def test_device_planned_lengths_equal_host_planned_eager_sampled(tiny):
    cfg, model, drafter = tiny
    prompts = _prompts(cfg, 4, 24, seed=6)
    sampling = SamplingOptions(temperature=0.9, top_p=0.95, seed=11)
    (out_a, out_b), _ = _lockstep(model, cfg, drafter, prompts, 3, 16, sampling, 1)
    assert out_a == out_b


def test_sampled_adaptive_static_equals_unified(tiny):
    """Sampled requests with a binding budget: static == unified with compaction forced. The
    arena is 10 % above the static run's peak, so bands move but nothing is retracted or
    admitted later: the batches — and so the budget's lengths, which a sampled realisation
    depends on (its distribution does not) — are the same in both runs."""
    cfg, model, drafter = tiny
    prompts = _prompts(cfg, 8, 30, seed=7)
    sampling = SamplingOptions(temperature=1.0, top_p=0.9)

    def run(pool):
        chain = DsparkChain(drafter, 4, verify_lengths="adaptive", verify_budget=9)
        reqs, eng = _run(model, pool, prompts, 40, chain, max_running=4, sampling=sampling)
        eng.verify_steps = sum(r.verify_steps for r in reqs)
        return [r.output for r in reqs], [r.verified_rows for r in reqs], eng

    static = _pool(cfg, drafter, max_running=4)
    out_s, rows_s, eng_s = run(static)
    sinks = sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)
    unified = _pool(cfg, drafter, int(1.1 * static.stats.peak_bytes) + sinks, max_running=4)
    out_u, rows_u, eng_u = run(unified)
    assert unified.stats.compactions > 0 and eng_u.scheduler.retractions == 0
    assert eng_u.scheduler.verify_batches == eng_s.scheduler.verify_batches
    assert (out_s, rows_s) == (out_u, rows_u)
    assert sum(rows_s) < 5 * eng_s.verify_steps  # the budget cut lengths
    assert eng_s.scheduler.verified_rows <= 9 * eng_s.scheduler.verify_batches


# ------------------------------------------------------------------ checkpoints


def test_confidence_head_round_trips_and_old_checkpoints_run_fixed(tiny, tmp_path):
    cfg, model, drafter = tiny
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())
    assert config["confidence"] is True
    loaded = load_drafter(tmp_path / "d", model)
    assert loaded.config.confidence
    assert torch.equal(loaded.conf_w, drafter.conf_w) and torch.equal(loaded.conf_b, drafter.conf_b)

    # a checkpoint written before the head existed: no field, no tensors
    from safetensors.torch import load_file, save_file

    old = tmp_path / "old"
    old.mkdir()
    del config["confidence"]
    (old / CONFIG_NAME).write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "d" / WEIGHTS_NAME))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("conf_")}, str(old / WEIGHTS_NAME)
    )
    legacy = load_drafter(old, model)
    assert not legacy.config.confidence
    chain = DsparkChain(legacy, 3, verify_lengths="adaptive", verify_budget=4)
    assert not chain.adaptive  # lengths stay fixed
    prompts = _prompts(cfg, 3, 20, seed=8)
    reqs, _ = _run(model, _pool(cfg, legacy), prompts, 12, chain)
    fixed, _ = _run(model, _pool(cfg, legacy), prompts, 12, DsparkChain(legacy, 3))
    assert [r.output for r in reqs] == [r.output for r in fixed]
    assert all(r.verified_rows == 4 * r.verify_steps for r in reqs)
    with pytest.raises(ValueError, match="verify_lengths"):
        DsparkChain(legacy, 3, verify_lengths="ragged")


# ------------------------------------------------------------------ distillation


def _mini() -> HybridConfig:
    return HybridConfig(
        vocab_size=96,
        d_model=64,
        n_q_heads=2,
        n_kv_heads=1,
        head_dim_k=32,
        head_dim_v=32,
        ffn_dim=128,
        layer_pattern=("full", "gdn", "swa", "full"),
        window=16,
        gdn_heads=2,
        gdn_head_dim_k=16,
        gdn_head_dim_v=16,
        dtype=torch.float64,
        max_context=512,
    )


@pytest.mark.slow  # a training run; the head's round trip and its use stay in the fast tier
def test_distillation_improves_the_confidence_heads_calibration():
    """Held-out (prompts of another seed than the training ones), on the distilled drafter's
    own survival targets: its trained head has a lower binary cross-entropy and expected
    calibration error than the untrained head it started from (put back on the same
    drafter), and beats the best constant predictor (the base rate's entropy)."""
    cfg = _mini()
    model = HybridModel(cfg, seed=0)
    gamma = 4
    dcfg = DistillConfig(
        steps=60, prompts=24, prompt_len=16, gen_len=32, gamma=gamma, lr=1e-2, batch=4,
        seed=0, eval_prompts=0, log_every=0, head_steps=60,
    )  # fmt: skip
    start = DsparkDrafter(
        draft_config_for(cfg), model.embed_weight, model.lm_head_weight, seed=dcfg.seed + 17
    )
    result = distill(model, dcfg, drafter=start)
    assert len(result.bce_losses) == 60 + 60
    trained = result.drafter
    held = greedy_rollouts(
        model, random_prompts(8, 16, cfg.vocab_size, seed=4321), 32, start.config.target_layers
    )
    after = confidence_calibration(trained, held, gamma)
    untrained_head = copy_drafter(trained)
    untrained_head.conf_w.data.copy_(start.conf_w)
    untrained_head.conf_b.data.copy_(start.conf_b)
    before = confidence_calibration(untrained_head, held, gamma)
    assert before.base_rate == after.base_rate  # the same drafts, the same targets
    rate = after.base_rate
    assert 0.05 < rate < 0.95  # the distilled drafter is right sometimes, wrong sometimes
    r = torch.tensor(rate, dtype=torch.float64)
    constant = float(-(r * r.log() + (1 - r) * (-r).log1p()))
    assert after.bce < before.bce and after.ece < before.ece, (before, after)
    assert after.bce < constant, (after, constant)
    assert after.ece < 0.1, after


@pytest.mark.parametrize("verify_lengths", ["fixed", "adaptive"])
def test_verify_logprobs_are_the_targets_raw_logprobs(verify_lengths):
    """A DSPARK engine with log-probabilities (float32; the fixed step takes each row's
    log-sum-exp from the accept's pass over the logits, the ragged step each packed row's
    log-probability from ``greedy_logprob``; their kernels equal these references in
    ``sgl-kernel/tests``): every output token's log-probability, greedy and sampled lanes
    alike, is ``log_softmax`` of the target's own logits at that position."""
    import dataclasses

    cfg = dataclasses.replace(preset("tiny"), dtype=torch.float32)
    model = HybridModel(cfg, seed=5)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=9)
    budget = 7 if verify_lengths == "adaptive" else None
    chain = DsparkChain(drafter, 3, verify_lengths=verify_lengths, verify_budget=budget)
    assert chain.adaptive == (verify_lengths == "adaptive")
    eng = EngineCore(model, _pool(cfg, drafter, max_running=3), TorchReferenceBackend(), 3, 64,
                     chain=chain, logprobs=True)  # fmt: skip
    prompts = _prompts(cfg, 3, 12, seed=8)
    hot = SamplingOptions(temperature=0.8, seed=4)
    reqs = [eng.submit(p, 6, sampling=hot if i == 1 else None) for i, p in enumerate(prompts)]
    eng.run()
    assert sum(r.verify_steps for r in reqs) > 0
    for prompt, req in zip(prompts, reqs, strict=True):
        assert len(req.output_logprobs) == len(req.output) == 6
        toks = list(prompt)
        for tok, lp in zip(req.output, req.output_logprobs, strict=True):
            logits = model.reference_forward([torch.tensor(toks)])[0][-1]
            want = float(torch.log_softmax(logits.double(), -1)[tok])
            assert lp == pytest.approx(want, abs=1e-4)
            toks.append(tok)
