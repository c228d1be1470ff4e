"""Commit of recurrent state after a speculative verify: keep each request's state at its
accepted position, written into its physical state slot of the arena.

Verifying ``T = gamma + 1`` tokens through a STATE layer computes the state after each position
into a scratch buffer ``scratch[bs, T, *S]``; the persistent slot is not touched. This op then
copies, for every lane ``b``, ``scratch[b, accepted[b]]`` into ``dest[phys]`` where ``phys`` is
the physical slot of the request's virtual slot ``vslots[b]`` (``state_v2p[vslots[b]]``, or
``vslots[b]`` itself when ``state_v2p`` is None). Virtual-to-physical translation happens inside
the copy kernel, so the whole commit is one launch.

- ``accepted[b]``: index in ``[0, T)`` of the kept position, i.e. the number of accepted draft
  tokens (the state after the last committed token).
- ``dest [num_slots, *S]``: usually a strided view into the ``uint8`` arena (slot stride = the
  slot envelope, not contiguous across slots).
- A lane is *skipped* (its destination untouched, its scratch never read) when ``accepted < 0``
  or ``accepted >= T``, ``vslot < 0``, ``vslot >= V`` (``V = state_v2p.numel()``), the slot is
  unbound (``state_v2p[vslot] < 0``) or ``phys >= num_slots``. Padded lanes of a fixed-size
  (CUDA-graph) batch pass ``vslot = -1`` or ``accepted = -1``.
- Precondition (the caller's, not checked): the live lanes' physical slots are distinct.

Layout requirements (checked on the host from metadata only):

- ``scratch.dtype == dest.dtype``: the commit moves bytes, bit-exact. A dtype conversion
  (e.g. fp32 scratch into a bf16 conv state) would be a rounding decision of the model's verify
  kernel, which should write its scratch in the state's dtype.
- The per-state block ``[*S]`` is contiguous in both ``scratch[b, t]`` and ``dest[s]``; the
  strides of ``scratch``'s first two dims and of ``dest``'s first dim are free (non-negative).
- ``accepted`` and ``vslots`` are 1-D contiguous int32 (or int64) of equal length ``bs``,
  ``bs <= scratch.shape[0]``; ``state_v2p`` is 1-D contiguous int32.

Two entry points:

- ``commit_states``: one state tensor, one launch.
- ``commit_states_multi``: many state tensors (conv and SSM of every STATE layer, of any mix of
  dtypes) in **one** launch. Their addresses, strides and sizes are packed once into small
  device tables by a ``StateCommitPlan`` (built eagerly, outside CUDA-graph capture, from
  persistent scratch buffers and arena views); each step's call then allocates nothing, reads
  nothing on the host, and has a fixed grid, so it can be captured and replayed.

How the kernels move bytes: like ``unit_ops``, as the widest integer words ``W`` in
(8, 4, 2, 1) bytes that divide every base address, every stride in bytes and the block size;
when all of them are multiples of 16 the kernel is told so and moves 16-byte vectors. One
program per (chunk of ``BLOCK`` words of a block, lane): a state of megabytes is spread over
many programs. Lane offsets (``b * stride_b + accepted * stride_t``, ``phys * slot_stride``)
are int64 before they meet a pointer: slot offsets in big arenas exceed 2^31 bytes. Ids are
checked for ``>= 0`` explicitly before any gather; a skipped lane touches no memory.

Each op below reads top-down: the Triton kernels, the launchers (``*_triton``, which tests call
directly), the torch references they must equal, and the public ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

# Bytes one program moves per block (a chunk); bigger blocks are split over programs.
_CHUNK_BYTES = 16384
_WORD_BYTES = (8, 4, 2, 1)
_TL_WORD = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
_META_COLS = 8  # StateCommitPlan.meta columns, see _commit_multi_kernel
_MAX_LANES = 65535  # CUDA limit of grid axis 1 (one program row per lane)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _commit_lane_chunk(
    src,  # word pointer to scratch[0, 0]
    dst,  # word pointer to dest[0]
    src_stride_b,  # words
    src_stride_t,  # words
    dst_stride_slot,  # words
    block_words,
    t_len,
    num_slots,
    lane,
    chunk,
    accepted_ptr,
    vslots_ptr,
    v2p_ptr,
    v2p_numel,
    IDENTITY: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    """Copy chunk ``chunk`` of lane ``lane``'s kept state into its physical slot (or nothing)."""
    acc = tl.load(accepted_ptr + lane).to(tl.int64)
    vslot = tl.load(vslots_ptr + lane).to(tl.int64)
    ok = (acc >= 0) & (acc < t_len) & (vslot >= 0)
    if IDENTITY:
        phys = vslot
    else:
        ok = ok & (vslot < v2p_numel)
        phys = tl.load(v2p_ptr + vslot, mask=ok, other=-1).to(tl.int64)
    ok = ok & (phys >= 0) & (phys < num_slots)
    # A skipped lane moves nothing (limit 0) and its offsets are clamped to 0.
    acc = tl.where(ok, acc, 0)
    phys = tl.where(ok, phys, 0)
    limit = tl.multiple_of(tl.where(ok, block_words, 0), VEC)  # blocks are whole vectors
    # int64 before the multiply: slot * slot stride exceeds 2^31 in big arenas.
    src_off = tl.multiple_of(lane.to(tl.int64) * src_stride_b + acc * src_stride_t, VEC)
    dst_off = tl.multiple_of(phys * dst_stride_slot, VEC)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < limit
    vals = tl.load(src + src_off + offs, mask=m)
    tl.store(dst + dst_off + offs, vals, mask=m)


@triton.jit(do_not_specialize=["t_len", "num_slots", "v2p_numel"])
def _commit_states_kernel(
    scratch_ptr,
    dest_ptr,
    src_stride_b,
    src_stride_t,
    dst_stride_slot,
    block_words,
    t_len,
    num_slots,
    accepted_ptr,
    vslots_ptr,
    v2p_ptr,
    v2p_numel,
    WORD: tl.constexpr,
    ALIGN16: tl.constexpr,
    IDENTITY: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    src = scratch_ptr.to(tl.pointer_type(WORD))
    dst = dest_ptr.to(tl.pointer_type(WORD))
    if ALIGN16:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    _commit_lane_chunk(
        src, dst, src_stride_b, src_stride_t, dst_stride_slot, block_words, t_len, num_slots,
        tl.program_id(1), tl.program_id(0), accepted_ptr, vslots_ptr, v2p_ptr, v2p_numel,
        IDENTITY, BLOCK, VEC,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_work", "v2p_numel"])
def _commit_multi_kernel(
    meta_ptr,  # int64 [L, 8]: src addr, dst addr, src stride b, t, dst stride, words, T, slots
    work_ptr,  # int32 [2, num_work]: (layer, chunk) of each program of axis 0
    num_work,
    accepted_ptr,
    vslots_ptr,
    v2p_ptr,
    v2p_numel,
    WORD: tl.constexpr,
    ALIGN16: tl.constexpr,
    IDENTITY: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    w = tl.program_id(0)
    layer = tl.load(work_ptr + w).to(tl.int64)
    chunk = tl.load(work_ptr + num_work + w)
    row = meta_ptr + layer * 8
    src = tl.load(row + 0).to(tl.pointer_type(WORD))
    dst = tl.load(row + 1).to(tl.pointer_type(WORD))
    if ALIGN16:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    _commit_lane_chunk(
        src, dst, tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5),
        tl.load(row + 6), tl.load(row + 7), tl.program_id(1), chunk, accepted_ptr,
        vslots_ptr, v2p_ptr, v2p_numel, IDENTITY, BLOCK, VEC,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host-side checks and geometry (metadata only, no device read)
# ---------------------------------------------------------------------------------------------


def _block_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Whether dims ``lead:`` of ``t`` are laid out contiguously (size-1 dims ignored)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_pair(scratch: torch.Tensor, dest: torch.Tensor, name: str = "") -> None:
    """One (scratch, dest) pair: shapes, dtypes, layout, device."""
    tag = f"{name}: " if name else ""
    if scratch.dim() < 2 or dest.dim() != scratch.dim() - 1:
        raise ValueError(
            f"{tag}need scratch [bs, T, *S] and dest [num_slots, *S], got "
            f"{tuple(scratch.shape)} and {tuple(dest.shape)}"
        )
    if tuple(scratch.shape[2:]) != tuple(dest.shape[1:]):
        raise ValueError(
            f"{tag}state shapes differ: scratch {tuple(scratch.shape[2:])}, "
            f"dest {tuple(dest.shape[1:])}"
        )
    if scratch.dtype != dest.dtype:
        raise ValueError(
            f"{tag}scratch dtype {scratch.dtype} != dest dtype {dest.dtype} (the commit moves "
            "bytes: write the scratch in the state's dtype)"
        )
    if scratch.device != dest.device:
        raise ValueError(f"{tag}scratch on {scratch.device}, dest on {dest.device}")
    if not (_block_contiguous(scratch, 2) and _block_contiguous(dest, 1)):
        raise ValueError(f"{tag}the per-state block [*S] must be contiguous in scratch and dest")
    if min(scratch.stride(0), scratch.stride(1), dest.stride(0)) < 0:
        raise ValueError(f"{tag}negative strides are not supported")


def _check_lanes(
    accepted: torch.Tensor,
    vslots: torch.Tensor,
    state_v2p: torch.Tensor | None,
    rows: int,
    device: torch.device,
) -> int:
    """Lane tensors; returns ``bs``."""
    for name, t in (("accepted", accepted), ("vslots", vslots), ("state_v2p", state_v2p)):
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the states on {device}")
        if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    bs = vslots.numel()
    if accepted.numel() != bs:
        raise ValueError(f"accepted has {accepted.numel()} lanes, vslots {bs}")
    if bs > rows:
        raise ValueError(f"{bs} lanes but the scratch holds {rows} rows")
    if bs > _MAX_LANES:
        raise ValueError(f"{bs} lanes exceed the grid limit {_MAX_LANES}")
    return bs


def _geometry(ptrs: Sequence[int], byte_strides: Sequence[int]) -> tuple[int, bool]:
    """``(W, align16)``: the widest word dividing every address and byte stride/size, and
    whether all of them are multiples of 16 (16-byte vectors)."""
    vals = [*ptrs, *byte_strides]
    w = next(w for w in _WORD_BYTES if all(v % w == 0 for v in vals))
    return w, all(v % 16 == 0 for v in vals)


def _pair_layout(scratch: torch.Tensor, dest: torch.Tensor) -> tuple[list[int], list[int]]:
    """``([src addr, dst addr], [src stride b, src stride t, dst stride, block] in bytes)``."""
    size = scratch.element_size()
    block = 1
    for d in dest.shape[1:]:
        block *= d
    strides = [scratch.stride(0), scratch.stride(1), dest.stride(0), block]
    return [scratch.data_ptr(), dest.data_ptr()], [s * size for s in strides]


def _launch_shape(block_words: int, word_bytes: int, block: int | None) -> int:
    """Words per program (a power of two)."""
    if block is None:
        block = min(next_pow2(block_words), max(1, _CHUNK_BYTES // word_bytes))
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return block


def _num_warps(block: int, vec: int) -> int:
    """Enough threads that each moves a few 16-byte vectors per chunk."""
    return max(1, min(8, block // (32 * max(vec, 1) * 4)))


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def commit_states_triton(
    scratch: torch.Tensor,
    accepted: torch.Tensor,
    vslots: torch.Tensor,
    state_v2p: torch.Tensor | None,
    dest: torch.Tensor,
    *,
    block: int | None = None,
) -> None:
    """Triton launcher of ``commit_states`` (one launch; none for no lanes or empty states).

    ``block`` (a power of two) overrides the words per program; tests lower it to spread a
    state over several programs at small sizes.
    """
    _check_pair(scratch, dest)
    bs = _check_lanes(accepted, vslots, state_v2p, scratch.shape[0], dest.device)
    ptrs, byte_strides = _pair_layout(scratch, dest)
    if bs == 0 or byte_strides[-1] == 0:
        return
    w, align16 = _geometry(ptrs, byte_strides)
    sb, st, sd, block_words = (s // w for s in byte_strides)
    block = _launch_shape(block_words, w, block)
    vec = 16 // w if align16 else 1
    identity = state_v2p is None
    _commit_states_kernel[(triton.cdiv(block_words, block), bs)](
        scratch,
        dest,
        sb,
        st,
        sd,
        block_words,
        scratch.shape[1],
        dest.shape[0],
        accepted,
        vslots,
        vslots if identity else state_v2p,
        0 if identity else state_v2p.numel(),
        WORD=_TL_WORD[w],
        ALIGN16=align16,
        IDENTITY=identity,
        BLOCK=block,
        VEC=vec,
        num_warps=_num_warps(block, vec),
    )


class StateCommitPlan:
    """The fixed part of a multi-tensor commit: ``scratches[i]`` commits into ``dests[i]``.

    Built once, eagerly (it allocates two small device tables and copies them from the host),
    from *persistent* buffers: the plan stores raw addresses, so it holds references to every
    tensor and is stale once any of them is reallocated or an arena view is rebuilt (e.g. the
    STATE band grew: build a new plan, outside capture). Pairs may mix dtypes (conv bf16, SSM
    fp32); each pair must satisfy ``commit_states``'s requirements. Empty states are dropped.

    - ``meta`` int64 ``[L, 8]``: per pair the scratch and dest addresses, the scratch strides of
      dims 0 and 1, the dest slot stride and the block size (all in words), ``T`` and
      ``num_slots``;
    - ``work`` int32 ``[2, num_work]``: the (pair, chunk) each program of grid axis 0 moves;
    - ``word_bytes``, ``align16``, ``block``: the launch's constants (one compiled variant per
      distinct triple; warm it eagerly before capture by one call with padded lanes);
    - ``rows``: the most lanes a call may pass (the smallest ``scratch.shape[0]``).
    """

    def __init__(
        self,
        scratches: Sequence[torch.Tensor],
        dests: Sequence[torch.Tensor],
        *,
        block: int | None = None,
    ) -> None:
        scratches, dests = list(scratches), list(dests)
        if len(scratches) != len(dests) or not scratches:
            raise ValueError(f"need equal, non-empty lists: {len(scratches)} vs {len(dests)}")
        device = dests[0].device
        ptrs, strides, live = [], [], []
        for i, (s, d) in enumerate(zip(scratches, dests, strict=True)):
            _check_pair(s, d, f"pair {i}")
            if d.device != device:
                raise ValueError(f"pair {i}: on {d.device}, pair 0 on {device}")
            p, bst = _pair_layout(s, d)
            if bst[-1] == 0:
                continue
            ptrs += p
            strides += bst
            live.append((s, d, bst))
        self.scratches, self.dests = scratches, dests
        self.device = device
        self.rows = min(s.shape[0] for s in scratches)
        if not live:  # nothing to move: calls launch nothing
            self.word_bytes, self.align16, self.block = 1, False, 1
            self.meta = torch.zeros(0, _META_COLS, dtype=torch.int64, device=device)
            self.work = torch.zeros(2, 0, dtype=torch.int32, device=device)
            return
        w, self.align16 = _geometry(ptrs, strides)
        self.word_bytes = w
        max_words = max(bst[-1] // w for _, _, bst in live)
        self.block = _launch_shape(max_words, w, block)
        meta, layers, chunks = [], [], []
        for i, (s, d, bst) in enumerate(live):
            sb, st, sd, words = (x // w for x in bst)
            meta.append([s.data_ptr(), d.data_ptr(), sb, st, sd, words, s.shape[1], d.shape[0]])
            n = triton.cdiv(words, self.block)
            layers += [i] * n
            chunks += range(n)
        self.meta = torch.tensor(meta, dtype=torch.int64).to(device)
        self.work = torch.tensor([layers, chunks], dtype=torch.int32).to(device)

    @property
    def num_work(self) -> int:
        """Programs along grid axis 0 (chunks of all pairs)."""
        return self.work.shape[1]


def commit_states_multi_triton(
    plan: StateCommitPlan,
    accepted: torch.Tensor,
    vslots: torch.Tensor,
    state_v2p: torch.Tensor | None,
) -> None:
    """Triton launcher of ``commit_states_multi``: every pair of ``plan`` in one launch (none
    for no lanes). No allocation, no host read, fixed grid ``(plan.num_work, bs)``."""
    bs = _check_lanes(accepted, vslots, state_v2p, plan.rows, plan.device)
    if bs == 0 or plan.num_work == 0:
        return
    w = plan.word_bytes
    vec = 16 // w if plan.align16 else 1
    identity = state_v2p is None
    _commit_multi_kernel[(plan.num_work, bs)](
        plan.meta,
        plan.work,
        plan.num_work,
        accepted,
        vslots,
        vslots if identity else state_v2p,
        0 if identity else state_v2p.numel(),
        WORD=_TL_WORD[w],
        ALIGN16=plan.align16,
        IDENTITY=identity,
        BLOCK=plan.block,
        VEC=vec,
        num_warps=_num_warps(plan.block, vec),
    )


# ---------------------------------------------------------------------------------------------
# torch references (the oracle; also the CPU implementation)
# ---------------------------------------------------------------------------------------------


def commit_states_reference(
    scratch: torch.Tensor,
    accepted: torch.Tensor,
    vslots: torch.Tensor,
    state_v2p: torch.Tensor | None,
    dest: torch.Tensor,
) -> None:
    """``dest[phys(vslots[b])] = scratch[b, accepted[b]]`` for every live lane ``b``, in place.

    ``phys(v) = state_v2p[v]`` (``v`` itself when ``state_v2p`` is None). Lanes with
    ``accepted`` outside ``[0, T)``, ``vslot`` outside ``[0, V)``, an unbound slot or
    ``phys >= num_slots`` are skipped. Requirements: see the module docstring.
    """
    _check_pair(scratch, dest)
    bs = _check_lanes(accepted, vslots, state_v2p, scratch.shape[0], dest.device)
    if bs == 0:
        return
    t_len, num_slots = scratch.shape[1], dest.shape[0]
    acc = accepted.long()
    vs = vslots.long()
    ok = (acc >= 0) & (acc < t_len) & (vs >= 0)
    if state_v2p is None:
        phys = vs
    else:
        v = state_v2p.numel()
        ok = ok & (vs < v)
        phys = state_v2p[vs.clamp(0, max(v - 1, 0))].long() if v else torch.full_like(vs, -1)
    ok = ok & (phys >= 0) & (phys < num_slots)
    lanes = ok.nonzero().flatten()
    if lanes.numel():
        dest[phys[lanes]] = scratch[lanes, acc[lanes]]


def commit_states_multi_reference(
    scratches: Sequence[torch.Tensor],
    accepted: torch.Tensor,
    vslots: torch.Tensor,
    state_v2p: torch.Tensor | None,
    dests: Sequence[torch.Tensor],
) -> None:
    """``commit_states_reference`` for every pair ``(scratches[i], dests[i])``."""
    if len(scratches) != len(dests):
        raise ValueError(f"need equal lists: {len(scratches)} vs {len(dests)}")
    for s, d in zip(scratches, dests, strict=True):
        commit_states_reference(s, accepted, vslots, state_v2p, d)


def _commit_states_multi_planned_reference(
    plan: StateCommitPlan,
    accepted: torch.Tensor,
    vslots: torch.Tensor,
    state_v2p: torch.Tensor | None,
) -> None:
    """Commit every pair of ``plan`` in one launch; per pair as ``commit_states`` (the
    reference: ``commit_states_multi_reference`` of the plan's pairs)."""
    commit_states_multi_reference(plan.scratches, accepted, vslots, state_v2p, plan.dests)


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


commit_states = kernel_op(
    "commit_states",
    triton=commit_states_triton,
    reference=commit_states_reference,
    device_of="dest",
)


commit_states_multi = kernel_op(
    "commit_states_multi",
    triton=commit_states_multi_triton,
    reference=_commit_states_multi_planned_reference,
    device_of=lambda plan, *args, **kwargs: plan.dests[0],
)
