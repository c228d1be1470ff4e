"""FP8 products of a few rows on the CUDA cores, the activations quantised in the same launch.

At one to a few rows a decode step's FP8 projections are weight reads: the tensor-core GEMM of
:mod:`unimem_kernel.fp8_gemm` spends three launches on one of them at one row — the
activation's quantisation, the GEMM (a 16-row tile of which one row is used) and, where the
few output tiles leave SMs idle, the sum of its split-K partials. :func:`fp8_gemv` is one
launch: program ``(i, n)`` quantises row ``i``'s activation itself (its ``K`` elements, a few
KB read from L2 by every program) and multiplies it by its own ``BLOCK_N`` rows of the weight
on the CUDA cores, so at one row the weight is read once and no partial goes through memory.

Contract: the product of :func:`unimem_kernel.fp8_gemm.fp8_gemm` with fused quantisation
(``xs`` None) — ``x [M, K]`` quantised per row and group of 128 columns with
:func:`~unimem_kernel.fp8_gemm.fp8_quantize_groups`' arithmetic (the same e4m3 values and
scales), dense ``wq [N, K]`` / ``ws [N, KG]`` or grouped ``wq [E, N, K]`` / ``ws [E, N, KG]``
with ``offs [E]`` (int32 cumulative end rows; rows past ``offs[-1]`` are zeros) and optional
``rows [T]`` (product row ``i`` reads activation row ``rows[i]``), ``bias`` ``[N]`` or
``[E, N]``. :func:`fp8_gemv_reference` is that op's torch reference. Only the order of the
float32 sums differs: each group's inner sum is a reduction on the CUDA cores rather than a
tensor-core dot, and the groups of one loop step (``GROUPS``) are summed before they are
added. No row's result depends on another row's values, but the rounding differs from the
tensor-core kernels', so batch-invariant (deterministic) products must not take it.

Rows: every program reads its weight rows once per product row; the programs of one column
tile's rows run next to each other (the row is the grid's fastest dimension), so a weight
read for one row is in L2 for the next, and grouped rows, sorted by expert, read their
expert's weight the same way. Measured on an H100 against the tensor-core path's three
launches (weights from HBM, ``docs/results/fp8_gemv_h100.json``): one row of Qwen3-Next-80B's
dense projections 4-55 % faster (``in_proj_qkvz`` 12 288 x 2 048 14.4 -> 13.9 µs, ``out_proj``
2 048 x 4 096 10.1 -> 7.4, the shared expert's down 2 048 x 512 6.2 -> 2.8); one token's
routed experts (10 rows) even; from two rows of the wide projections and two tokens of
experts on, even or slower. In the 80B-shaped model's one-stream decode step both pay (the
quantisation launches go too): 2.77 -> 2.42 ms (``docs/results/big_fp8_profile_1_*_h100.json``).
:func:`takes_gemv` takes it for dense products of at most ``UNIMEM_FP8_GEMV_ROWS`` rows
(default 1) and grouped ones of at most ``UNIMEM_FP8_GEMV_PAIRS`` rows (default 16: one
token of top-10 routing).

Tiles (:class:`Fp8GemvConfig`): ``BLOCK_N`` weight rows per program, ``GROUPS`` groups of 128
columns per loop step (``GROUPS * 128 * BLOCK_N`` weight bytes a step), warps and stages;
:func:`fp8_gemv_config` sizes them by the product (``UNIMEM_FP8_GEMV_CONFIG`` forces one).
Nothing is read on the host: the call can be recorded in a CUDA graph after a first call
(Triton compiles on first use).

On the CPU interpreter, whose cast to e4m3 truncates, the rounding to e4m3 is done in float32
arithmetic with the GPU's result (round to nearest even), so the CPU tests compare the same
quantised values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from unimem_kernel import envs
from unimem_kernel._dispatch import kernel_op, next_pow2, use_triton
from unimem_kernel.fp8_gemm import FP8_DTYPE, GROUP, fp8_gemm_reference, num_groups
from unimem_kernel.rounding import INTERPRETED

__all__ = [
    "MAX_GROUPS",
    "TARGET_PROGRAMS",
    "Fp8GemvConfig",
    "fp8_gemv",
    "fp8_gemv_config",
    "fp8_gemv_reference",
    "fp8_gemv_triton",
    "takes_gemv",
]


@dataclass(frozen=True)
class Fp8GemvConfig:
    """A tile: weight rows per program, groups of 128 columns per loop step, warps, stages."""

    block_n: int
    groups: int
    num_warps: int
    num_stages: int

    def spec(self) -> str:
        """``"BN,G,warps,stages"`` (the form ``UNIMEM_FP8_GEMV_CONFIG`` reads)."""
        return f"{self.block_n},{self.groups},{self.num_warps},{self.num_stages}"

    @classmethod
    def parse(cls, spec: str) -> Fp8GemvConfig:
        """The config of :meth:`spec`'s form; ValueError naming ``spec`` otherwise."""
        try:
            cfg = cls(*(int(v) for v in spec.split(",")))
        except (TypeError, ValueError):
            raise ValueError(f"fp8_gemv config {spec!r} is not 'BN,G,warps,stages'") from None
        for v in (cfg.block_n, cfg.groups):
            if v < 1 or v & (v - 1):
                raise ValueError(f"fp8_gemv config {spec!r}: BN and G are powers of 2")
        if cfg.num_warps not in (1, 2, 4, 8) or cfg.num_stages < 1:
            raise ValueError(f"fp8_gemv config {spec!r}: warps 1/2/4/8, stages >= 1")
        return cfg


TARGET_PROGRAMS = 1536
"""Programs a product aims at (:func:`fp8_gemv_config`): about twelve per SM of an H100."""

MAX_GROUPS = 8
"""Most groups of 128 columns a loop step reads (1 024 columns)."""


def fp8_gemv_config(n: int, k: int, rows: int) -> Fp8GemvConfig:
    """The tile for ``rows`` product rows of an ``[n, k]`` weight: ``UNIMEM_FP8_GEMV_CONFIG``
    if set, else ``BLOCK_N`` the smallest power of two from 4 to 32 that keeps the programs
    (``rows * n / BLOCK_N``) at most :data:`TARGET_PROGRAMS`, ``GROUPS`` all of ``K`` up to
    :data:`MAX_GROUPS`, 4 warps, one stage. On an H100 (``docs/results/fp8_gemv_h100.json``,
    16 tiles swept) this rule's tile is the sweep's best, within 1 %, for five of
    Qwen3-Next-80B's seven one-row products, and 7-16 % slower for ``in_proj_qkvz`` and the
    experts' down (2 warps there; the two runs disagreed on it)."""
    forced = envs.get("UNIMEM_FP8_GEMV_CONFIG")
    if forced:
        return Fp8GemvConfig.parse(forced)
    block_n = min(32, max(4, next_pow2(-(-rows * n // TARGET_PROGRAMS))))
    return Fp8GemvConfig(block_n, min(MAX_GROUPS, next_pow2(num_groups(k))), 4, 1)


def takes_gemv(x: torch.Tensor, rows: int, grouped: bool, invariant: bool) -> bool:
    """Whether an FP8 product of ``rows`` product rows (dense, or ``grouped`` over experts)
    with activations like ``x`` runs :func:`fp8_gemv`: the Triton side in use for ``x``
    (``UNIMEM_KERNEL_BACKEND``), not batch-invariant, and at most ``UNIMEM_FP8_GEMV_ROWS``
    dense rows or ``UNIMEM_FP8_GEMV_PAIRS`` grouped ones."""
    if invariant or rows == 0 or not use_triton(x):
        return False
    return rows <= envs.get("UNIMEM_FP8_GEMV_PAIRS" if grouped else "UNIMEM_FP8_GEMV_ROWS")


@triton.jit
def _e4m3_values(q):
    """fp32 ``q`` (``|q| <= 448``) rounded to e4m3, to nearest even, as fp32 values. The GPU
    converts; the interpreter, whose conversion truncates, rounds the bits: 3 mantissa bits
    from 2**-6 up, steps of 2**-9 below (the subnormals), by adding and subtracting 1.5 *
    2**23 (float32 addition rounds to nearest even)."""
    if INTERPRETED:
        bits = q.to(tl.uint32, bitcast=True)
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
        tiny = ((q * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        return tl.where(((bits >> 23) & 0xFF) >= 121, normal, tiny)
    return q.to(tl.float8e4nv).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def _fp8_gemv_kernel(
    x_ptr, rows_ptr, w_ptr, ws_ptr, offs_ptr, bias_ptr, out_ptr,
    T, N, K, KG, E,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    GROUPED: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_K: tl.constexpr,
):  # fmt: skip
    # Program (i, n): output row i, columns n * BLOCK_N ... (the rows of one column tile are
    # neighbours: the weight read for one is in L2 for the next). GROUPED: row i belongs to
    # the first expert e with offs[e] > i (none: a tail row, left zero, no bias).
    i = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = rn < N
    k_end = K
    we = 0
    if GROUPED:
        seg = tl.arange(0, BLOCK_E)
        ends = tl.load(offs_ptr + seg, mask=seg < E, other=0).to(tl.int64)
        e = tl.sum(((ends <= i) & (seg < E)).to(tl.int32), axis=0)
        k_end = tl.where(e < E, K, 0)
        we = tl.minimum(e, E - 1).to(tl.int64)
    if GATHER:  # noqa: SIM108 (product row i reads activation row rows[i])
        src = tl.load(rows_ptr + i).to(tl.int64)
    else:
        src = i
    gs = tl.arange(0, GROUPS)
    ks = tl.arange(0, GROUP_K)
    x_row = x_ptr + src * stride_xm
    w_rows = w_ptr + we * stride_we + rn[:, None, None] * stride_wn
    s_rows = ws_ptr + we * stride_wse + rn[:, None] * stride_wsn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_end, GROUPS * GROUP_K):
        kk = k0 + gs[:, None] * GROUP_K + ks[None, :]  # [GROUPS, GROUP_K]
        mk = kk < K
        # the groups' quantisation, with fp8_gemm._quant_groups_kernel's arithmetic
        xv = tl.load(x_row + kk, mask=mk, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-10)
        sa = tl.math.div_rn(amax, 448.0)
        inv = tl.math.div_rn(448.0, amax)
        q = _e4m3_values(tl.minimum(tl.maximum(xv * inv[:, None], -448.0), 448.0))
        w = tl.load(w_rows + kk[None, :, :], mask=mask_n[:, None, None] & mk[None, :, :], other=0.0)
        part = tl.sum(w.to(tl.float32) * q[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
        g = k0 // GROUP_K + gs
        sw = tl.load(s_rows + g[None, :], mask=mask_n[:, None] & (g < KG)[None, :], other=0.0)
        acc += tl.sum(part * sa[None, :] * sw, axis=1)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + we * N + rn, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(k_end > 0, bias, 0.0)
    tl.store(out_ptr + i * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def fp8_gemv_reference(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    offs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: Fp8GemvConfig | None = None,
) -> torch.Tensor:
    """The product of the module docstring in ``x``'s dtype:
    :func:`~unimem_kernel.fp8_gemm.fp8_gemm_reference` with ``xs`` None (``config`` is the
    Triton side's tile and changes nothing here)."""
    return fp8_gemm_reference(
        x, None, wq, ws, out_dtype=x.dtype, bias=bias, offs=offs, rows=rows
    )  # fmt: skip


def fp8_gemv_triton(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    offs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: Fp8GemvConfig | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`fp8_gemv` (arguments checked): one launch of ``T x N /
    BLOCK_N`` programs; ``config`` overrides the tile (tests, the benchmark)."""
    grouped = offs is not None
    t = rows.shape[0] if rows is not None else x.shape[0]
    k = x.shape[1]
    n = wq.shape[-2]
    e = wq.shape[0] if grouped else 1
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or fp8_gemv_config(n, k, t)
    _fp8_gemv_kernel[(t, triton.cdiv(n, cfg.block_n))](
        x, rows if rows is not None else x, wq, ws, offs if grouped else x,
        bias if bias is not None else out, out,
        t, n, k, num_groups(k), e,
        x.stride(0), wq.stride(0) if grouped else 0, wq.stride(-2),
        ws.stride(0) if grouped else 0, ws.stride(-2), out.stride(0),
        GROUPED=grouped, GATHER=rows is not None, HAS_BIAS=bias is not None,
        BLOCK_E=next_pow2(e), BLOCK_N=cfg.block_n, GROUPS=cfg.groups, GROUP_K=GROUP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _check_gemv(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    offs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: Fp8GemvConfig | None = None,
) -> None:
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(
            f"fp8_gemv: x must be [M, K] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}"
        )
    grouped = offs is not None
    k = x.shape[1]
    lead = 3 if grouped else 2
    if wq.dim() != lead or wq.shape[-1] != k or wq.dtype != FP8_DTYPE:
        raise ValueError(
            f"fp8_gemv: weight must be {'[E, N, K]' if grouped else '[N, K]'} e4m3 with K = "
            f"{k}, got {tuple(wq.shape)} {wq.dtype}"
        )
    if wq.stride(-1) != 1:
        raise ValueError("fp8_gemv: the weight's rows must be contiguous")
    if ws.shape != (*wq.shape[:-1], num_groups(k)) or ws.dtype != torch.float32:
        raise ValueError(
            f"fp8_gemv: weight scales must be {(*wq.shape[:-1], num_groups(k))} float32, got "
            f"{tuple(ws.shape)} {ws.dtype}"
        )
    if grouped and (offs.shape != (wq.shape[0],) or offs.dtype != torch.int32):
        raise ValueError(
            f"fp8_gemv: offs must be [{wq.shape[0]}] int32, got {tuple(offs.shape)} {offs.dtype}"
        )
    if rows is not None and (rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"fp8_gemv: rows must be [T] int32/int64, got {tuple(rows.shape)}")
    want = (wq.shape[0], wq.shape[1]) if grouped else (wq.shape[0],)
    if bias is not None and bias.shape != want:
        raise ValueError(f"fp8_gemv: bias must be {list(want)}, got {tuple(bias.shape)}")


fp8_gemv = kernel_op(
    "fp8_gemv",
    triton=fp8_gemv_triton,
    reference=fp8_gemv_reference,
    device_of="x",
    check=_check_gemv,
)
