"""Which soft term keeps a drafter's *sampled* accept length: a small CPU comparison.

The target (default: the embedded Gemma 3 270M) writes training text — ``--train`` prompts
sampled from ``<bos>`` (24 tokens, temperature 1), continued ``--gen-len`` tokens at
``--temperature`` — and held-out text (the package's short prompts, ``--held`` of them,
``--held-len`` tokens at the same temperature). The drafter (default: the shipped one) is
fine-tuned ``--steps`` steps under each soft term of ``--variants`` and scored by
:func:`unimem.training.sampled_accept.sampled_accept_lengths` (draft temperature = the
sampling temperature). Slow on a CPU (the engine's reference attention): ~25 min of text and
~3 min a variant on 2 cores with the defaults.

    python tools/drafter_soft_loss_cpu.py --json docs/results/drafter_soft_loss_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

VARIANTS = {
    "ce_t1_w05": {"soft_weight": 0.5},
    "tv_t07_w05": {"soft_weight": 0.5, "soft_temperature": 0.7, "soft_loss": "tv"},
    "tv_t07_w1": {"soft_weight": 1.0, "soft_temperature": 0.7, "soft_loss": "tv"},
    "ce_t07_w1": {"soft_weight": 1.0, "soft_temperature": 0.7},
}


def main() -> int:
    from unimem.data.prompts import short_prompts
    from unimem.engine.api import Engine
    from unimem.speculative import shipped
    from unimem.speculative.checkpoint import load_drafter
    from unimem.training.draft_data import bos_prompts, continuations, text_continuations
    from unimem.training.sampled_accept import sampled_accept_lengths
    from unimem.training.teacher_forcing import teacher_forced_states
    from unimem.training.trainer import TrainConfig, train_drafter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="gemma-3-270m")
    p.add_argument("--drafter", default=None, help="default: the model's shipped drafter")
    p.add_argument("--train", type=int, default=160)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--held", type=int, default=16)
    p.add_argument("--held-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    engine = Engine(model_path=args.model_path, device="cpu", disable_radix_cache=True)
    model = engine.model
    path = args.drafter or shipped.shipped_drafter(args.model_path, model)
    if path is None:
        raise SystemExit(f"no shipped drafter fits {args.model_path}: pass --drafter")
    drafter = load_drafter(path, model, dtype=torch.float32)
    prompts = bos_prompts(engine, args.train, 24, seed=777000)
    seqs, lens = continuations(
        engine, prompts, args.gen_len, temperatures=(args.temperature,), seed=888000
    )
    held_seqs, held_lens = text_continuations(
        engine, short_prompts()[: args.held], 64, args.held_len, temperature=args.temperature
    )
    layers = drafter.config.target_layers
    held_data = teacher_forced_states(model, held_seqs, held_lens, layers, soft_top_k=256)
    train = teacher_forced_states(model, seqs, lens, layers, soft_top_k=64)
    t = args.temperature
    rows = {"base": sampled_accept_lengths(drafter, held_data, 7, t, (1.0,))[1.0]}
    for name in args.variants.split(","):
        cfg = TrainConfig(steps=args.steps, batch=8, anchors_per_step=32, lr=3e-4, warmup=5,
                          bf16=False, seed=1, eval_every=10**6, save_every=10**6, head_steps=0,
                          progress=False, **VARIANTS[name])  # fmt: skip
        tuned = train_drafter(drafter, train, None, cfg).drafter
        rows[name] = sampled_accept_lengths(tuned, held_data, 7, t, (1.0,))[1.0]
        print(name, f"{rows[name]['accept']:.3f}", flush=True)
    print("base", f"{rows['base']['accept']:.3f}")
    if args.json:
        report = {"args": vars(args), "drafter": str(path), "results": rows,
                  "seconds": time.perf_counter() - t0}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
