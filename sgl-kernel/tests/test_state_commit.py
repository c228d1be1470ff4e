"""State commit after verify: Triton launchers vs torch reference vs a naive per-lane oracle.

Destinations are strided views into a ``uint8`` arena poisoned with 0xFF; after a commit every
byte outside the committed slots' blocks must still be 0xFF (other slots, the envelope's other
blocks and padding, the arena's head and tail). Lanes cover the padded cases: ``vslot = -1``,
``vslot >= V``, an unbound virtual slot, ``accepted = -1`` and ``accepted = T``. On CPU the
kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, root conftest): sizes stay small
and ``block`` is lowered so that one state spans several programs.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import state_commit as sc

# Triton runs on CPU tensors only through the interpreter (set by the root conftest when there is
# no GPU); on a GPU machine the compiled kernels are tested through the ``cuda`` variants.
POISON = 0xFF


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def arena_view(arena, byte_offset, num_slots, slot_bytes, dtype, shape):
    """``[num_slots, *shape]`` of ``dtype``: slot ``s`` is a contiguous block at byte
    ``byte_offset + s * slot_bytes`` of ``arena`` (as the memory layout builds them)."""
    size = dtype.itemsize
    assert byte_offset % size == 0 and slot_bytes % size == 0
    n = arena.numel()
    typed = arena[: n - n % size].view(dtype)
    inner, stride = [], 1
    for d in reversed(shape):
        inner.append(stride)
        stride *= d
    strides = (slot_bytes // size, *reversed(inner))
    return typed.as_strided((num_slots, *shape), strides, byte_offset // size)


def random_states(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def block_bytes(dtype, shape):
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def make_lanes(gen, *, bs, t_len, num_slots, num_virt, translate, device):
    """``(accepted, vslots, state_v2p)`` with distinct live physical slots and the padded cases
    in the first lanes: vslot -1, vslot past the table, unbound slot, accepted -1, accepted T."""
    assert bs >= 6 and num_virt - 2 >= bs and num_slots >= max(num_virt - 2, bs)
    accepted = torch.randint(0, t_len, (bs,), generator=gen, dtype=torch.int32)
    if translate:
        v2p = torch.full((num_virt,), -1, dtype=torch.int32)
        bound = torch.randperm(num_virt, generator=gen)[: num_virt - 2]
        v2p[bound] = torch.randperm(num_slots, generator=gen)[: bound.numel()].int()
        unbound = (v2p < 0).nonzero().flatten()
        live = bound[torch.randperm(bound.numel(), generator=gen)]
        vslots = live[:bs].int().clone()
        vslots[1] = num_virt  # past the end of state_v2p
        vslots[2] = int(unbound[0])
    else:
        v2p = None
        vslots = torch.randperm(num_slots, generator=gen)[:bs].int()
        vslots[1] = num_slots  # past the end of dest
        vslots[2] = -3
    vslots[0] = -1
    accepted[3] = -1
    accepted[4] = t_len  # out of range: skipped, never read
    to = lambda t: None if t is None else t.to(device)
    return to(accepted), to(vslots), to(v2p)


def naive_targets(accepted, vslots, v2p, t_len, num_slots):
    """``[(lane, position, physical slot)]`` of the lanes that commit, from the contract."""
    acc, vs = accepted.cpu().tolist(), vslots.cpu().tolist()
    table = None if v2p is None else v2p.cpu().tolist()
    out = []
    for b, (a, v) in enumerate(zip(acc, vs, strict=True)):
        if not 0 <= a < t_len or v < 0:
            continue
        if table is not None:
            if v >= len(table) or table[v] < 0:
                continue
            v = table[v]
        if v < num_slots:
            out.append((b, a, v))
    return out


def check_commit(arena_before, arena_after, pairs, targets):
    """``arena_after`` = ``arena_before`` with ``dest[phys] = scratch[b, a]`` for each target of
    each (scratch, dest offset, slot bytes, dtype, shape); every other byte unchanged."""
    expected = arena_before.cpu().clone()
    written = torch.zeros(expected.numel(), dtype=torch.bool)
    for scratch, offset, slot_bytes, dtype, shape in pairs:
        nbytes = block_bytes(dtype, shape)
        s = scratch.cpu()
        for b, a, phys in targets:
            start = offset + phys * slot_bytes
            expected[start : start + nbytes] = s[b, a].contiguous().view(torch.uint8).flatten()
            written[start : start + nbytes] = True
    got = arena_after.cpu()
    assert torch.equal(got, expected)
    assert bool((got[~written] == arena_before.cpu()[~written]).all())


# ---------------------------------------------------------------------------------------------
# one state tensor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len", [1, 8])
@pytest.mark.parametrize("translate", [True, False])
def test_commit_states(device, dtype, t_len, translate):
    gen = torch.Generator().manual_seed(10 * t_len + translate + (dtype == torch.bfloat16) * 3)
    bs, rows, num_slots, num_virt, shape = 8, 10, 12, 11, (3, 4)
    head, slot_bytes, block_off = 32, 112, 16  # the slot envelope: padding around the block
    arena = torch.full((head + num_slots * slot_bytes + 24,), POISON, dtype=torch.uint8)
    arena = arena.to(device)
    scratch = random_states(gen, (rows, t_len, *shape), dtype, device)
    accepted, vslots, v2p = make_lanes(
        gen, bs=bs, t_len=t_len, num_slots=num_slots, num_virt=num_virt,
        translate=translate, device=device,
    )  # fmt: skip
    scratch_before = scratch.clone()
    ref, tri = arena.clone(), arena.clone()
    view = lambda a: arena_view(a, head + block_off, num_slots, slot_bytes, dtype, shape)
    sc.commit_states_reference(scratch, accepted, vslots, v2p, view(ref))
    sc.commit_states_triton(scratch, accepted, vslots, v2p, view(tri), block=2)
    assert torch.equal(tri.cpu(), ref.cpu())
    targets = naive_targets(accepted, vslots, v2p, t_len, num_slots)
    assert len(targets) == bs - 5
    check_commit(arena, tri, [(scratch, head + block_off, slot_bytes, dtype, shape)], targets)
    assert torch.equal(scratch, scratch_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "every_other_t"])
def test_commit_strided_scratch_narrow_words(device, layout):
    """Scratch with free strides in its first two dims; fp16 blocks of 30 bytes at 2-byte
    aligned offsets, so the kernel moves 2-byte words without 16-byte vectors."""
    gen = torch.Generator().manual_seed(20 + len(layout))
    dtype, shape, bs, t_len, num_slots = torch.float16, (3, 5), 6, 4, 9
    head, slot_bytes = 6, 34
    if layout == "transposed":
        scratch = random_states(gen, (t_len, bs, *shape), dtype, device).transpose(0, 1)
    else:
        scratch = random_states(gen, (bs, 2 * t_len, *shape), dtype, device)[:, ::2]
    assert not scratch.is_contiguous()
    arena = torch.full((head + num_slots * slot_bytes + 5,), POISON, dtype=torch.uint8)
    arena = arena.to(device)
    accepted, vslots, v2p = make_lanes(
        gen, bs=bs, t_len=t_len, num_slots=num_slots, num_virt=8, translate=True, device=device
    )
    ref, tri = arena.clone(), arena.clone()
    view = lambda a: arena_view(a, head, num_slots, slot_bytes, dtype, shape)
    assert sc._geometry(*sc._pair_layout(scratch, view(tri))) == (2, False)
    sc.commit_states_reference(scratch, accepted, vslots, v2p, view(ref))
    sc.commit_states_triton(scratch, accepted, vslots, v2p, view(tri), block=4)
    assert torch.equal(tri.cpu(), ref.cpu())
    targets = naive_targets(accepted, vslots, v2p, t_len, num_slots)
    check_commit(arena, tri, [(scratch, head, slot_bytes, dtype, shape)], targets)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_no_lanes(device):
    scratch = torch.ones(2, 3, 4, device=device)
    dest = torch.zeros(5, 4, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    sc.commit_states_triton(scratch, empty, empty, None, dest)
    sc.commit_states_multi_triton(sc.StateCommitPlan([scratch], [dest]), empty, empty, None)
    assert bool((dest == 0).all())


def test_commit_rejects_bad_inputs():
    lanes = torch.zeros(2, dtype=torch.int32)
    scratch = torch.zeros(2, 3, 4, 6)
    dest = torch.zeros(5, 4, 6)
    for fn in (sc.commit_states_reference, sc.commit_states_triton):
        with pytest.raises(ValueError, match="dtype"):
            fn(scratch, lanes, lanes, None, dest.bfloat16())
        with pytest.raises(ValueError, match="contiguous"):
            fn(scratch, lanes, lanes, None, torch.zeros(5, 6, 4).transpose(1, 2))
        with pytest.raises(ValueError, match="contiguous"):
            fn(scratch.transpose(2, 3).contiguous().transpose(2, 3), lanes, lanes, None, dest)
        with pytest.raises(ValueError, match="state shapes"):
            fn(scratch, lanes, lanes, None, torch.zeros(5, 4, 5))
        with pytest.raises(ValueError, match="rows"):
            fn(scratch[:1], lanes, lanes, None, dest)
        with pytest.raises(ValueError, match="lanes"):
            fn(scratch, lanes[:1], lanes, None, dest)
        with pytest.raises(ValueError, match="int32 or int64"):
            fn(scratch, lanes.float(), lanes, None, dest)
    with pytest.raises(ValueError, match="dtype"):
        sc.StateCommitPlan([scratch], [dest.half()])
    with pytest.raises(ValueError, match="equal"):
        sc.StateCommitPlan([scratch, scratch], [dest])


# ---------------------------------------------------------------------------------------------
# many state tensors, one launch
# ---------------------------------------------------------------------------------------------


def make_slot_arena(gen, lanes, *, num_slots, head, device, align=16):
    """An arena whose slot envelope packs every (dtype, shape) of ``lanes`` (each block padded to
    ``align`` bytes), poisoned; returns ``(arena, slot_bytes, offsets)``."""
    offsets, off = [], 0
    for dtype, shape in lanes:
        offsets.append(head + off)
        off += -(-block_bytes(dtype, shape) // align) * align
    slot_bytes = off + align  # a spare padding block at the end of the envelope
    arena = torch.full((head + num_slots * slot_bytes + 40,), POISON, dtype=torch.uint8)
    return arena.to(device), slot_bytes, offsets


class _LaunchCounter:
    """Counts launches of a Triton kernel (``kernel[grid](...)``) and forwards them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


MULTI_LANES = {
    # conv (bf16) and recurrent (fp32) state of two layers: 16-byte vectors
    "aligned": [
        (torch.bfloat16, (4, 2)),
        (torch.float32, (2, 3, 4)),
        (torch.bfloat16, (4, 2)),
        (torch.float32, (2, 3, 4)),
    ],
    # an fp16 block of 30 bytes in a 2-byte aligned envelope: the whole plan moves 2-byte words
    "narrow": [(torch.bfloat16, (4, 2)), (torch.float16, (3, 5)), (torch.float32, (2, 3))],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(MULTI_LANES))
@pytest.mark.parametrize("translate", [True, False])
def test_commit_states_multi(device, case, translate, monkeypatch):
    gen = torch.Generator().manual_seed(30 + translate + len(case))
    lanes = MULTI_LANES[case]
    bs, rows, t_len, num_slots, num_virt = 6, 7, 4, 9, 8
    align = 16 if case == "aligned" else 2
    arena, slot_bytes, offsets = make_slot_arena(
        gen, lanes, num_slots=num_slots, head=32 if case == "aligned" else 2,
        device=device, align=align,
    )  # fmt: skip
    scratches = [random_states(gen, (rows, t_len, *s), d, device) for d, s in lanes]
    views = lambda a: [
        arena_view(a, off, num_slots, slot_bytes, d, s)
        for off, (d, s) in zip(offsets, lanes, strict=True)
    ]
    ref, tri = arena.clone(), arena.clone()
    plan = sc.StateCommitPlan(scratches, views(tri), block=4)
    assert (plan.word_bytes, plan.align16) == ((8, True) if case == "aligned" else (2, False))
    counter = _LaunchCounter(sc._commit_multi_kernel)
    monkeypatch.setattr(sc, "_commit_multi_kernel", counter)
    accepted, vslots, v2p = make_lanes(
        gen, bs=bs, t_len=t_len, num_slots=num_slots, num_virt=num_virt,
        translate=translate, device=device,
    )  # fmt: skip
    # Two steps through the same plan and lane tensors, updated in place (as a graph replays).
    for step in range(2):
        if step:
            new_acc, new_vs, new_v2p = make_lanes(
                gen, bs=bs, t_len=t_len, num_slots=num_slots, num_virt=num_virt,
                translate=translate, device=device,
            )  # fmt: skip
            accepted.copy_(new_acc.flip(0))
            vslots.copy_(new_vs.flip(0))
            if v2p is not None:
                v2p.copy_(new_v2p)
        before = tri.clone()
        sc.commit_states_multi_reference(scratches, accepted, vslots, v2p, views(ref))
        sc.commit_states_multi_triton(plan, accepted, vslots, v2p)
        assert torch.equal(tri.cpu(), ref.cpu())
        targets = naive_targets(accepted, vslots, v2p, t_len, num_slots)
        assert len(targets) == bs - 5
        pairs = [
            (s, off, slot_bytes, d, shp)
            for s, off, (d, shp) in zip(scratches, offsets, lanes, strict=True)
        ]
        check_commit(before, tri, pairs, targets)
    assert counter.launches == 2


@pytest.mark.parametrize("device", DEVICES)
def test_public_entry_points_dispatch(device, monkeypatch):
    """``UNIMEM_KERNEL_BACKEND=triton`` routes the public functions to the launchers; both
    backends give the same bytes."""
    gen = torch.Generator().manual_seed(40)
    dtype, shape, t_len, num_slots = torch.float32, (2, 4), 3, 8
    arena = torch.full((16 + num_slots * 64,), POISON, dtype=torch.uint8, device=device)
    accepted, vslots, v2p = make_lanes(
        gen, bs=6, t_len=t_len, num_slots=num_slots, num_virt=8, translate=True, device=device
    )
    scratch = random_states(gen, (6, t_len, *shape), dtype, device)
    calls = []
    for name in ("commit_states_triton", "commit_states_multi_triton"):
        launcher = getattr(sc, name)

        def spy(*args, _launcher=launcher, _name=name, **kwargs):
            calls.append(_name)
            _launcher(*args, **kwargs)

        monkeypatch.setattr(sc, name, spy)
    view = lambda a: arena_view(a, 16, num_slots, 64, dtype, shape)
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", backend)
        one, multi = arena.clone(), arena.clone()
        sc.commit_states(scratch, accepted, vslots, v2p, view(one))
        sc.commit_states_multi(sc.StateCommitPlan([scratch], [view(multi)]), accepted, vslots, v2p)
        assert torch.equal(one, multi)
        results[backend] = one
    assert torch.equal(results["reference"], results["triton"])
    assert calls == ["commit_states_triton", "commit_states_multi_triton"]


# ---------------------------------------------------------------------------------------------
# GPU only: realistic sizes, offsets past 2^31, CUDA-graph capture
# ---------------------------------------------------------------------------------------------


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_multi_realistic_sizes_and_graph_replay():
    """Conv bf16 [2048, 3] and SSM fp32 [8, 128, 128] (512 KiB, many chunks) of 3 layers, bs 16,
    T 4: default block size; then the same commit captured in a CUDA graph and replayed with
    new lane values written in place."""
    _cuda_or_skip()
    dev = "cuda"
    gen = torch.Generator().manual_seed(50)
    lanes = [(torch.bfloat16, (2048, 3)), (torch.float32, (8, 128, 128))] * 3
    bs, rows, t_len, num_slots, num_virt = 16, 16, 4, 48, 40
    arena, slot_bytes, offsets = make_slot_arena(
        gen, lanes, num_slots=num_slots, head=256, device=dev
    )
    scratches = [random_states(gen, (rows, t_len, *s), d, dev) for d, s in lanes]
    views = lambda a: [
        arena_view(a, off, num_slots, slot_bytes, d, s)
        for off, (d, s) in zip(offsets, lanes, strict=True)
    ]
    pairs = [
        (s, off, slot_bytes, d, shp)
        for s, off, (d, shp) in zip(scratches, offsets, lanes, strict=True)
    ]
    plan = sc.StateCommitPlan(scratches, views(arena))
    assert (plan.word_bytes, plan.align16) == (8, True)
    accepted, vslots, v2p = make_lanes(
        gen, bs=bs, t_len=t_len, num_slots=num_slots, num_virt=num_virt, translate=True,
        device=dev,
    )  # fmt: skip
    before = arena.clone()
    sc.commit_states_multi(plan, accepted, vslots, v2p)  # also warms the kernel for capture
    torch.cuda.synchronize()
    check_commit(before, arena, pairs, naive_targets(accepted, vslots, v2p, t_len, num_slots))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sc.commit_states_multi(plan, accepted, vslots, v2p)
    for _ in range(2):
        new_acc, new_vs, new_v2p = make_lanes(
            gen, bs=bs, t_len=t_len, num_slots=num_slots, num_virt=num_virt, translate=True,
            device=dev,
        )  # fmt: skip
        accepted.copy_(new_acc)
        vslots.copy_(new_vs)
        v2p.copy_(new_v2p)
        for s in scratches:
            s.copy_(torch.randn(s.shape, generator=gen).to(s.dtype))
        before = arena.clone()
        ref = arena.clone()
        sc.commit_states_multi_reference(scratches, accepted, vslots, v2p, views(ref))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(arena, ref)
        check_commit(before, arena, pairs, naive_targets(accepted, vslots, v2p, t_len, num_slots))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,shape,slot_bytes", [
    (torch.uint8, (5, 7), (1 << 30) + 1),  # 1-byte words: word offsets past 2^31
    (torch.float32, (4, 8), (1 << 30) + 16),  # 16-byte vectors, byte offsets past 2^31
])  # fmt: skip
def test_slot_offsets_past_2_gib(dtype, shape, slot_bytes):
    _cuda_or_skip()
    dev = "cuda"
    num_slots, head = 3, 16
    arena = torch.full((head + num_slots * slot_bytes,), POISON, dtype=torch.uint8, device=dev)
    dest = arena_view(arena, head, num_slots, slot_bytes, dtype, shape)
    if dtype == torch.uint8:
        scratch = torch.randint(0, 255, (2, 2, *shape), dtype=dtype, device=dev)
    else:
        scratch = torch.randn((2, 2, *shape), device=dev).to(dtype)
    accepted = torch.tensor([1, 0], dtype=torch.int32, device=dev)
    vslots = torch.tensor([1, 0], dtype=torch.int32, device=dev)
    v2p = torch.tensor([2, -1], dtype=torch.int32, device=dev)  # lane 1 -> slot 2; lane 0 unbound
    nbytes = block_bytes(dtype, shape)
    start = head + 2 * slot_bytes
    assert start > 1 << 31
    plan = sc.StateCommitPlan([scratch], [dest])
    for commit in (sc.commit_states_triton, None):
        arena[start : start + nbytes] = POISON
        if commit is None:
            sc.commit_states_multi_triton(plan, accepted, vslots, v2p)
        else:
            commit(scratch, accepted, vslots, v2p, dest)
        torch.cuda.synchronize()
        assert torch.equal(dest[2], scratch[1, 0])
        assert bool((arena[:start] == POISON).all())
        assert bool((arena[start + nbytes :] == POISON).all())
