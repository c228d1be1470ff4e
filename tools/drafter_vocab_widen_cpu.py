"""Does the shipped drafter's reduced draft vocabulary cost sampled acceptance? A CPU check
without training.

The shipped drafter scores 32 768 of Gemma 3 270M's 262 144 tokens, which hold ~96.3 % of
the target's mass at temperature 0.7 (``sampled_accept_sixth_seventh_cpu.json``'s
``coverage``). Its LM head rows are the target's own (tied embeddings), so the same trained
drafter can score every token: the full-vocabulary variant keeps every weight, maps each
token's Markov row ``U`` to its draft id's (the out-of-vocabulary row for the new ones) and
gives the new tokens a Markov ``V`` row of zeros (``full_v0``) or the mean of the trained
rows (``full_vmean``). All three are scored by
:func:`unimem.training.sampled_accept.sampled_accept_lengths` on the same text: ``--requests``
of the package's short prompts continued 128 tokens at temperature 0.7 by the target
(draft temperature = the sampling temperature). ~6 min on 2 cores.

    python tools/drafter_vocab_widen_cpu.py --json docs/results/drafter_vocab_widened_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from unimem.engine.api import Engine
from unimem.speculative.checkpoint import load_drafter
from unimem.speculative.drafter import DsparkDrafter
from unimem.speculative.shipped import shipped_drafter
from unimem.training.draft_data import text_continuations
from unimem.training.prompt_sets import prompt_texts
from unimem.training.sampled_accept import sampled_accept_lengths
from unimem.training.teacher_forcing import teacher_forced_states


def widened(base: DsparkDrafter, new_v: str) -> DsparkDrafter:
    """``base`` scoring the whole vocabulary (module docstring); ``new_v``: "zero" or
    "mean"."""
    config = dataclasses.replace(base.config, draft_vocab_size=None)
    out = DsparkDrafter(config, base.embed, base.lm_head)
    skip = ("d2t", "markov_u", "markov_v")
    out.load_state_dict({k: v for k, v in base.state_dict().items() if k not in skip}, strict=False)
    with torch.no_grad():
        out.markov_u.copy_(base.markov_u[base.t2d])
        v = torch.zeros_like(out.markov_v)
        if new_v == "mean":
            v[:] = base.markov_v.mean(0)
        v[base.d2t] = base.markov_v
        out.markov_v.copy_(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="gemma-3-270m")
    ap.add_argument("--drafter", default=None, help="default: the model's shipped drafter")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(model_path=args.model_path, device="cpu", disable_radix_cache=True)
    model = engine.model
    path = args.drafter or shipped_drafter(args.model_path, model)
    if path is None:
        raise SystemExit(f"no shipped drafter for {args.model_path}: pass --drafter")
    base = load_drafter(path, model, dtype=torch.float32)
    texts = prompt_texts("short", None)[: args.requests]
    seqs, plens = text_continuations(
        engine, texts, 64, args.tokens, temperature=args.temperature, seed=0
    )
    engine.shutdown()
    data = teacher_forced_states(model, seqs, plens, base.config.target_layers, soft_top_k=256)
    variants = {"base": base, "full_v0": widened(base, "zero"), "full_vmean": widened(base, "mean")}
    report = {"command": "python tools/drafter_vocab_widen_cpu.py", "drafter": str(path),
              "requests": len(seqs), "tokens": args.tokens, "temperature": args.temperature,
              "variants": {}}  # fmt: skip
    for name, drafter in variants.items():
        row = sampled_accept_lengths(drafter, data, 7, args.temperature, (1.0,))[1.0]
        report["variants"][name] = row
        alpha = " ".join(f"{a:.3f}" for a in row["alpha"])
        print(f"{name:>11} accept {row['accept']:.4f}  alpha {alpha}", flush=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
