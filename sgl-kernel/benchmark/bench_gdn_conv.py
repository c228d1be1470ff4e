"""The GDN causal conv of decode and verify steps, by tile: ``BLOCK_D`` channels per program and
warps per program (the data for choosing ``gdn._launch_conv``'s tile per step kind).

Sizes: one GDN layer of the ``small`` preset (conv_dim 6144, kernel 4), bf16 inputs and conv
state in arena slot views (``bench_gdn.arena_states``); ``x`` is the ``mixed_qkv`` column slice
of a ``[rows, 8224]`` in-projection output (as the model passes it); verify writes the conv
output and the record's input rows (``VerifyRecord.x``), as the engine's verify does; decode
updates the slot in place. Each tile's outputs (and, for decode, the slot) are compared
bitwise with the default tile's: the conv is per-element arithmetic, so a tile must change no
bit.

Each time: ``--iters`` calls in one CUDA graph, median of ``--repeats`` replays
(``unimem_kernel.timing.graph_median_ms``); ``GB/s`` counts x read, y (and the record's x)
written and the conv windows read (and, decode, written). ``--json PATH`` writes the rows.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_gdn import CONV_DIM, KW, arena_states

from unimem_kernel import gdn
from unimem_kernel.timing import graph_median_ms

IN_PROJ = 8224  # the small preset's GDN in-projection width (mixed_qkv | z | b | a)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[48])
    ap.add_argument("--verify-tokens", type=int, default=8)
    ap.add_argument("--block-d", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args(argv)


def bench_case(bs: int, mode: str, t: int, args: argparse.Namespace, rows: list) -> None:
    """Every tile of one (batch, step kind), appended to ``rows``."""
    dev = torch.device("cuda")
    _, conv, _ = arena_states(bs + 16, dev)
    slots = torch.randperm(bs + 16, device=dev)[:bs].to(torch.int32)
    w = torch.randn(CONV_DIM, KW, device=dev).bfloat16()
    x = torch.randn(bs * t, IN_PROJ, device=dev).bfloat16()[:, :CONV_DIM]
    y = torch.empty(bs, t, CONV_DIM, device=dev, dtype=torch.bfloat16)
    rec_x = torch.empty_like(y)
    xs, ys = x.stride(0), y.stride(1)
    state0 = conv.clone()

    def call(bd: int | None, nw: int | None) -> None:
        gdn._launch_conv(
            x, (xs * t, xs, x.stride(1)), w, conv, slots, y, (ys * t, ys, y.stride(2)),
            seq_len=t, max_len=t, cu=None, init=None, scratch=None,
            write_final=mode == "decode", block_d=bd,
            record_x=rec_x if mode == "verify" else None, num_warps=nw,
        )  # fmt: skip

    def outputs(bd: int | None, nw: int | None) -> list[torch.Tensor]:
        conv.copy_(state0)
        y.fill_(float("nan"))
        rec_x.fill_(float("nan"))
        call(bd, nw)
        last = rec_x if mode == "verify" else conv[slots.long()]
        return [y.clone().view(torch.int16), last.clone().view(torch.int16)]

    ref = outputs(None, None)
    window = bs * CONV_DIM * (KW - 1) * 2
    moved = x.numel() * 2 + y.numel() * 2 + window
    moved += y.numel() * 2 if mode == "verify" else window
    timing = dict(warmup=3, iters=args.iters, repeats=args.repeats)
    for bd in args.block_d:
        for nw in args.warps:
            try:
                same = all(torch.equal(a, b) for a, b in zip(outputs(bd, nw), ref, strict=True))
                conv.copy_(state0)
                ms = graph_median_ms(lambda bd=bd, nw=nw: call(bd, nw), **timing)
            except Exception as exc:  # a tile that does not compile: say so, go on
                print(f"{mode} bs {bs} block_d {bd} warps {nw}: {type(exc).__name__}: {exc}")
                continue
            gbps = moved / (ms * 1e-3) / 1e9
            rows.append(
                dict(mode=mode, bs=bs, t=t, block_d=bd, warps=nw, us=ms * 1e3, gbps=gbps,
                     bitwise_equal=same)
            )  # fmt: skip
            print(
                f"{mode:6s} bs {bs:3d} x {t}  block_d {bd:5d} warps {nw}: {ms * 1e3:7.2f} us "
                f"{gbps:6.0f} GB/s  bitwise {same}"
            )


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn_conv: needs CUDA", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}; conv_dim {CONV_DIM}, kernel {KW}")
    torch.manual_seed(0)
    rows: list = []
    for bs in args.bs:
        bench_case(bs, "decode", 1, args, rows)
        bench_case(bs, "verify", args.verify_tokens, args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__, rows=rows), f, indent=1)
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
