"""GDN verify + commit of a DSPARK step, old vs new: per-position states in scratch and a
copy commit (``old``), against the step's recorded inputs and a replay commit (``new``).

- ``old``: ``gdn_forward_triton("verify", conv_scratch=, ssm_scratch=)`` writes the conv
  window and the SSM state after every position (``[bs, T, H, Dk, Dv]`` fp32 per layer), then
  ``commit_states_multi`` copies entry ``accepted`` of every layer's scratches into the slots
  (one launch);
- ``new``: ``gdn_forward_triton("verify", record=)`` keeps the conv input and output rows
  (bf16) and the gates of every position, and ``gdn_replay_commit_triton`` (two launches per
  layer) rebuilds the conv window and re-runs the recurrence over tokens ``0 .. accepted``
  from the slot, in the verify's own kernel.

Sizes: ``--layers`` GDN layers of the ``small`` preset (16 heads, Dk = Dv = 128, bf16 inputs
and conv state, fp32 SSM state in arena slot views), ``--bs`` lanes x ``--tokens`` (gamma + 1)
tokens, accepted counts uniform in ``1 .. T`` (``random``) and all ``T`` (``all``, the
replay's worst case). Times in CUDA graphs (``--per-graph`` steps per graph; device time per
step, median of ``--repeats``): ``verify`` (all layers' mixers), ``commit``, ``total``.
``scratch MB``: the per-position scratch or record allocated (all layers); ``moved MB``: bytes
the phase must read and write (verify: states read + scratch written; commit: what it reads
and writes). ``conv bitwise``: whether the new commit's conv windows equal the old's byte for
byte; ``state ulps``: the largest difference of the committed SSM states, in units of fp32
eps at the states' largest magnitude (the old verify is another compiled kernel). ``--tiles``
also times the new form and a decode step (one token per lane through every layer) per
delta-rule tile: decode, verify and the replay share the step tile. ``--json PATH`` writes
the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from unimem_kernel import gdn
from unimem_kernel import gdn_reference as gr
from unimem_kernel.state_commit import StateCommitPlan, commit_states_multi

H, DK, DV, KW = 16, 128, 128, 4


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per verify (gamma + 1)")
    ap.add_argument("--layers", type=int, default=8, help="GDN layers per step")
    ap.add_argument("--key-heads", type=int, default=H)
    ap.add_argument("--per-graph", type=int, default=10, help="steps per captured graph")
    ap.add_argument("--replays", type=int, default=10, help="graph replays per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples; the median is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiles",
        default="",
        help="also time the new form's verify + commit with these delta-rule tiles: "
        "comma-separated BVxWARPS (e.g. 16x1,32x2,64x4); the default tile is the first row",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


class Layer:
    """One GDN layer: weights, arena-view slot states, the step's inputs and both scratches."""

    def __init__(self, args, num_slots, gen, dev):
        hk, bs, t = args.key_heads, args.bs, args.tokens
        self.conv_dim = gr.mixed_qkv_dim(H, DK, DV, hk)
        conv_bytes = self.conv_dim * (KW - 1) * 2
        ssm_off = -(-conv_bytes // 256) * 256
        slot = ssm_off + H * DK * DV * 4
        self.arena = torch.zeros(num_slots * slot, dtype=torch.uint8, device=dev)
        self.conv = self.arena.view(torch.bfloat16).as_strided(
            (num_slots, self.conv_dim, KW - 1), (slot // 2, KW - 1, 1), 0
        )
        self.ssm = self.arena.view(torch.float32).as_strided(
            (num_slots, H, DK, DV), (slot // 4, DK * DV, DV, 1), ssm_off // 4
        )

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=dev)

        self.conv.copy_(randn(*self.conv.shape).bfloat16())
        self.ssm.copy_(0.1 * randn(*self.ssm.shape))
        self.w = (0.5 * randn(self.conv_dim, KW)).bfloat16()
        self.x = randn(bs * t, self.conv_dim).bfloat16()
        self.g = -torch.rand(bs * t, H, generator=gen, device=dev)
        self.beta = torch.rand(bs * t, H, generator=gen, device=dev)
        self.o = torch.empty(bs * t, H, DV, dtype=torch.bfloat16, device=dev)
        self.y = torch.empty_like(self.x)
        self.conv_scratch = torch.zeros(bs, t, self.conv_dim, KW - 1, dtype=torch.bfloat16,
                                        device=dev)  # fmt: skip
        self.ssm_scratch = torch.zeros(bs, t, H, DK, DV, device=dev)
        self.record = gr.VerifyRecord.empty(bs, t, self.conv_dim, H, torch.bfloat16,
                                            torch.float32, dev)  # fmt: skip
        self.o1 = torch.empty(bs, H, DV, dtype=torch.bfloat16, device=dev)
        self.y1 = torch.empty(bs, self.conv_dim, dtype=torch.bfloat16, device=dev)

    def verify(self, slots, new: bool, hk: int, tile=(None, None)) -> None:
        if new:
            scratch = {"record": self.record}
        else:
            scratch = {"conv_scratch": self.conv_scratch, "ssm_scratch": self.ssm_scratch,
                       "conv_out": self.y}  # fmt: skip
        gdn.gdn_forward_triton(
            "verify", self.x, self.w, self.g, self.beta, self.conv, self.ssm, slots,
            num_k_heads=hk, out=self.o, block_v=tile[0], num_warps=tile[1], **scratch,
        )  # fmt: skip

    def decode(self, slots, hk: int, tile=(None, None)) -> None:
        bs = slots.shape[0]
        gdn.gdn_forward_triton(
            "decode", self.x[:bs], self.w, self.g[:bs], self.beta[:bs], self.conv, self.ssm,
            slots, num_k_heads=hk, out=self.o1, conv_out=self.y1, block_v=tile[0],
            num_warps=tile[1],
        )  # fmt: skip


def graph_us(fn, args) -> float:
    """Device time of one ``fn`` call replayed from a CUDA graph of ``per_graph`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.per_graph):
            fn()
    samples = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (args.replays * args.per_graph))
    return statistics.median(samples)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn_commit: needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    bs, t, hk, nl = args.bs, args.tokens, args.key_heads, args.layers
    num_slots = bs + 16
    layers = [Layer(args, num_slots, gen, dev) for _ in range(nl)]
    perm = torch.randperm(num_slots, generator=gen, device=dev)[:bs]
    slots = perm.to(torch.int32)
    old_plan = StateCommitPlan(
        [s for ly in layers for s in (ly.conv_scratch, ly.ssm_scratch)],
        [d for ly in layers for d in (ly.conv, ly.ssm)],
    )
    accepted_sets = {
        "random": torch.randint(0, t, (bs,), generator=gen, device=dev, dtype=torch.int32),
        "all": torch.full((bs,), t - 1, dtype=torch.int32, device=dev),
    }
    saved = [ly.arena.clone() for ly in layers]

    def restore():
        for ly, a in zip(layers, saved, strict=True):
            ly.arena.copy_(a)

    def verify(new, tile=(None, None)):
        return lambda: [ly.verify(slots, new, hk, tile) for ly in layers]

    def commit(new, accepted, tile=(None, None)):
        def run():
            if new:
                for ly in layers:
                    gdn.gdn_replay_commit_triton(
                        ly.record, accepted, ly.conv, ly.ssm, slots, hk,
                        block_v=tile[0], num_warps=tile[1],
                    )  # fmt: skip
            else:
                commit_states_multi(old_plan, accepted, slots, None)

        return run

    # agreement: both paths from the same slot states
    bitwise, ulps = {}, {}
    for name, accepted in accepted_sets.items():
        results = []
        for new in (False, True):
            restore()
            verify(new)()
            commit(new, accepted)()
            results.append([(ly.conv.clone(), ly.ssm.clone()) for ly in layers])
        bitwise[name] = all(torch.equal(a[0], b[0]) for a, b in zip(*results, strict=True))
        ulps[name] = max(
            float((a[1] - b[1]).abs().max()) / (torch.finfo(torch.float32).eps *
                                                 float(a[1].abs().max()))
            for a, b in zip(*results, strict=True)
        )  # fmt: skip
    restore()

    ssm_b, conv_b = H * DK * DV * 4, layers[0].conv_dim * (KW - 1) * 2
    prep_b = layers[0].record.nbytes // (bs * t)  # record bytes per token
    x_b = layers[0].conv_dim * 2 + H * 8  # verify inputs per token (mixed_qkv, g, beta)
    env = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "heads": H, "key_heads": hk, "dk": DK, "dv": DV, "layers": nl, "bs": bs, "tokens": t,
        "per_graph": args.per_graph, "repeats": args.repeats,
        "scratch_mb": {
            "old": nl * bs * t * (ssm_b + conv_b) / 1e6,
            "new": nl * bs * t * prep_b / 1e6,
        },
    }  # fmt: skip
    print(
        f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}; {nl} GDN layers "
        f"(H={H}, Hk={hk}, Dk={DK}, Dv={DV}), bs {bs} x {t} tokens; per-position scratch "
        f"old {env['scratch_mb']['old']:.0f} MB, new {env['scratch_mb']['new']:.1f} MB; "
        f"times in us per step (CUDA graphs of {args.per_graph} steps)"
    )
    header = (f"{'accepted':>8} {'impl':>4} {'phase':>7} {'us':>9} {'moved MB':>9} "
              f"{'conv bitwise':>12} {'state ulps':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))
    rows = []
    for name, accepted in accepted_sets.items():
        mean_kept = float(accepted.float().mean()) + 1  # tokens replayed per lane
        for new in (False, True):
            impl = "new" if new else "old"
            per_tok = prep_b if new else ssm_b + conv_b
            moved = {
                "verify": nl * bs * (ssm_b + conv_b + t * (x_b + per_tok)),
                "commit": nl * bs * (
                    2 * conv_b + (mean_kept * prep_b + 2 * ssm_b if new else 2 * ssm_b)
                ),
            }  # fmt: skip
            moved["total"] = moved["verify"] + moved["commit"]
            v, c = verify(new), commit(new, accepted)
            times = {"verify": graph_us(v, args), "commit": graph_us(c, args)}
            times["total"] = graph_us(lambda v=v, c=c: (v(), c()), args)
            restore()
            for phase in ("verify", "commit", "total"):
                row = {"accepted": name, "impl": impl, "phase": phase, "us": times[phase],
                       "moved_mb": moved[phase] / 1e6, "conv_bitwise": bitwise[name],
                       "state_ulps": ulps[name]}  # fmt: skip
                rows.append(row)
                print(f"{name:>8} {impl:>4} {phase:>7} {times[phase]:9.1f} "
                      f"{moved[phase] / 1e6:9.1f} {str(bitwise[name]):>12} "
                      f"{ulps[name]:10.1f}")  # fmt: skip
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",") if t]
    if tiles:
        print("new form and decode by delta-rule tile (accepted: random)")
        print(f"  {'tile':>8} {'verify':>9} {'commit':>9} {'total':>9} {'decode':>9}")
    for tile in tiles:
        accepted = accepted_sets["random"]
        v, c = verify(True, tile), commit(True, accepted, tile)
        times = {"verify": graph_us(v, args), "commit": graph_us(c, args)}
        times["total"] = graph_us(lambda v=v, c=c: (v(), c()), args)
        times["decode"] = graph_us(
            lambda tile=tile: [ly.decode(slots, hk, tile) for ly in layers], args
        )
        restore()
        print(f"  {tile[0]:>4}x{tile[1]:<3} {times['verify']:9.1f} {times['commit']:9.1f} "
              f"{times['total']:9.1f} {times['decode']:9.1f}")  # fmt: skip
        for phase in ("verify", "commit", "total", "decode"):
            rows.append({"accepted": "random", "impl": f"new bv{tile[0]} w{tile[1]}",
                         "phase": phase, "us": times[phase]})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(bitwise.values()) and max(ulps.values()) <= 8 else 2


if __name__ == "__main__":
    raise SystemExit(main())
