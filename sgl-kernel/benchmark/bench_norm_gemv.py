"""``unimem_kernel.norm_linear`` against the launches it replaces, at a small model's decode shapes.

For each projection of a Gemma 3 270M layer (``--shapes``; ``d`` 640, 4 query and 1 KV heads
of 256, MLP 2048) and each row count (``--rows``), GPU time per call inside CUDA graphs of:

- ``chain``: the unfused launches (``norm_add_rms_norm`` + ``F.linear`` [+ ``gelu_tanh_mul``];
  ``F.linear`` alone for the projections with no norm in front);
- ``fused``: ``norm_linear`` under every candidate tile (``BLOCK_N`` x ``BLOCK_K``, warps,
  stages), each first checked against the reference (a tile that gives a wrong result fails
  the run);

and prints the best tile's time next to the chain's. ``--configs-out PATH`` writes the
fastest tiles in the tuned table's format (``unimem_kernel/norm_gemv_configs.json``: GPU name
-> ``"N,K,act"`` -> ``[[max_rows, "BN,BK,warps,stages"], ...]``; copy it there to use it),
``--json PATH`` every timing.

    python sgl-kernel/benchmark/bench_norm_gemv.py --json out.json --configs-out cfg.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

SHAPES = {
    # name: (N, K, mode, act); mode 0 plain, 2 post-norm + add + norm in front
    "qkv": (1536, 640, 2, None),
    "o_proj": (640, 1024, 0, None),
    "gate_up": (4096, 640, 2, "gelu_tanh"),
    "down": (640, 2048, 0, None),
}
EPS = 1e-6


def candidates(n_out: int, rows: int) -> list[str]:
    """Tiles worth timing. One row (CUDA cores): 4-16 output columns per program, 256-1024
    of ``K`` a step; more rows (tensor cores): 16-32 columns, 64-256 of ``K``; a few (warps,
    stages) pairs each, at most 8192 weight elements a step, at least 8 programs."""
    if rows == 1:
        sizes, pairs = ((4, 8, 16), (256, 512, 1024)), ((4, 1), (4, 3), (8, 2))
    else:
        sizes, pairs = ((16, 32), (64, 128, 256)), ((4, 3), (4, 4), (8, 3))
    out = []
    for bn in sizes[0]:
        for bk in sizes[1]:
            if bn * bk > 8192 or n_out // bn < 8:
                continue
            out += [f"{bn},{bk},{w},{st}" for w, st in pairs]
    return out


def inputs(name: str, m: int, gen: torch.Generator, dev) -> tuple:
    """``(x, weight, norm_weight, kwargs)`` of ``m`` rows of projection ``name`` in bf16."""
    n, k, mode, act = SHAPES[name]
    dt = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt)

    x, w = rnd(m, k), rnd(n, k, scale=k**-0.5)
    nw = rnd(k, scale=0.3) if mode else None
    kw = {"zero_centered": True, "act": act}
    if mode == 2:
        kw.update(delta=rnd(m, k, scale=3.0), post_weight=rnd(k, scale=0.3))
    return x, w, nw, kw


def measure(name: str, m: int, gen: torch.Generator, dev, deadline: float) -> dict:
    """The chain's time and every candidate tile's for ``m`` rows of ``name`` (µs)."""
    from unimem_kernel import gelu_tanh_mul, norm_add_rms_norm
    from unimem_kernel.norm_gemv import NormLinearConfig, norm_linear_reference, norm_linear_triton
    from unimem_kernel.timing import graph_median_ms

    x, w, nw, kw = inputs(name, m, gen, dev)
    act, d, pw = kw["act"], kw.get("delta"), kw.get("post_weight")

    def us(fn) -> float:
        return 1e3 * graph_median_ms(fn, warmup=2, iters=20, repeats=7)

    def chain():
        h = x
        if d is not None:
            h = norm_add_rms_norm(x, d, pw, nw, EPS, zero_centered=True)[1]
        y = F.linear(h, w)
        return gelu_tanh_mul(y) if act else y

    def f32(t):
        return None if t is None else t.float()

    ref_kw = {**kw, "delta": f32(d), "post_weight": f32(pw)}
    ref = norm_linear_reference(x.float(), w.float(), f32(nw), EPS, **ref_kw)[1]
    out = {"shape": name, "rows": m, "chain_us": us(chain), "tiles": {}, "wrong": []}
    for spec in candidates(w.shape[0] // 2 if act else w.shape[0], m):
        cfg = NormLinearConfig.parse(spec)
        got = norm_linear_triton(x, w, nw, EPS, config=cfg, **kw)[1]
        err = ((got.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            out["wrong"].append(spec)
            print(f"  WRONG {name} rows {m} tile {spec}: relative error {err:.3g}")
            continue
        out["tiles"][spec] = us(partial(norm_linear_triton, x, w, nw, EPS, config=cfg, **kw))
        if time.time() > deadline:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs-out", default=None)
    ap.add_argument("--budget-s", type=float, default=200.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_norm_gemv: needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    deadline = time.time() + args.budget_s
    rows, table, wrong = [], {}, 0
    print(f"GPU {gpu}, bf16, torch {torch.__version__}", flush=True)
    for m in (int(r) for r in args.rows.split(",")):  # every shape at one row count first
        for name in args.shapes:
            n, k, _, act = SHAPES[name]
            r = measure(name, m, gen, dev, deadline)
            wrong += len(r["wrong"])
            rows.append(r)
            if not r["tiles"]:
                continue
            spec, t = min(r["tiles"].items(), key=lambda kv: kv[1])
            r.update(best_config=spec, best_fused_us=t)
            mb = n * k * 2 / 1e6
            print(f"{name:8s} N={n} K={k} rows={m:3d}: chain {r['chain_us']:6.2f} us, "
                  f"norm_linear {t:6.2f} us ({spec}), {r['chain_us'] / t:.2f}x; weight "
                  f"{mb:.2f} MB at {mb / t:.2f} TB/s", flush=True)  # fmt: skip
            table.setdefault(f"{n},{k},{act or 'none'}", []).append([m, spec])
            if time.time() > deadline:
                print(f"budget of {args.budget_s} s spent: stopping")
                break
        if time.time() > deadline:
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    if args.configs_out:
        with open(args.configs_out, "w") as f:
            json.dump({gpu: table}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
