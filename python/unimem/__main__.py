"""Command line: ``python -m unimem validate ...`` (see ``--help``)."""

from __future__ import annotations

import argparse
import sys

from unimem.engine.config import preset_names
from unimem.engine.validate import ValidateConfig, format_table, validate, write_json


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m unimem")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser(
        "validate",
        help="run the same requests through static and unified memory and compare outputs",
    )
    d = ValidateConfig()
    v.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    v.add_argument("--preset", default=d.preset, help=f"model preset: {', '.join(preset_names())}")
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
    v.add_argument("--backend", choices=["torch", "fa4"], default=d.backend)
    v.add_argument("--json", metavar="PATH", help="write the report as JSON (- for stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = ValidateConfig(
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
    )
    try:
        report = validate(cfg, progress=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return 0 if report["exact_match"] == report["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
