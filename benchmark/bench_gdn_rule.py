"""Where the delta rule's time goes in a DSPARK verify step: the ``_rule_kernel`` launches of
the verify and of the replay commit against the bytes they must move.

Per row (all ``--layers`` GDN layers of the ``small`` preset: 16 heads, Dk = Dv = 128, fp32
states in slot views, bf16 conv outputs; ``--bs`` lanes x ``--tokens`` tokens), device time in
CUDA graphs (median of ``--repeats``):

- ``verify``: the verify's rule launch (reads each lane's state, stores the outputs and the
  record's gates); ``verify, no prologue``: the same launch with the mixer's prologue (the L2
  norm of q, k; SiLU runs in the conv) switched off — the arithmetic the prologue costs;
- ``replay``: the replay commit's rule launch (tokens ``0 .. accepted`` from the slot, the
  final state written back), accepted counts uniform in ``0 .. T-1`` (``random``) or ``T-1``
  (``all``); with and without the prologue; ``1 launch``: every layer's replay in one launch
  (the engine's :class:`~unimem_kernel.gdn.ReplayCommitPlan` form);
- ``read states`` / ``copy states``: a read-only reduction and a copy of the same states (the
  bandwidth floor of the verify's and of the replay's state traffic);
- ``fused bound, r + T tokens`` (``--fused-extra``, with the prologue): one rule launch per
  layer over ``r + T`` tokens per lane with the final state written back, against ``verify``
  plus ``replay r tokens, 1 launch`` (every lane replaying ``r`` tokens). It bounds a replay
  commit folded into the next step's verify — one kernel that replays the previous step's
  ``r`` accepted tokens from the slot, writes the state there, then runs this step's ``T``
  tokens — from above (it also stores the ``r`` replayed tokens' outputs, and writes the
  state at the end instead of after token ``r``: the same bytes).

``--tiles BVxWARPS,..`` repeats the rule rows per delta-rule tile (the step tile first);
``step`` is the launch the engine makes (no explicit tile: ``gdn._rule_config``'s step
default). ``--heads`` / ``--key-heads`` set the value and key heads (Qwen3-Next: 32 / 16).
This is a diagnostic of the kernel's form (what bounds it: state bytes or per-token
arithmetic); the engine's numbers are ``profile_step.py``'s.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_gdn_commit import graph_us

from unimem_kernel import gdn
from unimem_kernel import gdn_reference as gr

DK, DV = 128, 128


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per verify (gamma + 1)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiles", default="step", help="BVxWARPS list, or step")
    ap.add_argument("--heads", type=int, default=16, help="value heads")
    ap.add_argument("--key-heads", type=int, default=None, help="key heads (default: --heads)")
    ap.add_argument(
        "--fused-extra", default="1,4", help="replayed tokens r of the fused-bound rows (list)"
    )
    ap.add_argument("--per-graph", type=int, default=10)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn_rule: needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    bs, t, nl = args.bs, args.tokens, args.layers
    H = args.heads
    HK = args.key_heads or H
    n = bs * t
    conv_dim = gr.mixed_qkv_dim(H, DK, DV, HK)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    # every layer's tensors are slices of one stacked tensor, so that one launch can also run
    # all layers' replays (layer i's lanes are lanes i * bs .. of the stack)
    ns = bs + 16
    all_states = 0.1 * randn(nl * ns, H, DK, DV)
    all_ys = randn(nl * n, conv_dim).bfloat16()
    all_gs = -torch.rand(nl * n, H, generator=gen, device=dev)
    all_betas = torch.rand(nl * n, H, generator=gen, device=dev)
    states = [all_states[i * ns : (i + 1) * ns] for i in range(nl)]
    ys = [all_ys[i * n : (i + 1) * n] for i in range(nl)]
    gs = [all_gs[i * n : (i + 1) * n] for i in range(nl)]
    betas = [all_betas[i * n : (i + 1) * n] for i in range(nl)]
    outs = [torch.empty(n, H, DV, dtype=torch.bfloat16, device=dev) for _ in range(nl)]
    rec_g = [torch.empty(bs, t, H, device=dev) for _ in range(nl)]
    rec_b = [torch.empty(bs, t, H, device=dev) for _ in range(nl)]
    slots = torch.randperm(bs + 16, generator=gen, device=dev)[:bs].to(torch.int32)
    accepted = {
        "random": torch.randint(0, t, (bs,), generator=gen, device=dev, dtype=torch.int32),
        "all": torch.full((bs,), t - 1, dtype=torch.int32, device=dev),
    }
    extras = [int(r) for r in args.fused_extra.split(",") if r]
    for r in extras:
        if not 1 <= r <= t:
            raise SystemExit(f"bench_gdn_rule: --fused-extra {r} must be in 1 .. {t}")
        accepted[f"{r} tokens"] = torch.full((bs,), r - 1, dtype=torch.int32, device=dev)

    def launch(y, g, beta, out, state, lanes, prep, tile, acc, gates, seq=t, final=None):
        q, k, v = gdn._split_conv_out(y, H, DK, DV, HK)
        strides = tuple(gdn._row_strides(x, seq, True) for x in (q, k, v))
        gb_strides = tuple(gdn._row_strides(x, seq, True) for x in (g, beta))
        gdn._launch_rule(
            (q, k, v), strides, (g, beta), gb_strides, out, (seq * H * DV, H * DV, DV, 1),
            state, lanes, seq_len=seq, cu=None, init=None, scratch=None,
            write_final=acc is not None if final is None else final, prep=prep, scale=None,
            block_v=tile[0], num_warps=tile[1], record_gates=gates, accepted=acc,
        )  # fmt: skip

    def rule(i, prep, tile, acc=None):
        gates = None if acc is not None else (rec_g[i], rec_b[i])
        launch(ys[i], gs[i], betas[i], outs[i], states[i], slots, prep, tile, acc, gates)

    # the stacked form: lane i * bs + b is layer i's lane b (its slot offset by i * ns)
    stacked_slots = torch.cat([slots + i * ns for i in range(nl)])
    stacked_out = torch.empty(nl * n, H, DV, dtype=torch.bfloat16, device=dev)

    stacked_accepted = {name: acc.repeat(nl) for name, acc in accepted.items()}

    def rule_stacked(prep, tile, name):
        launch(all_ys, all_gs, all_betas, stacked_out, all_states, stacked_slots, prep, tile,
               stacked_accepted[name], None)  # fmt: skip

    rows = []
    state_mb = nl * bs * H * DK * DV * 4 / 1e6
    sel = [s for s in states]
    read_us = graph_us(lambda: [s[:bs].sum() for s in sel], args)
    copies = [torch.empty_like(s[:bs]) for s in sel]
    copy_us = graph_us(lambda: [c.copy_(s[:bs]) for c, s in zip(copies, sel, strict=True)], args)
    rows.append({"row": "read states", "us": read_us, "GB/s": state_mb / read_us * 1e3})
    rows.append({"row": "copy states", "us": copy_us, "GB/s": 2 * state_mb / copy_us * 1e3})

    def add(row, spec, fn, traffic_mb):
        us = graph_us(fn, args)  # runs and times ``fn`` before returning
        rows.append({"row": row, "tile": spec, "us": us, "GB/s": traffic_mb / us * 1e3})

    def fused_inputs(r):
        # r + t tokens per lane for every layer (the fused-bound rows)
        m = bs * (r + t)
        ys_ = [randn(m, conv_dim).bfloat16() for _ in range(nl)]
        gs_ = [-torch.rand(m, H, generator=gen, device=dev) for _ in range(nl)]
        bs_ = [torch.rand(m, H, generator=gen, device=dev) for _ in range(nl)]
        outs_ = [torch.empty(m, H, DV, dtype=torch.bfloat16, device=dev) for _ in range(nl)]
        return ys_, gs_, bs_, outs_

    fused = {r: fused_inputs(r) for r in extras}

    def rule_fused(r, tile):
        fy, fg, fb, fo = fused[r]
        for i in range(nl):
            launch(fy[i], fg[i], fb[i], fo[i], states[i], slots, True, tile, None, None,
                   seq=r + t, final=True)  # fmt: skip

    for spec in args.tiles.split(","):
        tile = (None, None) if spec == "step" else tuple(int(x) for x in spec.split("x"))
        for prep in (True, False):
            tag = "" if prep else ", no prologue"
            add("verify" + tag, spec, lambda: [rule(i, prep, tile) for i in range(nl)], state_mb)  # noqa: B023
            for name, acc in accepted.items():
                if name.endswith("tokens") and not prep:
                    continue
                add(f"replay {name}" + tag, spec,
                    lambda: [rule(i, prep, tile, acc) for i in range(nl)], 2 * state_mb)  # noqa: B023  # fmt: skip
                add(f"replay {name}, 1 launch" + tag, spec,
                    lambda: rule_stacked(prep, tile, name), 2 * state_mb)  # noqa: B023  # fmt: skip
        for r in extras:
            add(f"fused bound, {r} + {t} tokens", spec, lambda: rule_fused(r, tile), 2 * state_mb)  # noqa: B023
    print(f"bench_gdn_rule: {torch.cuda.get_device_name()}, {nl} layers, {bs} lanes x {t} "
          f"tokens, H {H} (key heads {HK}), Dk {DK}, Dv {DV}; "
          f"states {state_mb:.0f} MB")  # fmt: skip
    for r in rows:
        print(f"  {r['row']:<28} {r.get('tile', ''):>6} {r['us']:9.1f} us  {r['GB/s']:7.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "heads": H, "key_heads": HK,
                   "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
