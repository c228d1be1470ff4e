"""Id-space ops: each Triton launcher equals its torch reference on fresh random id spaces.

On CPU the launchers run in the Triton interpreter (``TRITON_INTERPRET=1``, set by the root
conftest), so sizes stay small. Every test is parametrised by device; the ``cuda`` variants are
marked ``gpu`` and skipped without a CUDA device. Each comparison checks the whole output state:
``v2p``, ``p2v``, the free stacks (whole tensors, past the tops too: neither side may write
there), ``vids``, the request table and ``src_out``/``dst_out`` (past ``k`` too).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import id_ops

# Triton runs on CPU tensors only through the interpreter (set by the root conftest when there is
# no GPU); on a GPU machine the compiled kernels are tested through the ``cuda`` variants.
PAGE_SIZES = [1, 16, 64]
JUNK = -7  # stack entries past the top: never read, never written


# ---------------------------------------------------------------------------------------------
# helpers: valid random id spaces
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Space:
    """One id space: tables, free stacks and the host's counts of them."""

    v2p: torch.Tensor
    p2v: torch.Tensor
    phys_free: torch.Tensor
    phys_top: int
    virt_free: torch.Tensor
    virt_top: int

    def clone(self) -> Space:
        return dataclasses.replace(
            self,
            v2p=self.v2p.clone(),
            p2v=self.p2v.clone(),
            phys_free=self.phys_free.clone(),
            virt_free=self.virt_free.clone(),
        )

    def assert_equal(self, other: Space) -> None:
        for name in ("v2p", "p2v", "phys_free", "virt_free"):
            torch.testing.assert_close(getattr(self, name), getattr(other, name), rtol=0, atol=0)
        assert (self.phys_top, self.virt_top) == (other.phys_top, other.virt_top)

    def check_consistent(self) -> None:
        """v2p and p2v are inverse; the stacks hold exactly the unbound ids of the band."""
        v2p, p2v = self.v2p.cpu().long(), self.p2v.cpu().long()
        bound_v = (v2p >= 0).nonzero().flatten()
        assert torch.equal(p2v[v2p[bound_v]], bound_v)
        bound_p = (p2v >= 0).nonzero().flatten()
        assert torch.equal(v2p[p2v[bound_p]], bound_p)
        free = self.phys_free[: self.phys_top].cpu().long()
        assert free.unique().numel() == free.numel() and bool((p2v[free] == -1).all())
        vfree = self.virt_free[: self.virt_top].cpu().long()
        assert vfree.unique().numel() == vfree.numel() and bool((v2p[vfree] == -1).all())


def make_space(
    gen: torch.Generator,
    num_virt: int,
    num_phys: int,
    bound_phys: torch.Tensor,
    device: str,
    band_lo: int = 1,
    bind_virt0: bool = False,
) -> Space:
    """A random valid space over the band ``[band_lo, num_phys)`` of physical units.

    Units below ``band_lo`` (unit 0, the sink, by default) are neither bound nor free. The
    units ``bound_phys`` are bound to random distinct virtual ids (a random permutation; with
    ``bind_virt0``, virtual id 0 is one of them); the band's other units are on the free stack,
    shuffled, and the unbound virtual ids on the virtual stack, shuffled. Stack entries past the
    tops hold ``JUNK``.
    """
    bound_phys = bound_phys.long()
    assert bool(((bound_phys >= band_lo) & (bound_phys < num_phys)).all())
    nb = bound_phys.numel()
    perm_v = torch.randperm(num_virt, generator=gen)
    if bind_virt0:
        assert nb >= 1
        perm_v = torch.cat([perm_v[perm_v == 0], perm_v[perm_v != 0]])
    vids = perm_v[:nb]
    v2p = torch.full((num_virt,), -1, dtype=torch.int32)
    p2v = torch.full((num_phys,), -1, dtype=torch.int32)
    v2p[vids] = bound_phys.int()
    p2v[bound_phys] = vids.int()
    is_free = torch.ones(num_phys, dtype=torch.bool)
    is_free[:band_lo] = False
    is_free[bound_phys] = False
    free = torch.arange(num_phys)[is_free]
    free = free[torch.randperm(free.numel(), generator=gen)]
    phys_free = torch.full((num_phys,), JUNK, dtype=torch.int32)
    phys_free[: free.numel()] = free.int()
    vfree = perm_v[nb:]
    vfree = vfree[torch.randperm(vfree.numel(), generator=gen)]
    virt_free = torch.full((num_virt,), JUNK, dtype=torch.int32)
    virt_free[: vfree.numel()] = vfree.int()
    space = Space(v2p, p2v, phys_free, free.numel(), virt_free, vfree.numel())
    space.check_consistent()
    return dataclasses.replace(
        space,
        v2p=v2p.to(device),
        p2v=p2v.to(device),
        phys_free=phys_free.to(device),
        virt_free=virt_free.to(device),
    )


def random_space(gen: torch.Generator, num_virt: int, num_phys: int, device: str) -> Space:
    """A space with a random number of random units of the band ``[1, num_phys)`` bound."""
    band = torch.arange(1, num_phys)
    nb = int(torch.randint(0, min(num_virt, band.numel()) + 1, (), generator=gen))
    bound = band[torch.randperm(band.numel(), generator=gen)[:nb]]
    return make_space(gen, num_virt, num_phys, bound, device)


def make_req_table(rows: int, width: int, layout: str, device: str, fill: int = -3) -> torch.Tensor:
    """A ``[rows, width]`` int32 request table as a contiguous, sliced or transposed view."""
    if layout == "contiguous":
        t = torch.full((rows, width), fill, dtype=torch.int32)
    elif layout == "sliced":
        t = torch.full((rows + 1, width + 5), fill, dtype=torch.int32)[1:, 2 : width + 2]
    elif layout == "transposed":
        t = torch.full((width, rows), fill, dtype=torch.int32).t()
    else:
        raise ValueError(layout)
    return t.to(device)


def random_pages(
    gen: torch.Generator, n: int, rows: int, num_cols: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` distinct random ``(row, page column)`` slots of a request table."""
    slots = torch.randperm(rows * num_cols, generator=gen)[:n]
    return (slots // num_cols).int().to(device), (slots % num_cols).int().to(device)


def batch_sizes(gen: torch.Generator, most: int) -> list[int]:
    """Batch sizes to try when up to ``most`` units can be taken: empty, one, all, random."""
    return sorted({0, min(1, most), most, int(torch.randint(0, most + 1, (), generator=gen))})


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# bind_units
# ---------------------------------------------------------------------------------------------


def run_bind(
    space: Space,
    n: int,
    vids: torch.Tensor,
    use_virt: bool,
    req: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
    page_size: int = 1,
) -> None:
    """Bind with the reference and the Triton launcher from the same state; compare all."""
    results = []
    for fn in (id_ops.bind_units_reference, id_ops.bind_units_triton):
        s, v = space.clone(), vids.clone()
        r = None if req is None else req.clone()
        fn(
            s.v2p,
            s.p2v,
            s.phys_free,
            s.phys_top,
            n,
            v,
            virt_free=s.virt_free if use_virt else None,
            virt_top=s.virt_top,
            req_to_token=r,
            unit_rows=rows,
            unit_cols=cols,
            page_size=page_size,
        )
        results.append((s, v, r))
    (s_ref, v_ref, r_ref), (s_tri, v_tri, r_tri) = results
    s_ref.assert_equal(s_tri)
    assert_same(v_ref, v_tri)
    if req is not None:
        assert_same(r_ref, r_tri)
        assert torch.equal(r_tri, req) == (n == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "page_size,layout", [(1, "transposed"), (16, "sliced"), (64, "contiguous")]
)
@pytest.mark.parametrize("use_virt", [False, True])
def test_bind_with_request_table(device, page_size, layout, use_virt):
    gen = torch.Generator().manual_seed(1000 + page_size + use_virt)
    num_virt, num_phys, rows = 40, 24, 3
    width = 4 * page_size - page_size // 2  # a partial last page: its tail tokens are skipped
    num_cols = -(-width // page_size)
    for _ in range(3):
        space = random_space(gen, num_virt, num_phys, device)
        most = min(space.phys_top, space.virt_top, rows * num_cols)
        for n in batch_sizes(gen, most):
            vids = _given_vids(gen, space, n, use_virt, device)
            r, c = random_pages(gen, n, rows, num_cols, device)
            req = make_req_table(rows, width, layout, device)
            run_bind(space, n, vids, use_virt, req, r, c, page_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_virt", [False, True])
def test_bind_without_request_table(device, use_virt):
    gen = torch.Generator().manual_seed(2000 + use_virt)
    for num_virt, num_phys in [(8, 8), (300, 200)]:  # 300 > one program's block of units
        for _ in range(3):
            space = random_space(gen, num_virt, num_phys, device)
            most = min(space.phys_top, space.virt_top)
            for n in batch_sizes(gen, most):
                run_bind(space, n, _given_vids(gen, space, n, use_virt, device), use_virt)


def _given_vids(gen: torch.Generator, space: Space, n: int, use_virt: bool, device: str):
    """The ``vids`` argument: an output buffer (with junk past ``n``) when popping virtual
    ids, else ``n`` random distinct unbound virtual ids followed by junk."""
    out = torch.full((n + 2,), JUNK, dtype=torch.int32)
    if not use_virt:
        unbound = (space.v2p.cpu() == -1).nonzero().flatten()
        out[:n] = unbound[torch.randperm(unbound.numel(), generator=gen)[:n]].int()
    return out.to(device)


# ---------------------------------------------------------------------------------------------
# unbind_units
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("source", ["vids", "req"])
@pytest.mark.parametrize("use_virt", [False, True])
def test_unbind(device, page_size, source, use_virt):
    gen = torch.Generator().manual_seed(3000 + page_size + 7 * use_virt + 13 * (source == "req"))
    num_virt, num_phys, rows = 30, 40, 4
    width = 5 * page_size
    num_cols = 5
    layout = {1: "transposed", 16: "sliced", 64: "contiguous"}[page_size]
    for _ in range(2):
        # Build the state by binding through the reference, so the request table names units.
        space = make_space(gen, num_virt, num_phys, torch.empty(0, dtype=torch.long), device)
        nb = int(torch.randint(1, min(space.phys_top, rows * num_cols) + 1, (), generator=gen))
        vids = torch.empty(nb, dtype=torch.int32, device=device)
        r, c = random_pages(gen, nb, rows, num_cols, device)
        req = make_req_table(rows, width, layout, device)
        id_ops.bind_units_reference(
            space.v2p,
            space.p2v,
            space.phys_free,
            space.phys_top,
            nb,
            vids,
            virt_free=space.virt_free,
            virt_top=space.virt_top,
            req_to_token=req,
            unit_rows=r,
            unit_cols=c,
            page_size=page_size,
        )
        space = dataclasses.replace(
            space, phys_top=space.phys_top - nb, virt_top=space.virt_top - nb
        )
        space.check_consistent()
        for n in batch_sizes(gen, nb):
            pick = torch.randperm(nb, generator=gen)[:n].to(device)
            kw = {"vids": vids[pick]} if source == "vids" else {"req_to_token": req}
            results = []
            for fn in (id_ops.unbind_units_reference, id_ops.unbind_units_triton):
                s = space.clone()
                fn(
                    s.v2p,
                    s.p2v,
                    s.phys_free,
                    s.phys_top,
                    n,
                    unit_rows=r[pick],
                    unit_cols=c[pick],
                    page_size=page_size,
                    virt_free=s.virt_free if use_virt else None,
                    virt_top=s.virt_top,
                    **kw,
                )
                results.append(dataclasses.replace(s, phys_top=s.phys_top + n))
            results[0].assert_equal(results[1])
            virt_top = space.virt_top + (n if use_virt else 0)
            dataclasses.replace(results[1], virt_top=virt_top).check_consistent()


@pytest.mark.parametrize("device", DEVICES)
def test_bind_unbind_largest_ids(device):
    """The last virtual id, the last physical unit and the table's last (partial) page."""
    gen = torch.Generator().manual_seed(4000)
    num_virt, num_phys, page_size, rows, width = 50, 33, 16, 3, 60  # last page: 12 of 16 tokens
    space = make_space(gen, num_virt, num_phys, torch.empty(0, dtype=torch.long), device)
    top = space.phys_top
    space.phys_free[top - 1] = num_phys - 1  # the top of the stack: the largest unit
    space.phys_free[: top - 1] = torch.arange(1, num_phys - 1, dtype=torch.int32)
    vids = torch.tensor([num_virt - 1], dtype=torch.int32, device=device)
    r = torch.tensor([rows - 1], dtype=torch.int32, device=device)
    c = torch.tensor([width // page_size], dtype=torch.int32, device=device)
    outs = []
    for bind, unbind in [
        (id_ops.bind_units_reference, id_ops.unbind_units_reference),
        (id_ops.bind_units_triton, id_ops.unbind_units_triton),
    ]:
        s = space.clone()
        req = make_req_table(rows, width, "contiguous", device)
        bind(
            s.v2p,
            s.p2v,
            s.phys_free,
            top,
            1,
            vids,
            req_to_token=req,
            unit_rows=r,
            unit_cols=c,
            page_size=page_size,
        )
        assert int(s.v2p[num_virt - 1]) == num_phys - 1
        assert req[rows - 1, -1].item() == (num_virt - 1) * page_size + width % page_size - 1
        bound = s.clone()
        unbind(
            s.v2p,
            s.p2v,
            s.phys_free,
            top - 1,
            1,
            req_to_token=req,
            unit_rows=r,
            unit_cols=c,
            page_size=page_size,
        )
        outs.append((bound, s, req))
    outs[0][0].assert_equal(outs[1][0])
    outs[0][1].assert_equal(outs[1][1])
    assert_same(outs[0][2], outs[1][2])
    outs[1][1].check_consistent()


# ---------------------------------------------------------------------------------------------
# translate_tokens
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("shape", [(0,), (1,), (1500,), (3, 5, 7)])
def test_translate(device, page_size, shape):
    gen = torch.Generator().manual_seed(5000 + page_size + len(shape))
    num_virt, num_phys = 24, 20
    # virtual page 0 bound by construction: token -1 must give the sink, not a slot of page 0
    # (``//`` truncating toward zero maps -1 to page 0 unless negatives are guarded)
    band = torch.arange(1, num_phys)
    nb = int(torch.randint(1, min(num_virt, band.numel()) + 1, (), generator=gen))
    bound = band[torch.randperm(band.numel(), generator=gen)[:nb]]
    space = make_space(gen, num_virt, num_phys, bound, device, bind_virt0=True)
    page0 = int(space.v2p[0])
    assert page0 >= 1
    lo, hi = -2 * page_size, (num_virt + 3) * page_size  # negatives and pages past the end
    vtok = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32)
    flat = vtok.view(-1)
    specials = [-1, -(2**31), 2**31 - 1, num_virt * page_size - 1, num_virt * page_size, 0]
    flat[: len(specials)] = torch.tensor(specials[: flat.numel()], dtype=torch.int32)
    vtok = vtok.to(device)
    outs = []
    for fn in (id_ops.translate_tokens_reference, id_ops.translate_tokens_triton):
        out = torch.full(shape, JUNK, dtype=torch.int32, device=device)
        fn(vtok, space.v2p, page_size, out)
        outs.append(out)
    assert_same(outs[0], outs[1])
    for out in outs:
        got = out.view(-1).tolist()
        if got:
            assert got[0] == 0, "token -1 must give the sink"
        if len(got) >= len(specials):  # negative, past-the-end and unbound give the sink
            assert got[:3] == [0, 0, 0]
            assert got[4] == 0
            assert got[5] == page0 * page_size  # token 0: the first slot of page 0


# ---------------------------------------------------------------------------------------------
# translate_slots
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (1,), (48,), (1500,)])
def test_translate_slots(device, dtype, shape):
    gen = torch.Generator().manual_seed(6000 + len(shape) + shape[0])
    num_virt, num_phys = 24, 20
    band = torch.arange(1, num_phys)
    bound = band[torch.randperm(band.numel(), generator=gen)[:10]]
    space = make_space(gen, num_virt, num_phys, bound, device)
    v = torch.randint(-3, num_virt + 3, shape, generator=gen, dtype=dtype)
    specials = [-1, num_virt, num_virt - 1, 0]
    v.view(-1)[: len(specials)] = torch.tensor(specials[: v.numel()], dtype=dtype)
    v = v.to(device)
    outs = []
    for fn in (id_ops.translate_slots_reference, id_ops.translate_slots_triton):
        out = torch.full(shape, JUNK, dtype=dtype, device=device)
        fn(v, space.v2p, out)
        outs.append(out)
    assert_same(outs[0], outs[1])
    table = space.v2p.cpu().tolist()
    want = [table[x] if 0 <= x < num_virt else -1 for x in v.view(-1).tolist()]
    assert outs[0].view(-1).tolist() == want  # negatives, past the end, unbound: -1


# ---------------------------------------------------------------------------------------------
# compact_band
# ---------------------------------------------------------------------------------------------


def compaction_space(
    gen: torch.Generator,
    num_phys: int,
    k: int,
    end: str,
    n_live: int,
    spare_holes: int,
    device: str,
) -> tuple[Space, int, int]:
    """A band ``[1, num_phys)`` whose region of ``k`` units at its ``end`` holds ``n_live``
    live units, with ``n_live + spare_holes`` holes outside the region (so the stack holds
    ``k + spare_holes`` ids, enough for the compaction's precondition)."""
    lo = 1 if end == "low" else num_phys - k
    region = torch.arange(lo, lo + k)
    outside = torch.cat([torch.arange(1, lo), torch.arange(lo + k, num_phys)])
    holes_out = n_live + spare_holes
    assert holes_out <= outside.numel()
    live_in = region[torch.randperm(k, generator=gen)[:n_live]]
    live_out = outside[torch.randperm(outside.numel(), generator=gen)[holes_out:]]
    bound = torch.cat([live_in, live_out])
    space = make_space(gen, 2 * num_phys, num_phys, bound, device)
    assert space.phys_top == k + spare_holes
    return space, lo, lo + k


def run_compact(space: Space, lo: int, hi: int, block: int) -> tuple[Space, torch.Tensor]:
    """Compact with both implementations; compare the state and src/dst (sentinels past k)."""
    k = max(hi - lo, 0)
    outs = []
    for fn in (id_ops.compact_band_reference, id_ops.compact_band_triton):
        s = space.clone()
        src = torch.full((k + 3,), 99, dtype=torch.int32, device=space.p2v.device)
        dst = src.clone()
        kw = {"block": block} if fn is id_ops.compact_band_triton else {}
        fn(s.v2p, s.p2v, s.phys_free, s.phys_top, lo, hi, src, dst, **kw)
        outs.append((s, src, dst))
    (s_ref, src_ref, dst_ref), (s_tri, src_tri, dst_tri) = outs
    s_ref.assert_equal(s_tri)
    assert_same(src_ref, src_tri)
    assert_same(dst_ref, dst_tri)
    return s_tri, src_tri


def check_compacted(before: Space, after: Space, lo: int, hi: int, src: torch.Tensor) -> None:
    """The region is empty, every virtual id still bound, and the stack is the old one less
    the region and the destinations."""
    k = hi - lo
    assert bool((after.p2v[lo:hi] == -1).all())
    assert torch.equal(before.v2p >= 0, after.v2p >= 0)
    after = dataclasses.replace(after, phys_top=before.phys_top - k)
    after.check_consistent()
    n_live = int((src[:k] >= 0).sum())
    assert bool((src[n_live:k] == -1).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("end", ["low", "high"])
@pytest.mark.parametrize(
    "case",
    [
        "random",
        "fully_live",  # no unit of the region is on the stack
        "fully_free",  # L = 0: nothing moves, the stack only loses the region
        "tight",  # as many holes outside as live units: every filtered entry is a destination
        "fully_live_tight",
    ],
)
@pytest.mark.parametrize("block", [4, 1024])
def test_compact(device, end, case, block):
    gen = torch.Generator().manual_seed(6000 + len(case) + 31 * (end == "high") + block)
    num_phys = 40
    for _ in range(3):
        k = int(torch.randint(1, 13, (), generator=gen))
        room = num_phys - 1 - k  # units outside the region
        if case == "random":
            n_live = int(torch.randint(0, k + 1, (), generator=gen))
            spare = int(torch.randint(0, room - n_live + 1, (), generator=gen))
        elif case == "fully_live":
            n_live, spare = k, int(torch.randint(0, room - k + 1, (), generator=gen))
        elif case == "fully_free":
            n_live, spare = 0, int(torch.randint(0, room + 1, (), generator=gen))
        elif case == "tight":
            n_live, spare = int(torch.randint(0, k + 1, (), generator=gen)), 0
        else:
            n_live, spare = k, 0
        space, lo, hi = compaction_space(gen, num_phys, k, end, n_live, spare, device)
        after, src = run_compact(space, lo, hi, block)
        check_compacted(space, after, lo, hi, src)
        assert int((src[:k] >= 0).sum()) == n_live


@pytest.mark.parametrize("device", DEVICES)
def test_compact_empty_region_launches_nothing(device):
    gen = torch.Generator().manual_seed(7000)
    space = random_space(gen, 20, 16, device)
    for lo, hi in [(5, 5), (7, 3)]:
        after, src = run_compact(space, lo, hi, 4)
        space.assert_equal(after)
        assert src.tolist() == [99, 99, 99]


@pytest.mark.parametrize("device", DEVICES)
def test_compact_whole_band(device):
    """The region is the whole band: every stack id is in it, the stack filters to nothing."""
    gen = torch.Generator().manual_seed(7100)
    num_phys = 12
    space = make_space(gen, 20, num_phys, torch.empty(0, dtype=torch.long), device)
    after, src = run_compact(space, 1, num_phys, 4)
    assert src.tolist()[: num_phys - 1] == [-1] * (num_phys - 1)


# ---------------------------------------------------------------------------------------------
# a random sequence of ops, both implementations side by side
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_random_op_sequence(device):
    """Alloc (bind, popping virtual ids), free (unbind, pushing them back) and compaction of
    the band's top, as a runtime would issue them; both states must stay equal and valid."""
    gen = torch.Generator().manual_seed(8000)
    num_virt, num_phys = 48, 32
    ref = make_space(gen, num_virt, num_phys, torch.empty(0, dtype=torch.long), device)
    tri = ref.clone()
    live: list[int] = []  # virtual ids bound, as the host would track them (here: read back)
    band_hi = num_phys
    vids = torch.empty(num_phys, dtype=torch.int32, device=device)
    for _step in range(12):
        op = int(torch.randint(0, 3, (), generator=gen))
        if op == 0 and ref.phys_top > 0:
            n = int(torch.randint(1, ref.phys_top + 1, (), generator=gen))
            for s, fn in ((ref, id_ops.bind_units_reference), (tri, id_ops.bind_units_triton)):
                fn(
                    s.v2p,
                    s.p2v,
                    s.phys_free,
                    s.phys_top,
                    n,
                    vids,
                    virt_free=s.virt_free,
                    virt_top=s.virt_top,
                )
                s.phys_top -= n
                s.virt_top -= n
            live += vids[:n].tolist()
        elif op == 1 and live:
            n = int(torch.randint(1, len(live) + 1, (), generator=gen))
            pick = [live.pop(int(torch.randint(0, len(live), (), generator=gen))) for _ in range(n)]
            v = torch.tensor(pick, dtype=torch.int32, device=device)
            for s, fn in ((ref, id_ops.unbind_units_reference), (tri, id_ops.unbind_units_triton)):
                fn(
                    s.v2p,
                    s.p2v,
                    s.phys_free,
                    s.phys_top,
                    n,
                    vids=v,
                    virt_free=s.virt_free,
                    virt_top=s.virt_top,
                )
                s.phys_top += n
                s.virt_top += n
        else:
            k = min(int(torch.randint(1, 6, (), generator=gen)), ref.phys_top)
            if k == 0:
                continue
            lo, hi = band_hi - k, band_hi
            src = torch.empty(k, dtype=torch.int32, device=device)
            dst = torch.empty(k, dtype=torch.int32, device=device)
            for s, fn in ((ref, id_ops.compact_band_reference), (tri, id_ops.compact_band_triton)):
                fn(s.v2p, s.p2v, s.phys_free, s.phys_top, lo, hi, src, dst)
                s.phys_top -= k
            band_hi = lo
        ref.assert_equal(tri)
        tri.check_consistent()
        assert ref.phys_top == band_hi - 1 - len(live)


# ---------------------------------------------------------------------------------------------
# the public entry points dispatch to the kernels
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_public_entry_points_use_triton_when_forced(monkeypatch, device):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    calls = []
    for name in ("bind_units", "unbind_units", "translate_tokens", "compact_band"):
        launcher = getattr(id_ops, f"{name}_triton")

        def spy(*args, _launcher=launcher, _name=name, **kwargs):
            calls.append(_name)
            _launcher(*args, **kwargs)

        monkeypatch.setattr(id_ops, f"{name}_triton", spy)
    gen = torch.Generator().manual_seed(9000)
    ref = make_space(gen, 16, 12, torch.empty(0, dtype=torch.long), device)
    tri = ref.clone()
    vids = torch.empty(4, dtype=torch.int32, device=device)
    req = [make_req_table(2, 8, "contiguous", device) for _ in range(2)]
    rows = torch.tensor([0, 1], dtype=torch.int32, device=device)
    cols = torch.tensor([1, 0], dtype=torch.int32, device=device)
    for s, r, bind, unbind in [
        (ref, req[0], id_ops.bind_units_reference, id_ops.unbind_units_reference),
        (tri, req[1], id_ops.bind_units, id_ops.unbind_units),
    ]:
        bind(
            s.v2p,
            s.p2v,
            s.phys_free,
            s.phys_top,
            2,
            vids,
            virt_free=s.virt_free,
            virt_top=s.virt_top,
            req_to_token=r,
            unit_rows=rows,
            unit_cols=cols,
            page_size=4,
        )
        s.phys_top -= 2
        s.virt_top -= 2
        unbind(
            s.v2p,
            s.p2v,
            s.phys_free,
            s.phys_top,
            1,
            req_to_token=r,
            unit_rows=rows,
            unit_cols=cols,
            page_size=4,
        )
        s.phys_top += 1
    ref.assert_equal(tri)
    assert_same(req[0], req[1])
    vtok = torch.arange(-2, 40, dtype=torch.int32, device=device)
    outs = [torch.empty_like(vtok) for _ in range(2)]
    id_ops.translate_tokens_reference(vtok, ref.v2p, 4, outs[0])
    id_ops.translate_tokens(vtok, tri.v2p, 4, outs[1])
    assert_same(outs[0], outs[1])
    sd = [torch.empty(3, dtype=torch.int32, device=device) for _ in range(4)]
    id_ops.compact_band_reference(ref.v2p, ref.p2v, ref.phys_free, ref.phys_top, 9, 12, *sd[:2])
    id_ops.compact_band(tri.v2p, tri.p2v, tri.phys_free, tri.phys_top, 9, 12, *sd[2:])
    ref.assert_equal(tri)
    assert_same(sd[0], sd[2])
    assert calls == ["bind_units", "unbind_units", "translate_tokens", "compact_band"]
