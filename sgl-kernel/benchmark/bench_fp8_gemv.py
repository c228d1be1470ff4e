"""The few-row FP8 product (:func:`unimem_kernel.fp8_gemv.fp8_gemv`, one launch that quantises
its rows) against the tensor-core path it replaces (the quantisation launch, the Triton FP8
GEMM and, where it splits K, the partials' sum), at a decode step's rows.

Shapes: Qwen3-Next-80B's dense FP8 projections (``--shapes N x K``: GDN ``in_proj_qkvz`` and
``out_proj``, attention ``q_proj`` (gated) and ``o_proj``, the shared expert's gate-up and
down) at ``--rows`` rows, and its routed experts (512 experts, top-10; gate-up ``1024 x
2048`` with the token gather, down ``2048 x 512``) at ``--tokens`` tokens of random distinct
routes. Each timed call reads its weights from HBM, as a step's layers do: dense products
cycle through enough copies of the weight to exceed the L2 cache, the experts' through
``ROUTES`` different routes (other experts each call). Every product is
timed in CUDA graphs (:func:`unimem_kernel.timing.graph_median_ms`), µs per product.

First every tile of ``--sweep`` (``BN/G/warps/stages`` specs) at the first row count and the
first token count; then the tile :func:`~unimem_kernel.fp8_gemv.fp8_gemv_config` sizes
("sized"), the best of the sweep (by the summed time over all the shapes there) and the
tensor-core path at every row and token count. Checks each product against the tensor-core
path's (relative error of the bf16 outputs) and, for the dense ones, both (float32 outputs)
against the float64 product of the quantised operands. ``--json`` writes every timing; ``--best-out
FILE`` writes the best tile's spec (for ``UNIMEM_FP8_GEMV_CONFIG`` in a later command).

    python sgl-kernel/benchmark/bench_fp8_gemv.py --json out.json --best-out best.txt
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from unimem_kernel import moe_route
from unimem_kernel.fp8_gemm import (
    dequantize,
    fp8_grouped_linear,
    fp8_linear,
    fp8_quantize_groups,
    fp8_quantize_groups_reference,
)
from unimem_kernel.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_config
from unimem_kernel.timing import graph_median_ms

DEFAULT_SHAPES = "12288x2048,2048x4096,8192x2048,2048x4096,1024x2048,2048x512"
EXPERTS, TOP_K, EXPERT_FFN, HIDDEN = 512, 10, 512, 2048
DEFAULT_SWEEP = ",".join(
    f"{bn}/{g}/{w}/{s}" for bn, g, w, s in itertools.product((4, 8, 16, 32), (4, 8), (2, 4), (1,))
)
L2_BYTES = 256 << 20
"""Weight bytes cycled through per dense timing (past any Hopper L2)."""
ROUTES = 16
"""Routes cycled through per expert timing."""
ITERS = 48


def _fp8_weights(lead: tuple[int, ...], n: int, k: int, dev: torch.device, copies: int):
    out = []
    for _ in range(copies):
        w = torch.randn(*lead, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        q, s = fp8_quantize_groups(w.reshape(-1, k))
        out.append((q.view(*lead, n, k), s.view(*lead, n, -1)))
    return out


def _copies(nbytes: int) -> int:
    return max(2, -(-L2_BYTES // max(nbytes, 1)))


def _time(product, calls) -> float:
    """µs per product, cycling through the argument tuples ``calls`` in the captured calls."""
    cycle = itertools.cycle(calls)
    return 1e3 * graph_median_ms(lambda: product(*next(cycle)), iters=ITERS)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _exact(wq, ws, x) -> torch.Tensor:
    """The dense product of the quantised operands in float64."""
    xq, xs = fp8_quantize_groups_reference(x)
    return dequantize(xq, xs).double() @ dequantize(wq, ws).double().t()


class Case:
    """One product: dense ``N x K`` at ``rows`` rows, or the routed experts' gate-up / down at
    ``rows`` tokens. ``weights``: the dense weight's copies ``[(wq, ws), ...]``, or the
    experts' ``(wq, ws)``, made once per shape. :attr:`calls`: the argument tuples ``(wq, ws,
    x, offs, rows)`` the timed calls cycle through."""

    def __init__(self, kind: str, n: int, k: int, rows: int, dev: torch.device, weights) -> None:
        self.kind, self.n, self.k, self.rows = kind, n, k, rows
        gen = torch.Generator(device=dev).manual_seed(n * 7 + k + rows)
        if kind == "dense":
            x = torch.randn(rows, k, device=dev, generator=gen).bfloat16() * 3
            self.calls = [(wq, ws, x, None, None) for wq, ws in weights]
            return
        wq, ws = weights
        self.calls = []
        for _ in range(ROUTES):
            scores = torch.rand(rows, EXPERTS, device=dev, generator=gen)
            route = moe_route(scores.topk(TOP_K, dim=1).indices, EXPERTS)
            if kind == "gate_up":  # reads the token rows through the gather
                x = torch.randn(rows, k, device=dev, generator=gen).bfloat16() * 3
                self.calls.append((wq, ws, x, route.ends, route.token))
            else:  # down: the activation rows are already in expert order
                x = torch.randn(rows * TOP_K, k, device=dev, generator=gen).bfloat16() * 3
                self.calls.append((wq, ws, x, route.ends, None))

    @property
    def label(self) -> str:
        unit = "rows" if self.kind == "dense" else "tokens"
        return f"{self.kind} {self.n}x{self.k} {unit} {self.rows}"

    @staticmethod
    def tensor_cores(wq, ws, x, offs, rows):
        if offs is None:
            return fp8_linear(x, wq, ws)
        return fp8_grouped_linear(x, wq, ws, offs, rows)

    @staticmethod
    def gemv(cfg: Fp8GemvConfig):
        def run(wq, ws, x, offs, rows):
            return fp8_gemv(x, wq, ws, offs, rows, config=cfg)

        return run


def _cases(shapes, rows: int, tokens: int, dense, experts, dev) -> list[Case]:
    cases = [Case("dense", n, k, rows, dev, dense[n, k]) for n, k in shapes]
    cases.append(Case("gate_up", 2 * EXPERT_FFN, HIDDEN, tokens, dev, experts["gate_up"]))
    cases.append(Case("down", HIDDEN, EXPERT_FFN, tokens, dev, experts["down"]))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--tokens", default="1,2,4,8,48")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="N x K, comma-separated")
    ap.add_argument("--sweep", default=DEFAULT_SWEEP, help="tiles BN/G/warps/stages, commas")
    ap.add_argument("--json", default=None)
    ap.add_argument("--best-out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_gemv: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    os.environ["UNIMEM_KERNEL_BACKEND"] = "triton"
    os.environ["UNIMEM_FP8_GEMV_ROWS"] = "0"  # fp8_linear: the tensor-core path
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; torch {torch.__version__}; µs per product in CUDA graphs, weights from HBM")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    tokens_list = [int(t) for t in args.tokens.split(",")]
    sweep = [Fp8GemvConfig.parse(s.replace("/", ",")) for s in args.sweep.split(",")]

    # the weights, made once: each dense shape's copies, one set of experts (the routes vary)
    dense = {(n, k): _fp8_weights((), n, k, dev, _copies(n * k)) for n, k in set(shapes)}
    experts = {
        "gate_up": _fp8_weights((EXPERTS,), 2 * EXPERT_FFN, HIDDEN, dev, 1)[0],
        "down": _fp8_weights((EXPERTS,), HIDDEN, EXPERT_FFN, dev, 1)[0],
    }
    # the sweep at the first row and token counts
    first = _cases(shapes, rows_list[0], tokens_list[0], dense, experts, dev)
    sweep_rows, totals = [], {}
    for cfg in sweep:
        us = [_time(c.gemv(cfg), c.calls) for c in first]
        totals[cfg] = sum(us)
        sweep_rows.append({"tile": cfg.spec(), "us": dict(zip([c.label for c in first], us,
                                                              strict=True)),
                           "total_us": sum(us)})  # fmt: skip
        print(
            f"sweep {cfg.spec():>10}: "
            + " ".join(f"{u:6.2f}" for u in us)
            + f"  sum {sum(us):7.2f}"
        )
    best = min(totals, key=totals.get)
    print(f"best tile {best.spec()} (sum {totals[best]:.2f} µs)")

    # every row / token count: tensor cores, the sized tile, the sweep's best
    results = []
    for r, t in itertools.zip_longest(rows_list, tokens_list):
        cases = _cases(shapes, r or rows_list[0], t or tokens_list[0], dense, experts, dev)
        for c in cases:
            if c.kind == "dense" and r is None or c.kind != "dense" and t is None:
                continue
            want = c.tensor_cores(*c.calls[0])
            row = {"case": c.label, "kind": c.kind, "n": c.n, "k": c.k, "rows": c.rows,
                   "tensor_cores_us": _time(c.tensor_cores, c.calls)}  # fmt: skip
            sized = fp8_gemv_config(c.n, c.k, c.calls[0][2].shape[0] if c.kind == "dense"
                                    else c.rows * TOP_K)  # fmt: skip
            row["sized_tile"] = sized.spec()
            for name, cfg in (("sized", sized), ("best", best)):
                row[f"gemv_{name}_us"] = _time(c.gemv(cfg), c.calls)
                row[f"gemv_{name}_rel_err"] = _rel_err(c.gemv(cfg)(*c.calls[0]), want)
            if c.kind == "dense":  # float32 outputs against the float64 product
                wq, ws, x = c.calls[0][:3]
                exact = _exact(wq, ws, x)
                fp32 = (wq, ws, x.float(), None, None)
                row["tensor_cores_err_vs_f64"] = _rel_err(c.tensor_cores(*fp32), exact)
                row["gemv_err_vs_f64"] = _rel_err(c.gemv(sized)(*fp32), exact)
            results.append(row)
            f64 = (f"  vs float64: tensor cores {row['tensor_cores_err_vs_f64']:.1e}, gemv "
                   f"{row['gemv_err_vs_f64']:.1e}" if c.kind == "dense" else "")  # fmt: skip
            print(
                f"{c.label:>32}: tensor cores {row['tensor_cores_us']:7.2f}  gemv sized "
                f"{sized.spec():>9} {row['gemv_sized_us']:7.2f}  best {row['gemv_best_us']:7.2f}"
                f"  (rel err {row['gemv_sized_rel_err']:.1e}){f64}"
            )
            if row["gemv_best_rel_err"] > 2e-2 or row["gemv_sized_rel_err"] > 2e-2:
                print(f"bench_fp8_gemv: {c.label} differs from the tensor-core product",
                      file=sys.stderr)  # fmt: skip
                return 1
    if args.best_out:
        with open(args.best_out, "w") as f:
            f.write(best.spec() + "\n")
    if args.json:
        with open(args.json, "w") as f:
            record = {"gpu": gpu, "torch": torch.__version__, "best": best.spec(),
                      "sweep": sweep_rows, "rows": results}  # fmt: skip
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
