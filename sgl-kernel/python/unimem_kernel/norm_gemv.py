"""A decode step's projection with its norms in front and its gated activation behind: one launch.

At one to a few rows a decoder layer's GEMMs are bandwidth-bound weight reads, and every
norm, residual add and activation around them is a launch of its own that moves almost no
bytes (Gemma 3: a post-norm, the residual add and the next pre-norm before the q/k/v and
the gate/up projections, GeGLU after the latter). :func:`norm_linear` does the whole chain
in one launch: every program reads the few input rows (``K`` elements each: 640 to a few
thousand), computes the norms itself, and multiplies by its own ``BLOCK_N`` columns of the
weight, so the weight is read once and nothing else touches memory twice.

Contract (the torch reference states it; the Triton side computes the same with its own
summation order)::

    stream = x + rms_norm(delta, post_weight)     if delta is not None   (returned; without
                                                  post_weight: x + delta, the Qwen form)
    h      = rms_norm(stream or x, norm_weight)   if norm_weight is not None, else stream or x
    y      = h @ weight.T                          (weight [N, K]; fp32 accumulation)
    out    = act(y[:, :N/2]) * y[:, N/2:]           if act ("gelu_tanh", "silu"), else y

Each norm is ``v * rsqrt(mean(v^2) + eps) * w`` in fp32 (``w`` the weight upcast, or ``1 + w``
when ``zero_centered``: Gemma's form) rounded once to the input dtype; ``stream`` is rounded
to the dtype; ``y`` is rounded to the dtype before the activation, which runs in fp32 and is
rounded before its product, exactly as :func:`~unimem_kernel.fused.norm_add_rms_norm` (or
:func:`~unimem_kernel.fused.add_rms_norm` without ``post_weight``),
``F.linear`` and :func:`~unimem_kernel.fused.gelu_tanh_mul` / ``silu_mul`` round when called
one after the other. The only numerical difference from that chain is the order in which the
GEMM and the norms' sums of squares add up.

The kernel covers up to :data:`MAX_ROWS` rows; the caller picks this op for small batches and
the vendor GEMM above. Measured on the H200 at Gemma 3 270M's projections
(``docs/results/bench_norm_gemv_h200.json``): one row, 1.5-2.2x faster than the chain of
launches it replaces; 8 and 16 rows on the tensor cores, 0.7-0.85x on the projections with
norms in front (every program recomputes the rows' norms), 1.0x on the plain ones — so the
models take it for one-row steps by default (``UNIMEM_NORM_LINEAR_ROWS``).

A row's result depends on no other row's values (the row tile, one row or a power of two from
the row count, may still change its rounding on the GPU), and the vendor GEMM that larger
batches take rounds differently: batch-invariant (deterministic) mode must not use it.
Nothing is read on the host; the call can be recorded in a CUDA graph after a first call
(Triton compiles on first use).

Tiles: ``BLOCK_N`` output columns per program (both halves' columns with an activation),
``BLOCK_K`` per loop step. One row runs a one-row tile on the CUDA cores (``BLOCK_N`` from 4:
more programs over a narrow output); more rows a tensor-core tile of at least 16 rows and
columns. From the tuned table ``norm_gemv_configs.json`` (GPU name ->
``"N,K,act"`` -> ``[[max_rows, "BN,BK,warps,stages"], ...]``, written by the micro-benchmark's
sweep, ``sgl-kernel/benchmark/bench_norm_gemv.py``),
else :data:`DEFAULT_CONFIG` (:data:`DEFAULT_ONE_ROW_CONFIG` for one row);
``UNIMEM_NORM_LINEAR_CONFIG`` forces one. A tile whose ``BLOCK_K`` covers all of ``K`` (the
one-row tiles at Gemma 3 270M's q/k/v, ``o_proj`` and gate/up) issues its weight loads before
the norms' passes over the input, so that the weights are in flight while the norms wait on
theirs (not yet timed on the GPU).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unimem_kernel import envs, pdl
from unimem_kernel._dispatch import kernel_op, next_pow2, records_autograd
from unimem_kernel.batch_invariant import bi_rms_norm_reference
from unimem_kernel.fused_activations import gelu_tanh_mul_reference, silu_mul_reference
from unimem_kernel.fused_common import FUSED_SWITCH, check_device, check_float
from unimem_kernel.fused_norms import add_rms_norm_reference, norm_add_rms_norm_reference
from unimem_kernel.rounding import INTERPRETED, round_rne

__all__ = [
    "ACTS",
    "DEFAULT_CONFIG",
    "DEFAULT_ONE_ROW_CONFIG",
    "MAX_ROWS",
    "NormLinearConfig",
    "norm_linear",
    "norm_linear_config",
    "norm_linear_reference",
    "norm_linear_triton",
]

MAX_ROWS = 64
"""Most rows the kernel takes (its row tile covers them all: one row, or a power of two >= 16
for the tensor cores)."""

ACTS = {None: 0, "silu": 1, "gelu_tanh": 2}
"""The activations (``act``) and their kernel codes."""


@dataclass(frozen=True)
class NormLinearConfig:
    """A tile of the kernel: output columns per program, ``K`` per loop step, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def spec(self) -> str:
        """``"BN,BK,warps,stages"`` (the form ``UNIMEM_NORM_LINEAR_CONFIG`` reads)."""
        return f"{self.block_n},{self.block_k},{self.num_warps},{self.num_stages}"

    @classmethod
    def parse(cls, spec: str) -> NormLinearConfig:
        """The config of :meth:`spec`'s form; ValueError naming ``spec`` otherwise."""
        try:
            cfg = cls(*(int(v) for v in spec.split(",")))
        except (TypeError, ValueError):
            raise ValueError(f"norm_linear config {spec!r} is not 'BN,BK,warps,stages'") from None
        for v, least in ((cfg.block_n, 4), (cfg.block_k, 16)):
            if v < least or v & (v - 1):
                raise ValueError(
                    f"norm_linear config {spec!r}: BN is a power of 2 >= 4, BK one >= 16"
                )
        if cfg.num_warps not in (1, 2, 4, 8) or cfg.num_stages < 1:
            raise ValueError(f"norm_linear config {spec!r}: warps 1/2/4/8, stages >= 1")
        return cfg


DEFAULT_CONFIG = NormLinearConfig(16, 128, 4, 4)
"""The tile of several rows without a tuned entry: 16 columns per program (a few hundred
programs for the projections of a small model), 128 of ``K`` a step, loads four steps ahead."""

DEFAULT_ONE_ROW_CONFIG = NormLinearConfig(8, 1024, 4, 3)
"""The tile of one row without a tuned entry: 8 columns per program and 1024 of ``K`` a step
(the whole row of a small model's weight in one load: within 3 % of the best tile of every
Gemma 3 270M projection on the H200, ``docs/results/bench_norm_gemv_h200.json``)."""

TUNED_CONFIGS = Path(__file__).with_name("norm_gemv_configs.json")


@functools.cache
def _tuned(device_name: str) -> dict[str, list[tuple[int, NormLinearConfig]]]:
    if not TUNED_CONFIGS.exists():
        return {}
    table = json.loads(TUNED_CONFIGS.read_text()).get(device_name, {})
    return {key: [(int(r), NormLinearConfig.parse(c)) for r, c in rows]
            for key, rows in table.items()}  # fmt: skip


def norm_linear_config(
    rows: int, n: int, k: int, act: str | None, device: torch.device
) -> NormLinearConfig:
    """The tile for ``rows`` rows of an ``[n, k]`` weight with ``act``: the forced one
    (``UNIMEM_NORM_LINEAR_CONFIG``), else the tuned table's for this GPU, else the default."""
    forced = envs.get("UNIMEM_NORM_LINEAR_CONFIG")
    if forced:
        return NormLinearConfig.parse(forced)
    if device.type == "cuda":
        key = f"{n},{k},{act or 'none'}"
        for max_rows, cfg in _tuned(torch.cuda.get_device_name(device)).get(key, []):
            if rows <= max_rows:
                return cfg
    return DEFAULT_ONE_ROW_CONFIG if rows == 1 else DEFAULT_CONFIG


# ------------------------------------------------------------------------- the kernel


@triton.jit
def _stream_chunk(x_rows, d_rows, pw_ptr, k0, ks, kmask, mk, rstd_d, dt: tl.constexpr,
                  HAS_DELTA: tl.constexpr, HAS_POST: tl.constexpr,
                  ZERO_CENTERED: tl.constexpr):  # fmt: skip
    """Columns ``k0 + ks`` of the stream (fp32 values of dtype ``dt``): ``x``, or ``x +
    norm(delta)`` (``x + delta`` without HAS_POST) rounded as the chain rounds it."""
    xv = tl.load(x_rows + k0 + ks[None, :], mask=mk, other=0.0).to(tl.float32)
    if HAS_DELTA:
        dv = tl.load(d_rows + k0 + ks[None, :], mask=mk, other=0.0).to(tl.float32)
        if HAS_POST:
            pw = tl.load(pw_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                pw = 1.0 + pw
            dv = round_rne((dv * rstd_d[:, None]) * pw[None, :], dt).to(tl.float32)
        xv = round_rne(xv + dv, dt).to(tl.float32)
    return xv


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32. A one-row tile (and the interpreter, whose dot is numpy's
    matmul, which takes no bf16) multiplies in fp32 and sums over K on the CUDA cores; larger
    tiles take the tensor cores."""
    if INTERPRETED or a.shape[0] == 1:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _normed_chunk(x_rows, d_rows, pw_ptr, nw_ptr, k0, ks, K, mmask, rstd_d, rstd,
                  dt: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_POST: tl.constexpr,
                  HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr):  # fmt: skip
    """Columns ``k0 + ks`` of the GEMM's input, of dtype ``dt``: the stream normed (HAS_NORM)
    or the stream itself."""
    kmask = k0 + ks < K
    mk = mmask[:, None] & kmask[None, :]
    h = _stream_chunk(x_rows, d_rows, pw_ptr, k0, ks, kmask, mk, rstd_d, dt, HAS_DELTA,
                      HAS_POST, ZERO_CENTERED)  # fmt: skip
    if HAS_NORM:
        nw = tl.load(nw_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            nw = 1.0 + nw
        h = round_rne((h * rstd[:, None]) * nw[None, :], dt)
    else:
        h = h.to(dt)
    return h


@triton.jit
def _norm_linear_kernel(
    x_ptr, d_ptr, pw_ptr, nw_ptr, w_ptr, s_ptr, y_ptr,
    M, NOUT, K, stride_x, stride_d, stride_w, stride_y, eps,
    HAS_DELTA: tl.constexpr, HAS_POST: tl.constexpr, HAS_NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    ACT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Program n: output columns n * BLOCK_N .. + BLOCK_N of every row (with ACT, the gate's
    # columns and the same columns of the up half, NOUT further down the weight).
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < NOUT
    ks = tl.arange(0, BLOCK_K)
    dt = y_ptr.dtype.element_ty
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    d_rows = d_ptr + rm[:, None].to(tl.int64) * stride_d
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_w
    # The first K tile of the weights (all of K for a small model's one-row tile) is loaded
    # before the wait for the predecessor: no kernel of the step writes weights, and under
    # PDL their fetch from HBM overlaps the predecessor's tail.
    wmask0 = (ks < K)[:, None] & nmask[None, :]
    w0 = tl.load(w_cols + ks[:, None], mask=wmask0, other=0.0)  # [BLOCK_K, BLOCK_N]
    w0_up = w0
    if ACT != 0:
        w0_up = tl.load(w_cols + NOUT * stride_w + ks[:, None], mask=wmask0, other=0.0)
    pdl.wait(PDL)
    rstd_d = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_POST:  # the branch's post-norm: its sum of squares
        sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mk = mmask[:, None] & (k0 + ks < K)[None, :]
            dv = tl.load(d_rows + k0 + ks[None, :], mask=mk, other=0.0).to(tl.float32)
            sq += dv * dv
        rstd_d = tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_NORM:  # the stream's sum of squares (program 0 also writes the stream)
        sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = k0 + ks < K
            mk = mmask[:, None] & kmask[None, :]
            sv = _stream_chunk(x_rows, d_rows, pw_ptr, k0, ks, kmask, mk, rstd_d, dt, HAS_DELTA,
                               HAS_POST, ZERO_CENTERED)  # fmt: skip
            if HAS_DELTA:  # noqa: SIM102 (a constexpr, then a runtime branch)
                if pid == 0:
                    s_ptrs = s_ptr + rm[:, None].to(tl.int64) * K + k0 + ks[None, :]
                    tl.store(s_ptrs, sv.to(dt), mask=mk)
            sq += sv * sv
        rstd = tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h = _normed_chunk(x_rows, d_rows, pw_ptr, nw_ptr, 0, ks, K, mmask, rstd_d, rstd, dt,
                      HAS_DELTA, HAS_POST, HAS_NORM, ZERO_CENTERED)  # fmt: skip
    acc = _dot(h, w0, acc, PRECISION)
    if ACT != 0:
        acc_up = _dot(h, w0_up, acc_up, PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):  # the rest of K, in order
        h = _normed_chunk(x_rows, d_rows, pw_ptr, nw_ptr, k0, ks, K, mmask, rstd_d, rstd, dt,
                          HAS_DELTA, HAS_POST, HAS_NORM, ZERO_CENTERED)  # fmt: skip
        wmask = (k0 + ks < K)[:, None] & nmask[None, :]
        w = tl.load(w_cols + (k0 + ks)[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = _dot(h, w, acc, PRECISION)
        if ACT != 0:
            w_up = tl.load(w_cols + NOUT * stride_w + (k0 + ks)[:, None], mask=wmask, other=0.0)
            acc_up = _dot(h, w_up, acc_up, PRECISION)
    out_mask = mmask[:, None] & nmask[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    if ACT == 0:
        tl.store(y_ptrs, round_rne(acc, dt), mask=out_mask)
    else:
        g = round_rne(acc, dt).to(tl.float32)  # the GEMM's output, rounded as F.linear's
        u = round_rne(acc_up, dt).to(tl.float32)
        if ACT == 1:
            a = g / (1.0 + tl.exp(-g))  # torch's silu in fp32
        else:  # torch's tanh GELU, tanh(v) = 1 - 2 / (exp(2v) + 1)
            inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            a = 0.5 * g * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)))
        a = round_rne(a, dt).to(tl.float32)
        tl.store(y_ptrs, round_rne(a * u, dt), mask=out_mask)
    pdl.launch_dependents(PDL)


# ------------------------------------------------------------------------- the op


def norm_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    post_weight: torch.Tensor | None = None,
    zero_centered: bool = False,
    act: str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Norms, projection and gated activation of a few rows (module docstring).

    ``x [M, K]`` (fp16, bf16, fp32; float64 runs the reference), ``weight [N, K]`` of ``x``'s
    dtype (``N`` even with ``act``: ``[gate; up]`` rows), ``norm_weight`` / ``post_weight
    [K]`` or None, ``delta [M, K]`` like ``x`` or None (needs ``norm_weight``; without
    ``post_weight`` the stream is ``x + delta``). Returns ``(stream, out)``: the new stream
    ``[M, K]`` (None without ``delta``) and ``out [M, N]`` (``[M, N / 2]`` with ``act``), new
    contiguous tensors of ``x``'s dtype."""
    stream, h = None, x
    if delta is not None and post_weight is None:
        stream, h = add_rms_norm_reference(x, delta, norm_weight, eps, zero_centered=zero_centered)
    elif delta is not None:
        stream, h = norm_add_rms_norm_reference(
            x, delta, post_weight, norm_weight, eps, zero_centered=zero_centered
        )
    elif norm_weight is not None:
        h = bi_rms_norm_reference(x, norm_weight, eps, zero_centered=zero_centered)
    y = F.linear(h, weight)
    if act is None:
        return stream, y
    return stream, (silu_mul_reference if act == "silu" else gelu_tanh_mul_reference)(y)


def norm_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    post_weight: torch.Tensor | None = None,
    zero_centered: bool = False,
    act: str | None = None,
    config: NormLinearConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Triton launcher of :func:`norm_linear` (arguments checked; no float64); ``config``
    overrides the tile (tests, the sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    nout = n // 2 if act is not None else n
    cfg = config or norm_linear_config(m, n, k, act, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if delta is not None and delta.stride(1) != 1:
        delta = delta.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty((m, nout), dtype=x.dtype, device=x.device)
    stream = torch.empty((m, k), dtype=x.dtype, device=x.device) if delta is not None else None
    if m == 0:
        return stream, y
    d = delta if delta is not None else x
    pdl_mode = pdl.mode(x)
    # one row: a one-row tile on the CUDA cores (any BN); more: a tensor-core tile (>= 16)
    block_m = 1 if m == 1 else max(16, next_pow2(m))
    block_n = cfg.block_n if m == 1 else max(16, cfg.block_n)
    _norm_linear_kernel[(triton.cdiv(nout, block_n),)](
        x, d, post_weight if post_weight is not None else x,
        norm_weight if norm_weight is not None else x, weight,
        stream if stream is not None else y, y,
        m, nout, k, x.stride(0), d.stride(0), weight.stride(0), y.stride(0), float(eps),
        HAS_DELTA=delta is not None, HAS_POST=post_weight is not None,
        HAS_NORM=norm_weight is not None,
        ZERO_CENTERED=bool(zero_centered), ACT=ACTS[act],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=cfg.block_k, PDL=pdl_mode,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(pdl_mode),
    )  # fmt: skip
    return stream, y


def _check_norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    post_weight: torch.Tensor | None = None,
    zero_centered: bool = False,
    act: str | None = None,
) -> bool:
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    check_device("weight", weight, x, "x")
    if act not in ACTS:
        raise ValueError(f"act must be one of {list(ACTS)}, got {act!r}")
    if act is not None and weight.shape[0] % 2:
        raise ValueError(f"weight's rows must be even ([gate; up]) with act, got {weight.shape[0]}")
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(
                f"delta must be like x ({tuple(x.shape)}, {x.dtype}), got "
                f"{tuple(delta.shape)}, {delta.dtype}"
            )
        check_device("delta", delta, x, "x")
        if norm_weight is None:
            raise ValueError("delta needs norm_weight")
    elif post_weight is not None:
        raise ValueError("post_weight is given without delta")
    for name, w in (("norm_weight", norm_weight), ("post_weight", post_weight)):
        if w is None:
            continue
        check_float(name, w)
        if w.shape != (k,):
            raise ValueError(f"{name} must have shape ({k},), got {tuple(w.shape)}")
        check_device(name, w, x, "x")
    tensors = (x, weight, norm_weight, delta, post_weight)
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return False
    return m <= MAX_ROWS and not records_autograd(*tensors)


norm_linear = kernel_op(
    "norm_linear",
    triton=norm_linear_triton,
    reference=norm_linear_reference,
    device_of="x",
    check=_check_norm_linear,
    switch=FUSED_SWITCH,
)
