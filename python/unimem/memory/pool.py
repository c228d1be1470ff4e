"""The interface the engine uses to hold KV pages and state slots, whatever backs them.

Two implementations: :class:`~unimem.memory.unified.UnifiedMemory` (one arena, virtual ids,
compaction) and :class:`~unimem.memory.static.StaticMemory` (the baseline: separate pools with
a split fixed at start-up, page ids used as they are). Both run the same model code.

Contract (what may be called when, what is always safe):

- Every method is host-driven and sync-free: the host decides how many units each request
  gets from lengths it already knows; device ops are launched in stream order and nothing is
  read back. Running out of memory is a *value* (``admit`` returns None, ``grow`` returns
  False, ``save_state`` returns None) and leaves the pool exactly as it was — the
  generation counter included: a failed ``admit`` makes no handle, so it uses no
  generation — and the scheduler then evicts or retracts.
- A broken invariant inside the pool (a bug, never bad input) raises
  :class:`~unimem.memory.errors.InternalError`, in every mode (no ``assert``). The band
  planner checks its plan before anything is executed, so an error there leaves the pool as
  it was; every call gives back what it took (rows, ids, holds) before the error propagates.
- ``req_to_token[row, pos]`` holds the *virtual* token id of position ``pos`` of the request
  at ``row``: ``vpage * page_size + offset``. Row 0, virtual page 0 and virtual state slot 0
  are never handed out: padded batch lanes point at them and resolve to the zero sink.
- ``full_v2p``/``swa_v2p``/``state_v2p`` are the device tables readers translate through
  (``None`` for ``full_v2p``/``state_v2p`` means ids are physical: the static baseline).
  They are allocated once: their addresses never change.
- Units are zeroed when handed out (FULL/SWA pages and state slots), so a fresh request's
  recurrent state is zero and no stale NaN can leak into a tile load.

Sharing (the prefix cache). A page may be held by several holders — requests and the prefix
cache — and the host counts them, per page and per kind:

- ``page_refs(p)``: holders of page ``p``'s FULL unit. Every request holds each page of its
  ``pages``; the cache holds the pages of its nodes. The page is unbound (FULL, and SWA if
  still bound) when the count reaches 0, and its virtual id goes back to the pool.
- SWA holders: a request holds the SWA unit of its pages from ``swa_start`` on; the cache
  holds the SWA units of the windows it retains. ``swa_bound(p)`` is true while any holder
  does. Policy: **an SWA unit is unbound exactly when its last SWA holder lets go** —
  ``retire_swa`` drops only the retiring request's hold, so a page whose window the cache
  keeps stays bound. An SWA holder always holds the page's FULL unit too, and a retired SWA
  unit is never bound again (its bytes are gone).
- State slots have one owner each: a request (``state_slot``) or the cache (a checkpoint
  made by ``save_state``, freed by ``free_states``).

Misuse is refused before anything changes. Every public operation checks all of its
arguments first — types, ranges, duplicates within one batch, handles that are not live — and
raises ``ValueError`` naming the argument, leaving the pool exactly as it was. The checks are
host work linear in the batch (no device read, no per-token loop):

- a :class:`RequestMemory` is a *handle* with a ``generation``; ``release`` invalidates it, and
  any later use of it is refused, whatever happened to its row since;
- a request appears at most once per batch, a page at most once per list, a slot at most once;
- what a live request holds cannot be let go through the sharing entry points: ``unref_pages``
  drops only holds taken by ``ref_pages``, ``free_states`` frees only checkpoint slots (not a
  request's own slot, not a slot that is not held — a second free is refused).
"""

from __future__ import annotations

import numbers
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

import unimem_kernel as uk
from unimem.memory.errors import InternalError
from unimem.memory.host_ids import HostIdPool
from unimem.memory.layout import MemoryLayout
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.staging import upload_int32

_PAIR_TYPES = {tuple, list}
_ROW = operator.attrgetter("row")

POISON_BYTE = 0xFF
"""Byte that makes every float format NaN; free units hold it in poison mode."""


@dataclass
class RequestMemory:
    """What one request holds, as the host knows it (no device reads needed).

    ``pages``: virtual FULL page ids by page column (the first ``shared`` of them came from a
    matched prefix); ``swa_start``: the request holds the SWA units of columns from
    ``swa_start`` on, not before (they were retired, or never needed: a resumed request starts
    at the first column of its window); ``state_slot``: virtual state slot (-1 when no STATE
    layers); ``generation``: which admission of its pool made this handle (unique per pool).
    The pool accepts a handle only while it is live: from ``admit`` until ``release``.
    """

    row: int
    state_slot: int
    pages: list[int] = field(default_factory=list)
    swa_start: int = 0
    shared: int = 0
    generation: int = 0


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix a new request resumes from (what a prefix-cache hit hands to ``admit``).

    ``pages``: the page ids of its first ``len(pages)`` columns (FULL bound; SWA bound over the
    window behind the prefix's end); ``checkpoint``: a state slot holding the recurrent state
    after the prefix's last token (-1 when the model has no STATE layers).
    """

    pages: tuple[int, ...]
    checkpoint: int = -1


@dataclass(frozen=True)
class FreedUnits:
    """Units an operation unbound (gave back to their band), and their bytes."""

    full: int = 0
    swa: int = 0
    state: int = 0
    bytes: int = 0

    def __add__(self, other: FreedUnits) -> FreedUnits:
        return FreedUnits(
            self.full + other.full,
            self.swa + other.swa,
            self.state + other.state,
            self.bytes + other.bytes,
        )


@dataclass
class MemoryStats:
    """Counters every pool keeps (host-side). ``retired_swa_pages`` counts SWA units unbound
    by ``retire_swa`` (a retirement that only drops one holder of a shared unit unbinds
    nothing)."""

    used_bytes: int = 0
    peak_bytes: int = 0
    capacity_bytes: int = 0
    compactions: int = 0
    moved_units: int = 0
    retired_swa_pages: int = 0


def _count(counts: dict[int, int], ids: list[int], delta: int) -> None:
    """Add ``delta`` to ``counts[i]`` for each id; drop entries that reach 0."""
    for i in ids:
        n = counts.get(i, 0) + delta
        if n:
            counts[i] = n
        else:
            del counts[i]


def bind_order(todo: list[tuple[RequestMemory, int]]) -> list[int]:
    """Indices into the fresh ids of ``todo``'s requests (handed out in ``todo`` order:
    request 0 gets the first ``n0``) listing the last request's block first, each block in
    its own order. A device free stack pops ``n`` ids at once as ``stack[top - n + i]`` for
    ``i < n``; binding in this order gives request 0 the top of the stack, request 1 the ids
    under them, and so on — what popping per request, in order, would do."""
    blocks = []
    at = 0
    for _, n in todo:
        blocks.append(range(at, at + n))
        at += n
    return [i for block in reversed(blocks) for i in block]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def as_int(name: str, value: object) -> int:
    """``value`` as an int; ``ValueError`` naming ``name`` for anything else (bools, floats,
    tensors included)."""
    if type(value) is int:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def as_list(name: str, values: object) -> list:
    """``values`` (any finite iterable but a string) as a list; ``ValueError`` otherwise."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a sequence, got {type(values).__name__}")
    try:
        return list(values)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{name} must be a sequence, got {type(values).__name__}") from None


def as_ids(name: str, values: object) -> list[int]:
    """A list of distinct ints (page ids, slot ids); ``ValueError`` naming ``name`` else."""
    ids = [as_int(f"{name}[{i}]", v) for i, v in enumerate(as_list(name, values))]
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for i, v in enumerate(ids):
            if v in seen:
                raise ValueError(f"{name}[{i}]: id {v} appears twice in one call")
            seen.add(v)
    return ids


class MemoryPool(ABC):
    """KV pages, SWA pages and state slots of one model, plus its request table."""

    def __init__(
        self, spec: MemorySpec, max_requests: int, max_context: int, device: torch.device
    ) -> None:
        if not isinstance(spec, MemorySpec):
            raise ValueError(f"spec must be a MemorySpec, got {type(spec).__name__}")
        max_requests = as_int("max_requests", max_requests)
        max_context = as_int("max_context", max_context)
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.spec = spec
        self.layout = MemoryLayout.build(spec)
        # Bytes of one unit of each kind the model has (host accounting reads them often).
        self._kind_bytes = tuple((k, self.layout.unit_bytes(k)) for k in spec.kinds)
        self._unit_bytes = {k: 0 for k in LayerKind} | dict(self._kind_bytes)
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
        self._page_offsets: torch.Tensor | None = None  # arange(page_size), made once
        self.stats = MemoryStats()
        self._usage_observers: list[Callable[[], None]] = []
        self.swa_window = spec.max_window
        self._has_state = spec.has(LayerKind.STATE)
        self._has_swa = spec.has(LayerKind.SWA)
        # Holders per page (host counts; a page absent from a dict has no holder of that kind).
        self._full_refs: dict[int, int] = {}
        self._swa_refs: dict[int, int] = {}
        # The part of those counts taken through ``ref_pages`` (the only holds ``unref_pages``
        # may drop: the rest belong to requests and go with ``release``).
        self._shared_full: dict[int, int] = {}
        self._shared_swa: dict[int, int] = {}
        # Live handles by row, their state slots (slot -> row), and the last generation made.
        self._live: dict[int, RequestMemory] = {}
        self._request_slots: dict[int, int] = {}
        self._generation = 0

    # --- tables readers translate through ------------------------------------------------------

    full_v2p: torch.Tensor | None
    swa_v2p: torch.Tensor | None
    state_v2p: torch.Tensor | None

    # --- argument checks (host only, linear in the batch) ---------------------------------------

    def check_request(self, req: object, name: str = "req") -> RequestMemory:
        """``req`` if it is a live handle of this pool; ``ValueError`` naming ``name`` if it is
        not a handle, was released (stale, whatever its row holds now) or is another pool's."""
        if not isinstance(req, RequestMemory):
            raise ValueError(f"{name} must be a RequestMemory, got {type(req).__name__}")
        live = self._live.get(req.row) if type(req.row) is int else None
        if live is not req:
            now = (
                f"row {req.row} now holds generation {live.generation}"
                if live is not None
                else f"row {req.row} is not in use"
            )
            raise ValueError(
                f"{name} is not a live request handle of this pool (generation "
                f"{req.generation}; released, or never admitted here): {now}"
            )
        return req

    def _check_batch(self, name: str, batch: object, what: str) -> list[tuple[RequestMemory, int]]:
        """``batch`` as ``(live handle, int)`` pairs, each request at most once."""
        fast = self._valid_batch(batch)
        if fast is not None:
            return fast
        out: list[tuple[RequestMemory, int]] = []
        rows: set[int] = set()
        for i, item in enumerate(as_list(name, batch)):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"{name}[{i}] must be a (request, {what}) pair, got {item!r}")
            req = self.check_request(item[0], f"{name}[{i}]")
            if req.row in rows:
                raise ValueError(f"{name}[{i}]: the request at row {req.row} appears twice")
            rows.add(req.row)
            out.append((req, as_int(f"{name}[{i}] {what}", item[1])))
        return out

    def _valid_batch(self, batch: object) -> list[tuple[RequestMemory, int]] | None:
        """``batch`` as a list if it is a list or tuple of ``(live handle, int)`` pairs
        (tuples or lists) with distinct rows — what the scheduler passes — checked by passes
        over the whole batch; else None: :meth:`_check_batch` then checks it item by item and
        names what is wrong."""
        if type(batch) is not list and type(batch) is not tuple:
            return None
        if not batch:
            return []
        if not set(map(type, batch)) <= _PAIR_TYPES or set(map(len, batch)) != {2}:
            return None
        reqs, values = zip(*batch, strict=True)
        if set(map(type, values)) != {int} or set(map(type, reqs)) != {RequestMemory}:
            return None
        rows = list(map(_ROW, reqs))
        if set(map(type, rows)) != {int} or len(set(rows)) != len(rows):
            return None
        if not all(map(operator.is_, map(self._live.get, rows), reqs)):
            return None
        return batch if type(batch) is list else list(batch)

    def _check_requests(self, name: str, reqs: object) -> list[RequestMemory]:
        """``reqs`` as live handles, each at most once."""
        out: list[RequestMemory] = []
        rows: set[int] = set()
        for i, req in enumerate(as_list(name, reqs)):
            self.check_request(req, f"{name}[{i}]")
            if req.row in rows:
                raise ValueError(f"{name}[{i}]: the request at row {req.row} appears twice")
            rows.add(req.row)
            out.append(req)
        return out

    def _check_slot(self, name: str, slot: object) -> int:
        """``slot`` if it is a held state slot (an int); ``ValueError`` naming ``name``."""
        s = as_int(name, slot)
        if not self._has_state:
            raise ValueError(f"{name}: the model has no STATE layers: there are no state slots")
        if not self._holds_state(s):
            raise ValueError(f"{name}: state slot {s} is not held (never made, or freed)")
        return s

    def check_checkpoint(self, slot: object, name: str = "slot") -> int:
        """``slot`` if it is a held state slot that no live request owns (a checkpoint, which
        ``free_states`` may free); ``ValueError`` naming ``name`` otherwise."""
        s = self._check_slot(name, slot)
        row = self._request_slots.get(s)
        if row is not None:
            raise ValueError(
                f"{name}: state slot {s} is the own slot of the live request at row {row}: "
                f"only release lets it go"
            )
        return s

    @staticmethod
    def _check_count(name: str, n: object) -> int:
        n = as_int(name, n)
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
        return n

    @staticmethod
    def _view(views: dict, key: object, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return views[key]
        except (KeyError, TypeError):
            have = ", ".join(repr(k) for k in views)
            raise ValueError(f"{name}: no view {key!r} in this pool (it has {have})") from None

    def _check_tokens(self, name: str, tokens: object) -> int:
        tokens = as_int(name, tokens)
        if not 1 <= tokens <= self.max_context:
            raise ValueError(f"{name} must be in [1, max_context={self.max_context}], got {tokens}")
        return tokens

    # --- request lifecycle ---------------------------------------------------------------------

    def admit(self, num_tokens: int, prefix: SharedPrefix | None = None) -> RequestMemory | None:
        """A request row, a state slot and pages for ``num_tokens`` tokens; None if they do
        not fit (nothing changes then).

        With ``prefix``, the request resumes at ``p = len(prefix.pages) * page_size``: its
        first columns are the shared pages (written into its row of the request table, one
        launch), its SWA hold starts at the first column of the window behind ``p``
        (``swa_start = swa_stop(p, len(pages))``: exactly what a request that computed the
        prefix itself would hold), its state slot is a device copy of the checkpoint, and it
        gets fresh pages for the rest of ``num_tokens`` (``>= p``). Raises ``ValueError`` if
        the prefix is not held as promised (a page without holders, a needed SWA unit
        retired, a checkpoint slot not taken): resuming there would read the sink.
        """
        num_tokens = self._check_tokens("num_tokens", num_tokens)
        shared: list[int] = []
        swa_start = 0
        if prefix is not None:
            if not isinstance(prefix, SharedPrefix):
                raise ValueError(f"prefix must be a SharedPrefix, got {type(prefix).__name__}")
            shared = as_ids("prefix.pages", prefix.pages)
            k = len(shared)
            if k * self.page_size > num_tokens:
                raise ValueError(
                    f"num_tokens {num_tokens} does not cover the {k}-page shared prefix "
                    f"({k * self.page_size} tokens)"
                )
            swa_start = self.swa_stop(k * self.page_size, k)
            self._check_prefix(prefix, swa_start)
        k = len(shared)
        if self._rows.free == 0:
            return None
        row = self._rows.peek(1)[0]  # taken once the request fits
        req = RequestMemory(
            row=row,
            state_slot=-1,
            pages=list(shared),
            swa_start=swa_start,
            shared=k,
            generation=self._generation + 1,
        )
        n = pages_for(num_tokens, self.page_size) - k
        slots = self._alloc([(req, n)] if n else [], 1 if self._has_state else 0)
        if slots is None:
            return None
        self._rows.take(1)
        self._generation += 1
        self._register(req, slots[0] if self._has_state else -1)
        if prefix is not None and k:
            self._add_refs(shared, shared[swa_start:] if self._has_swa else [])
            self._write_pages(shared, [req.row] * k, list(range(k)))
        if prefix is not None and self._has_state:
            self._copy_states([prefix.checkpoint], [req.state_slot])
        self._update_usage()
        return req

    def admit_many(self, token_counts: Sequence[int]) -> list[RequestMemory]:
        """Requests for ``token_counts[i]`` tokens each (no shared prefix), admitted in order
        until one does not fit; returns the admitted ones (a prefix of the list, possibly
        empty).

        Contract: the pool ends exactly as after that many :meth:`admit` calls one by one
        (stopping at the first None) — the same rows, pages, slots and generations, the same
        request table, the same virtual-to-physical tables and free stacks, the same band
        moves (compactions and the units they move) and the same statistics. The admissions
        are planned one by one on the host (:meth:`_plan_admissions`); runs of requests whose
        plans move no live unit (band extensions at most) are bound together, one upload and
        one bind / zero launch per kind for the run (the device pops the run's units from its
        free lists at once, each request getting the ids its own pop would), instead of per
        request; a plan that compacts a band starts a new run.

        If an allocator step raises (:class:`~unimem.memory.errors.InternalError`), the
        requests this call admitted are released, their rows come back, and the error
        propagates; nothing is leaked."""
        counts = [self._check_tokens(f"token_counts[{i}]", n) for i, n in enumerate(token_counts)]
        need = [pages_for(n, self.page_size) for n in counts]
        groups = self._plan_admissions(need[: self._rows.free])
        total = sum(size for _, size in groups)
        if total == 0:
            return []
        rows = self._rows.peek(total)  # taken group by group, as each one is allocated
        first = self._generation
        reqs = [
            RequestMemory(row=row, state_slot=-1, pages=[], swa_start=0, shared=0,
                          generation=first + 1 + i)
            for i, row in enumerate(rows)
        ]  # fmt: skip
        done = 0
        try:
            for plan, size in groups:
                group = reqs[done : done + size]
                todo = [(r, n) for r, n in zip(group, need[done : done + size], strict=True) if n]
                slots = self._alloc(todo, size if self._has_state else 0, plan)
                if slots is None:
                    raise InternalError(
                        f"admit_many: requests {done}..{done + size - 1} were planned to fit "
                        f"but their allocation failed"
                    )
                self._rows.take(size)
                self._generation = first + done + size
                for i, req in enumerate(group):
                    self._register(req, slots[i] if self._has_state else -1)
                done += size
        except BaseException:
            if done:
                self.release(reqs[:done])
            self._generation = first
            raise
        self._update_usage()
        return reqs

    def _plan_admissions(self, pages: list[int]) -> list[tuple[object, int]]:
        """How the longest prefix of requests needing ``pages[i]`` fresh pages (and a state
        slot each, with STATE layers) that fits one by one is allocated: ``(plan, size)``
        groups in order, each of ``size`` consecutive requests whose allocation is one
        :meth:`_alloc` call with that ``plan`` (None: the implementation plans itself).
        Host only; changes nothing. The default: every request that fits, in one group."""
        free = self._free_for_admission()
        if free is None:
            return [(None, len(pages))] if pages else []
        pages_left, slots_left = free
        fit = 0
        for n in pages:
            slots = 1 if self._has_state else 0
            if n > pages_left or slots > slots_left:
                break
            pages_left -= n
            slots_left -= slots
            fit += 1
        return [(None, fit)] if fit else []

    def _alloc_spare(
        self, todo: list[tuple[RequestMemory, int]], keep_free: int
    ) -> list[int] | None:
        """``_alloc(todo, 0)`` for pages handed out ahead of need: only from units free now
        (nothing moved or evicted for them) and only if ``keep_free`` pages stay free after,
        else None with nothing changed."""
        raise NotImplementedError

    def _free_for_admission(self) -> tuple[int, int] | None:
        """``(pages, state slots)`` admissions may take in total, for pools whose capacity
        is two counts (:meth:`_plan_admissions`' default); pools that plan otherwise override
        :meth:`_plan_admissions`."""
        raise NotImplementedError

    def _register(self, req: RequestMemory, state_slot: int) -> None:
        """An admitted request's bookkeeping: its fresh pages (past the shared prefix) held
        once, the request live, its state slot (``-1`` without STATE layers) recorded."""
        self._hold_fresh(req.pages[req.shared :])
        self._live[req.row] = req
        if self._has_state:
            req.state_slot = state_slot
            self._request_slots[state_slot] = req.row

    def grow(
        self,
        batch: Sequence[tuple[RequestMemory, int]],
        reserve: Callable[[], Sequence[int]] | None = None,
    ) -> bool:
        """Give every request pages for its target token count (``1..max_context``); all or
        nothing. A target the request already covers needs nothing.

        ``reserve``, called only when some request needs pages now (most steps need none),
        returns one token count per request, each at least its target (counts past
        ``max_context`` are capped there): every request is then given the pages for its
        count in the same allocation if the pool has them to spare (:meth:`_alloc_spare`:
        free without moving anything, with a page per request of the batch still free
        after), else only what the targets need. A batch then allocates once per several
        page boundaries instead of at each request's own (each allocation is a few launches
        and host work); pages held ahead come back with the request."""
        items = self._check_batch("batch", batch, "tokens")
        targets = [tokens for _, tokens in items]
        if targets and (min(targets) < 1 or max(targets) > self.max_context):
            for i, tokens in enumerate(targets):
                self._check_tokens(f"batch[{i}] tokens", tokens)
        if reserve is not None and not callable(reserve):
            raise ValueError(f"reserve must be a callable, got {type(reserve).__name__}")
        p = self.page_size
        todo = []
        for req, tokens in items:
            n = -(-tokens // p) - len(req.pages)
            if n > 0:
                todo.append((req, n))
        if not todo:
            return True
        if reserve is not None:
            counts = self._check_reserve(reserve(), targets)
            cap = self.max_context
            ahead = []
            for (req, _), r in zip(items, counts, strict=True):
                n = -(-min(r, cap) // p) - len(req.pages)
                if n > 0:
                    ahead.append((req, n))
            if ahead != todo and self._grow_by(ahead, keep_free=len(items)):
                return True
        return self._grow_by(todo)

    @staticmethod
    def _check_reserve(reserve: object, targets: list[int]) -> list[int]:
        """``reserve`` as ints, one per target, none below its target; ValueError naming the
        first that is not."""
        counts = as_list("reserve", reserve)
        if len(counts) != len(targets):
            raise ValueError(f"reserve has {len(counts)} counts for {len(targets)} requests")
        out = []
        for i, (r, tokens) in enumerate(zip(counts, targets, strict=True)):
            if type(r) is not int:
                r = as_int(f"reserve[{i}]", r)
            if r < tokens:
                raise ValueError(f"reserve[{i}] = {r} is below its request's target {tokens}")
            out.append(r)
        return out

    def _grow_by(self, todo: list[tuple[RequestMemory, int]], keep_free: int | None = None) -> bool:
        """Allocate ``todo``'s pages (all or nothing) and hold them; False if they do not fit
        (with ``keep_free``: if they are not to spare, :meth:`_alloc_spare`)."""
        before = [len(req.pages) for req, _ in todo]
        spare = keep_free is not None
        got = self._alloc_spare(todo, keep_free) if spare else self._alloc(todo, 0)
        if got is None:
            return False
        for (req, _), b in zip(todo, before, strict=True):
            self._hold_fresh(req.pages[b:])
        self._update_usage()
        return True

    def swa_stop(self, pos: int, num_pages: int) -> int:
        """The first page column a request whose next query sits at ``pos`` still attends to
        through its SWA layers (0 without SWA), capped at ``num_pages``: tokens at positions
        ``<= pos - window`` are never attended again, so column ``c`` is behind the window
        when ``(c + 1) * page_size <= pos - window + 1``."""
        if not self._has_swa:
            return 0
        return min(max(0, (pos - self.swa_window + 1) // self.page_size), num_pages)

    def retire_swa(self, batch: Sequence[tuple[RequestMemory, int]]) -> int:
        """Drop each request's hold on the SWA units wholly behind its window.

        ``batch`` pairs a request with the position of its next query (its committed length,
        ``0..`` the tokens its pages hold); columns below ``swa_stop(pos)`` are let go. A unit
        is unbound when its last holder lets go (one launch for the batch); a unit the prefix
        cache keeps stays bound. Returns the number of columns the requests let go.
        """
        items = self._check_batch("batch", batch, "pos")
        p = self.page_size
        behind = 1 - (self.swa_window or 0)  # swa_stop, inline: pos + behind over the page size
        todo = []  # only the requests that let something go
        for i, (req, pos) in enumerate(items):
            n = len(req.pages)
            if not 0 <= pos <= n * p:
                raise ValueError(
                    f"batch[{i}] pos must be in [0, {n * p}] (the tokens its pages hold), got {pos}"
                )
            stop = min(max(0, (pos + behind) // p), n)
            if stop > req.swa_start:
                todo.append((req, stop))
        if not self._has_swa:
            return 0
        drop: list[int] = []
        for req, stop in todo:
            drop += req.pages[req.swa_start : stop]
            req.swa_start = stop
        if drop:
            freed = self._drop_refs([], drop)
            self.stats.retired_swa_pages += freed.swa
            self._update_usage()
        return len(drop)

    def release(self, reqs: Sequence[RequestMemory]) -> FreedUnits:
        """Drop everything the requests hold and return their rows; their handles are stale
        from now on. Pages someone else still holds (the prefix cache, another request) stay
        bound. Returns what was unbound."""
        reqs = self._check_requests("reqs", reqs)
        full: list[int] = []
        swa: list[int] = []
        for req in reqs:
            full += req.pages
            if self._has_swa:
                swa += req.pages[req.swa_start :]
        slots = [req.state_slot for req in reqs if req.state_slot >= 0]
        freed = self._drop_refs(full, swa, slots)
        for req in reqs:
            del self._live[req.row]
            self._request_slots.pop(req.state_slot, None)
            self._rows.give([req.row])
            req.pages = []
            req.swa_start = 0
            req.shared = 0
            req.state_slot = -1
        self._update_usage()
        return freed

    # --- sharing: holders other than the request that allocated a page ---------------------------

    def page_refs(self, page: int) -> int:
        """Holders of page ``page``'s FULL unit (0: not bound)."""
        return self._full_refs.get(page, 0)

    def swa_bound(self, page: int) -> bool:
        """Whether page ``page``'s SWA unit is bound (some holder keeps it)."""
        return page in self._swa_refs

    def holders(self) -> tuple[dict[int, int], dict[int, int]]:
        """Copies of the host counts ``({page: FULL holders}, {page: SWA holders})`` of every
        bound page (checks and tests)."""
        return dict(self._full_refs), dict(self._swa_refs)

    def ref_pages(self, pages: Iterable[int], swa: Iterable[int] = ()) -> None:
        """Add a holder to the FULL unit of each of ``pages`` and to the SWA unit of each of
        ``swa`` (each page at most once per list). Host only. Raises ``ValueError`` for a page
        that is not bound (a unit cannot be revived once let go: callers share only what
        someone still holds) and for an SWA hold without a FULL hold of the same holder."""
        pages, swa = as_ids("pages", pages), as_ids("swa", swa)
        if swa and not self._has_swa:
            raise ValueError("swa: the model has no SWA layers")
        for i, p in enumerate(pages):
            if p not in self._full_refs:
                raise ValueError(f"pages[{i}]: page {p} has no holder: it cannot be shared")
        new_full = set(pages)
        for i, p in enumerate(swa):
            if p not in self._swa_refs:
                raise ValueError(
                    f"swa[{i}]: the SWA unit of page {p} is not bound: it cannot be shared"
                )
            full = self._shared_full.get(p, 0) + (p in new_full)
            if self._shared_swa.get(p, 0) + 1 > full:
                raise ValueError(
                    f"swa[{i}]: page {p}: an SWA hold needs a FULL hold of the same holder "
                    f"(ref the page in pages too)"
                )
        _count(self._shared_full, pages, 1)
        _count(self._shared_swa, swa, 1)
        self._add_refs(pages, swa)

    def unref_pages(self, pages: Iterable[int], swa: Iterable[int] = ()) -> FreedUnits:
        """Drop one holder taken by :meth:`ref_pages` from the FULL unit of each of ``pages``
        and the SWA unit of each of ``swa``; unbinds what no one holds any more (one launch
        per kind). A page's SWA hold must be dropped no later than its FULL hold. Raises
        ``ValueError`` for a hold ``ref_pages`` did not take: what a request holds goes with
        ``release`` / ``retire_swa``."""
        pages, swa = as_ids("pages", pages), as_ids("swa", swa)
        for name, ids, shared in (
            ("pages", pages, self._shared_full),
            ("swa", swa, self._shared_swa),
        ):
            for i, p in enumerate(ids):
                if shared.get(p, 0) < 1:
                    what = "" if name == "pages" else "SWA unit of "
                    raise ValueError(
                        f"{name}[{i}]: no holder taken by ref_pages holds the {what}page {p} "
                        f"(a request's holds go with release and retire_swa)"
                    )
        dropped_swa = set(swa)
        for i, p in enumerate(pages):
            if self._shared_swa.get(p, 0) - (p in dropped_swa) > self._shared_full[p] - 1:
                raise ValueError(
                    f"pages[{i}]: page {p}'s SWA hold must be dropped no later than its FULL "
                    f"hold (pass it in swa too)"
                )
        _count(self._shared_full, pages, -1)
        _count(self._shared_swa, swa, -1)
        freed = self._drop_refs(pages, swa)
        self._update_usage()
        return freed

    def save_state(self, slot: int) -> int | None:
        """A new state slot, owned by the caller, holding a device copy of slot ``slot``'s
        state (a checkpoint); None if no slot fits (nothing changes then). ``slot`` must be
        held (a request's slot or a checkpoint). Free it with :meth:`free_states`. Draft lanes
        of STATE ride along (they are part of the slot)."""
        if not self._has_state:
            raise ValueError("the model has no STATE layers: there is no state to save")
        src = self._check_slot("slot", slot)
        slots = self._alloc([], 1)
        if slots is None:
            return None
        self._copy_states([src], slots)
        self._update_usage()
        return slots[0]

    def free_states(self, slots: Sequence[int]) -> FreedUnits:
        """Unbind state slots made by :meth:`save_state` (one launch). Each must be held and
        listed once, and none may be a live request's own slot (``release`` frees those): a
        slot freed twice is refused."""
        ids = as_ids("slots", slots)
        for i, s in enumerate(ids):
            self.check_checkpoint(s, f"slots[{i}]")
        freed = self._drop_refs([], [], ids)
        self._update_usage()
        return freed

    def copy_states(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the bytes of state slot ``src[i]`` onto slot ``dst[i]`` (virtual slots; the
        physical ones are gathered on the device through ``state_v2p``: no host read). One
        launch. Slots must be held, ``dst`` distinct and disjoint from ``src``."""
        src_ids = [self._check_slot(f"src[{i}]", v) for i, v in enumerate(as_list("src", src))]
        dst_ids = [self._check_slot(f"dst[{i}]", v) for i, v in enumerate(as_ids("dst", dst))]
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"copy_states: {len(src_ids)} sources, {len(dst_ids)} destinations")
        both = set(src_ids) & set(dst_ids)
        if both:
            raise ValueError(f"dst: slot {min(both)} is also a source")
        self._copy_states(src_ids, dst_ids)

    def _copy_states(self, src: list[int], dst: list[int]) -> None:
        n = len(src)
        if n == 0:
            return
        ids = self.physical_state_slots(upload_int32(src + dst, self.device))
        buf, base = self._unit_buffer(LayerKind.STATE)
        ub = self.layout.unit_bytes(LayerKind.STATE)
        uk.copy_units(buf, base, ub, ids[:n].contiguous(), ids[n:].contiguous())

    def _check_prefix(self, prefix: SharedPrefix, swa_start: int) -> None:
        pages = as_ids("prefix.pages", prefix.pages)
        k = len(pages)
        if k == 0:
            raise ValueError("prefix.pages: a shared prefix needs at least one page")
        if k > self.max_pages_per_request:
            raise ValueError(
                f"prefix.pages: a {k}-page prefix exceeds {self.max_pages_per_request} pages"
            )
        for c, p in enumerate(pages):
            if p not in self._full_refs:
                raise ValueError(f"prefix.pages[{c}]: page {p} has no holder")
            if self._has_swa and c >= swa_start and p not in self._swa_refs:
                raise ValueError(
                    f"prefix.pages[{c}]: page {p}'s SWA unit is retired but lies in the "
                    f"window behind the resume point (columns {swa_start}..{k - 1})"
                )
        ckpt = as_int("prefix.checkpoint", prefix.checkpoint)
        if self._has_state and not self._holds_state(ckpt):
            raise ValueError(f"prefix.checkpoint {ckpt} is not a held state slot")
        if not self._has_state and ckpt != -1:
            raise ValueError(f"prefix.checkpoint must be -1 without STATE layers, got {ckpt}")

    # --- host reference counts -------------------------------------------------------------------

    def _hold_fresh(self, pages: list[int]) -> None:
        """Freshly bound pages: one holder (the request), FULL and SWA."""
        for p in pages:
            self._full_refs[p] = 1
            if self._has_swa:
                self._swa_refs[p] = 1

    def _add_refs(self, pages: list[int], swa: list[int]) -> None:
        for p in pages:
            self._full_refs[p] += 1
        for p in swa:
            self._swa_refs[p] += 1

    def _drop_refs(self, full: list[int], swa: list[int], slots: Sequence[int] = ()) -> FreedUnits:
        """Drop one holder per entry (SWA first, then FULL), then unbind the units that lost
        their last holder together with ``slots``. Each unit is unbound at most once, so a
        page shared by two released requests is pushed once. Callers have checked that every
        entry has a holder to drop."""
        swa_free: list[int] = []
        for p in swa:
            n = self._swa_refs[p] - 1
            if n:
                self._swa_refs[p] = n
            else:
                del self._swa_refs[p]
                swa_free.append(p)
        full_free: list[int] = []
        for p in full:
            n = self._full_refs[p] - 1
            if n:
                self._full_refs[p] = n
                continue
            del self._full_refs[p]
            full_free.append(p)
        if full_free or swa_free or slots:
            self._free_units(full_free, swa_free, list(slots))
        ub = self._unit_bytes
        nbytes = (
            len(full_free) * ub[LayerKind.FULL]
            + len(swa_free) * ub[LayerKind.SWA]
            + len(slots) * ub[LayerKind.STATE]
        )
        return FreedUnits(len(full_free), len(swa_free), len(slots), nbytes)

    def _write_pages(self, pages: list[int], rows: list[int], cols: list[int]) -> None:
        """``req_to_token[rows[i], cols[i] * P + o] = pages[i] * P + o`` (one upload, one
        scatter; no host read). Used for pages that are already bound (shared ones)."""
        n = len(pages)
        if n == 0:
            return
        packed = upload_int32(list(pages) + list(rows) + list(cols), self.device)
        self._write_page_rows(packed[:n], packed[n : 2 * n], packed[2 * n :])

    def _write_page_rows(self, pages: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
        p = self.page_size
        offs = self._page_offsets
        if offs is None:
            offs = self._page_offsets = torch.arange(p, device=self.device, dtype=torch.int32)
        flat = rows.long() * self.req_to_token.shape[1] + cols * p
        self.req_to_token.view(-1)[flat[:, None] + offs] = pages[:, None] * p + offs

    # --- views -----------------------------------------------------------------------------------

    @abstractmethod
    def kv_cache(self, kind: LayerKind, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K view ``[num_pages, page_size, H, Dk]`` and V view ``[..., Dv]`` of one lane."""

    @abstractmethod
    def state_cache(self, lane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv view ``[num_slots, *conv_shape]`` and SSM view ``[num_slots, *ssm_shape]``."""

    def physical_state_slots(self, vslots: torch.Tensor) -> torch.Tensor:
        """Physical slots of virtual state slots (device gather; -1 for unbound slots and for
        negative ``vslots``: padded lanes of a fixed-size batch)."""
        if self.state_v2p is None:
            return vslots
        out = torch.empty_like(vslots)
        uk.translate_slots(vslots.contiguous(), self.state_v2p, out)  # one launch on CUDA
        return out

    # --- accounting ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes of units currently holding data (host counts)."""
        return sum(self.live_units(k) * ub for k, ub in self._kind_bytes)

    def _update_usage(self) -> None:
        used = self.used_bytes()
        self.stats.used_bytes = used
        self.stats.peak_bytes = max(self.stats.peak_bytes, used)
        for observer in self._usage_observers:
            observer()

    def add_usage_observer(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` after every operation that changes what the pool holds
        (host bookkeeping only, right after ``stats`` is updated): recorders that want
        every intermediate level, not only the level between calls."""
        self._usage_observers.append(observer)

    def remove_usage_observer(self, observer: Callable[[], None]) -> None:
        """Stop calling ``observer`` (added by :meth:`add_usage_observer`)."""
        self._usage_observers.remove(observer)

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
    def _alloc(
        self, todo: list[tuple[RequestMemory, int]], n_slots: int, plan: object = None
    ) -> list[int] | None:
        """Append ``n`` fresh pages to each ``(req, n)`` of ``todo`` (FULL, and SWA when
        present), writing them into the request table, and bind ``n_slots`` zeroed state
        slots, returned. All or nothing: None leaves everything as it was; so does an
        :class:`~unimem.memory.errors.InternalError` raised while planning. ``plan``: what
        :meth:`_plan_admissions` made for this call (None: plan now).

        Device ids are popped in reverse request order (:func:`bind_order`), so that the
        requests of ``todo`` get the physical units that the same allocations one request
        after another would give them."""

    @abstractmethod
    def _free_units(self, full: list[int], swa: list[int], slots: list[int]) -> None:
        """Unbind these FULL pages, SWA units (by page id) and state slots, each listed once
        (one launch per kind), and give their ids back."""

    @abstractmethod
    def _holds_state(self, slot: int) -> bool:
        """Whether state slot ``slot`` is handed out."""

    @abstractmethod
    def _unit_buffer(self, kind: LayerKind) -> tuple[torch.Tensor, int]:
        """``(buffer, base)``: the byte tensor holding units of ``kind`` and the byte offset of
        its unit 0 (physical unit ``u`` spans ``base + u * unit_bytes``)."""
