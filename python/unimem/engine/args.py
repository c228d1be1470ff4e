"""Engine arguments with SGLang's names and meanings (``sglang.srt.server_args.ServerArgs``),
validated at construction so that an impossible configuration fails before anything loads.

Only the flags unimem implements exist here; a flag SGLang has and unimem does not is refused
by name (:data:`UNSUPPORTED_SGLANG_ARGS`) rather than silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from unimem.engine.grammar import grammar_available
from unimem.engine.prefill_delay import DEFAULT_MAX_DELAY_PASSES, PrefillDelayer
from unimem.models.model_path import DEFAULT_MODEL

__all__ = ["EngineArgs", "UNSUPPORTED_SGLANG_ARGS", "SWA_FULL_TOKENS_RATIO", "graph_buckets"]

SWA_FULL_TOKENS_RATIO = 0.8
"""SWA pool tokens per FULL pool token in the static split: SGLang's default
``--swa-full-tokens-ratio`` (server_args.py)."""

DEFAULT_MAMBA_TRACK_INTERVAL = 512
"""Tokens between the recurrent-state checkpoints of cached prefixes (models with STATE
layers) when ``mamba_track_interval`` is not given: a step that may end on one copies a
state slot, and every checkpoint the cache keeps holds one (``docs/prefix_cache.md``)."""

GRAMMAR_BACKENDS = ("xgrammar", "none")
"""``grammar_backend`` choices (SGLang's default first)."""

DEFAULT_CUDA_MAX_RUNNING = 256
"""``max_running_requests`` on CUDA when it is not given (and no graph size caps it)."""

DEFAULT_CPU_MAX_RUNNING = 16
"""``max_running_requests`` on the CPU when it is not given."""

DEFAULT_CPU_MAX_TOTAL_TOKENS = 16384
"""FULL-pool tokens on the CPU when ``max_total_tokens`` is not given (no memory probe)."""

UNSUPPORTED_SGLANG_ARGS = frozenset(
    {
        "dp_size",
        "pp_size",
        "ep_size",
        "kv_cache_dtype",
        "lora_paths",
        "enable_lora",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "enable_torch_compile",
        "enable_mixed_chunk",
        "schedule_policy",
        "trust_remote_code",
        "load_format",
        "revision",
    }
)
"""SGLang arguments unimem does not implement: passing one is an error naming it."""

PREFILL_DELAYER_DEFAULTS = {
    "prefill_delayer_max_delay_passes": DEFAULT_MAX_DELAY_PASSES,
    "prefill_delayer_token_usage_low_watermark": None,
    "prefill_delayer_queue_min_ratio": None,
    "prefill_delayer_max_delay_ms": None,
}
"""The ``prefill_delayer_*`` arguments and their defaults: setting one needs
``enable_prefill_delayer``."""

SPECULATIVE_ALGORITHMS = ("DSPARK",)
QUANTIZATION_METHODS = ("fp8",)
"""``quantization`` values (``unimem.models.quant_config.QUANTIZATION_METHODS``)."""
VERIFY_LENGTHS = ("fixed", "adaptive")
"""``speculative_verify_lengths`` values (:class:`~unimem.speculative.chain.DsparkChain`)."""
SAMPLED_VERIFY = ("token", "block")
"""``speculative_sampling_verify`` values (``unimem.speculative.spec_sampling.SAMPLED_VERIFY``)."""
ATTENTION_BACKENDS = ("fa4", "torch")
DEVICES = ("cpu", "cuda")


def _positive_int(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def graph_buckets(
    cuda_graph_bs: tuple[int, ...] | None, max_running: int
) -> tuple[int, ...] | None:
    """The batch sizes whose step graphs are recorded for ``max_running`` requests: those of
    ``cuda_graph_bs`` up to ``max_running``, and ``max_running`` itself (every batch needs a
    graph that holds it); None (the runner's default buckets) without ``cuda_graph_bs``."""
    if cuda_graph_bs is None:
        return None
    return tuple(sorted({b for b in cuda_graph_bs if b < max_running} | {max_running}))


@dataclass
class EngineArgs:
    """What ``unimem.Engine`` and ``python -m unimem.launch_server`` take (SGLang's names).

    ``model_path``: a checkpoint directory, a ``.gguf`` file or an embedded model's name
    (:func:`unimem.models.model_path.resolve_model_path`); None: the default model,
    ``gemma-3-270m``.
    ``cuda_graph_max_bs`` / ``cuda_graph_bs`` (SGLang's names, CUDA only): every batch runs a
    recorded step graph, so the running requests are capped at the largest recorded batch:
    ``cuda_graph_max_bs`` (default buckets up to it: 1, 2, 4, then every multiple of 8) or
    the largest of ``cuda_graph_bs``, the batch sizes to record (a batch pads up to the next;
    :func:`graph_buckets`). Fewer sizes start faster (each is several graphs) and pad more.
    ``max_total_tokens``: tokens of the FULL-attention pool (SGLang's meaning). Without
    ``enable_unified_memory`` the static pools hold that many FULL tokens,
    ``SWA_FULL_TOKENS_RATIO`` times as many SWA tokens and ``max_running_requests`` state
    slots; with it, one arena of the same bytes. Unset: on CUDA, ``mem_fraction_static`` of
    the GPU's memory minus the weights; on the CPU, ``DEFAULT_CPU_MAX_TOTAL_TOKENS``.
    ``speculative_num_draft_tokens``: tokens each verify step checks (the anchor plus
    ``gamma`` drafted tokens), as in SGLang's chain speculation.
    ``speculative_draft_model_path``: a DSPARK drafter checkpoint directory
    (:mod:`unimem.speculative.checkpoint`, e.g. from ``python -m
    unimem.training.train_drafter``); without it, the drafter shipped for this model if there
    is one (:mod:`unimem.speculative.shipped`), else a seeded untrained drafter (outputs stay
    exact; acceptance is low).
    ``tp_size``: tensor parallelism over that many processes (one GPU each on CUDA; gloo
    on the CPU), see :mod:`unimem.engine.distributed`. ``nnodes``, ``node_rank``,
    ``dist_init_addr`` (SGLang's names): the ranks spread evenly over ``nnodes`` machines,
    this one being ``node_rank``, meeting at rank 0's store on ``dist_init_addr``
    (``HOST:PORT`` of node 0); an engine on a node other than 0 runs its ranks for rank 0
    and returns when rank 0 shuts down.
    ``disable_radix_cache``: turn the prefix cache off (SGLang's meaning; on by default:
    :mod:`unimem.cache.prefix_cache`). ``mamba_track_interval``: tokens between the
    recurrent-state checkpoints of cached prefixes of a model with STATE layers (SGLang's
    name: a multiple of ``page_size``; None: ``DEFAULT_MAMBA_TRACK_INTERVAL`` rounded down to
    whole pages, at least one page); a model without STATE layers resumes at any page.
    ``speculative_verify_lengths`` (unimem only, DSPARK): "fixed" verifies
    ``speculative_num_draft_tokens`` tokens per request and step; "adaptive" chooses each
    request's length from the drafter's confidence head under ``speculative_verify_budget``
    tokens per step over the batch (None: no cut), see
    :mod:`unimem.speculative.verify_lengths`.
    ``speculative_sampling_verify`` (unimem only, DSPARK): how a sampled request's chain is
    verified — "token" (draft by draft, the original rule) or "block" (jointly: as exact,
    never fewer tokens a step in expectation; :mod:`unimem.speculative.spec_sampling`).
    ``enable_deterministic_inference`` (SGLang's name, CUDA only): batch-invariant kernels
    process-wide while the engine lives (:mod:`unimem.models.batch_invariant`), so that a
    request's tokens do not depend on the other requests, the batch bucket or the step kind.
    ``quantization`` (SGLang's name): "fp8" quantises an unquantised checkpoint's linears
    at load (block-wise FP8 weights, per-token-group activations); an FP8 checkpoint
    (``quantization_config``) runs in FP8 with or without it
    (:mod:`unimem.models.quant_config`).
    ``enable_prefill_delayer`` (SGLang's name; off by default): while a saturated batch
    decodes, hold admissions back until a batch's worth of lanes is free, at most
    ``prefill_delayer_max_delay_passes`` forward passes in a row; admit at once while the
    pool's usage is below ``prefill_delayer_token_usage_low_watermark``; with
    ``prefill_delayer_queue_min_ratio``, also hold while fewer requests wait than that ratio
    of the running ones, at most ``prefill_delayer_max_delay_ms`` per episode
    (:mod:`unimem.engine.prefill_delay`).
    ``grammar_backend`` (SGLang's name): "xgrammar" (the default) compiles and matches the
    grammars of structured-output requests (:mod:`unimem.engine.grammar`); "none" refuses
    them. SGLang's other backends ("outlines", "llguidance") are refused by name.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    context_length: int | None = None
    enable_unified_memory: bool = False
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    attention_backend: str | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None
    random_seed: int = 0
    skip_tokenizer_init: bool = False
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    disable_radix_cache: bool = False
    mamba_track_interval: int | None = None
    speculative_verify_lengths: str = "fixed"
    speculative_verify_budget: int | None = None
    speculative_sampling_verify: str = "token"
    enable_deterministic_inference: bool = False
    quantization: str | None = None
    enable_prefill_delayer: bool = False
    prefill_delayer_max_delay_passes: int = DEFAULT_MAX_DELAY_PASSES
    prefill_delayer_token_usage_low_watermark: float | None = None
    prefill_delayer_queue_min_ratio: float | None = None
    prefill_delayer_max_delay_ms: float | None = None
    grammar_backend: str = "xgrammar"

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """Build from keyword arguments, refusing unknown and unsupported SGLang ones by
        name."""
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key in UNSUPPORTED_SGLANG_ARGS:
                raise ValueError(f"argument {key!r} (an SGLang option) is not supported by unimem")
            if key not in known:
                raise ValueError(f"unknown argument {key!r}")
        return cls(**kwargs)

    def topology(self):
        """The :class:`~unimem.engine.distributed.Topology` of the ranks."""
        from unimem.engine.distributed import Topology

        return Topology(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr)

    def __post_init__(self) -> None:
        if self.model_path is None:
            self.model_path = DEFAULT_MODEL
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a non-empty path, got {self.model_path!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        for name in (
            "context_length",
            "page_size",
            "max_total_tokens",
            "max_running_requests",
            "chunked_prefill_size",
            "cuda_graph_max_bs",
            "speculative_num_draft_tokens",
            "mamba_track_interval",
            "speculative_verify_budget",
        ):
            _positive_int(name, getattr(self, name))
        _positive_int("tp_size", self.tp_size, allow_none=False)
        self.topology()  # the nodes: ValueError naming the argument
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        frac = self.mem_fraction_static
        if frac is not None and not (
            isinstance(frac, (int, float)) and math.isfinite(frac) and 0 < frac < 1
        ):
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {frac!r}")
        if frac is not None and self.device != "cuda":
            raise ValueError("mem_fraction_static applies to device cuda only")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.attention_backend == "fa4" and self.device != "cuda":
            raise ValueError("attention_backend fa4 needs device cuda")
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm.upper() not in SPECULATIVE_ALGORITHMS:
                raise ValueError(
                    f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                    f"got {self.speculative_algorithm!r}"
                )
            self.speculative_algorithm = self.speculative_algorithm.upper()
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = 8
            if self.speculative_num_draft_tokens < 2:
                raise ValueError(
                    "speculative_num_draft_tokens must be >= 2 (the anchor and at least one "
                    f"drafted token), got {self.speculative_num_draft_tokens}"
                )
        elif self.speculative_num_draft_tokens is not None:
            raise ValueError("speculative_num_draft_tokens needs speculative_algorithm DSPARK")
        elif self.speculative_draft_model_path is not None:
            raise ValueError("speculative_draft_model_path needs speculative_algorithm DSPARK")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS} (or unset), "
                f"got {self.quantization!r}"
            )
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if self.grammar_backend == "xgrammar" and not grammar_available():
            raise ValueError(
                "grammar_backend xgrammar: the package is not installed (pip install "
                "xgrammar, or grammar_backend 'none')"
            )
        self._check_verify_lengths()
        self._check_radix_cache()
        self._check_prefill_delayer()
        if self.cuda_graph_max_bs is not None and self.device != "cuda":
            raise ValueError("cuda_graph_max_bs applies to device cuda only")
        self._check_cuda_graph_bs()
        if self.enable_deterministic_inference and self.device != "cuda":
            raise ValueError(
                "enable_deterministic_inference applies to device cuda only (the CPU runs "
                "torch's own kernels)"
            )

    def _check_cuda_graph_bs(self) -> None:
        if self.cuda_graph_bs is None:
            return
        bs = self.cuda_graph_bs
        if isinstance(bs, (str, bytes)) or not hasattr(bs, "__iter__"):
            raise ValueError(f"cuda_graph_bs must be a list of batch sizes, got {bs!r}")
        bs = tuple(bs)
        if not bs:
            raise ValueError("cuda_graph_bs must name at least one batch size")
        for b in bs:
            _positive_int("cuda_graph_bs", b)
        if self.device != "cuda":
            raise ValueError("cuda_graph_bs applies to device cuda only")
        if self.cuda_graph_max_bs is not None and max(bs) > self.cuda_graph_max_bs:
            raise ValueError(
                f"cuda_graph_bs {max(bs)} exceeds cuda_graph_max_bs {self.cuda_graph_max_bs}"
            )
        self.cuda_graph_bs = tuple(sorted(set(bs)))

    def graph_cap(self) -> int | None:
        """The most running requests the recorded graphs allow (None: no cap of theirs)."""
        if self.cuda_graph_bs is not None:
            return max(self.cuda_graph_bs)
        return self.cuda_graph_max_bs

    def _check_verify_lengths(self) -> None:
        if self.speculative_verify_lengths not in VERIFY_LENGTHS:
            raise ValueError(
                f"speculative_verify_lengths must be one of {VERIFY_LENGTHS}, "
                f"got {self.speculative_verify_lengths!r}"
            )
        if self.speculative_verify_lengths != "fixed" and self.speculative_algorithm is None:
            raise ValueError(
                "speculative_verify_lengths adaptive needs speculative_algorithm DSPARK"
            )
        if (
            self.speculative_verify_budget is not None
            and self.speculative_verify_lengths != "adaptive"
        ):
            raise ValueError("speculative_verify_budget needs speculative_verify_lengths adaptive")
        if self.speculative_sampling_verify not in SAMPLED_VERIFY:
            raise ValueError(
                f"speculative_sampling_verify must be one of {SAMPLED_VERIFY}, "
                f"got {self.speculative_sampling_verify!r}"
            )
        if self.speculative_sampling_verify != "token" and self.speculative_algorithm is None:
            raise ValueError("speculative_sampling_verify block needs speculative_algorithm DSPARK")

    def _check_radix_cache(self) -> None:
        if not isinstance(self.disable_radix_cache, bool):
            raise ValueError(
                f"disable_radix_cache must be a bool, got {self.disable_radix_cache!r}"
            )
        interval = self.mamba_track_interval
        if interval is None:
            return
        if self.disable_radix_cache:
            raise ValueError("mamba_track_interval needs the radix cache (not disable_radix_cache)")
        if interval % self.page_size:
            raise ValueError(
                f"mamba_track_interval must be a multiple of page_size {self.page_size}, "
                f"got {interval}"
            )

    def _check_prefill_delayer(self) -> None:
        if not isinstance(self.enable_prefill_delayer, bool):
            raise ValueError(
                f"enable_prefill_delayer must be a bool, got {self.enable_prefill_delayer!r}"
            )
        given = [
            name
            for name, default in PREFILL_DELAYER_DEFAULTS.items()
            if getattr(self, name) != default
        ]
        if given and not self.enable_prefill_delayer:
            raise ValueError(f"{given[0]} needs enable_prefill_delayer")
        if not self.enable_prefill_delayer:
            return
        self.prefill_delayer()  # ValueError naming a bad value
        ratio = self.prefill_delayer_queue_min_ratio
        if self.prefill_delayer_max_delay_ms is not None and ratio is None:
            raise ValueError(
                "prefill_delayer_max_delay_ms caps the queue trigger: it needs "
                "prefill_delayer_queue_min_ratio"
            )
        if ratio is not None and self.tp_size > 1:
            raise ValueError(
                "prefill_delayer_queue_min_ratio is not supported with tp_size > 1 (its "
                "wall-clock cap would differ between the ranks, which schedule alike)"
            )

    def prefill_delayer(self) -> PrefillDelayer | None:
        """The :class:`~unimem.engine.prefill_delay.PrefillDelayer` these arguments ask for
        (a new one: it keeps per-run counters), or None when it is off."""
        if not self.enable_prefill_delayer:
            return None
        try:
            return PrefillDelayer(
                self.prefill_delayer_max_delay_passes,
                self.prefill_delayer_token_usage_low_watermark,
                self.prefill_delayer_queue_min_ratio,
                self.prefill_delayer_max_delay_ms,
            )
        except ValueError as e:  # name the argument as the caller spelled it
            raise ValueError(f"prefill_delayer_{e}") from None

    @property
    def checkpoint_interval_pages(self) -> int:
        """Pages between the state checkpoints of cached prefixes (models with STATE
        layers): ``mamba_track_interval`` or ``DEFAULT_MAMBA_TRACK_INTERVAL`` tokens, in whole
        pages, at least one."""
        tokens = self.mamba_track_interval or DEFAULT_MAMBA_TRACK_INTERVAL
        return max(1, tokens // self.page_size)

    @property
    def gamma(self) -> int:
        """Drafted tokens per verify step (0 without speculation)."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_draft_tokens - 1
