"""Read a GGUF file: its metadata (key -> value) and its tensor table, tensors as raw bytes.

The layout is llama.cpp's GGUF (versions 2 and 3, little-endian): the magic ``GGUF``, the
version, the tensor and key/value counts, the key/value pairs, the tensor infos (name, dims
innermost-first, ggml type, offset), then the tensor data aligned to ``general.alignment``
(32 by default). Value and tensor type numbers are the ``gguf`` library's
(:class:`gguf.GGUFValueType`, :class:`gguf.GGMLQuantizationType`).

The header is parsed here, not through ``gguf.GGUFReader``: that reader builds a numpy view per
array element, which for a 262 144-token vocabulary takes tens of seconds; here numeric arrays
are one ``frombuffer`` each and string arrays one pass over the bytes. Tensor bytes stay in a
read-only memory map until :func:`unimem.models.gguf.dequant.dequantize` reads them.

Errors are :class:`GGUFError` (a ``ValueError``) naming the file and what is wrong.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "read_gguf"]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}

_STRUCT_CODES = {"<u1": "<B", "<i1": "<b", "<u2": "<H", "<i2": "<h", "<u4": "<I", "<i4": "<i"}
_STRUCT_CODES.update({"<f4": "<f", "<u8": "<Q", "<i8": "<q", "<f8": "<d"})


class GGUFError(ValueError):
    """A file that is not a GGUF this reader understands; the message names the file."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` in torch order (outermost first, the reverse of
    GGUF's dims), its ggml ``qtype``, and ``data``: its raw bytes, a read-only ``uint8``
    array (a view of the file's memory map) of ``shape[:-1] + (bytes per row,)``."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    data: np.ndarray


@dataclass
class GGUFFile:
    """A parsed GGUF: ``metadata`` (key -> int, float, bool, str, or list of those; numeric
    arrays as numpy arrays) and ``tensors`` (name -> :class:`GGUFTensor`, in file order)."""

    path: Path
    version: int
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        """``metadata[key]``; :class:`GGUFError` naming the key if the file lacks it."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]


class _Cursor:
    """Sequential little-endian reads over a bytes-like buffer."""

    def __init__(self, buf, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str):
        try:
            out = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path}: truncated header at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return out[0] if len(out) == 1 else out

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated string at byte {self.pos}")
        s = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.unpack("<IQ")
            if etype == GGUFValueType.STRING:
                return self.strings(count)
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype])
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated array at byte {self.pos}")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos = end
                return arr.astype(bool) if etype == GGUFValueType.BOOL else arr
            return [self.value(etype) for _ in range(count)]
        if vtype in _SCALARS:
            v = self.unpack(_STRUCT_CODES[_SCALARS[vtype]])
            return bool(v) if vtype == GGUFValueType.BOOL else v
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}")

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
                pos += n
        except struct.error:
            raise GGUFError(f"{self.path}: truncated string array at byte {pos}") from None
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the GGUF at ``path`` (module docstring). Tensor data is memory-mapped, not read."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(
            f"{path}: GGUF version {version} is not supported (2, 3; big-endian files neither)"
        )
    n_tensors, n_kv = cur.unpack("<QQ")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("<I")
        metadata[key] = cur.value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        qtype_id, offset = cur.unpack("<IQ")
        infos.append((name, dims, qtype_id, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, qtype_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown ggml type {qtype_id}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GGUFError(
                f"{path}: tensor {name} row of {dims[0]} elements is not a multiple of "
                f"{qtype.name}'s block of {block}"
            )
        shape = tuple(int(d) for d in reversed(dims))
        row_bytes = dims[0] // block * block_bytes
        n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        start = data_start + offset
        end = start + n_rows * row_bytes
        if end > len(mm):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file")
        raw = mm[start:end].reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, shape, qtype, raw)
    return GGUFFile(path, version, metadata, tensors)
