"""Byte ops on fixed-size units of the arena: copy units (compaction) and fill units
(zero on hand-out, NaN poison for freed units).

The arena is one ``uint8`` tensor. A band's unit ``u`` spans bytes
``[base + u * unit_bytes, base + (u + 1) * unit_bytes)``. ``base`` and ``unit_bytes`` are
multiples of 16 (the arena itself is 16-byte aligned), so kernels may move 16-byte words.
Offsets are int64 everywhere: arenas exceed 2^31 bytes. Negative ids are padding and skipped.

Each op below reads top-down: its Triton kernel, the launcher (``*_triton``, which tests call
directly), the torch reference it must equal, and the public op (``_dispatch.kernel_op``).

How the kernels move bytes:

- *Words.* The launcher views the arena as the widest integer type ``W`` in (8, 4, 2, 1) bytes
  that divides ``buf.data_ptr()``, ``base`` and ``unit_bytes`` (dropping the arena's last
  ``numel % W`` bytes from the view: no unit reaches them, since every unit ends on a multiple
  of ``W``). What may be relied on: CUDA's caching allocator returns blocks aligned to at least
  256 bytes, and the arena's contract makes ``base`` and ``unit_bytes`` multiples of 16, so an
  arena allocated on its own is always moved as int64; when it is also 16-byte aligned the
  kernel is told so (``VEC``) and loads and stores 16 bytes per thread access. A view that
  starts at an odd offset still works, with narrower words.
- *Grid.* One program per (unit, chunk of ``BLOCK`` words of the unit): a unit of megabytes is
  spread over many programs, so one big unit moves at bandwidth, and a batch of small units
  over many programs too.
- *Padding.* A pair or id ``< 0`` is loaded by its programs, which then touch nothing; callers
  pass fixed-size, ``-1``-padded id lists (compaction's ``src_out``/``dst_out``) so that the
  launch shape never depends on device data.
- Unit offsets are computed in int64 (``id * unit_words``) before they meet a pointer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

# Bytes one program moves per unit (a chunk); units above this are split across programs.
_CHUNK_BYTES = 16384
# CUDA limits grid axis 1 (the chunks of a unit) to 65535.
_MAX_CHUNKS = 65535
_WORD_TYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word_view(buf: torch.Tensor, base: int, unit_bytes: int) -> tuple[torch.Tensor, int, int]:
    """``(words, word_bytes, vec)``: ``buf`` viewed as the widest aligned integer words.

    ``vec`` is how many words make an aligned 16-byte vector (1 when 16-byte alignment of
    every unit's start cannot be guaranteed). A view, never a copy.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.stride(0) != 1:
        raise ValueError(f"the arena must be a contiguous 1-D uint8 tensor, got {buf.dtype}")
    if base < 0 or unit_bytes <= 0:
        raise ValueError(f"bad unit geometry: base={base}, unit_bytes={unit_bytes}")
    ptr, offset = buf.data_ptr(), buf.storage_offset()
    for w, dtype in _WORD_TYPES:
        if ptr % w == 0 and offset % w == 0 and base % w == 0 and unit_bytes % w == 0:
            usable = buf.numel() - buf.numel() % w
            words = buf[:usable].view(dtype)
            aligned16 = ptr % 16 == 0 and base % 16 == 0 and unit_bytes % 16 == 0
            return words, w, (16 // w if aligned16 else 1)
    raise AssertionError("unreachable: 1-byte words always fit")


def _unit_grid(unit_words: int, word_bytes: int, block: int | None) -> tuple[int, int]:
    """``(BLOCK, chunks)``: words per program and programs per unit."""
    if block is None:
        block = min(next_pow2(unit_words), max(1, _CHUNK_BYTES // word_bytes))
    chunks = triton.cdiv(unit_words, block)
    if chunks > _MAX_CHUNKS:
        raise ValueError(f"unit of {unit_words} words needs {chunks} chunks (> {_MAX_CHUNKS})")
    return block, chunks


def _num_warps(block: int, vec: int) -> int:
    """Enough threads that each moves a few 16-byte vectors per chunk."""
    return max(1, min(8, block // (32 * max(vec, 1) * 4)))


# ---------------------------------------------------------------------------------------------
# copy_units: unit src[i] -> unit dst[i]
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])  # id lists: see id_ops
def _copy_units_kernel(
    words_ptr,
    base_words,
    unit_words,
    src_ptr,
    dst_ptr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    # int64 before the multiply: id * unit size exceeds 2^31 in big arenas.
    src_start = tl.multiple_of(base_words + src * unit_words, VEC)
    dst_start = tl.multiple_of(base_words + dst * unit_words, VEC)
    # A padded pair moves nothing: its word limit is 0.
    limit = tl.where((src >= 0) & (dst >= 0), unit_words, 0)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < limit
    vals = tl.load(words_ptr + src_start + offs, mask=m)
    tl.store(words_ptr + dst_start + offs, vals, mask=m)


def copy_units_triton(
    buf: torch.Tensor,
    base: int,
    unit_bytes: int,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    block: int | None = None,
) -> None:
    """Triton launcher of ``copy_units`` (one launch; none for empty id lists).

    ``block`` (a power of two) overrides the words per program; tests lower it to exercise
    units split over several programs at small sizes.
    """
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-D")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    words, w, vec = _word_view(buf, base, unit_bytes)
    n = src.numel()
    if n == 0:
        return
    unit_words = unit_bytes // w
    block, chunks = _unit_grid(unit_words, w, block)
    _copy_units_kernel[(n, chunks)](
        words,
        base // w,
        unit_words,
        src,
        dst,
        BLOCK=block,
        VEC=vec,
        num_warps=_num_warps(block, vec),
    )


def copy_units_reference(
    buf: torch.Tensor, base: int, unit_bytes: int, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy unit ``src[i]`` onto unit ``dst[i]`` for every pair with both ids >= 0.

    ``src`` and ``dst`` are int32 of equal length. Precondition: no unit is both a source and a
    destination, and destinations are distinct (compaction guarantees both).
    """
    s = src.long()
    d = dst.long()
    ok = (s >= 0) & (d >= 0)
    off = torch.arange(unit_bytes, device=buf.device)
    si = (base + s[ok] * unit_bytes)[:, None] + off[None, :]
    di = (base + d[ok] * unit_bytes)[:, None] + off[None, :]
    buf[di.reshape(-1)] = buf[si.reshape(-1)]


# ---------------------------------------------------------------------------------------------
# fill_units: every byte of unit ids[i] <- byte_value
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["word_value"], do_not_specialize_on_alignment=["ids_ptr"])
def _fill_units_kernel(
    words_ptr,
    base_words,
    unit_words,
    ids_ptr,
    word_value,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    unit = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    chunk = tl.program_id(1)
    start = tl.multiple_of(base_words + unit * unit_words, VEC)
    limit = tl.where(unit >= 0, unit_words, 0)  # a padded id fills nothing
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < limit
    vals = tl.full([BLOCK], word_value, dtype=words_ptr.dtype.element_ty)
    tl.store(words_ptr + start + offs, vals, mask=m)


def _word_value(byte_value: int, word_bytes: int) -> int:
    """``byte_value`` repeated over a word, as the signed integer of that width."""
    return int.from_bytes(bytes([byte_value]) * word_bytes, "little", signed=word_bytes > 1)


def fill_units_triton(
    buf: torch.Tensor,
    base: int,
    unit_bytes: int,
    ids: torch.Tensor,
    byte_value: int,
    *,
    block: int | None = None,
) -> None:
    """Triton launcher of ``fill_units`` (one launch; none for an empty id list).

    ``block`` as in ``copy_units_triton``.
    """
    if not 0 <= byte_value <= 255:
        raise ValueError(f"byte_value must be in 0..255, got {byte_value}")
    if ids.dim() != 1 or not ids.is_contiguous():
        raise ValueError("ids must be a contiguous 1-D tensor")
    words, w, vec = _word_view(buf, base, unit_bytes)
    n = ids.numel()
    if n == 0:
        return
    unit_words = unit_bytes // w
    block, chunks = _unit_grid(unit_words, w, block)
    _fill_units_kernel[(n, chunks)](
        words,
        base // w,
        unit_words,
        ids,
        _word_value(byte_value, w),
        BLOCK=block,
        VEC=vec,
        num_warps=_num_warps(block, vec),
    )


def fill_units_reference(
    buf: torch.Tensor, base: int, unit_bytes: int, ids: torch.Tensor, byte_value: int
) -> None:
    """Set every byte of each unit ``ids[i] >= 0`` to ``byte_value`` (0..255).

    0 makes a handed-out unit finite; 0xFF fills it with NaN in every float format (poison).
    """
    i = ids.long()
    i = i[i >= 0]
    off = torch.arange(unit_bytes, device=buf.device)
    idx = (base + i * unit_bytes)[:, None] + off[None, :]
    buf[idx.reshape(-1)] = byte_value


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


copy_units = kernel_op(
    "copy_units", triton=copy_units_triton, reference=copy_units_reference, device_of="buf"
)


fill_units = kernel_op(
    "fill_units", triton=fill_units_triton, reference=fill_units_reference, device_of="buf"
)
