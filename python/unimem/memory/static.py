"""The static baseline: separate pools with a split fixed at start-up.

What serving engines do by default, and what the unified arena is measured against: one
buffer of FULL pages, one of SWA pages and one of state slots, each sized at start-up. FULL
page ids and state slot ids are physical — ``req_to_token`` holds physical token ids and no
table translates them (``full_v2p`` and ``state_v2p`` are None). SWA pages, being fewer than
FULL pages, are reached through a FULL-page -> SWA-page mapping (``swa_v2p``), as in SGLang's
hybrid SWA pool. Page 0 of each attention pool is the zero sink.
"""

from __future__ import annotations

import numpy as np
import torch

import unimem_kernel as uk
from unimem.memory.host_ids import HostIdPool
from unimem.memory.id_space import IdSpace, warm_up_id_kernels
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import (
    POISON_BYTE,
    MemoryPool,
    RequestMemory,
    as_int,
    bind_order,
    pages_for,
)
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.staging import upload_int32


class StaticMemory(MemoryPool):
    """Fixed pools: ``num_full_pages`` FULL pages, ``num_swa_pages`` SWA pages and
    ``num_state_slots`` state slots (each count excludes the sink)."""

    def __init__(
        self,
        spec: MemorySpec,
        num_full_pages: int,
        num_swa_pages: int,
        num_state_slots: int,
        max_requests: int,
        max_context: int,
        device: torch.device | str = "cpu",
        poison: bool = False,
    ) -> None:
        super().__init__(spec, max_requests, max_context, torch.device(device))
        self.poison = poison
        counts = {
            LayerKind.FULL: num_full_pages,
            LayerKind.SWA: num_swa_pages,
            LayerKind.STATE: num_state_slots,
        }
        self.kinds = spec.kinds
        for k in self.kinds:
            counts[k] = as_int(
                f"num_{k.value}_{'slots' if k is LayerKind.STATE else 'pages'}", counts[k]
            )
            if counts[k] < 1:
                raise ValueError(f"StaticMemory needs at least one {k.value} unit, got {counts[k]}")
        num_full_pages, num_swa_pages, num_state_slots = (
            counts[LayerKind.FULL],
            counts[LayerKind.SWA],
            counts[LayerKind.STATE],
        )
        lay = self.layout
        fill = POISON_BYTE if poison else 0
        self.pools: dict[LayerKind, torch.Tensor] = {}
        self.capacity: dict[LayerKind, int] = {}
        for k in self.kinds:
            sink = 0 if k is LayerKind.STATE else 1
            units = counts[k] + sink
            self.capacity[k] = counts[k]
            buf = torch.full((units * lay.unit_bytes(k),), fill, dtype=torch.uint8, device=device)
            buf[: sink * lay.unit_bytes(k)].zero_()
            self.pools[k] = buf
        self.stats.capacity_bytes = sum(b.numel() for b in self.pools.values())

        self._full_ids = HostIdPool(1, num_full_pages) if spec.has(LayerKind.FULL) else None
        self._slots = HostIdPool(0, num_state_slots) if spec.has(LayerKind.STATE) else None
        self._swa: IdSpace | None = None
        if spec.has(LayerKind.SWA):
            self._swa = IdSpace("swa", num_full_pages + 1, num_swa_pages + 1, self.device)
            self._swa.push_range(1, num_swa_pages + 1)
        self._warm_up_kernels()
        self.full_v2p = None
        self.state_v2p = None
        self.swa_v2p = self._swa.v2p if self._swa is not None else None
        self._kv_views = {
            (k, lane): (
                lay.of(k).k_view(self.pools[k], 0, counts[k] + 1, lane),
                lay.of(k).v_view(self.pools[k], 0, counts[k] + 1, lane),
            )
            for k in self.kinds
            if k is not LayerKind.STATE
            for lane in range(lay.of(k).num_lanes)
        }
        self._state_views = {}
        if spec.has(LayerKind.STATE):
            sl, n, buf = lay.state, num_state_slots, self.pools[LayerKind.STATE]
            self._state_views = {
                lane: (sl.conv_view(buf, 0, n, lane), sl.ssm_view(buf, 0, n, lane))
                for lane in range(sl.num_lanes)
            }

    @classmethod
    def from_budget(
        cls,
        spec: MemorySpec,
        budget_bytes: int,
        num_state_slots: int,
        swa_to_full: float,
        max_requests: int,
        max_context: int,
        device: torch.device | str = "cpu",
        poison: bool = False,
    ) -> StaticMemory:
        """Split ``budget_bytes``: ``num_state_slots`` slots first, then FULL and SWA pages in
        the ratio ``num_swa_pages = swa_to_full * num_full_pages`` (SGLang's default hybrid
        SWA pool uses a token ratio of 0.8). Raises if a pool would be empty."""
        lay = MemoryLayout.build(spec)
        left = budget_bytes
        if spec.has(LayerKind.STATE):
            left -= num_state_slots * lay.unit_bytes(LayerKind.STATE)
        else:
            num_state_slots = 0
        per_full = lay.unit_bytes(LayerKind.FULL) if spec.has(LayerKind.FULL) else 0
        per_swa = lay.unit_bytes(LayerKind.SWA) if spec.has(LayerKind.SWA) else 0
        ratio = swa_to_full if per_swa else 0.0
        # Sinks come out of the budget too.
        left -= per_full + per_swa
        n_full = int(left // (per_full + ratio * per_swa)) if per_full else 0
        n_swa = int(n_full * ratio) if per_full else int(left // per_swa) if per_swa else 0
        if left <= 0 or (per_full and n_full < 1) or (per_swa and n_swa < 1):
            raise ValueError(
                f"a budget of {budget_bytes} bytes cannot hold {num_state_slots} state slots and "
                f"at least one page of each attention kind"
            )
        return cls(spec, n_full, n_swa, num_state_slots, max_requests, max_context, device, poison)

    # --- views -----------------------------------------------------------------------------------

    def kv_cache(self, kind: LayerKind, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view(self._kv_views, (kind, lane), "(kind, lane)")

    def state_cache(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view(self._state_views, lane, "lane")

    # --- counts ----------------------------------------------------------------------------------

    def live_units(self, kind: LayerKind) -> int:
        if kind is LayerKind.FULL and self._full_ids is not None:
            return self._full_ids.used
        if kind is LayerKind.SWA and self._swa is not None:
            return self.capacity[kind] - self._swa.free
        if kind is LayerKind.STATE and self._slots is not None:
            return self._slots.used
        return 0

    def fits_alone(self, num_tokens: int, swa_tokens: int) -> bool:
        p = self.page_size
        need = {
            LayerKind.FULL: pages_for(self._check_count("num_tokens", num_tokens), p),
            LayerKind.SWA: pages_for(self._check_count("swa_tokens", swa_tokens), p),
            LayerKind.STATE: 1,
        }
        return all(need[k] <= self.capacity[k] for k in self.kinds)

    # --- allocation ------------------------------------------------------------------------------

    def _free_for_admission(self) -> tuple[int, int]:
        """Pages every page pool can still hand out, and free state slots (what ``_alloc``
        checks: ids are host-chosen, so admissions one by one take exactly these)."""
        pools = [ids.free for ids in (self._full_ids, self._swa) if ids is not None]
        slots = self._slots.free if self._slots is not None else 0
        return (min(pools) if pools else 0), slots

    def _alloc_spare(
        self, todo: list[tuple[RequestMemory, int]], keep_free: int
    ) -> list[int] | None:
        free, _ = self._free_for_admission()
        if sum(n for _, n in todo) + keep_free > free:
            return None
        return self._alloc(todo, 0)

    def _alloc(
        self, todo: list[tuple[RequestMemory, int]], n_slots: int, plan: object = None
    ) -> list[int] | None:
        n_pages = sum(n for _, n in todo)
        if self._full_ids is not None and n_pages > self._full_ids.free:
            return None
        if self._swa is not None and n_pages > self._swa.free:
            return None
        if n_slots and (self._slots is None or n_slots > self._slots.free):
            return None
        pages = self._full_ids.take(n_pages) if n_pages else []
        slots = self._slots.take(n_slots) if n_slots else []
        if n_pages:
            rows, cols = [], []
            for req, n in todo:
                rows += [req.row] * n
                cols += range(len(req.pages), len(req.pages) + n)
            order = bind_order(todo)
            dev = [pages[i] for i in order] + [rows[i] for i in order] + [cols[i] for i in order]
            packed = upload_int32(np.array(dev, dtype=np.int32), self.device)
            pdev = packed[:n_pages]
            self._write_page_rows(pdev, packed[n_pages : 2 * n_pages], packed[2 * n_pages :])
            self._zero(LayerKind.FULL, pdev)
            if self._swa is not None:
                self._zero(LayerKind.SWA, self._swa.bind(pdev))
        if slots:
            self._zero(LayerKind.STATE, upload_int32(slots, self.device))
        at = 0
        for req, n in todo:
            req.pages += pages[at : at + n]
            at += n
        return slots

    def _warm_up_kernels(self) -> None:
        """Compile the id and byte ops' variants these pools launch now, not at their first
        use mid-run (:func:`~unimem.memory.id_space.warm_up_id_kernels`; the SWA space binds
        without a request table, at page size 1; the byte op on a padded id, which touches
        nothing)."""
        if self.device.type != "cuda":
            return
        if self._swa is not None:
            warm_up_id_kernels(self.device, (1,), self.req_to_token.dtype)
        pad = torch.full((1,), -1, dtype=torch.int32, device=self.device)
        for k in self.kinds:
            self._zero(k, pad)

    def _zero(self, kind: LayerKind, ids: torch.Tensor, byte: int = 0) -> None:
        uk.fill_units(self.pools[kind], 0, self._unit_bytes[kind], ids, byte)

    def _free_units(self, full: list[int], swa: list[int], slots: list[int]) -> None:
        packed = upload_int32(np.array(full + swa + slots, dtype=np.int32), self.device)
        a, b = len(full), len(full) + len(swa)
        if swa:
            pushed = self._swa.unbind(len(swa), vids=packed[a:b])
            if self.poison:
                self._zero(LayerKind.SWA, pushed, POISON_BYTE)
        if full:
            self._full_ids.give(full)
            if self.poison:
                self._zero(LayerKind.FULL, packed[:a], POISON_BYTE)
        if slots:
            self._slots.give(slots)
            if self.poison:
                self._zero(LayerKind.STATE, packed[b:], POISON_BYTE)

    def _holds_state(self, slot: int) -> bool:
        return self._slots is not None and self._slots.holds(slot)

    def _unit_buffer(self, kind: LayerKind) -> tuple[torch.Tensor, int]:
        return self.pools[kind], 0
