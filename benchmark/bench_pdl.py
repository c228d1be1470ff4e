"""What programmatic dependent launch (PDL) would save between the small kernels of a step.

A verify step is ~150 kernels, many of them a few microseconds long (norms, RoPE, gates,
the drafter's pick), so the gap between one kernel's last block and the next kernel's first
one is a visible share of the step. With PDL (``launch_pdl=True``, Hopper and later) a
kernel may be launched while the previous one still runs; it waits for the previous one's
memory with ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``) before it reads what that
kernel wrote, and the previous kernel may signal early (``gdc_launch_dependents``).

Rows (µs per kernel, chains recorded in one CUDA graph, median of ``--repeats``):

- ``row chain``: ``--chain`` launches of a row kernel over ``[--rows, --dim]`` bf16 (an
  add + RMS norm's traffic: read two rows, write one), each reading the previous one's
  output: without PDL; with PDL and a wait at the top; with PDL, the wait after the
  kernel's independent prologue and an early trigger;
- ``gemm + row``: a cuBLAS GEMM (``[rows, dim] x [dim, dim]``) then the row kernel, alternately:
  whether a PDL row kernel gains anything after a kernel that does not trigger.

Each PDL chain's final output is compared with the plain chain's (bitwise): a missing wait
would show as a mismatch. Needs a CUDA device of compute capability 9.0 or later.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from cuda_timing import graph_median_ms


@triton.jit
def _row_kernel(x_ptr, r_ptr, y_ptr, D, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                EARLY: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    # independent prologue: the residual row is not written by the previous kernel
    r = tl.load(r_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    if WAIT:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    s = x + r
    y = s * tl.math.rsqrt(tl.sum(s * s, axis=0) / D + 1e-6)
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _row(x, r, y, pdl: bool, early: bool) -> None:
    rows, d = x.shape
    _row_kernel[(rows,)](x, r, y, d, BLOCK=triton.next_power_of_2(d), WAIT=pdl,
                         EARLY=early, launch_pdl=pdl, num_warps=4)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("bench_pdl: needs a CUDA device of compute capability 9.0 or later")
        return 1
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shape = (args.rows, args.dim)
    r = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    w = torch.randn(args.dim, args.dim, device=dev, dtype=torch.bfloat16) / args.dim**0.5
    x0 = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    bufs = [torch.empty_like(x0) for _ in range(2)]
    g_out = torch.empty_like(x0)

    def chain(pdl: bool, early: bool):
        def run():
            src = x0
            for i in range(args.chain):
                dst = bufs[i % 2]
                _row(src, r, dst, pdl, early)
                src = dst

        return run

    def gemm_chain(pdl: bool, early: bool):
        def run():
            src = x0
            for i in range(args.chain // 2):
                torch.mm(src, w, out=g_out)
                dst = bufs[i % 2]
                _row(g_out, r, dst, pdl, early)
                src = dst

        return run

    rows = []
    finals = {}
    for name, make, per in (("row chain", chain, args.chain), ("gemm + row", gemm_chain,
                                                                args.chain)):  # fmt: skip
        for label, pdl, early in (("plain", False, False), ("pdl, wait", True, False),
                                  ("pdl, wait + early trigger", True, True)):  # fmt: skip
            fn = make(pdl, early)
            try:
                us = graph_median_ms(fn, warmup=1, iters=1, repeats=args.repeats) * 1e3 / per
            except Exception as e:  # e.g. a driver that refuses PDL inside a capture
                rows.append({"chain": name, "launch": label, "error": repr(e)})
                continue
            fn()
            torch.cuda.synchronize()
            out = bufs[(args.chain // (1 if name == "row chain" else 2) - 1) % 2].clone()
            same = None
            if label == "plain":
                finals[name] = out
            else:
                same = bool(torch.equal(out, finals[name]))
            rows.append({"chain": name, "launch": label, "us_per_kernel": us, "equal": same})
    print(
        f"bench_pdl: {torch.cuda.get_device_name()}, rows {args.rows} x {args.dim} bf16, "
        f"chains of {args.chain} kernels in one CUDA graph, median of {args.repeats}"
    )
    for row in rows:
        if "error" in row:
            print(f"  {row['chain']:<12} {row['launch']:<28} failed: {row['error']}")
            continue
        eq = "" if row["equal"] is None else f"  equal to plain: {row['equal']}"
        print(f"  {row['chain']:<12} {row['launch']:<28} {row['us_per_kernel']:7.2f} us{eq}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
