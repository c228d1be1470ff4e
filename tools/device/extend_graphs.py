"""Padded extend graphs (``UNIMEM_EXTEND_GRAPHS``) on a real model, against the eager extend.

    python3 tools/device/extend_graphs.py --model-path GGUF --eval-prompts HELDOUT.jsonl \\
        --eval-split heldout [--drafter DIR] --json docs/results/extend_graphs_h100.json

For DSPARK (the model's shipped drafter, or ``--drafter``) and for plain decoding, one engine
with ``UNIMEM_EXTEND_GRAPHS=on`` and one with ``off``, in that order per kind:

- start-up seconds (with ``on`` the padded extends are recorded too) and the runner's
  request buckets;
- one extend on its own: ``generate`` of one 21-token prompt for one token, ten calls after
  three, milliseconds each;
- closed loops of 48 / 8 / 1 requests in flight over the held-out prompts (128 tokens, EOS
  ignored; ``dspark_real.py``'s ``_run``): tok/s, accept length, steps by kind;
- afterwards, per kind and concurrency, how many requests' outputs ``on`` and ``off`` share
  (the padded GEMMs can round differently, so greedy outputs may part after a near-tie).

The JSON is rewritten after every engine (a cut-off run keeps what it measured). ``--device
cpu`` is a dry run of the same code on a small checkpoint (the padded extend eager).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch


def _dspark_real():
    path = Path(__file__).with_name("dspark_real.py")
    spec = importlib.util.spec_from_file_location("dspark_real", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--eval-prompts", required=True)
    p.add_argument("--eval-split")
    p.add_argument("--drafter", help="default: the model's shipped drafter")
    p.add_argument("--json", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--concurrency", default="48,8,1")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--mem-fraction-static", type=float, default=0.6)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("extend_graphs: no CUDA device", file=sys.stderr)
        return 2
    from unimem.engine.api import Engine
    from unimem.training.prompt_sets import read_prompts

    dr = _dspark_real()
    texts = read_prompts(args.eval_prompts, args.eval_split)[:48]
    concs = [int(c) for c in args.concurrency.split(",")]
    spec = {"speculative_algorithm": "DSPARK", "speculative_num_draft_tokens": 8}
    if args.drafter:
        spec["speculative_draft_model_path"] = args.drafter
    kw = {"mem_fraction_static": args.mem_fraction_static} if args.device == "cuda" else {}
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report: dict = {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "settings": vars(args), "runs": {}, "same_outputs": {}}  # fmt: skip
    outputs: dict = {}
    for name, extra in (("dspark", spec), ("none", {})):
        for mode in ("on", "off"):
            os.environ["UNIMEM_EXTEND_GRAPHS"] = mode
            t0 = time.perf_counter()
            eng = Engine(model_path=args.model_path, device=args.device, **kw, **extra)
            start = time.perf_counter() - t0
            ids = [eng.tokenizer.encode(t)[:256] for t in texts]
            one = [[2] + [100 + i for i in range(20)]]
            params = {"max_new_tokens": 1, "ignore_eos": True}
            for _ in range(3):
                eng.generate(input_ids=one, sampling_params=params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            for _ in range(10):
                eng.generate(input_ids=one, sampling_params=params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            run = {
                "start_s": round(start, 2),
                "extend_lanes": list(eng.core.runner.extend_lanes),
                "one_extend_ms": round(100 * (time.perf_counter() - t1), 3),
            }
            for c in concs:
                res, outs = dr._run(eng, ids, c, args.output_len, 0.0)
                run[f"in_flight_{c}"] = res
                outputs[(name, mode, c)] = outs
            report["runs"][f"{name}_{mode}"] = run
            summary = {k: v if not isinstance(v, dict) else
                       {x: v[x] for x in ("tok_s", "accept_length") if x in v}
                       for k, v in run.items()}  # fmt: skip
            print(name, mode, json.dumps(summary), flush=True)
            for c in concs:
                a, b = outputs.get((name, "on", c)), outputs.get((name, "off", c))
                if a is not None and b is not None:
                    same = sum(x == y for x, y in zip(a, b, strict=True))
                    report["same_outputs"][f"{name}_{c}"] = [same, len(a)]
                    print(f"{name} at {c} in flight: {same}/{len(a)} outputs the same on/off")
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            eng.shutdown()
            del eng
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
