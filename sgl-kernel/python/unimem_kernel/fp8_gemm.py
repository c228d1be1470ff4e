"""FP8 (e4m3) GEMMs with per-token-group activation scales and per-row-group weight scales.

Scaling convention (the hub's block-wise FP8, DeepSeek-V3 / Qwen3-Next ``-FP8`` checkpoints):
the reduction dim ``K`` is cut into groups of :data:`GROUP` (128) columns, ``KG =
ceil(K / 128)`` of them (the last may be partial). An activation row ``x [K]`` is quantised
per group (:func:`fp8_quantize_groups`): with ``a = max(amax(|x_g|), SCALE_FLOOR)``, the
scale ``s = a / 448`` and ``q_g = clamp(x_g * (448 / a), -448, 448)`` rounded to e4m3 (round
to nearest even): two IEEE divisions per group, one multiplication per element, the same
float32 ops (so the same bits) in the kernels and in torch on any device. A weight is
``wq [N, K]`` e4m3 with ``ws [N, KG]`` float32: row ``n``'s group ``g`` holds ``wq[n, g] *
ws[n, g]`` (a checkpoint's ``[128, 128]`` block scales expanded to rows, so any row
permutation or row range of a weight keeps its scales). The product::

    y[m, n] = sum_g  xs[m, g] * ws[n, g] * (sum_{k in g} xq[m, k] * wq[n, k])

with the inner sum an FP8 tensor-core dot accumulated in float32 and the outer sum over
``g`` in ascending order, in float32 (with split-K ``S``: over ``S`` consecutive runs of
groups, each in ascending order, the run sums then added in ascending order); ``y`` is cast
to the output dtype once.

Ops (Triton kernel on CUDA, torch reference of the same semantics elsewhere, as every op of
this package; ``UNIMEM_KERNEL_BACKEND`` forces either):

- :func:`fp8_quantize_groups`: ``x [M, K]`` -> ``(xq [M, K] e4m3, xs [M, KG] float32)``
  (``xs`` row-major, or M-major for cuBLASLt);
- :func:`fp8_linear`: ``x [..., K]`` (bf16/fp16/fp32) times ``wq^T``: quantise, then one
  GEMM launch: the Triton kernel (:func:`fp8_gemm`), or with many rows on an H100-class
  GPU (SM90) cuBLASLt's block-scaled GEMM (:func:`fp8_gemm_lt` through
  ``torch._scaled_mm``; :func:`use_lt` decides, the weight's ``[ceil(N/128), KG]`` block table
  given);
- :func:`fp8_grouped_linear`: rows grouped by expert (``offs``, the cumulative end rows,
  ``torch._grouped_mm``'s convention) times their expert's ``wq [E, N, K]``, optionally
  gathering ``x[rows]`` in the loads: the MoE layers' routed experts.

``UNIMEM_FP8_ACT_QUANT=fused`` quantises the activations inside the GEMM's loads instead of
in a launch of their own (the same values; one launch per product instead of two; GPU only).

Tile choice (:func:`fp8_gemm_config`): by the row count (and, where the tuned table
``fp8_gemm_configs.json`` beside this module names the GPU and the ``N x K`` shape, by
that), with split-K for dense products whose few rows leave the GPU's SMs idle; or one fixed
tile without split-K (``invariant=True``, deterministic inference): each output element's
arithmetic is then the same whatever the number of rows, so a row's result does not depend
on the other rows (activation scales are per row already). ``UNIMEM_FP8_GEMM_CONFIG=
"BMxBN,warps,stages,splitk"`` forces one tile (sweeps). Outputs are allocated with
``torch.empty`` (split-K partials too) and no device value is read on the host: every call
is capturable in a CUDA graph. Split-K is deterministic: the partials are summed in a fixed
order, by a second launch or by the last of a tile's programs to finish (an arrival counter
per tile, :func:`tile_counters`); the same bits either way. ``UNIMEM_FP8_SPLIT_SUM``: ``auto``
(the default) sums in the kernel from :data:`SPLIT_SUM_MIN_RUNS` runs on, ``kernel`` always,
``separate`` never.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from unimem_kernel import envs
from unimem_kernel._dispatch import (
    grouped_row_tiles,
    interpreter_stand_in,
    kernel_op,
    next_pow2,
    use_triton,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "GROUP",
    "SCALE_FLOOR",
    "SPLIT_SUM_MIN_RUNS",
    "LT_MIN_N",
    "LT_MIN_ROWS",
    "LT_N_ALIGN",
    "LT_WIDE_MIN_ROWS",
    "LT_WIDE_N",
    "Fp8GemmConfig",
    "collapse_block_scales",
    "dequantize",
    "device_capability",
    "expand_block_scales",
    "fp8_gemm",
    "fp8_gemm_config",
    "fp8_gemm_lt",
    "fp8_gemm_reference",
    "fp8_gemm_triton",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_quantize_groups",
    "fp8_quantize_groups_reference",
    "fp8_quantize_groups_triton",
    "nearest_swept_config",
    "quantize_blocks",
    "quantize_blockwise",
    "tile_counters",
    "use_lt",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
SCALE_FLOOR = 1e-10
"""Smallest group amax used for a scale (an all-zero group quantises to zeros, scale tiny)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def num_groups(k: int) -> int:
    """``KG``: groups of :data:`GROUP` columns covering ``k``."""
    return (k + GROUP - 1) // GROUP


# ------------------------------------------------------------------- activation quantisation


@triton.jit
def _quant_groups_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # program (r, g): rows [r * BLOCK_R, ...) and column group g; scale (m, g) at
    # s_ptr + m * stride_sm + g * stride_sg (row-major (KG, 1) or M-major (1, M))
    rm = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    g = tl.program_id(1)
    kk = g * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm < M)[:, None] & (kk < K)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    s = tl.math.div_rn(amax, 448.0)  # IEEE divisions, as torch's tensor / tensor
    inv = tl.math.div_rn(448.0, amax)
    q = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    # (the interpreter's e4m3 cast truncates where the GPU's rounds to nearest even: under
    # the interpreter q_ptr is float32 and the caller casts with torch, which rounds as the GPU)
    tl.store(q_ptr + rm[:, None] * stride_qm + kk[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rm * stride_sm + g * stride_sg, s, mask=rm < M)


QUANT_ROWS = 8
"""Rows per program of the quantisation kernel."""


def fp8_quantize_groups_reference(
    x: torch.Tensor, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float, unit stride along ``K``) -> ``(xq [M, K] e4m3 contiguous, xs
    [M, KG] float32)``, per token and group of 128 columns (module docstring). ``xs`` is
    row-major (strides ``(KG, 1)``), or with ``m_major`` M-major (strides ``(1, M)``: the
    layout cuBLASLt's 1 x 128 block scaling reads, :func:`fp8_gemm_lt`) with the same
    values. Both are new tensors owned by the caller."""
    m, k = x.shape
    kg = num_groups(k)
    xf = x.float()
    pad = torch.zeros(m, kg * GROUP, dtype=torch.float32, device=x.device)
    pad[:, :k] = xf
    amax = pad.view(m, kg, GROUP).abs().amax(dim=-1).clamp_min(SCALE_FLOOR)
    # tensor / tensor: an IEEE division on every device (CUDA turns "/ python float" into a
    # multiplication by a rounded reciprocal; the kernel divides)
    top = torch.full_like(amax, FP8_MAX)
    s = amax / top
    inv = top / amax
    q = (pad.view(m, kg, GROUP) * inv[..., None]).clamp(-FP8_MAX, FP8_MAX)
    if m_major:
        s = s.t().contiguous().t()
    return q.view(m, kg * GROUP)[:, :k].to(FP8_DTYPE).contiguous(), s


def fp8_quantize_groups_triton(
    x: torch.Tensor, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`fp8_quantize_groups` (``x`` checked): one launch, which
    writes the scales in their layout directly (``m_major``: into a ``[KG, M]`` buffer seen
    transposed; no copy launch)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    kg = num_groups(k)
    interp = _interpreting()
    q = torch.empty(m, k, dtype=torch.float32 if interp else FP8_DTYPE, device=x.device)
    if m_major:
        s = torch.empty(kg, m, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(m, kg, dtype=torch.float32, device=x.device)
    if m and k:
        _quant_groups_kernel[(triton.cdiv(m, QUANT_ROWS), kg)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            BLOCK_R=QUANT_ROWS, BLOCK_K=GROUP, num_warps=4,
        )  # fmt: skip
    if interp:  # the compiled kernel stores e4m3 itself
        with interpreter_stand_in():
            q = q.to(FP8_DTYPE)
    return q, s


def _check_quantize(x: torch.Tensor, m_major: bool = False) -> None:
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize_groups: x must be [M, K], got {tuple(x.shape)}")


fp8_quantize_groups = kernel_op(
    "fp8_quantize_groups",
    triton=fp8_quantize_groups_triton,
    reference=fp8_quantize_groups_reference,
    device_of="x",
    check=_check_quantize,
)


# ------------------------------------------------------------------- GEMM kernel


@dataclass(frozen=True)
class Fp8GemmConfig:
    """A tile of the FP8 GEMM kernel (``BLOCK_K`` is always :data:`GROUP`); ``split_k``
    programs share each output tile's groups (dense products only; 1 for grouped ones; 0:
    as many as bring the programs to two per SM, at most 8 and two groups per run)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def spec(self) -> str:
        """``"BMxBN,warps,stages,splitk"`` (the form ``UNIMEM_FP8_GEMM_CONFIG`` reads)."""
        return (f"{self.block_m}x{self.block_n},{self.num_warps},{self.num_stages},"
                f"{self.split_k}")  # fmt: skip

    @classmethod
    def parse(cls, spec: str) -> Fp8GemmConfig:
        """The config of :meth:`spec`'s form; ValueError naming ``spec`` otherwise."""
        try:
            tile, warps, stages, split = spec.split(",")
            bm, bn = tile.split("x")
            cfg = cls(int(bm), int(bn), int(warps), int(stages), int(split))
        except ValueError:
            msg = f"fp8 GEMM config {spec!r} is not 'BMxBN,warps,stages,splitk'"
            raise ValueError(msg) from None
        for v in (cfg.block_m, cfg.block_n):
            if v < 16 or v & (v - 1):
                raise ValueError(f"fp8 GEMM config {spec!r}: tile sides are powers of 2 >= 16")
        if cfg.split_k < 0:
            raise ValueError(f"fp8 GEMM config {spec!r}: split-K is >= 0 (0: automatic)")
        return cfg


INVARIANT_CONFIG = Fp8GemmConfig(64, 64, 4, 4)
"""The one tile of ``invariant=True``: independent of the row count, no split-K."""

# Decode / verify steps have 1-512 rows. The weight is the traffic there, so one row tile
# should cover the rows (every extra row tile re-reads the weight), with wgmma's 64-row
# minimum from 33 rows on; narrow outputs then leave SMs idle, which split-K fills (dense
# only). Prefill takes 128 x 128. Tuned per GPU and shape by fp8_gemm_configs.json.
_BY_ROWS = (
    (16, Fp8GemmConfig(16, 64, 4, 4, 0)),
    (32, Fp8GemmConfig(32, 64, 4, 4, 0)),
    (64, Fp8GemmConfig(64, 64, 4, 4, 0)),
    (512, Fp8GemmConfig(64, 128, 4, 3)),
    (1 << 62, Fp8GemmConfig(128, 128, 8, 3)),
)

TUNED_CONFIGS = Path(__file__).with_name("fp8_gemm_configs.json")
"""``{gpu name: {"N,K": [[rows, "BMxBN,warps,stages,splitk"], ...]}}`` (ascending ``rows``,
the row counts swept at; written by the FP8 GEMM micro-benchmark's sweep; other row counts up
to the largest take the nearest swept one's tile, :func:`nearest_swept_config`)."""


@functools.cache
def _tuned(device_name: str) -> dict[str, list[tuple[int, Fp8GemmConfig]]]:
    if not TUNED_CONFIGS.exists():
        return {}
    table = json.loads(TUNED_CONFIGS.read_text()).get(device_name, {})
    return {shape: [(int(r), Fp8GemmConfig.parse(c)) for r, c in rows]
            for shape, rows in table.items()}  # fmt: skip


def nearest_swept_config(swept: list[tuple[int, Fp8GemmConfig]], rows: int) -> Fp8GemmConfig | None:
    """The tile swept at the row count nearest ``rows`` on a log scale (``swept``: ``(rows
    swept at, tile)``, ascending, not empty); None above the largest swept count (prefill:
    the defaults by rows take it). Between two swept counts ``a < b`` the switch is at
    ``sqrt(a * b)``: a tile chosen for ``b`` rows spreads its columns over fewer, wider
    programs (e.g. 64 x 256 at 384 rows), which at a third of those rows leaves most SMs
    idle (H100, qkv 3 072 x 2 048: 16.3 us at 64 rows with the 384-row tile, 7.7 at 48 with
    the 48-row one; ``docs/results/fp8_gemm_rows_h100.json``)."""
    rows = max(rows, 1)
    if rows > swept[-1][0]:
        return None
    for (lo, lo_cfg), (hi, _) in zip(swept, swept[1:], strict=False):
        if rows * rows <= lo * hi:
            return lo_cfg
    return swept[-1][1]


def fp8_gemm_config(
    rows_per_group: int,
    invariant: bool = False,
    shape: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> Fp8GemmConfig:
    """The tile for ``rows_per_group`` rows per weight (the mean rows per expert for grouped
    calls) of an ``N x K`` weight (``shape``) on ``device``: ``UNIMEM_FP8_GEMM_CONFIG`` if
    set, else the tuned table's entry for this GPU and shape, else the default by rows;
    :data:`INVARIANT_CONFIG` when ``invariant``."""
    if invariant:
        return INVARIANT_CONFIG
    forced = envs.get("UNIMEM_FP8_GEMM_CONFIG")
    if forced:
        return Fp8GemmConfig.parse(forced)
    if shape is not None and device is not None and device.type == "cuda":
        swept = _tuned(torch.cuda.get_device_name(device)).get(f"{shape[0]},{shape[1]}")
        cfg = nearest_swept_config(swept, rows_per_group) if swept else None
        if cfg is not None:
            return cfg
    for max_rows, cfg in _BY_ROWS:
        if rows_per_group <= max_rows:
            return cfg
    return _BY_ROWS[-1][1]


@triton.jit(do_not_specialize=["T"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, rows_ptr, w_ptr, ws_ptr, offs_ptr, bias_ptr, out_ptr, cnt_ptr, sum_ptr,
    T, N, K, KG, E,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
    GROUPED: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
    FUSED_QUANT: tl.constexpr, BLOCK_E: tl.constexpr, SPLIT_K: tl.constexpr,
    SPLIT_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (p, n, s): row tile p, column tile n, run s of the groups (SPLIT_K > 1: dense
    # only; the run's float32 partial goes to out_ptr + s * stride_os, bias added to the sum;
    # SPLIT_SUM: the tile's last program to finish writes the sum to sum_ptr [T, N], its
    # arrivals counted in cnt_ptr[p * n_tiles + n], which it leaves at zero).
    # GROUPED: expert e < E owns rows [offs[e-1], offs[e]), the tail [offs[E-1], T) is
    # written as zeros; row tiles start at each segment's first row and are numbered over all
    # segments in order (found on the device from offs: no host reads). Otherwise one
    # segment [0, T), weight 0.
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        seg = tl.arange(0, BLOCK_E)
        ends = tl.load(offs_ptr + seg, mask=seg < E, other=0).to(tl.int32)
        ends = tl.where(seg < E, ends, T)
        starts = tl.load(offs_ptr + seg - 1, mask=(seg >= 1) & (seg <= E), other=0).to(tl.int32)
        counts = tl.maximum(ends - starts, 0)
        tiles = tl.where(seg <= E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
        cum = tl.cumsum(tiles, axis=0)
        e = tl.sum((cum <= p).to(tl.int32), axis=0)
        if e > E:
            return
        sel = seg == e
        row0 = tl.sum(tl.where(sel, starts, 0), axis=0)
        row_end = tl.sum(tl.where(sel, ends, 0), axis=0)
        tile = p - tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
        g_end = tl.where(e == E, 0, KG)  # the tail's rows stay zero
        we = tl.minimum(e, E - 1).to(tl.int64)
        rm = (row0 + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    else:
        row_end = T
        g_end = KG
        we = 0
        rm = (p * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = rm < row_end
    mask_n = rn < N
    if GATHER:  # noqa: SIM108 (product row i reads activation row rows[i])
        src = tl.load(rows_ptr + rm, mask=mask_m, other=0).to(tl.int64)
    else:
        src = rm
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + src[:, None] * stride_am
    w_cols = w_ptr + we * stride_we + rn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_lo = 0
    if SPLIT_K > 1:
        per_run = tl.cdiv(g_end, SPLIT_K)
        g_lo = tl.program_id(2) * per_run
        g_end = tl.minimum(g_lo + per_run, g_end)
    for g in range(g_lo, g_end):
        kk = (g * BLOCK_K + rk).to(tl.int64)
        mask_k = kk < K
        a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FUSED_QUANT:
            # a_ptr is the unquantised activation: quantise the group here, with the
            # arithmetic of _quant_groups_kernel (so the same e4m3 values and scales)
            xa = a.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xa), axis=1), 1e-10)
            sa = tl.math.div_rn(amax, 448.0)
            inv = tl.math.div_rn(448.0, amax)
            q = tl.minimum(tl.maximum(xa * inv[:, None], -448.0), 448.0)
            a = q.to(w_ptr.dtype.element_ty)
        else:
            sa = tl.load(as_ptr + src * stride_asm + g, mask=mask_m, other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        part = tl.dot(a, w, out_dtype=tl.float32)
        sw = tl.load(ws_ptr + we * stride_wse + rn * stride_wsn + g, mask=mask_n, other=0.0)
        acc += part * sa[:, None] * sw[None, :]
    if HAS_BIAS and SPLIT_K == 1:
        bias = tl.load(bias_ptr + we * N + rn, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(g_end > 0, bias, 0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    part = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(part + tl.program_id(2) * stride_os, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if SPLIT_SUM:
        # every thread's partial is stored before the arrival is counted (barrier, release);
        # the last arrival (acquire) reads the runs back through L2 (.cg: not a stale L1 line)
        # and adds them in run order, as _split_sum_kernel does
        tl.debug_barrier()
        tile = p * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(part + s * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            dst = sum_ptr + rm[:, None] * N + rn[None, :]
            tl.store(dst, total.to(sum_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next product


@triton.jit
def _split_sum_kernel(
    part_ptr, bias_ptr, out_ptr, numel, N, stride_s,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # out = (part[0] + part[1] + ... + part[SPLIT_K - 1]) + bias, in that order, cast once
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * stride_s + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_operands(xq, xs, wq, ws, grouped: bool) -> None:
    k = xq.shape[1]
    kg = num_groups(k)
    lead = 3 if grouped else 2
    if wq.dim() != lead or wq.shape[-1] != k or wq.dtype != FP8_DTYPE:
        raise ValueError(
            f"fp8 weight must be {'[E, N, K]' if grouped else '[N, K]'} e4m3 with K = {k}, "
            f"got {tuple(wq.shape)} {wq.dtype}"
        )
    if ws.shape != (*wq.shape[:-1], kg) or ws.dtype != torch.float32:
        raise ValueError(
            f"fp8 weight scales must be {(*wq.shape[:-1], kg)} float32, got "
            f"{tuple(ws.shape)} {ws.dtype}"
        )
    if xq.dtype != FP8_DTYPE or xs.shape != (xq.shape[0], kg) or xs.dtype != torch.float32:
        raise ValueError(
            f"fp8 activations must be [M, {k}] e4m3 with [M, {kg}] float32 scales, got "
            f"{tuple(xq.shape)} {xq.dtype} and {tuple(xs.shape)} {xs.dtype}"
        )


def fp8_gemm_triton(
    xq: torch.Tensor,
    xs: torch.Tensor | None,
    wq: torch.Tensor,
    ws: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    offs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Triton launcher of :func:`fp8_gemm` (arguments checked): one GEMM launch (``xs`` None:
    quantising in its loads), plus the ordered sum of split-K partials when the tile splits
    K."""
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    if xs is not None and xs.shape[1] > 1 and xs.stride(1) != 1:
        xs = xs.contiguous()  # the kernel reads the scales row-major
    return _launch(xq, xs, wq, ws, out_dtype, bias, offs, rows, invariant)


def _check_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor | None,
    wq: torch.Tensor,
    ws: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    offs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    invariant: bool = False,
) -> None:
    if xs is None:
        k = xq.shape[1]
        if wq.shape[-1] != k or ws.shape != (*wq.shape[:-1], num_groups(k)):
            raise ValueError(
                f"fp8 weight {tuple(wq.shape)} / scales {tuple(ws.shape)} do not fit K {k}"
            )
        return
    _check_operands(xq, xs, wq, ws, offs is not None)
    if rows is not None and offs is None:
        raise ValueError("fp8_gemm: rows needs offs (a grouped call)")


def _split_k(cfg: Fp8GemmConfig, t: int, n: int, kg: int, device: torch.device) -> int:
    """The runs of groups a dense product of ``t x n`` outputs over ``kg`` groups uses."""
    if cfg.split_k:
        return max(1, min(cfg.split_k, kg))
    tiles = triton.cdiv(t, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    sms = _sm_count(device)
    return max(1, min(8, kg // 2, triton.cdiv(2 * sms, tiles)))


SPLIT_SUM_MIN_RUNS = 8
"""``UNIMEM_FP8_SPLIT_SUM=auto`` sums split-K partials in the GEMM kernel from this many runs
on. Measured (H100, ``bench_fp8_split_sum.py``, ``docs/results/fp8_split_sum_h100.json``; µs
per GEMM at 1 and 8 rows of Qwen3-Next-80B's dense projections, second launch / in the
kernel): 8 runs 5.08 / 4.42 and 5.38 / 4.75 (N 1 024, K 2 048); 2 to 4 runs 0.2-0.4 µs
slower in the kernel (the last program's serial read of the partials, and every program's
barrier and atomic, outweigh a second launch inside a CUDA graph)."""

_COUNTERS_MIN = 4096


def _sums_in_kernel(split: int) -> bool:
    """Whether a product of ``split`` runs sums them in the kernel (``UNIMEM_FP8_SPLIT_SUM``)."""
    mode = envs.get("UNIMEM_FP8_SPLIT_SUM")
    return mode == "kernel" or (mode == "auto" and split >= SPLIT_SUM_MIN_RUNS)


_counters: dict[torch.device, torch.Tensor] = {}
_kept: list[torch.Tensor] = []  # replaced buffers: graphs captured with them still read them


def tile_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least ``n`` int32 arrival counters on ``device``, all zero, for the split-K sum in
    the GEMM kernel (``SPLIT_SUM``): one buffer per device, made on first use outside a CUDA
    graph capture, and left at zero by every product that uses it. None where there is none
    yet, or it is too short, during a capture (which cannot make one): the caller then sums
    in a second launch. Products on one device share the buffer, so they must not overlap
    in time (one stream, or streams ordered by events, as the engine's steps and their
    graphs are); a graph keeps the buffer it was captured with (a replaced one is never
    freed)."""
    buf = _counters.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(n, _COUNTERS_MIN, 2 * buf.numel() if buf is not None else 0)
    if buf is not None:
        _kept.append(buf)
    _counters[device] = buf = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: exercise the split path on tiny shapes
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(a, xs, wq, ws, out_dtype, bias, offs, rows, invariant) -> torch.Tensor:
    """One :func:`_fp8_gemm_kernel` launch (``xs`` None: fused quantisation), plus the
    ordered sum of the split-K partials when the tile splits K."""
    grouped = offs is not None
    t = rows.shape[0] if rows is not None else a.shape[0]
    k = a.shape[1]
    n = wq.shape[-2]
    e = wq.shape[0] if grouped else 1
    out = torch.empty(t, n, dtype=out_dtype, device=a.device)
    if t == 0 or n == 0:
        return out
    kg = num_groups(k)
    cfg = fp8_gemm_config(max(t // e, 1), invariant, (n, k), a.device)
    split = 1 if grouped else _split_k(cfg, t, n, kg, a.device)
    dest = out if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=a.device)
    row_tiles = grouped_row_tiles(t, e, cfg.block_m) if grouped else triton.cdiv(t, cfg.block_m)
    grid = (row_tiles, triton.cdiv(n, cfg.block_n), split)
    counters = None
    if split > 1 and _sums_in_kernel(split):
        counters = tile_counters(a.device, grid[0] * grid[1])
    fused = xs is None
    # the bias goes in this launch unless a second one sums the partials
    kernel_bias = bias is not None and (split == 1 or counters is not None)
    _fp8_gemm_kernel[grid](
        a, a if fused else xs, rows if rows is not None else a, wq, ws, offs if grouped else a,
        bias if kernel_bias else out, dest,
        counters if counters is not None else dest, out,
        t, n, k, kg, e,
        a.stride(0), 0 if fused else xs.stride(0), wq.stride(0) if grouped else 0,
        wq.stride(-2), ws.stride(0) if grouped else 0, ws.stride(-2), n,
        t * n if split > 1 else 0,
        GROUPED=grouped, GATHER=rows is not None, HAS_BIAS=kernel_bias,
        FUSED_QUANT=fused, BLOCK_E=next_pow2(e + 1), SPLIT_K=split,
        SPLIT_SUM=counters is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1 and counters is None:
        block = 1024
        _split_sum_kernel[(triton.cdiv(t * n, block),)](
            dest, bias if bias is not None else dest, out, t * n, n, t * n,
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def fused_quantization(x: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` / :func:`fp8_grouped_linear` quantise ``x`` inside the GEMM
    (``UNIMEM_FP8_ACT_QUANT=fused``) rather than in a launch of its own (``separate``, the
    default); Triton on a GPU only (the interpreter's e4m3 cast truncates)."""
    return envs.get("UNIMEM_FP8_ACT_QUANT") == "fused" and use_triton(x) and not _interpreting()


def _dense_reference(xq, xs, wq, ws) -> torch.Tensor:
    m, k = xq.shape
    acc = torch.zeros(m, wq.shape[0], dtype=torch.float32, device=xq.device)
    for g in range(num_groups(k)):
        cols = slice(g * GROUP, min((g + 1) * GROUP, k))
        part = xq[:, cols].float() @ wq[:, cols].float().t()
        acc += part * xs[:, g : g + 1] * ws[:, g][None, :]
    return acc


def fp8_gemm_reference(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    offs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """The scaled product of quantised operands (module docstring): ``xq [M, K]``, ``xs [M,
    KG]``; dense ``wq [N, K]``, ``ws [N, KG]`` -> ``[M, N]``; grouped (``offs [E]`` int32)
    ``wq [E, N, K]``, ``ws [E, N, KG]`` -> ``[T, N]`` with ``T = M`` or, with ``rows [T]``
    (int64), product row ``i`` reading activation row ``rows[i]``. ``bias [N]`` (dense) or
    ``[E, N]`` (grouped), added in float32. Rows past ``offs[-1]`` are zeros.

    ``xs`` None: ``xq`` is the unquantised activation (float) and the GEMM quantises each
    row group as it loads it, with :func:`fp8_quantize_groups`' arithmetic (the same values:
    one launch instead of two). Meant for the GPU: the CPU interpreter's e4m3 cast truncates
    (:func:`fused_quantization` says when to use it). ``invariant``: one tile for every row
    count (:data:`INVARIANT_CONFIG`).

    The reference: per group, the float32 product of the e4m3 values times both scales,
    summed over ascending groups (grouped: every expert's product over all rows, kept on the
    rows it owns; no host read of ``offs``); ``xs`` None quantises first
    (:func:`fp8_quantize_groups_reference`); ``invariant`` has no effect (one arithmetic)."""
    if xs is None:
        xq, xs = fp8_quantize_groups_reference(xq)
    if rows is not None:
        xq, xs = xq[rows], xs[rows]
    if offs is None:
        acc = _dense_reference(xq, xs, wq, ws)
        if bias is not None:
            acc = acc + bias.float()
        return acc.to(out_dtype)
    t = xq.shape[0]
    e = wq.shape[0]
    owner = torch.searchsorted(offs.to(torch.int64), torch.arange(t, device=xq.device),
                               right=True)  # fmt: skip
    acc = torch.zeros(t, wq.shape[1], dtype=torch.float32, device=xq.device)
    for i in range(e):
        part = _dense_reference(xq, xs, wq[i], ws[i])
        if bias is not None:
            part = part + bias[i].float()
        acc = torch.where((owner == i)[:, None], part, acc)
    return acc.to(out_dtype)


fp8_gemm = kernel_op(
    "fp8_gemm",
    triton=fp8_gemm_triton,
    reference=fp8_gemm_reference,
    device_of="xq",
    check=_check_gemm,
)


# ------------------------------------------------------------------- cuBLASLt (dense)

LT_MIN_ROWS = 256
"""Fewest rows for which :func:`fp8_linear` takes cuBLASLt's block-scaled GEMM
(:func:`use_lt`) for a weight of :data:`LT_MIN_N` to :data:`LT_WIDE_N` output rows (wider:
:data:`LT_WIDE_MIN_ROWS`; narrower: never). Measured on an H100 (2026-12-06, activation
quantisation included, ``docs/results/fp8_gemm_rows_tiles_h100.json``): at 256 rows cuBLASLt
beats the Triton kernel (qkv 3072 x 2048: 12.1 vs 16.6 us, gate_up 11264 x 2048: 19.0 vs
31.9), at 128 rows it loses on such shapes (qkv 11.7 vs 10.5, down 2048 x 5632: 21.0 vs
14.2). ``UNIMEM_FP8_LT_MIN_ROWS`` replaces this rule for every shape."""

LT_WIDE_N = 8192
"""From this many output rows (``N``) a weight counts as wide: cuBLASLt from
:data:`LT_WIDE_MIN_ROWS` rows. Same H100 run, 128 rows: 11 264 x 2 048 11.9 vs 17.8 us,
12 352 x 2 048 12.7 vs 17.7, 8 224 x 2 048 11.9 vs 13.5, 8 192 x 2 048 11.5 vs 11.8; at 64
rows cuBLASLt's fixed ~11.5 us loses to the Triton kernel's 7.8-11.9 on most shapes."""

LT_WIDE_MIN_ROWS = 128
"""Fewest rows for cuBLASLt on a wide weight (:data:`LT_WIDE_N`)."""

LT_MIN_N = 1024
"""Below this many output rows the Triton kernel at every row count: at 384 rows a 512 x
2 048 weight took 10.2 us on cuBLASLt against 7.9 on the Triton kernel (same run)."""

LT_CAPABILITY = (9, 0)
"""The one compute capability whose cuBLASLt has the 1 x 128 / 128 x 128 block scaling
PyTorch reaches (``_scaled_mm``'s "DeepSeek-style" scaling: SM90 only)."""

LT_OUT_DTYPES = (torch.bfloat16, torch.float16)
"""Output dtypes :func:`fp8_linear` sends to cuBLASLt (the models' GPU dtypes)."""

LT_N_ALIGN = 16
"""cuBLASLt's FP8 GEMM wants ``N`` (the output's leading dimension) a multiple of 16; ``N``
need not fill its last 128-row block (the block table has ``ceil(N / 128)`` rows): on an
H100 the GDN input projections, ``N`` 8 224 and 12 352, gave the Triton kernel's errors at
48-384 rows (``bench_fp8_gemm.py``, ``fp8_gemm_rows_h100.json``, 2026-12-06)."""

LT_ALIGN = 4
"""``M`` and ``K / 128`` must be multiples of this. cuBLASLt reads the 128 x 128 weight scales
with their ``K / 128`` extent padded to a multiple of 4 (as TransformerEngine lays them out
and PyTorch's block-scaling tests pad them), while ``_scaled_mm`` accepts only the unpadded
stride ``K / 128``; and it refuses 1 x 128 activation scales whose ``M`` is not a multiple of
4. Seen on an H100 (torch 2.11, 2026-12-06): ``K / 128`` of 17 or 5 gave wrong products
(max error 58 % and 100 % of the largest value), ``M`` of 385, 386, 387, 258, 5 or 1
``CUBLAS_STATUS_NOT_SUPPORTED``."""


def lt_min_rows(n: int) -> int | None:
    """Fewest rows for which an ``N``-output-row weight goes to cuBLASLt (None: never, by
    the row count): ``UNIMEM_FP8_LT_MIN_ROWS`` when set, whatever ``N``; else
    :data:`LT_WIDE_MIN_ROWS` from :data:`LT_WIDE_N`, :data:`LT_MIN_ROWS` from
    :data:`LT_MIN_N`, None below."""
    forced = envs.get("UNIMEM_FP8_LT_MIN_ROWS")
    if forced is not None:
        return forced
    if n >= LT_WIDE_N:
        return LT_WIDE_MIN_ROWS
    return LT_MIN_ROWS if n >= LT_MIN_N else None


def use_lt(
    rows: int,
    n: int,
    k: int,
    *,
    invariant: bool,
    capability: tuple[int, int] | None,
    has_blocks: bool,
    out_dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """Whether a dense FP8 product of ``rows`` activation rows by an ``N x K`` weight runs on
    cuBLASLt (:func:`fp8_gemm_lt`) rather than the Triton kernel. A pure function of its
    arguments (and ``UNIMEM_FP8_LT_MIN_ROWS``): ``capability`` is the device's compute
    capability, None off CUDA. Yes only when all hold: the capability is
    :data:`LT_CAPABILITY` (SM90); not ``invariant`` (batch-invariant mode keeps the Triton
    kernel's fixed tile); ``has_blocks`` (the weight has its ``[ceil(N/128), K/128]`` block table);
    ``out_dtype`` in :data:`LT_OUT_DTYPES`; ``rows >=`` :func:`lt_min_rows` of ``N`` and a
    multiple of :data:`LT_ALIGN`; ``N`` a multiple of :data:`LT_N_ALIGN` and ``K`` of
    ``128 * LT_ALIGN`` (:data:`LT_ALIGN` says why)."""
    min_rows = lt_min_rows(n)
    return (
        capability == LT_CAPABILITY
        and not invariant
        and has_blocks
        and out_dtype in LT_OUT_DTYPES
        and min_rows is not None
        and rows >= min_rows
        and rows % LT_ALIGN == 0
        and n % LT_N_ALIGN == 0
        and k % (GROUP * LT_ALIGN) == 0
    )


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s CUDA compute capability (cached per device), None off CUDA."""
    if device.type != "cuda":
        return None
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def fp8_gemm_lt(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    block_scales: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense scaled product of :func:`fp8_gemm_reference` on cuBLASLt's block-scaled
    GEMM (``torch._scaled_mm``, 1 x 128 activation and 128 x 128 weight scaling; SM90 with
    cuBLASLt >= 12.9). ``xq [M, K]`` e4m3 row-major, ``xs [M, KG]`` float32 M-major
    (strides ``(1, M)``: :func:`fp8_quantize_groups` with ``m_major``); ``wq [N, K]`` e4m3
    row-major (passed as its ``[K, N]`` column-major transpose) and ``block_scales
    [ceil(N/128), KG]`` float32 row-major (one scale per 128 x 128 block, the last one
    possibly short: :func:`collapse_block_scales`; passed transposed, a view); ``N`` a
    multiple of 16 (:data:`LT_N_ALIGN`), ``K`` of 512 and ``M`` of 4 (:data:`LT_ALIGN`).
    ``bias [N]`` of ``out_dtype`` (bf16 or fp16), added in cuBLASLt's epilogue
    (:func:`fp8_linear` never sends a bias here). Returns a new ``[M, N]``
    tensor of ``out_dtype`` (from the caching allocator: capturable in a CUDA graph).
    The operands are read, never kept. ValueError naming the operand otherwise. The sums run
    in cuBLASLt's order, so the result matches the Triton kernel's within float32 rounding,
    not bit for bit."""
    _check_lt(xq, xs, wq, block_scales, out_dtype, bias)
    return torch._scaled_mm(
        xq, wq.t(), scale_a=xs, scale_b=block_scales.t(), bias=bias, out_dtype=out_dtype
    )


def _check_lt(xq, xs, wq, block_scales, out_dtype, bias) -> None:
    m, k = xq.shape
    n = wq.shape[0]
    kg = num_groups(k)
    if xq.dtype != FP8_DTYPE or not xq.is_contiguous():
        raise ValueError(f"fp8_gemm_lt: xq must be [M, K] e4m3 row-major, got {xq.dtype}")
    if wq.dim() != 2 or wq.shape[1] != k or wq.dtype != FP8_DTYPE or not wq.is_contiguous():
        raise ValueError(
            f"fp8_gemm_lt: wq must be [N, {k}] e4m3 row-major, got {tuple(wq.shape)} {wq.dtype}"
        )
    if n % LT_N_ALIGN or k % (GROUP * LT_ALIGN) or m % LT_ALIGN:
        raise ValueError(
            f"fp8_gemm_lt: N {n} must be a multiple of {LT_N_ALIGN}, K {k} of "
            f"{GROUP * LT_ALIGN} and M {m} of {LT_ALIGN} (LT_ALIGN)"
        )
    m_major = xs.stride(0) == 1 and (kg == 1 or xs.stride(1) == m)
    if xs.shape != (m, kg) or xs.dtype != torch.float32 or not (m <= 1 or m_major):
        raise ValueError(
            f"fp8_gemm_lt: xs must be [{m}, {kg}] float32 with strides (1, {m}), got "
            f"{tuple(xs.shape)} {xs.dtype} strides {xs.stride()}"
        )
    want = ((n + GROUP - 1) // GROUP, kg)
    if (
        block_scales.shape != want
        or block_scales.dtype != torch.float32
        or not block_scales.is_contiguous()
    ):
        raise ValueError(
            f"fp8_gemm_lt: block_scales must be {want} float32 row-major, got "
            f"{tuple(block_scales.shape)} {block_scales.dtype}"
        )
    if out_dtype not in LT_OUT_DTYPES:
        raise ValueError(f"fp8_gemm_lt: out_dtype must be one of {LT_OUT_DTYPES}, got {out_dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype):
        raise ValueError(
            f"fp8_gemm_lt: bias must be [{n}] {out_dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )


def _takes_lt(
    x2: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    invariant: bool,
    block_scales: torch.Tensor | None,
) -> bool:
    """Whether :func:`fp8_linear` runs ``x2 [M, K]`` on cuBLASLt: the kernels' side of the
    ops is in use on a CUDA tensor (``UNIMEM_KERNEL_BACKEND``), there is no bias (the
    models' FP8 linears have none; a product with one stays on the Triton kernel) and
    :func:`use_lt` says yes."""
    if block_scales is None or bias is not None or not x2.is_cuda or not use_triton(x2):
        return False
    if _interpreting():
        return False
    return use_lt(
        x2.shape[0], n, x2.shape[1], invariant=invariant,
        capability=device_capability(x2.device), has_blocks=True, out_dtype=x2.dtype,
    )  # fmt: skip


# ------------------------------------------------------------------- entry points


def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    invariant: bool = False,
    block_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K]`` times FP8 weight ``wq [N, K]`` (scales ``ws [N, KG]``) transposed:
    ``x`` quantised per token and group (:func:`fp8_quantize_groups`), then one GEMM.
    Returns ``[..., N]`` in ``x``'s dtype. A few rows (:func:`unimem_kernel.fp8_gemv.
    takes_gemv`) take :func:`~unimem_kernel.fp8_gemv.fp8_gemv` instead: one launch on the
    CUDA cores that quantises the rows itself.

    The GEMM: cuBLASLt's block-scaled one (:func:`fp8_gemm_lt`, the scales written M-major
    by the quantisation launch) where :func:`use_lt` says so — which needs
    ``block_scales [ceil(N/128), KG]``, the weight's 128 x 128 block scales (``ws`` collapsed,
    :func:`collapse_block_scales`; the caller owns it) — else the Triton kernel
    (:func:`fp8_gemm`). ``UNIMEM_FP8_ACT_QUANT=fused`` always takes the Triton kernel with
    the quantisation in its loads."""
    k = x.shape[-1]
    n = wq.shape[0]
    x2 = x.reshape(-1, k)
    if _gemv.takes_gemv(x2, x2.shape[0], False, invariant):
        return _gemv.fp8_gemv(x2, wq, ws, bias=bias).reshape(*x.shape[:-1], n)
    if fused_quantization(x2):
        y = fp8_gemm(x2, None, wq, ws, out_dtype=x.dtype, bias=bias, invariant=invariant)
        return y.reshape(*x.shape[:-1], n)
    if _takes_lt(x2, n, bias, invariant, block_scales):
        xq, xs = fp8_quantize_groups(x2, m_major=True)
        y = fp8_gemm_lt(xq, xs, wq, block_scales, out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], n)
    xq, xs = fp8_quantize_groups(x2)
    y = fp8_gemm(xq, xs, wq, ws, out_dtype=x.dtype, bias=bias, invariant=invariant)
    return y.reshape(*x.shape[:-1], n)


def fp8_grouped_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    offs: torch.Tensor,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    invariant: bool = False,
) -> torch.Tensor:
    """``[T, N]``: row ``i`` of ``a`` (``x``, or ``x[rows]`` read in the loads) times its
    expert's FP8 weight ``wq[e] [N, K]`` transposed, ``e`` the expert owning row ``i`` by
    ``offs [E]`` (int32, non-decreasing, ``offs[-1] <= T``; rows past it are zeros).
    ``x [M, K]`` is quantised once per token (before the gather), or, at a few rows
    (:func:`unimem_kernel.fp8_gemv.takes_gemv`), by :func:`~unimem_kernel.fp8_gemv.
    fp8_gemv` in its one launch. Returns ``x``'s dtype."""
    t = rows.shape[0] if rows is not None else x.shape[0]
    if _gemv.takes_gemv(x, t, True, invariant):
        return _gemv.fp8_gemv(x, wq, ws, offs, rows, bias)
    if fused_quantization(x):
        return fp8_gemm(
            x, None, wq, ws, out_dtype=x.dtype, bias=bias, offs=offs, rows=rows, invariant=invariant
        )
    xq, xs = fp8_quantize_groups(x)
    return fp8_gemm(
        xq, xs, wq, ws, out_dtype=x.dtype, bias=bias, offs=offs, rows=rows, invariant=invariant
    )


# ------------------------------------------------------------------ the weight format
# (block-wise e4m3 with a float32 scale per 128 x 128 block, the hub's FP8 checkpoints)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(q [..., N, K] e4m3, scale [..., NB, KG] float32)``: one scale
    per 128 x 128 block, ``amax / 448`` (the hub's FP8 checkpoint layout), ``q = w / scale``
    rounded to e4m3."""
    *lead, n, k = w.shape
    nb, kg = (n + GROUP - 1) // GROUP, num_groups(k)
    pad = torch.zeros(*lead, nb * GROUP, kg * GROUP, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w.float()
    blocks = pad.view(*lead, nb, GROUP, kg, GROUP)
    s = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-10) / FP8_MAX  # [..., NB, KG]
    q = (blocks / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * GROUP, kg * GROUP)[..., :n, :k].to(FP8_DTYPE).contiguous()
    return q, s


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blocks` with the scales expanded to rows (``[..., N, KG]``)."""
    q, s = quantize_blocks(w)
    return q, expand_block_scales(s, w.shape[-2])


def dequantize(q: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """``q [..., N, K]`` times its per-row-group scales ``[..., N, KG]``, float32."""
    k = q.shape[-1]
    return q.float() * row_scales.repeat_interleave(GROUP, dim=-1)[..., :k]


def collapse_block_scales(row_scales: torch.Tensor, k: int) -> torch.Tensor | None:
    """The inverse of :func:`expand_block_scales` for a 2-D weight of ``k`` columns:
    ``row_scales [N, KG]`` -> the block table ``[ceil(N/128), KG]`` float32 (row-major, a
    new tensor the caller owns; what :func:`fp8_gemm_lt` takes; a last block of fewer than
    128 rows is one table row too), or None when ``k`` is not a multiple of 128, ``N`` is 0
    or some 128-row block's rows differ (a model that moved rows across block boundaries;
    NaN scales count as differing). Reads the scales on the host (a device sync): for load
    time. ValueError when ``KG`` does not fit ``k``."""
    if row_scales.dim() != 2 or row_scales.shape[1] != num_groups(k):
        raise ValueError(
            f"row scales {tuple(row_scales.shape)} are not [N, {num_groups(k)}] for K {k}"
        )
    n, kg = row_scales.shape
    if n == 0 or k % GROUP:
        return None
    nb = (n + GROUP - 1) // GROUP
    pad = nb * GROUP - n  # the last block's missing rows repeat its last row
    full = torch.cat([row_scales, row_scales[-1:].expand(pad, kg)]) if pad else row_scales
    blocks = full.reshape(nb, GROUP, kg)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        return None
    return blocks[:, 0].float().clone(memory_format=torch.contiguous_format)


def expand_block_scales(block_scales: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., NB, KB]`` block scales of a weight with ``n`` rows -> ``[..., n, KB]`` float32
    (row ``r`` takes block row ``r // 128``); ValueError if ``NB != ceil(n / 128)``."""
    nb = block_scales.shape[-2]
    if nb != (n + GROUP - 1) // GROUP:
        raise ValueError(
            f"{nb} block rows of scales do not cover a weight of {n} rows in blocks of {GROUP}"
        )
    rows = block_scales.float().repeat_interleave(GROUP, dim=-2)
    return rows[..., :n, :].contiguous()


# the module of the few-row product that fp8_linear / fp8_grouped_linear dispatch to
# (imported last: it builds on this module's quantisation and reference; by its module name,
# since the package's attribute of that name is the op)
_gemv = importlib.import_module("unimem_kernel.fp8_gemv")
