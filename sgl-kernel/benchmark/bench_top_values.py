"""``unimem_kernel.top_values`` against ``torch.topk`` (the launch it replaces in the sampler's
bounded cut-off), GPU time per call inside CUDA graphs.

For each ``--rows`` x ``--vocab`` (default: 1, 48 and 384 rows — one request, 48 decode
lanes, 48 lanes' verify rows at gamma 7 — of Gemma 3's 262 144 logits; ``--extra``: 48 rows
of a 32 768-token draft vocabulary, a draft column's, and 384 of them), float32 logits drawn
fresh per shape (``randn * 4``): first checks that both give the same values, then times
both. Prints one line per shape; ``--json PATH`` writes them with the GPU's name.

    python sgl-kernel/benchmark/bench_top_values.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from unimem_kernel.timing import graph_median_ms
from unimem_kernel.top_values import top_values_reference, top_values_triton


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,48,384")
    ap.add_argument("--vocab", default="262144")
    ap.add_argument(
        "--extra", default="48x32768,384x32768", help="more RxV shapes, comma-separated"
    )
    ap.add_argument("--w", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    shapes = [(int(r), int(v)) for v in args.vocab.split(",") for r in args.rows.split(",")]
    shapes += [tuple(int(x) for x in s.split("x")) for s in args.extra.split(",") if s]
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; torch {torch.__version__}; w = {args.w}; µs per call in CUDA graphs")
    rows_out = []
    for n, vocab in shapes:
        x = torch.randn(n, vocab, device="cuda") * 4
        x[0, :7] = x[0].max()  # ties at the top of one row
        want = top_values_reference(x, args.w)
        got = top_values_triton(x, args.w)
        same = bool(torch.equal(got, want))
        if not same:
            print(f"{n} x {vocab}: top_values differs from torch.topk", file=sys.stderr)
            return 1
        ref_ms = graph_median_ms(lambda x=x: top_values_reference(x, args.w))
        ours_ms = graph_median_ms(lambda x=x: top_values_triton(x, args.w))
        row = {
            "rows": n, "vocab": vocab, "w": args.w, "torch_topk_us": ref_ms * 1e3,
            "top_values_us": ours_ms * 1e3, "speedup": ref_ms / ours_ms, "same": same,
        }  # fmt: skip
        rows_out.append(row)
        print(f"{n:5d} x {vocab:7d}: torch.topk {ref_ms * 1e3:9.1f}  top_values "
              f"{ours_ms * 1e3:9.1f}  ({ref_ms / ours_ms:.2f}x)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
