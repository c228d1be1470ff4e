"""GDN prefill (extend) on arena slots: the recurrent Triton delta rule against the chunked (WY)
one (``unimem_kernel.gdn_chunked``), and the whole mixer (``gdn_forward_triton`` with
``chunked_prefill`` off / on).

Cases: ``--requests`` (default 1 and 4) requests of ``--lens`` tokens each (default 4096 and
32768), at two head presets: ``small`` (H = Hk = 16) and ``qwen3-next`` (Hk 16 key heads, H 32
value heads), Dk = Dv = 128, bf16 inputs, float32 SSM state in strided arena slot views (every
request from an initial state). Chunked rows per ``--chunks`` (default 16, 32) and
``--precisions`` (``ieee``: float32 dots, ``tf32``: tensor cores). Times are CUDA-event medians
of ``--repeats`` samples of ``--iters`` eager calls (prefill is not captured), in ms; ``check``
is the largest relative difference of the output from the recurrent rule's (mixer: from the
recurrent mixer's). ``--json PATH`` writes the rows. Without CUDA it prints one line and exits
with status 2.
"""

from __future__ import annotations

import argparse
import json

import torch

from unimem_kernel.timing import median_ms

PRESETS = {"small": (16, 16), "qwen3-next": (32, 16)}  # (H, Hk)
DK = DV = 128
KW = 4


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--precisions", nargs="+", default=["ieee", "tf32"])
    ap.add_argument("--block-v", type=int, nargs="+", default=[None], help="chunked V block")
    ap.add_argument("--no-mixer", action="store_true", help="only the delta rule")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def arena_ssm(num_slots: int, h: int, device) -> torch.Tensor:
    """``[num_slots, H, Dk, Dv]`` float32 slot views (256 bytes of envelope padding per slot)."""
    block = h * DK * DV
    slot = block + 64
    arena = torch.zeros(num_slots * slot, dtype=torch.float32, device=device)
    ssm = arena.as_strided((num_slots, h, DK, DV), (slot, DK * DV, DV, 1), 16)
    ssm.copy_(0.1 * torch.randn(ssm.shape, device=device))
    return ssm


def bench_case(args, preset, bs, length, report) -> None:
    from unimem_kernel import gdn
    from unimem_kernel import gdn_chunked as gc
    from unimem_kernel import gdn_reference as gr

    h, hk = PRESETS[preset]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    n = bs * length
    slots = torch.randperm(bs + 4, generator=gen, device=dev)[:bs].int()
    ssm = arena_ssm(bs + 4, h, dev)
    saved = ssm.clone()
    cu = torch.arange(0, n + 1, length, dtype=torch.int32, device=dev)
    init = torch.ones(bs, dtype=torch.bool, device=dev)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    q = randn(n, hk, DK).bfloat16()
    k = torch.nn.functional.normalize(randn(n, hk, DK), dim=-1).bfloat16()
    v = randn(n, h, DV).bfloat16()
    g = -0.1 * torch.rand(n, h, generator=gen, device=dev)
    beta = torch.rand(n, h, generator=gen, device=dev)
    o = torch.empty(n, h, DV, dtype=torch.bfloat16, device=dev)
    it, rep = args.iters, args.repeats

    def rec():
        gdn.gated_delta_rule_extend_triton(q, k, v, g, beta, ssm, slots, cu, init, out=o)

    ms = median_ms(rec, warmup=1, iters=it, repeats=rep)
    ssm.copy_(saved)
    rec()
    o_rec = o.clone()
    report(preset, bs, length, "rule", "recurrent", ms, None)
    for c in args.chunks:
        for prec in args.precisions:
            for bv in args.block_v:

                def chk(c=c, prec=prec, bv=bv):
                    gc.gated_delta_rule_extend_chunked_triton(
                        q, k, v, g, beta, ssm, slots, cu, init, None, hk, c, length, out=o,
                        block_v=bv, dot_precision=prec,
                    )  # fmt: skip

                ms = median_ms(chk, warmup=1, iters=it, repeats=rep)
                ssm.copy_(saved)
                chk()
                name = f"chunked C{c} {prec}" + ("" if bv is None else f" bv{bv}")
                report(preset, bs, length, "rule", name, ms, rel(o, o_rec))
    if args.no_mixer:
        return
    conv_dim = gr.mixed_qkv_dim(h, DK, DV, hk)
    x = randn(n, conv_dim).bfloat16()
    w = (0.5 * randn(conv_dim, KW)).bfloat16()
    conv = torch.zeros(bs + 4, conv_dim, KW - 1, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    outs = {}
    for chunked in (False, True):

        def mix(chunked=chunked):
            gdn.gdn_forward_triton(
                "extend", x, w, g, beta, conv, ssm, slots, cu, has_initial_state=init,
                num_k_heads=hk, out=o, conv_out=y, max_seqlen=length, chunked_prefill=chunked,
            )  # fmt: skip

        ms = median_ms(mix, warmup=1, iters=it, repeats=rep)
        ssm.copy_(saved)
        conv.zero_()
        mix()
        outs[chunked] = o.clone()
        check = rel(outs[True], outs[False]) if chunked else None
        name = f"chunked C{gc.DEFAULT_CHUNK} ieee" if chunked else "recurrent"
        report(preset, bs, length, "mixer", name, ms, check)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn_prefill: needs a CUDA device")
        return 2
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dk": DK,
        "dv": DV,
        "iters": args.iters,
        "repeats": args.repeats,
    }
    print(f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}; Dk = Dv = {DK}, bf16 "
          f"inputs, fp32 state in arena slot views; eager, median of {args.repeats} x "
          f"{args.iters} calls, ms")  # fmt: skip
    header = f"{'preset':>10} {'bs':>3} {'len':>6} {'what':>5} {'impl':>22} {'ms':>9} {'check':>8}"
    print(header)
    print("-" * len(header))
    rows = []

    def report(preset, bs, length, what, impl, ms, check):
        rows.append({"preset": preset, "bs": bs, "len": length, "what": what, "impl": impl,
                     "ms": ms, "check": check})  # fmt: skip
        c_s = f"{check:8.1e}" if check is not None else f"{'':>8}"
        print(f"{preset:>10} {bs:>3} {length:>6} {what:>5} {impl:>22} {ms:9.3f} {c_s}",
              flush=True)  # fmt: skip

    for preset in args.presets:
        for length in args.lens:
            for bs in args.requests:
                bench_case(args, preset, bs, length, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
