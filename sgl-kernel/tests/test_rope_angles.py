"""``unimem_kernel.rope_angles.rope_cos_sin``: RoPE's cos/sin in one launch against the models'
torch formula (:func:`rope_cos_sin_reference`).

On CUDA the kernel must give torch's bits — a model's tokens may not move when its RoPE
tables come from the kernel — so the ``gpu`` cases compare with ``torch.equal`` over every
position below 2^18, at the frequency tables of the presets and architectures (theta 10^4 and
10^7, head dims 64 to 256, partial rotary), plain, with gpt-oss's attention factor and with
the casts to bf16 / fp16. Under the Triton interpreter (CPU) the cosine is NumPy's: float32
results agree with torch's CPU ones to one unit in the last place, and exactly after a cast to
16 bits at these sizes. Also: ragged ``T`` (not a multiple of the block), ``T = 0``, int32
positions, float64 tables (the reference), bad inputs refused by name.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel.rope_angles import rope_cos_sin, rope_cos_sin_reference


def inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def compare(got, want, exact):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if exact:
            assert torch.equal(g.cpu(), w.cpu())
        else:  # one float32 ulp (the interpreter's NumPy cosine against torch's)
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1.2e-7, atol=6e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "theta,rotary,factor,out_dtype",
    [
        (10_000.0, 128, None, None),
        (10_000_000.0, 64, None, None),
        (150_000.0, 64, 1.3465735902799727, torch.bfloat16),
        (10_000.0, 256, None, torch.float16),
    ],
)
def test_matches_the_model_formula(triton_backend, device, theta, rotary, factor, out_dtype):
    gen = torch.Generator().manual_seed(rotary)
    positions = torch.randint(0, 40_000, (45,), generator=gen).to(device)
    inv = inv_freq(theta, rotary).to(device)
    got = rope_cos_sin(positions, inv, factor, out_dtype)
    want = rope_cos_sin_reference(positions, inv, factor, out_dtype)
    compare(got, want, exact=device == "cuda" or out_dtype is not None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "theta,rotary,factor,out_dtype",
    [
        (10_000.0, 128, None, None),  # the small preset
        (10_000_000.0, 64, None, None),  # Qwen3-Next: partial rotary 64 of 256
        (1_000_000.0, 128, None, torch.bfloat16),  # Gemma 3 global
        (150_000.0, 64, 1.3465735902799727, torch.bfloat16),  # gpt-oss, YaRN factor
    ],
)
def test_every_position_equals_torch_on_gpu(theta, rotary, factor, out_dtype):
    positions = torch.arange(1 << 18, device="cuda")
    inv = inv_freq(theta, rotary).cuda()
    got = rope_cos_sin(positions, inv, factor, out_dtype)
    compare(got, rope_cos_sin_reference(positions, inv, factor, out_dtype), exact=True)
    got32 = rope_cos_sin(positions.int(), inv, factor, out_dtype)
    compare(got32, got, exact=True)


@pytest.mark.gpu
def test_inside_a_cuda_graph():
    positions = torch.randint(0, 4096, (384,), device="cuda")
    inv = inv_freq(10_000.0, 128).cuda()
    rope_cos_sin(positions, inv)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = rope_cos_sin(positions, inv)
    positions.copy_(torch.randint(0, 4096, (384,), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    compare(got, rope_cos_sin_reference(positions, inv), exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_and_dtypes(triton_backend, device):
    inv = inv_freq(10_000.0, 32).to(device)
    for t in (0, 1, 17):
        pos = torch.arange(t, dtype=torch.int32, device=device)
        c, s = rope_cos_sin(pos, inv)
        assert c.shape == s.shape == (t, 16) and c.dtype == torch.float32 and c.is_contiguous()
    inv64 = inv.double()
    pos = torch.arange(9, device=device)
    compare(rope_cos_sin(pos, inv64), rope_cos_sin_reference(pos, inv64), exact=True)


def test_bad_inputs_are_refused_by_name():
    inv = inv_freq(10_000.0, 32)
    with pytest.raises(ValueError, match="positions must be a 1-D int32/int64"):
        rope_cos_sin(torch.arange(4.0), inv)
    with pytest.raises(ValueError, match="inv_freq must be a 1-D float32/float64"):
        rope_cos_sin(torch.arange(4), inv.half())
    with pytest.raises(ValueError, match="out_dtype must be a float dtype"):
        rope_cos_sin(torch.arange(4), inv, out_dtype=torch.int32)
