"""GGUF checkpoints (llama.cpp's format): read, dequantise, convert to a cached HF directory.

:func:`converted_checkpoint` is the entry point; :mod:`unimem.models.model_path` routes a
``.gguf`` ``--model-path`` to it. The ``gguf`` package is imported only when a GGUF is used.
"""

from __future__ import annotations

__all__ = ["converted_checkpoint", "is_gguf_file"]

MAGIC = b"GGUF"


def is_gguf_file(path: str) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def converted_checkpoint(path, root=None, expected_sha256=None):
    """See :func:`unimem.models.gguf.convert.converted_checkpoint`."""
    from unimem.models.gguf.convert import converted_checkpoint as convert

    return convert(path, root, expected_sha256)
