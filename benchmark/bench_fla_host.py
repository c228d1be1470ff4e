"""Host and GPU cost of one GDN layer's extend through fla's chunked rule, as the engine calls
it: ``unimem.models.gdn_prefill.gdn_extend_fla`` with the varlen plan built once per extend
(``fla_varlen``) and shared by the layers, beside the runner's recurrent extend.

Why: fla's path is ~10 Triton launches plus torch glue per GDN layer, and through the engine
its prefill steps were slower than the recurrent kernel's although its kernels were faster
(``docs/benchmarks.md``, "Chunked GDN prefill"): the host, not the GPU, sets their pace. This
measures the host's cost per call beside the GPU's, for both extend paths.

Rows per ``(requests, tokens)`` and variant:

- ``host us``: Python time of one call, measured over ``--calls`` back-to-back calls without
  a synchronisation (fewer launches than the CUDA queue holds, so the host never waits on the
  GPU); the median and the fastest of ``--repeats`` samples (the host's time varies more
  between samples than the GPU's);
- ``gpu us``: the same calls replayed from a CUDA graph (kernel time without the host);
- ``launches``: kernels per call (``torch.profiler``);
- ``check``: relative difference (2-norm) of the output, the final SSM states and the conv
  windows from the ``fla`` variant's.

Variants: ``fla`` (``gdn_extend_fla`` as the runner calls it) and ``recurrent`` (the runner's
other extend path: ``unimem_kernel.gdn.gdn_forward("extend", ...)``, conv + SiLU then L2 norm
+ recurrent delta rule; 3 launches measured). ``--profile N`` prints cProfile's top ``N``
functions by own time for the ``fla`` variant at the first size.
Sizes: one GDN layer of the ``small`` preset (16 heads, Dk = Dv = 128, conv 4), bf16
activations, fp32 SSM states in arena-like slot views. Prints the GPU, versions and a table;
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import statistics
import time

import torch
from cuda_timing import graph_median_ms

from unimem.models import gdn_prefill
from unimem_kernel import gdn as gdn_ops

H, DK, DV, KW = 16, 128, 128, 4
CONV_DIM = H * (2 * DK + DV)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per sample")
    ap.add_argument("--repeats", type=int, default=9, help="samples per row")
    ap.add_argument("--profile", type=int, default=0, help="cProfile's top N (fla variant)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


VARIANTS = ("fla", "recurrent")


class Case:
    """Inputs of one extend: ``bs`` requests of ``length`` tokens on random slots."""

    def __init__(self, bs: int, length: int, gen: torch.Generator, dev: torch.device):
        n_slots = 2 * bs + 3
        self.n = bs * length
        self.length = length
        self.conv0 = torch.randn(n_slots, CONV_DIM, KW - 1, generator=gen, device=dev).bfloat16()
        self.ssm0 = 0.1 * torch.randn(n_slots, H, DK, DV, generator=gen, device=dev)
        self.slots = torch.randperm(n_slots, generator=gen, device=dev)[:bs].int()
        self.cu = torch.arange(0, self.n + 1, length, dtype=torch.int32, device=dev)
        self.cu_host = list(range(0, self.n + 1, length))
        self.x = torch.randn(self.n, CONV_DIM, generator=gen, device=dev).bfloat16()
        self.w = (0.5 * torch.randn(CONV_DIM, KW, generator=gen, device=dev)).bfloat16()
        self.g = -0.5 * torch.rand(self.n, H, generator=gen, device=dev) - 0.01
        self.beta = torch.rand(self.n, H, generator=gen, device=dev).bfloat16()
        self.conv = self.conv0.clone()
        self.ssm = self.ssm0.clone()
        self.varlen = gdn_prefill.fla_varlen(self.cu, self.cu_host)

    def reset(self) -> None:
        self.conv.copy_(self.conv0)
        self.ssm.copy_(self.ssm0)

    def call(self, variant: str) -> torch.Tensor:
        if variant == "fla":
            return gdn_prefill.gdn_extend_fla(
                self.x, self.w, self.g, self.beta, self.conv, self.ssm, self.slots, self.cu,
                max_seqlen=self.length, varlen=self.varlen, num_k_heads=H,
            )  # fmt: skip
        return gdn_ops.gdn_forward(
            "extend", self.x, self.w, self.g, self.beta, self.conv, self.ssm, self.slots,
            self.cu, max_seqlen=self.length, num_k_heads=H, batch_invariant=False,
        )  # fmt: skip


def host_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """Median and fastest sample of the host's microseconds per call."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples), min(samples)


def gpu_us(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn``'s kernels, replayed from a CUDA graph."""
    return graph_median_ms(fn, warmup=1, iters=calls, repeats=repeats) * 1e3


def launches(fn) -> int:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None) -> None:
    args = parse_args(argv)
    dev = torch.device("cuda")
    import fla  # noqa: F401 - fail early and say so if fla is missing

    env = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "fla": getattr(fla, "__version__", "?"),
        "calls": args.calls,
        "repeats": args.repeats,
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(
        f"{'bs':>4} {'len':>6} {'variant':>9} {'host us':>9} {'fastest':>9} {'gpu us':>9} "
        f"{'launch':>6} check"
    )
    for bs in args.requests:
        for length in args.lens:
            case = Case(bs, length, gen, dev)
            ref = None
            for variant in VARIANTS:
                case.reset()
                out = case.call(variant)  # compiles / autotunes on first use
                torch.cuda.synchronize()
                got = (out.float(), case.ssm.clone(), case.conv.clone())
                if ref is None:
                    ref = got
                check = max(rel(a, b) for a, b in zip(got, ref, strict=True))
                fn = functools.partial(case.call, variant)
                host, fastest = host_us(fn, args.calls, args.repeats)
                row = {
                    "bs": bs,
                    "len": length,
                    "variant": variant,
                    "host_us": host,
                    "host_us_fastest": fastest,
                    "gpu_us": gpu_us(fn, args.calls, args.repeats),
                    "launches": launches(fn),
                    "check": check,
                }
                rows.append(row)
                print(
                    f"{bs:>4} {length:>6} {variant:>9} {host:>9.1f} {fastest:>9.1f} "
                    f"{row['gpu_us']:>9.1f} {row['launches']:>6} {check:.1e}"
                )
                if args.profile and variant == "fla" and len(rows) == 1:
                    prof = cProfile.Profile()
                    torch.cuda.synchronize()
                    prof.enable()
                    for _ in range(args.calls):
                        fn()
                    prof.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
                    print(s.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
