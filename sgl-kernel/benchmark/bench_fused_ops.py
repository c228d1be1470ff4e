"""Fused elementwise model ops (``unimem_kernel.fused``) against the torch compositions they
replace, at the ``small`` preset's verify sizes, bf16, on one GPU.

Sizes: ``T`` rows (default 384: a verify step of 48 requests x 8 tokens), ``d_model`` 2048
(``add_rms_norm``), ffn 5632 (``silu_mul`` / ``gelu_tanh_mul`` on the fused ``[T, 2 * ffn]``
projection), GDN 16 heads x 128 (``gdn_gates``, ``gated_rms_norm`` in both flavours), attention
16 q / 4 kv heads x 128 (``rope_qk``, full rotary; and a partial rotary of 64 dims). The state
dtype of the gates is fp32 and the rotation dtype of RoPE fp32, as in the models.

Each row: ``ms`` per call of the fused op (Triton) and of its ``*_reference`` (the exact torch
code the models ran before): ``--iters`` calls recorded in one CUDA graph (as the engine's
steps run them; ``--eager`` times back-to-back Python calls instead, which for kernels of a few
µs measures the launch cost), CUDA events around a replay, the median of ``--repeats``
samples; the ratio fused / torch; the largest
elementwise difference of the outputs. ``--json PATH`` writes the rows. Needs CUDA (exits 2
with one line without it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import triton

from unimem_kernel import fused as fu
from unimem_kernel.timing import graph_median_ms, median_ms


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, nargs="+", default=[384], help="rows (tokens)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--gdn-heads", type=int, default=16)
    ap.add_argument("--gdn-dv", type=int, default=128)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=9, help="samples; the median is kept")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="time eager back-to-back calls (launch cost included) instead of graph replays",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


def time_ms(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Median over samples of the mean time per call (CUDA events), of ``iters`` calls
    recorded in a CUDA graph as the step runs them (``--eager``: called from Python)."""
    timer = median_ms if args.eager else graph_median_ms
    return timer(fn, warmup=args.warmup, iters=args.iters, repeats=args.repeats)


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def max_diff(a, b) -> float:
    return max(
        float((x.double() - y.double()).abs().max())
        for x, y in zip(_flat(a), _flat(b), strict=True)
    )


def cases(t: int, args: argparse.Namespace, dev: str = "cuda"):
    """``(name, shape string, fused call, torch call)`` for every op at ``t`` rows."""
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(t)

    def rn(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    d, f = args.d_model, args.ffn
    h, dv = args.gdn_heads, args.gdn_dv
    hq, hk, dh = args.q_heads, args.kv_heads, args.head_dim
    x, delta, w = rn(t, d), rn(t, d), rn(d)
    gu = rn(t, 2 * f, scale=2.0)
    proj = rn(t, 4 * h)  # [... | b | a] columns of the GDN input projection (strided views)
    b, a = proj[:, 2 * h : 3 * h], proj[:, 3 * h :]
    A_log, dt_bias = rn(h, dtype=torch.float32).abs(), rn(h, dtype=torch.float32) - 4
    o = rn(t, h, dv)
    zproj = rn(t, 2 * h * dv)
    z = zproj[:, h * dv :].reshape(t, h, dv)  # a reshaped column slice, as the mixers pass it
    wn = rn(dv)
    qkv = rn(t, (hq + 2 * hk) * dh)
    q = qkv[:, : hq * dh].reshape(t, hq, dh)
    k = qkv[:, hq * dh : (hq + hk) * dh].reshape(t, hk, dh)
    ang = torch.arange(t, device=dev, dtype=torch.float32)[:, None] * torch.rand(
        dh // 2, generator=g, device=dev
    )
    cos, sin = ang.cos(), ang.sin()
    pcos, psin = cos[:, : dh // 4].contiguous(), sin[:, : dh // 4].contiguous()
    eps = 1e-6
    return [
        (
            "add_rms_norm",
            f"[{t}, {d}]",
            lambda: fu.add_rms_norm(x, delta, w, eps),
            lambda: fu.add_rms_norm_reference(x, delta, w, eps),
        ),
        (
            "add_rms_norm (1 + w)",
            f"[{t}, {d}]",
            lambda: fu.add_rms_norm(x, delta, w, eps, zero_centered=True),
            lambda: fu.add_rms_norm_reference(x, delta, w, eps, zero_centered=True),
        ),
        ("silu_mul", f"[{t}, 2 x {f}]", lambda: fu.silu_mul(gu), lambda: fu.silu_mul_reference(gu)),
        (
            "gelu_tanh_mul",
            f"[{t}, 2 x {f}]",
            lambda: fu.gelu_tanh_mul(gu),
            lambda: fu.gelu_tanh_mul_reference(gu),
        ),
        (
            "gdn_gates",
            f"[{t}, {h}]",
            lambda: fu.gdn_gates(a, b, A_log, dt_bias),
            lambda: fu.gdn_gates_reference(a, b, A_log, dt_bias),
        ),
        (
            "gated_rms_norm (synthetic)",
            f"[{t}, {h}, {dv}]",
            lambda: fu.gated_rms_norm(o, wn, z, eps),
            lambda: fu.gated_rms_norm_reference(o, wn, z, eps),
        ),
        (
            "gated_rms_norm (hf)",
            f"[{t}, {h}, {dv}]",
            lambda: fu.gated_rms_norm(o, wn, z, eps, round_before_weight=True),
            lambda: fu.gated_rms_norm_reference(o, wn, z, eps, round_before_weight=True),
        ),
        (
            "rope_qk",
            f"q [{t}, {hq}, {dh}], k [{t}, {hk}, {dh}]",
            lambda: fu.rope_qk(q, k, cos, sin),
            lambda: fu.rope_qk_reference(q, k, cos, sin),
        ),
        (
            "rope_qk (partial, 1/4)",
            f"q [{t}, {hq}, {dh}], k [{t}, {hk}, {dh}]",
            lambda: fu.rope_qk(q, k, pcos, psin),
            lambda: fu.rope_qk_reference(q, k, pcos, psin),
        ),
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_ops: needs a CUDA device", file=sys.stderr)
        return 2
    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
    )
    rows = []
    print(
        f"{'op':28s} {'shape':34s} {'fused ms':>9s} {'torch ms':>9s} {'ratio':>6s} {'max diff':>9s}"
    )
    with torch.no_grad():
        for t in args.t:
            for name, shape, fused, ref in cases(t, args):
                ms_f, ms_t = time_ms(fused, args), time_ms(ref, args)
                diff = max_diff(fused(), ref())
                row = {
                    "op": name,
                    "t": t,
                    "shape": shape,
                    "fused_ms": ms_f,
                    "torch_ms": ms_t,
                    "ratio": ms_f / ms_t,
                    "max_diff": diff,
                }
                rows.append(row)
                print(
                    f"{name:28s} {shape:34s} {ms_f:9.4f} {ms_t:9.4f} {ms_f / ms_t:6.2f} {diff:9.2e}"
                )
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "args": vars(args),
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
