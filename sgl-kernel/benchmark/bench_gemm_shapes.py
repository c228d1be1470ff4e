"""The verify step's GEMM shapes on one GPU: cuBLAS as torch calls it, against the other ways
of running the same product (the data for choosing a GEMM path for the narrow-output shapes).

Shapes (default the ``small`` preset at 48 requests x 8 tokens, ``M`` = 384, bf16 weights
``[N, K]`` as ``nn.Linear`` stores them): attention q/k/v, o-projection, GDN in-projection,
GDN out-projection (= o), MLP gate+up, MLP down, LM head (float32 out). ``--shapes q3n_..``:
the Qwen3-Next ``bench`` checkpoint's dense projections (``SHAPES``).

Variants per shape:
- ``cublas``: ``F.linear`` (the LM head: ``torch.mm(..., out_dtype=float32)``), torch's default
  BLAS path;
- ``cublaslt``: the same after ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``lt bias``: ``F.linear(x, w, zeros(N))`` (bf16 shapes): torch runs a bf16 ``addmm`` with a
  1-D bias through cuBLASLt's bias epilogue (``gemm_and_bias``) whatever the preferred
  library, so this is cuBLASLt for one call site; adding +0.0 changes no value;
- ``tunable``: ``torch.cuda.tunable`` (TunableOp) tuned for the shape in this process, then
  the same call (it dispatches to the algorithm it measured fastest);
- ``triton BMxBNxBK sS wW stT``: a Triton TMA GEMM with split-K ``S`` (``S`` > 1: float32
  partials ``[S, M, N]`` written by the GEMM, summed in split order by a second pass; the
  ``+sum`` time includes that pass). Only for the shapes named by ``--split-shapes``.

Each time: ``--iters`` calls recorded in one CUDA graph, CUDA events around a replay, the
median of ``--repeats`` samples (``unimem_kernel.timing.graph_median_ms``); TFLOP/s =
2 M N K / time;
``rel`` = the largest |difference| to a float32 torch product, relative to its largest
|value|. ``--json PATH`` writes the rows. Needs CUDA (exits 2 with one line without it).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unimem_kernel.timing import graph_median_ms

SHAPES = {  # name: (K, N, out dtype)
    "qkv": (2048, 3072, "bf16"),
    "o_proj": (2048, 2048, "bf16"),
    "gdn_in": (2048, 8224, "bf16"),
    "gate_up": (2048, 11264, "bf16"),
    "down": (5632, 2048, "bf16"),
    "lm_head": (2048, 32000, "fp32"),
    # the Qwen3-Next `bench` checkpoint (tools/make_checkpoint.py): GDN in_proj_qkvz +
    # in_proj_ba stacked; GDN out_proj and attention o_proj (both 4096 -> 2048); the gated
    # q_proj; k_proj / v_proj; router + shared expert gate / up stacked; shared expert down
    "q3n_gdn_in": (2048, 12352, "bf16"),
    "q3n_out": (4096, 2048, "bf16"),
    "q3n_q": (2048, 8192, "bf16"),
    "q3n_kv": (2048, 512, "bf16"),
    "q3n_moe_in": (2048, 1088, "bf16"),
    "q3n_se_down": (512, 2048, "bf16"),
}
SMALL_SHAPES = ["qkv", "o_proj", "gdn_in", "gate_up", "down", "lm_head"]

# (BM, BN, BK, split, warps, stages)
TRITON_CONFIGS = [
    (128, 128, 64, 1, 8, 4),
    (128, 128, 64, 2, 8, 4),
    (128, 128, 64, 3, 8, 4),
    (128, 64, 64, 1, 4, 4),
    (128, 64, 64, 2, 4, 4),
    (64, 128, 64, 2, 4, 4),
    (128, 256, 64, 4, 8, 3),
    (128, 256, 64, 5, 8, 3),
    (64, 64, 128, 1, 4, 4),
    (64, 64, 64, 2, 4, 5),
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=384, help="rows (tokens of one verify step)")
    ap.add_argument("--shapes", nargs="+", default=SMALL_SHAPES, choices=list(SHAPES))
    ap.add_argument("--split-shapes", nargs="*", default=["down", "o_proj"], choices=list(SHAPES))
    ap.add_argument("--no-tunable", action="store_true", help="skip the TunableOp variant")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=40, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples; the median is kept")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap.parse_args(argv)


@triton.jit
def _split_k_kernel(
    a_desc, b_desc, c_ptr, M, N, K, stride_cs, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """C[s] = A[:, Ks] @ B[:, Ks]^T for the s-th of SPLIT contiguous runs of K chunks; A
    ``[M, K]``, B ``[N, K]`` (TMA descriptors, zero-filled out of bounds); C float32
    ``[SPLIT, M, N]`` (SPLIT > 1) or ``C.dtype`` ``[M, N]``. Row tiles run fastest, so the
    programs that share a B tile run together (B, the weight, is the larger operand)."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    chunks = tl.cdiv(K, BK)
    per = tl.cdiv(chunks, SPLIT)
    k_lo = pid_s * per * BK
    k_hi = tl.minimum(k_lo + per * BK, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        a = a_desc.load([pid_m * BM, k])
        b = b_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    ptrs = c_ptr + pid_s * stride_cs + rm[:, None] * stride_cm + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def triton_linear(x, w, cfg, c):
    """``x @ w.T`` by :func:`_split_k_kernel` into the preallocated ``c`` (``[S, M, N]``
    float32 partials, or ``[M, N]``); the split sum (``S`` > 1) is the caller's."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, split, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    stride_cs = c.stride(0) if split > 1 else 0
    stride_cm = c.stride(-2)
    _split_k_kernel[grid](
        a_desc, b_desc, c, m, n, k, stride_cs, stride_cm,
        BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def bench_shape(name: str, args: argparse.Namespace, record, timing: dict) -> None:
    """Time every variant of one shape (module docstring) and ``record`` each."""
    k, n, odt = SHAPES[name]
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    ref = x.float() @ w.float().t()
    if odt == "fp32":

        def call():
            return torch.mm(x, w.t(), out_dtype=torch.float32)
    else:

        def call():
            return F.linear(x, w)

    torch.backends.cuda.preferred_blas_library("cublas")
    record(name, "cublas", graph_median_ms(call, **timing), rel_err(call(), ref), k, n)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    record(name, "cublaslt", graph_median_ms(call, **timing), rel_err(call(), ref), k, n)
    torch.backends.cuda.preferred_blas_library("cublas")
    if odt != "fp32":
        zero = torch.zeros(n, device="cuda", dtype=x.dtype)

        def lt_bias():
            return F.linear(x, w, zero)

        record(name, "lt bias", graph_median_ms(lt_bias, **timing), rel_err(lt_bias(), ref), k, n)
    if not args.no_tunable:
        tun = torch.cuda.tunable
        tun.enable(True)
        tun.tuning_enable(True)
        tun.set_max_tuning_iterations(50)
        tun.set_max_tuning_duration(200)
        if hasattr(tun, "write_file_on_exit"):
            tun.write_file_on_exit(False)
        y = call()  # tunes this shape
        torch.cuda.synchronize()
        tun.tuning_enable(False)
        try:
            record(name, "tunable", graph_median_ms(call, **timing), rel_err(y, ref), k, n)
        finally:
            tun.enable(False)
    if name not in args.split_shapes:
        return
    for cfg in TRITON_CONFIGS:
        bm, bn, bk, split, warps, stages = cfg
        label = f"triton {bm}x{bn}x{bk} s{split} w{warps} st{stages}"
        shape_c = (split, args.m, n) if split > 1 else (args.m, n)
        c = torch.empty(shape_c, device="cuda", dtype=torch.float32 if split > 1 else x.dtype)

        def gemm(c=c, cfg=cfg):
            return triton_linear(x, w, cfg, c)

        def with_sum(c=c, cfg=cfg):
            return triton_linear(x, w, cfg, c).sum(0).to(x.dtype)

        try:
            y = gemm()
            err = rel_err(y.sum(0) if split > 1 else y, ref)
            record(name, label, graph_median_ms(gemm, **timing), err, k, n)
            if split > 1:
                record(name, label + " +sum", graph_median_ms(with_sum, **timing), err, k, n)
        except Exception as exc:  # a config that does not compile on this GPU: say so, go on
            print(f"{name:8s} {label:34s} failed: {type(exc).__name__}: {str(exc)[:200]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_shapes: needs CUDA", file=sys.stderr)
        return 2
    triton.set_allocator(_alloc)
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, M = {args.m}")
    torch.manual_seed(0)
    rows = []
    timing = dict(warmup=args.warmup, iters=args.iters, repeats=args.repeats)

    def record(shape, variant, ms, err, k, n):
        tf = 2 * args.m * n * k / (ms * 1e-3) / 1e12
        rows.append(dict(shape=shape, variant=variant, ms=ms, tflops=tf, rel=err, k=k, n=n))
        print(f"{shape:8s} {variant:34s} {ms * 1e3:8.1f} us {tf:6.0f} TF/s  rel {err:.1e}")

    for name in args.shapes:
        bench_shape(name, args, record, timing)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, m=args.m, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
