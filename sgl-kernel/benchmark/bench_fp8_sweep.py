"""The tile sweep of ``bench_fp8_gemm.py --sweep``: the Triton block-scaled FP8 GEMM
(:func:`unimem_kernel.fp8_gemm`, the GEMM alone on pre-quantised activations) under each
candidate tile, forced through ``UNIMEM_FP8_GEMM_CONFIG``, per shape and row count; writes
the fastest as the tuned table (``unimem_kernel.fp8_gemm.TUNED_CONFIGS``' format)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from bench_gemm_shapes import SHAPES

from unimem_kernel.timing import graph_median_ms

SMS_WAVES = 4
"""Split-K is only tried while the programs fit in this many waves of the GPU's SMs."""


def candidates(m: int, n: int, k: int, sms: int) -> list[str]:
    """Tiles worth timing for ``m`` rows of an ``N x K`` product: row tiles from 16 up to
    the rows' power of two (at most 128; one row tile is the weight read once), column tiles
    32-256, one or two (warps, stages) per size, split-K 1, 2, 4 (8 for ``K`` >= 4096) while
    the programs stay within :data:`SMS_WAVES` waves and each run has >= 2 groups."""
    from unimem_kernel._dispatch import next_pow2

    kg = -(-k // 128)
    top = min(128, max(16, next_pow2(m)))
    out = []
    for bm in (16, 32, 64, 128):
        if bm > top or bm < top // 4:
            continue
        for bn in (32, 64, 128, 256):
            if bn == 256 and bm < 64:
                continue
            if bm <= 32:
                warps_stages = [(4, 4)]
            elif bm * bn <= 64 * 128:
                warps_stages = [(4, 3), (4, 5)]
            else:
                warps_stages = [(8, 3), (4, 3)]
            tiles = -(-m // bm) * -(-n // bn)
            for w, st in warps_stages:
                for split in (1, 2, 4, 8):
                    if split == 8 and k < 4096:
                        continue
                    if split > 1 and (tiles * split > SMS_WAVES * sms or kg // split < 2):
                        continue
                    out.append(f"{bm}x{bn},{w},{st},{split}")
    return out


def sweep(args, g: torch.Generator) -> int:
    """Run the sweep (module docstring); 0, or 1 when a tile gives a wrong product."""
    from unimem_kernel.fp8_gemm import (
        Fp8GemmConfig,
        fp8_gemm,
        fp8_gemm_config,
        fp8_gemm_reference,
        fp8_quantize_groups,
        quantize_blockwise,
    )

    dev = g.device
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count

    def us(fn) -> float:
        return 1e3 * graph_median_ms(fn, warmup=2, iters=20, repeats=3)

    t0 = time.perf_counter()
    table: dict[str, list[list]] = {}
    results = []
    invariant_total: dict[str, float] = {}  # tiles without split-K: summed time
    bad = 0
    print(f"sweep: shapes {args.sweep_shapes}, rows {args.sweep_m}, budget {args.sweep_budget_s} s")
    weights = {}
    for name in args.sweep_shapes:
        k, n, _ = SHAPES[name]
        w = (torch.randn(n, k, generator=g, device=dev) / k**0.5).bfloat16()
        weights[name] = (w, *quantize_blockwise(w))
    for m in args.sweep_m:  # in the order given: the sizes that matter most first
        for name in args.sweep_shapes:
            k, n, _ = SHAPES[name]
            w, wq, ws = weights[name]
            if time.perf_counter() - t0 > args.sweep_budget_s:
                print(f"sweep: budget spent, {name} at {m} rows and later not swept")
                break
            a = torch.randn(m, k, generator=g, device=dev).bfloat16()
            xq, xs = fp8_quantize_groups(a)
            ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=torch.float32)
            bf16_us = us(lambda: F.linear(a, w))  # noqa: B023 (timed at once)
            quant_us = us(lambda: fp8_quantize_groups(a))  # noqa: B023
            default = fp8_gemm_config(m, shape=(n, k), device=dev).spec()
            times: dict[str, float] = {}
            for spec in dict.fromkeys([default, *candidates(m, n, k, sms)]):
                os.environ["UNIMEM_FP8_GEMM_CONFIG"] = spec
                try:
                    y = fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32)
                    err = float((y - ref).abs().max() / ref.abs().max())
                    if err > 1e-3:
                        print(f"  {name} m {m} {spec}: WRONG (rel {err:.1e})")
                        bad += 1
                        continue
                    times[spec] = us(
                        lambda: fp8_gemm(xq, xs, wq, ws, out_dtype=torch.bfloat16)  # noqa: B023
                    )
                except Exception as e:  # a tile this GPU cannot run (shared memory, ...)
                    print(f"  {name} m {m} {spec}: failed ({str(e).splitlines()[0][:80]})")
                finally:
                    del os.environ["UNIMEM_FP8_GEMM_CONFIG"]
            best = min(times, key=times.get)
            for spec, t in times.items():
                if Fp8GemmConfig.parse(spec).split_k == 1:
                    invariant_total[spec] = invariant_total.get(spec, 0.0) + t
            table.setdefault(f"{n},{k}", []).append([m, best])
            row = {"shape": name, "n": n, "k": k, "m": m, "bf16_us": bf16_us,
                   "quant_us": quant_us, "default": default,
                   "default_us": times.get(default), "best": best, "best_us": times[best],
                   "times_us": times}  # fmt: skip
            results.append(row)
            print(
                f"{name:10s} m {m:4d}  bf16 {bf16_us:6.1f}  fp8 default {default:16s} "
                f"{times.get(default, float('nan')):6.1f}  best {best:16s} {times[best]:6.1f}"
                f"  + quant {quant_us:5.1f}  -> fp8 {times[best] + quant_us:6.1f} us"
                f"  ({len(times)} tiles, {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    table = {shape: sorted(rows) for shape, rows in table.items()}
    # among tiles without split-K timed at every swept size (the invariant tile serves all)
    full = {s: t for s, t in invariant_total.items()
            if all(s in r["times_us"] for r in results)}  # fmt: skip
    inv = min(full, key=full.get) if full else None
    print(f"fastest tile without split-K over all swept sizes (invariant candidate): {inv}")
    # the table is keyed by GPU name: this card's entry replaces its old one, other cards' stay
    tables = {}
    if os.path.exists(args.sweep_out):
        with open(args.sweep_out) as f:
            tables = json.load(f)
    tables[props.name] = table
    with open(args.sweep_out, "w") as f:
        json.dump(tables, f, indent=1)
    print(
        f"wrote this GPU's entry of the tuned table {args.sweep_out} "
        f"({len(tables)} GPU(s); copy to unimem_kernel/fp8_gemm_configs.json)"
    )
    if args.json:
        out = {"gpu": props.name, "torch": torch.__version__, "sweep": results,
               "invariant_candidate": inv, "table": {props.name: table}}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0
