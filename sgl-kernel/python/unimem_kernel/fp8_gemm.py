"""FP8 (e4m3) GEMMs with per-token-group activation scales and per-row-group weight scales.

Scaling convention (the hub's block-wise FP8, DeepSeek-V3 / Qwen3-Next ``-FP8`` checkpoints):
the reduction dim ``K`` is cut into groups of :data:`GROUP` (128) columns, ``KG =
ceil(K / 128)`` of them (the last may be partial). An activation row ``x [K]`` is quantised
per group (:func:`fp8_quantize_groups`): ``s = max(amax(|x_g|), SCALE_FLOOR) / 448``,
``q_g = clamp(x_g / s, -448, 448)`` rounded to e4m3 (round to nearest even). A weight is
``wq [N, K]`` e4m3 with ``ws [N, KG]`` float32: row ``n``'s group ``g`` holds ``wq[n, g] *
ws[n, g]`` (a checkpoint's ``[128, 128]`` block scales expanded to rows, so any row
permutation or row range of a weight keeps its scales). The product::

    y[m, n] = sum_g  xs[m, g] * ws[n, g] * (sum_{k in g} xq[m, k] * wq[n, k])

with the inner sum an FP8 tensor-core dot accumulated in float32 and the outer sum over
``g`` in ascending order, in float32; ``y`` is cast to the output dtype once.

Ops (Triton kernel on CUDA, torch reference of the same semantics elsewhere, as every op of
this package; ``UNIMEM_KERNEL_BACKEND`` forces either):

- :func:`fp8_quantize_groups`: ``x [M, K]`` -> ``(xq [M, K] e4m3, xs [M, KG] float32)``;
- :func:`fp8_linear`: ``x [..., K]`` (bf16/fp16/fp32) times ``wq^T``: quantise, then one
  GEMM launch (:func:`fp8_gemm`);
- :func:`fp8_grouped_linear`: rows grouped by expert (``offs``, the cumulative end rows,
  ``torch._grouped_mm``'s convention) times their expert's ``wq [E, N, K]``, optionally
  gathering ``x[rows]`` in the loads: the MoE layers' routed experts.

``UNIMEM_FP8_ACT_QUANT=fused`` quantises the activations inside the GEMM's loads instead of
in a launch of their own (the same values; one launch per product instead of two; GPU only).

Tile choice: by the row count for speed, or one fixed tile (``invariant=True``,
deterministic inference): each output element's arithmetic is then the same whatever the
number of rows, so a row's result does not depend on the other rows (activation scales are
per row already). No split-K in either. Outputs are allocated with ``torch.empty`` and no
device value is read on the host: every call is capturable in a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import next_pow2, use_triton

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "GROUP",
    "SCALE_FLOOR",
    "Fp8GemmConfig",
    "fp8_gemm",
    "fp8_gemm_config",
    "fp8_gemm_reference",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_quantize_groups",
    "fp8_quantize_groups_reference",
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
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, BLOCK_K: tl.constexpr
):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    kk = g * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = kk < K
    x = tl.load(x_ptr + m * stride_xm + kk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)  # IEEE division, as torch
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
    # (the interpreter's e4m3 cast truncates where the GPU's rounds to nearest even: under
    # the interpreter q_ptr is float32 and the caller casts with torch, which rounds as the GPU)
    tl.store(q_ptr + m * stride_qm + kk, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m * stride_sm + g, s)


def fp8_quantize_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`fp8_quantize_groups`."""
    m, k = x.shape
    kg = num_groups(k)
    xf = x.float()
    pad = torch.zeros(m, kg * GROUP, dtype=torch.float32, device=x.device)
    pad[:, :k] = xf
    amax = pad.view(m, kg, GROUP).abs().amax(dim=-1)
    # tensor / tensor: an IEEE division on every device (CUDA turns "/ python float" into a
    # multiplication by the reciprocal, one ulp off in some groups; the kernel divides)
    amax = amax.clamp_min(SCALE_FLOOR)
    s = amax / torch.full_like(amax, FP8_MAX)
    q = (pad.view(m, kg, GROUP) / s[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(m, kg * GROUP)[:, :k].to(FP8_DTYPE).contiguous(), s


def fp8_quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float, unit stride along ``K``) -> ``(xq [M, K] e4m3, xs [M, KG]
    float32)``, per token and group of 128 columns (module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize_groups: x must be [M, K], got {tuple(x.shape)}")
    if not use_triton(x):
        return fp8_quantize_groups_reference(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    kg = num_groups(k)
    interp = _interpreting()
    q = torch.empty(m, k, dtype=torch.float32 if interp else FP8_DTYPE, device=x.device)
    s = torch.empty(m, kg, dtype=torch.float32, device=x.device)
    if m and k:
        _quant_groups_kernel[(m, kg)](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_K=GROUP, num_warps=1
        )
    return (q.to(FP8_DTYPE) if interp else q), s


# ------------------------------------------------------------------- GEMM kernel


@dataclass(frozen=True)
class Fp8GemmConfig:
    """A tile of the FP8 GEMM kernel (``BLOCK_K`` is always :data:`GROUP`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


INVARIANT_CONFIG = Fp8GemmConfig(64, 64, 4, 4)
"""The one tile of ``invariant=True``: independent of the row count."""

# Decode / verify steps have 1-512 rows: small tiles keep an H200's 132 SMs busy on the
# narrow projections (N 2048 at 384 rows: 6 x 32 programs); prefill takes 128 x 128.
_BY_ROWS = (
    (32, Fp8GemmConfig(32, 64, 4, 4)),
    (512, Fp8GemmConfig(64, 64, 4, 4)),
    (1 << 62, Fp8GemmConfig(128, 128, 8, 3)),
)


def fp8_gemm_config(rows_per_group: int, invariant: bool = False) -> Fp8GemmConfig:
    """The tile for ``rows_per_group`` rows per weight (the mean rows per expert for grouped
    calls); :data:`INVARIANT_CONFIG` when ``invariant``."""
    if invariant:
        return INVARIANT_CONFIG
    for max_rows, cfg in _BY_ROWS:
        if rows_per_group <= max_rows:
            return cfg
    return _BY_ROWS[-1][1]


@triton.jit(do_not_specialize=["T"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, rows_ptr, w_ptr, ws_ptr, offs_ptr, bias_ptr, out_ptr,
    T, N, K, KG, E,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    GROUPED: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
    FUSED_QUANT: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (p, n): row tile p, column tile n. GROUPED: expert e < E owns rows
    # [offs[e-1], offs[e]), the tail [offs[E-1], T) is written as zeros; row tiles start at
    # each segment's first row and are numbered over all segments in order (found on the
    # device from offs: no host reads). Otherwise one segment [0, T), weight 0.
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
    for g in range(0, g_end):
        kk = (g * BLOCK_K + rk).to(tl.int64)
        mask_k = kk < K
        a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FUSED_QUANT:
            # a_ptr is the unquantised activation: quantise the group here, with the
            # arithmetic of _quant_groups_kernel (so the same e4m3 values and scales)
            xa = a.to(tl.float32)
            sa = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xa), axis=1), 1e-10), 448.0)
            q = tl.minimum(tl.maximum(tl.math.div_rn(xa, sa[:, None]), -448.0), 448.0)
            a = q.to(w_ptr.dtype.element_ty)
        else:
            sa = tl.load(as_ptr + src * stride_asm + g, mask=mask_m, other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        part = tl.dot(a, w, out_dtype=tl.float32)
        sw = tl.load(ws_ptr + we * stride_wse + rn * stride_wsn + g, mask=mask_n, other=0.0)
        acc += part * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + we * N + rn, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(g_end > 0, bias, 0.0)[None, :]
    o = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


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


def fp8_gemm(
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
    """The scaled product of quantised operands (module docstring): ``xq [M, K]``, ``xs [M,
    KG]``; dense ``wq [N, K]``, ``ws [N, KG]`` -> ``[M, N]``; grouped (``offs [E]`` int32)
    ``wq [E, N, K]``, ``ws [E, N, KG]`` -> ``[T, N]`` with ``T = M`` or, with ``rows [T]``
    (int64), product row ``i`` reading activation row ``rows[i]``. ``bias [N]`` (dense) or
    ``[E, N]`` (grouped), added in float32. Rows past ``offs[-1]`` are zeros.

    ``xs`` None: ``xq`` is the unquantised activation (float) and the GEMM quantises each
    row group as it loads it, with :func:`fp8_quantize_groups`' arithmetic (the same values:
    one launch instead of two). Triton only (the CPU interpreter's e4m3 cast truncates)."""
    grouped = offs is not None
    if xs is None:
        return _fp8_gemm_fused(xq, wq, ws, out_dtype, bias, offs, rows, invariant)
    _check_operands(xq, xs, wq, ws, grouped)
    if rows is not None and not grouped:
        raise ValueError("fp8_gemm: rows needs offs (a grouped call)")
    if not use_triton(xq):
        return fp8_gemm_reference(
            xq, xs, wq, ws, out_dtype=out_dtype, bias=bias, offs=offs, rows=rows
        )
    t = rows.shape[0] if rows is not None else xq.shape[0]
    k = xq.shape[1]
    n = wq.shape[-2]
    e = wq.shape[0] if grouped else 1
    out = torch.empty(t, n, dtype=out_dtype, device=xq.device)
    if t == 0 or n == 0:
        return out
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    cfg = fp8_gemm_config(max(t // e, 1), invariant)
    row_tiles = triton.cdiv(t, cfg.block_m) + (e + 1 if grouped else 0)
    grid = (row_tiles, triton.cdiv(n, cfg.block_n))
    _fp8_gemm_kernel[grid](
        xq, xs, rows if rows is not None else xs, wq, ws, offs if grouped else xs,
        bias if bias is not None else out, out,
        t, n, k, num_groups(k), e,
        xq.stride(0), xs.stride(0), wq.stride(0) if grouped else 0, wq.stride(-2),
        ws.stride(0) if grouped else 0, ws.stride(-2), out.stride(0),
        GROUPED=grouped, GATHER=rows is not None, HAS_BIAS=bias is not None, FUSED_QUANT=False,
        BLOCK_E=next_pow2(e + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _fp8_gemm_fused(x, wq, ws, out_dtype, bias, offs, rows, invariant) -> torch.Tensor:
    """:func:`fp8_gemm` with ``xs`` None (the activation quantised in the GEMM's loads)."""
    grouped = offs is not None
    k = x.shape[1]
    t = rows.shape[0] if rows is not None else x.shape[0]
    n = wq.shape[-2]
    e = wq.shape[0] if grouped else 1
    if wq.shape[-1] != k or ws.shape != (*wq.shape[:-1], num_groups(k)):
        raise ValueError(
            f"fp8 weight {tuple(wq.shape)} / scales {tuple(ws.shape)} do not fit K {k}"
        )
    out = torch.empty(t, n, dtype=out_dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = fp8_gemm_config(max(t // e, 1), invariant)
    row_tiles = triton.cdiv(t, cfg.block_m) + (e + 1 if grouped else 0)
    grid = (row_tiles, triton.cdiv(n, cfg.block_n))
    _fp8_gemm_kernel[grid](
        x, x, rows if rows is not None else x, wq, ws, offs if grouped else x,
        bias if bias is not None else out, out,
        t, n, k, num_groups(k), e,
        x.stride(0), 0, wq.stride(0) if grouped else 0, wq.stride(-2),
        ws.stride(0) if grouped else 0, ws.stride(-2), out.stride(0),
        GROUPED=grouped, GATHER=rows is not None, HAS_BIAS=bias is not None, FUSED_QUANT=True,
        BLOCK_E=next_pow2(e + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def fused_quantization(x: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` / :func:`fp8_grouped_linear` quantise ``x`` inside the GEMM
    (``UNIMEM_FP8_ACT_QUANT=fused``) rather than in a launch of its own (``separate``, the
    default); Triton on a GPU only (the interpreter's e4m3 cast truncates)."""
    choice = os.environ.get("UNIMEM_FP8_ACT_QUANT", "separate")
    if choice not in ("separate", "fused"):
        raise ValueError(f"UNIMEM_FP8_ACT_QUANT must be separate or fused, got {choice!r}")
    return choice == "fused" and use_triton(x) and not _interpreting()


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
) -> torch.Tensor:
    """The torch reference of :func:`fp8_gemm`: per group, the float32 product of the
    e4m3 values times both scales, summed over ascending groups (grouped: every expert's
    product over all rows, kept on the rows it owns; no host read of ``offs``)."""
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


# ------------------------------------------------------------------- entry points


def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K]`` times FP8 weight ``wq [N, K]`` (scales ``ws [N, KG]``) transposed:
    ``x`` quantised per token and group (:func:`fp8_quantize_groups`), then
    :func:`fp8_gemm`. Returns ``[..., N]`` in ``x``'s dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if fused_quantization(x2):
        y = fp8_gemm(x2, None, wq, ws, out_dtype=x.dtype, bias=bias, invariant=invariant)
        return y.reshape(*x.shape[:-1], wq.shape[0])
    xq, xs = fp8_quantize_groups(x2)
    y = fp8_gemm(xq, xs, wq, ws, out_dtype=x.dtype, bias=bias, invariant=invariant)
    return y.reshape(*x.shape[:-1], wq.shape[0])


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
    ``x [M, K]`` is quantised once per token (before the gather). Returns ``x``'s dtype."""
    if fused_quantization(x):
        return fp8_gemm(
            x, None, wq, ws, out_dtype=x.dtype, bias=bias, offs=offs, rows=rows, invariant=invariant
        )
    xq, xs = fp8_quantize_groups(x)
    return fp8_gemm(
        xq, xs, wq, ws, out_dtype=x.dtype, bias=bias, offs=offs, rows=rows, invariant=invariant
    )
