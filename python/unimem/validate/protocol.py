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
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from unimem.cache import PrefixCache
from unimem.engine.core import EngineCore
from unimem.engine.distributed import (
    Topology,
    TPGroups,
    run_ranks,
    state_check_for,
    vocab_tables,
)
from unimem.engine.draft_runner import draft_config_for
from unimem.engine.sampling import SamplingOptions
from unimem.memory.layout import PageLayout, SlotLayout
from unimem.memory.pool import MemoryPool, pages_for
from unimem.memory.spec import DraftLane, LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models import batch_invariant, fp8_convert
from unimem.models.base import CausalLM
from unimem.models.config import HybridConfig, memory_spec
from unimem.models.loader import load_checkpoint, load_hf_config, resolve_dtype
from unimem.models.model_path import resolve_model_path
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.models.tensor_parallel import SINGLE, full_config
from unimem.speculative.chain import VERIFY_LENGTHS, DsparkChain
from unimem.speculative.checkpoint import load_drafter
from unimem.speculative.control import AcceptanceControl, uniform_draws
from unimem.speculative.drafter import DsparkDrafter
from unimem.speculative.shipped import shipped_drafter
from unimem.validate.report import ProgressBar

MB = 1 << 20


@dataclass
class ValidateConfig:
    device: str = "cpu"
    preset: str = "tiny"
    requests: int = 16
    input_len: int = 96
    output_len: int = 32
    seed: int = 0
    page_size: int = 16
    arena_mb: float | None = None
    max_running: int = 8
    chunk_size: int = 128
    backend: str = "auto"
    cuda_graphs: str = "auto"
    spec: str = "none"
    gamma: int = 7
    accept_rate: float = 0.8
    control_reference: str = "decode"
    repeats: int = 1
    prefix_cache: bool = False
    shared_prefix_len: int = 0
    checkpoint_interval: int = 1
    model_path: str | None = None
    dtype: str = "auto"
    prompts_file: str | None = None
    oracle: str = "none"
    speculative_draft_model_path: str | None = None
    draft_layers: int = 2
    temperature: float = 0.0
    top_p: float = 1.0
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    verify_lengths: str = "fixed"
    verify_budget: int | None = None
    deterministic: str = "auto"
    quantization: str | None = None

    def topology(self) -> Topology:
        """The nodes the ``tp_size`` ranks run on (``--nnodes``, ``--node-rank``,
        ``--dist-init-addr``)."""
        return Topology(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr)

    def __post_init__(self) -> None:
        if self.deterministic not in DETERMINISTIC_MODES:
            raise ValueError(
                f"deterministic must be one of {DETERMINISTIC_MODES}, got {self.deterministic!r}"
            )
        if self.deterministic == "on" and self.device != "cuda":
            raise ValueError(
                "--enable-deterministic-inference applies to --device cuda (CPU runs use "
                "torch's own kernels; float64 runs are exact already)"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        for name in ("requests", "input_len", "output_len", "page_size", "max_running", "tp_size"):
            _check_count(name, getattr(self, name))
        self.topology()
        _check_count("chunk_size", self.chunk_size)
        if self.arena_mb is not None and not (
            isinstance(self.arena_mb, (int, float))
            and math.isfinite(self.arena_mb)
            and self.arena_mb > 0
        ):
            raise ValueError(
                f"arena_mb (--arena-mb) must be a finite number > 0, got {self.arena_mb!r}"
            )
        if self.oracle not in ORACLES:
            raise ValueError(f"oracle must be one of {ORACLES}, got {self.oracle!r}")
        if self.oracle != "none" and self.model_path is None:
            raise ValueError("--oracle transformers needs --model-path (a HuggingFace checkpoint)")
        if self.prompts_file is not None and self.model_path is None:
            raise ValueError("--prompts needs --model-path (its tokenizer encodes them)")
        if self.model_path is not None and not os.path.isfile(
            os.path.join(self.checkpoint_dir, "config.json")
        ):
            raise ValueError(f"--model-path {self.model_path}: no config.json there")
        if self.prompts_file is not None and not os.path.isfile(self.prompts_file):
            raise ValueError(f"--prompts {self.prompts_file}: no such file")
        if not 0 <= self.shared_prefix_len <= self.input_len:
            raise ValueError(
                f"shared prefix length must be in [0, input length {self.input_len}], "
                f"got {self.shared_prefix_len}"
            )
        if not isinstance(self.checkpoint_interval, int) or self.checkpoint_interval < 1:
            raise ValueError(
                f"checkpoint interval must be an int >= 1, got {self.checkpoint_interval!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.attention_backend == "fa4" and self.device != "cuda":
            raise ValueError("the fa4 backend needs --device cuda")
        if self.use_cuda_graphs and self.attention_backend == "torch":
            raise ValueError(
                "CUDA graphs need the fa4 backend on a CUDA device (the torch reference "
                "backend reads lengths on the host)"
            )
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {SPEC_MODES}, got {self.spec!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}")
        if self.control_reference not in CONTROL_REFERENCES:
            raise ValueError(
                f"control reference must be one of {CONTROL_REFERENCES}, "
                f"got {self.control_reference!r}"
            )
        if self.spec != "none":
            if not isinstance(self.gamma, int) or self.gamma < 1:
                raise ValueError(f"gamma must be an int >= 1, got {self.gamma!r}")
            if not 0.0 <= self.accept_rate <= 1.0:
                raise ValueError(f"accept rate must be in [0, 1], got {self.accept_rate!r}")
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0
        ):
            raise ValueError(f"temperature (--temperature) must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p (--top-p) must be in (0, 1], got {self.top_p!r}")
        if self.temperature > 0 and self.oracle != "none":
            raise ValueError("--oracle compares greedy outputs: it needs --temperature 0")
        if self.verify_lengths not in VERIFY_LENGTHS:
            raise ValueError(
                f"verify lengths (--verify-lengths) must be one of {VERIFY_LENGTHS}, "
                f"got {self.verify_lengths!r}"
            )
        b = self.verify_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(
                f"verify budget (--speculative-verify-budget) must be an int >= 1, got {b!r}"
            )
        _check_count("draft_layers", self.draft_layers)
        if self.speculative_draft_model_path is not None and self.draft_layers != 2:
            raise ValueError(
                "--draft-layers applies to the seeded drafter, not to "
                "--speculative-draft-model-path (its config.json gives its layers)"
            )
        draft = self.speculative_draft_model_path  # used with spec dspark only
        if draft is not None and not os.path.isfile(os.path.join(draft, "config.json")):
            raise ValueError(f"--speculative-draft-model-path {draft}: no config.json there")

    def sampling(self) -> SamplingOptions | None:
        """Every request's sampling options: None (greedy) at temperature 0, else
        ``temperature`` and ``top_p`` with the engine's per-request seed (drawn from its
        ``random_seed`` and the request id: the same in every run of the protocol)."""
        if self.temperature == 0:
            return None
        return SamplingOptions(temperature=self.temperature, top_p=self.top_p)

    @property
    def window(self) -> int:
        """Tokens a request's write window reaches past its last token (``gamma`` with
        speculation, else 0)."""
        return self.gamma if self.spec != "none" else 0

    @property
    def lookahead(self) -> int:
        """Tokens of memory a request keeps for a verify step launched after its last one
        (results are read one step late): ``gamma + 1`` with speculation, else 0."""
        return self.gamma + 1 if self.spec != "none" else 0

    @property
    def attention_backend(self) -> str:
        """The backend ``auto`` resolves to: FA4 on CUDA for a 16-bit preset, else the torch
        reference (float64 presets are for exactness, which FA4 does not compute in)."""
        if self.backend != "auto":
            return self.backend
        sixteen_bit = self.model_dtype in (torch.bfloat16, torch.float16)
        return "fa4" if self.device == "cuda" and sixteen_bit else "torch"

    @property
    def checkpoint_dir(self) -> str | None:
        """The checkpoint directory ``model_path`` names (a GGUF file or an embedded model's
        name resolved, :func:`unimem.models.model_path.resolve_model_path`); None for a
        preset."""
        if self.model_path is None:
            return None
        return resolve_model_path(self.model_path)

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model computes in: the preset's, or the checkpoint's resolved from
        ``dtype`` (:func:`unimem.models.loader.resolve_dtype`)."""
        if self.model_path is None:
            return preset(self.preset).dtype
        hf_config = load_hf_config(self.checkpoint_dir)
        return resolve_dtype(self.dtype, hf_config, torch.device(self.device))

    @property
    def use_deterministic(self) -> bool:
        """Batch-invariant kernels (:mod:`unimem.models.batch_invariant`): "auto" turns them
        on with CUDA."""
        if self.deterministic == "auto":
            return self.device == "cuda"
        return self.deterministic == "on"

    @property
    def use_cuda_graphs(self) -> bool:
        if self.cuda_graphs == "auto":
            return self.device == "cuda" and self.attention_backend == "fa4"
        if self.cuda_graphs == "on" and self.device != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        return self.cuda_graphs == "on"


def _check_count(name: str, value: object) -> None:
    """``ValueError`` naming the field (and its flag) unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{name} ({flag}) must be an int >= 1, got {value!r}")


SPEC_MODES = ("none", "dspark")
DETERMINISTIC_MODES = ("auto", "on", "off")
NOT_APPLICABLE = (
    "not applicable at temperature > 0: speculative sampling draws from the same "
    "distribution as non-speculative sampling, not the same tokens"
)
ORACLES = ("none", "transformers")
CONTROL_REFERENCES = ("decode", "speculative")
BACKENDS = ("auto", "torch", "fa4")


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


@dataclass
class StepSeries:
    """What one run held, engine step by engine step, from the host's counts only (the pool's
    live-unit counters, its stats and the scheduler's lists; nothing is read from the device).

    ``units[kind][i]``: units of ``kind`` (``"full"``, ``"swa"``, ``"state"``) in use at the
    fullest moment of engine step ``i + 1`` (the step's start included: a step that only frees
    keeps the bytes it started with). ``unit_bytes[kind]``: one unit's bytes, of which
    ``draft_unit_bytes[kind]`` belong to the drafter's lanes (0 without speculation). So
    :meth:`used_bytes` is the pool's ``used_bytes()`` at those moments, and its largest value
    is the run's ``peak_bytes``. ``running[i]``: requests running after step ``i + 1``.
    ``compaction_steps`` / ``retraction_steps``: the step of each compaction / retraction, one
    entry each (their lengths are the run's counts). ``capacity``: the fixed walls in bytes,
    static: each pool's size by kind (its sink included; they sum to ``capacity_bytes``),
    unified: ``{"arena": capacity_bytes}``."""

    units: dict[str, list[int]]
    unit_bytes: dict[str, int]
    draft_unit_bytes: dict[str, int]
    running: list[int] = field(default_factory=list)
    compaction_steps: list[int] = field(default_factory=list)
    retraction_steps: list[int] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.running)

    def kind_bytes(self, kind: str, draft: bool = False) -> list[int]:
        """Per step, the bytes of ``kind``'s units in use that hold the target model's layers
        (``draft`` False) or the drafter's lanes (``draft`` True)."""
        d = self.draft_unit_bytes[kind]
        per = d if draft else self.unit_bytes[kind] - d
        return [n * per for n in self.units[kind]]

    def used_bytes(self) -> list[int]:
        """Per step, the bytes of every unit in use (all kinds, draft lanes included)."""
        kinds = list(self.units)
        return [
            sum(self.units[k][i] * self.unit_bytes[k] for k in kinds) for i in range(self.steps)
        ]


class SeriesRecorder:
    """Records a :class:`StepSeries` while an engine runs on ``pool``: call :meth:`step`
    after every engine step and :meth:`close` at the end.

    Host counts only. A step allocates (admission, growth) before it accounts the previous
    step (retirement, release), so its fullest moment lies inside it: the recorder observes
    the pool's usage (``pool.add_usage_observer``: host arithmetic after every operation
    that changes what it holds) to keep, per step, the per-kind counts at the moment the
    total was largest. :meth:`close` stops observing."""

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        kinds = pool.spec.kinds
        self._kinds = [k.value for k in kinds]
        self.series = StepSeries(
            units={k: [] for k in self._kinds},
            unit_bytes={k.value: pool.layout.unit_bytes(k) for k in kinds},
            draft_unit_bytes={k.value: _draft_unit_bytes(pool.layout.of(k)) for k in kinds},
            capacity=_capacity(pool),
        )
        self._fullest = self._sample()
        self._compactions = pool.stats.compactions
        self._retractions = 0
        self._steps = 0
        pool.add_usage_observer(self._observe)

    def _observe(self) -> None:
        now = self._sample()
        if self._bytes(now) > self._bytes(self._fullest):
            self._fullest = now

    def _sample(self) -> tuple[int, ...]:
        return tuple(self.pool.live_units(LayerKind(k)) for k in self._kinds)

    def _bytes(self, units: tuple[int, ...]) -> int:
        return sum(n * self.series.unit_bytes[k] for k, n in zip(self._kinds, units, strict=True))

    def step(self, engine: EngineCore) -> None:
        """Close the step the engine just ran: its fullest counts, running requests, and the
        compactions and retractions it made."""
        s = self.series
        for k, n in zip(self._kinds, self._fullest, strict=True):
            s.units[k].append(n)
        self._fullest = self._sample()
        s.running.append(len(engine.scheduler.running))
        self._steps = engine.steps
        self._marks(engine.scheduler.retractions)

    def _marks(self, retractions: int) -> None:
        s, step = self.series, self._steps
        compactions = self.pool.stats.compactions
        s.compaction_steps += [step] * (compactions - self._compactions)
        s.retraction_steps += [step] * (retractions - self._retractions)
        self._compactions, self._retractions = compactions, retractions

    def close(self, engine: EngineCore) -> StepSeries:
        """Stop observing the pool; compactions or retractions after the last step (the
        final drain) are marked on the last step. Returns the series."""
        self.pool.remove_usage_observer(self._observe)
        self._marks(engine.scheduler.retractions)
        return self.series


def _draft_unit_bytes(layout: PageLayout | SlotLayout) -> int:
    """Bytes of one unit from its first draft lane's block on (the draft lanes follow the
    target's in the envelope), 0 without draft lanes."""
    if layout.num_lanes == layout.num_target:
        return 0
    offsets = layout.k_offsets if isinstance(layout, PageLayout) else layout.conv_offsets
    return layout.unit_bytes - offsets[layout.num_target]


def _capacity(pool: MemoryPool) -> dict[str, int]:
    if isinstance(pool, StaticMemory):
        return {k.value: pool.pools[k].numel() for k in pool.kinds}
    return {"arena": pool.stats.capacity_bytes}


def make_prompts(cfg: ValidateConfig, vocab_size: int) -> list[list[int]]:
    """Fixed synthetic prompts: ``requests`` x ``input_len`` token ids drawn from the seed; the
    first ``shared_prefix_len`` of them are the same in every prompt."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, vocab_size, (cfg.requests, cfg.input_len), generator=g)
    if cfg.shared_prefix_len:
        g = torch.Generator().manual_seed(cfg.seed + 2)
        ids[:, : cfg.shared_prefix_len] = torch.randint(
            0, vocab_size, (cfg.shared_prefix_len,), generator=g
        )
    return ids.tolist()


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
            bar.update(sum(len(r.output) for r in _all(e)))

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


def _all(engine: EngineCore):
    s = engine.scheduler
    return list(s.finished) + list(s.running) + list(s.waiting)


def compare(static: RunResult, unified: RunResult) -> list[dict]:
    """Requests whose outputs differ, with the first differing position."""
    return compare_outputs(static.outputs, unified.outputs)


def compare_outputs(expected: dict[int, list[int]], got: dict[int, list[int]]) -> list[dict]:
    """Requests of ``expected`` whose output in ``got`` differs, with the first differing
    position."""
    diffs = []
    for rid, a in expected.items():
        b = got.get(rid)
        if a != b:
            pairs = zip(a, b or [], strict=False)
            first = next((i for i, (x, y) in enumerate(pairs) if x != y), len(b or []))
            diffs.append({"rid": rid, "first_diff": first})
    return diffs


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
    _warm_up(model, cfg, prompts)
    res_s, res_u, timing = _static_and_unified(model, cfg, prompts, progress)
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
    _add_oracle(report, cfg, model, prompts, {"static": res_s.outputs, "unified": res_u.outputs})
    return report


def _validate_rank(groups: TPGroups, cfg, progress, max_margins) -> dict:
    """One rank of a tensor-parallel :func:`validate` (progress shown by rank 0 only)."""
    return validate(cfg, progress and groups.rank == 0, max_margins, tp=groups)


def read_prompts_file(path: str) -> list[str]:
    """The prompts of ``--prompts``: a ``.json`` file holds a list of strings (prompts may span
    lines); any other file holds one prompt per non-empty line."""
    if path.endswith(".json"):
        import json

        with open(path) as f:
            prompts = json.load(f)
        if not (isinstance(prompts, list) and all(isinstance(p, str) and p for p in prompts)):
            raise ValueError(f"--prompts {path}: expected a JSON list of non-empty strings")
        return prompts
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def build_model_and_prompts(
    cfg: ValidateConfig, device: torch.device, tp: TPGroups | None = None
) -> tuple[CausalLM, list[list[int]]]:
    """The model (the seeded preset, or the checkpoint of ``model_path``; with ``tp``, this
    rank's shard) and the prompts: ``--prompts`` lines encoded by the checkpoint's
    tokenizer, else random token ids from the seed (below the tokenizer's size when there is
    one)."""
    shard = tp.tensor_parallel() if tp is not None else SINGLE
    if cfg.model_path is None:
        model_cfg = preset(cfg.preset)
        model = HybridModel(model_cfg, seed=cfg.seed, device=device, tp=shard)
        if cfg.quantization == "fp8":
            fp8_convert.quantize_model_online(model)
        return model, make_prompts(cfg, model_cfg.vocab_size)
    ckpt = load_checkpoint(
        cfg.checkpoint_dir, dtype=cfg.dtype, device=device, tp=shard, quantization=cfg.quantization
    )
    model = ckpt.model
    vocab = model.config.vocab_size
    if ckpt.tokenizer is not None:
        vocab = min(vocab, len(ckpt.tokenizer))
    if cfg.prompts_file is None:
        return model, make_prompts(cfg, vocab)
    if ckpt.tokenizer is None:
        raise ValueError(f"--prompts: the checkpoint {cfg.model_path} has no tokenizer")
    lines = read_prompts_file(cfg.prompts_file)
    if len(lines) < cfg.requests:
        raise ValueError(f"--prompts has {len(lines)} prompts, --requests asks for {cfg.requests}")
    return model, [ckpt.tokenizer.encode(t) for t in lines[: cfg.requests]]


def _add_oracle(
    report: dict,
    cfg: ValidateConfig,
    model: CausalLM,
    prompts: list[list[int]],
    runs: dict[str, dict[int, list[int]]],
) -> None:
    """With ``--oracle transformers``: the same prompts through
    ``transformers.AutoModelForCausalLM.generate`` (greedy, eager attention, the model's
    dtype) — ``oracle_matches`` (requests whose static and unified outputs both equal it),
    ``oracle_mismatches`` and ``oracle_max_logprob_diff`` (the largest difference between
    our per-token log-probabilities, from a static run, and transformers' over the common
    prefix)."""
    if cfg.oracle != "transformers":
        return
    from transformers import AutoModelForCausalLM

    device = model.device
    hf = AutoModelForCausalLM.from_pretrained(
        cfg.checkpoint_dir, dtype=model.config.dtype, attn_implementation="eager"
    ).to(device)
    hf.eval()
    expected, hf_logprobs = {}, {}
    for rid, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=cfg.output_len,
                # our runs ignore EOS (it may be the argmax and is kept); so here: no EOS
                # stopping and no EOS suppression (min_new_tokens would mask it)
                eos_token_id=None,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        toks = out.sequences[0, len(ids) :].tolist()
        logits = torch.stack([x[0] for x in out.logits]).float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks, device=device)[:, None])
        expected[rid], hf_logprobs[rid] = toks, lp[:, 0].tolist()
    del hf
    ours = _logprob_run(model, cfg, prompts)
    diffs = []
    for label in runs:
        for d in compare_outputs(expected, runs[label]):
            diffs.append({**d, "mode": label})
    worst = 0.0
    for rid, (toks, lps) in ours.items():
        n = 0
        while n < min(len(toks), len(expected[rid])) and toks[n] == expected[rid][n]:
            n += 1
        n = min(n + 1, len(toks), len(expected[rid]))  # the first differing token's too
        worst = max(
            [worst] + [abs(a - b) for a, b in zip(lps[:n], hf_logprobs[rid][:n], strict=True)]
        )
    report["oracle_matches"] = len(prompts) - len({d["rid"] for d in diffs})
    report["oracle_mismatches"] = diffs
    report["oracle_max_logprob_diff"] = worst


def _logprob_run(model: CausalLM, cfg: ValidateConfig, prompts) -> dict:
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


def _static_and_unified(
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
    default_bytes = first_static.stats.capacity_bytes + _header(first_static)
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


def bench_config(**overrides) -> ValidateConfig:
    """The ``bench`` protocol's defaults: serving sizes on one GPU — the ``small`` preset, 48
    requests of 512 prompt and 2048 output tokens, all running at once, DSPARK gamma 7 with
    acceptance control 0.8 following a speculative reference run, page size 64, FA4 and CUDA
    graphs; static and unified each run twice (ABBA order)."""
    base = dict(
        device="cuda",
        preset="small",
        requests=48,
        input_len=512,
        output_len=2048,
        page_size=64,
        max_running=48,
        chunk_size=8192,
        spec="dspark",
        gamma=7,
        accept_rate=0.8,
        control_reference="speculative",
        repeats=2,
    )
    base.update(overrides)
    return ValidateConfig(**base)


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


def _warm_up(
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
    bytes_ = static.stats.capacity_bytes + _header(static)
    unified = unified_pool(warm, model.config, device, bytes_, chain_lanes(chain))
    run_one(model, unified, warm, prompts, "warm-up", False, chain)
    for kind in unified.kinds:
        unified.compact(kind)
    del static, unified
    torch.cuda.synchronize(device)


def chain_lanes(chain: DsparkChain | None) -> tuple[DraftLane, ...]:
    return chain.drafter.config.lanes() if chain is not None else ()


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
    _warm_up(model, ref_cfg, prompts)
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
        _warm_up(model, ctl_cfg, prompts, ctl_chain)
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

    _warm_up(model, cfg, prompts, chain_for())
    res_s, res_u, timing = _static_and_unified(model, cfg, prompts, progress, chain_for, lanes)
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
    _add_oracle(report, cfg, model, prompts, {"static": res_s.outputs, "unified": res_u.outputs})
    if cfg.prefix_cache:
        _compare_cache_off(report, cfg, model, prompts, progress, res_s, res_u, chain_for, lanes)
    return report


def control_expected_accept_length(rate: float, gamma: int) -> float:
    """The accept length validate measures (``Request.verified_tokens`` per verify step:
    ``accepted + 1`` per step, counted before truncation at the output length) when the
    acceptance control replaces each drafted token by the reference's with probability
    ``rate`` and nothing else is accepted: a step accepts ``j < gamma`` drafts with
    probability ``rate ** j * (1 - rate)`` and all ``gamma`` with ``rate ** gamma``, so
    ``sum_{i=0..gamma} rate ** i`` tokens per step.

    Finite outputs do not change it: validate's references run ``gamma`` tokens past the
    output, so a request's last step draws like any other (its surplus is counted, not
    committed), and by Wald's identity the expected count over a request's steps is the
    expected number of steps times this mean. A drafter's own correct guesses add to it.
    Speculative outputs must follow the reference for this to hold, which on the GPU takes
    batch-invariant kernels."""
    return float(sum(rate**i for i in range(gamma + 1)))


def control_draws_accept_length(
    seed: int,
    rate: float,
    gamma: int,
    references: dict[int, list[int]],
    prompts: list[list[int]],
    output_len: int,
) -> float:
    """The accept length the acceptance control's own draws give for this run (its hash of
    ``(seed, rid, position)``, replayed on the host): each request from the token its
    prefill gives to ``output_len`` tokens (or its reference's end), every verify step
    accepting drafts while the draw says "reference" and the reference is known, ``gamma``
    at most, plus the bonus token. A run whose speculative outputs follow the reference
    measures this plus its drafter's own correct guesses; the difference from
    :func:`control_expected_accept_length` is the sample of draws."""
    steps = counted = 0
    for rid, ref in references.items():
        start = len(prompts[rid])
        out_len = min(output_len, len(ref) - start)
        positions = torch.arange(len(ref) + gamma + 1)
        take = (uniform_draws(seed, torch.full_like(positions, rid), positions) < rate) & (
            positions < len(ref)
        )
        take = take.tolist()
        done, at = 1, start + 1  # the prefill's token is committed
        while done < out_len:
            accepted = 0
            while accepted < gamma and take[at + accepted]:
                accepted += 1
            steps += 1
            counted += accepted + 1
            done += accepted + 1
            at += accepted + 1
    return counted / steps if steps else 0.0


def near_tie_margin(dtype: torch.dtype) -> float:
    """Oracle logit margins below this explain a speculative token flip (module docstring):
    0 for float64 (no flip is explained), 1e-3 for float32, 1/16 for 16-bit models (logits
    of O(1) computed from bf16 activations carry errors of ~1e-2)."""
    if dtype == torch.float64:
        return 0.0
    if dtype == torch.float32:
        return 1e-3
    return 1 / 16


def spec_mismatches(
    model: CausalLM,
    prompts: list[list[int]],
    expected: dict[int, list[int]],
    runs: dict[str, dict[int, list[int]]],
    max_margins: int | None = None,
) -> list[dict]:
    """Requests (rid = prompt index) whose output in a speculative run (``runs[label]``)
    differs from the non-speculative ``expected`` output: the first differing output position,
    both tokens there, and the dense oracle's top-2 tokens and logit margin after the common
    prefix (a near-tie explains a flipped token — ``near_tie`` — a clear margin means a bug).
    Margins are computed for the first ``max_margins`` mismatches (None: all); the others
    have ``logit_margin`` None."""
    out = []
    tie = near_tie_margin(model.config.dtype)
    margins: dict[tuple[int, int], dict] = {}
    for label, outputs in runs.items():
        for d in compare_outputs(expected, outputs):
            rid, first = d["rid"], d["first_diff"]
            d["mode"] = label
            d["spec_token"] = _at(outputs.get(rid, []), first)
            d["reference_token"] = _at(expected[rid], first)
            key = (rid, first)
            if key not in margins and (max_margins is None or len(margins) < max_margins):
                margins[key] = _margin(model, prompts[rid] + expected[rid][:first])
            d.update(margins.get(key, {"oracle_top2": None, "logit_margin": None}))
            m = d["logit_margin"]
            d["near_tie"] = m is not None and m < tie
            out.append(d)
    return out


def _at(tokens: list[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None


def _margin(model: CausalLM, prefix: list[int]) -> dict:
    """The target's choice after ``prefix`` by the dense oracle: its top-2 tokens and the
    logit margin between them (a near-tie explains a flipped token)."""
    ids = torch.tensor(prefix, dtype=torch.long)
    logits = model.reference_forward([ids])[0][-1]
    top = torch.topk(logits.double(), 2)
    return {
        "oracle_top2": [int(i) for i in top.indices],
        "logit_margin": float(top.values[0] - top.values[1]),
    }


def _header(static: StaticMemory) -> int:
    """Bytes of the unified arena's sinks (so the default arena holds what static holds)."""
    return sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)
