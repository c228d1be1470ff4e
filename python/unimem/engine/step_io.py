"""What a decode or verify step reads and writes besides the pool: capture-stable buffers.

A step of the GPU path reads nothing from the host but the batch's lanes, and the host reads
its results one step late. Four small owners make that explicit:

- :class:`DeviceRequestState`: per request-table row, the request's committed length and its
  next input token (the pending token of a decode, the anchor of a verify), **on the device**.
  Every step reads them and writes the advanced values back, so consecutive steps chain on
  the device without the host knowing accepted lengths. Row 0 (the pool's padding row) is
  never advanced: it stays length 0, token 0.
- :class:`DeviceSamplingState`: per request-table row, the request's sampling parameters
  (temperature, top-k, top-p, min-p, seed), written by every extend of the request from
  host-known values (one non-blocking copy); decode steps gather them by row. Row 0 stays
  greedy.
- :class:`StepLanes`: the batch's per-lane inputs ``rows``, ``vslots`` (virtual state slots)
  and ``rids`` (acceptance-control keys) in one ``[3, max_bs]`` int32 buffer, filled by one
  non-blocking copy from pinned memory. Lanes past the batch (padding up to a captured batch
  size) point at row 0, slot -1, rid -1: they read the sink, skip every state slot and write
  nothing anyone reads.
- :class:`StepOutputs`: ``tokens [max_bs, width]`` int64 and ``counts [max_bs]`` int32 that a
  step writes (lane ``b`` committed ``tokens[b, :counts[b]]``), and ``verify_lens [max_bs]``
  int32, the rows each lane verified (written by ragged verify steps; ``width`` otherwise).
- :class:`ResultRing`: pinned host copies of a step's outputs, taken by non-blocking copies
  and an event; the host reads them after it has launched the next step.

All buffers are allocated once; their addresses never change, so a CUDA graph records them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from unimem.models.sampler import SORTED, SamplingRows
from unimem_kernel.lane_commit import commit_lanes

__all__ = [
    "DeviceRequestState",
    "DeviceSamplingState",
    "ResultRing",
    "SamplingRows",
    "StagedResult",
    "StagedTopLogprobs",
    "stage_to_host",
    "StepLanes",
    "StepOutputs",
]


class DeviceRequestState:
    """Per request-table row: ``seq_lens [R]`` int32 (tokens in memory) and
    ``next_tokens [R]`` int64 (the token the next decode/verify step feeds). Device-owned:
    only steps write them (an extend sets them from host-known values or its sample)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.next_tokens = torch.zeros(rows, dtype=torch.int64, device=device)

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq_lens, next_tokens)`` of ``rows [bs]`` (int32 or int64; two gathers, no
        host read)."""
        return self.seq_lens.index_select(0, rows), self.next_tokens.index_select(0, rows)

    def write(self, rows: torch.Tensor, seq_lens: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Set the state of ``rows [bs]``; lanes on row 0 (padding) write row 0's own zeros,
        so duplicates of row 0 all agree and row 0 never changes."""
        idx = rows.long()
        live = rows > 0
        self.seq_lens[idx] = torch.where(live, seq_lens.to(torch.int32), 0)
        self.next_tokens[idx] = torch.where(live, next_tokens.long(), 0)

    def commit(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        next_tokens: torch.Tensor,
        tokens: torch.Tensor,
        out: StepOutputs,
        accepted: torch.Tensor | None = None,
        write_slots: Sequence[torch.Tensor] = (),
    ) -> list[torch.Tensor]:
        """A decode or verify step's lanes in one launch (:func:`unimem_kernel.commit_lanes`):
        lane ``b`` commits ``tokens[b, :count]`` (``count`` = 1, or ``accepted[b] + 1`` for a
        verify step) into ``out``, and its row advances to ``seq_lens[b] + count`` with
        ``next_tokens[b]`` next (padding lanes on row 0 write row 0's zeros). ``seq_lens``
        int32, ``next_tokens`` int64, ``tokens [bs, W]`` int64, ``accepted`` int32. Returns
        ``write_slots`` (``[bs * W]`` each) with the rows past each lane's committed prefix
        sent to the sink slot 0."""
        return commit_lanes(
            rows, seq_lens, next_tokens, tokens, self.seq_lens, self.next_tokens,
            out.tokens, out.counts, accepted, write_slots,
        )  # fmt: skip


class DeviceSamplingState:
    """Per request-table row, the sampling parameters of the request on that row:
    ``floats [3, R]`` float32 (temperature, top-p, min-p) and ``ints [2, R]`` int64 (top-k,
    seed). Allocated once (capture-stable); rows start greedy (temperature 0, top-p 1, top-k
    off, min-p 0, seed 0) and row 0 (padding) is never written."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self.floats = torch.zeros(3, rows, dtype=torch.float32, device=device)
        self.floats[1].fill_(1.0)
        self.ints = torch.zeros(2, rows, dtype=torch.int64, device=device)

    @staticmethod
    def pack(params: Sequence[tuple[float, int, float, float, int]]) -> tuple[Tensor, Tensor]:
        """Host tensors ``(floats [3, bs], ints [2, bs])`` of ``(temperature, top_k, top_p,
        min_p, seed)`` per lane."""
        floats = np.array([[p[0], p[2], p[3]] for p in params], dtype=np.float32).T
        ints = np.array([[p[1], p[4]] for p in params], dtype=np.int64).T
        return (
            torch.from_numpy(np.ascontiguousarray(floats.reshape(3, len(params)))),
            torch.from_numpy(np.ascontiguousarray(ints.reshape(2, len(params)))),
        )

    def upload(
        self, params: Sequence[tuple[float, int, float, float, int]]
    ) -> tuple[Tensor, Tensor]:
        """Device copies of :meth:`pack` (non-blocking from pinned memory on CUDA)."""
        floats, ints = self.pack(params)
        if self.device.type != "cuda":
            return floats.to(self.device), ints.to(self.device)
        return (
            floats.pin_memory().to(self.device, non_blocking=True),
            ints.pin_memory().to(self.device, non_blocking=True),
        )

    def write(self, rows: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """Set the parameters of ``rows [bs]`` (distinct, non-zero) from uploaded
        ``floats [3, bs]`` / ``ints [2, bs]``."""
        idx = rows.long()
        self.floats[:, idx] = floats
        self.ints[:, idx] = ints

    @staticmethod
    def lanes(floats: torch.Tensor, ints: torch.Tensor, rule: str = SORTED) -> SamplingRows:
        """:class:`SamplingRows` view of ``floats [3, bs]`` / ``ints [2, bs]`` (with the
        host's cut-off ``rule`` promise)."""
        return SamplingRows(floats[0], ints[0].int(), floats[1], floats[2], ints[1], rule)

    def read(self, rows: torch.Tensor, rule: str = SORTED) -> SamplingRows:
        """The parameters of ``rows [bs]`` (gathers; no host read)."""
        idx = rows.long()
        return self.lanes(self.floats[:, idx], self.ints[:, idx], rule)


class StepLanes:
    """Capture-stable per-lane inputs of a step (module docstring)."""

    PAD = (0, -1, -1)
    """``(row, vslot, rid)`` of a padded lane."""
    _PAD_COLUMN = np.array(PAD, dtype=np.int32)[:, None]

    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.max_bs = max_bs
        self.device = device
        self.buffer = torch.zeros(3, max_bs, dtype=torch.int32, device=device)
        self.pad(max_bs)

    def rows(self, bs: int) -> torch.Tensor:
        return self.buffer[0, :bs]

    def vslots(self, bs: int) -> torch.Tensor:
        return self.buffer[1, :bs]

    def rids(self, bs: int) -> torch.Tensor:
        return self.buffer[2, :bs]

    def stage(
        self, rows: Sequence[int], vslots: Sequence[int], rids: Sequence[int], width: int
    ) -> None:
        """Write the batch's lanes, padded to ``width`` lanes, with one copy from pinned
        memory that does not block the host (stream-ordered after the previous step)."""
        bs = len(rows)
        if not bs <= width <= self.max_bs:
            raise ValueError(f"{bs} lanes padded to {width} (max_bs {self.max_bs})")
        host = np.empty((3, width), dtype=np.int32)
        host[:, :bs] = (rows, vslots, rids)
        host[:, bs:] = self._PAD_COLUMN
        src = torch.from_numpy(host)
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.buffer[:, :width].copy_(src, non_blocking=True)

    def pad(self, width: int) -> None:
        """Every lane below ``width`` padded (before a warm-up run or a capture)."""
        for i, value in enumerate(self.PAD):
            self.buffer[i, :width].fill_(value)


@dataclass(frozen=True)
class StepOutputs:
    """Device results of the last step: lane ``b`` committed ``tokens[b, :counts[b]]``;
    ``logprobs[b, j]`` is the log-probability the target gave ``tokens[b, j]`` (written only
    by a runner built with ``logprobs=True``); ``verify_lens[b]`` the rows lane ``b``
    verified (a ragged verify step writes it; it stays ``width`` otherwise)."""

    tokens: torch.Tensor  # [max_bs, width] int64
    counts: torch.Tensor  # [max_bs] int32
    logprobs: torch.Tensor  # [max_bs, width] float32
    verify_lens: torch.Tensor | None = None  # [max_bs] int32

    @classmethod
    def allocate(cls, max_bs: int, width: int, device: torch.device) -> StepOutputs:
        return cls(
            torch.zeros(max_bs, width, dtype=torch.int64, device=device),
            torch.zeros(max_bs, dtype=torch.int32, device=device),
            torch.zeros(max_bs, width, dtype=torch.float32, device=device),
            torch.full((max_bs,), width, dtype=torch.int32, device=device),
        )


@dataclass
class StagedResult:
    """Host copies of one step's outputs for ``bs`` lanes, valid once ``event`` completed
    (None: already valid, a CPU run). ``logprobs`` is None unless the ring copies them;
    ``verify_lens`` (the rows each lane verified) once :meth:`read` returned."""

    tokens: torch.Tensor
    counts: torch.Tensor
    logprobs: torch.Tensor | None
    event: torch.cuda.Event | None
    verify_lens: torch.Tensor | None = None

    def read(self) -> tuple[list[list[int]], list[int], list[list[float]] | None]:
        """``(tokens per lane, counts, logprobs per lane or None)`` — waits for the step if
        it is still running."""
        if self.event is not None:
            self.event.synchronize()
        logprobs = self.logprobs.tolist() if self.logprobs is not None else None
        return self.tokens.tolist(), self.counts.tolist(), logprobs


def stage_to_host(
    *tensors: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """Host copies of device ``tensors``, stream-ordered after the work that writes them:
    on CUDA, fresh pinned buffers filled without blocking and the event recorded behind the
    copies (wait on it before reading); elsewhere the tensors themselves and None. For the
    step results that only some steps produce (the ring's fixed sets hold the others)."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    hosts = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for host, t in zip(hosts, tensors, strict=True):
        host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return hosts, event


@dataclass
class StagedTopLogprobs:
    """Host copies of one eager step's top log-probabilities (``values [bs, rows, k]``
    float32, ``ids [bs, rows, k]`` int64: lane ``b``'s row ``j`` is its output token ``j``'s
    distribution), valid once ``event`` completed (None: a CPU run)."""

    values: torch.Tensor
    ids: torch.Tensor
    event: torch.cuda.Event | None

    @classmethod
    def stage(cls, values: torch.Tensor, ids: torch.Tensor, bs: int) -> StagedTopLogprobs:
        """Copy lanes ``:bs`` to pinned host memory without blocking, stream-ordered after
        the step, with an event behind the copies."""
        (host_v, host_i), event = stage_to_host(values[:bs], ids[:bs])
        return cls(host_v, host_i, event)

    def read(self) -> list[list[list[tuple[int, float]]]]:
        """Per lane, per row, the ``(token id, log-probability)`` pairs, most likely first;
        waits for the copies."""
        if self.event is not None:
            self.event.synchronize()
        return [
            [list(zip(ids, vals, strict=True)) for ids, vals in zip(lane_i, lane_v, strict=True)]
            for lane_i, lane_v in zip(self.ids.tolist(), self.values.tolist(), strict=True)
        ]


class ResultRing:
    """``depth`` sets of pinned host buffers that step outputs are copied into without
    blocking; set ``k % depth`` holds step ``k``. With results read one step late, a set is
    reused two steps after it was filled, when it has been read: ``depth = 2``. With
    ``logprobs``, the outputs' log-probabilities are copied too."""

    def __init__(
        self,
        max_bs: int,
        width: int,
        device: torch.device,
        depth: int = 2,
        *,
        logprobs: bool = False,
    ) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.logprobs = logprobs
        # per set: tokens, counts and the event recorded behind the copies into them (reused:
        # a set is refilled only after it was read, i.e. after its last record completed)
        self._sets = [
            (
                torch.zeros(max_bs, width, dtype=torch.int64, pin_memory=pin),
                torch.zeros(max_bs, dtype=torch.int32, pin_memory=pin),
                torch.zeros(max_bs, width, dtype=torch.float32, pin_memory=pin),
                torch.cuda.Event() if pin else None,
                torch.zeros(max_bs, dtype=torch.int32, pin_memory=pin),
            )
            for _ in range(depth)
        ]
        self._next = 0

    def stage(self, out: StepOutputs, bs: int) -> StagedResult:
        """Copy lanes ``:bs`` of ``out`` to the next host set (stream-ordered after the
        step) and record an event behind the copies."""
        tokens, counts, logprobs, event, lens = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        width = out.tokens.shape[1]
        tokens[:bs, :width].copy_(out.tokens[:bs], non_blocking=True)
        counts[:bs].copy_(out.counts[:bs], non_blocking=True)
        staged_lens = None
        if out.verify_lens is not None:
            lens[:bs].copy_(out.verify_lens[:bs], non_blocking=True)
            staged_lens = lens[:bs]
        staged_logprobs = None
        if self.logprobs:
            logprobs[:bs, :width].copy_(out.logprobs[:bs], non_blocking=True)
            staged_logprobs = logprobs[:bs, :width]
        if event is not None:
            event.record()
        return StagedResult(tokens[:bs, :width], counts[:bs], staged_logprobs, event, staged_lens)
