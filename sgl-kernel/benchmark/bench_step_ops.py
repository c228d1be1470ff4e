"""The verify step's small non-GEMM kernels at their step sizes, one GPU: the numbers for
changes to those kernels, measured side by side against the previous source tree.

Ops and sizes (a verify step of 48 requests x 8 tokens = 384 rows, bf16):

- ``markov_pick``: the drafter's pick, 48 lanes x 7 columns over 32 000 tokens, Markov rank 16,
  with and without the acceptance control;
- ``moe_route``: the pairs grouped by expert — 384 tokens x top 8 of 64 experts (the Qwen3-Next
  ``bench`` checkpoint), 384 x top 4 of 32 (gpt-oss-like), 48 x top 8 of 64 (a decode step);
- ``moe_combine``: the weighted slot sum, Qwen3-Next (d 2048, with the sigmoid-gated shared
  expert) and gpt-oss-like (top 4, d 2880);
- ``silu_mul`` on the small preset's MLP (``[384, 2 x 5632]``) and on the routed experts'
  ``[3072, 2 x 512]``; ``add_rms_norm`` on ``[384, 2048]``;
- ``sigmoid_gate`` (gated attention's output gate, Qwen3-Next: 16 heads x 256, the gate a
  column slice of the q/gate product), where the installed ``unimem_kernel`` has it.

Each op: ``--iters`` calls recorded in one CUDA graph, its inputs rotated over ``--copies``
sets so that L2 does not hold them across calls (a step's tensors are fresh), CUDA events
around a replay, median of ``--repeats``; µs per call. ``--save-outputs PATH`` keeps every
op's output on the first input set (inputs are drawn from fixed seeds), and ``--compare A B``
reports which ops' saved outputs are equal bitwise — run the script once on each tree
(``PYTHONPATH`` of that tree's ``python`` and ``sgl-kernel/python``) and compare. ``--json
PATH`` writes the times. Needs CUDA (exits 2 with one line without it).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Callable

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20, help="calls per sample (one CUDA graph)")
    ap.add_argument("--repeats", type=int, default=9, help="samples; the median is kept")
    ap.add_argument("--copies", type=int, default=6, help="input sets the calls rotate over")
    ap.add_argument("--json", metavar="PATH", help="write the times as JSON")
    ap.add_argument("--save-outputs", metavar="PATH", help="torch.save every op's output")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved outputs")
    return ap.parse_args(argv)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


def compare(path_a: str, path_b: str) -> int:
    """Prints ``EQUAL`` / ``DIFFERENT`` per op saved in both files; 1 if any differs."""
    a = torch.load(path_a, map_location="cpu", weights_only=False)
    b = torch.load(path_b, map_location="cpu", weights_only=False)
    differ = 0
    for name in a:
        if name in b:
            same = _equal(a[name], b[name])
            differ += not same
            print(f"{'EQUAL' if same else 'DIFFERENT':<10} {name}")
    return 1 if differ else 0


def _cases(dev: torch.device) -> list[tuple[str, Callable, Callable]]:
    """``(name, make(generator) -> args, op(*args))`` per measured op."""
    import unimem_kernel as uk
    from unimem_kernel import fused

    def r(g, *shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    def pick(control: bool):
        def make(g):
            base = r(g, 48, 7, 32000, dtype=torch.float32, scale=3.0)
            anchors = torch.randint(0, 32000, (48,), generator=g).to(dev)
            u, w = r(g, 32000, 16, scale=0.5), r(g, 32000, 16, scale=0.5)
            if not control:
                return base, anchors, u, w
            ref = torch.randint(0, 32000, (48, 7), generator=g).to(dev)
            take = (torch.rand(48, 7, generator=g) < 0.8).to(dev)
            return base, anchors, u, w, ref, take

        return make

    def ids(t, k, e):
        return lambda g: (torch.randn(t, e, generator=g).topk(k, -1).indices.to(dev), e)

    def combine_inputs(t, k, e, d, shared):
        def make(g):
            route = uk.moe_route(torch.randn(t, e, generator=g).topk(k, -1).indices.to(dev), e)
            y = r(g, t * k, d)
            w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev)
            extra = (r(g, t, d), r(g, t, d), r(g, d, scale=0.05)) if shared else ()
            return (y, route.order, w, route.inverse, *extra)

        return make

    def combine(y, order, w, inverse, shared=None, gate_input=None, gate_weight=None):
        if shared is None:
            return uk.moe_combine(y, order, w, inverse)
        return uk.moe_combine(y, order, w, inverse, shared=shared, gate_input=gate_input,
                              gate_weight=gate_weight)  # fmt: skip

    cases = [
        ("markov_pick", pick(False), uk.markov_pick),
        ("markov_pick with control", pick(True), uk.markov_pick),
        ("moe_route 384 x top 8 of 64", ids(384, 8, 64), uk.moe_route),
        ("moe_route 384 x top 4 of 32", ids(384, 4, 32), uk.moe_route),
        ("moe_route 48 x top 8 of 64", ids(48, 8, 64), uk.moe_route),
        (
            "moe_combine Qwen3-Next (shared expert)",
            combine_inputs(384, 8, 64, 2048, True),
            combine,
        ),  # fmt: skip
        ("moe_combine gpt-oss-like", combine_inputs(384, 4, 32, 2880, False), combine),
        ("silu_mul [384, 2 x 5632]", lambda g: (r(g, 384, 11264),), uk.silu_mul),
        ("silu_mul [3072, 2 x 512]", lambda g: (r(g, 3072, 1024),), uk.silu_mul),
        (
            "add_rms_norm [384, 2048]",
            lambda g: (r(g, 384, 2048), r(g, 384, 2048), r(g, 2048, scale=0.1)),
            lambda x, d, w: fused.add_rms_norm(x, d, w, 1e-6),
        ),
    ]
    if hasattr(uk, "sigmoid_gate"):
        cases.append((
            "sigmoid_gate [384, 16, 256]",
            lambda g: (r(g, 384, 16, 256), r(g, 384, 16, 512, scale=3.0)[..., 256:]),
            uk.sigmoid_gate,
        ))  # fmt: skip
    return cases


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not torch.cuda.is_available():
        print("bench_step_ops: needs CUDA", file=sys.stderr)
        return 2
    import triton

    from unimem_kernel.timing import graph_median_ms

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; {args.iters} calls a graph, {args.copies} input sets, median "
          f"of {args.repeats}")  # fmt: skip
    times, outputs = {}, {}
    for name, make, op in _cases(dev):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) % 10_000)
        sets = [make(gen) for _ in range(args.copies)]
        outputs[name] = op(*sets[0])
        calls = iter(range(1 << 30))

        def fn(op=op, sets=sets, calls=calls):
            return op(*sets[next(calls) % len(sets)])

        us = 1000 * graph_median_ms(fn, warmup=args.warmup, iters=args.iters,
                                    repeats=args.repeats)  # fmt: skip
        times[name] = round(us, 3)
        print(f"{name:<44} {us:8.2f} us")
    if args.save_outputs:
        torch.save(outputs, args.save_outputs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "us_per_call": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
