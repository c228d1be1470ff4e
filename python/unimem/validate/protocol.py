"""The validation protocol: the same requests through static and unified memory.

Same weights (from the seed), same synthetic prompts, greedy decoding, the same scheduler
policy. The static run uses fixed pools sized so that every running request fits at its full
length (the oracle); the unified run uses one arena of ``arena_mb`` (default: the same bytes
as the static pools) — a small arena forces compaction and retraction. The report says how
many requests produced identical output ids, and compares throughput and memory.

With ``spec="dspark"`` both runs decode by chain speculation (a seeded DSPARK drafter, or the
drafter checkpoint of ``speculative_draft_model_path``, whose layers live in draft lanes of the
pools' pages, ``gamma`` drafts per step). A non-speculative
run on static memory goes first: its outputs (``gamma`` tokens longer than asked, so every
drafted position has a reference) drive the acceptance control (``accept_rate``) and are what
the speculative outputs must equal. With ``control_reference="speculative"`` the acceptance
control follows instead the output of a speculative run on static memory whose drafts are
never replaced (``accept_rate`` 0): on a bf16 model the non-speculative output drifts from
any speculative one at the first near-tie (decode and verify steps run different kernel
shapes), and a control following it stops accepting after that point; a reference computed
by verify steps keeps the requested acceptance over long outputs. The report adds, per mode,
verify steps and accept length (committed tokens per verify step), and across modes how many
requests had the same verify count, the same accept length, and speculative output equal to
the non-speculative output — listing any that differ with the first differing position and
the target's top-2 logit margin there (a near-tie explains a flip; anything else is a bug).

With ``prefix_cache`` both runs go through a :class:`~unimem.cache.PrefixCache` (anchors every
``checkpoint_interval`` pages; the static pools get extra state slots for its checkpoints, and
the default unified arena is as many bytes as those pools). A third run, on static memory with
the cache off, is the reference: ``cache_off_matches`` counts requests whose output equals it
in both cached runs, and each mode reports its cache statistics under ``"prefix_cache"``.
``shared_prefix_len`` gives every prompt the same first tokens (drawn from the seed).

On CUDA the runs use FA4 (``backend="auto"``, 16-bit presets) and replay decode / verify
steps as CUDA graphs (``cuda_graphs="auto"``); graphs are recorded when each run's engine is
built, and short untimed warm-up runs (both memories, per decoding mode) compile every kernel
first, so that no timed run pays for a compile. :func:`bench` is the same protocol at
serving sizes, adding the unified/static throughput ratio and the GPU's name.

Sampling. ``temperature`` > 0 (with ``top_p``) samples every request (the engine's seed per
request id, so static and unified runs draw the same tokens): static == unified still compares
outputs token for token, and with ``spec="dspark"`` verify counts and accept lengths; the
speculative-vs-non-speculative comparison is greedy-only (the report says it is not
applicable: ``spec_matches_reference`` None) — speculative sampling's exactness is a
distribution test (test/speculative/test_spec_sampling.py).

Near-ties. On a float64 model a speculative token differing from the non-speculative one is a
bug. In bf16, a verify step (``gamma + 1`` rows per request) and a decode step (one row) run
different kernel shapes, so two tokens whose logits differ by less than the rounding of the
logits may swap: a speculative mismatch whose oracle margin is below ``near_tie_margin`` of
the model's dtype is reported as explained.

Series. Every run records, per engine step, the units of each kind in use, the running
requests and the steps of its compactions and retractions, from host counters only
(:class:`SeriesRecorder`); the report carries the static and unified runs' series under
``"series"`` — what ``--plot`` draws (:mod:`unimem.validate.plot`).

The parts: :mod:`unimem.validate.config` (the run's configuration),
:mod:`unimem.validate.workload` (model and prompts), :mod:`unimem.validate.runs` (one run
through one pool), :mod:`unimem.validate.series` (what a run held, step by step) and
:mod:`unimem.validate.checks` (the comparisons). Their public names are importable from
here too.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, replace

import torch

from unimem.engine.distributed import (
    TPGroups,
    run_ranks,
    vocab_tables,
)
from unimem.memory.spec import DraftLane
from unimem.models import batch_invariant
from unimem.models.base import CausalLM
from unimem.models.tensor_parallel import full_config
from unimem.speculative.chain import DsparkChain
from unimem.speculative.checkpoint import load_drafter
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.speculative.shipped import shipped_drafter
from unimem.validate.checks import (
    add_oracle,
    compare,
    compare_outputs,
    control_draws_accept_length,
    control_expected_accept_length,
    near_tie_margin,
    spec_mismatches,
)
from unimem.validate.config import BACKENDS, SPEC_MODES, ValidateConfig, bench_config
from unimem.validate.runs import (
    RunResult,
    make_backend,
    run_one,
    run_series,
    sink_bytes,
    static_and_unified,
    static_pool,
    unified_pool,
    warm_up,
)
from unimem.validate.series import SeriesRecorder, StepSeries
from unimem.validate.workload import build_model_and_prompts, make_prompts, read_prompts_file

__all__ = [
    "BACKENDS",
    "NOT_APPLICABLE",
    "SPEC_MODES",
    "RunResult",
    "SeriesRecorder",
    "StepSeries",
    "ValidateConfig",
    "bench",
    "bench_config",
    "build_model_and_prompts",
    "compare",
    "compare_outputs",
    "control_draws_accept_length",
    "control_expected_accept_length",
    "gpu_name",
    "make_backend",
    "make_prompts",
    "near_tie_margin",
    "read_prompts_file",
    "run_one",
    "sink_bytes",
    "spec_mismatches",
    "static_pool",
    "unified_pool",
    "validate",
    "warm_up",
]


NOT_APPLICABLE = (
    "not applicable at temperature > 0: speculative sampling draws from the same "
    "distribution as non-speculative sampling, not the same tokens"
)


def validate(
    cfg: ValidateConfig,
    progress: bool = False,
    max_margins: int | None = None,
    tp: TPGroups | None = None,
) -> dict:
    """Run the protocol (module docstring) and return the report. ``max_margins``: compute
    the oracle's logit margin for at most this many speculative mismatches (the dense oracle
    is slow on long sequences; None: all). ``tp_size`` > 1: every rank (spawned here) runs
    the whole protocol on its shard of the model — the same inputs, so the same schedule —
    and rank 0's report is returned (on a node other than 0, ``nnodes`` > 1: the report of
    the node's first rank, which ran the same schedule); ``tp`` is the rank's groups when
    called on a rank."""
    if cfg.tp_size > 1 and tp is None:
        return run_ranks(
            cfg.tp_size,
            _validate_rank,
            cfg,
            progress,
            max_margins,
            device=cfg.device,
            topology=cfg.topology(),
        )
    invariant = (
        batch_invariant.use_batch_invariant() if cfg.use_deterministic else contextlib.nullcontext()
    )
    with invariant:
        report = _validate(cfg, progress, max_margins, tp)
    report["deterministic_inference"] = cfg.use_deterministic
    report["quantization"] = cfg.quantization
    return report


def _validate(
    cfg: ValidateConfig, progress: bool, max_margins: int | None, tp: TPGroups | None
) -> dict:
    device = torch.device(cfg.device) if tp is None else tp.device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda given but no CUDA device is available")
    if cfg.attention_backend == "fa4" and cfg.model_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"the fa4 backend needs a bf16/fp16 model; this one is {cfg.model_dtype}: use "
            "--backend torch, a 16-bit preset (small) or --dtype bfloat16"
        )
    model, prompts = build_model_and_prompts(cfg, device, tp)
    if cfg.prompts_file is not None:  # pools are sized for the longest prompt of the file
        cfg = replace(cfg, input_len=max(len(p) for p in prompts))
    if cfg.spec == "dspark":
        report = _validate_dspark(cfg, model, prompts, progress, max_margins)
        report["gpu"] = gpu_name(device)
        return report
    warm_up(model, cfg, prompts)
    res_s, res_u, timing = static_and_unified(model, cfg, prompts, progress)
    diffs = compare(res_s, res_u)
    report = {
        "config": asdict(cfg),
        "requests": len(prompts),
        "exact_match": len(prompts) - len(diffs),
        "mismatches": diffs,
        "static": res_s.summary(with_arena_stats=False),
        "unified": res_u.summary(with_arena_stats=True),
        "timing_runs": timing,
        "series": run_series(res_s, res_u),
        "gpu": gpu_name(device),
    }
    if cfg.prefix_cache:
        _compare_cache_off(report, cfg, model, prompts, progress, res_s, res_u)
    add_oracle(report, cfg, model, prompts, {"static": res_s.outputs, "unified": res_u.outputs})
    return report


def _validate_rank(groups: TPGroups, cfg, progress, max_margins) -> dict:
    """One rank of a tensor-parallel :func:`validate` (progress shown by rank 0 only)."""
    return validate(cfg, progress and groups.rank == 0, max_margins, tp=groups)


def bench(cfg: ValidateConfig, progress: bool = False, max_margins: int = 8) -> dict:
    """The validation protocol, throughput-focused: the report of :func:`validate` plus
    ``throughput_ratio`` (unified / static output tokens per second, from this one run)."""
    report = validate(cfg, progress, max_margins)
    s, u = report["static"]["throughput_tok_s"], report["unified"]["throughput_tok_s"]
    report["throughput_ratio"] = u / s if s else 0.0  # of the mean throughputs
    return report


def gpu_name(device: torch.device) -> str | None:
    """The CUDA device's name, None on CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _compare_cache_off(
    report: dict,
    cfg: ValidateConfig,
    model: CausalLM,
    prompts: list[list[int]],
    progress: bool,
    res_s: RunResult,
    res_u: RunResult,
    chain_for=None,
    lanes: tuple[DraftLane, ...] = (),
) -> None:
    """Run the requests on static memory with the cache off and add ``cache_off_matches``
    (requests whose output equals it in both cached runs), ``cache_off_mismatches`` and the
    run's summary (``"cache_off"``) to ``report``."""
    off_cfg = replace(cfg, prefix_cache=False)
    pool = static_pool(off_cfg, model.config, model.device, lanes)
    chain = chain_for() if chain_for is not None else None
    res_off = run_one(model, pool, off_cfg, prompts, "no cache", progress, chain)
    diffs = []
    for label, res in (("static", res_s), ("unified", res_u)):
        for d in compare_outputs(res_off.outputs, res.outputs):
            diffs.append({**d, "mode": label})
    report["cache_off_matches"] = len(prompts) - len({d["rid"] for d in diffs})
    report["cache_off_mismatches"] = diffs
    report["cache_off"] = res_off.summary(with_arena_stats=False)


def _validate_dspark(
    cfg: ValidateConfig,
    model: CausalLM,
    prompts: list[list[int]],
    progress: bool,
    max_margins: int | None,
) -> dict:
    model_cfg, device = model.config, model.device
    # 1. the non-speculative reference, gamma tokens longer so that every drafted position
    #    of the speculative runs has a reference token
    ref_cfg = replace(cfg, spec="none", output_len=cfg.output_len + cfg.gamma)
    warm_up(model, ref_cfg, prompts)
    res_ref = run_one(
        model, static_pool(ref_cfg, model_cfg, device), ref_cfg, prompts, "reference", progress
    )
    references = {rid: prompts[rid] + out for rid, out in res_ref.outputs.items()}
    shared = vocab_tables(model)  # full tables: the drafter is replicated on every rank
    draft_path = cfg.speculative_draft_model_path
    if draft_path is None and cfg.model_path is not None:
        draft_path = shipped_drafter(cfg.model_path, model)
    if draft_path is not None:
        drafter = load_drafter(draft_path, model, shared=shared)
    else:
        drafter = DsparkDrafter(
            draft_config_for(full_config(model_cfg, model.tp), num_layers=cfg.draft_layers),
            *shared,
            seed=cfg.seed + 17,
        )
    lanes = drafter.config.lanes()
    res_ctl = None
    if cfg.control_reference == "speculative":
        # 1b. the control's reference by verify steps: drafts never replaced
        ctl_cfg = replace(cfg, output_len=cfg.output_len + cfg.gamma, accept_rate=0.0)
        ctl_chain = DsparkChain(drafter, cfg.gamma, AcceptanceControl(0.0, cfg.seed, {}, device))
        warm_up(model, ctl_cfg, prompts, ctl_chain)
        pool = static_pool(ctl_cfg, model_cfg, device, lanes)
        res_ctl = run_one(model, pool, ctl_cfg, prompts, "control", progress, ctl_chain)
        del pool
        references = {rid: prompts[rid] + out for rid, out in res_ctl.outputs.items()}
    # 2. the same requests by chain speculation, through static and unified memory

    def chain_for() -> DsparkChain:
        # a fresh acceptance control per run: each run replays the same coin flips
        return DsparkChain(
            drafter,
            cfg.gamma,
            AcceptanceControl(cfg.accept_rate, cfg.seed, references, device),
            verify_lengths=cfg.verify_lengths,
            verify_budget=cfg.verify_budget,
        )

    warm_up(model, cfg, prompts, chain_for())
    res_s, res_u, timing = static_and_unified(model, cfg, prompts, progress, chain_for, lanes)
    diffs = compare(res_s, res_u)
    expected = {rid: out[: cfg.output_len] for rid, out in res_ref.outputs.items()}
    runs = {"static": res_s.outputs, "unified": res_u.outputs}
    sampled = cfg.temperature > 0  # different random streams: no token-for-token reference
    spec_diffs = [] if sampled else spec_mismatches(model, prompts, expected, runs, max_margins)
    off_ref = {d["rid"] for d in spec_diffs}
    rids = list(res_s.outputs)
    report = {
        "config": asdict(cfg),
        "requests": len(prompts),
        "exact_match": len(prompts) - len(diffs),
        "mismatches": diffs,
        "verify_lengths": "adaptive" if chain_for().adaptive else "fixed",
        "drafter": str(draft_path) if draft_path is not None else "seeded, untrained",
        "acceptance_control": {"on": cfg.accept_rate > 0, "rate": cfg.accept_rate},
        "verify_counts_match": sum(
            res_s.verify_steps[r] == res_u.verify_steps.get(r) for r in rids
        ),
        "accept_lengths_match": sum(
            res_s.verified_tokens[r] == res_u.verified_tokens.get(r) for r in rids
        ),
        "spec_matches_reference": None if sampled else len(prompts) - len(off_ref),
        "spec_mismatches": spec_diffs,
        "spec_vs_reference": NOT_APPLICABLE if sampled else "compared",
        "reference": res_ref.summary(with_arena_stats=False),
        "static": res_s.summary(with_arena_stats=False),
        "unified": res_u.summary(with_arena_stats=True),
        "timing_runs": timing,
        "series": run_series(res_s, res_u),
    }
    if res_ctl is not None:
        report["control_run"] = res_ctl.summary(with_arena_stats=False)
    if cfg.accept_rate > 0 and not sampled and cfg.verify_lengths == "fixed":
        report["control_expected_accept_length"] = control_expected_accept_length(
            cfg.accept_rate, cfg.gamma
        )
        report["control_draws_accept_length"] = control_draws_accept_length(
            cfg.seed, cfg.accept_rate, cfg.gamma, references, prompts, cfg.output_len
        )
    add_oracle(report, cfg, model, prompts, {"static": res_s.outputs, "unified": res_u.outputs})
    if cfg.prefix_cache:
        _compare_cache_off(report, cfg, model, prompts, progress, res_s, res_u, chain_for, lanes)
    return report
