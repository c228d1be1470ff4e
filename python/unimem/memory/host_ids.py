"""Host-side pools of ids that the host hands out itself.

Virtual ids (FULL virtual pages, STATE virtual slots, request-table rows) never move and are
chosen by the host, which therefore knows every request's ids without reading the device.
"""

from __future__ import annotations


class HostIdPool:
    """A LIFO pool of the integer ids ``[first, first + count)``.

    ``take(n)`` returns ``n`` ids or raises if fewer are free (callers check ``free`` first:
    running out is a scheduling decision, not an error). ``give`` returns ids; giving an id
    that is not taken is a bug and raises. Returned ids are handed out again first (last
    returned, first taken); after them the lowest never-used ids, ascending, so small runs use
    small ids. Never-used ids cost no memory: a pool may span millions of ids.
    """

    def __init__(self, first: int, count: int) -> None:
        if count < 0:
            raise ValueError(f"HostIdPool count must be >= 0, got {count}")
        self.first = first
        self.capacity = count
        self._next = first  # lowest id never handed out
        self._returned: list[int] = []  # stack: the top is handed out first
        self._taken: set[int] = set()

    @property
    def free(self) -> int:
        return self.capacity - len(self._taken)

    @property
    def used(self) -> int:
        return len(self._taken)

    def holds(self, i: int) -> bool:
        """Whether ``i`` is currently taken."""
        return i in self._taken

    def peek(self, n: int) -> list[int]:
        """The ids ``take(n)`` would return now, without taking them."""
        if n > self.free:
            raise RuntimeError(f"HostIdPool: {n} ids requested, {self.free} free")
        k = min(n, len(self._returned))
        ids = self._returned[len(self._returned) - k :][::-1]
        return ids + list(range(self._next, self._next + n - k))

    def take(self, n: int) -> list[int]:
        if n > self.free:
            raise RuntimeError(f"HostIdPool: {n} ids requested, {self.free} free")
        k = min(n, len(self._returned))
        ids = self._returned[len(self._returned) - k :][::-1]
        del self._returned[len(self._returned) - k :]
        fresh = n - k
        ids += range(self._next, self._next + fresh)
        self._next += fresh
        self._taken.update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._taken:
                raise RuntimeError(f"HostIdPool: id {i} returned but not taken")
            self._taken.remove(i)
        self._returned.extend(reversed(ids))
