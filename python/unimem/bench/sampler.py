"""The on-device sampler's cut-off rules, side by side.

    python -m unimem bench sampler [--rows 1,48,384] [--vocab 262144] [--profile N] [--json OUT]

For each row count (decode steps of 1 and 48 requests; 384 = a verify step of 48 requests x
8 rows), times inside CUDA graphs (GPU time per call, median of samples) of ``sample`` (one
token per row, temperature 0.7) and ``filtered_probs`` (the distributions speculative sampling
compares) under each rule of :data:`unimem.models.sampler.CUT_RULES`:

- ``whole_row``: top-p 0.95, top-k off, the :data:`~unimem.models.sampler.SORTED` rule (a
  whole-row sort);
- ``bounded``: top-k 64, top-p 0.95 in a batch promised :data:`~unimem.models.sampler.BOUNDED`
  (the cut-off among each row's 256 largest logits);
- ``unfiltered``: no filter (top-k off, top-p 1, min-p 0) in a batch promised
  :data:`~unimem.models.sampler.UNFILTERED` (nothing sorted), and ``unfiltered_sorted``: the
  same rows under the SORTED rule (what a batch without the promise pays).

It checks that each rule's rows draw the same tokens and distributions as under the SORTED
rule beside rows of another rule (the rule is the row's own). ``--profile N`` (default 8) also
lists, per op and rule, the N costliest GPU kernels of an eager call (``torch.profiler``):
where a draw's time goes. ``--device cpu`` is a dry run at tiny sizes (the check, wall-clock
times). Prints the GPU and sizes; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from unimem.models import sampler
from unimem_kernel.timing import graph_median_ms, median_ms

PROG = "python -m unimem bench sampler"

CASES = (
    # label, top_k, top_p, rule
    ("whole_row", -1, 0.95, sampler.SORTED),
    ("bounded", 64, 0.95, sampler.BOUNDED),
    ("unfiltered", -1, 1.0, sampler.UNFILTERED),
    ("unfiltered_sorted", -1, 1.0, sampler.SORTED),
)


def _rows(n: int, top_k: int, device, top_p: float = 0.95) -> tuple[torch.Tensor, ...]:
    return (
        torch.full((n,), 0.7, device=device),
        torch.full((n,), top_k, dtype=torch.int32, device=device),
        torch.full((n,), top_p, device=device),
        torch.zeros(n, device=device),
    )


def check_rule_is_per_row(vocab: int, device) -> bool:
    """Rows promised BOUNDED (top-k 64) or UNFILTERED give the same tokens and distributions
    as the same rows under the SORTED rule beside a row of another kind."""
    g = torch.Generator(device=device).manual_seed(0)
    n = 6
    logits = torch.randn(n, vocab, generator=g, device=device) * 4
    seeds = torch.arange(n, dtype=torch.int64, device=device)
    pos = torch.arange(n, dtype=torch.int64, device=device) + 3
    ok = True
    for top_k, top_p, rule in ((64, 0.95, sampler.BOUNDED), (-1, 1.0, sampler.UNFILTERED)):
        temp, k, p, min_p = _rows(n, top_k, device, top_p)
        mixed_k, mixed_p = k.clone(), p.clone()
        mixed_k[-1], mixed_p[-1] = -1, 0.9  # a row of the SORTED kind beside them
        a = sampler.sample(logits, temp, mixed_k, mixed_p, min_p, seeds, pos)
        b = sampler.sample(logits, temp, k, p, min_p, seeds, pos, rule)
        pa = sampler.filtered_probs(logits, temp, mixed_k, mixed_p, min_p)
        pb = sampler.filtered_probs(logits, temp, k, p, min_p, rule)
        ok = ok and torch.equal(a[:-1], b[:-1]) and torch.equal(pa[:-1], pb[:-1])
    return ok


def kernel_profile(fn, top: int, calls: int = 5) -> dict[str, float]:
    """GPU time per call of ``fn``'s ``top`` costliest kernels (by name), in microseconds,
    from ``torch.profiler`` over ``calls`` eager calls after a warm-up."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            total[e.name] = total.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return {name: us / calls for name, us in ranked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rows", default="1,48,384")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument(
        "--profile",
        type=int,
        default=8,
        metavar="N",
        help="also list each op's N costliest GPU kernels per call (torch.profiler over eager "
        "calls; 0: off)",
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(f"{PROG}: needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    vocab = args.vocab if cuda else min(args.vocab, 4096)
    rows_list = [int(r) for r in args.rows.split(",")] if cuda else [1, 4]
    name = torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)"
    print(f"{name}, vocab {vocab}, temperature 0.7; rules: " + ", ".join(
        f"{label} (top-k {k}, top-p {p}, {rule})" for label, k, p, rule in CASES),
        flush=True)  # fmt: skip
    ok = check_rule_is_per_row(vocab, dev)
    print(f"bounded and unfiltered rows draw as under the sorted rule: {ok}", flush=True)

    def us(fn) -> float:
        if cuda:
            return 1e3 * graph_median_ms(fn, warmup=2, iters=5, repeats=5)
        return 1e3 * median_ms(fn, warmup=1, iters=2, repeats=3, device=dev)

    out = []
    for n in rows_list:
        g = torch.Generator(device=dev).manual_seed(n)
        logits = torch.randn(n, vocab, generator=g, device=dev) * 4
        seeds = torch.arange(n, dtype=torch.int64, device=dev)
        pos = torch.arange(n, dtype=torch.int64, device=dev) + 3
        row = {"rows": n}
        for label, top_k, top_p, rule in CASES:
            p = _rows(n, top_k, dev, top_p)
            ops = {
                "sample": partial(sampler.sample, logits, *p, seeds, pos, rule),
                "filtered_probs": partial(sampler.filtered_probs, logits, *p, rule),
            }
            for op, fn in ops.items():
                row[f"{op}_{label}_us"] = us(fn)
                if cuda and args.profile:
                    top = kernel_profile(fn, args.profile)
                    row[f"{op}_{label}_kernels_us"] = top
                    print(f"  rows {n} {op} {label}: "
                          + ", ".join(f"{k[:48]} {v:.1f}" for k, v in top.items()),
                          flush=True)  # fmt: skip
        for op in ("sample", "filtered_probs"):
            row[f"{op}_speedup"] = row[f"{op}_whole_row_us"] / row[f"{op}_bounded_us"]
            row[f"{op}_unfiltered_speedup"] = (
                row[f"{op}_unfiltered_sorted_us"] / row[f"{op}_unfiltered_us"]
            )
            print(f"rows {n:4d} {op:15s}: whole row {row[f'{op}_whole_row_us']:9.1f} us, "
                  f"bounded {row[f'{op}_bounded_us']:8.1f} us ({row[f'{op}_speedup']:.1f}x); "
                  f"unfiltered {row[f'{op}_unfiltered_us']:8.1f} us against "
                  f"{row[f'{op}_unfiltered_sorted_us']:.1f} sorted "
                  f"({row[f'{op}_unfiltered_speedup']:.1f}x)", flush=True)  # fmt: skip
        out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": name, "vocab": vocab, "torch": torch.__version__,
                       "rule_is_per_row": ok, "rows": out}, f, indent=1)  # fmt: skip
    return 0 if ok else 1
