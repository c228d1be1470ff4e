"""The routed experts' grouped GEMMs at verify sizes: ``torch._grouped_mm`` (CUTLASS, what the MoE
layer runs) against our Triton grouped kernel (``batch_invariant._bi_grouped_kernel``) in
several tile configurations — the data for choosing the MoE GEMM path of a verify step.

Sizes (default the Qwen3-Next ``bench`` checkpoint of ``make_checkpoint.py``: d 2048, 64
experts of width 512, top 8; a verify step of 48 requests x 8 tokens = 384 tokens, 3 072
pairs): the gate/up projection ``[P, d] x [E, 2I, d]`` and the down projection ``[P, I] x
[E, d, I]``, bf16, with a router-like routing (top-k of random scores, so every expert gets
~``P / E`` rows) grouped by ``unimem_kernel.moe_route``. ``--tokens`` takes several token
counts (e.g. prefill chunks) to see where each path wins.

Each time: ``--iters`` calls in one CUDA graph, CUDA events around a replay, median of
``--repeats`` (``unimem_kernel.timing.graph_median_ms``); ``--launch-orders`` adds each Triton tile
with its column tiles launched first (the same bits, another order over the weights); GB/s =
the experts' weight bytes / time (the floor of this regime: every expert's weights are read
once); ``rel`` = the largest |difference| to the float32 per-expert product relative to its
largest |value|. ``--json PATH`` writes the rows. Needs CUDA (exits 2 with one line without
it).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from unimem_kernel import moe_route
from unimem_kernel.batch_invariant import MatmulConfig, bi_grouped_linear_triton
from unimem_kernel.timing import graph_median_ms

# (BM, BN, BK, warps, stages); group_m is unused by the grouped kernel
CONFIGS = [
    (128, 128, 64, 8, 3),  # the batch-invariant default
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 8, 3),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 6),
    (64, 64, 64, 4, 6),
    (32, 128, 128, 4, 4),
    (32, 64, 128, 4, 5),
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[384])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=512, help="expert intermediate size I")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples; the median is kept")
    ap.add_argument(
        "--launch-orders",
        action="store_true",
        help="also time each Triton tile with its column tiles launched first (grid (n, p))",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_gemm: needs CUDA", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    e, k, d, width = args.experts, args.top_k, args.d_model, args.width
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}; E {e}, top {k}, "
          f"d {d}, I {width}, bf16")  # fmt: skip
    torch.manual_seed(0)
    timing = dict(warmup=args.warmup, iters=args.iters, repeats=args.repeats)
    projections = {  # name: (N, K)
        "gate_up": (2 * width, d),
        "down": (d, width),
    }
    weights = {
        name: torch.randn(e, n, kk, device="cuda", dtype=torch.bfloat16) / kk**0.5
        for name, (n, kk) in projections.items()
    }
    rows = []
    for tokens in args.tokens:
        ids = torch.randn(tokens, e, device="cuda").topk(k, dim=-1).indices
        route = moe_route(ids, e)
        pairs = tokens * k
        for name, (n, kk) in projections.items():
            w = weights[name]
            xs = torch.randn(pairs, kk, device="cuda", dtype=torch.bfloat16)
            ref = torch.empty(pairs, n, device="cuda")
            lo = 0
            for ex, hi in enumerate(route.ends.tolist()):
                ref[lo:hi] = xs[lo:hi].float() @ w[ex].float().t()
                lo = hi
            gbytes = w.numel() * w.element_size() / 1e9

            def record(variant, fn, name=name, tokens=tokens, ref=ref, gbytes=gbytes):
                y = fn()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                ms = graph_median_ms(fn, **timing)
                rows.append(dict(tokens=tokens, proj=name, variant=variant, ms=ms, rel=err,
                                 gb_s=gbytes / (ms * 1e-3)))  # fmt: skip
                print(f"T {tokens:6d} {name:8s} {variant:28s} {ms * 1e3:8.1f} us "
                      f"{gbytes / (ms * 1e-3):7.0f} GB/s  rel {err:.1e}")  # fmt: skip

            record("torch._grouped_mm",
                   lambda xs=xs, w=w, ends=route.ends: torch._grouped_mm(
                       xs, w.transpose(-2, -1), offs=ends))  # fmt: skip
            for bm, bn, bk, warps, stages in CONFIGS:
                cfg = MatmulConfig(bm, bn, bk, warps, stages, 1)
                label = f"triton {bm}x{bn}x{bk} w{warps} st{stages}"
                for cols_fastest in (False, True) if args.launch_orders else (False,):
                    tag = label + (" cols-first" if cols_fastest else "")
                    try:
                        record(tag,
                               lambda xs=xs, w=w, cfg=cfg, ends=route.ends, c=cols_fastest:
                               bi_grouped_linear_triton(xs, w, ends, config=cfg,
                                                        cols_fastest=c))  # fmt: skip
                    except Exception as exc:  # a config that does not fit this GPU: go on
                        print(f"T {tokens:6d} {name:8s} {tag:28s} failed: "
                              f"{type(exc).__name__}: {str(exc)[:160]}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, experts=e, top_k=k, d_model=d, width=width, rows=rows), f,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
