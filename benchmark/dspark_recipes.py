"""Drafter recipe choices measured on one set of target-written text (H200), one command.

    python3 benchmark/dspark_recipes.py --model-path gemma-3-270m \\
        --eval-prompts PROMPTS.jsonl --eval-split heldout \\
        --json docs/results/dspark_recipes_h200.json [--budget-each 25] [-- TRAIN FLAGS]

Generates the training text once (``unimem.training.train_drafter.generate``, the flags of
``benchmark/dspark_real.py``'s defaults, overridable after ``--``), then trains one drafter
per recipe for ``--budget-each`` seconds each (same data, same seed, no confidence head) and
records its held-out offline accept length (greedy chain schedule, no acceptance control),
steps done and weight bytes. Recipes vary one knob from the base (2 draft layers, target
layers 1/9/17, Markov rank 16, MLP width 1 024, draft vocabulary 32 768, gamma 7): draft
layers 1 and 3, other target layers, Markov rank 64, draft vocabulary 8 192 and 65 536, MLP
width 2 048. The base drafter is also evaluated at block sizes 3, 5 and 7. Prints the GPU
and a table; writes everything to ``--json``; fails loudly without CUDA or prompt files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from dspark_real import DEFAULT_TRAIN

RECIPES = {
    "base": [],
    "layers_1": ["--draft-layers", "1"],
    "layers_3": ["--draft-layers", "3"],
    "targets_5_11_17": ["--target-layers", "5,11,17"],
    "targets_1_5_9_13_17": ["--target-layers", "1,5,9,13,17"],
    "targets_17": ["--target-layers", "17"],
    "markov_rank_64": ["--markov-rank", "64"],
    "vocab_8192": ["--draft-vocab", "8192"],
    "vocab_65536": ["--draft-vocab", "65536"],
    "ffn_2048": ["--draft-ffn-dim", "2048"],
}


def main(argv: list[str]) -> int:
    own, rest = argv, []
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--eval-prompts", required=True)
    p.add_argument("--eval-split")
    p.add_argument("--train-prompts")
    p.add_argument("--train-split")
    p.add_argument("--json", required=True)
    p.add_argument("--budget-each", type=float, default=25.0, help="training seconds each")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of recipe names")
    p.add_argument("--out-root", default="/tmp/dspark_recipes")
    args = p.parse_args(own)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dspark_recipes: error: no CUDA device", file=sys.stderr)
        return 2
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        print(f"dspark_recipes: error: unknown recipes {unknown}", file=sys.stderr)
        return 2
    from unimem.speculative.checkpoint import load_drafter
    from unimem.training import train_drafter
    from unimem.training.teacher_forcing import teacher_forced_states
    from unimem.training.trainer import offline_accept_lengths

    def targs(extra: list[str], out: str) -> argparse.Namespace:
        argv = [
            "--model-path", args.model_path, "--out", out, "--device", args.device,
            "--eval-prompts", args.eval_prompts, *DEFAULT_TRAIN,
            "--time-budget", str(args.budget_each), "--head-steps", "0", "--no-progress",
        ]  # fmt: skip
        if args.eval_split:
            argv += ["--eval-split", args.eval_split]
        if args.train_prompts:
            argv += ["--train-prompts", args.train_prompts]
            if args.train_split:
                argv += ["--train-split", args.train_split]
        argv += [*rest, *extra]
        ns = train_drafter.parser().parse_args(argv)
        ns.argv = argv
        return ns

    report: dict = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none (cpu)",
        "torch": torch.__version__,
        "settings": vars(args) | {"train_overrides": rest},
        "recipes": {},
    }
    t0 = time.perf_counter()
    text = train_drafter.generate(targs([], f"{args.out_root}/base"))
    report["data"] = text.info
    for name in names:
        out = f"{args.out_root}/{name}"
        summary = train_drafter.train_on(text, targs(RECIPES[name], out))
        row = {
            k: summary[k]
            for k in ("accept_before", "accept_after", "steps", "weights_bytes", "draft_config")
        }
        row["seconds"] = summary["seconds"]["training"]
        report["recipes"][name] = row
        print(f"{name:22s} accept {row['accept_after']:.3f} ({row['steps']} steps)", flush=True)
    if "base" in names and text.held_sequences:
        base = f"{args.out_root}/base"
        drafter = load_drafter(base, text.model)
        held = teacher_forced_states(
            text.model, text.held_sequences, text.held_prompt_lens, drafter.config.target_layers
        )
        report["base_by_gamma"] = {g: offline_accept_lengths(drafter, held, g) for g in (3, 5, 7)}
        print("base by gamma", report["base_by_gamma"])
    report["seconds"] = time.perf_counter() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {args.json} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
