"""``unimem_kernel.moe_route`` (grouping a step's token-expert pairs by expert) at the engine's
routings, GPU time per call in CUDA graphs, with the program size for short routings as
shipped (``--min-block 16``: fewer pairs than 128 take one program of their next power of two)
and as before it (``--min-block 128``: every routing in 128-pair programs).

For each ``--tokens`` count and each routing of ``--routings`` (``TOPK/EXPERTS``: Qwen3-Next-80B's
top 10 of 512 experts, the synthetic preset's top 8 of 64), random expert ids drawn fresh per
shape; checks the route against the torch reference, then times it each way. ``--json PATH``
writes the rows with the GPU's name.

    python sgl-kernel/benchmark/bench_moe_route.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import unimem_kernel.expert_route as er
from unimem_kernel.expert_route import moe_route, moe_route_reference
from unimem_kernel.timing import graph_median_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,48,384")
    ap.add_argument("--routings", default="10/512,8/64")
    ap.add_argument("--min-block", default="16,128", help="program sizes for short routings")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_route: needs a CUDA device", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; torch {torch.__version__}; µs per call in CUDA graphs")
    rows = []
    shipped = er._MIN_BLOCK
    try:
        for routing in args.routings.split(","):
            k, e = (int(v) for v in routing.split("/"))
            for t in (int(v) for v in args.tokens.split(",")):
                g = torch.Generator().manual_seed(t * 1000 + e)
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                ids = ids.to("cuda", torch.int32)
                want = moe_route_reference(ids, e)
                line = f"top {k:2d} of {e:3d}, {t:4d} tokens:"
                for mb in (int(v) for v in args.min_block.split(",")):
                    er._MIN_BLOCK = mb
                    got = moe_route(ids, e)
                    if any(not torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                        print(f"{line} min block {mb}: differs from the reference", file=sys.stderr)
                        return 1
                    us = graph_median_ms(lambda ids=ids, e=e: moe_route(ids, e)) * 1e3
                    rows.append({"tokens": t, "topk": k, "experts": e, "min_block": mb, "us": us})
                    line += f"  min block {mb:3d}: {us:6.1f}"
                print(line)
    finally:
        er._MIN_BLOCK = shipped
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
