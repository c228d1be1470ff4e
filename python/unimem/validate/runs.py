"""One run of the protocol's requests through one pool, and the pools it runs on.

:func:`static_pool` sizes fixed pools so that every running request fits at its full
length (the oracle); :func:`unified_pool` is one arena of ``arena_mb`` (default: the static
pools' bytes plus the arena's sinks, :func:`sink_bytes`). :func:`run_one` drives an
:class:`~unimem.engine.core.EngineCore` over a pool to the end and returns a
:class:`RunResult` (outputs, time, memory, verify counts, the step series, leaks);
:func:`static_and_unified` runs both memories ``repeats`` times in ABBA order;
:func:`warm_up` compiles every kernel on CUDA before the timed runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch

from unimem.cache import PrefixCache
from unimem.engine.core import EngineCore
from unimem.engine.distributed import state_check_for
from unimem.memory.pool import MemoryPool, pages_for
from unimem.memory.spec import DraftLane, LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.base import CausalLM
from unimem.models.config import HybridConfig, memory_spec
from unimem.speculative.chain import DsparkChain
from unimem.validate.config import MB, ValidateConfig
from unimem.validate.report import ProgressBar
from unimem.validate.series import SeriesRecorder, StepSeries


@dataclass
class RunResult:
    """One memory mode's run. ``verify_steps`` / ``verified_tokens`` (per request) are empty
    without speculation."""

    outputs: dict[int, list[int]]
    output_tokens: int
    seconds: float
    peak_bytes: int
    capacity_bytes: int
    steps: int
    compactions: int = 0
    retractions: int = 0
    forward_steps: dict[int, int] = field(default_factory=dict)
    verify_steps: dict[int, int] = field(default_factory=dict)
    verified_tokens: dict[int, int] = field(default_factory=dict)
    verified_rows: dict[int, int] = field(default_factory=dict)
    verify_batches: int = 0
    """Verify steps of the engine (batches), for the rows verified per step."""
    prefix_cache: dict | None = None
    slowest_steps: dict[int, float] = field(default_factory=dict)
    """The host wall time (ms) of the five slowest engine steps, by step index: stalls
    (compiles, allocations, retractions) show here."""
    series: StepSeries | None = None
    """What the run held, step by step (:class:`StepSeries`)."""
    leaked_bytes: int = 0
    """Bytes of units still held once every request finished (the prefix cache flushed
    first): anything but 0 is a leak."""
    leaked_rows: int = 0
    """Request-table rows still taken once every request finished."""

    @property
    def accept_length(self) -> float:
        """Committed tokens per verify step, over all requests (0 without verify steps)."""
        steps = sum(self.verify_steps.values())
        return sum(self.verified_tokens.values()) / steps if steps else 0.0

    def summary(self, with_arena_stats: bool) -> dict:
        out = {
            "output_tokens": self.output_tokens,
            "throughput_tok_s": self.output_tokens / self.seconds if self.seconds else 0.0,
            "peak_bytes": self.peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "steps": self.steps,
            "seconds": self.seconds,
            # the run's wall time per engine step: how fast its steps ran, apart from how
            # many the run's token path needed (a throughput moves with both)
            "ms_per_step": 1e3 * self.seconds / self.steps if self.steps else 0.0,
            "leaked_bytes": self.leaked_bytes,
            "leaked_rows": self.leaked_rows,
        }
        if with_arena_stats:
            out["compactions"] = self.compactions
            out["retractions"] = self.retractions
        if self.verify_steps:
            steps = sum(self.verify_steps.values())
            rows = sum(self.verified_rows.values())
            out["verify_steps"] = steps
            out["accept_length"] = self.accept_length
            out["mean_verify_length"] = rows / steps
            out["verify_batches"] = self.verify_batches
            # request-steps per verify batch: how full the run's verify steps were
            out["lanes_per_verify_batch"] = (
                steps / self.verify_batches if self.verify_batches else 0.0
            )
            out["tokens_verified_per_step"] = (
                rows / self.verify_batches if self.verify_batches else 0.0
            )
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache
        out["slowest_steps_ms"] = self.slowest_steps
        return out


def static_pool(
    cfg: ValidateConfig,
    model_cfg: HybridConfig,
    device: torch.device,
    draft_lanes: tuple[DraftLane, ...] = (),
) -> StaticMemory:
    """Pools sized so that ``max_running`` requests all fit at their full length (plus the
    write window and the look-ahead step with speculation). With the prefix cache, one more
    state slot per anchor point of each running request's length, for checkpoints."""
    spec = memory_spec(model_cfg, cfg.page_size, draft_lanes)
    total = cfg.input_len + cfg.output_len + cfg.window + cfg.lookahead
    per_req = pages_for(total, cfg.page_size)
    n = cfg.max_running * per_req
    slots = cfg.max_running
    if cfg.prefix_cache:
        slots += cfg.max_running * max(1, total // (cfg.page_size * cfg.checkpoint_interval))
    return StaticMemory(spec, n, n, slots, cfg.max_running, model_cfg.max_context, device)


def unified_pool(
    cfg: ValidateConfig,
    model_cfg: HybridConfig,
    device: torch.device,
    default_bytes: int,
    draft_lanes: tuple[DraftLane, ...] = (),
) -> UnifiedMemory:
    spec = memory_spec(model_cfg, cfg.page_size, draft_lanes)
    arena = int(cfg.arena_mb * MB) if cfg.arena_mb is not None else default_bytes
    return UnifiedMemory(spec, arena, cfg.max_running, model_cfg.max_context, device)


def sink_bytes(static: StaticMemory) -> int:
    """Bytes of the unified arena's sinks (so the default arena holds what static holds)."""
    return sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)


def make_backend(name: str):
    if name == "torch":
        from unimem.attention.torch_backend import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "fa4":
        from unimem.attention.fa4_backend import FA4Backend

        return FA4Backend()
    raise ValueError(f"unknown attention backend {name!r}; valid: torch, fa4")


def run_one(
    model: CausalLM,
    pool: MemoryPool,
    cfg: ValidateConfig,
    prompts: list[list[int]],
    label: str,
    progress: bool,
    chain: DsparkChain | None = None,
) -> RunResult:
    backend = make_backend(cfg.attention_backend)
    cache = PrefixCache(pool, cfg.checkpoint_interval) if cfg.prefix_cache else None
    engine = EngineCore(
        model,
        pool,
        backend,
        cfg.max_running,
        cfg.chunk_size,
        chain=chain,
        cache=cache,
        cuda_graphs=cfg.use_cuda_graphs,
    )
    for p in prompts:
        engine.submit(p, cfg.output_len, sampling=cfg.sampling())
    total = len(prompts) * cfg.output_len
    bar = ProgressBar(label, total) if progress else None
    marks: list[float] = []
    recorder = SeriesRecorder(pool)

    agreement = state_check_for(model)  # tensor parallel, UNIMEM_TP_CHECK_STATE=1

    def on_step(e: EngineCore) -> None:
        marks.append(time.perf_counter())
        recorder.step(e)
        if agreement is not None:
            agreement(e)
        if bar:
            bar.update(sum(len(r.output) for r in _requests(e)))

    start = time.perf_counter()
    try:
        done = engine.run(on_step)
    finally:
        series = recorder.close(engine)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    seconds = time.perf_counter() - start
    gaps = [b - a for a, b in zip([start, *marks], marks, strict=False)]
    slowest = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:5]
    if bar:
        bar.close()
    cached = cache_stats(cache, done, engine.scheduler.cache_flushes) if cache is not None else None
    if cache is not None:
        cache.flush()  # what the cache held is not a leak; what stays held now is
    rows = pool.req_to_token.shape[0] - 1
    return RunResult(
        outputs={r.rid: r.output for r in done},
        output_tokens=sum(len(r.output) for r in done),
        seconds=seconds,
        peak_bytes=pool.stats.peak_bytes,
        capacity_bytes=pool.stats.capacity_bytes,
        steps=engine.steps,
        compactions=pool.stats.compactions,
        retractions=engine.scheduler.retractions,
        forward_steps={r.rid: r.forward_steps for r in done},
        verify_steps={r.rid: r.verify_steps for r in done} if chain else {},
        verified_tokens={r.rid: r.verified_tokens for r in done} if chain else {},
        verified_rows={r.rid: r.verified_rows for r in done} if chain else {},
        verify_batches=engine.scheduler.verify_batches,
        prefix_cache=cached,
        slowest_steps={i: round(gaps[i] * 1e3, 3) for i in slowest},
        series=series,
        leaked_bytes=pool.used_bytes(),
        leaked_rows=rows - pool.free_rows,
    )


def cache_stats(cache: PrefixCache, done: list, flushes: int) -> dict:
    """The cache's counters and gauges at the end of a run, and the requests' skipped
    tokens (``cached_tokens``, retractions' readmissions included) and how often memory
    pressure flushed the cache (``flushes``)."""
    out = cache.stats.as_dict()
    out["cached_tokens"] = sum(r.cached_tokens for r in done)
    out["checkpoint_interval"] = cache.checkpoint_interval
    out["flushes"] = flushes
    return out


def _requests(engine: EngineCore):
    s = engine.scheduler
    return list(s.finished) + list(s.running) + list(s.waiting)


def static_and_unified(
    model: CausalLM,
    cfg: ValidateConfig,
    prompts: list[list[int]],
    progress: bool,
    chain_for=None,
    lanes: tuple[DraftLane, ...] = (),
) -> tuple[RunResult, RunResult, dict[str, list[float]]]:
    """The requests through fresh static pools and fresh unified arenas, ``cfg.repeats``
    times each in ABBA order (static, unified, unified, static, ...: a slow drift of the
    machine cancels in the means). Returns the first run of each mode, with ``seconds`` set
    so that its throughput is the mode's mean, and every run's throughput per mode. Every
    run of a mode must give the same outputs, verify counts and accept lengths (the runs are
    deterministic), else ``RuntimeError``."""
    model_cfg, device = model.config, model.device
    order: list[str] = []
    for i in range(cfg.repeats):
        order += ["static", "unified"] if i % 2 == 0 else ["unified", "static"]
    first_static = static_pool(cfg, model_cfg, device, lanes)  # the order starts static
    default_bytes = first_static.stats.capacity_bytes + sink_bytes(first_static)
    runs: dict[str, list[RunResult]] = {"static": [], "unified": []}
    for mode in order:
        if mode == "static":
            if first_static is not None:
                pool, first_static = first_static, None
            else:
                pool = static_pool(cfg, model_cfg, device, lanes)
        else:
            pool = unified_pool(cfg, model_cfg, device, default_bytes, lanes)
        chain = chain_for() if chain_for is not None else None
        runs[mode].append(run_one(model, pool, cfg, prompts, f"{mode:<7}", progress, chain))
        del pool
    timing = {m: [r.output_tokens / r.seconds for r in rs] for m, rs in runs.items()}
    for mode, results in runs.items():
        first = results[0]
        for k, other in enumerate(results[1:], 1):
            if (other.outputs, other.verify_steps, other.verified_tokens) != (
                first.outputs,
                first.verify_steps,
                first.verified_tokens,
            ):
                raise RuntimeError(f"{mode} run {k} differs from its run 0: not deterministic")
        first.seconds = first.output_tokens * len(results) / sum(timing[mode])
    return runs["static"][0], runs["unified"][0], timing


def run_series(static: RunResult, unified: RunResult) -> dict[str, dict]:
    """The report's ``"series"``: each mode's :class:`StepSeries` as plain data (what
    ``--plot`` draws)."""
    return {m: asdict(r.series) for m, r in (("static", static), ("unified", unified))}


def warm_up(
    model: CausalLM,
    cfg: ValidateConfig,
    prompts: list[list[int]],
    chain: DsparkChain | None = None,
) -> None:
    """On CUDA, untimed runs of every request with a short output (past the point where
    SWA pages start to retire; the timed runs' steps, graphs included) through a fresh static
    pool and a fresh unified arena, then a compaction of every band: every kernel of the
    extend, decode and verify paths and of the allocator compiles here — in each variant the
    real batches need (Triton specialises on argument alignment) — not inside a timed run
    (kernels compile once per process, so the run that went first would pay for both).
    Nothing on CPU."""
    if cfg.device != "cuda":
        return
    # long enough for SWA retirement to begin (its release path has kernel variants of its
    # own), and for a few decode / verify steps after it
    c = model.config
    window = c.window if "swa" in c.layer_pattern else 0
    retire_at = max(0, window + 2 * cfg.page_size - cfg.input_len)
    out = min(cfg.output_len, retire_at + 2 * cfg.gamma + 4)
    warm = replace(cfg, output_len=out, prefix_cache=False)
    device = model.device
    static = static_pool(warm, model.config, device, chain_lanes(chain))
    run_one(model, static, warm, prompts, "warm-up", False, chain)
    # the unified arena's own kernel variants (translation through v2p), and compaction
    bytes_ = static.stats.capacity_bytes + sink_bytes(static)
    unified = unified_pool(warm, model.config, device, bytes_, chain_lanes(chain))
    run_one(model, unified, warm, prompts, "warm-up", False, chain)
    for kind in unified.kinds:
        unified.compact(kind)
    del static, unified
    torch.cuda.synchronize(device)


def chain_lanes(chain: DsparkChain | None) -> tuple[DraftLane, ...]:
    return chain.drafter.config.lanes() if chain is not None else ()


def logprob_run(model: CausalLM, cfg: ValidateConfig, prompts) -> dict:
    """Outputs and per-token log-probabilities of a non-speculative static run."""
    plain = replace(cfg, spec="none", prefix_cache=False)
    pool = static_pool(plain, model.config, model.device)
    engine = EngineCore(
        model,
        pool,
        make_backend(plain.attention_backend),
        plain.max_running,
        plain.chunk_size,
        cuda_graphs=plain.use_cuda_graphs,
        logprobs=True,
    )
    reqs = [engine.submit(p, plain.output_len) for p in prompts]
    engine.run()
    return {r.rid: (r.output, r.output_logprobs) for r in reqs}
