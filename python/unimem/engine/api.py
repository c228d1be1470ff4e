"""``unimem.Engine``: the offline API, shaped like ``sglang.Engine``.

::

    engine = unimem.Engine(model_path=PATH, device="cpu", dtype="float32",
                           enable_unified_memory=True, page_size=16, max_total_tokens=4096)
    outs = engine.generate(input_ids=[[1, 2, 3], [4, 5]],     # or prompt=["text", ...]
                           sampling_params={"max_new_tokens": 16, "temperature": 0.0})
    outs[0]["output_ids"], outs[0]["text"], outs[0]["meta_info"]
    engine.shutdown()

Construction loads the checkpoint (:func:`unimem.models.loader.load_checkpoint`), sizes the
memory as SGLang does (:mod:`unimem.engine.pools`), and builds the step loop
(:class:`~unimem.engine.core.EngineCore`): static pools, or with ``enable_unified_memory`` one
arena of the same bytes; FA4 and CUDA graphs on a GPU for a 16-bit model; DSPARK chain
speculation with ``speculative_algorithm="DSPARK"`` (the drafter of
``speculative_draft_model_path``, else the one shipped for the model, else a seeded untrained
one: :attr:`Engine.drafter_path` says which; per-request verify lengths with
``speculative_verify_lengths="adaptive"``); the prefix cache unless ``disable_radix_cache``
(:class:`~unimem.cache.PrefixCache` over the pool: a request resumes at the longest cached
prefix of its prompt, ``meta_info.cached_tokens`` says how many tokens it skipped;
:meth:`Engine.flush_cache` empties it); with ``tp_size`` N > 1, tensor
parallelism over N processes (:mod:`unimem.engine.distributed`: this process is rank 0 and
drives the others; each rank holds its shard of the model and its own arena). Decoding is
greedy unless a request asks for ``temperature`` > 0 (with ``top_p``, ``top_k``, ``min_p``,
``seed``: sampled on the device, see :mod:`unimem.engine.sampling`; with DSPARK, exact
speculative sampling).

``generate`` validates every request before any runs (``ValueError`` naming the field:
unknown or invalid sampling parameters, an empty prompt, a prompt past the context), then
runs them together with continuous batching and returns one dict per request, in order.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import torch

from unimem.cache import CacheStats, PrefixCache
from unimem.engine.adjustments import NEUTRAL_PENALTIES, check_penalties
from unimem.engine.adjustments import check_options as check_adjustments
from unimem.engine.args import (
    DEFAULT_CPU_MAX_RUNNING,
    DEFAULT_CUDA_MAX_RUNNING,
    EngineArgs,
    graph_buckets,
)
from unimem.engine.core import EngineCore
from unimem.engine.distributed import LeaderCore, RankProcesses, TPGroups, follow, vocab_tables
from unimem.engine.grammar import GrammarBackend, grammar_of_fields
from unimem.engine.pools import checkpoint_slots, plan_pools, tokens_for_budget
from unimem.engine.prompt_logprobs import check_options, check_top_logprobs
from unimem.engine.request import Request
from unimem.engine.sampling import SamplingOptions
from unimem.memory.spec import LayerKind
from unimem.models import batch_invariant
from unimem.models.config import memory_spec
from unimem.models.loader import load_checkpoint
from unimem.models.sampler import THRESHOLD_CHUNK_ELEMENTS
from unimem.models.tensor_parallel import SINGLE, full_config
from unimem.speculative.chain import DsparkChain
from unimem.speculative.checkpoint import load_drafter
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.speculative.shipped import shipped_drafter, untrained_drafter_warning

__all__ = ["Engine", "SamplingParams", "cache_stats"]

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens``."""

DEFAULT_MEM_FRACTION_STATIC = 0.85
"""Share of the GPU's free memory (after the weights) that KV pages and state take when
neither ``max_total_tokens`` nor ``mem_fraction_static`` is given."""

STEP_BYTES_PER_LOGIT = 32
"""Bytes per logit (``rows x vocabulary`` of the largest captured step) that the steps'
CUDA graphs may hold beside the pools: the bf16 logits, their float32 scaled copy, and in a
speculative verify the target's and the drafter's float32 distributions with the sampler's
masks and temporaries. At Gemma 3's 262 144-token vocabulary, 256 requests and a verify of 8
rows that is 17 GiB: more than the 15 % that the default ``mem_fraction_static`` leaves on an
80 GiB GPU (an H100 ran out of memory capturing the sampling graphs)."""


class StartupLaps:
    """Seconds per start-up phase, in the order they ran: :meth:`lap` closes the phase that
    ran since the previous lap (or since construction) under its name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._t, 3)
        self._t = now


def startup_line(seconds: Mapping[str, float]) -> str:
    """``start-up 52.3 s: checkpoint 40.1 s, pools 0.2 s, step loop 11.9 s (CUDA graphs
    11.2 s), warm up 0.1 s`` from :attr:`Engine.startup_seconds` (its phases in the order
    they ran; the graphs' seconds are part of the step loop's)."""
    parts = []
    for name, sec in seconds.items():
        if name == "cuda_graphs":
            continue
        part = f"{name.replace('_', ' ')} {sec:.1f} s"
        if name == "step_loop" and "cuda_graphs" in seconds:
            part += f" (CUDA graphs {seconds['cuda_graphs']:.1f} s)"
        parts.append(part)
    total = sum(sec for name, sec in seconds.items() if name != "cuda_graphs")
    return f"start-up {total:.1f} s: " + ", ".join(parts)


def step_workspace_bytes(rows: int, vocab: int) -> int:
    """What the default memory split leaves free beside the pools for a largest step of
    ``rows`` logit rows over ``vocab`` tokens (:data:`STEP_BYTES_PER_LOGIT` per logit, plus
    one chunk of the sampler's row-chunked temporaries)."""
    return rows * vocab * STEP_BYTES_PER_LOGIT + THRESHOLD_CHUNK_ELEMENTS * 36


SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "stop_token_ids",
    "min_new_tokens",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "json_schema",
    "regex",
    "ebnf",
)


class SamplingParams:
    """Validated sampling parameters of one request: ``max_new_tokens``, ``ignore_eos``,
    ``stop_token_ids`` and :class:`~unimem.engine.sampling.SamplingOptions`
    (``temperature`` 0 — the default — is greedy; ``top_p``, ``top_k`` (-1: off), ``min_p``,
    ``seed``) as ``self.sampling``; ``min_new_tokens``, ``logit_bias`` (token id, an int
    or its string, -> bias) and the penalties (``presence_penalty``, ``frequency_penalty``,
    ``repetition_penalty``) as :mod:`unimem.engine.adjustments` takes them (checked before
    submission); at most one of ``json_schema`` (a JSON schema's text), ``regex`` and
    ``ebnf`` as ``self.grammar`` (a :class:`~unimem.engine.grammar.GrammarSpec`, or None).
    ``defaults`` (the checkpoint's, see :attr:`Engine.sampling_defaults`) fill the keys the
    request leaves out or sets to None.
    ``ValueError`` naming the key."""

    def __init__(self, params: Mapping | None, defaults: Mapping | None = None) -> None:
        params = dict(params or {})
        for key in params:
            if key not in SAMPLING_KEYS:
                raise ValueError(
                    f"sampling_params: unknown key {key!r}; supported: {', '.join(SAMPLING_KEYS)}"
                )
        # the checkpoint's defaults (generation_config.json) where the request is silent
        for key, value in (defaults or {}).items():
            if params.get(key) is None:
                params[key] = value
        n = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be an int >= 0, got {n!r}")
        options = {
            key: params[key]
            for key in ("temperature", "top_p", "top_k", "min_p", "seed")
            if key in params and params[key] is not None
        }
        try:
            sampling = SamplingOptions(**options)
        except ValueError as e:
            raise ValueError(f"sampling_params.{e}") from None
        ignore_eos = params.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"sampling_params.ignore_eos must be a bool, got {ignore_eos!r}")
        stops = params.get("stop_token_ids") or []
        if not isinstance(stops, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in stops
        ):
            raise ValueError(
                f"sampling_params.stop_token_ids must be a list of ints, got {stops!r}"
            )
        bias = params.get("logit_bias") or {}
        if not isinstance(bias, Mapping):
            raise ValueError(f"sampling_params.logit_bias must be a mapping, got {bias!r}")
        try:
            bias = {int(t): v for t, v in bias.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"sampling_params.logit_bias keys must be token ids, got {list(bias)!r}"
            ) from None
        self.max_new_tokens: int = n
        self.ignore_eos: bool = ignore_eos
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self.sampling: SamplingOptions = sampling
        self.min_new_tokens = params.get("min_new_tokens") or 0
        self.logit_bias: dict[int, float] = bias
        kinds = ("json_schema", "regex", "ebnf")
        self.grammar, _ = grammar_of_fields({k: params.get(k) for k in kinds}, "sampling_params")
        self.penalties = tuple(
            params[key] if params.get(key) is not None else neutral
            for key, neutral in zip(
                ("presence_penalty", "frequency_penalty", "repetition_penalty"),
                NEUTRAL_PENALTIES,
                strict=True,
            )
        )


class Engine:
    """Offline generation over one model (module docstring). Keyword arguments are
    :class:`~unimem.engine.args.EngineArgs` (SGLang's names); an unknown or unsupported one
    raises ``ValueError`` naming it."""

    def __init__(self, **kwargs) -> None:
        self.args = args = EngineArgs.from_kwargs(**kwargs)
        self._ranks: RankProcesses | None = None
        if args.tp_size == 1:
            self._build(args, None)
            return
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but no CUDA device is available")
        topo = args.topology()
        self._ranks = RankProcesses(args.tp_size, args.device, _engine_rank, kwargs, topology=topo)
        if topo.node_rank > 0:
            self._follow_rank0(kwargs)
            return
        try:
            self._build(args, self._ranks.groups)
        except BaseException:
            self._ranks.join()
            self._ranks = None
            raise

    def _follow_rank0(self, kwargs: dict) -> None:
        """On a node other than 0: run this node's first rank (the others are spawned)
        until rank 0 shuts down; ``RuntimeError`` if a rank of this node failed."""
        ranks, self._ranks = self._ranks, None
        self.core = None
        try:
            _engine_rank(ranks.groups, kwargs)
        finally:
            failed = ranks.join()
        if failed:
            raise RuntimeError(f"tensor-parallel ranks of this node failed: {failed}")

    @classmethod
    def _on_rank(cls, args: EngineArgs, groups: TPGroups) -> Engine:
        """The engine state of a rank other than 0 (built as rank 0 builds its own)."""
        self = cls.__new__(cls)
        self.args, self._ranks = args, None
        self._build(args, groups)
        return self

    def _build(self, args: EngineArgs, groups: TPGroups | None) -> None:
        """Load this rank's model shard, size and build its memory and its step loop. With
        ``groups`` every rank calls this at once; failures are agreed on (every rank raises)
        before any collective could wait for a rank that failed."""
        device = torch.device(args.device) if groups is None else groups.device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but no CUDA device is available")
        self._owns_invariance = False
        if args.enable_deterministic_inference and not batch_invariant.enabled():
            batch_invariant.enable()  # process-wide: this engine's steps and every graph
            self._owns_invariance = True
        torch.manual_seed(args.random_seed)
        tp = groups.tensor_parallel() if groups is not None else SINGLE
        laps = StartupLaps()
        self.startup_seconds = laps.seconds
        """Seconds of each start-up phase, in order: ``checkpoint`` (reading the weights onto
        the device, conversions such as online FP8, the tokenizer), ``drafter`` (DSPARK's),
        ``pools`` (sizing and building the memory), ``step_loop`` (the scheduler and the
        runner, whose CUDA-graph captures are also given alone as ``cuda_graphs``); the
        server adds ``warm_up``. ``/get_server_info`` reports it; the server logs it."""
        error, ckpt = None, None
        try:
            ckpt = load_checkpoint(
                args.model_path,
                dtype=args.dtype,
                device=device,
                max_context=args.context_length,
                tokenizer_path=args.tokenizer_path,
                tp=tp,
                quantization=args.quantization,
            )
        except (ValueError, OSError) as e:
            error = e
        if groups is not None:
            groups.agree(error)
        elif error is not None:
            raise error
        laps.lap("checkpoint")
        self.checkpoint = ckpt
        self.model = ckpt.model
        self.tokenizer = None if args.skip_tokenizer_init else ckpt.tokenizer
        self.eos_token_ids = ckpt.eos_token_ids
        self.sampling_defaults = dict(ckpt.sampling_defaults)
        config = self.model.config
        self.grammar_backend = None
        if args.grammar_backend == "xgrammar" and ckpt.tokenizer is not None:
            self.grammar_backend = GrammarBackend(
                config.vocab_size, ckpt.eos_token_ids, tokenizer=ckpt.tokenizer
            )
            laps.lap("grammar")
        self.context_length = config.max_context
        sixteen_bit = config.dtype in (torch.bfloat16, torch.float16)
        backend_name = args.attention_backend or (
            "fa4" if device.type == "cuda" and sixteen_bit else "torch"
        )
        if backend_name == "fa4" and not sixteen_bit:
            raise ValueError(f"attention_backend fa4 needs a bf16/fp16 model, got {config.dtype}")
        # under tensor parallelism the NCCL all-reduces are recorded inside the step graphs
        cuda_graphs = (
            device.type == "cuda" and backend_name == "fa4" and not args.disable_cuda_graph
        )

        chain = None
        lanes = ()
        self.drafter_path: str | None = None
        """The drafter checkpoint in use (given, or shipped for this model); None: none, or
        the seeded untrained drafter."""
        if args.speculative_algorithm == "DSPARK":
            # the drafter is replicated on every rank: full tables, sized by the full model
            embed, lm_head = vocab_tables(self.model)
            draft_path = args.speculative_draft_model_path or shipped_drafter(
                args.model_path, self.model
            )
            self.drafter_path = None if draft_path is None else str(draft_path)
            if draft_path is not None:
                drafter = load_drafter(draft_path, self.model, shared=(embed, lm_head))
            else:
                log.warning(untrained_drafter_warning(args.gamma))
                drafter = DsparkDrafter(
                    draft_config_for(full_config(config, tp)),
                    embed,
                    lm_head,
                    seed=args.random_seed + 17,
                )
            if args.speculative_verify_lengths == "adaptive" and not drafter.config.confidence:
                raise ValueError(
                    "speculative_verify_lengths adaptive needs a drafter with a confidence "
                    f"head; the checkpoint {draft_path} has none "
                    "(retrain it with python -m unimem.training.distill, or use fixed)"
                )
            chain = DsparkChain(
                drafter,
                args.gamma,
                verify_lengths=args.speculative_verify_lengths,
                verify_budget=args.speculative_verify_budget,
                sampled_verify=args.speculative_sampling_verify,
            )
            lanes = drafter.config.lanes()
            laps.lap("drafter")
        spec = memory_spec(config, args.page_size, lanes)

        max_running = args.max_running_requests or (
            DEFAULT_CUDA_MAX_RUNNING if device.type == "cuda" else DEFAULT_CPU_MAX_RUNNING
        )
        if args.graph_cap() is not None:
            max_running = min(max_running, args.graph_cap())
        ckpt_slots = checkpoint_slots(spec, max_running, not args.disable_radix_cache)
        max_total = args.max_total_tokens
        if max_total is None:
            step_rows = max_running * (chain.verify_width if chain is not None else 1)
            workspace = step_workspace_bytes(step_rows, config.vocab_size)
            max_total = self._gpu_tokens(spec, max_running, ckpt_slots, device, workspace)
            if groups is not None:  # every rank's pools must have the same geometry
                max_total = groups.min_int(max_total)
        plan = plan_pools(spec, max_total, max_running, ckpt_slots)
        self.max_total_num_tokens = max_total
        self.max_running_requests = max_running
        pool = plan.build(args.enable_unified_memory, config.max_context, device)
        self.pool = pool
        self.cache = None
        if not args.disable_radix_cache:
            # anchors every page without STATE layers (nothing to copy); with them, every
            # checkpoint_interval_pages (each one copies a state slot): docs/prefix_cache.md
            interval = args.checkpoint_interval_pages if spec.has(LayerKind.STATE) else 1
            self.cache = PrefixCache(pool, interval)
        laps.lap("pools")
        chunk = args.chunked_prefill_size or (8192 if device.type == "cuda" else 512)
        core_args = (self.model, pool, _make_backend(backend_name), max_running, chunk)
        core_kwargs = dict(
            chain=chain,
            cache=self.cache,
            cuda_graphs=cuda_graphs,
            logprobs=True,
            random_seed=args.random_seed,
            prefill_delayer=args.prefill_delayer(),
            graph_buckets=graph_buckets(args.cuda_graph_bs, max_running),
            grammar_backend=self.grammar_backend,
        )
        if groups is not None and groups.rank == 0:
            self.core = LeaderCore(*core_args, groups=groups, **core_kwargs)
        else:
            self.core = EngineCore(*core_args, **core_kwargs)
        laps.lap("step_loop")
        if self.core.runner.capture_seconds is not None:
            self.startup_seconds["cuda_graphs"] = round(self.core.runner.capture_seconds, 3)
        self.backend_name = backend_name
        self.cuda_graphs = cuda_graphs

    def _gpu_tokens(
        self, spec, max_running: int, ckpt_slots: int, device: torch.device, workspace: int
    ) -> int:
        """KV tokens for the pools on a CUDA device: ``mem_fraction_static`` of the free
        memory; by default (no fraction given) also at most the free memory less the steps'
        ``workspace`` (:func:`step_workspace_bytes`), so that graph capture does not run out
        of memory where the vocabulary and the verify width make the steps large. A fraction
        the user gives is kept, with a warning when it leaves less than ``workspace``."""
        from unimem.engine.args import DEFAULT_CPU_MAX_TOTAL_TOKENS

        if device.type != "cuda":
            return DEFAULT_CPU_MAX_TOTAL_TOKENS
        free, _ = torch.cuda.mem_get_info(device)
        given = self.args.mem_fraction_static
        budget = int(free * (given or DEFAULT_MEM_FRACTION_STATIC))
        gib = 2**30
        if given is None and free - workspace < budget:
            budget = free - workspace
            log.info(
                "KV pools take %.1f GiB of %.1f GiB free: %.1f GiB stay for the steps' "
                "vocabulary-sized buffers (mem_fraction_static sets the split)",
                budget / gib, free / gib, workspace / gib,
            )  # fmt: skip
            if budget <= 0:
                raise ValueError(
                    f"the steps' vocabulary-sized buffers need about {workspace / gib:.1f} GiB "
                    f"and {free / gib:.1f} GiB are free: lower max_running_requests or "
                    f"cuda_graph_max_bs (or the verify width)"
                )
        elif given is not None and free - budget < workspace:
            log.warning(
                "mem_fraction_static %.2f leaves %.1f GiB beside the KV pools; the steps may "
                "need about %.1f GiB (out of memory at graph capture: lower it)",
                given, (free - budget) / gib, workspace / gib,
            )  # fmt: skip
        return tokens_for_budget(spec, budget, max_running, ckpt_slots)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: Mapping | Sequence[Mapping] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> dict | list[dict]:
        """Generate for one prompt (a string or a list of token ids: returns a dict) or a
        batch (a list of either: returns a list of dicts, in order). ``sampling_params``: one
        dict for all, or one per request. Each result has ``text``, ``output_ids`` and
        ``meta_info`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, with chain
        speculation ``spec_verify_ct`` and ``spec_accept_length`` (committed tokens per verify
        step),
        ``finish_reason`` as ``{"type": "stop", "matched": id}`` or ``{"type": "length",
        "length": n}``, and with ``return_logprob`` ``output_token_logprobs``: a
        ``(logprob, token_id, None)`` triple per output token; with ``logprob_start_len`` >= 0
        also ``input_token_logprobs``, the prompt's from that position (position 0's logprob
        None; :mod:`unimem.engine.prompt_logprobs`), and with ``top_logprobs_num`` k > 0
        (at most 20) ``output_top_logprobs`` and ``input_top_logprobs``: the k most likely
        tokens at each output / scored prompt position, as triples, most likely first (None
        where not scored). SGLang's arguments)."""
        if self.core is None:
            raise ValueError("this engine ran the ranks of node_rank > 0: generate on node 0")
        prompts, single = self._prompts(prompt, input_ids)
        params = self._params(sampling_params, len(prompts))
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError(
                f"logprob_start_len must be -1 (output tokens only) or a prompt position, "
                f"got {logprob_start_len!r}"
            )
        start = logprob_start_len if return_logprob and logprob_start_len >= 0 else None
        top = top_logprobs_num if return_logprob else 0
        for i, ids in enumerate(prompts):
            self._check_request(i, ids, params[i])
            try:
                check_options(len(ids), start, top if start is not None else 0)
                check_top_logprobs(top, engine_logprobs=True)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        reqs = [self._submit(ids, p, start, top) for ids, p in zip(prompts, params, strict=True)]
        self.core.run()
        outs = [
            self._result(r, return_logprob, discard=p.max_new_tokens == 0)
            for r, p in zip(reqs, params, strict=True)
        ]
        return outs[0] if single else outs

    def _prompts(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "prompt needs a tokenizer (the checkpoint has none): pass input_ids"
                )
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not texts or any(not isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            return [self.tokenizer.encode(t) for t in texts], single
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids or of lists of them")
        single = not isinstance(input_ids[0], (list, tuple))
        batch = [input_ids] if single else list(input_ids)
        for i, ids in enumerate(batch):
            if not isinstance(ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in ids
            ):
                raise ValueError(f"input_ids[{i}] must be a list of ints")
        return [list(ids) for ids in batch], single

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        defaults = self.sampling_defaults
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {n} prompts"
                )
            return [SamplingParams(p, defaults) for p in sampling_params]
        return [SamplingParams(sampling_params, defaults)] * n

    def _check_request(self, i: int, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError(f"request {i}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]} outside the vocabulary [0, {vocab})")
        total = len(ids) + max(params.max_new_tokens, 1)
        if total > self.context_length:
            raise ValueError(
                f"request {i}: prompt {len(ids)} + max_new_tokens {params.max_new_tokens} "
                f"tokens exceed the context length {self.context_length}"
            )
        self.core.check_request(ids, max(params.max_new_tokens, 1))
        self.core.check_sampling(params.sampling)
        try:
            n = params.max_new_tokens
            check_adjustments(params.logit_bias, params.min_new_tokens, n, vocab)
            check_penalties(*params.penalties)
            if params.grammar is not None:
                self.core.grammar_state(params.grammar)  # compiles it (cached) or says why not
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None

    def _submit(
        self, ids: list[int], params: SamplingParams, start: int | None = None, top: int = 0
    ) -> Request:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        scored = {} if start is None else dict(prompt_logprobs_from=start, prompt_top_logprobs=top)
        return self.core.submit(
            ids,
            max(params.max_new_tokens, 1),  # 0 (a prefill): one sampled, left out (_result)
            stop_token_ids=stops,
            sampling=params.sampling,
            top_logprobs=top,
            logit_bias=params.logit_bias,
            min_tokens=params.min_new_tokens,
            presence_penalty=params.penalties[0],
            frequency_penalty=params.penalties[1],
            repetition_penalty=params.penalties[2],
            grammar=params.grammar,
            **scored,
        )

    def _result(self, req: Request, return_logprob: bool, discard: bool = False) -> dict:
        """SGLang's result of ``req``; ``discard``: it asked for 0 output tokens (its one
        sampled token is left out, finish reason length 0)."""
        if discard:
            req = dataclasses.replace(req, output=[], output_logprobs=[], output_top_logprobs=[])
            req.stopped = False
        if req.finish_reason == "stop":
            finish = {"type": "stop", "matched": req.output[-1]}
        else:
            finish = {"type": "length", "length": len(req.output)}
        meta = {
            "id": str(req.rid),
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "cached_tokens": req.cached_tokens,
            "finish_reason": finish,
        }
        if req.verify_steps:  # chain speculation (SGLang's name for the verify count)
            meta["spec_verify_ct"] = req.verify_steps
            meta["spec_accept_length"] = req.verified_tokens / req.verify_steps
        if return_logprob:
            meta["output_token_logprobs"] = [
                (lp, tok, None) for lp, tok in zip(req.output_logprobs, req.output, strict=True)
            ]
        if req.top_logprobs_k:
            meta["output_top_logprobs"] = [
                [(lp, i, None) for i, lp in alts] for alts in req.output_top_logprobs
            ]
        start = req.prompt_logprobs_from
        if start is not None:
            span = range(start, len(req.prompt))
            meta["input_token_logprobs"] = [
                (req.prompt_logprobs[j], req.prompt[j], None) for j in span
            ]
            if req.prompt_top_logprobs_k:
                tops = [req.prompt_top_logprobs[j] for j in span]
                meta["input_top_logprobs"] = [
                    None if t is None else [(lp, i, None) for i, lp in t] for t in tops
                ]
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output, skip_special_tokens=True)
        return {"text": text, "output_ids": list(req.output), "meta_info": meta}

    def warm_up(self) -> dict:
        """Run every kind of step once before the first real request, so that no request
        pays for what compiles on first use (on a GPU: the kernel variants that the
        start-up's graph captures do not run, such as the extend step's FA4 prefill and its
        sampler; SGLang's server sends a warm-up request for the same reason). Three
        requests of a page and a few tokens of prompt (fixed ids, ``<eos>`` ignored): greedy
        alone first (an extend, then decode or verify steps), then beside it two sampled
        ones (temperature 0.7 with top-k 64 / top-p 0.95 and log-probabilities, and
        temperature 1 unfiltered), the first sharing the greedy one's prompt as a prefix (an
        extend over a cached prefix where the cache is on). Afterwards the engine is as it
        was: the prefix cache empty with its counters at zero (with ``tp_size`` > 1, where
        the cache cannot be flushed, it keeps the warm-up's prompt) and request ids numbered
        from 0 again on every rank, so what users get (seedless sampled requests included)
        is what they would have got without the warm-up. Returns ``{"seconds", "requests",
        "tokens"}``. ``ValueError`` while requests are queued or running, or on node
        ranks > 0."""
        if self.core is None:
            raise ValueError("this engine ran the ranks of node_rank > 0: warm up on node 0")
        if not self.core.scheduler.idle:
            raise ValueError("warm_up: requests are queued or running")
        t0 = time.perf_counter()
        gamma = self.core.chain.gamma if self.core.chain else 0
        # prompt + output tokens a request may hold here (a tiny context shrinks the warm-up)
        room = min(self.core.max_request_tokens(), self.context_length) - 1
        new = max(1, min(2 * (gamma + 1) + 2, room // 2))  # past the first verify if it fits
        more = 3 if room - new >= 4 else 0  # the sampled request's tokens past the prefix
        length = max(1, min(self.pool.page_size + 5, room - new - more))
        vocab = self.model.config.vocab_size
        prompt = [(7 + 31 * i) % vocab for i in range(length)]
        greedy = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0.0}
        done = [self.generate(input_ids=prompt, sampling_params=greedy)]
        extended = prompt + [(11 + 17 * i) % vocab for i in range(more)]
        sampled = [
            {**greedy, "temperature": 0.7, "top_k": 64, "top_p": 0.95, "seed": 1},
            {**greedy, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": 2},
        ]
        done += self.generate(
            input_ids=[extended, prompt], sampling_params=sampled, return_logprob=True
        )
        if self.cache is not None and self._ranks is None:
            self.flush_cache()
            self.cache.stats = CacheStats()
        self.core.restart_request_ids()  # with tp_size > 1 on every rank (LeaderCore)
        tokens = sum(len(o["output_ids"]) for o in done)
        return {"seconds": time.perf_counter() - t0, "requests": len(done), "tokens": tokens}

    def flush_cache(self) -> bool:
        """Drop everything the prefix cache holds (SGLang's ``flush_cache``): its pages,
        windows and checkpoints go back to the pool. Only while no request is queued or
        running (False then, and nothing changes); True when flushed (or there is no cache).
        ``ValueError`` with ``tp_size`` > 1 (the other ranks' caches would not follow)."""
        if not self.core.scheduler.idle:
            return False
        if self.cache is not None:
            if self._ranks is not None:
                raise ValueError("flush_cache is not supported with tp_size > 1")
            self.cache.flush()
        return True

    def cache_stats(self) -> dict | None:
        """:func:`cache_stats` of this engine's step loop."""
        return cache_stats(self.core)

    def get_server_info(self) -> dict:
        """Capacity and memory use: ``max_total_num_tokens``, ``max_running_requests``,
        ``context_length``, the memory mode, the pool's used / capacity bytes (what the
        prefix cache holds included), the cache's statistics (``prefix_cache``) and the
        start-up's phases (``startup_seconds``)."""
        stats = self.pool.stats
        return {
            "model_path": self.args.model_path,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_length,
            "enable_unified_memory": self.args.enable_unified_memory,
            "attention_backend": self.backend_name,
            "cuda_graphs": self.cuda_graphs,
            "enable_deterministic_inference": self.args.enable_deterministic_inference,
            "tp_size": self.args.tp_size,
            "used_bytes": self.pool.used_bytes(),
            "capacity_bytes": stats.capacity_bytes,
            "disable_radix_cache": self.args.disable_radix_cache,
            "prefix_cache": self.cache_stats(),
            "enable_prefill_delayer": self.args.enable_prefill_delayer,
            "startup_seconds": dict(self.startup_seconds),
        }

    def shutdown(self) -> None:
        """Release the model and the memory (and end the other ranks' processes)."""
        if self._ranks is not None:
            self.core.stop()
            self._ranks.join()
            self._ranks = None
        self.core = None
        self.cache = None
        self.pool = None
        self.model = None
        if getattr(self, "_owns_invariance", False):
            batch_invariant.disable()
            self._owns_invariance = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def cache_stats(core: EngineCore) -> dict | None:
    """The prefix cache of ``core``: its counters and gauges (:class:`~unimem.cache.CacheStats`:
    lookups, hit tokens, hit rate, cached pages, checkpoints, evictions, ...), the tokens its
    pages hold (``cached_tokens``), its checkpoint interval in pages and the scheduler's
    flushes under memory pressure; None when the cache is off."""
    cache = core.cache
    if cache is None:
        return None
    return {
        **cache.stats.as_dict(),
        "cached_tokens": cache.stats.cached_pages * cache.page_size,
        "checkpoint_interval_pages": cache.checkpoint_interval,
        "pressure_flushes": core.scheduler.cache_flushes,
    }


def _engine_rank(groups: TPGroups, kwargs: dict) -> None:
    """A spawned rank of a tensor-parallel ``Engine``: build its engine state, then follow
    rank 0's steps until it shuts down."""
    engine = Engine._on_rank(EngineArgs.from_kwargs(**kwargs), groups)
    follow(engine.core, groups)


def _make_backend(name: str):
    if name == "fa4":
        from unimem.attention.fa4_backend import FA4Backend

        return FA4Backend()
    from unimem.attention.torch_backend import TorchReferenceBackend

    return TorchReferenceBackend()
