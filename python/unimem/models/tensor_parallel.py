"""Tensor parallelism inside a model: which slice of every weight a rank holds, and the two
collectives a sharded forward needs.

A model sharded over ``size`` ranks (Megatron-style) keeps, on rank ``r``:

* attention: its share of the K/V heads and the query heads that read them (``q``/``k``/``v``
  rows, ``o`` columns; gpt-oss ``sinks`` by query head);
* Gated DeltaNet: its share of the key heads together with the value heads that read them
  (``H / size`` value heads, ``Hk / size`` key heads; the conv channels and projections of
  its q/k/v slice, its ``A_log``/``dt_bias``, its ``out_proj`` columns);
* dense MLP and routed experts: a slice of the intermediate dim (gate/up rows: column
  parallel; down columns: row parallel) — every expert sliced, the router replicated;
* embedding and LM head: a contiguous slice of the vocabulary (``vocab_part``; the last
  slice zero-padded to the common size).

Row-parallel outputs (attention ``o``, GDN ``out_proj``, MLP ``down``, the embedding
lookup) are partial sums: :meth:`TensorParallel.all_reduce` adds them over the ranks, so the
residual stream is replicated. Logits are gathered (:func:`parallel_logits`): every rank
gets the full ``[N, vocab]`` rows, bit-identical on every rank, so every rank picks the same
token without another exchange and sampling / log-probabilities work unchanged.

The collectives go through a :class:`Communicator` handed in by the engine (a gloo group on
the CPU, NCCL on GPUs: :mod:`unimem.engine.distributed`); the model never creates groups.
``TensorParallel()`` (size 1) is the unsharded model: every helper is then the plain op.

A rank's :class:`~unimem.models.config.HybridConfig` (:func:`local_config`) has its local
head counts and intermediate width, so ``memory_spec`` sizes each rank's arena for its own
heads; ``vocab_size`` and ``d_model`` stay global.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from unimem.models import batch_invariant
from unimem.models.config import HybridConfig

__all__ = [
    "Communicator",
    "SINGLE",
    "Shard",
    "TensorParallel",
    "full_config",
    "local_config",
    "parallel_embedding",
    "parallel_logits",
    "row_parallel_linear",
    "row_parallel_linear_lt",
    "lt_route",
    "LT_ROUTE_SHAPES",
]


class Communicator(Protocol):
    """The model's collectives over the ranks of one tensor-parallel group."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on every rank), in rank order."""
        ...


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` and the :class:`Communicator` of its group (None for size 1).
    ``ValueError`` naming the field for a rank outside ``[0, size)`` or a missing
    communicator."""

    rank: int = 0
    size: int = 1
    comm: Communicator | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TensorParallel.size must be an int >= 1, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel.rank must be in [0, {self.size}), got {self.rank!r}")
        if self.size > 1 and self.comm is None:
            raise ValueError("TensorParallel.comm is needed when size > 1")

    def part(self, n: int, field: str) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` items split evenly; ``ValueError`` naming
        ``field`` unless ``size`` divides ``n``."""
        if n % self.size:
            raise ValueError(f"{field} ({n}) must be divisible by tp_size ({self.size})")
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def vocab_part(self, vocab: int) -> tuple[int, int, int]:
        """``(start, stop, rows)``: this rank's vocabulary ids ``[start, stop)`` and the rows
        of its (zero-padded) embedding / LM-head shard, ``ceil(vocab / size)`` on every
        rank."""
        rows = -(-vocab // self.size)
        start = min(self.rank * rows, vocab)
        return start, min(start + rows, vocab), rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (in place); ``x`` itself for size 1."""
        return x if self.size == 1 else self.comm.all_reduce(x)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        return torch.cat(self.comm.all_gather(x.contiguous()), dim=-1)


SINGLE = TensorParallel()
"""The unsharded model."""


# ---------------------------------------------------------------------- shards of tensors


@dataclass(frozen=True)
class Shard:
    """A rank's part of a full tensor: along ``dim``, the concatenation of the index ranges
    ``ranges`` (``(start, stop)`` pairs), zero-padded to ``rows`` entries when ``rows`` is
    set (the last vocabulary shard)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    rows: int | None = None

    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of ``full`` (a new contiguous tensor)."""
        parts = [full.narrow(self.dim, a, b - a) for a, b in self.ranges if b > a]
        out = torch.cat(parts, dim=self.dim) if parts else full.narrow(self.dim, 0, 0)
        return self._pad(out).contiguous()

    def read(self, sliced) -> torch.Tensor:
        """This shard read from a ``safetensors`` slice (``safe_open(...).get_slice(name)``):
        only the shard's bytes are read."""
        ndim = len(sliced.get_shape())
        parts = []
        for a, b in self.ranges:
            if b > a:
                index = [slice(None)] * ndim
                index[self.dim] = slice(a, b)
                parts.append(sliced[tuple(index)])
        if not parts:
            raise ValueError(f"empty shard {self.ranges} of a tensor of {sliced.get_shape()}")
        return self._pad(torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0])

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        if self.rows is None or t.shape[self.dim] == self.rows:
            return t
        shape = list(t.shape)
        shape[self.dim] = self.rows - t.shape[self.dim]
        return torch.cat([t, t.new_zeros(shape)], dim=self.dim)


def heads(
    tp: TensorParallel, n_heads: int, head_dim: int, field: str, offset: int = 0
) -> tuple[int, int]:
    """Rows ``[start, stop)`` of this rank's heads in a head-major block of ``n_heads`` heads
    of ``head_dim`` starting at ``offset``."""
    a, b = tp.part(n_heads, field)
    return offset + a * head_dim, offset + b * head_dim


def shard(dim: int, *ranges: tuple[int, int]) -> Shard:
    """A :class:`Shard` of ``ranges`` along ``dim``."""
    return Shard(dim, tuple(ranges))


def vocab_shard(tp: TensorParallel, vocab: int, dim: int = 0) -> Shard:
    """This rank's vocabulary rows along ``dim``, zero-padded to the common shard size."""
    start, stop, rows = tp.vocab_part(vocab)
    return Shard(dim, ((start, stop),), rows)


def gdn_qkv_ranges(tp: TensorParallel, c: HybridConfig, offset: int = 0) -> tuple:
    """This rank's channels of a ``[q | k | v]`` GDN block (key heads, then value heads,
    head-major) of a *global* config ``c`` starting at ``offset``."""
    hk, h, dk, dv = c.gdn_key_heads, c.gdn_heads, c.gdn_head_dim_k, c.gdn_head_dim_v
    key = hk * dk
    return (
        heads(tp, hk, dk, "gdn key heads", offset),
        heads(tp, hk, dk, "gdn key heads", offset + key),
        heads(tp, h, dv, "gdn value heads", offset + 2 * key),
    )


# ---------------------------------------------------------------------- configs


def local_config(config: HybridConfig, tp: TensorParallel) -> HybridConfig:
    """The :class:`HybridConfig` of rank ``tp.rank``: query / KV / GDN head counts and
    ``ffn_dim`` divided by ``tp.size`` (``ValueError`` naming the field unless it divides
    them); everything else as in ``config``."""
    if tp.size == 1:
        return config

    def div(name: str, value: int) -> int:
        if value % tp.size:
            raise ValueError(
                f"HybridConfig.{name} ({value}) must be divisible by tp_size ({tp.size})"
            )
        return value // tp.size

    changes = {
        "n_q_heads": div("n_q_heads", config.n_q_heads),
        "n_kv_heads": div("n_kv_heads", config.n_kv_heads),
        "ffn_dim": div("ffn_dim", config.ffn_dim),
    }
    if "gdn" in config.layer_pattern:
        changes["gdn_heads"] = div("gdn_heads", config.gdn_heads)
        changes["gdn_k_heads"] = div("gdn_k_heads", config.gdn_key_heads)
    return dataclasses.replace(config, **changes)


def full_config(local: HybridConfig, tp: TensorParallel) -> HybridConfig:
    """The unsharded config a rank's :func:`local_config` came from (what a replicated
    drafter is sized by)."""
    if tp.size == 1:
        return local
    s = tp.size
    changes = {
        "n_q_heads": local.n_q_heads * s,
        "n_kv_heads": local.n_kv_heads * s,
        "ffn_dim": local.ffn_dim * s,
    }
    if "gdn" in local.layer_pattern:
        changes["gdn_heads"] = local.gdn_heads * s
        changes["gdn_k_heads"] = local.gdn_key_heads * s
    return dataclasses.replace(local, **changes)


# ---------------------------------------------------------------------- sharded ops


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel
) -> torch.Tensor:
    """``x W^T (+ b)`` of a row-parallel projection: each rank multiplies its input slice by
    its weight columns, the partial sums are all-reduced, and the bias (replicated) is added
    once, after the sum. Size 1: ``F.linear(x, W, b)``."""
    if tp.size == 1:
        return F.linear(x, weight, bias)
    y = tp.all_reduce(F.linear(x, weight))
    return y if bias is None else y + bias


LT_ROUTE_SHAPES = frozenset({(5632, 2048), (4096, 2048)})
"""``(K, N)`` of the projections that run through cuBLASLt's bias epilogue (chosen by
measurement, ``docs/decisions.md``): the ``small`` preset's MLP down projection (5632 ->
2048) and the Qwen3-Next GDN ``out_proj`` / attention ``o_proj`` (4096 -> 2048, the
80B-A3B's own shapes)."""


def lt_route(weight: torch.Tensor) -> bool:
    """Whether :func:`row_parallel_linear_lt` runs products by ``weight [N, K]`` (the rank's
    shard) through cuBLASLt's bias epilogue: one of :data:`LT_ROUTE_SHAPES`.

    The choice depends on the weight's shape only, never on the row count: the two libraries
    round differently from each other, and a route chosen by rows would make verify steps
    round differently from decode steps, so speculative outputs would drift from plain ones."""
    return (int(weight.shape[1]), int(weight.shape[0])) in LT_ROUTE_SHAPES


def row_parallel_linear_lt(
    x: torch.Tensor, weight: torch.Tensor, zero_bias: torch.Tensor, tp: TensorParallel
) -> torch.Tensor:
    """``row_parallel_linear(x, weight, None, tp)``, through cuBLASLt where :func:`lt_route`
    says so (by the weight's shape): each rank's product is then ``F.linear(x, W,
    zero_bias)`` (``zero_bias``: zeros ``[N]`` in the weight's dtype, on its device), a
    bf16/fp16 ``addmm`` with a 1-D bias, which torch runs through cuBLASLt's bias epilogue
    whatever BLAS library is preferred; otherwise ``F.linear(x, W)``. Adding +0.0 to the float32
    accumulator changes no value (a -0.0 result becomes +0.0), so the output equals the plain
    product's up to the GEMM algorithm's own rounding. On the CPU, and under batch invariance
    (whose ``addmm`` override adds the bias in its own GEMM's epilogue), the values are the
    plain product's. No device value is read."""
    y = F.linear(x, weight, zero_bias) if lt_route(weight) else F.linear(x, weight)
    return y if tp.size == 1 else tp.all_reduce(y)


def parallel_embedding(
    ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, vocab: int
) -> torch.Tensor:
    """Rows of a vocabulary-parallel embedding: each rank looks up the ids of its slice (zero
    rows for the others) and the rows are all-reduced (one non-zero term each: exact).
    Size 1: ``weight[ids]``."""
    if tp.size == 1:
        return weight[ids]
    start, _, rows = tp.vocab_part(vocab)
    local = ids - start
    inside = (local >= 0) & (local < rows)
    x = weight[local.clamp(0, rows - 1)]
    x = torch.where(inside[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    return tp.all_reduce(x)


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=) (CUDA)


def logits_matmul(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``hidden @ weight.T`` as ``dtype`` logits (``hidden [N, d]``, ``weight [V, d]``). A
    bf16 / fp16 LM head on CUDA with float32 logits writes float32 from the GEMM itself
    (``torch.mm(..., out_dtype=float32)``: the accumulator is not rounded to the model dtype
    first, and no separate cast pass over ``[N, V]`` runs); otherwise — and in
    batch-invariant mode, whose GEMM override covers ``aten::mm`` without an output dtype —
    the product in the model dtype, then cast."""
    if (
        _MM_OUT_DTYPE
        and hidden.is_cuda
        and dtype == torch.float32
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == hidden.dtype
        and hidden.dim() == 2
        and not batch_invariant.covers(hidden)
    ):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden, weight).to(dtype)


def parallel_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tp: TensorParallel,
    vocab: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[N, vocab]`` logits in ``dtype`` from a vocabulary-parallel LM head
    (:func:`logits_matmul`): each rank's slice, gathered along the vocabulary (padding cut
    off). Every rank gets the same bits."""
    logits = logits_matmul(hidden, weight, dtype)
    if tp.size == 1:
        return logits
    return tp.gather_last(logits)[:, :vocab]
