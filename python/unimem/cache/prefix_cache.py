"""Prefix cache for hybrid models: shared FULL pages, SWA windows, state checkpoints.

A cached prefix is reusable only where all three kinds of memory exist at its end: FULL K/V
for every token, SWA K/V for the window behind the point where the new request continues,
and the recurrent state at exactly that point. The cache keeps, in a page-granular radix tree
(:mod:`unimem.cache.radix`):

- **FULL pages** of every cached page (one holder per node, counted by the pool);
- **anchors**: resume points made on insertion. Behind each anchor the SWA units of
  ``window_pages = ceil(max(W, page_size) / page_size)`` pages are kept (the window a request
  resuming there attends to, page-aligned); older SWA units are not held by the cache and
  retire when their requests let go. For models with STATE layers an anchor also holds a
  **checkpoint**: a state slot with a copy of the recurrent state after its last token.
  Anchors exist only at page boundaries ``k`` with ``k % checkpoint_interval == 0``.

``match`` returns the longest prefix whose end has all three (a model without SWA needs no
window, one without STATE no checkpoint; a FULL-only model can resume at any page boundary).
It never returns a point lacking one: there the pool would hand attention the zero sink.

Who holds what. The pool counts holders per page (requests and the cache); a unit is unbound
when its last holder lets go. A node whose page a running request also holds is *locked*: it
is never evicted (evicting it would free nothing). Eviction is LRU over unlocked leaves,
leaves that are not resume points first (they can serve no match); when those are not
enough, the anchors of the remaining (locked) nodes are dropped, LRU: their checkpoint slots
and the SWA units only their windows keep are freed, and they stop being resume points.
Nothing here reads the device; device work (copying a checkpoint, writing shared pages into a
request row, unbinding) is launched by the pool, sync-free.

Contract for the engine (see ``docs/prefix_cache.md``):

- admission: :meth:`PrefixCache.admit` instead of ``pool.admit`` — the request's memory and
  how many leading tokens it skips (its ``kv_len`` starts there);
- insertion: :meth:`PrefixCache.insert` when a request's committed length reaches an anchor
  point (a chunk boundary on the interval) and on finish, *before* ``retire_swa`` of that step
  and before ``release``: the window must still be held;
- memory pressure: :meth:`PrefixCache.evict` before retracting a running request (then
  :meth:`PrefixCache.flush` only if eviction freed nothing).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from unimem.cache.radix import Node, RadixTree
from unimem.memory.errors import require
from unimem.memory.pool import (
    FreedUnits,
    MemoryPool,
    RequestMemory,
    SharedPrefix,
    as_int,
    pages_for,
)
from unimem.memory.spec import LayerKind


@dataclass(frozen=True)
class MatchResult:
    """The longest resumable cached prefix of a query.

    ``num_tokens``: tokens a request may skip (a multiple of the page size; 0 = miss);
    ``pages``: their page ids; ``checkpoint``: the state slot to start from (-1 without STATE
    layers or on a miss); ``full_tokens``: tokens whose FULL pages are cached along the query
    (``>= num_tokens``: the gap is what a cache that ignored SWA and state would wrongly
    claim). Valid until the cache next changes (insert, evict, flush).
    """

    num_tokens: int
    pages: tuple[int, ...]
    checkpoint: int
    full_tokens: int
    nodes: tuple[Node, ...] = field(default=(), repr=False, compare=False)

    @property
    def prefix(self) -> SharedPrefix | None:
        """What ``pool.admit`` needs to resume here (None on a miss)."""
        return SharedPrefix(self.pages, self.checkpoint) if self.pages else None


@dataclass(frozen=True)
class Admission:
    """A request admitted by the cache: its memory, and ``prefix_tokens`` leading tokens whose
    K/V and state it already has (its ``kv_len`` starts there)."""

    mem: RequestMemory
    prefix_tokens: int


@dataclass(frozen=True)
class Insertion:
    """What :meth:`PrefixCache.insert` did: ``tokens`` resumable at the insertion point (0 when
    no anchor exists there); ``checkpoint``: the state slot of the anchor this call made (a
    copy of the request's state, or the ``checkpoint`` it was handed), now owned by the cache;
    -1 when it made none (no STATE layers, an anchor already there, or none possible)."""

    tokens: int
    checkpoint: int = -1


@dataclass
class CacheStats:
    """Counters (``lookups`` .. ``evicted_bytes``) and gauges (``cached_pages`` ..
    ``anchors``: what the cache holds now)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    full_hit_tokens: int = 0
    inserts: int = 0
    inserted_pages: int = 0
    adopted_pages: int = 0
    window_misses: int = 0
    checkpoint_failures: int = 0
    checkpoints_saved: int = 0
    evictions: int = 0
    dropped_anchors: int = 0
    evicted_bytes: int = 0
    cached_pages: int = 0
    retained_swa_pages: int = 0
    checkpoints: int = 0
    anchors: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the cache."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def as_dict(self) -> dict:
        """The counters and gauges by name, with ``hit_rate``. The fields are plain ints, so
        the instance's ``__dict__`` is copied (the server publishes this every engine step;
        ``dataclasses.asdict`` deep-copied each field: ~16 µs of the engine thread a step)."""
        return {**vars(self), "hit_rate": self.hit_rate}


class PrefixCache:
    """Prefix cache over ``pool``; anchors every ``checkpoint_interval`` pages at most."""

    def __init__(self, pool: MemoryPool, checkpoint_interval: int = 1) -> None:
        if not isinstance(pool, MemoryPool):
            raise ValueError(f"pool must be a MemoryPool, got {type(pool).__name__}")
        if type(checkpoint_interval) is not int or checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be an int >= 1, got {checkpoint_interval}")
        self.pool = pool
        self.page_size = pool.page_size
        self.checkpoint_interval = checkpoint_interval
        self.has_swa = pool.spec.has(LayerKind.SWA)
        self.has_state = pool.spec.has(LayerKind.STATE)
        p = self.page_size
        self.window_pages = pages_for(max(pool.swa_window, p), p) if self.has_swa else 0
        self.tree = RadixTree(p)
        self.stats = CacheStats()
        self._clock = 0
        self._checkpoints: set[int] = set()  # the anchors' checkpoint slots

    # --- lookup ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """The longest prefix of ``tokens`` (whole pages) with FULL pages for every token, the
        SWA units of the ``window_pages`` pages behind its end (all of them when it is
        shorter) and, with STATE layers, a checkpoint at its end. Host only; changes nothing.
        """
        path = self.tree.walk(_token_seq("tokens", tokens))
        best, run = 0, 0
        for d, node in enumerate(path, start=1):
            run = run + 1 if node.swa else 0
            if self._resumable_at(node, d, run):
                best = d
        nodes = tuple(path[:best])
        ckpt = nodes[-1].checkpoint if nodes and self.has_state else -1
        return MatchResult(
            num_tokens=best * self.page_size,
            pages=tuple(n.page for n in nodes),
            checkpoint=ckpt,
            full_tokens=len(path) * self.page_size,
            nodes=nodes,
        )

    def _resumable_at(self, node: Node, depth: int, swa_run: int) -> bool:
        window_ok = not self.has_swa or swa_run >= min(depth, self.window_pages)
        state_ok = not self.has_state or node.checkpoint >= 0
        return window_ok and state_ok

    def admit(self, tokens: Sequence[int], chunk: int) -> Admission | None:
        """Admit a request whose next forwards compute ``tokens`` (prompt plus output so far),
        resuming at the longest cached prefix of ``tokens[:-1]`` (at least one token is always
        computed, so the last one yields logits); its memory covers the prefix plus ``chunk``
        more tokens at most. When the pool is full, unlocked cache entries are evicted (never
        the matched path) until the request fits or nothing is left to evict. None: it does
        not fit (the pool is as it was, less what was evicted)."""
        chunk = as_int("chunk", chunk)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if len(_token_seq("tokens", tokens)) == 0:
            raise ValueError("tokens: a request needs at least one token")
        if self.pool.free_rows == 0:
            return None
        m = self.match(tokens[: len(tokens) - 1])
        need = m.num_tokens + min(len(tokens) - m.num_tokens, chunk)
        # While evicting to make room, the matched path must survive: its nodes are pinned,
        # and its window is covered, since the anchor whose window holds it may lie deeper
        # (and be evicted).
        for n in m.nodes:
            n.pins += 1
        if m.nodes:
            self._cover(m.nodes[-1])
        try:
            mem = self.pool.admit(need, m.prefix)
            while mem is None:
                if self.evict(self._demand_bytes(need - m.num_tokens)).bytes == 0:
                    return None
                mem = self.pool.admit(need, m.prefix)
        finally:
            for n in m.nodes:
                n.pins -= 1
            if m.nodes:
                self._uncover(m.nodes[-1])
        s = self.stats
        s.lookups += 1
        s.lookup_tokens += len(tokens)
        s.hit_requests += m.num_tokens > 0
        s.hit_tokens += m.num_tokens
        s.full_hit_tokens += m.full_tokens
        self._touch(m.nodes)
        return Admission(mem, m.num_tokens)

    def _demand_bytes(self, tokens: int) -> int:
        lay, n = self.pool.layout, pages_for(tokens, self.page_size)
        kinds = self.pool.spec.kinds
        total = n * lay.unit_bytes(LayerKind.FULL) if LayerKind.FULL in kinds else 0
        if self.has_swa:
            total += n * lay.unit_bytes(LayerKind.SWA)
        if self.has_state:
            total += lay.unit_bytes(LayerKind.STATE)
        return max(total, 1)

    # --- insertion -------------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], req: RequestMemory, checkpoint: int | None = None
    ) -> Insertion:
        """Cache the prefix ``tokens`` held by ``req``: ``len(tokens)`` is the request's
        committed length (its state slot holds the state after exactly these tokens), and
        ``req.pages[c]`` holds page column ``c`` of them.

        ``checkpoint``: a state slot already holding the state after exactly ``tokens`` (a
        snapshot taken when that state was current — the engine takes one when a later step
        may advance the request's slot before this call). The cache takes it over: it becomes
        the anchor's checkpoint, or is freed if no checkpoint is made here. Without it, a
        checkpoint is copied from ``req``'s slot.

        The resume point is ``k = len(tokens) // page_size`` pages, rounded down to the
        interval (with STATE layers ``len(tokens)`` must be ``k * page_size`` exactly: the
        state exists only there). An anchor is made at ``k`` only if the window behind it is
        still bound — held by the cache, by anyone, or by ``req`` itself (then a node whose
        own SWA unit is gone adopts ``req``'s page) — and, with STATE layers, a checkpoint
        slot fits. Only then are the missing nodes of the path created (sharing ``req``'s
        FULL pages): pages that could never be resumed from are not cached. Returns the tokens
        resumable at the insertion point and the checkpoint slot of the anchor made.

        ``ValueError`` before anything changes (``checkpoint`` then stays the caller's) when
        ``req`` is not a live handle, ``tokens`` are not token ids or exceed ``req``'s pages,
        or ``checkpoint`` is not a held slot, is a live request's own slot or is already an
        anchor's.
        """
        tokens = _token_seq("tokens", tokens)
        self.pool.check_request(req, "req")
        k = len(tokens) // self.page_size
        if len(req.pages) < k:
            raise ValueError(
                f"tokens: {len(tokens)} tokens span {k} pages, the request holds {len(req.pages)}"
            )
        if checkpoint is not None:
            if not self.has_state:
                raise ValueError("checkpoint: given, but the model has no STATE layers")
            checkpoint = self.pool.check_checkpoint(checkpoint, "checkpoint")
            if checkpoint in self._checkpoints:
                raise ValueError(f"checkpoint: slot {checkpoint} is already an anchor's")
        k = self._anchor_pages(len(tokens))
        keys = [self.tree.key(tokens, c) for c in range(k)]  # checks the token ids
        made = -1
        try:
            made, got = self._insert(keys, req, checkpoint)
        finally:
            if checkpoint is not None and made != checkpoint:
                self.pool.free_states([checkpoint])
        return Insertion(got, made)

    def _anchor_pages(self, num_tokens: int) -> int:
        """The pages an insertion of ``num_tokens`` tokens caches: whole pages, rounded down to
        the interval where an anchor needs a window or a checkpoint (0: none; with STATE
        layers the state exists only at exactly ``num_tokens``)."""
        p = self.page_size
        k = num_tokens // p
        if not self.has_swa and not self.has_state:
            return k
        if self.has_state and (num_tokens != k * p or k % self.checkpoint_interval):
            return 0
        return k - k % self.checkpoint_interval

    def _insert(
        self, keys: list[tuple[int, ...]], req: RequestMemory, checkpoint: int | None
    ) -> tuple[int, int]:
        """:meth:`insert` of the pages keyed ``keys`` on checked arguments: ``(checkpoint
        made, tokens resumable)``."""
        p = self.page_size
        k = len(keys)
        self.stats.inserts += 1
        if k == 0:
            return -1, 0
        if not self.has_swa and not self.has_state:
            self._touch(self._extend_path(keys, req))
            return -1, k * p
        path = self.tree.walk_keys(keys)
        if len(path) == k and path[-1].anchor:
            self._touch(path)
            return -1, k * p
        adopt = self._window_plan(path, req, k)
        if adopt is None:
            self.stats.window_misses += 1
            return -1, 0
        ckpt = -1
        if self.has_state:
            saved = self.pool.save_state(req.state_slot) if checkpoint is None else checkpoint
            if saved is None:
                self.stats.checkpoint_failures += 1
                return -1, 0
            ckpt = saved
            self.stats.checkpoints_saved += 1
            self.stats.checkpoints += 1
        path = self._extend_path(keys, req)
        for c in adopt:
            self._adopt(path[c], req.pages[c])
        self._anchor(path[k - 1], ckpt)
        self._touch(path)
        return ckpt, k * p

    def _window_plan(self, path: list[Node], req: RequestMemory, k: int) -> list[int] | None:
        """Columns of the window behind ``k`` whose node must adopt ``req``'s page; None if
        some column's SWA unit is gone for good (no anchor can be made at ``k``)."""
        adopt = []
        for c in range(max(0, k - self.window_pages), k):
            node = path[c] if c < len(path) else None
            page = node.page if node is not None else req.pages[c]
            if (node is not None and node.swa) or self.pool.swa_bound(page):
                continue
            if self.pool.swa_bound(req.pages[c]):
                adopt.append(c)
                continue
            return None
        return adopt

    def _extend_path(self, keys: list[tuple[int, ...]], req: RequestMemory) -> list[Node]:
        """The path of the pages keyed ``keys``, creating missing nodes with ``req``'s pages
        (the cache takes a FULL hold on each)."""
        path = self.tree.walk_keys(keys)
        parent = path[-1] if path else self.tree.root
        new = req.pages[len(path) : len(keys)]
        self.pool.ref_pages(new)
        for c, page in enumerate(new, start=len(path)):
            parent = self.tree.add(parent, keys[c], page)
            path.append(parent)
        self.stats.inserted_pages += len(new)
        self.stats.cached_pages += len(new)
        return path

    def _adopt(self, node: Node, page: int) -> None:
        """``node`` (whose SWA unit is gone) takes over ``page`` (same tokens, SWA bound)."""
        self.pool.ref_pages([page])
        self.pool.unref_pages([node.page])
        node.page = page
        self.stats.adopted_pages += 1

    def _anchor(self, node: Node, checkpoint: int) -> None:
        self._cover(node)
        node.anchor = True
        node.checkpoint = checkpoint
        if checkpoint >= 0:
            self._checkpoints.add(checkpoint)
        self.stats.anchors += 1

    def _unanchor(self, node: Node) -> FreedUnits:
        freed = self._uncover(node)
        if node.checkpoint >= 0:
            freed += self.pool.free_states([node.checkpoint])
            self._checkpoints.discard(node.checkpoint)
            node.checkpoint = -1
            self.stats.checkpoints -= 1
        node.anchor = False
        self.stats.anchors -= 1
        return freed

    def _cover(self, node: Node) -> None:
        """Count one more user of the window behind ``node``; hold the SWA units not held."""
        take = []
        for n in node.window(self.window_pages):
            n.window_refs += 1
            if not n.swa:
                n.swa = True
                take.append(n.page)
        self.pool.ref_pages([], take)
        self.stats.retained_swa_pages += len(take)

    def _uncover(self, node: Node) -> FreedUnits:
        """Undo one :meth:`_cover`; SWA units no window needs any more are let go."""
        drop = []
        for n in node.window(self.window_pages):
            n.window_refs -= 1
            if n.window_refs == 0:
                n.swa = False
                drop.append(n.page)
        self.stats.retained_swa_pages -= len(drop)
        return self.pool.unref_pages([], drop)

    def _touch(self, nodes: Sequence[Node]) -> None:
        self._clock += 1
        for n in nodes:
            n.last_access = self._clock

    # --- eviction --------------------------------------------------------------------------------

    def evict(self, num_bytes: int) -> FreedUnits:
        """Free at least ``num_bytes`` bytes of units the cache holds, or all it can without
        touching what running requests use. Returns what was unbound.

        1. Unlocked, unpinned leaves are evicted — those that are no resume point first, then
           least recently used (a parent may become such a leaf).
        2. If that is not enough, the anchors left (nodes locked by a running request, or
           above one; pinned nodes excepted) are dropped, least recently used first (deeper
           first on ties): each gives back its checkpoint slot and the SWA units of its window
           that no other window needs. The nodes stay (their FULL pages are in use) but are no
           resume point any more, so ``match`` no longer ends there. An anchor that would free
           nothing (no checkpoint, and its window's SWA units still held by a request or
           another window) is kept.
        """
        num_bytes = as_int("num_bytes", num_bytes)
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        freed = FreedUnits()
        if num_bytes == 0:
            return freed
        heap = [(self._priority(n), id(n), n) for n in self.tree.nodes() if self._evictable(n)]
        heapq.heapify(heap)
        while heap and freed.bytes < num_bytes:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._remove(node)
            self.stats.evictions += 1
            if parent is not self.tree.root and self._evictable(parent):
                heapq.heappush(heap, (self._priority(parent), id(parent), parent))
        if freed.bytes < num_bytes:
            freed += self._drop_anchors(num_bytes - freed.bytes)
        return freed

    def _drop_anchors(self, num_bytes: int) -> FreedUnits:
        """Phase 2 of :meth:`evict`: drop unpinned anchors (LRU, deeper first on ties) until
        ``num_bytes`` bytes were unbound or no anchor would free anything."""
        freed = FreedUnits()
        anchors = [n for n in self.tree.nodes() if n.anchor and n.pins == 0]
        if not anchors:
            return freed
        anchors.sort(key=lambda n: (n.last_access, -n.depth))
        # SWA holders per page, taken once: it stays right for every node that still holds
        # its SWA unit (dropping a cover either lets the node's unit go or leaves it alone).
        swa_refs = self.pool.holders()[1] if self.has_swa else {}
        progress = True
        while progress and freed.bytes < num_bytes:
            progress = False
            for node in anchors:
                if freed.bytes >= num_bytes:
                    break
                if not node.anchor or not self._frees_on_drop(node, swa_refs):
                    continue
                got = self._unanchor(node)
                freed += got
                self.stats.dropped_anchors += 1
                self.stats.evicted_bytes += got.bytes
                progress = True
        return freed

    def _frees_on_drop(self, node: Node, swa_refs: dict[int, int]) -> bool:
        """Whether dropping the anchor ``node`` unbinds anything: its checkpoint, or an SWA
        unit only its window keeps (the cache's is the only hold)."""
        if node.checkpoint >= 0:
            return True
        return any(
            w.window_refs == 1 and swa_refs.get(w.page, 0) == 1
            for w in node.window(self.window_pages)
        )

    def flush(self) -> FreedUnits:
        """Drop everything the cache holds, locked nodes included (running requests keep
        their own holds, so their pages stay bound)."""
        freed = FreedUnits()
        for node in list(self.tree.nodes()):
            freed += self._remove(node)
        return freed

    def _evictable(self, node: Node) -> bool:
        return node.is_leaf and node.pins == 0 and self.pool.page_refs(node.page) == 1

    def _priority(self, node: Node) -> tuple[bool, int]:
        resumable = node.anchor or not (self.has_swa or self.has_state)
        return resumable, node.last_access

    def _remove(self, node: Node) -> FreedUnits:
        freed = self._unanchor(node) if node.anchor else FreedUnits()
        freed += self.pool.unref_pages([node.page], [node.page] if node.swa else [])
        if node.swa:
            self.stats.retained_swa_pages -= 1
        self.tree.remove_leaf(node)
        self.stats.cached_pages -= 1
        self.stats.evicted_bytes += freed.bytes
        return freed

    # --- inspection ------------------------------------------------------------------------------

    def held(self) -> tuple[list[int], list[int], list[int]]:
        """``(pages, swa_pages, checkpoint_slots)`` the cache holds (checks and tests)."""
        nodes = list(self.tree.nodes())
        return (
            [n.page for n in nodes],
            [n.page for n in nodes if n.swa],
            [n.checkpoint for n in nodes if n.checkpoint >= 0],
        )

    def check(self) -> None:
        """Check the cache's own invariants (host only; tests and debugging): raises
        :class:`~unimem.memory.errors.InternalError` naming the first broken one."""
        nodes = list(self.tree.nodes())
        require(len(nodes) == self.tree.size == self.stats.cached_pages, "node count")
        require(len({n.page for n in nodes}) == len(nodes), "a page is cached twice")
        refs: dict[int, int] = {id(n): 0 for n in nodes}
        for n in nodes:
            require(
                n.depth == n.parent.depth + 1 and n.pins == 0,
                "invariant broken: n.depth == n.parent.depth + 1 and n.pins == 0",
            )
            require(self.pool.page_refs(n.page) >= 1, f"cached page {n.page} is not bound")
            if n.anchor:
                require((n.checkpoint >= 0) == self.has_state, "anchor without its checkpoint")
                require(n.depth % self.checkpoint_interval == 0, "anchor off the interval")
                for w in n.window(self.window_pages):
                    refs[id(w)] += 1
            else:
                require(n.checkpoint < 0, "checkpoint without an anchor")
        for n in nodes:
            require(n.window_refs == refs[id(n)], f"page {n.page}: window count")
            require(n.swa == (n.window_refs > 0), f"page {n.page}: SWA hold != window cover")
            require(not n.swa or self.pool.swa_bound(n.page), f"page {n.page}: SWA not bound")
        ckpts = [n.checkpoint for n in nodes if n.checkpoint >= 0]
        require(set(ckpts) == self._checkpoints and len(ckpts) == len(set(ckpts)), "checkpoints")
        s = self.stats
        require(s.retained_swa_pages == sum(n.swa for n in nodes), "retained SWA gauge")
        require(s.checkpoints == sum(n.checkpoint >= 0 for n in nodes), "checkpoint gauge")
        require(s.anchors == sum(n.anchor for n in nodes), "anchor gauge")


def _token_seq(name: str, tokens: object) -> Sequence[int]:
    """``tokens`` if it is a sequence (sized and sliceable, not a string); ``ValueError``
    otherwise. Token ids are checked where they are read (:meth:`RadixTree.key`)."""
    if isinstance(tokens, (str, bytes)) or not (
        hasattr(tokens, "__len__") and hasattr(tokens, "__getitem__")
    ):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(tokens).__name__}")
    return tokens  # type: ignore[return-value]
