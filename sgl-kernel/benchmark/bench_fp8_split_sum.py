"""Who sums the Triton FP8 GEMM's split-K partials: the tile's last program to finish
(``UNIMEM_FP8_SPLIT_SUM=kernel``, one launch a product) or a second launch (``separate``).

At the rows of a few-request decode step (``--rows``, default 1 and 8) and the dense FP8
projections of Qwen3-Next-80B (``--shapes N x K``: GDN ``in_proj_qkvz`` and ``out_proj``,
attention ``q_proj`` and ``o_proj``, the shared expert's gate-up and down), on fresh random
operands: checks that both give the same bits, then times each in CUDA graphs (the GEMM
alone, activations quantised beforehand). Prints the GPU and each shape's tile and split;
``--json PATH`` writes the rows.

    python sgl-kernel/benchmark/bench_fp8_split_sum.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from unimem_kernel.fp8_gemm import (
    FP8_DTYPE,
    _split_k,
    fp8_gemm,
    fp8_gemm_config,
    fp8_quantize_groups,
    num_groups,
)
from unimem_kernel.timing import graph_median_ms

DEFAULT_SHAPES = "12288x2048,2048x4096,8192x2048,1024x2048,2048x512"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="N x K, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_split_sum: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    os.environ["UNIMEM_KERNEL_BACKEND"] = "triton"
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; torch {torch.__version__}; µs per GEMM in CUDA graphs")
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = torch.randn(n, k, device=dev) / k**0.5
            wq, ws = fp8_quantize_groups(w.bfloat16())
            assert wq.dtype == FP8_DTYPE
            xq, xs = fp8_quantize_groups(torch.randn(m, k, device=dev).bfloat16() * 3)
            cfg = fp8_gemm_config(m, False, (n, k), dev)
            split = _split_k(cfg, m, n, num_groups(k), dev)
            out = {}
            us = {}
            for mode in ("separate", "kernel"):
                os.environ["UNIMEM_FP8_SPLIT_SUM"] = mode
                out[mode] = fp8_gemm(xq, xs, wq, ws, out_dtype=torch.bfloat16)
                ops = (xq, xs, wq, ws)
                us[mode] = 1e3 * graph_median_ms(
                    lambda ops=ops: fp8_gemm(*ops, out_dtype=torch.bfloat16), iters=50
                )
            same = torch.equal(out["kernel"], out["separate"])
            print(
                f"rows {m:4d}  N {n:6d}  K {k:5d}  tile {cfg.spec():>16}  split {split}:  "
                f"separate {us['separate']:6.2f}  kernel {us['kernel']:6.2f}  "
                f"same bits {same}"
            )
            rows_out.append(
                {"rows": m, "n": n, "k": k, "tile": cfg.spec(), "split": split,
                 "separate_us": us["separate"], "kernel_us": us["kernel"], "same_bits": same}
            )  # fmt: skip
            if not same:
                print("bench_fp8_split_sum: the two sums differ", file=sys.stderr)
                return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
