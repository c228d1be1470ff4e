"""Dequantise GGUF tensors to torch tensors.

Supported ggml types: F32, F16, BF16 (stored floats) and the block quantisations Q8_0, Q5_0,
Q4_K and Q6_K (the ones llama.cpp's Q4_K_M / Q5_0 / Q8_0 files use), decoded by the ``gguf``
library's numpy reference (``gguf.quants.dequantize``, llama.cpp's formulas in float32).
Any other type is refused by name (:class:`~unimem.models.gguf.reader.GGUFError`).

Decoding is exact in float32 (every supported format's values are float32 products of its
scales and integer codes); :func:`dequantize` returns float32 unless asked for another dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from unimem.models.gguf.reader import GGUFError, GGUFTensor

__all__ = ["SUPPORTED_TYPES", "dequantize"]

Q = GGMLQuantizationType
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}
)


def dequantize(tensor: GGUFTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``tensor`` decoded to a new ``[*tensor.shape]`` CPU tensor of ``dtype`` (module
    docstring); :class:`GGUFError` naming the tensor for an unsupported type."""
    qtype = tensor.qtype
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise GGUFError(
            f"tensor {tensor.name}: ggml type {qtype.name} is not supported (supported: {names})"
        )
    raw = np.ascontiguousarray(tensor.data)
    if qtype == Q.F32:
        out = torch.from_numpy(raw.view(np.float32).copy())
    elif qtype == Q.F16:
        out = torch.from_numpy(raw.view(np.float16).copy())
    elif qtype == Q.BF16:
        out = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    else:
        out = torch.from_numpy(_gguf_dequantize(raw, qtype))
    out = out.reshape(tensor.shape)
    return out if out.dtype == dtype else out.to(dtype)
