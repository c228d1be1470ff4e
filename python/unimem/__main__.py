"""Command line: ``python -m unimem validate ...``, ``python -m unimem bench [SUITE] ...``
(the suites are :mod:`unimem.bench`'s, ``e2e`` the default) and ``python -m unimem envs``
(every ``UNIMEM_*`` switch with its default and doc); see ``--help``.

Errors a user can make — a count that is not positive, an arena size that is not a finite
positive number, an output path (``--json``, ``--plot``) that cannot be written (checked
before the run starts), a flag that only applies with another one, ``--plot`` without
matplotlib — end the command with one line on stderr and exit status 2, never a traceback.
Ctrl-C stops it with one line and exit status 130.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from unimem.bench import DEFAULT_SUITE, SUITES, run_suite
from unimem.models.model_path import ModelNotInstalled
from unimem.models.presets import preset_names
from unimem.validate.config import BENCH_MODEL, PACKAGE_PROMPTS
from unimem.validate.protocol import (
    BACKENDS,
    SPEC_MODES,
    ValidateConfig,
    bench,
    bench_config,
    validate,
)
from unimem.validate.report import format_table, passed, write_json
from unimem_kernel import envs


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m unimem")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser(
        "validate",
        help="run the same requests through static and unified memory and compare outputs",
    )
    _add_run_args(v, ValidateConfig())
    b = sub.add_parser(
        "bench",
        help="measurements: the validation protocol at serving sizes on one GPU, with the "
        f"unified/static throughput ratio (suite e2e, the default: {BENCH_MODEL} with its "
        "drafter, 48 real prompts -> 2048 tokens, DSPARK gamma 7), or another suite",
        usage="python -m unimem bench [SUITE] [FLAGS]",
        description=_bench_suites_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_args(b, bench_config(), bench=True)
    sub.add_parser("envs", help="list every UNIMEM_* environment switch, its default and doc")
    return p


def _bench_suites_text() -> str:
    lines = ["suites (python -m unimem bench SUITE --help for a suite's flags):"]
    lines += [f"  {name:<14}{text}" for name, (_, text) in SUITES.items()]
    return "\n".join(lines + ["", "The flags below are the e2e suite's."])


def _add_run_args(v: argparse.ArgumentParser, d: ValidateConfig, bench: bool = False) -> None:
    v.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    real = (
        f" (default: the real model {BENCH_MODEL} with its shipped drafter on the package's "
        f"real prompts, the acceptance control off; --preset {d.preset} for the synthetic one)"
        if bench
        else f" (default {d.preset})"
    )
    v.add_argument(
        "--preset",
        default=None if bench else d.preset,
        help=f"synthetic model preset: {', '.join(preset_names())}; ignored with --model-path"
        + real,
    )
    v.add_argument(
        "--model-path",
        default=d.model_path,
        help="a HuggingFace checkpoint directory (config.json, safetensors, tokenizer), a .gguf "
        "file, or gemma-3-270m (the embedded model, extra 'model') to run instead of a preset",
    )
    v.add_argument(
        "--dtype",
        default=None,
        help="with --model-path: auto (the checkpoint's; float32 runs in bfloat16 on cuda), "
        "bfloat16, float16, float32 or float64",
    )
    v.add_argument(
        "--prompts",
        dest="prompts_file",
        default=d.prompts_file,
        metavar="FILE",
        help="with --model-path: one text prompt per line (or a .json list of prompts), encoded "
        f"by its tokenizer, or {PACKAGE_PROMPTS!r}: the package's real prompts (default: random "
        "token ids; bench's default model: the real prompts)",
    )
    v.add_argument(
        "--oracle",
        choices=["none", "transformers"],
        default=d.oracle,
        help="transformers: also run the prompts through transformers' generate on the same "
        "checkpoint and compare tokens and log-probabilities",
    )
    v.add_argument("--requests", type=int, default=d.requests)
    v.add_argument("--input-len", type=int, default=d.input_len)
    v.add_argument("--output-len", type=int, default=d.output_len)
    v.add_argument("--seed", type=int, default=d.seed)
    v.add_argument("--page-size", type=int, default=d.page_size)
    v.add_argument(
        "--arena-mb",
        type=float,
        default=d.arena_mb,
        help="unified arena size (default: the static pools' bytes); small values force "
        "compaction and retraction",
    )
    v.add_argument("--max-running", type=int, default=d.max_running)
    v.add_argument("--chunk-size", type=int, default=d.chunk_size, help="prefill tokens per step")
    v.add_argument(
        "--backend",
        choices=BACKENDS,
        default=d.backend,
        help="attention backend (auto: fa4 on cuda for a 16-bit preset, else the torch reference)",
    )
    v.add_argument(
        "--cuda-graphs",
        choices=["auto", "on", "off"],
        default=d.cuda_graphs,
        help="replay decode/verify steps as CUDA graphs (auto: on with cuda and fa4)",
    )
    v.add_argument(
        "--spec",
        choices=SPEC_MODES,
        default=d.spec,
        help="decode by DSPARK chain speculation (dspark) or one token per step (none)",
    )
    v.add_argument(
        "--gamma",
        type=int,
        default=None,
        help=f"drafted tokens per verify step (default {d.gamma})",
    )
    on_checkpoint = "; bench on a checkpoint: 0" if bench else ""
    v.add_argument(
        "--accept-rate",
        type=float,
        default=None,
        help="acceptance control: replace each drafted token by the non-speculative "
        f"continuation with this probability (seeded; 0 = the raw drafter; default "
        f"{d.accept_rate}{on_checkpoint})",
    )
    v.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="fp8: block-wise FP8 weights (quantised at load; the synthetic presets' "
        "projections too) with per-token-group FP8 activations; an FP8 checkpoint runs in "
        "FP8 without it",
    )
    det = v.add_mutually_exclusive_group()
    det.add_argument(
        "--enable-deterministic-inference",
        dest="deterministic",
        action="store_const",
        const="on",
        help="batch-invariant kernels: a request's tokens do not depend on its batch, the "
        "bucket or the step kind (SGLang's flag; on by default for validate --device cuda)",
    )
    det.add_argument(
        "--disable-deterministic-inference",
        dest="deterministic",
        action="store_const",
        const="off",
        help="the vendor kernels (validate --device cuda turns batch invariance on otherwise)",
    )
    v.add_argument(
        "--control-reference",
        choices=["decode", "speculative"],
        default=None,
        help="what the acceptance control replaces drafts with: the non-speculative output "
        "(decode) or that of a speculative run without replacement (speculative: keeps the "
        "acceptance on long bf16 outputs, where decode and verify kernels break near-ties "
        f"differently; default {d.control_reference})",
    )
    v.add_argument(
        "--speculative-draft-model-path",
        metavar="DIR",
        default=None,
        help="with --spec dspark: a drafter checkpoint directory (config.json, "
        "model.safetensors; e.g. from python -m unimem.training.distill) instead of the "
        "seeded drafter",
    )
    v.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --spec dspark and the seeded drafter: its layers, alternating FULL and SWA "
        "hosts (an odd count makes FULL and SWA pages of unequal sizes; default "
        f"{d.draft_layers})",
    )
    v.add_argument(
        "--verify-lengths",
        choices=["fixed", "adaptive"],
        default=None,
        help="with --spec dspark: verify gamma + 1 tokens per request (fixed), or choose each "
        "request's length on the device from the drafter's confidence head under "
        f"--speculative-verify-budget (adaptive; default {d.verify_lengths})",
    )
    v.add_argument(
        "--speculative-verify-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="with --verify-lengths adaptive: tokens verified per step over the batch "
        "(default: batch size x (gamma + 1), no cut)",
    )
    v.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="sample every request at this temperature (0: greedy; > 0 with --spec dspark: "
        "speculative sampling, and speculative vs non-speculative is not compared)",
    )
    v.add_argument(
        "--top-p",
        type=float,
        default=None,
        help=f"with --temperature > 0: nucleus sampling mass (default {d.top_p})",
    )
    v.add_argument(
        "--tp-size",
        type=int,
        default=d.tp_size,
        help="tensor parallelism: run every rank of the protocol in its own process (one GPU "
        "each on cuda, gloo on cpu) on its shard of the model; rank 0 reports",
    )
    v.add_argument(
        "--nnodes",
        type=int,
        default=d.nnodes,
        help="with --tp-size: the ranks spread evenly over this many machines",
    )
    v.add_argument(
        "--node-rank",
        type=int,
        default=d.node_rank,
        help="with --nnodes: this machine's index (0 reports; the others run their ranks)",
    )
    v.add_argument(
        "--dist-init-addr",
        default=d.dist_init_addr,
        help="with --nnodes: HOST:PORT of node 0, where the ranks meet",
    )
    v.add_argument(
        "--prefix-cache",
        choices=["on", "off"],
        default="on" if d.prefix_cache else "off",
        help="prefix cache over both memories (on: also a cache-off run to compare against)",
    )
    v.add_argument(
        "--shared-prefix-len",
        type=int,
        default=d.shared_prefix_len,
        help="the first L prompt tokens are the same in every request (L <= --input-len)",
    )
    v.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        help="with --prefix-cache on: prefix-cache anchors (state checkpoints) every this many "
        f"pages (default {d.checkpoint_interval})",
    )
    v.add_argument(
        "--repeats",
        type=int,
        default=d.repeats,
        help="run static and unified this many times each, in ABBA order; throughputs are "
        "the means (every run is also checked for identical outputs)",
    )
    v.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads with --device cpu (default 1: the CPU presets' ops are "
        "too small to gain from more, and contended threads slow them down many times)",
    )
    v.add_argument("--json", metavar="PATH", help="write the report as JSON (- for stdout)")
    v.add_argument(
        "--plot",
        metavar="PATH",
        help="draw the bytes in use per kind per step, static vs unified, into PATH "
        "(.png, .svg or .pdf; needs matplotlib: pip install 'unimem[plot]')",
    )
    v.set_defaults(_defaults=d)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in SUITES:
            if argv[1] != DEFAULT_SUITE:
                return run_suite(argv[1], argv[2:])
            argv = ["bench", *argv[2:]]
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "envs":
        print(envs.describe())
        return 0
    try:
        _check_flags(args)
        cfg = _config(args)
        if args.plot:
            from unimem.validate import plot

            plot.check_plot_path(args.plot)
            plot.require_matplotlib()
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path and path != "-":
                _check_writable(flag, path)
        if cfg.device == "cpu":
            torch.set_num_threads(args.cpu_threads or 1)
        if args.command == "bench":
            report = bench(cfg, progress=True)
        else:
            report = validate(cfg, progress=True)
    except ModelNotInstalled as e:
        hint = " (or --preset small: the synthetic model)" if args.command == "bench" else ""
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:
        print(f"error: out of device memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if cfg.node_rank > 0:  # node 0 reports
        print(f"node {cfg.node_rank}: ranks done")
        return 0
    if args.json != "-":
        print(format_table(report))
    try:
        if args.json:
            write_json(report, args.json)
        if args.plot:
            plot.memory_figure(report, args.plot)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # bench: static vs unified must agree exactly; speculative vs non-speculative flips are
    # reported (bf16 near-ties; margins of the first few only) but do not fail it.
    return 0 if passed(report, spec_vs_reference=args.command == "validate") else 1


_NEEDS = (
    # (flag, attribute, needed flag, whether it is given)
    ("--gamma", "gamma", "--spec dspark", lambda a: a.spec != "none"),
    ("--accept-rate", "accept_rate", "--spec dspark", lambda a: a.spec != "none"),
    ("--control-reference", "control_reference", "--spec dspark", lambda a: a.spec != "none"),
    (
        "--speculative-draft-model-path",
        "speculative_draft_model_path",
        "--spec dspark",
        lambda a: a.spec != "none",
    ),
    (
        "--checkpoint-interval",
        "checkpoint_interval",
        "--prefix-cache on",
        lambda a: a.prefix_cache == "on",
    ),
    ("--dtype", "dtype", "--model-path", lambda a: a.model_path is not None),
    ("--cpu-threads", "cpu_threads", "--device cpu", lambda a: a.device == "cpu"),
    ("--top-p", "top_p", "--temperature > 0", lambda a: a.temperature > 0),
    ("--verify-lengths", "verify_lengths", "--spec dspark", lambda a: a.spec != "none"),
    ("--draft-layers", "draft_layers", "--spec dspark", lambda a: a.spec != "none"),
    (
        "--speculative-verify-budget",
        "speculative_verify_budget",
        "--verify-lengths adaptive",
        lambda a: a.verify_lengths == "adaptive",
    ),
)


def _check_flags(args: argparse.Namespace) -> None:
    """``ValueError`` for a flag given without the flag it applies with, or a bad count
    that only the command line has (``--cpu-threads``); then fill in the defaults. bench
    without ``--preset`` or ``--model-path`` runs :data:`BENCH_MODEL` on the package's real
    prompts; bench on a checkpoint measures the raw drafter (``--accept-rate`` 0) unless
    told otherwise."""
    d = args._defaults
    if args.command == "bench" and args.preset is None and args.model_path is None:
        args.model_path = BENCH_MODEL
        if args.prompts_file is None:
            args.prompts_file = PACKAGE_PROMPTS
    if args.preset is None:
        args.preset = d.preset
    if args.command == "bench" and args.model_path is not None and args.accept_rate is None:
        args.accept_rate = 0.0
    for flag, attr, needed, given in _NEEDS:
        if getattr(args, attr) is not None and not given(args):
            raise ValueError(f"{flag} only applies with {needed}")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads must be an int >= 1, got {args.cpu_threads}")
    if args.deterministic is None:  # validate: auto (on with CUDA); bench: off
        args.deterministic = "auto" if args.command == "validate" else "off"
    if (
        args.control_reference is None
        and args.spec != "none"
        and (args.deterministic == "on" or (args.deterministic == "auto" and args.device == "cuda"))
    ):
        # batch-invariant kernels: decode and verify agree, so the control can follow the
        # non-speculative output again
        args.control_reference = "decode"
    for attr in (
        "gamma",
        "accept_rate",
        "control_reference",
        "checkpoint_interval",
        "dtype",
        "top_p",
        "verify_lengths",
        "draft_layers",
    ):
        if getattr(args, attr) is None:
            setattr(args, attr, getattr(d, attr))


def _check_writable(flag: str, path: str) -> None:
    """``ValueError`` naming ``flag`` unless ``path`` can be written (tried by opening it for
    appending; a file that did not exist is removed again)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror})") from None
    if not existed:
        os.remove(path)


def _config(args: argparse.Namespace) -> ValidateConfig:
    return ValidateConfig(
        device=args.device,
        preset=args.preset,
        requests=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        page_size=args.page_size,
        arena_mb=args.arena_mb,
        max_running=args.max_running,
        chunk_size=args.chunk_size,
        backend=args.backend,
        cuda_graphs=args.cuda_graphs,
        spec=args.spec,
        gamma=args.gamma,
        accept_rate=args.accept_rate,
        control_reference=args.control_reference,
        repeats=args.repeats,
        prefix_cache=args.prefix_cache == "on",
        shared_prefix_len=args.shared_prefix_len,
        checkpoint_interval=args.checkpoint_interval,
        model_path=args.model_path,
        dtype=args.dtype,
        prompts_file=args.prompts_file,
        oracle=args.oracle,
        speculative_draft_model_path=args.speculative_draft_model_path,
        draft_layers=args.draft_layers,
        temperature=args.temperature,
        top_p=args.top_p,
        tp_size=args.tp_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        verify_lengths=args.verify_lengths,
        verify_budget=args.speculative_verify_budget,
        deterministic=args.deterministic,
        quantization=args.quantization,
    )


if __name__ == "__main__":
    sys.exit(main())
