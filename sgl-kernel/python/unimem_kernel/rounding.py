"""Round-to-nearest-even inside Triton kernels, bit for bit as torch rounds.

:func:`round_rne` is the one place a kernel rounds an fp32 value to a storage dtype, so that
the kernels round where the torch references round and get their bits; :data:`INTERPRETED`
says whether Triton runs through its CPU interpreter (whose casts behave differently).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["INTERPRETED", "round_rne"]

# Whether Triton runs through its interpreter (fixed when triton is imported, as Triton's own
# switch is): the interpreter's fp32 -> bf16 conversion truncates instead of rounding.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_rne(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to ``dt`` to nearest, ties to even (torch's rounding), as a tensor of
    ``dt``. On the GPU a 16-bit ``dt`` rounds with one ``cvt.rn`` in inline assembly, which the
    compiler cannot see through: through a plain ``.to(bf16)``, LLVM narrows ``fptrunc(fmul)``
    to a 16-bit multiply and contracts it with the 16-bit add that follows into one fused
    multiply-add, skipping the rounding torch does in between. Under the interpreter, whose
    conversion to bf16 truncates, bf16 rounds through the bits (the same value for every
    finite ``x``), so the CPU tests compare the kernels' bits."""
    if INTERPRETED:
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dt)
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "cvt.rn.bf16.f32 $0, $1;", "=h,r", [x], dtype=tl.bfloat16, is_pure=True, pack=1
        )
    if dt == tl.float16:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16.f32 $0, $1;", "=h,r", [x], dtype=tl.float16, is_pure=True, pack=1
        )
    return x.to(dt)
