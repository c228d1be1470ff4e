"""FP8 operands and the closeness check shared by the FP8 kernel tests (pytest puts this folder
on ``sys.path``; the test modules import it by name, as ``kernel_devices``)."""

from __future__ import annotations

import torch

from unimem_kernel.fp8_gemm import FP8_DTYPE, FP8_MAX, num_groups


def fp8_weights(n: int, k: int, gen: torch.Generator, lead: tuple[int, ...] = ()):
    """A random ``[*lead, n, k]`` weight quantised per row and group of 128 columns:
    ``(q e4m3, scales [*lead, n, KG] float32)`` on the CPU."""
    w = torch.randn(*lead, n, k, generator=gen) / k**0.5
    kg = num_groups(k)
    pad = torch.zeros(*lead, n, kg * 128)
    pad[..., :k] = w
    s = pad.view(*lead, n, kg, 128).abs().amax(-1) / FP8_MAX
    q = (pad.view(*lead, n, kg, 128) / s[..., None]).view(*lead, n, kg * 128)[..., :k]
    return q.to(FP8_DTYPE), s.float()


def assert_product_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """A kernel's product against the float32 reference on the same operands: only the order
    (and, on tensor cores, the precision) of the float32 accumulation differs, plus one
    rounding to ``y``'s dtype (one bf16 ulp: the interpreter's cast truncates)."""
    rtol = 2**-7 if y.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.cpu().float(), ref.cpu().float(), rtol=rtol, atol=1e-3)
