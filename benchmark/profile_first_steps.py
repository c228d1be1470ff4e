"""Where the first engine steps of a bench run spend their time, static pools vs the unified
arena (the bench times every step from the first admission on, so a one-time cost of the
first steps counts in its unified / static throughput ratio).

Runs the ``bench`` protocol's setup (the ``small`` preset, its prompts, DSPARK gamma 7 without
acceptance control, page 64, all requests running, FA4 and CUDA graphs), its warm-up (every
kernel compiled), then per memory kind a fresh pool and engine whose first ``--steps``
steps run one at a time under cProfile with a device synchronisation after each: wall time
per step, then the functions with the largest cumulative time over those steps.

``--kernels N`` profiles the same steps' GPU work instead of the host's: each step's GPU time
(CUDA events), then ``torch.profiler`` over the steps, kernels summed over them by the
categories of ``profile_step.py`` and the ``N`` kernels with the most time (prefill chunks run
eagerly, verify steps as graph replays; both are listed).

    python benchmark/profile_first_steps.py --steps 4 --top 25
    python benchmark/profile_first_steps.py --steps 4 --kernels 25 --memory static
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch
from profile_step import category

from unimem.engine.core import EngineCore
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.validate import protocol as P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="profile the steps' GPU kernels (this many listed) instead of the host",
    )
    ap.add_argument(
        "--memory", default="static,unified,static,unified", help="comma-separated kinds, in order"
    )
    args = ap.parse_args()
    kinds = args.memory.split(",")
    if not set(kinds) <= {"static", "unified"}:
        ap.error(f"--memory: kinds are static and unified, got {args.memory!r}")
    cfg = P.bench_config(requests=args.requests, output_len=64)
    dev = torch.device(cfg.device)
    model, prompts = P.build_model_and_prompts(cfg, dev)
    drafter = DsparkDrafter(
        draft_config_for(model.config), model.embed_weight, model.lm_head_weight, seed=17
    )
    lanes = drafter.config.lanes()
    P.warm_up(model, cfg, prompts, DsparkChain(drafter, cfg.gamma))
    first = P.static_pool(cfg, model.config, dev, lanes)
    default_bytes = first.stats.capacity_bytes + P.sink_bytes(first)
    del first
    print(f"{torch.cuda.get_device_name(dev)}: small preset, {len(prompts)} x {cfg.input_len} "
          f"prompts, chunk {cfg.chunk_size}, first {args.steps} steps")  # fmt: skip
    for kind in kinds:
        if kind == "static":
            pool = P.static_pool(cfg, model.config, dev, lanes)
        else:
            pool = P.unified_pool(cfg, model.config, dev, default_bytes, lanes)
        eng = EngineCore(model, pool, P.make_backend(cfg.attention_backend), cfg.max_running,
                         cfg.chunk_size, chain=DsparkChain(drafter, cfg.gamma),
                         cuda_graphs=cfg.use_cuda_graphs)  # fmt: skip
        for p in prompts:
            eng.submit(p, cfg.output_len)
        torch.cuda.synchronize(dev)
        if args.kernels:
            profile_kernels(eng, kind, args.steps, args.kernels, dev)
        else:
            profile_host(eng, kind, args.steps, args.top, dev)
        del eng, pool
    return 0


def profile_host(eng: EngineCore, kind: str, steps: int, top: int, dev: torch.device) -> None:
    """``steps`` engine steps, one at a time under cProfile: wall per step, then the ``top``
    functions by cumulative time."""
    prof = cProfile.Profile()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        prof.enable()
        eng.step()
        torch.cuda.synchronize(dev)
        prof.disable()
        walls.append((time.perf_counter() - t) * 1e3)
    print(f"[{kind}] step wall ms (synchronised): {', '.join(f'{w:.1f}' for w in walls)}")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    print("\n".join(lines[-top - 1 :]))


def profile_kernels(eng: EngineCore, kind: str, steps: int, top: int, dev: torch.device) -> None:
    """``steps`` engine steps, one at a time under ``torch.profiler`` (CUDA activity only):
    each step's GPU time by CUDA events around it (synchronised before the next starts; the
    profiler adds little to kernel times) and its host time until ``step()`` returns (the GPU
    work is launched, not waited for: a host time near the GPU time means a host-bound
    step), then the kernels summed over the steps by category and the ``top`` kernels."""
    gpu_ms, host_ms = [], []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            eng.step()
            end.record()
            host_ms.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize(dev)
            gpu_ms.append(start.elapsed_time(end))
    print(f"[{kind}] step GPU ms (events, synchronised): {', '.join(f'{t:.1f}' for t in gpu_ms)}")
    print(f"[{kind}] step host ms (until step() returns): "
          f"{', '.join(f'{t:.1f}' for t in host_ms)}")  # fmt: skip
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us > 0:
            per_cat[category(evt.key)] += us / 1000
            per_kernel[evt.key[:150]][0] += us / 1000
            per_kernel[evt.key[:150]][1] += evt.count
    total = sum(per_cat.values())
    print(f"  {'kernels by category, summed over the steps':<52}{'ms':>9}{'share':>8}")
    for label, ms in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<52}{ms:>9.2f}{100 * ms / total:>7.1f}%")
    print(f"  {'sum of kernel time':<52}{total:>9.2f}")
    print("  top kernels (ms, calls):")
    for name, (ms, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {ms:8.2f} {calls:6.0f}  {name}")


if __name__ == "__main__":
    raise SystemExit(main())
