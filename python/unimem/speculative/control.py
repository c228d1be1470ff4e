"""Acceptance control: make accept lengths reproducible in tests and benchmarks.

A seeded drafter with random weights almost never agrees with the target, so every verify
step would commit one token. The control replaces each drafted token by the *reference*
continuation (the output of a non-speculative greedy run of the same request) with
probability ``rate``. When the speculative output equals the reference — which is what
validation checks — a replaced token is always accepted, so with a drafter that never agrees
by itself the accepted prefix is geometric and the mean committed tokens per step is
``1 + sum_{k=1..gamma} rate^k`` (``rate = 0.8``, ``gamma = 7``: 4.16). Chance agreement of
the drafter can only raise it.

The decision for the token at absolute position ``pos`` of request ``rid`` is a pure function
of ``(seed, rid, pos)``: a 32-bit integer hash turned into a uniform draw ``u`` and compared
with ``rate``. It does not depend on the batch, the step or the memory mode, so static and
unified runs propose the same tokens. Positions the reference does not cover are left as
drafted.

Device-friendly: the reference tokens and the decisions live in device tables indexed by
``rid`` and position (uploaded once), and a step's decisions are one gather with no host read
(:meth:`AcceptanceControl.decide_window`: one launch on CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from unimem_kernel.window_lookup import window_lookup

__all__ = ["AcceptanceControl", "uniform_draws"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: products of 32-bit values stay below 2**63 in int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of int64 values in ``[0, 2**32)``."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def uniform_draws(seed: int, rids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform draws in ``[0, 1)`` (float64), one per element of the broadcast of ``rids``
    and ``positions``; a pure function of ``(seed, rid, position)``, identical on every
    device."""
    x = torch.full_like(positions, seed & _M32, dtype=torch.int64)
    x = _mix(x)
    x = _mix(x ^ (rids.long() & _M32))
    x = _mix(x ^ (positions.long() & _M32))
    return x.double() / float(1 << 32)


class AcceptanceControl:
    """Replace drafted tokens by the reference continuation with probability ``rate``.

    ``references[rid]`` is request ``rid``'s reference token sequence by absolute position
    (prompt followed by the non-speculative output); rids are small non-negative ints.
    ``rate`` in ``[0, 1]``: 0 never replaces (the raw drafter), 1 always does where the
    reference is known.
    """

    def __init__(
        self,
        rate: float,
        seed: int,
        references: Mapping[int, Sequence[int]],
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"AcceptanceControl.rate must be in [0, 1], got {rate!r}")
        if any(not isinstance(r, int) or r < 0 for r in references):
            raise ValueError("AcceptanceControl.references: rids must be non-negative ints")
        self.rate = float(rate)
        self.seed = int(seed)
        rows = max(references, default=-1) + 1
        width = max((len(t) for t in references.values()), default=0) + 1
        table = torch.full((max(rows, 1), width), -1, dtype=torch.int64)
        for rid, toks in references.items():
            table[rid, : len(toks)] = torch.tensor(list(toks), dtype=torch.int64)
        self.table = table.to(device)
        """``[rids, width]`` int64: reference token at each position, -1 where unknown (the
        last column is always -1, so clamped out-of-range positions read "unknown")."""
        r = torch.arange(table.shape[0])[:, None]
        p = torch.arange(width)[None, :]
        self.take_table = ((uniform_draws(self.seed, r, p) < self.rate) & (table >= 0)).to(device)
        """``[rids, width]`` bool: the decision at each position, drawn once here (a gather per
        step instead of the hash's ~20 integer kernels per drafted column in the graph)."""

    def _index(self, rids: torch.Tensor, positions: torch.Tensor):
        """Table indices of ``(rids, positions)`` (broadcast): out-of-range pairs go to row 0's
        last column, which is always unknown."""
        rows, width = self.table.shape
        r = rids.long()
        p = positions.long()
        ok = (r >= 0) & (r < rows) & (p >= 0) & (p < width)
        return torch.where(ok, r, 0), torch.where(ok, p, width - 1)

    def reference(self, rids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Reference tokens (int64, -1 where unknown) at ``positions`` of requests ``rids``
        (broadcast)."""
        return self.table[self._index(rids, positions)]

    def apply(
        self, tokens: torch.Tensor, rids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``tokens`` (drafted for ``positions`` of requests ``rids``, broadcast) with each
        replaced by the reference token where ``u(seed, rid, pos) < rate`` and the reference
        is known. Returns a new int64 tensor."""
        ref, take = self.decide(rids, positions)
        return torch.where(take, ref, tokens.long())

    def decide(
        self, rids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reference tokens (int64, -1 where unknown), take (bool))`` at ``positions`` of
        requests ``rids`` (broadcast): the token drafted there is replaced by the reference
        where ``take``. A pure function of ``(seed, rid, pos)`` — independent of a request's
        sampling seed, so speculative sampling treats a replaced draft as proposed by a point
        mass (:func:`unimem.speculative.spec_sampling.replace_proposal`)."""
        idx = self._index(rids, positions)
        return self.table[idx], self.take_table[idx]

    def decide_window(
        self, rids: torch.Tensor, starts: torch.Tensor, width: int, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decide` at positions ``starts[b] + offset + i`` (``i < width``) of request
        ``rids[b]`` (``rids``, ``starts`` ``[bs]`` int), as ``[bs, width]`` tensors: the same
        values as ``decide(rids[:, None], starts[:, None] + offset + arange(width))``, in one
        launch on CUDA (:func:`unimem_kernel.window_lookup`)."""
        ref, take = window_lookup((self.table, self.take_table), rids, starts, width, offset)
        return ref, take
