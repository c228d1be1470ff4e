"""Decode / verify attention on one GPU: FlashAttention-4 against the split-KV Triton kernel
(``unimem_kernel.paged_attention.paged_verify_attention``), side by side.

Shapes of the ``small`` preset: ``--bs`` 48 requests, 16 query / 4 KV heads of 128, bf16,
page 64. The caches are arena views: pages laid out layer-major in an envelope of
``--layers`` layers (each a K block then a V block), so a layer's page stride is the whole
envelope, as the engine's pools lay them out. Every request holds ``ctx`` cached tokens plus
the step's ``q_len`` new ones (``cache_seqlens = ctx + q_len``) in randomly placed pages.
Rows: ``q_len`` 8 (a DSPARK verify, gamma 7) and 1
(decode) x contexts 512, 1024, 2048, 4096 x window None and 512.

Each side is timed as the engine runs it: ``--iters`` calls recorded in one CUDA graph,
CUDA events around a replay, the median of ``--repeats`` replays (``unimem_kernel.timing``), in
microseconds per call. ``fa4n us``: FA4 with the backend's narrow query tile
(``fa4_backend.narrow_query_tile``: 64 rows, one consumer warpgroup) where the step's packed
rows fit it, as ``FA4Backend`` runs such steps on SM90. ``GB/s`` is the K/V bytes the step
must read (the keys some query of a request can see, every request) over our time. ``err``
is the largest elementwise difference of ours vs FA4, relative to FA4's largest magnitude
(bf16 outputs: ~1e-2 is a few bf16 ulps); a comment line before each row gives the narrow
tile's against the default tile's. ``--splits`` / ``--programs`` sweep our work split (keys
per split, programs per (request, KV head)); defaults are the module's. FA4 is skipped (ours
only) when ``flash_attn.cute`` does not import. Prints the GPU, the sizes and a table;
``--json PATH`` writes the rows. Needs CUDA (prints one line and exits 2 without it); most of
its time is FA4's first compiles.

    python -m unimem.bench.verify_attention
    python -m unimem.bench.verify_attention --q-len 8 --context 512 --programs 2 4 8
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="layers per page envelope")
    p.add_argument("--q-len", type=int, nargs="+", default=[8, 1], help="query rows/request")
    p.add_argument("--context", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--window", type=int, nargs="+", default=[0, 512], help="0: no window")
    p.add_argument("--splits", type=int, nargs="+", default=[None], help="keys per split")
    p.add_argument("--programs", type=int, nargs="+", default=[None], help="per (req, head)")
    p.add_argument("--max-seqlen-k", type=int, default=32768, help="host bound passed to ours")
    p.add_argument("--iters", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--repeats", type=int, default=5, help="graph replays; the median is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fa4", action="store_true", help="time ours only")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    return p.parse_args(argv)


def arena_views(torch, num_pages, args, dtype, device, gen):
    """K and V ``[num_pages, page, Hkv, D]`` views of layer ``layers // 2`` in a layer-major
    arena (page stride = the envelope); every slot finite (FA4 loads whole pages), the sink
    page 0 zero."""
    ps, hkv, d = args.page_size, args.kv_heads, args.head_dim
    block = ps * hkv * d
    envelope = args.layers * 2 * block
    arena = torch.empty(num_pages * envelope, dtype=dtype, device=device)
    off = (args.layers // 2) * 2 * block
    k = arena.as_strided((num_pages, ps, hkv, d), (envelope, hkv * d, d, 1), off)
    v = arena.as_strided((num_pages, ps, hkv, d), (envelope, hkv * d, d, 1), off + block)
    arena.normal_(generator=gen)
    k[0].zero_()
    v[0].zero_()
    return arena, k, v


def visible_keys(ctx_total: int, q_len: int, window: int | None) -> int:
    """Keys that some query of a request sees (each request: ``ctx_total`` keys)."""
    if window is None:
        return ctx_total
    return min(ctx_total, window + q_len - 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_verify_attention: needs a CUDA device (none found); nothing timed",
              file=sys.stderr)  # fmt: skip
        return 2
    import triton

    from unimem_kernel import paged_attention as pa
    from unimem_kernel.timing import graph_median_ms

    fa4 = fa4_fwd = None
    if not args.no_fa4:
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4
            from flash_attn.cute.interface import _flash_attn_fwd as fa4_fwd
        except ImportError as e:
            print(f"# FA4 not importable ({e}): ours only")
    from unimem.attention.fa4_backend import narrow_query_tile

    dev = torch.device("cuda")
    dt = torch.bfloat16
    bs, hq, hkv, d, ps = args.bs, args.q_heads, args.kv_heads, args.head_dim, args.page_size
    scale = d**-0.5
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    max_pages = triton.cdiv(max(args.context) + max(args.q_len), ps)
    num_pages = 1 + bs * max_pages
    arena, kc, vc = arena_views(torch, num_pages, args, dt, dev, gen)
    perm = torch.randperm(num_pages - 1, generator=gen, device=dev).to(torch.int32) + 1
    table_full = perm.view(bs, max_pages)
    props = torch.cuda.get_device_properties(dev)
    print(f"# GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, FA4 {'yes' if fa4 else 'no'}")  # fmt: skip
    print(f"# bs={bs} Hq={hq} Hkv={hkv} D={d} bf16 page={ps}, arena envelope {args.layers} "
          f"layers ({kc.stride(0) * 2} B page stride), {num_pages} pages "
          f"({arena.numel() * 2 / 2**30:.2f} GiB); CUDA graph of {args.iters} calls, median of "
          f"{args.repeats} replays; ours: max_seqlen_k={args.max_seqlen_k}, default split "
          f"{pa._SPLIT} keys, {pa._KV_PROGRAMS} programs")  # fmt: skip
    head = (f"{'q_len':>5} {'ctx':>5} {'window':>6} {'split':>5} {'progs':>5} {'fa4 us':>8} "
            f"{'fa4n us':>8} "
            f"{'ours us':>8} {'speedup':>7} {'ours GB/s':>9} {'err':>8}")  # fmt: skip
    print(head)
    print("-" * len(head))
    rows = []
    for q_len in args.q_len:
        q = torch.randn(bs * q_len, hq, d, generator=gen, device=dev).to(dt)
        cu = torch.arange(bs + 1, dtype=torch.int32, device=dev) * q_len
        for ctx in args.context:
            total = ctx + q_len
            n_cols = triton.cdiv(total, ps)
            table = table_full[:, :n_cols].contiguous()
            seq = torch.full((bs,), total, dtype=torch.int32, device=dev)
            for w in args.window:
                window = w or None
                left = None if window is None else window - 1
                kv_bytes = bs * visible_keys(total, q_len, window) * hkv * 2 * d * 2
                fa4_us, fa4_out = None, None
                if fa4 is not None:

                    def run_fa4(window=window, left=left, q=q, cu=cu, seq=seq, table=table,
                                q_len=q_len, n_cols=n_cols):  # fmt: skip
                        res = fa4(q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=q_len,
                                  max_seqlen_k=n_cols * ps, seqused_k=seq, page_table=table,
                                  softmax_scale=scale, causal=True,
                                  window_size=(left, None if left is None else 0),
                                  num_splits=1, pack_gqa=None)  # fmt: skip
                        return res[0] if isinstance(res, tuple) else res

                    fa4_us = 1e3 * graph_median_ms(run_fa4, warmup=2, iters=args.iters,
                                                   repeats=args.repeats)  # fmt: skip
                    fa4_out = run_fa4()
                tile = narrow_query_tile(q_len, hq, hkv, d, d, local=window is not None)
                narrow_us = None
                if fa4_fwd is not None and tile is not None:

                    def run_narrow(left=left, q=q, cu=cu, seq=seq, table=table, q_len=q_len,
                                   n_cols=n_cols, tile=tile):  # fmt: skip
                        return fa4_fwd(q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=q_len,
                                       max_seqlen_k=n_cols * ps, seqused_k=seq,
                                       page_table=table, softmax_scale=scale, causal=True,
                                       window_size_left=left,
                                       window_size_right=None if left is None else 0,
                                       tile_mn=tile, num_threads=256)[0]  # fmt: skip

                    narrow_us = 1e3 * graph_median_ms(run_narrow, warmup=2, iters=args.iters,
                                                      repeats=args.repeats)  # fmt: skip
                    diff = (run_narrow().float() - fa4_out.float()).abs().max()
                    narrow_err = float(diff / fa4_out.float().abs().max().clamp_min(1e-30))
                    print(f"# q_len {q_len} ctx {ctx} window {window}: FA4 narrow tile {tile} "
                          f"vs default, max rel diff {narrow_err:.1e}")  # fmt: skip
                for split in args.splits:
                    for progs in args.programs:

                        def run_ours(window=window, q=q, cu=cu, seq=seq, table=table,
                                     q_len=q_len, split=split, progs=progs):  # fmt: skip
                            return pa.paged_verify_attention(
                                q, kc, vc, cu, seq, table, q_len=q_len,
                                max_seqlen_k=args.max_seqlen_k, scale=scale, window=window,
                                split_size=split, kv_programs=progs,
                            )  # fmt: skip

                        ours_us = 1e3 * graph_median_ms(run_ours, warmup=2, iters=args.iters,
                                                        repeats=args.repeats)  # fmt: skip
                        err = None
                        if fa4_out is not None:
                            out = run_ours()
                            diff = (out.float() - fa4_out.float()).abs().max()
                            err = float(diff / fa4_out.float().abs().max().clamp_min(1e-30))
                        row = {
                            "bs": bs, "q_len": q_len, "context": ctx, "cache_seqlens": total,
                            "window": window, "split": split or pa._SPLIT,
                            "programs": progs or pa._KV_PROGRAMS, "fa4_us": fa4_us,
                            "fa4_narrow_us": narrow_us, "fa4_narrow_tile": tile,
                            "ours_us": ours_us, "ours_gbps": kv_bytes / ours_us / 1e3,
                            "kv_bytes": kv_bytes, "max_rel_err_vs_fa4": err,
                        }  # fmt: skip
                        rows.append(row)
                        fa4_s = f"{fa4_us:8.1f}" if fa4_us is not None else f"{'-':>8}"
                        fa4_s += f" {narrow_us:8.1f}" if narrow_us is not None else f" {'-':>8}"
                        sp = f"{fa4_us / ours_us:7.2f}" if fa4_us is not None else f"{'-':>7}"
                        err_s = f"{err:8.1e}" if err is not None else f"{'-':>8}"
                        print(f"{q_len:>5} {ctx:>5} {str(window):>6} {row['split']:>5} "
                              f"{row['programs']:>5} {fa4_s} {ours_us:8.1f} {sp} "
                              f"{row['ours_gbps']:9.0f} {err_s}", flush=True)  # fmt: skip
    if args.json:
        meta = {"gpu": props.name, "bs": bs, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                "page_size": ps, "layers": args.layers, "iters": args.iters,
                "repeats": args.repeats, "fa4": fa4 is not None}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
