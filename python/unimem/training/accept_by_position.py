"""A drafter's accept length by output position, and under bounded context windows:
``python -m unimem.training.accept_by_position``.

The target writes ``--tokens`` greedy tokens after each of ``--requests`` prompts (its Engine,
EOS ignored: long outputs); its residual streams are recomputed by teacher forcing; the
engine's greedy chain schedule is replayed offline
(:func:`~unimem.training.trainer.offline_accept_by_position`) for the drafter as saved and for
each ``--windows`` value with every draft layer attending that window
(:func:`~unimem.speculative.drafter.with_context_window`; weights unchanged). A drafter whose
accept length falls in the late buckets met contexts longer than it trained on.

    python -m unimem.training.accept_by_position --model-path gemma-3-270m \\
        --drafter python/unimem/data/drafters/gemma-3-270m --prompts short --requests 12 \\
        --tokens 512 --windows 96,128,160 --device cpu --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from unimem.engine.api import Engine
from unimem.speculative.checkpoint import load_drafter
from unimem.speculative.drafter import with_context_window
from unimem.training.draft_data import text_continuations
from unimem.training.prompt_sets import prompt_texts
from unimem.training.teacher_forcing import teacher_forced_states
from unimem.training.trainer import offline_accept_by_position

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unimem.training.accept_by_position",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--drafter", required=True, help="a drafter checkpoint directory")
    p.add_argument(
        "--prompts", default="short", help="'short' (the package's real prompts) or a file"
    )
    p.add_argument("--split", default=None, help="the prompt file's split to use")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--tokens", type=int, default=512, help="greedy output tokens each")
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--windows", type=_ints, default=(), help="context windows to try, e.g. 96,128")
    p.add_argument("--edges", type=_ints, default=(0, 64, 128, 256, 512, 1024))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("requests", "tokens", "gamma", "max_prompt_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    t0 = time.perf_counter()
    engine = Engine(
        model_path=args.model_path, device=args.device, dtype=args.dtype, disable_radix_cache=True
    )
    model = engine.model
    drafter = load_drafter(args.drafter, model, dtype=torch.float32)
    saved = drafter.config
    # built before the generation: an impossible window fails at once
    variants = [("as saved", saved)]
    variants += [(f"window {w}", with_context_window(saved, w, model.config)) for w in args.windows]
    texts = prompt_texts(args.prompts, args.split)
    if len(texts) < args.requests:
        raise SystemExit(f"--prompts has {len(texts)} prompts, --requests {args.requests}")
    seqs, prompt_lens = text_continuations(
        engine, texts[: args.requests], args.max_prompt_len, args.tokens
    )
    engine.shutdown()
    data = teacher_forced_states(model, seqs, prompt_lens, drafter.config.target_layers)
    rows = {}
    for name, config in variants:
        drafter.config = config
        rows[name] = {
            "layer_hosts": list(config.layer_hosts),
            "window": config.window,
            "context_window": config.context_window,
            "accept": offline_accept_by_position(drafter, data, args.gamma, args.edges),
        }
    drafter.config = saved
    keys = [k for k in rows["as saved"]["accept"] if k != "all"]
    print(f"{'drafter':<28} {'all':>6} " + " ".join(f"{k:>9}" for k in keys))
    for name, row in rows.items():
        acc = row["accept"]
        reach = row["window"] if row["context_window"] is None else row["context_window"]
        label = f"{name} ({'+'.join(row['layer_hosts'])}, {reach})"
        print(
            f"{label:<28} {acc['all']['accept']:6.2f} "
            + " ".join(f"{acc[k]['accept']:9.2f}" if k in acc else f"{'-':>9}" for k in keys)
        )
    report = {
        "model_path": args.model_path,
        "drafter": args.drafter,
        "device": str(model.device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "prompts": args.prompts,
        "requests": len(seqs),
        "tokens": args.tokens,
        "gamma": args.gamma,
        "variants": rows,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
