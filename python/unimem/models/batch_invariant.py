"""Batch-invariant execution (``--enable-deterministic-inference``): a request's numbers do not
depend on which other requests share its step, on the batch bucket, or on the step kind.

Why it is needed. On the GPU the vendor GEMM picks its algorithm (tile shape, split-K) from the
problem size, so row ``i`` of ``x @ W.T`` rounds differently when ``x`` has 1, 48 or 384 rows;
torch's row reductions split a long row across blocks when there are few rows; the GDN
recurrence's Triton tiles differ between extend and decode/verify. In bf16 those differences
flip greedy near-ties, so outputs then depend on the batch: static != unified as soon as memory
pressure changes the batches, speculative != non-speculative because verify runs ``gamma + 1``
rows per request where decode runs one.

What the mode does (process-wide, one switch):

- every ``aten::mm`` and ``aten::addmm`` on the selected device types (CUDA by default) runs
  :func:`unimem_kernel.bi_matmul`: one fixed tile configuration chosen without looking at the
  number of rows, no split-K, the reduction over K always in the same order. This catches
  ``F.linear`` and ``@`` everywhere (target, drafter, LM head, tensor-parallel shards) without
  touching the model code;
- :func:`rms_normalize` (the RMS norms of :mod:`unimem.models.nn_ops` and
  :mod:`unimem.models.qwen_common` and Gemma's) reduces each row in one program
  (:func:`unimem_kernel.bi_rms_norm`);
- the routed experts (:func:`unimem.models.moe.expert_mlp`) multiply through
  :func:`unimem_kernel.bi_grouped_linear`, whose rows do not depend on how many rows the
  other experts got, and sum the top-k slots in a fixed order;
- the GDN recurrence uses one tile configuration for extend, decode and verify
  (:func:`gdn_batch_invariant` tells the runner);
- FA4 runs with a fixed ``pack_gqa`` and ``num_splits = 1`` (the engine builds the backend).

On the CPU nothing changes unless a test asks for the CPU key: float64 runs are exact already.
What it costs is in ``docs/results.md``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch

from unimem_kernel import envs

__all__ = [
    "covers",
    "disable",
    "enable",
    "enabled",
    "gdn_batch_invariant",
    "overridden_device_types",
    "rms_normalize",
    "use_batch_invariant",
]

_lock = threading.Lock()
_library: torch.library.Library | None = None
_device_types: tuple[str, ...] = ()


def enabled() -> bool:
    """Whether batch-invariant execution is on in this process."""
    return _library is not None


def overridden_device_types() -> tuple[str, ...]:
    """The dispatch keys whose ``mm`` / ``addmm`` are replaced (empty when off)."""
    return _device_types


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from unimem_kernel import bi_matmul

    if a.dtype not in _KERNEL_DTYPES:
        # float64 / integer products: torch's batched kernel (not overridden, so no recursion
        # through the override; float64 is exact enough not to need invariance)
        return torch.bmm(a[None], b[None])[0]
    return bi_matmul(a, b)


def _addmm(
    bias: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> torch.Tensor:
    from unimem_kernel import bi_matmul

    if a.dtype not in _KERNEL_DTYPES:
        return torch.baddbmm(bias[None] if bias.dim() < 3 else bias, a[None], b[None],
                             beta=beta, alpha=alpha)[0]  # fmt: skip
    n = b.shape[1]
    row_bias = bias.dim() == 1 or (bias.dim() == 2 and bias.shape[0] == 1)
    if beta == 1 and alpha == 1 and row_bias and bias.shape[-1] == n:
        return bi_matmul(a, b, bias.reshape(n))
    out = bi_matmul(a, b)
    if alpha != 1:
        out = out * alpha
    return out + bias * beta if beta != 0 else out


def enable(device_types: Sequence[str] = ("CUDA",)) -> None:
    """Turn batch-invariant execution on for ``device_types`` (dispatch keys: ``"CUDA"``;
    tests may add ``"CPU"`` with the Triton interpreter). Idempotent for the same keys;
    switching keys needs :func:`disable` first (``ValueError`` otherwise)."""
    global _library, _device_types
    keys = tuple(device_types)
    if not keys or any(k not in ("CUDA", "CPU") for k in keys):
        raise ValueError(f"device_types must be a non-empty subset of CUDA, CPU, got {keys!r}")
    if envs.get("UNIMEM_FUSED_OPS") == "off":
        # the fused residual-add + norm kernels are the models' row-local norms; their
        # references (what the switch selects) reduce with torch, which is not batch-invariant
        raise ValueError(
            "deterministic inference needs the fused row ops: unset UNIMEM_FUSED_OPS=off"
        )
    with _lock:
        if _library is not None:
            if set(keys) != set(_device_types):
                raise ValueError(
                    f"batch-invariant mode is already on for {_device_types}; disable() first"
                )
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns that a built-in kernel is replaced
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for key in keys:
                lib.impl("mm", _mm, key)
                lib.impl("addmm", _addmm, key)
        _library, _device_types = lib, keys


def disable() -> None:
    """Restore the vendor ``mm`` / ``addmm`` and the default kernel choices."""
    global _library, _device_types
    with _lock:
        if _library is not None:
            _library._destroy()
        _library, _device_types = None, ()


@contextlib.contextmanager
def use_batch_invariant(device_types: Sequence[str] = ("CUDA",)) -> Iterator[None]:
    """:func:`enable` for the block, then back to the previous state."""
    was = _device_types
    if was and set(was) != set(device_types):
        raise ValueError(f"batch-invariant mode is already on for {was}")
    enable(device_types)
    try:
        yield
    finally:
        if not was:
            disable()


def covers(t: torch.Tensor) -> bool:
    """Whether batch-invariant execution applies to tensors on ``t``'s device."""
    return enabled() and t.device.type.upper() in _device_types


_ones: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x ** 2) + eps)`` over the last dim, in ``x``'s dtype (the callers
    pass float32 or float64). In batch-invariant mode each row is reduced by one program
    (:func:`unimem_kernel.bi_rms_norm` with a unit weight: multiplying by 1.0 is exact);
    otherwise torch's reduction."""
    if covers(x) and x.dtype == torch.float32:
        from unimem_kernel import bi_rms_norm

        d = x.shape[-1]
        key = (d, x.device, x.dtype)
        ones = _ones.get(key)
        if ones is None:  # created once per shape, outside any graph capture's hot path
            ones = _ones[key] = torch.ones(d, device=x.device, dtype=x.dtype)
        return bi_rms_norm(x, ones, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def gdn_batch_invariant(t: torch.Tensor) -> bool:
    """Whether the GDN kernels on ``t``'s device must use one tile configuration for every
    step kind (extend, decode, verify)."""
    return covers(t)
