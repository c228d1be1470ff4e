"""The interface the engine uses to hold KV pages and state slots, whatever backs them.

Two implementations: :class:`~unimem.memory.unified.UnifiedMemory` (one arena, virtual ids,
compaction) and :class:`~unimem.memory.static.StaticMemory` (the baseline: separate pools with
a split fixed at start-up, page ids used as they are). Both run the same model code.

Contract (what may be called when, what is always safe):

- Every method is host-driven and sync-free: the host decides how many units each request
  gets from lengths it already knows; device ops are launched in stream order and nothing is
  read back. Running out of memory is a *value* (``admit`` returns None, ``grow`` returns
  False) and leaves the pool exactly as it was: the scheduler then evicts or retracts.
- ``req_to_token[row, pos]`` holds the *virtual* token id of position ``pos`` of the request
  at ``row``: ``vpage * page_size + offset``. Row 0, virtual page 0 and virtual state slot 0
  are never handed out: padded batch lanes point at them and resolve to the zero sink.
- ``full_v2p``/``swa_v2p``/``state_v2p`` are the device tables readers translate through
  (``None`` for ``full_v2p``/``state_v2p`` means ids are physical: the static baseline).
  They are allocated once: their addresses never change.
- Units are zeroed when handed out (FULL/SWA pages and state slots), so a fresh request's
  recurrent state is zero and no stale NaN can leak into a tile load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unimem.memory.host_ids import HostIdPool
from unimem.memory.layout import MemoryLayout
from unimem.memory.spec import LayerKind, MemorySpec

POISON_BYTE = 0xFF
"""Byte that makes every float format NaN; free units hold it in poison mode."""


@dataclass
class RequestMemory:
    """What one request holds, as the host knows it (no device reads needed).

    ``pages``: virtual FULL page ids by page column; ``swa_start``: columns below it have had
    their SWA pages retired; ``state_slot``: virtual state slot (-1 when no STATE layers).
    """

    row: int
    state_slot: int
    pages: list[int] = field(default_factory=list)
    swa_start: int = 0

    def capacity_tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size


@dataclass
class MemoryStats:
    """Counters every pool keeps (host-side)."""

    used_bytes: int = 0
    peak_bytes: int = 0
    capacity_bytes: int = 0
    compactions: int = 0
    moved_units: int = 0
    retired_swa_pages: int = 0


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class MemoryPool(ABC):
    """KV pages, SWA pages and state slots of one model, plus its request table."""

    def __init__(
        self, spec: MemorySpec, max_requests: int, max_context: int, device: torch.device
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.spec = spec
        self.layout = MemoryLayout.build(spec)
        self.page_size = spec.page_size
        self.device = torch.device(device)
        self.max_context = max_context
        self.max_pages_per_request = pages_for(max_context, spec.page_size)
        width = self.max_pages_per_request * spec.page_size
        # Row 0 is the padding row: all zeros, never handed out.
        self.req_to_token = torch.zeros(
            (max_requests + 1, width), dtype=torch.int32, device=self.device
        )
        self._rows = HostIdPool(1, max_requests)
        self.stats = MemoryStats()
        self.swa_window = spec.max_window
        self._has_state = spec.has(LayerKind.STATE)

    # --- tables readers translate through ------------------------------------------------------

    full_v2p: torch.Tensor | None
    swa_v2p: torch.Tensor | None
    state_v2p: torch.Tensor | None

    # --- request lifecycle ---------------------------------------------------------------------

    def admit(self, num_tokens: int) -> RequestMemory | None:
        """A request row, a state slot and pages for ``num_tokens`` tokens; None if they do
        not fit (nothing changes then)."""
        self._check_tokens(num_tokens)
        if self._rows.free == 0:
            return None
        req = RequestMemory(row=self._rows.take(1)[0], state_slot=-1)
        n = pages_for(num_tokens, self.page_size)
        if not self._alloc([(req, n)] if n else [], [req] if self._has_state else []):
            self._rows.give([req.row])
            return None
        self._update_usage()
        return req

    def grow(self, batch: Sequence[tuple[RequestMemory, int]]) -> bool:
        """Give every request pages for its target token count; all or nothing."""
        todo = []
        for req, tokens in batch:
            self._check_tokens(tokens)
            n = pages_for(tokens, self.page_size) - len(req.pages)
            if n > 0:
                todo.append((req, n))
        if not todo:
            return True
        if not self._alloc(todo, []):
            return False
        self._update_usage()
        return True

    def _check_tokens(self, tokens: int) -> None:
        if tokens > self.max_context:
            raise ValueError(f"{tokens} tokens exceed max_context {self.max_context}")

    def retire_swa(self, batch: Sequence[tuple[RequestMemory, int]]) -> int:
        """Release SWA pages wholly behind the window of each request.

        ``batch`` pairs a request with the position of its next query (its committed length):
        tokens at positions ``<= pos - window`` are never attended again, so a page column ``c``
        retires when ``(c + 1) * page_size <= pos - window + 1``. One launch for the batch.
        Returns the number of pages retired.
        """
        if self.swa_v2p is None:
            return 0
        rows: list[int] = []
        cols: list[int] = []
        for req, pos in batch:
            stop = min(max(0, (pos - self.swa_window + 1) // self.page_size), len(req.pages))
            for c in range(req.swa_start, stop):
                rows.append(req.row)
                cols.append(c)
            req.swa_start = max(req.swa_start, stop)
        if rows:
            self._unbind_swa(rows, cols)
            self.stats.retired_swa_pages += len(rows)
            self._update_usage()
        return len(rows)

    def release(self, reqs: Sequence[RequestMemory]) -> None:
        """Free everything the requests hold and return their rows."""
        self.release_all(list(reqs))
        for req in reqs:
            self._rows.give([req.row])
            req.pages = []
            req.swa_start = 0
            req.state_slot = -1
        self._update_usage()

    # --- views -----------------------------------------------------------------------------------

    @abstractmethod
    def kv_cache(self, kind: LayerKind, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K view ``[num_pages, page_size, H, Dk]`` and V view ``[..., Dv]`` of one lane."""

    @abstractmethod
    def state_cache(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv view ``[num_slots, *conv_shape]`` and SSM view ``[num_slots, *ssm_shape]``."""

    def physical_state_slots(self, vslots: torch.Tensor) -> torch.Tensor:
        """Physical slots of virtual state slots (device gather; -1 for unbound)."""
        if self.state_v2p is None:
            return vslots
        return self.state_v2p[vslots.long()]

    # --- accounting ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes of units currently holding data (host counts)."""
        return sum(self.live_units(k) * self.layout.unit_bytes(k) for k in self.spec.kinds)

    def _update_usage(self) -> None:
        used = self.used_bytes()
        self.stats.used_bytes = used
        self.stats.peak_bytes = max(self.stats.peak_bytes, used)

    @property
    def free_rows(self) -> int:
        return self._rows.free

    # --- what each implementation provides ------------------------------------------------------

    @abstractmethod
    def fits_alone(self, num_tokens: int, swa_tokens: int) -> bool:
        """Whether one request holding ``num_tokens`` tokens of FULL pages, ``swa_tokens`` of
        SWA pages and a state slot fits in this pool when nothing else is in it."""

    @abstractmethod
    def live_units(self, kind: LayerKind) -> int:
        """Units of ``kind`` handed out and not yet freed."""

    @abstractmethod
    def _alloc(self, todo: list[tuple[RequestMemory, int]], state_for: list[RequestMemory]) -> bool:
        """Append ``n`` pages to each ``(req, n)`` of ``todo`` (FULL, and SWA when present),
        writing them into the request table, and give each request of ``state_for`` a zeroed
        state slot. All or nothing: False leaves everything as it was."""

    @abstractmethod
    def _unbind_swa(self, rows: list[int], cols: list[int]) -> None: ...

    @abstractmethod
    def release_all(self, reqs: list[RequestMemory]) -> None:
        """Unbind every unit the requests hold (one launch per kind)."""
