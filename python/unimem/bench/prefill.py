"""Time to first token of long prompts on one GPU: GDN prefill through the recurrent kernel
against fla's chunked kernel (``unimem.models.gdn_prefill``), side by side in one process.

Builds the ``small`` preset (8 GDN, 4 SWA, 4 FULL layers; bf16) over static pools with the FA4
backend and no prefix cache, then for each ``--requests`` count, each ``--lens`` prompt length
and each mode of ``UNIMEM_GDN_CHUNKED_PREFILL`` (``off``: recurrent; ``fla``; ``auto``: the
default's choice) submits that many requests of that many random tokens, each for one output
token, and times ``EngineCore.run`` (prefill in chunks of ``--chunk`` tokens, packed across the
requests, then the sampled tokens read back): the median of ``--repeats`` after one warm-up run
per mode and size (fla autotunes its kernels on first use). Prints the GPU, the settings and a
table of ms and ratios against ``off``; ``--json PATH`` writes the rows.

    python -m unimem bench prefill --lens 4096 28000
    python -m unimem bench prefill --requests 1 4 16 --lens 512 1024 2048

Needs a CUDA device (and ``fla-core`` for the ``fla`` mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from unimem_kernel.timing import wall_clock

PROG = "python -m unimem bench prefill"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[4096, 28000])
    ap.add_argument("--requests", type=int, nargs="+", default=[1], help="prompts at once")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="off,fla", help="UNIMEM_GDN_CHUNKED_PREFILL values")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{PROG}: error: needs a CUDA device", file=sys.stderr)
        return 2
    from unimem.attention.fa4_backend import FA4Backend
    from unimem.engine.core import EngineCore
    from unimem.memory.static import StaticMemory
    from unimem.models.config import memory_spec
    from unimem.models.gdn_prefill import PREFILL_ENV
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel

    dev = torch.device("cuda")
    cfg = preset("small")
    model = HybridModel(cfg, seed=0, device=dev)
    spec = memory_spec(cfg, 64)
    most = max(args.requests)
    pages = most * -(-(max(args.lens) + 64) // 64) + 1
    pool = StaticMemory(spec, pages, pages, most, most, cfg.max_context, dev)
    eng = EngineCore(model, pool, FA4Backend(), most, args.chunk)
    gen = torch.Generator().manual_seed(0)
    gpu = torch.cuda.get_device_name(dev)
    print(f"{gpu}: small preset, prefill chunks of {args.chunk}, static pools, FA4")
    rows = []
    for requests in args.requests:
        for length in args.lens:
            prompts = torch.randint(0, cfg.vocab_size, (requests, length), generator=gen).tolist()
            times = {}
            for mode in args.modes.split(","):
                os.environ[PREFILL_ENV] = mode
                samples = []
                for i in range(args.repeats + 1):
                    with wall_clock(dev) as watch:
                        for prompt in prompts:
                            eng.submit(prompt, 1)
                        eng.run()
                    if i:  # the first is the warm-up
                        samples.append(watch.seconds * 1e3)
                times[mode] = statistics.median(samples)
                rows.append(
                    {"requests": requests, "len": length, "mode": mode, "ms": times[mode],
                     "samples": samples}
                )  # fmt: skip
            base = times.get("off")
            line = "  ".join(
                f"{m} {ms:8.1f} ms" + (f" ({base / ms:.2f}x)" if base and m != "off" else "")
                for m, ms in times.items()
            )
            print(f"  {requests:>3} x {length:>6} tokens: {line}")
    os.environ.pop(PREFILL_ENV, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "chunk": args.chunk, "rows": rows}, f, indent=2)
    return 0
