"""Invariant checks for pools. They read the device and synchronise: tests and debugging only,
never on the step path. A broken invariant raises
:class:`~unimem.memory.errors.InternalError` naming it, in every mode (also under
``python -O``).

``check_unified(mem, requests)`` checks, for a :class:`UnifiedMemory`:

- bands lie inside the arena, above the header, and never overlap; header + band bytes +
  gaps == arena bytes;
- per id space: ``v2p`` and ``p2v`` are inverse; every bound physical id lies inside its
  band's extent; the sink (physical 0) is never bound;
- the free stack holds exactly the unbound ids of the extent, each once, and its height is the
  host's count;
- a page's FULL unit is bound exactly when the host counts a holder of it, and its SWA unit
  exactly when the host counts an SWA holder (``MemoryPool.holders``);
- every request's pages are bound in FULL and bound in SWA from ``swa_start`` on; its
  request-table row holds its virtual token ids; its state slot is bound.

``check_holders(pool, requests, cache_pages, cache_swa, cache_slots)`` checks, for any pool,
that the host's holder counts are exactly the holders: each request holds its pages (FULL) and
its pages from ``swa_start`` (SWA), the cache holds what it says; that every state slot in use
belongs to exactly one of them; and that the SWA table binds exactly the SWA-held pages.

``unit_bytes(pool, kind, vid)``: the bytes of one unit through either pool's translation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from unimem.memory.errors import require
from unimem.memory.pool import MemoryPool, RequestMemory
from unimem.memory.spec import LayerKind
from unimem.memory.unified import UnifiedMemory


def check_unified(mem: UnifiedMemory, requests: Iterable[RequestMemory] = ()) -> None:
    bands = mem.bands
    bands.check()
    spans = sorted((b.byte_lo, b.byte_hi) for b in bands.bands if b.size > 0)
    covered, gaps, prev = 0, 0, mem.header_bytes
    for lo, hi in spans:
        require(lo >= prev, "bands overlap")
        gaps += lo - prev
        covered += hi - lo
        prev = hi
    gaps += mem.arena_bytes - prev
    require(mem.header_bytes + covered + gaps == mem.arena_bytes, "bytes not conserved")

    for kind, space in mem.spaces.items():
        band = mem.band(kind)
        v2p = space.v2p.cpu().long()
        p2v = space.p2v.cpu().long()
        bound_v = torch.nonzero(v2p >= 0).flatten()
        phys = v2p[bound_v]
        require(torch.equal(p2v[phys], bound_v), f"{kind}: p2v is not the inverse of v2p")
        bound_p = torch.nonzero(p2v >= 0).flatten()
        require(torch.equal(v2p[p2v[bound_p]], bound_p), f"{kind}: v2p is not the inverse of p2v")
        require(bound_p.numel() == band.live, f"{kind}: {bound_p.numel()} bound, host {band.live}")
        if bound_p.numel():
            require(
                int(bound_p.min()) >= band.lo and int(bound_p.max()) < band.hi,
                f"{kind}: a bound unit lies outside the band [{band.lo}, {band.hi})",
            )
        if kind is not LayerKind.STATE:
            require(int(p2v[0]) == -1, f"{kind}: the sink is bound")
        require(space.free == band.free, f"{kind}: stack height {space.free} != host {band.free}")
        stack = space.free_stack[: space.free].cpu().long()
        require(stack.unique().numel() == stack.numel(), f"{kind}: an id is on the stack twice")
        extent = torch.arange(band.lo, band.hi)
        holes = extent[p2v[band.lo : band.hi] < 0]
        require(torch.equal(stack.sort().values, holes), f"{kind}: stack != holes of the extent")

    full_refs, swa_refs = mem.holders()
    for kind, refs in ((LayerKind.FULL, full_refs), (LayerKind.SWA, swa_refs)):
        if kind in mem.spaces:
            bound = set(torch.nonzero(mem.spaces[kind].v2p.cpu() >= 0).flatten().tolist())
            require(bound == set(refs), f"{kind}: bound pages != pages the host counts holders of")

    p = mem.page_size
    r2t = mem.req_to_token.cpu().long()
    full_v2p = mem.spaces[LayerKind.FULL].v2p.cpu() if LayerKind.FULL in mem.spaces else None
    swa_v2p = mem.spaces[LayerKind.SWA].v2p.cpu() if LayerKind.SWA in mem.spaces else None
    for req in requests:
        if req.pages:
            v = torch.tensor(req.pages)
            require(bool((full_v2p[v] > 0).all()), f"row {req.row}: an unbound FULL page")
            if swa_v2p is not None:
                require(bool((swa_v2p[v[req.swa_start :]] > 0).all()), f"row {req.row}: SWA")
            want = (v[:, None] * p + torch.arange(p)[None, :]).flatten()
            require(torch.equal(r2t[req.row, : want.numel()], want), f"row {req.row}: table")
        if LayerKind.STATE in mem.spaces:
            require(int(mem.spaces[LayerKind.STATE].v2p[req.state_slot]) >= 0, "state slot")


def check_holders(
    pool: MemoryPool,
    requests: Iterable[RequestMemory],
    cache_pages: Iterable[int] = (),
    cache_swa: Iterable[int] = (),
    cache_slots: Iterable[int] = (),
) -> None:
    """The host's holder counts equal the holders (see the module docstring)."""
    requests = list(requests)
    has_swa = pool.spec.has(LayerKind.SWA)
    want_full = Counter(cache_pages)
    want_swa = Counter(cache_swa) if has_swa else Counter()
    for req in requests:
        want_full.update(req.pages)
        if has_swa:
            want_swa.update(req.pages[req.swa_start :])
    full_refs, swa_refs = pool.holders()
    require(dict(want_full) == full_refs, "FULL holder counts differ from the holders")
    require(dict(want_swa) == swa_refs, "SWA holder counts differ from the holders")
    require(pool.live_units(LayerKind.FULL) == len(full_refs), "FULL live units != held pages")
    if has_swa:
        require(pool.live_units(LayerKind.SWA) == len(swa_refs), "SWA live units != held units")
        bound = set(torch.nonzero(pool.swa_v2p.cpu() >= 0).flatten().tolist())
        require(bound == set(swa_refs), "SWA table binds other pages than the SWA-held ones")
    if pool.spec.has(LayerKind.STATE):
        slots = [r.state_slot for r in requests] + list(cache_slots)
        require(len(set(slots)) == len(slots), "a state slot has two owners")
        require(pool.live_units(LayerKind.STATE) == len(slots), "state slots leak or are shared")


def unit_bytes(pool: MemoryPool, kind: LayerKind, vid: int) -> torch.Tensor | None:
    """The bytes of the unit of ``kind`` that id ``vid`` names (a page id for FULL and SWA, a
    state slot for STATE), as a view of the pool's buffer; None when it is not bound. Reads
    the translation table (syncs): tests only."""
    table = {
        LayerKind.FULL: pool.full_v2p,
        LayerKind.SWA: pool.swa_v2p,
        LayerKind.STATE: pool.state_v2p,
    }[kind]
    phys = vid if table is None else int(table[vid])
    if phys < 0:
        return None
    buf, base = pool._unit_buffer(kind)
    ub = pool.layout.unit_bytes(kind)
    return buf[base + phys * ub : base + (phys + 1) * ub]
