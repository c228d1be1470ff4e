"""Where the first engine steps of a bench run spend their time, static pools vs the unified
arena (the bench times every step from the first admission on, so a one-time cost of the
first steps counts in its unified / static throughput ratio).

Runs the ``bench`` protocol's setup (the ``small`` preset, its prompts, DSPARK gamma 7 without
acceptance control, page 64, all requests running, FA4 and CUDA graphs), its warm-up (every
kernel compiled), then per memory kind a fresh pool and engine whose first ``--steps``
steps run one at a time under cProfile with a device synchronisation after each: wall time
per step, then the functions with the largest cumulative time over those steps.

    python benchmark/profile_first_steps.py --steps 4 --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from unimem.engine.core import EngineCore
from unimem.engine.draft_runner import draft_config_for
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter
from unimem.validate import protocol as P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--requests", type=int, default=48)
    args = ap.parse_args()
    cfg = P.bench_config(requests=args.requests, output_len=64)
    dev = torch.device(cfg.device)
    model, prompts = P.build_model_and_prompts(cfg, dev)
    drafter = DsparkDrafter(
        draft_config_for(model.config), model.embed_weight, model.lm_head_weight, seed=17
    )
    lanes = drafter.config.lanes()
    P._warm_up(model, cfg, prompts, DsparkChain(drafter, cfg.gamma))
    first = P.static_pool(cfg, model.config, dev, lanes)
    default_bytes = first.stats.capacity_bytes + P._header(first)
    del first
    print(f"{torch.cuda.get_device_name(dev)}: small preset, {len(prompts)} x {cfg.input_len} "
          f"prompts, chunk {cfg.chunk_size}, first {args.steps} steps")  # fmt: skip
    for kind in ("static", "unified", "static", "unified"):
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
        prof = cProfile.Profile()
        walls = []
        for _ in range(args.steps):
            t = time.perf_counter()
            prof.enable()
            eng.step()
            torch.cuda.synchronize(dev)
            prof.disable()
            walls.append((time.perf_counter() - t) * 1e3)
        print(f"[{kind}] step wall ms (synchronised): {', '.join(f'{w:.1f}' for w in walls)}")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        print("\n".join(lines[-args.top - 1 :]))
        del eng, pool
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
