"""FA4 decode / verify time reading KV through arena views vs a contiguous per-layer cache.

The arena holds page envelopes laid out layer-major (docs/architecture.md, "Units"): for each
of ``--layers`` layers a contiguous ``[page_size, Hkv, D]`` K block then a V block, so one
layer's view has a page stride of the whole envelope (``layers`` times one layer's K+V). The
contiguous cache is ``[num_pages, page_size, Hkv, D]`` per layer with the same page ids and the
same bytes. Both run the same ``FA4Backend.attend`` (causal, paged, ``seqused_k``), captured in
a CUDA graph and replayed, so the numbers are kernel time, not Python launch overhead. Sides
alternate over ``--rounds`` rounds; the median per side is reported with the ratio arena /
contiguous.

    python -m unimem.bench.fa4_arena       # bs 48/256, ctx 2048/8192, page 64
    python -m unimem.bench.fa4_arena --bs 48 --context 4096 --gamma 3 \\
        --page-size 128
"""

from __future__ import annotations

import argparse
import statistics
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bs", type=int, nargs="+", default=[48, 256], help="batch sizes")
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192], help="tokens cached")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-dim-v", type=int, default=None, help="default: --head-dim")
    p.add_argument("--gamma", type=int, default=3, help="verify width is gamma + 1")
    p.add_argument("--layers", type=int, default=4, help="layers per page envelope")
    p.add_argument("--window", type=int, default=None, help="sliding window (None: full)")
    p.add_argument("--replays", type=int, default=20, help="graph replays per timing")
    p.add_argument("--rounds", type=int, default=7, help="alternating timing rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pack-gqa",
        choices=("auto", "on", "off"),
        default="auto",
        help="FA4's pack_gqa (auto: FA4's own choice, as the engine runs it)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_fa4_arena: needs a CUDA device (and flash-attn-4)", file=sys.stderr)
        return 2
    from unimem.attention.fa4_backend import FA4Backend
    from unimem.attention.metadata import AttentionMetadata

    dev = torch.device("cuda")
    dt = torch.bfloat16
    dk = args.head_dim
    dv = args.head_dim_v or dk
    hq, hkv, ps = args.q_heads, args.kv_heads, args.page_size
    elt = torch.empty((), dtype=dt).element_size()
    k_block, v_block = ps * hkv * dk * elt, ps * hkv * dv * elt
    envelope = args.layers * (k_block + v_block)
    lane = args.layers // 2
    backend = FA4Backend(pack_gqa={"auto": None, "on": True, "off": False}[args.pack_gqa])
    props = torch.cuda.get_device_properties(dev)
    print(f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}")
    print(
        f"Hq={hq} Hkv={hkv} Dk={dk} Dv={dv} bf16, page={ps}, envelope={args.layers} layers "
        f"({envelope} B page stride vs {k_block + v_block} B contiguous), "
        f"window={args.window}, gamma={args.gamma}, pack_gqa={args.pack_gqa}; "
        f"CUDA graph x{args.replays} replays, median of {args.rounds} alternating rounds"
    )
    header = f"{'bs':>5} {'ctx':>6} {'step':>7} {'arena us':>9} {'contig us':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    for bs in args.bs:
        for ctx in args.context:
            pages_per_req = -(-(ctx + args.gamma + 1) // ps)
            num_pages = 1 + bs * pages_per_req
            arena = torch.zeros(num_pages * envelope, dtype=torch.uint8, device=dev)
            typed = arena.view(dt)
            off = lane * (k_block + v_block) // elt
            k_arena = typed.as_strided(
                (num_pages, ps, hkv, dk), (envelope // elt, hkv * dk, dk, 1), off
            )
            v_arena = typed.as_strided(
                (num_pages, ps, hkv, dv), (envelope // elt, hkv * dv, dv, 1), off + k_block // elt
            )
            k_arena[1:].normal_(generator=gen)
            v_arena[1:].normal_(generator=gen)
            k_contig, v_contig = k_arena.contiguous(), v_arena.contiguous()
            perm = torch.randperm(num_pages - 1, generator=gen, device=dev).to(torch.int32) + 1
            table = perm.view(bs, pages_per_req).contiguous()
            for step, q_len in (("decode", 1), (f"verify{args.gamma + 1}", args.gamma + 1)):
                meta = make_meta(AttentionMetadata, bs, ctx, q_len, ps, table, dev)
                q = torch.randn(bs * q_len, hq, dk, generator=gen, device=dev).to(dt)
                times, outs = {}, {}
                graphs = {}
                for name, (kc, vc) in (
                    ("arena", (k_arena, v_arena)),
                    ("contig", (k_contig, v_contig)),
                ):
                    graphs[name], outs[name] = capture(
                        torch, backend, q, kc, vc, meta, args.window, dk**-0.5, args.replays
                    )
                    times[name] = []
                for _ in range(args.rounds):
                    for name in ("arena", "contig"):
                        times[name].append(time_graph(torch, graphs[name]) / args.replays)
                torch.cuda.synchronize()
                diff = float((outs["arena"].float() - outs["contig"].float()).abs().max())
                a = statistics.median(times["arena"]) * 1e3
                c = statistics.median(times["contig"]) * 1e3
                print(f"{bs:>5} {ctx:>6} {step:>7} {a:>9.1f} {c:>10.1f} {a / c:>7.3f}", end="")
                print("" if diff == 0 else f"   (max |diff| {diff:.2e})")
                del graphs
            del arena, typed, k_arena, v_arena, k_contig, v_contig
            torch.cuda.empty_cache()
    return 0


def make_meta(cls, bs, ctx, q_len, ps, table, dev):
    import torch

    i32 = dict(dtype=torch.int32, device=dev)
    t = bs * q_len
    total = ctx + q_len
    return cls(
        cu_seqlens_q=torch.arange(bs + 1, **i32) * q_len,
        cache_seqlens=torch.full((bs,), total, **i32),
        cu_seqlens_k=torch.arange(bs + 1, **i32) * total,
        page_table=table,
        swa_page_table=None,
        max_seqlen_q=q_len,
        max_seqlen_k=table.shape[1] * ps,
        num_tokens=t,
        page_size=ps,
        full_write_slots=torch.zeros(t, **i32),
        swa_write_slots=None,
        positions=torch.zeros(t, dtype=torch.int64, device=dev),
    )


def capture(torch, backend, q, kc, vc, meta, window, scale, replays):
    """Eager warm-up (compiles), then a graph of ``replays`` back-to-back attends."""
    run = lambda: backend.attend(q, kc, vc, meta, swa=False, window=window, scale=scale)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            out = run()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def time_graph(torch, graph) -> float:
    """Milliseconds of one replay, by CUDA events (:mod:`unimem_kernel.timing`)."""
    from unimem_kernel.timing import median_ms

    return median_ms(graph.replay, warmup=0, iters=1, repeats=1, device="cuda")


if __name__ == "__main__":
    sys.exit(main())
