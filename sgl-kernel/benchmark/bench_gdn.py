"""GDN layer kernels on arena slots: decode, verify and prefill times of ``unimem_kernel.gdn``
against fla's kernels with the gather/scatter copies they need.

Sizes: one GDN layer of the ``small`` preset (16 heads, Dk = Dv = 128, conv_dim 6144, conv
kernel 4), bf16 inputs, bf16 conv state, float32 SSM state. The states are strided views into a
``uint8`` arena (per slot: conv block, then SSM block, 256-byte aligned), and each batch uses a
random, non-identity set of slots.

Candidates per mode (``us`` per call):

- ``conv``: ``causal_conv1d_{decode,verify,extend}_triton`` (slot read/written in place);
- ``rule``: ``gated_delta_rule_{decode,verify,extend}_triton`` (q, k already L2-normalised);
- ``mixer``: ``gdn_forward_triton`` (conv + SiLU, then L2 norm + delta rule: two launches);
- ``fla-recurrent`` (decode, prefill) and ``fla-chunk`` (prefill), when ``fla`` is importable:
  ``initial_state = ssm[slots]`` (gather), fla's kernel with ``output_final_state=True``, then
  ``ssm.index_copy_(0, slots, final)`` (scatter) - the copies an in-place kernel saves. Same
  inputs as ``rule``. Verify has no fla row: fla's kernels keep no per-position states.

Decode and verify are timed as the engine runs them, inside CUDA graphs (``--per-graph`` calls
per graph, device-side time per call); prefill is timed eagerly (not captured; its launches
are long). ``GB/s`` counts the state bytes a call must move (decode: SSM + conv state read and
written; verify: states read, every position's states written to scratch), a roofline check
against the device's memory bandwidth. ``check`` is the largest relative difference of the
candidate's output from ``rule``'s (``mixer``: from the torch reference, on the first call).

``--sweep`` adds ``rule`` rows for other ``(block_v, num_warps)`` tiles. Prints the GPU,
versions, sizes and a table; ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from unimem_kernel import gdn
from unimem_kernel.timing import graph_median_ms, median_ms

H, DK, DV, KW = 16, 128, 128, 4
CONV_DIM = H * (2 * DK + DV)
SWEEP = [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 48, 256], help="decode/verify")
    ap.add_argument("--verify-tokens", type=int, default=4, help="tokens per verify (gamma+1)")
    ap.add_argument("--prefill-requests", type=int, nargs="+", default=[8])
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--per-graph", type=int, default=20, help="calls per time reported")
    ap.add_argument(
        "--replays", type=int, default=20, help="a sample's graph holds per-graph x replays calls"
    )
    ap.add_argument("--prefill-iters", type=int, default=5, help="eager calls per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples; the median is kept")
    ap.add_argument("--sweep", action="store_true", help="also time other rule tiles")
    ap.add_argument("--no-fla", action="store_true", help="skip fla even if importable")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def arena_states(num_slots: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(arena, conv [N, conv_dim, K-1] bf16, ssm [N, H, Dk, Dv] fp32)``: strided views, one
    slot envelope per slot (conv block, then SSM block), random finite contents."""
    conv_bytes = CONV_DIM * (KW - 1) * 2
    ssm_off = -(-conv_bytes // 256) * 256
    slot_bytes = ssm_off + H * DK * DV * 4
    arena = torch.zeros(num_slots * slot_bytes, dtype=torch.uint8, device=device)
    conv = arena.view(torch.bfloat16).as_strided(
        (num_slots, CONV_DIM, KW - 1), (slot_bytes // 2, KW - 1, 1), 0
    )
    ssm = arena.view(torch.float32).as_strided(
        (num_slots, H, DK, DV), (slot_bytes // 4, DK * DV, DV, 1), ssm_off // 4
    )
    conv.copy_(torch.randn(conv.shape, device=device).bfloat16())
    ssm.copy_(0.1 * torch.randn(ssm.shape, device=device))
    return arena, conv, ssm


def rule_inputs(n: int, device, gen):
    """q, k (unit norm), v in bf16 ``[n, H, D]``; g (<= 0), beta float32 ``[n, H]``."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q = randn(n, H, DK).bfloat16()
    k = torch.nn.functional.normalize(randn(n, H, DK), dim=-1).bfloat16()
    v = randn(n, H, DV).bfloat16()
    g = -torch.rand(n, H, generator=gen, device=device)
    beta = torch.rand(n, H, generator=gen, device=device)
    return q, k, v, g, beta


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def graph_us(fn, args) -> tuple[float, str]:
    """Per-call device time of ``fn`` replayed from a CUDA graph of ``--per-graph`` x
    ``--replays`` calls (falls back to eager timing, flagged, if ``fn`` cannot be
    captured)."""
    try:
        ms = graph_median_ms(
            fn, warmup=3, iters=args.per_graph * args.replays, repeats=args.repeats
        )
        return ms * 1e3, "graph"
    except RuntimeError as e:  # e.g. a kernel that syncs or allocates on the host
        torch.cuda.synchronize()
        print(f"  (capture failed, timed eagerly: {str(e).splitlines()[0][:80]})")
        iters = args.per_graph * args.replays
        return median_ms(fn, warmup=0, iters=iters, repeats=args.repeats) * 1e3, "eager"


def eager_us(fn, args) -> tuple[float, str]:
    return median_ms(fn, warmup=1, iters=args.prefill_iters, repeats=args.repeats) * 1e3, "eager"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# fla (optional)
# ---------------------------------------------------------------------------------------------


def load_fla():
    try:
        import fla
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return None
    return {
        "version": getattr(fla, "__version__", "?"),
        "chunk": chunk_gated_delta_rule,
        "recurrent": fused_recurrent_gated_delta_rule,
    }


def fla_step(fn, q, k, v, g, beta, ssm, slots, lead: int, cu: torch.Tensor | None, out: dict):
    """Gather the initial states, run fla (``[lead, T, H, D]`` inputs), scatter the finals."""
    idx = slots.long()
    shape = (lead, -1)

    def step():
        init = ssm.index_select(0, idx)
        with warnings.catch_warnings():  # fla warns about decode-shaped inputs
            warnings.simplefilter("ignore")
            o, final = fn(
                q.view(*shape, H, DK), k.view(*shape, H, DK), v.view(*shape, H, DV),
                g=g.view(*shape, H), beta=beta.view(*shape, H), scale=DK**-0.5,
                initial_state=init, output_final_state=True, cu_seqlens=cu,
            )  # fmt: skip
        ssm.index_copy_(0, idx, final.to(ssm.dtype))
        out["o"] = o

    return step


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


class Context(NamedTuple):
    args: argparse.Namespace
    dev: torch.device
    gen: torch.Generator
    fla: dict | None
    conv: torch.Tensor
    ssm: torch.Tensor
    w: torch.Tensor
    state_bytes: int
    report: Callable

    def slots(self, bs: int) -> torch.Tensor:
        """``bs`` distinct, non-identity slots."""
        n = self.ssm.shape[0]
        return torch.randperm(n, generator=self.gen, device=self.dev)[:bs].int()

    def tiles(self) -> list[tuple[int | None, int | None]]:
        return SWEEP if self.args.sweep else [(None, None)]


def bench_step(ctx: Context, mode: str, bs: int) -> None:
    """One decode or verify case: conv, rule (per tile), mixer, fla-recurrent (decode)."""
    args, dev, conv, ssm, w = ctx.args, ctx.dev, ctx.conv, ctx.ssm, ctx.w
    tv = 1 if mode == "decode" else args.verify_tokens
    n = bs * tv
    slots = ctx.slots(bs)
    x = torch.randn(n, CONV_DIM, generator=ctx.gen, device=dev).bfloat16()
    q, k, v, g, beta = rule_inputs(n, dev, ctx.gen)
    y = torch.empty_like(x)
    o = torch.empty(n, H, DV, dtype=torch.bfloat16, device=dev)
    scr = {}
    if mode == "verify":
        scr = {
            "conv_scratch": torch.empty(bs, tv, CONV_DIM, KW - 1, dtype=conv.dtype, device=dev),
            "ssm_scratch": torch.empty(bs, tv, H, DK, DV, device=dev),
        }
    # decode: states read and written; verify: read, and every position's states written
    moved = bs * ctx.state_bytes * (2 if mode == "decode" else 1 + tv)
    sh = (bs, tv)

    def conv_fn():
        if mode == "decode":
            gdn.causal_conv1d_decode_triton(x, w, conv, slots, out=y)
        else:
            gdn.causal_conv1d_verify_triton(
                x.view(*sh, -1), w, conv, slots, scr["conv_scratch"], out=y.view(*sh, -1)
            )

    def rule_fn(bv=None, nw=None):
        if mode == "decode":
            return lambda: gdn.gated_delta_rule_decode_triton(
                q, k, v, g, beta, ssm, slots, out=o, block_v=bv, num_warps=nw
            )
        return lambda: gdn.gated_delta_rule_verify_triton(
            q.view(*sh, H, DK), k.view(*sh, H, DK), v.view(*sh, H, DV), g.view(*sh, H),
            beta.view(*sh, H), ssm, slots, scr["ssm_scratch"], out=o.view(*sh, H, DV),
            block_v=bv, num_warps=nw,
        )  # fmt: skip

    def mixer_fn():
        gdn.gdn_forward_triton(mode, x, w, g, beta, conv, ssm, slots, out=o, conv_out=y, **scr)

    # the mixer against the torch reference, on copies of the states
    from unimem_kernel import gdn_reference as gr

    scr_a = {key: torch.empty_like(t) for key, t in scr.items()}
    scr_b = {key: torch.empty_like(t) for key, t in scr.items()}
    o_tri = gdn.gdn_forward_triton(mode, x, w, g, beta, conv.clone(), ssm.clone(), slots, **scr_a)
    o_ref = gr.gdn_forward(mode, x, w, g, beta, conv.clone(), ssm.clone(), slots, **scr_b)
    mixer_check = rel(o_tri, o_ref)
    del scr_a, scr_b

    ctx.report(mode, bs, tv, "conv", *graph_us(conv_fn, args))
    for bv, nw in ctx.tiles():
        name = "rule" if bv is None else f"rule bv{bv} w{nw}"
        ctx.report(mode, bs, tv, name, *graph_us(rule_fn(bv, nw), args), moved)
    ctx.report(mode, bs, tv, "mixer", *graph_us(mixer_fn, args), moved, mixer_check)
    if ctx.fla is not None and mode == "decode":
        saved = ssm.clone()
        rule_fn()()
        o_rule = o.clone()
        ssm.copy_(saved)
        res = {}
        step = fla_step(ctx.fla["recurrent"], q, k, v, g, beta, ssm, slots, bs, None, res)
        step()
        check = rel(res["o"].reshape(o_rule.shape), o_rule)
        ctx.report(mode, bs, tv, "fla-recurrent", *graph_us(step, args), moved, check)


def bench_prefill(ctx: Context, bs: int, length: int) -> None:
    """``bs`` requests of ``length`` tokens: conv, rule, mixer, fla."""
    args, dev, conv, ssm, w = ctx.args, ctx.dev, ctx.conv, ctx.ssm, ctx.w
    n = bs * length
    slots = ctx.slots(bs)
    cu = torch.arange(0, n + 1, length, dtype=torch.int32, device=dev)
    x = torch.randn(n, CONV_DIM, generator=ctx.gen, device=dev).bfloat16()
    q, k, v, g, beta = rule_inputs(n, dev, ctx.gen)
    y = torch.empty_like(x)
    o = torch.empty(n, H, DV, dtype=torch.bfloat16, device=dev)
    init = torch.ones(bs, dtype=torch.bool, device=dev)

    def conv_fn():
        gdn.causal_conv1d_extend_triton(x, w, conv, slots, cu, init, out=y, max_seqlen=length)

    def rule_fn(bv=None, nw=None):
        return lambda: gdn.gated_delta_rule_extend_triton(
            q, k, v, g, beta, ssm, slots, cu, init, out=o, block_v=bv, num_warps=nw
        )

    def mixer_fn():
        gdn.gdn_forward_triton(
            "extend", x, w, g, beta, conv, ssm, slots, cu, has_initial_state=init, out=o,
            conv_out=y, max_seqlen=length,
        )  # fmt: skip

    ctx.report("prefill", bs, length, "conv", *eager_us(conv_fn, args))
    for bv, nw in ctx.tiles():
        name = "rule" if bv is None else f"rule bv{bv} w{nw}"
        ctx.report("prefill", bs, length, name, *eager_us(rule_fn(bv, nw), args))
    ctx.report("prefill", bs, length, "mixer", *eager_us(mixer_fn, args))
    if ctx.fla is None:
        return
    saved = ssm.clone()
    rule_fn()()
    o_rule = o.clone()
    for name in ("recurrent", "chunk"):
        ssm.copy_(saved)
        res = {}
        step = fla_step(ctx.fla[name], q, k, v, g, beta, ssm, slots, 1, cu.long(), res)
        try:
            step()
        except Exception as e:  # a version whose signature differs: report it, go on
            print(f"  fla-{name} failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        check = rel(res["o"].reshape(o_rule.shape), o_rule)
        ctx.report("prefill", bs, length, f"fla-{name}", *eager_us(step, args), check=check)
    ssm.copy_(saved)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn: needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    fla = None if args.no_fla else load_fla()
    num_slots = max([*args.bs, *args.prefill_requests]) + 16
    _, conv, ssm = arena_states(num_slots, dev)
    w = (0.5 * torch.randn(CONV_DIM, KW, generator=gen, device=dev)).bfloat16()
    state_bytes = H * DK * DV * 4 + CONV_DIM * (KW - 1) * 2  # per request and layer

    props = torch.cuda.get_device_properties(dev)
    env = {
        "gpu": torch.cuda.get_device_name(dev),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla["version"] if fla else None,
        "heads": H,
        "dk": DK,
        "dv": DV,
        "conv_dim": CONV_DIM,
        "conv_kernel": KW,
        "verify_tokens": args.verify_tokens,
        "per_graph": args.per_graph,
        "repeats": args.repeats,
    }
    print(
        f"GPU {env['gpu']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}, "
        f"fla {env['fla'] or 'not available'}\n"
        f"GDN layer: H={H}, Dk={DK}, Dv={DV}, conv_dim={CONV_DIM}, K={KW}; bf16 inputs and conv "
        f"state, fp32 SSM state in arena slot views ({state_bytes / 2**20:.2f} MiB per request); "
        f"decode/verify in CUDA graphs of {args.per_graph} calls, prefill eager; median of "
        f"{args.repeats} samples; times in us"
    )
    header = f"{'mode':>7} {'bs':>4} {'T':>5} {'impl':>16} {'us':>10} {'GB/s':>7} {'check':>8}"
    print(header)
    print("-" * len(header))
    rows = []

    def report(mode, bs, t, impl, us, how, moved=None, check=None):
        gbs = moved / (us * 1e-6) / 1e9 if moved else None
        row = {"mode": mode, "bs": bs, "tokens": t, "impl": impl, "us": us, "timing": how,
               "gb_per_s": gbs, "check": check}  # fmt: skip
        rows.append(row)
        g_s = f"{gbs:7.0f}" if gbs else f"{'':>7}"
        c_s = f"{check:8.1e}" if check is not None else f"{'':>8}"
        print(f"{mode:>7} {bs:>4} {t:>5} {impl:>16} {us:10.1f} {g_s} {c_s}" + (
            "" if how == "graph" or mode == "prefill" else f"  ({how})"))  # fmt: skip

    ctx = Context(args, dev, gen, fla, conv, ssm, w, state_bytes, report)
    for mode in ("decode", "verify"):
        for bs in args.bs:
            bench_step(ctx, mode, bs)
    for bs in args.prefill_requests:
        for length in args.prefill_lens:
            bench_prefill(ctx, bs, length)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
