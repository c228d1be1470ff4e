"""FP8 (e4m3) against bf16 for the verify step's GEMM shapes on one GPU: the data for deciding
whether an FP8 weight path (``--quantization fp8``-style: weights quantised per output channel
at load, activations per token at run time) can move the step's GEMM share.

Shapes: ``bench_gemm_shapes.SHAPES`` (the ``small`` preset at ``--m`` rows). Variants per shape:
- ``bf16``: ``F.linear`` (the LM head: ``torch.mm(..., out_dtype=float32)``);
- ``fp8 rowwise``: ``torch._scaled_mm`` with float32 scales per row of A ``[M, 1]`` and per
  output channel of B ``[1, N]``, bf16 (LM head: float32) out;
- ``fp8 tensor``: the same with one scale per operand;
- ``torch quant``: the per-token activation quantisation a rowwise call needs as torch ops
  (amax, divide, cast: several launches), timed alone; ``group quant``: the engine's one
  Triton launch (:func:`unimem_kernel.fp8_quantize_groups`, per token and 128 columns);
- ``fp8 block triton`` (``--gemm triton|both``): the engine's path, block-wise ``[128, 128]``
  weights with per-token-group (128) activation scales (:func:`unimem_kernel.fp8_linear`:
  the Triton quantisation launch + the Triton block-scaled GEMM), and ``gemm`` alone;
  ``invariant``: the same with the batch-invariant tile; ``fused_quant``: one launch that
  quantises the activations in its loads (``UNIMEM_FP8_ACT_QUANT=fused``);
- ``fp8_linear_dispatched`` (always): :func:`unimem_kernel.fp8_linear` as the engine calls it,
  with the weight's ``[ceil(N/128), K/128]`` block table: cuBLASLt from
  :func:`unimem_kernel.fp8_gemm.lt_min_rows` rows (by ``N``) on an SM90 GPU, the Triton
  kernel below (:func:`unimem_kernel.fp8_gemm.use_lt`; the row's
  ``dispatch`` says which): ``--m 48 128 256 384 512`` shows the crossover;
- ``fp8 block scaled_mm`` (``--gemm scaled_mm|both``): cuBLASLt's block scaling through
  ``torch._scaled_mm`` with the same scales, after the same Triton activation quantisation.
  PyTorch (``ScaledBlas.cpp``: ``is_blockwise_1x128_scaling`` / ``_128x128``, checked on
  ``a`` and on ``b.t()`` / ``scale_b.t()``) recognises the pair by shape and strides only:
  ``scale_a`` ``[M, K/128]`` float32 M-major (strides ``(1, M)``: ``xs.t().contiguous().t()``)
  and ``scale_b`` ``[K/128, N/128]`` whose transpose is the row-major ``[N/128, K/128]`` block
  table (``ws_block.t()``, a view), with ``b = wq.t()``; the newer
  ``torch.nn.functional.scaled_mm`` (explicit ``ScalingType.BlockWise1x128`` /
  ``BlockWise128x128``) is tried too. ``n/a`` with the errors where neither runs.
With ``--moe``, the routed experts' grouped GEMM (``--experts`` experts of width
``--moe-width``, top-``--topk`` routing of ``--m`` tokens): bf16
(:func:`unimem_kernel.expert_linear`) against FP8 (:func:`unimem_kernel.fp8_grouped_linear`).

Each time: ``--iters`` calls in one CUDA graph, the median of ``--repeats`` samples
(``unimem_kernel.timing.graph_median_ms``); TFLOP/s = 2 M N K / time; ``rel`` = the largest
|difference| to the float32 product of the unquantised operands, relative to its largest
|value|. ``--json PATH`` writes the rows. Needs CUDA (exits 2 with one line without it).

``--sweep`` (instead of the table): for each ``--sweep-shapes`` shape at each ``--sweep-m``
row count, times the Triton GEMM alone under every candidate tile (``BMxBN``, warps, stages,
split-K; pruned by the row count), checks each against the reference, and writes the
fastest per shape and row count as the tuned table ``unimem_kernel/fp8_gemm_configs.json``
reads (``--sweep-out``: this GPU's entry replaces its old one, other GPUs' entries in an
existing file stay; copy it there to use it), printing per row bf16, the default tile,
the best tile and the quantisation launch; also the fastest single tile without split-K over
all swept sizes (the candidate for the batch-invariant tile). ``--sweep-budget-s`` stops early
(the table then holds what was swept).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_gemm_shapes import SHAPES

from unimem_kernel.timing import graph_median_ms

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[384], help="rows (tokens per step)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=40, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples; the median is kept")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument(
        "--gemm",
        choices=["triton", "scaled_mm", "both"],
        default="both",
        help="which block-scaled FP8 GEMM(s) to time",
    )
    ap.add_argument("--moe", action="store_true", help="also the grouped expert GEMMs")
    ap.add_argument("--sweep", action="store_true", help="sweep the Triton GEMM's tiles")
    ap.add_argument(
        "--sweep-m",
        type=int,
        nargs="+",
        default=[48, 128, 16, 384],
        help="row counts, the most important first (the budget may stop later ones; on SM90 "
        "cuBLASLt takes most products from 128 or 256 rows, fp8_gemm.lt_min_rows)",
    )
    ap.add_argument(
        "--sweep-shapes", nargs="+", choices=list(SHAPES),
        default=["qkv", "o_proj", "gdn_in", "gate_up", "down", "q3n_gdn_in", "q3n_out", "q3n_kv"],
    )  # fmt: skip
    ap.add_argument("--sweep-out", default="fp8_gemm_configs.json", help="tuned table path")
    ap.add_argument("--sweep-budget-s", type=float, default=170.0)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-width", type=int, default=512)
    ap.add_argument("--topk", type=int, default=8)
    return ap.parse_args(argv)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation: ``(x / s, s)`` with ``s = amax(|row|) / 448`` (float32)."""
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def measure_shape(m: int, name: str, g: torch.Generator, args) -> dict:
    """One shape's row: each variant's µs, TFLOP/s and error, and the quantisation's µs."""
    dev = g.device
    k, n, out = SHAPES[name]
    out_dtype = torch.float32 if out == "fp32" else torch.bfloat16
    a = torch.randn(m, k, generator=g, device=dev).bfloat16()
    w = (torch.randn(n, k, generator=g, device=dev) / k**0.5).bfloat16()
    ref = a.float() @ w.float().t()
    wq, ws = quant_rows(w)  # per output channel
    aq, a_s = quant_rows(a)
    ws_row = ws.t().contiguous()  # [1, N]
    b = wq.t()  # [K, N] column-major, as _scaled_mm wants its second operand
    w_1 = w.float().abs().amax() / FP8_MAX
    a_1 = a.float().abs().amax() / FP8_MAX
    b_1 = (w.float() / w_1).to(FP8).t()
    aq_1 = (a.float() / a_1).to(FP8)

    def bf16():
        if out == "fp32":
            return torch.mm(a, w.t(), out_dtype=torch.float32)
        return F.linear(a, w)

    def rowwise():
        return torch._scaled_mm(aq, b, scale_a=a_s, scale_b=ws_row, out_dtype=out_dtype)

    def tensor():
        return torch._scaled_mm(aq_1, b_1, scale_a=a_1, scale_b=w_1, out_dtype=out_dtype)

    def time_us(fn) -> float:
        return 1e3 * graph_median_ms(fn, warmup=args.warmup, iters=args.iters, repeats=args.repeats)

    row: dict = {"m": m, "shape": name, "k": k, "n": n}
    for label, fn in (("bf16", bf16), ("fp8_rowwise", rowwise), ("fp8_tensor", tensor)):
        try:
            y = fn().float()
            rel = float((y - ref).abs().max() / ref.abs().max())
            us = time_us(fn)
            row[label] = {"us": us, "tflops": 2 * m * n * k / us / 1e6, "rel": rel}
        except RuntimeError as e:  # a scaling mode this build does not have
            row[label] = {"error": str(e).splitlines()[0][:160]}
    row["quant_us"] = time_us(lambda: quant_rows(a))
    from unimem_kernel.fp8_gemm import (
        device_capability,
        fp8_gemm,
        fp8_linear,
        fp8_quantize_groups,
        quantize_blocks,
        quantize_blockwise,
        use_lt,
    )

    row["group_quant_us"] = time_us(lambda: fp8_quantize_groups(a))
    if out == "fp32":  # the LM head stays bf16 in the FP8 models
        return row

    wq_b, ws_rows = quantize_blockwise(w)
    _, ws_block = quantize_blocks(w)
    xq, xs = fp8_quantize_groups(a)
    lt = use_lt(m, n, k, invariant=False, capability=device_capability(dev), has_blocks=True)
    row["dispatch"] = "cublaslt" if lt else "triton"
    variants = [
        ("fp8_linear_dispatched", lambda: fp8_linear(a, wq_b, ws_rows, block_scales=ws_block))
    ]
    if args.gemm in ("triton", "both"):
        variants += [
            ("fp8_block_triton", lambda: fp8_linear(a, wq_b, ws_rows)),
            ("fp8_block_triton_gemm",
             lambda: fp8_gemm(xq, xs, wq_b, ws_rows, out_dtype=torch.bfloat16)),
            ("fp8_block_triton_invariant", lambda: fp8_linear(a, wq_b, ws_rows, invariant=True)),
            ("fp8_block_triton_fused_quant",
             lambda: fp8_gemm(a, None, wq_b, ws_rows, out_dtype=torch.bfloat16)),
        ]  # fmt: skip
    if args.gemm in ("scaled_mm", "both"):
        smm = block_scaled_mm(xq, xs, wq_b, ws_block)
        if isinstance(smm, str):
            row["fp8_block_scaled_mm"] = {"error": smm}
        else:
            variants += [
                ("fp8_block_scaled_mm", lambda: smm(*fp8_quantize_groups(a))),
                ("fp8_block_scaled_mm_gemm", lambda: smm(xq, xs)),
            ]
    for label, fn in variants:
        y = fn().float()
        rel = float((y - ref).abs().max() / ref.abs().max())
        us = time_us(fn)
        row[label] = {"us": us, "tflops": 2 * m * n * k / us / 1e6, "rel": rel}
    return row


def block_scaled_mm(xq, xs, wq, ws_block):
    """``(xq, xs) -> bf16 [M, N]`` through ``torch._scaled_mm`` with 1 x 128 activation and
    128 x 128 weight scales, in the first scale layout this torch build accepts (and that
    matches the Triton kernel within 2 %); a string naming the errors otherwise."""
    from unimem_kernel.fp8_gemm import fp8_gemm

    want = fp8_gemm(xq, xs, wq, ws_rows_of(ws_block, wq.shape[0]), out_dtype=torch.float32)
    b = wq.t()  # [K, N] column-major
    sb = ws_block.contiguous().t()  # [K/128, N/128]; its transpose the row-major block table

    def m_major(s):  # [M, K/128] with strides (1, M)
        return s.t().contiguous().t()

    def scaled_mm_v1(q, s):
        return torch._scaled_mm(q, b, scale_a=m_major(s), scale_b=sb, out_dtype=torch.bfloat16)

    def scaled_mm_v2(q, s):
        from torch.nn.functional import ScalingType, scaled_mm

        return scaled_mm(
            q, b, m_major(s), ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )  # fmt: skip

    calls = {"torch._scaled_mm (a M-major, b block table transposed)": scaled_mm_v1}
    if hasattr(torch.nn.functional, "scaled_mm"):
        calls["torch.nn.functional.scaled_mm BlockWise1x128/128x128"] = scaled_mm_v2
    errors = []
    for name, call in calls.items():
        try:
            y = call(xq, xs).float()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            errors.append(f"{name}: {str(e).splitlines()[0][:120]}")
            continue
        rel = float((y - want).abs().max() / want.abs().max())
        if rel < 0.02:
            print(f"block-scaled cuBLASLt through {name}")
            return call
        errors.append(f"{name}: runs but differs (rel {rel:.2e})")
    return "; ".join(errors)


def ws_rows_of(ws_block: torch.Tensor, n: int) -> torch.Tensor:
    from unimem_kernel.fp8_gemm import expand_block_scales

    return expand_block_scales(ws_block, n)


def measure_moe(m: int, g: torch.Generator, args) -> dict:
    """The routed experts' gate/up grouped GEMM at ``m`` tokens: bf16 vs FP8 (µs; ``rel``
    against the bf16 product)."""
    from unimem_kernel import expert_linear, fp8_grouped_linear, moe_route
    from unimem_kernel.fp8_gemm import quantize_blockwise

    dev = g.device
    e, i, d = args.experts, args.moe_width, 2048
    x = torch.randn(m, d, generator=g, device=dev).bfloat16()
    w = (torch.randn(e, 2 * i, d, generator=g, device=dev) / d**0.5).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g, device=dev)[: args.topk] for _ in range(m)])
    route = moe_route(ids, e)
    wq, ws = quantize_blockwise(w)
    row: dict = {"m": m, "shape": f"moe_gate_up E{e} I{i} top{args.topk}"}
    base = expert_linear(x, w, route.ends, route.token).float()
    for label, fn in (
        ("bf16", lambda: expert_linear(x, w, route.ends, route.token)),
        ("fp8_block_triton", lambda: fp8_grouped_linear(x, wq, ws, route.ends, route.token)),
    ):
        y = fn().float()
        us = 1e3 * graph_median_ms(fn, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
        rows = route.token.shape[0]
        row[label] = {"us": us, "tflops": 2 * rows * 2 * i * d / us / 1e6,
                      "rel": float((y - base).abs().max() / base.abs().max())}  # fmt: skip
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemm: needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"GPU {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}")
    print(f"iters {args.iters} per CUDA graph, median of {args.repeats}; us per call (TFLOP/s)")
    g = torch.Generator(device=dev).manual_seed(0)
    if args.sweep:
        from bench_fp8_sweep import sweep

        return sweep(args, g)
    rows = []
    for m in args.m:
        for name in args.shapes:
            row = measure_shape(m, name, g, args)
            rows.append(row)
            cells = []
            labels = [k for k in row if isinstance(row[k], dict)]
            for label in labels:
                r = row[label]
                cells.append(
                    f"{label} {r['us']:7.1f} ({r['tflops']:5.0f}, rel {r['rel']:.1e})"
                    if "us" in r
                    else f"{label} n/a ({r['error']})"
                )
            via = f" | dispatched to {row['dispatch']}" if "dispatch" in row else ""
            print(f"M {m:5d} {name:8s} " + " | ".join(cells)
                  + f" | torch quant {row['quant_us']:.1f} | group quant "
                  f"{row['group_quant_us']:.1f}{via}")  # fmt: skip
    if args.moe:
        for m in args.m:
            row = measure_moe(m, g, args)
            rows.append(row)
            print(f"M {m:5d} {row['shape']}: " + " | ".join(
                f"{k} {row[k]['us']:7.1f} ({row[k]['tflops']:5.0f}, rel {row[k]['rel']:.1e})"
                for k in ("bf16", "fp8_block_triton")))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": props.name, "torch": torch.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
