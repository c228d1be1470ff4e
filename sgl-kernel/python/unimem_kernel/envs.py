"""Every ``UNIMEM_*`` environment switch, in one registry.

The switches live here, in the lowest package, so that kernels and the engine read them the
same way: ``envs.get("UNIMEM_FUSED_OPS")`` returns the parsed value (the default when unset)
and raises ``ValueError`` naming the switch and its accepted values when the environment
holds something else. A switch is read at each call, not cached: tests and benchmarks set
them per run. ``python -m unimem envs`` (or :func:`describe`) lists them with their docs.

Adding a switch: one :class:`EnvSwitch` in :data:`SWITCHES`; nothing else reads
``os.environ`` for a ``UNIMEM_*`` name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SWITCHES", "EnvSwitch", "cache_root", "describe", "get", "is_set"]


@dataclass(frozen=True)
class EnvSwitch:
    """One switch: its name, default (the value when unset or empty), the accepted values
    (``choices``; ``None``: any string that ``parse`` accepts), a parser from the string
    to the value, and what it does."""

    name: str
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] = str

    def read(self) -> Any:
        raw = os.environ.get(self.name, "")
        if raw == "":
            return self.default
        if self.choices is not None and raw not in self.choices:
            *head, last = self.choices
            accepted = f"{', '.join(head)} or {last}" if head else last
            raise ValueError(f"{self.name} must be {accepted}, got {raw!r}")
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r} is not valid: {e}") from None


def _flag(raw: str) -> bool:
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError("expected 1/0, true/false, on/off or yes/no")


def _pdl_mode(raw: str) -> int:
    if raw == "early":
        return 2
    try:
        return int(_flag(raw))
    except ValueError:
        raise ValueError("expected early, or 1/0, true/false, on/off, yes/no") from None


def _positive_float(raw: str) -> float:
    v = float(raw)
    if not v > 0:
        raise ValueError("expected a positive number of seconds")
    return v


def _row_count(raw: str) -> int:
    v = int(raw)
    if v < 0:
        raise ValueError("expected a row count >= 0")
    return v


def _rows_limit(raw: str) -> int:
    v = int(raw)
    if not 0 <= v <= 64:
        raise ValueError("expected a row count from 0 to 64")
    return v


_ALL = (
    # kernels (unimem_kernel)
    EnvSwitch(
        "UNIMEM_KERNEL_BACKEND",
        "auto",
        "Which implementation every op runs: auto (Triton on CUDA tensors, the torch "
        "reference elsewhere), triton (also on the CPU: with TRITON_INTERPRET=1 the "
        "interpreter, small sizes only) or reference (the torch reference everywhere).",
        choices=("auto", "triton", "reference"),
    ),
    EnvSwitch(
        "UNIMEM_TOP_VALUES",
        "chunked",
        "How the sampler's bounded cut-off takes its 256 largest logits a row: chunked (the "
        "select by chunk maxima, unimem_kernel.top_values, its maxima from the Triton kernel "
        "unimem_kernel.chunk_maxima on CUDA), amax (the same select with torch's amax for the "
        "maxima, to measure it) or topk (one torch.topk over the whole row, to measure it).",
        choices=("chunked", "amax", "topk"),
    ),
    EnvSwitch(
        "UNIMEM_FUSED_OPS",
        "on",
        "off: the fused norm/RoPE/activation ops run their torch reference even on CUDA "
        "(to measure or bisect the fusion).",
        choices=("on", "off"),
    ),
    EnvSwitch(
        "UNIMEM_FP8_GEMM_CONFIG",
        "",
        "Force one FP8 GEMM tile for every shape (the Fp8GemmConfig.parse format); unset: "
        "the tuned table, else the default by rows.",
    ),
    EnvSwitch(
        "UNIMEM_FP8_ACT_QUANT",
        "separate",
        "Where FP8 activations are quantised: separate (a launch of its own) or fused "
        "(inside the GEMM; Triton on a GPU only).",
        choices=("separate", "fused"),
    ),
    EnvSwitch(
        "UNIMEM_FP8_SPLIT_SUM",
        "auto",
        "Who sums the Triton FP8 GEMM's split-K partials: kernel (the last of a tile's "
        "programs to finish; no second launch), separate (a launch of its own), or auto "
        "(kernel from fp8_gemm.SPLIT_SUM_MIN_RUNS runs on, where it measured faster); the "
        "same bits either way.",
        choices=("auto", "kernel", "separate"),
    ),
    EnvSwitch(
        "UNIMEM_FP8_GEMV_ROWS",
        1,
        "Most rows for which a dense FP8 linear runs unimem_kernel.fp8_gemv (one launch on the "
        "CUDA cores, the activation quantised inside) instead of the quantisation launch and "
        "the tensor-core GEMM; 0: never. Not under deterministic inference.",
        parse=_rows_limit,
    ),
    EnvSwitch(
        "UNIMEM_FP8_GEMV_PAIRS",
        16,
        "Most (token, expert) rows for which the routed experts' FP8 products run "
        "unimem_kernel.fp8_gemv; 0: never. Not under deterministic inference.",
        parse=_row_count,
    ),
    EnvSwitch(
        "UNIMEM_FP8_GEMV_CONFIG",
        "",
        "Force one fp8_gemv tile ('BN,G,warps,stages': weight rows per program, groups of 128 "
        "columns per step); unset: sized by the product (fp8_gemv.fp8_gemv_config).",
    ),
    EnvSwitch(
        "UNIMEM_FP8_LT_MIN_ROWS",
        None,
        "Fewest rows for which a dense FP8 linear with a block table runs on cuBLASLt's "
        "block-scaled GEMM (torch._scaled_mm) instead of the Triton kernel, on SM90 and "
        "outside deterministic inference (unimem_kernel.fp8_gemm.use_lt), for every weight "
        "shape; unset: by shape, fp8_gemm.lt_min_rows (128 rows for N >= 8192, 256 for "
        "N >= 1024, never below).",
        parse=_row_count,
    ),
    EnvSwitch(
        "UNIMEM_NORM_LINEAR_CONFIG",
        "",
        "Force one norm_linear tile for every shape ('BN,BK,warps,stages'); unset: the "
        "tuned table, else the default.",
    ),
    EnvSwitch(
        "UNIMEM_MOE_GEMM",
        "auto",
        "The grouped expert GEMM: auto (by rows per expert), triton (the project's tiles) "
        "or vendor (torch._grouped_mm).",
        choices=("auto", "triton", "vendor"),
    ),
    # models and engine (unimem)
    EnvSwitch(
        "UNIMEM_GDN_CHUNKED_PREFILL",
        "auto",
        "How Gated DeltaNet layers extend on prefill: auto (by cost), fla, triton "
        "(the project's chunked kernel) or off (the recurrent kernel).",
        choices=("auto", "fla", "triton", "off"),
    ),
    EnvSwitch(
        "UNIMEM_EXTEND_GRAPHS",
        "auto",
        "Short extend steps (at most 8 requests and 256 tokens, models without "
        "recurrent-state layers) run padded to a (requests, "
        "tokens) bucket, recorded as CUDA graphs at start-up with the runner's other steps "
        "(engine.runner: padded extend), deterministic mode included (a padded extend gives "
        "the ragged one's bits there). auto: where the runner records CUDA graphs; on: also "
        "eager (the CPU tests of the padded path); off: extends stay ragged and eager. "
        "One extend of Gemma 3 270M on an H100: 17.7 ms eager, 2.0 ms recorded "
        "(docs/results.md).",
        choices=("auto", "on", "off"),
    ),
    EnvSwitch(
        "UNIMEM_NORM_LINEAR_ROWS",
        1,
        "Steps of at most this many rows run a layer's norms, projections and gated "
        "activation as norm_linear launches (Gemma 3's layers; the synthetic hybrid model's "
        "MLP; 0: never; at most 64). Default 1: faster than the launches it replaces at one "
        "row, slower at 8-16 on the H200 (Gemma 3).",
        parse=_rows_limit,
    ),
    EnvSwitch(
        "UNIMEM_NORM_LINEAR_PLAIN",
        True,
        "Whether those steps also take norm_linear for the projections with no norm in "
        "front (attention output, MLP down); off: the vendor GEMM.",
        parse=_flag,
    ),
    EnvSwitch(
        "UNIMEM_PDL",
        2,
        "Programmatic dependent launch for a small decode step's Triton kernels (norm_linear, "
        "the RoPE + K/V store, the split-KV attention and its combine) on SM90+: each waits "
        "for its predecessor before reading what it wrote; early (default): the successor may "
        "launch once a kernel has waited; 1: once it has stored; 0: plain launches "
        "(unimem_kernel.pdl; Triton 3.3+, off by default with an older one). Gemma 3 270M "
        "at one request on an H100: 1 310 / 1 375 / 1 566 tok/s for 0 / 1 / early, the "
        "same tokens.",
        parse=_pdl_mode,
    ),
    EnvSwitch(
        "UNIMEM_CACHE_DIR",
        "",
        "Where converted GGUF checkpoints (gguf/) and FA4's compiled kernels (fa4/) are "
        "cached; unset: $XDG_CACHE_HOME/unimem or ~/.cache/unimem.",
    ),
    EnvSwitch(
        "UNIMEM_TP_CHECK_STATE",
        False,
        "1: after every step each tensor-parallel rank checks that its allocator state "
        "equals rank 0's (debug; it synchronises).",
        parse=_flag,
    ),
    EnvSwitch(
        "UNIMEM_TP_TIMEOUT_S",
        86400.0,
        "Seconds a tensor-parallel collective may wait (idle ranks wait for rank 0's next "
        "step in a broadcast).",
        parse=_positive_float,
    ),
    EnvSwitch(
        "UNIMEM_DP_START_TIMEOUT_S",
        1800.0,
        "Seconds `launch_server --dp-size N` waits for every replica to become healthy.",
        parse=_positive_float,
    ),
)

SWITCHES: dict[str, EnvSwitch] = {s.name: s for s in _ALL}


def _switch(name: str) -> EnvSwitch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered UNIMEM_* switch (unimem_kernel.envs)") from None


def get(name: str) -> Any:
    """The parsed value of switch ``name`` now (its default when unset or empty)."""
    return _switch(name).read()


def cache_root() -> Path:
    """Where unimem keeps what it builds once and reuses (``UNIMEM_CACHE_DIR``; unset:
    ``$XDG_CACHE_HOME/unimem``, else ``~/.cache/unimem``). Not created here."""
    env = get("UNIMEM_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "unimem"


def is_set(name: str) -> bool:
    """Whether the environment gives switch ``name`` a non-empty value."""
    return os.environ.get(_switch(name).name, "") != ""


def describe() -> str:
    """Every switch, its default and its doc, one paragraph each (for ``unimem envs``)."""
    lines = []
    for s in _ALL:
        choices = f" [{'|'.join(s.choices)}]" if s.choices else ""
        lines.append(f"{s.name}{choices} (default {s.default!r})\n    {s.doc}")
    return "\n".join(lines)
