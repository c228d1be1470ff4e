"""Byte ops on fixed-size units of the arena: copy units (compaction) and fill units
(zero on hand-out, NaN poison for freed units).

The arena is one ``uint8`` tensor. A band's unit ``u`` spans bytes
``[base + u * unit_bytes, base + (u + 1) * unit_bytes)``. ``base`` and ``unit_bytes`` are
multiples of 16 (the arena itself is 16-byte aligned), so kernels may move 16-byte words.
Offsets are int64 everywhere: arenas exceed 2^31 bytes. Negative ids are padding and skipped.
"""

from __future__ import annotations

import torch



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


def copy_units(buf, base, unit_bytes, src, dst) -> None:
    """See ``copy_units_reference`` for the contract."""
    copy_units_reference(buf, base, unit_bytes, src, dst)


def fill_units(buf, base, unit_bytes, ids, byte_value) -> None:
    """See ``fill_units_reference`` for the contract."""
    fill_units_reference(buf, base, unit_bytes, ids, byte_value)
