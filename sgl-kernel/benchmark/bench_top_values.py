"""``unimem_kernel.top_values`` (the select by chunk maxima) against ``torch.topk`` over the
whole row (what the sampler's bounded cut-off ran before), GPU time per call in CUDA graphs.

For each ``--rows`` x ``--vocab`` (default: 1, 48 and 384 rows — one request, 48 decode
lanes, 48 lanes' verify rows at gamma 7 — of Gemma 3's 262 144 logits; ``--extra``: 48 and
384 rows of a 32 768-token draft vocabulary, and 384 of Qwen's 151 936), float32 logits drawn
fresh per shape (``randn * 4``, ties at the top of one row), and each chunk of ``--chunks``
(``0``: the default one for the shape, rows and way), with its chunk maxima taken each way
of ``--maxima`` (``torch``'s amax, the ``kernel`` of :mod:`unimem_kernel.chunk_maxima`):
checks the values equal ``torch.topk``'s, then times both. Prints one line per shape, chunk
and way; ``--json PATH`` writes them with the GPU's name.

    python sgl-kernel/benchmark/bench_top_values.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from unimem_kernel.timing import graph_median_ms
from unimem_kernel.top_values import default_chunk, top_values


def top_values_reference(x: torch.Tensor, w: int) -> torch.Tensor:
    """What the sampler ran before: ``torch.topk`` over the whole row."""
    return torch.topk(x, w, dim=-1, sorted=True).values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,48,384")
    ap.add_argument("--vocab", default="262144")
    ap.add_argument(
        "--extra",
        default="48x32768,384x32768,384x151936",
        help="more RxV shapes, comma-separated",
    )
    ap.add_argument("--w", type=int, default=256)
    ap.add_argument("--chunks", default="0,8,16,32,64,128,256", help="chunk sizes; 0 = the default")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--maxima", default="torch,kernel", help="how the chunk maxima are taken (top_values)"
    )
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
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for n, vocab in shapes:
            x = (torch.randn(n, vocab, device="cuda") * 4).to(dtype)
            x[0, :7] = x[0].max()  # ties at the top of one row
            want = top_values_reference(x, args.w)
            ref_ms = graph_median_ms(lambda x=x: top_values_reference(x, args.w))
            asked = [int(c) for c in args.chunks.split(",")]
            maxima = args.maxima.split(",")
            defaults = {default_chunk(vocab, args.w, n, m) for m in maxima} if 0 in asked else set()
            chunks = sorted({c for c in asked if c} | defaults)
            for chunk, how in [(c, m) for c in chunks for m in maxima]:
                if chunk > 1 and vocab // chunk < args.w:
                    continue
                got = top_values(x, args.w, chunk, maxima=how)
                if not torch.equal(got, want):
                    print(f"{n} x {vocab} chunk {chunk} maxima {how}: differs from torch.topk",
                          file=sys.stderr)  # fmt: skip
                    return 1
                ms = graph_median_ms(lambda x=x, c=chunk, m=how: top_values(x, args.w, c, maxima=m))
                row = {
                    "rows": n, "vocab": vocab, "w": args.w, "dtype": dtype_name, "chunk": chunk,
                    "maxima": how, "default": chunk == default_chunk(vocab, args.w, n, how),
                    "torch_topk_us": ref_ms * 1e3, "top_values_us": ms * 1e3,
                    "speedup": ref_ms / ms, "same": True,
                }  # fmt: skip
                rows_out.append(row)
                mark = "*" if row["default"] else " "
                print(f"{dtype_name:8s} {n:5d} x {vocab:7d} chunk {chunk:4d}{mark} {how:6s}: "
                      f"torch.topk {ref_ms * 1e3:8.1f}  top_values {ms * 1e3:8.1f}  "
                      f"({ref_ms / ms:.2f}x)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
