"""Planning band moves in the arena, on the host, from counts alone.

The arena is one byte range. Each unit kind (FULL pages, SWA pages, STATE slots) is a *band*:
a contiguous range of unit ids ``[lo, hi)`` on its own grid — unit ``u`` of a band spans bytes
``[base + u * unit_bytes, base + (u + 1) * unit_bytes)``. Bands are kept in address order and
never overlap. The lowest band grows up from the reserved header, the highest grows down from
the arena end, and a middle band floats between them. The bytes no band covers
are gaps.

A band's *free* count is the number of ids on its device free stack: the units of its extent
that hold no live data. The host knows every count exactly (it decided every push and pop), so
whether a request fits, and how to make room, is decided here without reading the device.

To give band ``i`` ``m`` free units the planner, in order:

1. uses the units already free in ``i``;
2. extends ``i`` into the gap on either side (a middle band prefers the larger gap);
3. makes a neighbour retreat: the neighbour ``j`` evacuates the ``k`` units of its extent that
   face ``i`` into its own holes (compaction), first extending its far side if its holes are too
   few (which may in turn make *its* far neighbour retreat). An emptied middle band drops out of
   the way and re-anchors later in whatever gap it is given.

Where a band may be. A band always lies within its *gap*: the bytes between the nearest
non-empty band below it (or the header) and the nearest non-empty band above it (or the arena
end). An empty band is re-anchored at the grid point of its own unit grid nearest the middle
of its gap that lies inside the gap; when no grid point lies inside (a gap narrower than one
unit, off the band's grid), at the first grid point above the gap's lower limit, where it can
only grow up once its upper neighbour retreats. :meth:`BandLayout.room` counts the units a
band can add at one side while the whole band stays inside both limits of its gap (0 when it
does not lie inside them now), so a plan never makes bands overlap by construction.

``plan`` works on a copy and returns the list of actions, or ``None`` when the request
cannot be met — in which case nothing at all has changed. Before returning it checks the
planned layout (:meth:`BandLayout.check`: no overlap, nothing outside the arena, counts in
range) and raises :class:`~unimem.memory.errors.InternalError` with the band table if a plan
broke it — also with nothing changed. The executor replays the actions with device ops in
order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from unimem.memory.errors import InternalError

AHEAD_GAP_FACTOR = 8
"""A band extends ahead only while the gap beyond its need is this many times the extra."""


class Side(Enum):
    DOWN = -1
    UP = 1


@dataclass
class BandState:
    """Host bookkeeping of one band (all counts, no device data)."""

    name: str
    unit_bytes: int
    base: int
    lo: int
    hi: int
    free: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def live(self) -> int:
        return self.size - self.free

    @property
    def byte_lo(self) -> int:
        return self.base + self.lo * self.unit_bytes

    @property
    def byte_hi(self) -> int:
        return self.base + self.hi * self.unit_bytes


@dataclass(frozen=True)
class Extend:
    """Add ``n`` fresh units to band ``band`` at ``side`` (their ids go on its free stack)."""

    band: int
    side: Side
    n: int


@dataclass(frozen=True)
class Compact:
    """Band ``band`` evacuates its ``k`` units at ``side`` into its holes and gives them up."""

    band: int
    side: Side
    k: int


@dataclass(frozen=True)
class Reanchor:
    """Move the (empty) band ``band`` so that its extent is ``[at, at)``."""

    band: int
    at: int


Action = Extend | Compact | Reanchor


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


class BandLayout:
    """Bands in address order between ``header_end`` and ``arena_end`` (bytes).

    ``extend_ahead``: when a band extends into a gap that holds all it needs and at least
    :data:`AHEAD_GAP_FACTOR` times this many units more, it takes this many units more, so
    that the next allocations find free units and need no plan (a growing request otherwise
    extends its band by a page at every page boundary: a planning pass on a copy and a device
    push each time). Near the end of a gap every extension is exact again, so a band holds at
    most ``extend_ahead`` units of a gap that a neighbour could have had, which it gives up
    by compaction like any other units when the neighbour is short of room."""

    def __init__(
        self, bands: list[BandState], header_end: int, arena_end: int, extend_ahead: int = 0
    ) -> None:
        if extend_ahead < 0:
            raise ValueError(f"extend_ahead must be >= 0, got {extend_ahead}")
        self.bands = bands
        self.header_end = header_end
        self.arena_end = arena_end
        self.extend_ahead = extend_ahead
        # Free units of each band already promised to an earlier request of the same plan:
        # compaction may not consume them.
        self.reserved = [0] * len(bands)

    def copy(self) -> BandLayout:
        """An independent copy of the host state (plans are made on copies)."""
        return BandLayout(
            [replace(b) for b in self.bands], self.header_end, self.arena_end, self.extend_ahead
        )

    # --- geometry ----------------------------------------------------------------------------

    def _neighbour(self, i: int, side: Side) -> int | None:
        """Nearest non-empty band beyond ``i`` at ``side``."""
        j = i + side.value
        while 0 <= j < len(self.bands):
            if self.bands[j].size > 0:
                return j
            j += side.value
        return None

    def limit(self, i: int, side: Side) -> int:
        """The byte bound band ``i`` may extend to at ``side``."""
        j = self._neighbour(i, side)
        if side is Side.UP:
            return self.arena_end if j is None else self.bands[j].byte_lo
        return self.header_end if j is None else self.bands[j].byte_hi

    def _inside(self, i: int) -> bool:
        """Whether band ``i`` lies within both limits of its gap."""
        b = self.bands[i]
        return self.limit(i, Side.DOWN) <= b.byte_lo and b.byte_hi <= self.limit(i, Side.UP)

    def room(self, i: int, side: Side) -> int:
        """How many units band ``i`` can add at ``side`` without moving anybody: the band
        after the extension lies within both limits of its gap (0 if it does not now)."""
        if not self._inside(i):
            return 0
        b = self.bands[i]
        if side is Side.UP:
            return max(0, (self.limit(i, Side.UP) - b.base) // b.unit_bytes - b.hi)
        return max(0, b.lo - _ceil_div(self.limit(i, Side.DOWN) - b.base, b.unit_bytes))

    def sides(self, i: int) -> list[Side]:
        """The sides band ``i`` may grow at, preferred first."""
        n = len(self.bands)
        if n == 1 or i == 0:
            return [Side.UP]
        if i == n - 1:
            return [Side.DOWN]
        return sorted((Side.UP, Side.DOWN), key=lambda s: -self.room(i, s))

    def describe(self) -> str:
        """The band table, one band a line: extent in units and bytes, free count."""
        rows = [f"arena [{self.header_end}, {self.arena_end}) bytes past the header"]
        for i, b in enumerate(self.bands):
            rows.append(
                f"  {b.name}: units [{b.lo}, {b.hi}) bytes [{b.byte_lo}, {b.byte_hi}) "
                f"free {b.free} reserved {self.reserved[i]} unit_bytes {b.unit_bytes}"
            )
        return "\n".join(rows)

    def check(self) -> None:
        """Raise :class:`~unimem.memory.errors.InternalError` (the band table in its message)
        if bands overlap, leave the arena, or have counts out of range. Runs in every mode."""
        problem = None
        prev_hi = self.header_end
        for i, b in enumerate(self.bands):
            if b.lo > b.hi:
                problem = f"{b.name}: lo {b.lo} > hi {b.hi}"
            elif not 0 <= self.reserved[i] <= b.free <= b.size:
                problem = f"{b.name}: free {b.free} (reserved {self.reserved[i]}) of {b.size}"
            elif b.size and b.byte_lo < prev_hi:
                problem = f"{b.name} overlaps the band below it"
            if problem is not None:
                break
            if b.size:
                prev_hi = b.byte_hi
        if problem is None and prev_hi > self.arena_end:
            problem = "a band runs past the arena end"
        if problem is not None:
            raise InternalError(f"band plan: {problem}\n{self.describe()}")

    # --- actions on the host state ------------------------------------------------------------

    def apply(self, a: Action) -> None:
        b = self.bands[a.band]
        if isinstance(a, Extend):
            if a.side is Side.UP:
                b.hi += a.n
            else:
                b.lo -= a.n
            b.free += a.n
        elif isinstance(a, Compact):
            if a.side is Side.UP:
                b.hi -= a.k
            else:
                b.lo += a.k
            b.free -= a.k
        else:
            b.lo = b.hi = a.at

    # --- planning -----------------------------------------------------------------------------

    def _anchor_for(self, i: int) -> int:
        """Where an empty band ``i`` should sit: a grid point inside its gap (both limits
        respected) — the lowest for the lowest band, the highest for the highest, the one
        nearest the middle for a middle band. When no grid point lies inside the gap, the
        first one above its lower limit (the band can then grow only up, once its upper
        neighbour retreats: :meth:`room` is 0 until then)."""
        b = self.bands[i]
        lo_b, hi_b = self.limit(i, Side.DOWN), self.limit(i, Side.UP)
        first = _ceil_div(lo_b - b.base, b.unit_bytes)  # lowest grid point >= lo_b
        last = (hi_b - b.base) // b.unit_bytes  # highest grid point <= hi_b
        n = len(self.bands)
        if last < first or n == 1 or i == 0:
            return first
        if i == n - 1:
            return last
        middle = _ceil_div((lo_b + hi_b) // 2 - b.base, b.unit_bytes)
        return min(max(middle, first), last)

    def _make_room(self, i: int, side: Side, need: int, out: list[Action]) -> bool:
        """Move neighbours at ``side`` until band ``i`` can extend there by ``need`` units."""
        b = self.bands[i]
        while self.room(i, side) < need:
            if not self._within_far_limit(i, side):
                return False  # moving the neighbour at ``side`` cannot make room
            j = self._neighbour(i, side)
            if j is None:
                return False
            nb = self.bands[j]
            if side is Side.UP:
                target = b.base + (b.hi + need) * b.unit_bytes
                k = _ceil_div(target - nb.base, nb.unit_bytes) - nb.lo
            else:
                target = b.base + (b.lo - need) * b.unit_bytes
                k = nb.hi - (target - nb.base) // nb.unit_bytes
            k = min(k, nb.size)
            short = k - (nb.free - self.reserved[j])
            if short > 0:
                # The neighbour needs more holes: extend its far side (may move its neighbour).
                if self._make_room(j, side, short, out):
                    self._do(Extend(j, side, short), out)
                else:
                    k = nb.free - self.reserved[j]
            if k <= 0:
                return False
            self._do(Compact(j, Side.DOWN if side is Side.UP else Side.UP, k), out)
        return True

    def _within_far_limit(self, i: int, side: Side) -> bool:
        """Whether band ``i`` respects the limit of its gap opposite ``side`` (what a move of
        the neighbour at ``side`` cannot change)."""
        b = self.bands[i]
        if side is Side.UP:
            return b.byte_lo >= self.limit(i, Side.DOWN)
        return b.byte_hi <= self.limit(i, Side.UP)

    def plan(self, demands: list[tuple[int, int]]) -> list[Action] | None:
        """Actions that leave each band ``i`` of ``demands`` with ``m`` more free units than
        earlier demands on it took, or None. Plans on a copy: ``self`` is unchanged.

        The common case — every band already holds the free units asked of it — needs no
        action and is answered without the copy (the plan would be empty and the layout,
        checked when it last changed, is unchanged).
        """
        asked = [0] * len(self.bands)
        for i, m in demands:
            if m > 0:
                asked[i] += m
        if all(a <= b.free - r for a, b, r in zip(asked, self.bands, self.reserved, strict=True)):
            return []
        sim = self.copy()
        out: list[Action] = []
        for i, m in demands:
            if m <= 0:
                continue
            if not sim._grow(i, sim.reserved[i] + m, out):
                return None
            sim.reserved[i] += m
        sim.check()
        return out

    def _grow(self, i: int, m: int, out: list[Action]) -> bool:
        """Append to ``out`` (and apply) actions giving band ``i`` at least ``m`` free units."""
        need = m - self.bands[i].free
        if need <= 0:
            return True
        if self.bands[i].size == 0:
            at = self._anchor_for(i)
            if at != self.bands[i].lo:
                self._do(Reanchor(i, at), out)
        for side in self.sides(i):
            if need == 0:
                break
            room = self.room(i, side)
            take = min(need, room)
            if take == need and room - need >= AHEAD_GAP_FACTOR * self.extend_ahead:
                take += self.extend_ahead  # a wide gap: take some more (class docstring)
            if take:
                self._do(Extend(i, side, take), out)
                need -= min(need, take)
        for side in self.sides(i):
            if need == 0:
                break
            self._make_room(i, side, need, out)
            take = min(need, self.room(i, side))
            if take:
                self._do(Extend(i, side, take), out)
                need -= take
        return need == 0

    def _do(self, act: Action, out: list[Action]) -> None:
        self.apply(act)
        out.append(act)
