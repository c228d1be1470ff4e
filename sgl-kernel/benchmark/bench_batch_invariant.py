"""Batch-invariant GEMMs against cuBLAS: ``unimem_kernel.bi_linear`` vs ``F.linear`` and
``bi_grouped_linear`` vs ``torch._grouped_mm``, bf16, on one GPU.

Dense shapes: ``M`` (rows: decode, a verify step of 48 requests, prefill chunks) times
``(K, N)`` of the ``small`` preset's and a Qwen3-Next-like config's projections (hidden 2048:
QKV/gate-up ``2048 -> 4096``, ``2048 -> 2048``, down ``4096 -> 2048``, LM head ``2048 ->
32000``). Grouped: 64 experts, top-8 routing of ``T`` tokens (``T * 8`` rows sorted by expert,
as ``unimem.models.moe.expert_mlp`` builds them), ``2048 -> 1024``.

Each row: ``ms`` per call for ours and for the torch op (CUDA events around ``--iters``
back-to-back calls, after ``--warmup`` calls; the median of ``--repeats`` samples), the ratio
ours / torch, and the normwise difference of the outputs. Prints the GPU and versions;
``--json PATH`` writes the rows. Needs CUDA (exits 2 without it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from unimem_kernel import bi_grouped_linear, bi_linear, matmul_config
from unimem_kernel.timing import median_ms

SHAPES = [(2048, 4096), (2048, 2048), (4096, 2048), (2048, 32000)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 48, 384, 1024], help="rows")
    ap.add_argument("--grouped-tokens", type=int, nargs="+", default=[48, 384])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--grouped-k", type=int, default=2048)
    ap.add_argument("--grouped-n", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=9, help="samples; the median is kept")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


def time_ms(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Median over samples of the mean time per call (CUDA events)."""
    return median_ms(fn, warmup=args.warmup, iters=args.iters, repeats=args.repeats)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def dense_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=gen).mul_(k**-0.5).bfloat16()
        cfg = matmul_config(torch.bfloat16, k, n)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ours = time_ms(lambda x=x, w=w: bi_linear(x, w), args)
            ref = time_ms(lambda x=x, w=w: F.linear(x, w), args)
            rows.append(
                {
                    "op": "linear",
                    "m": m,
                    "k": k,
                    "n": n,
                    "tiles": f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}",
                    "ours_ms": ours,
                    "torch_ms": ref,
                    "ratio": ours / ref,
                    "rel_diff": rel_diff(bi_linear(x, w), F.linear(x, w)),
                }
            )
            print_row(rows[-1])
    return rows


def grouped_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    e, k, n = args.experts, args.grouped_k, args.grouped_n
    w = torch.randn(e, n, k, device="cuda", generator=gen).mul_(k**-0.5).bfloat16()
    wt = w.transpose(-2, -1)
    for t in args.grouped_tokens:
        scores = torch.rand(t, e, device="cuda", generator=gen)
        flat = scores.topk(args.topk, dim=-1).indices.reshape(-1)
        counts = torch.zeros(e, dtype=torch.int32, device="cuda")
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = torch.randn(t * args.topk, k, device="cuda", generator=gen).bfloat16()
        ours = time_ms(lambda xs=xs, offs=offs: bi_grouped_linear(xs, w, offs), args)
        ref = time_ms(lambda xs=xs, offs=offs: torch._grouped_mm(xs, wt, offs=offs), args)
        rows.append(
            {
                "op": "grouped",
                "m": t * args.topk,
                "k": k,
                "n": n,
                "tiles": f"E={e} top{args.topk} T={t}",
                "ours_ms": ours,
                "torch_ms": ref,
                "ratio": ours / ref,
                "rel_diff": rel_diff(
                    bi_grouped_linear(xs, w, offs), torch._grouped_mm(xs, wt, offs=offs)
                ),
            }
        )
        print_row(rows[-1])
    return rows


HEADER = (
    f"{'op':8} {'M':>6} {'K':>6} {'N':>6}  {'tiles':22} "
    f"{'ours ms':>9} {'torch ms':>9} {'ratio':>6}  rel diff"
)


def print_row(r: dict) -> None:
    print(
        f"{r['op']:8} {r['m']:6d} {r['k']:6d} {r['n']:6d}  {r['tiles']:22} "
        f"{r['ours_ms']:9.4f} {r['torch_ms']:9.4f} {r['ratio']:6.2f}  {r['rel_diff']:.2e}",
        flush=True,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_batch_invariant: needs a CUDA device", file=sys.stderr)
        return 2
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "warmup": args.warmup,
        "iters": args.iters,
        "repeats": args.repeats,
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(HEADER)
    rows = dense_rows(args)
    if hasattr(torch, "_grouped_mm"):
        rows += grouped_rows(args)
    else:
        print("(torch._grouped_mm missing: grouped rows skipped)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
