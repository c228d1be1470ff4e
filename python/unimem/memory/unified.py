"""The unified arena: every KV page and state slot of a hybrid model in one byte buffer.

Geometry (DESIGN §3.3). The arena starts with a reserved header holding the sinks: FULL page
0 at byte 0 and SWA page 0 right after it, all zeros, never handed out — the FULL view's grid
starts at byte 0 and the SWA view's at the end of the FULL sink, so unit 0 of each is its sink
and every live unit lies above the header. Then the bands, in address order: STATE slots
growing up from the header, SWA pages floating, FULL pages growing down from the arena end
(with fewer kinds, the lowest present band grows up and the highest grows down). Each band has
its own unit grid (``base + id * unit_bytes``) and its own :class:`IdSpace`.

Ids. FULL owns the virtual page ids (chosen by the host); SWA is indexed by the same virtual
page (its ``v2p`` entry is -1 once retired); STATE has its own virtual slot ids. Readers only
ever hold virtual ids and translate through the live tables; compaction rewrites the tables
and nothing else.

Making room (``band_plan``): the host plans from counts which bands extend into gaps and which
evacuate a boundary region into their own holes; the device pairs sources with holes, rebinds
and copies in stream order. No step ever reads the device.
"""

from __future__ import annotations

import numpy as np
import torch

import unimem_kernel as uk
from unimem.memory.band_plan import Action, BandLayout, BandState, Compact, Extend, Reanchor, Side
from unimem.memory.host_ids import HostIdPool
from unimem.memory.id_space import IdSpace
from unimem.memory.pool import POISON_BYTE, MemoryPool, RequestMemory, pages_for
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.staging import upload_int32

ADDRESS_ORDER = (LayerKind.STATE, LayerKind.SWA, LayerKind.FULL)
"""Bands from the low end of the arena to the high end."""


class UnifiedMemory(MemoryPool):
    """One arena of ``arena_bytes`` whose split between kinds follows the workload.

    ``poison``: fill free units with NaN bytes (and evacuated ones after a move), so that a
    read of memory nobody owns shows up as NaN. Debug and test use.
    """

    def __init__(
        self,
        spec: MemorySpec,
        arena_bytes: int,
        max_requests: int,
        max_context: int,
        device: torch.device | str = "cpu",
        poison: bool = False,
    ) -> None:
        super().__init__(spec, max_requests, max_context, torch.device(device))
        self.poison = poison
        lay = self.layout
        kinds = [k for k in ADDRESS_ORDER if spec.has(k)]
        ub = {k: lay.unit_bytes(k) for k in kinds}
        arena_end = arena_bytes - arena_bytes % 16
        self.base: dict[LayerKind, int] = {}
        header = 0
        for k in (LayerKind.FULL, LayerKind.SWA):
            if k in ub:
                self.base[k] = header
                header += ub[k]
        if LayerKind.STATE in ub:
            self.base[LayerKind.STATE] = header
        self.header_bytes = header
        smallest = header + sum(ub.values())
        if arena_end < smallest:
            raise ValueError(
                f"arena_bytes {arena_bytes} is too small: the sinks and one unit of each kind "
                f"need {smallest} bytes"
            )
        self.arena_bytes = arena_end
        self.stats.capacity_bytes = arena_end
        fill = POISON_BYTE if poison else 0
        self.arena = torch.full((arena_end,), fill, dtype=torch.uint8, device=self.device)
        self.arena[:header].zero_()

        self.kinds = kinds
        self.spaces: dict[LayerKind, IdSpace] = {}
        # Virtual ids: as many as physical units could ever be bound at once (plus the
        # never-handed-out id 0). Pages and slots held by the prefix cache need ids beyond
        # what running requests hold, and every bound virtual id has a physical unit.
        num_phys = {k: (arena_end - self.base[k]) // ub[k] for k in kinds}
        num_virtual_pages = num_phys.get(LayerKind.FULL, 0) + 1
        num_virtual_slots = num_phys.get(LayerKind.STATE, 0) + 1
        for k in kinds:
            num_virt = num_virtual_slots if k is LayerKind.STATE else num_virtual_pages
            self.spaces[k] = IdSpace(k.value, num_virt, num_phys[k], self.device)
        self.bands = BandLayout(
            [BandState(k.value, ub[k], self.base[k], 0, 0, 0) for k in kinds], header, arena_end
        )
        for i in range(len(kinds)):
            at = self.bands._anchor_for(i)
            self.bands.apply(Reanchor(i, at))
        self._band_index = {k: i for i, k in enumerate(kinds)}
        self._empty_bands = self.bands.copy()
        self._vpages = HostIdPool(1, num_virtual_pages - 1)
        self._vslots = HostIdPool(1, num_virtual_slots - 1)

        self.full_v2p = self._v2p(LayerKind.FULL)
        self.swa_v2p = self._v2p(LayerKind.SWA)
        self.state_v2p = self._v2p(LayerKind.STATE)
        self._kv_views = {
            (k, lane): (
                lay.of(k).k_view(self.arena, self.base[k], self.spaces[k].num_physical, lane),
                lay.of(k).v_view(self.arena, self.base[k], self.spaces[k].num_physical, lane),
            )
            for k in kinds
            if k is not LayerKind.STATE
            for lane in range(lay.of(k).num_lanes)
        }
        self._state_views = {}
        if LayerKind.STATE in kinds:
            sl, n = lay.state, self.spaces[LayerKind.STATE].num_physical
            base = self.base[LayerKind.STATE]
            self._state_views = {
                lane: (
                    sl.conv_view(self.arena, base, n, lane),
                    sl.ssm_view(self.arena, base, n, lane),
                )
                for lane in range(sl.num_lanes)
            }

    def _v2p(self, kind: LayerKind) -> torch.Tensor | None:
        return self.spaces[kind].v2p if kind in self.spaces else None

    # --- views -----------------------------------------------------------------------------------

    def kv_cache(self, kind: LayerKind, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv_views[(kind, lane)]

    def state_cache(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._state_views[lane]

    # --- counts ----------------------------------------------------------------------------------

    def band(self, kind: LayerKind) -> BandState:
        return self.bands.bands[self._band_index[kind]]

    def live_units(self, kind: LayerKind) -> int:
        return self.band(kind).live if kind in self._band_index else 0

    def fits_alone(self, num_tokens: int, swa_tokens: int) -> bool:
        p = self.page_size
        need = {
            LayerKind.FULL: pages_for(num_tokens, p),
            LayerKind.SWA: pages_for(swa_tokens, p),
            LayerKind.STATE: 1,
        }
        demands = [(self._band_index[k], need[k]) for k in self.kinds]
        return self._empty_bands.plan(demands) is not None

    # --- allocation ------------------------------------------------------------------------------

    def _alloc(self, todo: list[tuple[RequestMemory, int]], n_slots: int) -> list[int] | None:
        n_pages = sum(n for _, n in todo)
        if n_pages > self._vpages.free or n_slots > self._vslots.free:
            return None
        demands = []
        if n_pages:
            demands.append((self._band_index[LayerKind.FULL], n_pages))
            if LayerKind.SWA in self._band_index:
                demands.append((self._band_index[LayerKind.SWA], n_pages))
        if n_slots:
            demands.append((self._band_index[LayerKind.STATE], n_slots))
        plan = self.bands.plan(demands)
        if plan is None:
            return None
        for act in plan:
            self._execute(act)

        vids = self._vpages.take(n_pages)
        slots = self._vslots.take(n_slots)
        rows, cols = [], []
        for req, n in todo:
            start = len(req.pages)
            rows += [req.row] * n
            cols += range(start, start + n)
        packed = upload_int32(np.array(vids + rows + cols + slots, dtype=np.int32), self.device)
        if n_pages:
            vdev = packed[:n_pages]
            rdev = packed[n_pages : 2 * n_pages]
            cdev = packed[2 * n_pages : 3 * n_pages]
            self._bind(LayerKind.FULL, vdev, rdev, cdev)
            if LayerKind.SWA in self.spaces:
                self._bind(LayerKind.SWA, vdev)
        if n_slots:
            self._bind(LayerKind.STATE, packed[3 * n_pages :])
        it = iter(vids)
        for req, n in todo:
            req.pages.extend(next(it) for _ in range(n))
        return slots

    def _bind(self, kind, vids, rows=None, cols=None) -> None:
        space = self.spaces[kind]
        popped = space.bind(
            vids,
            req_to_token=self.req_to_token if rows is not None else None,
            unit_rows=rows,
            unit_cols=cols,
            page_size=self.page_size,
        )
        self.band(kind).free = space.free
        ub = self.layout.unit_bytes(kind)
        uk.fill_units(self.arena, self.base[kind], ub, popped, 0)

    def _unbind(self, kind: LayerKind, n: int, **where) -> None:
        space = self.spaces[kind]
        pushed = space.unbind(n, page_size=self.page_size, **where)
        self.band(kind).free = space.free
        if self.poison:
            ub = self.layout.unit_bytes(kind)
            uk.fill_units(self.arena, self.base[kind], ub, pushed, POISON_BYTE)

    def _free_units(self, full: list[int], swa: list[int], slots: list[int]) -> None:
        packed = upload_int32(np.array(full + swa + slots, dtype=np.int32), self.device)
        a, b = len(full), len(full) + len(swa)
        if full:
            self._unbind(LayerKind.FULL, len(full), vids=packed[:a])
            self._vpages.give(full)
        if swa:
            self._unbind(LayerKind.SWA, len(swa), vids=packed[a:b])
        if slots:
            self._unbind(LayerKind.STATE, len(slots), vids=packed[b:])
            self._vslots.give(slots)

    def _holds_state(self, slot: int) -> bool:
        return self._vslots.holds(slot)

    def _unit_buffer(self, kind: LayerKind) -> tuple[torch.Tensor, int]:
        return self.arena, self.base[kind]

    # --- band moves ------------------------------------------------------------------------------

    def _execute(self, act: Action) -> None:
        kind = self.kinds[act.band]
        band = self.bands.bands[act.band]
        space = self.spaces[kind]
        if isinstance(act, Reanchor):
            assert band.size == 0 and space.free == 0
        elif isinstance(act, Extend):
            up = act.side is Side.UP
            lo, hi = (band.hi, band.hi + act.n) if up else (band.lo - act.n, band.lo)
            space.push_range(lo, hi)
        elif isinstance(act, Compact):
            up = act.side is Side.UP
            lo, hi = (band.hi - act.k, band.hi) if up else (band.lo, band.lo + act.k)
            src, dst = space.compact(lo, hi)
            ub = self.layout.unit_bytes(kind)
            uk.copy_units(self.arena, self.base[kind], ub, src, dst)
            if self.poison:
                uk.fill_units(self.arena, self.base[kind], ub, src, POISON_BYTE)
            self.stats.compactions += 1
            self.stats.moved_units += act.k
        self.bands.apply(act)
        assert band.free == space.free, f"{kind}: host count {band.free} != stack {space.free}"

    # --- explicit compaction ---------------------------------------------------------------------

    def compact(self, kind: LayerKind, side: Side | None = None) -> int:
        """Evacuate every hole of band ``kind`` at ``side`` (default: the side it grows at):
        its live units move into its holes and the band shrinks to its live size, returning
        the freed bytes to the gap. Returns the number of units given up."""
        i = self._band_index[kind]
        band = self.bands.bands[i]
        k = band.free
        if k == 0:
            return 0
        side = side if side is not None else self.bands.sides(i)[0]
        self._execute(Compact(i, side, k))
        return k
