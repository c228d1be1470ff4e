"""Host-side pools of ids that the host hands out itself.

Virtual ids (FULL virtual pages, STATE virtual slots, request-table rows) never move and are
chosen by the host, which therefore knows every request's ids without reading the device.
"""

from __future__ import annotations


class HostIdPool:
    """A LIFO pool of the integer ids ``[first, first + count)``.

    ``take(n)`` returns ``n`` ids or raises if fewer are free (callers check ``free`` first:
    running out is a scheduling decision, not an error). ``give`` returns ids; giving an id
    that is not taken is a bug and raises.
    """

    def __init__(self, first: int, count: int) -> None:
        if count < 0:
            raise ValueError(f"HostIdPool count must be >= 0, got {count}")
        self.first = first
        self.capacity = count
        # Lowest ids on top so that small runs use small ids (easier to read in dumps).
        self._free = list(range(first + count - 1, first - 1, -1))
        self._taken: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._taken)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"HostIdPool: {n} ids requested, {len(self._free)} free")
        if n == 0:
            return []
        ids = self._free[-n:][::-1]
        del self._free[-n:]
        self._taken.update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._taken:
                raise RuntimeError(f"HostIdPool: id {i} returned but not taken")
            self._taken.remove(i)
        self._free.extend(reversed(ids))
