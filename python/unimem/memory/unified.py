"""The unified arena: every KV page and state slot of a hybrid model in one byte buffer.

Geometry. The arena starts with a reserved header holding the sinks: FULL page
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

import itertools

import numpy as np
import torch

import unimem_kernel as uk
from unimem.memory.band_plan import Action, BandLayout, BandState, Compact, Extend, Reanchor, Side
from unimem.memory.errors import InternalError
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

ADDRESS_ORDER = (LayerKind.STATE, LayerKind.SWA, LayerKind.FULL)
"""Bands from the low end of the arena to the high end."""

EXTEND_AHEAD_UNITS = 16
"""Units a band takes beyond its need when it extends into a wide gap
(:class:`~unimem.memory.band_plan.BandLayout` ``extend_ahead``): the next allocations of a
growing batch find them free and skip the planner and the device push."""


def _empty_layout(
    kinds: list[LayerKind],
    unit_bytes: dict[LayerKind, int],
    base: dict[LayerKind, int],
    header: int,
    arena_end: int,
) -> BandLayout:
    """The bands of an empty arena of ``arena_end`` bytes, each anchored where it grows."""
    bands = BandLayout(
        [BandState(k.value, unit_bytes[k], base[k], 0, 0, 0) for k in kinds],
        header,
        arena_end,
        extend_ahead=EXTEND_AHEAD_UNITS,
    )
    for i in range(len(kinds)):
        bands.apply(Reanchor(i, bands._anchor_for(i)))
    return bands


def _fits_minimal(kinds, unit_bytes, base, header, arena_end, demands) -> bool:
    """Whether an empty arena of ``arena_end`` bytes can plan ``demands`` (host only)."""
    if arena_end < header + sum(unit_bytes.values()):
        return False
    return _empty_layout(kinds, unit_bytes, base, header, arena_end).plan(demands) is not None


def _minimal_arena_bytes(kinds, unit_bytes, base, header, demands) -> int:
    """The smallest arena size (a multiple of 16) whose empty bands can plan ``demands``:
    the sinks plus one unit of each kind, plus what the bands' unit grids waste at their
    boundaries (bisection from a size that always fits: twice every unit)."""
    lo = header + sum(unit_bytes.values())
    lo += -lo % 16
    hi = lo + 2 * sum(unit_bytes.values())
    hi += -hi % 16
    while not _fits_minimal(kinds, unit_bytes, base, header, hi, demands):
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 32 * 16
        if _fits_minimal(kinds, unit_bytes, base, header, mid, demands):
            hi = mid
        else:
            lo = mid + 16
    return lo


def _single_pop_order(height: int, events: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """For one free stack of ``height`` ids, and requests that each push ``events[r][0]`` fresh
    ids (band extensions) and then pop ``events[r][1]``: if running every push first and then
    one pop of all the requests' ids takes exactly the ids the requests' own pops would take,
    the owner of each id of that one pop (bottom to top) as ``(request, index in its pop)``;
    else None. A pop of ``m`` binds ``stack[top - m + i]`` to the ``i``-th id (``IdSpace.bind``).
    Host only, linear in the ids popped (the stack below them is never listed)."""
    total = sum(pop for _, pop in events)
    base = max(0, height - total)  # labels: stack positions; those below never pop
    stack = list(range(base, height))
    batched = list(stack)
    label = height
    owner: dict[int, tuple[int, int]] = {}
    for r, (push, pop) in enumerate(events):
        fresh = list(range(label, label + push))
        label += push
        stack += fresh
        batched += fresh
        if pop > len(stack):
            return None
        for i, lab in enumerate(stack[len(stack) - pop :]):
            owner[lab] = (r, i)
        del stack[len(stack) - pop :]
    top = batched[len(batched) - total :] if total else []
    if set(top) != set(owner):
        return None
    return [owner[lab] for lab in top]


class _AdmissionGroup:
    """Consecutive admissions of ``admit_many`` served by one allocation: their band
    extensions (``actions``, in order) and, per band, each request's pushes and pops on a
    stack of ``heights[band]`` ids at the group's start."""

    def __init__(self, heights: list[int]) -> None:
        self.heights = heights
        self.actions: list[Action] = []
        self.events: list[list[tuple[int, int]]] = [[] for _ in heights]

    def extend(self, plan: list[Action], pushes: list[int], pops: list[int]) -> bool:
        """Add one request (its plan, and its pushes and pops per band) if one pop per band
        still serves every request as its own pop would; False (unchanged) otherwise."""
        trial = [ev + [(pushes[b], pops[b])] for b, ev in enumerate(self.events)]
        if any(_single_pop_order(h, ev) is None for h, ev in zip(self.heights, trial, strict=True)):
            return False
        self.events = trial
        self.actions += plan
        return True

    def order(self, band: int) -> list[tuple[int, int]]:
        """``(request, index)`` of each id of the group's one pop of ``band``, in bind order."""
        got = _single_pop_order(self.heights[band], self.events[band])
        if got is None:
            raise InternalError("admit_many: the group's pops no longer match")
        return got


def _geometry(lay: MemoryLayout) -> tuple[list[LayerKind], dict, dict, int]:
    """``(kinds in address order, unit bytes, base of each kind's grid, header bytes)``: the
    sinks of FULL then SWA fill the header; STATE's grid starts at its end."""
    kinds = [k for k in ADDRESS_ORDER if k in lay.kinds]
    ub = {k: lay.unit_bytes(k) for k in kinds}
    base: dict[LayerKind, int] = {}
    header = 0
    for k in (LayerKind.FULL, LayerKind.SWA):
        if k in ub:
            base[k] = header
            header += ub[k]
    if LayerKind.STATE in ub:
        base[LayerKind.STATE] = header
    return kinds, ub, base, header


def minimal_arena_bytes(spec: MemorySpec) -> int:
    """The smallest ``arena_bytes`` (a multiple of 16) :class:`UnifiedMemory` accepts for
    ``spec``: the sinks and one minimal request (one page of every attention kind, one state
    slot, draft lanes included), with what the unit grids waste at band boundaries."""
    kinds, ub, base, header = _geometry(MemoryLayout.build(spec))
    demands = [(i, 1) for i in range(len(kinds))]
    return _minimal_arena_bytes(kinds, ub, base, header, demands)


class UnifiedMemory(MemoryPool):
    """One arena of ``arena_bytes`` whose split between kinds follows the workload. The arena
    must hold at least one minimal request (one page of every attention kind and one state
    slot, draft lanes included): the constructor refuses a smaller one, naming the bytes
    needed.

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
        kinds, ub, self.base, header = _geometry(lay)
        arena_bytes = as_int("arena_bytes", arena_bytes)
        arena_end = arena_bytes - arena_bytes % 16
        self.header_bytes = header
        self.kinds = kinds
        self._band_index = {k: i for i, k in enumerate(kinds)}
        geometry = (kinds, ub, self.base, header)
        if not _fits_minimal(*geometry, arena_end, self._demands(1, 1)):
            need = _minimal_arena_bytes(*geometry, self._demands(1, 1))
            raise ValueError(
                f"arena_bytes {arena_bytes} is too small: the sinks and one minimal request (one "
                f"page of every attention kind, one state slot, draft lanes included) need "
                f"{need} bytes"
            )
        self.arena_bytes = arena_end
        self.stats.capacity_bytes = arena_end
        fill = POISON_BYTE if poison else 0
        self.arena = torch.full((arena_end,), fill, dtype=torch.uint8, device=self.device)
        self.arena[:header].zero_()

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
        self._warm_up_kernels()
        self.bands = _empty_layout(*geometry, arena_end)
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
        return self._view(self._kv_views, (kind, lane), "(kind, lane)")

    def state_cache(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view(self._state_views, lane, "lane")

    # --- counts ----------------------------------------------------------------------------------

    def band(self, kind: LayerKind) -> BandState:
        return self.bands.bands[self._band_index[kind]]

    def live_units(self, kind: LayerKind) -> int:
        return self.band(kind).live if kind in self._band_index else 0

    def fits_alone(self, num_tokens: int, swa_tokens: int) -> bool:
        p = self.page_size
        full = pages_for(self._check_count("num_tokens", num_tokens), p)
        swa = pages_for(self._check_count("swa_tokens", swa_tokens), p)
        return self._empty_bands.plan(self._demands(full, 1, swa)) is not None

    def _demands(self, n_pages: int, n_slots: int, n_swa: int | None = None) -> list:
        """Band demands of ``n_pages`` FULL pages, ``n_swa`` SWA pages (default: as many) and
        ``n_slots`` state slots, in the order ``_alloc`` plans them."""
        n_swa = n_pages if n_swa is None else n_swa
        out = []
        for kind, n in (
            (LayerKind.FULL, n_pages),
            (LayerKind.SWA, n_swa),
            (LayerKind.STATE, n_slots),
        ):
            if n and kind in self._band_index:
                out.append((self._band_index[kind], n))
        return out

    # --- allocation ------------------------------------------------------------------------------

    def _plan_admissions(self, pages: list[int]) -> list[tuple[object, int]]:
        """Plan admissions one by one on a copy of the bands (each plan made on the state the
        earlier admissions leave, their units taken off the free counts). A request whose plan
        compacts a band starts a new group; the others join the group before them: its band
        extensions run first, then one pop per kind binds, for every request, the ids its own
        pop would have taken (:func:`_single_pop_order`)."""
        sim = self.bands.copy()
        pages_left, slots_left = self._vpages.free, self._vslots.free
        groups: list[tuple[object, int]] = []
        group: _AdmissionGroup | None = None
        for n in pages:
            slots = 1 if self._has_state else 0
            if n > pages_left or slots > slots_left:
                break
            demands = self._demands(n, slots)
            plan = sim.plan(demands)
            if plan is None:
                break
            heights = [b.free for b in sim.bands]
            for act in plan:
                sim.apply(act)
            for i, m in demands:
                sim.bands[i].free -= m
            pages_left -= n
            slots_left -= slots
            pushes = [0] * len(sim.bands)
            for act in plan:
                if isinstance(act, Extend):
                    pushes[act.band] += act.n
            pops = [0] * len(sim.bands)
            for i, m in demands:
                pops[i] = m
            joins = group is not None and not any(isinstance(a, Compact) for a in plan)
            if joins and group.extend(plan, pushes, pops):
                groups[-1] = (group, groups[-1][1] + 1)
                continue
            group = _AdmissionGroup(heights)
            if not group.extend(plan, pushes, pops):
                raise InternalError("admit_many: a single admission's pops do not fit its stack")
            groups.append((group, 1))
        return groups

    def _alloc_spare(
        self, todo: list[tuple[RequestMemory, int]], keep_free: int
    ) -> list[int] | None:
        # bands may take fresh units from their gaps (Extend) but not move (Compact,
        # Reanchor: copies of units, which would cost more than the allocations that pages
        # ahead save), for the pages and for keep_free more
        n_pages = sum(n for _, n in todo)
        if n_pages + keep_free > self._vpages.free:
            return None
        demands = self._demands(n_pages, 0)
        plan = self.bands.plan(demands)
        margin = self.bands.plan([(i, m + keep_free) for i, m in demands])
        if plan is None or margin is None:
            return None
        if not all(isinstance(act, Extend) for act in (*plan, *margin)):
            return None
        return self._alloc(todo, 0, plan)

    def _alloc(
        self, todo: list[tuple[RequestMemory, int]], n_slots: int, plan: object = None
    ) -> list[int] | None:
        n_pages = sum(n for _, n in todo)
        if n_pages > self._vpages.free or n_slots > self._vslots.free:
            return None
        demands = self._demands(n_pages, n_slots)
        group = plan if isinstance(plan, _AdmissionGroup) else None
        if group is not None:
            heights = [self.spaces[k].free for k in self.kinds]
            if heights != group.heights:
                raise InternalError(f"admit_many: stacks {heights}, planned {group.heights}")
            plan = group.actions
        elif plan is None:
            plan = self.bands.plan(demands)
            if plan is None:
                return None
        for act in plan:
            self._execute(act)
        for i, m in demands:
            band = self.bands.bands[i]
            if band.free < m:
                raise InternalError(
                    f"{band.name}: the plan left {band.free} free units for a demand of {m}\n"
                    f"{self.bands.describe()}"
                )

        vids = self._vpages.take(n_pages)
        slots = self._vslots.take(n_slots)
        rows, cols = [], []
        for req, n in todo:
            start = len(req.pages)
            rows += [req.row] * n
            cols += range(start, start + n)
        if group is None:  # one request, or a grow: popped per request in order
            order = {k: bind_order(todo) for k in self.kinds if k is not LayerKind.STATE}
            slot_order = list(range(n_slots))[::-1]
        else:  # each request gets the ids of its own pop (the group's order)
            firsts = list(itertools.accumulate((n for _, n in todo), initial=0))
            order = {
                k: [firsts[r] + i for r, i in group.order(self._band_index[k])]
                for k in self.kinds
                if k is not LayerKind.STATE
            }
            slot_order = (
                [r for r, _ in group.order(self._band_index[LayerKind.STATE])] if n_slots else []
            )
        full = order.get(LayerKind.FULL, [])
        swa = order.get(LayerKind.SWA, [])
        packed = upload_int32(
            np.array(
                [vids[i] for i in full]
                + [rows[i] for i in full]
                + [cols[i] for i in full]
                + [vids[i] for i in swa]
                + [slots[i] for i in slot_order],
                dtype=np.int32,
            ),
            self.device,
        )
        if n_pages:
            self._bind(
                LayerKind.FULL,
                packed[:n_pages],
                packed[n_pages : 2 * n_pages],
                packed[2 * n_pages : 3 * n_pages],
            )
            if LayerKind.SWA in self.spaces:
                self._bind(LayerKind.SWA, packed[3 * n_pages : 4 * n_pages])
        if n_slots:
            at = 4 * n_pages if LayerKind.SWA in self.spaces else 3 * n_pages
            self._bind(LayerKind.STATE, packed[at : at + n_slots])
        at = 0
        for req, n in todo:
            req.pages += vids[at : at + n]
            at += n
        return slots

    def _warm_up_kernels(self) -> None:
        """Compile the id and byte ops' variants this arena launches now, not at their first
        use mid-run (:func:`~unimem.memory.id_space.warm_up_id_kernels`; the byte ops on
        padded ids, which touch nothing)."""
        if self.device.type != "cuda":
            return
        warm_up_id_kernels(self.device, (self.page_size,), self.req_to_token.dtype)
        pad = torch.full((1,), -1, dtype=torch.int32, device=self.device)
        for k in self.kinds:
            uk.fill_units(self.arena, self.base[k], self._unit_bytes[k], pad, 0)
            uk.copy_units(self.arena, self.base[k], self._unit_bytes[k], pad, pad)

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
        ub = self._unit_bytes[kind]
        uk.fill_units(self.arena, self.base[kind], ub, popped, 0)

    def _unbind(self, kind: LayerKind, n: int, **where) -> None:
        space = self.spaces[kind]
        pushed = space.unbind(n, page_size=self.page_size, **where)
        self.band(kind).free = space.free
        if self.poison:
            ub = self._unit_bytes[kind]
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
            if band.size or space.free:
                raise InternalError(
                    f"{kind}: re-anchoring a band of {band.size} units with {space.free} free"
                )
        elif isinstance(act, Extend):
            up = act.side is Side.UP
            lo, hi = (band.hi, band.hi + act.n) if up else (band.lo - act.n, band.lo)
            space.push_range(lo, hi)
        elif isinstance(act, Compact):
            up = act.side is Side.UP
            lo, hi = (band.hi - act.k, band.hi) if up else (band.lo, band.lo + act.k)
            src, dst = space.compact(lo, hi)
            ub = self._unit_bytes[kind]
            uk.copy_units(self.arena, self.base[kind], ub, src, dst)
            if self.poison:
                uk.fill_units(self.arena, self.base[kind], ub, src, POISON_BYTE)
            self.stats.compactions += 1
            self.stats.moved_units += act.k
        self.bands.apply(act)
        if band.free != space.free:
            raise InternalError(f"{kind}: host count {band.free} != stack height {space.free}")

    # --- explicit compaction ---------------------------------------------------------------------

    def compact(self, kind: LayerKind, side: Side | None = None) -> int:
        """Evacuate every hole of band ``kind`` at ``side`` (default: the side it grows at; a
        middle band may use either): its live units move into its holes and the band shrinks
        to its live size, returning the freed bytes to the gap. Returns the number of units
        given up."""
        if not isinstance(kind, LayerKind) or kind not in self._band_index:
            have = ", ".join(k.name for k in self.kinds)
            raise ValueError(f"kind: the arena has no {kind!r} band (it has {have})")
        i = self._band_index[kind]
        sides = self.bands.sides(i)
        if side is not None and side not in sides:
            allowed = ", ".join(s.name for s in sides)
            raise ValueError(f"side: the {kind.name} band grows at {allowed}, not {side!r}")
        band = self.bands.bands[i]
        k = band.free
        if k == 0:
            return 0
        self._execute(Compact(i, side if side is not None else sides[0], k))
        return k
