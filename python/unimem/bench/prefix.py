"""Prefix cache on a shared-prefix workload: hit rate and throughput with and without the
cache, static and unified memory (CPU ok: the float64 ``tiny`` preset).

Every request's prompt is a common prefix (``--shared-prefix-len``) followed by unique tokens;
the same requests run four times (static / unified memory x cache off / on) and must give
the same outputs. The unified arena has the bytes of the static pools with the cache on
(those have extra state slots for checkpoints) in both of its runs.

    python -m unimem bench prefix [--requests 16 --shared-prefix-len 256 --unique-len 32
                                   --output-len 32] [--json out.json]

Exit status 1 when the four runs' outputs differ.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace

import torch

from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.validate.protocol import (
    ValidateConfig,
    make_prompts,
    run_one,
    sink_bytes,
    static_pool,
    unified_pool,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m unimem bench prefix", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--shared-prefix-len", type=int, default=256)
    ap.add_argument("--unique-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--checkpoint-interval", type=int, default=4)
    ap.add_argument("--cpu-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(a.cpu_threads)
    on = ValidateConfig(
        device=a.device,
        preset=a.preset,
        requests=a.requests,
        input_len=a.shared_prefix_len + a.unique_len,
        output_len=a.output_len,
        seed=a.seed,
        page_size=a.page_size,
        max_running=a.max_running,
        chunk_size=a.chunk_size,
        prefix_cache=True,
        shared_prefix_len=a.shared_prefix_len,
        checkpoint_interval=a.checkpoint_interval,
    )
    off = replace(on, prefix_cache=False)
    device = torch.device(a.device)
    model_cfg = preset(a.preset)
    model = HybridModel(model_cfg, seed=a.seed, device=device)
    prompts = make_prompts(on, model_cfg.vocab_size)
    s_on = static_pool(on, model_cfg, device)
    arena = s_on.stats.capacity_bytes + sink_bytes(s_on)
    del s_on
    rows, outputs = [], {}
    for mode in ("static", "unified"):
        for cfg in (off, on):
            pool = (
                static_pool(cfg, model_cfg, device)
                if mode == "static"
                else unified_pool(cfg, model_cfg, device, arena)
            )
            res = run_one(model, pool, cfg, prompts, f"{mode} cache {cfg.prefix_cache}", False)
            c = res.prefix_cache or {}
            prefill = a.requests * cfg.input_len
            rows.append(
                {
                    "memory": mode,
                    "cache": "on" if cfg.prefix_cache else "off",
                    "hit_rate": c.get("hit_rate", 0.0),
                    "hit_tokens": c.get("hit_tokens", 0),
                    "prefill_tokens_computed": prefill - c.get("cached_tokens", 0),
                    "throughput_tok_s": res.output_tokens / res.seconds,
                    "seconds": res.seconds,
                    "steps": res.steps,
                    "peak_bytes": res.peak_bytes,
                    "capacity_bytes": res.capacity_bytes,
                    "evictions": c.get("evictions", 0),
                    "checkpoints_saved": c.get("checkpoints_saved", 0),
                    "retained_swa_pages": c.get("retained_swa_pages", 0),
                    "retractions": res.retractions,
                }
            )
            outputs[(mode, rows[-1]["cache"])] = res.outputs
    ref = outputs[("static", "off")]
    report = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "settings": vars(a),
        "identical_outputs": all(o == ref for o in outputs.values()),
        "runs": rows,
    }
    cols = "memory | cache | hit rate | hit tokens | prefill computed | tok/s | s | steps"
    print(f"| {cols} | peak MiB | evictions | checkpoints |")
    print("|" + "---|" * 11)
    for r in rows:
        print(
            f"| {r['memory']} | {r['cache']} | {r['hit_rate']:.3f} | {r['hit_tokens']} | "
            f"{r['prefill_tokens_computed']} | {r['throughput_tok_s']:.1f} | {r['seconds']:.2f} | "
            f"{r['steps']} | {r['peak_bytes'] / 2**20:.1f} | {r['evictions']} | "
            f"{r['checkpoints_saved']} |"
        )
    print(f"identical outputs across the four runs: {report['identical_outputs']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["identical_outputs"] else 1
