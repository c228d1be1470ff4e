"""Chunked (WY) GDN extend (``unimem_kernel.gdn_chunked``) against the recurrent Triton extend
(``unimem_kernel.gdn``) and the torch reference.

One ragged batch covers lengths 0, 1, C-1, C, C+1 (on a padded lane) and 3C+2, with and without
an initial state. SSM states are strided slot views of a ``uint8`` arena poisoned with 0xFF (NaN
in float32): a kernel that read a slot it must not (a padded lane's, one without an initial
state) or wrote outside the live slots is caught by NaN outputs or changed poison bytes.

On CPU the kernels run in the Triton interpreter at tiny sizes (chunks of 4, V blocks of 8); the
Qwen3-Next-sized variants (Hk 16, H 32, Dk = Dv = 128) are marked ``gpu``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from unimem_kernel import gdn
from unimem_kernel import gdn_chunked as gc
from unimem_kernel import gdn_reference as gr

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CPU = pytest.param(
    "cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1")
)
POISON = 0xFF
F32, BF16 = torch.float32, torch.bfloat16
DK, DV, KW, NUM_SLOTS = 8, 16, 4, 7
C = 4  # chunk of the interpreter runs
# lanes: 0 tokens (no state), 1, C-1 (no state), C, C+1 (padded lane), 3C+2
SLOTS = [4, 2, 6, 0, -1, 3]
INIT = [False, True, False, True, True, True]


def lens_for(c: int) -> list[int]:
    return [0, 1, c - 1, c, c + 1, 3 * c + 2]


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == BF16 else {"rtol": 1e-4, "atol": 1e-5}


STATE_TOL = {"rtol": 1e-4, "atol": 1e-5}


class Arena:
    """``ssm [NUM_SLOTS, H, Dk, Dv]`` float32 over slot envelopes (16 bytes of padding either
    side of each block) of a poisoned byte arena."""

    def __init__(self, shape, device, buf=None):
        self.shape = tuple(shape)
        self.block = math.prod(self.shape) * 4
        self.slot_bytes = self.block + 32
        if buf is None:
            buf = torch.full((64 + NUM_SLOTS * self.slot_bytes,), POISON, dtype=torch.uint8)
            buf = buf.to(device)
        self.buf = buf
        inner = [math.prod(self.shape[i + 1 :]) for i in range(len(self.shape))]
        self.ssm = buf.view(F32).as_strided(
            (NUM_SLOTS, *self.shape), (self.slot_bytes // 4, *inner), (48 + 16) // 4
        )

    def clone(self) -> Arena:
        return Arena(self.shape, self.buf.device, self.buf.clone())

    def untouched_outside(self, slots) -> bool:
        mask = torch.ones(self.buf.numel(), dtype=torch.bool)
        for s in slots:
            if s >= 0:
                base = 64 + s * self.slot_bytes
                mask[base : base + self.block] = False
        return bool((self.buf.cpu()[mask] == POISON).all())


def make_case(seed, h, hk, dtype, device, lens, dk=DK, dv=DV, slots_l=SLOTS, init_l=INIT):
    gen = torch.Generator().manual_seed(seed)
    arena = Arena((h, dk, dv), device)
    assert not arena.ssm.is_contiguous()
    for s, has in zip(slots_l, init_l, strict=True):
        if s >= 0 and has:
            arena.ssm[s] = (0.5 * torch.randn(h, dk, dv, generator=gen)).to(device)
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    n = bounds[-1]
    q = torch.randn(n, hk, dk, generator=gen).to(dtype).to(device)
    k = gr.l2norm(torch.randn(n, hk, dk, generator=gen)).to(dtype).to(device)
    v = torch.randn(n, h, dv, generator=gen).to(dtype).to(device)
    g = (-torch.rand(n, h, generator=gen)).to(device)
    beta = torch.rand(n, h, generator=gen).to(device)
    slots = torch.tensor(slots_l, dtype=torch.int64, device=device)
    init = torch.tensor(init_l, device=device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return arena, bounds, (q, k, v, g, beta), slots, init, cu


def rows_of(bounds, lanes) -> list[int]:
    return [r for i in lanes for r in range(bounds[i], bounds[i + 1])]


def close(a, b, **kw) -> None:
    torch.testing.assert_close(a.cpu().float(), b.cpu().float(), **kw)


def check_rule(h, hk, dtype, device, c, *, block_v, seed, lens=None, precision="ieee",
               otol=None, stol=None):  # fmt: skip
    """Chunked extend (no prep) vs the recurrent Triton extend and the reference."""
    lens = lens_for(c) if lens is None else lens
    arena, bounds, qkvgb, slots, init, cu = make_case(seed, h, hk, dtype, device, lens)
    rec, ref = arena.clone(), arena.clone()
    out = torch.full(qkvgb[2].shape, float("nan"), dtype=dtype, device=device)
    o = gc.gated_delta_rule_extend_chunked_triton(
        *qkvgb, arena.ssm, slots, cu, init, None, hk, c, max(lens), out=out, block_v=block_v,
        dot_precision=precision,
    )  # fmt: skip
    assert o is out
    o_rec = gdn.gated_delta_rule_extend_triton(*qkvgb, rec.ssm, slots, cu, init)
    o_ref = gc.gated_delta_rule_extend_chunked_reference(
        *qkvgb, ref.ssm, slots, cu, init, None, hk, c
    )
    live = [i for i, s in enumerate(SLOTS) if s >= 0]
    rows = rows_of(bounds, live)
    pad_rows = rows_of(bounds, [i for i, s in enumerate(SLOTS) if s < 0])
    otol = tol(dtype) if otol is None else otol
    stol = STATE_TOL if stol is None else stol
    close(o[rows], o_rec[rows], **otol)
    close(o[rows], o_ref[rows], **otol)
    assert bool((o[pad_rows] == 0).all()) and bool(o.isfinite().all())
    live_slots = [SLOTS[i] for i in live]
    close(arena.ssm[live_slots], rec.ssm[live_slots], **stol)
    close(arena.ssm[live_slots], ref.ssm[live_slots], **stol)
    assert bool((arena.ssm[SLOTS[0]] == 0).all())  # 0 tokens, no initial state: zeros
    assert arena.untouched_outside(SLOTS)


# ---------------------------------------------------------------------------------------------
# the delta rule alone (interpreter)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "h, hk, dtype",
    [
        pytest.param(2, 2, F32, id="h2-f32", marks=pytest.mark.slow),
        pytest.param(4, 2, F32, id="h4k2-f32"),
        pytest.param(4, 1, BF16, id="h4k1-bf16", marks=pytest.mark.slow),
    ],
)
def test_chunked_rule_vs_recurrent_and_reference(h, hk, dtype):
    if not _INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    check_rule(h, hk, dtype, "cpu", C, block_v=8, seed=10 * h + hk)


@pytest.mark.parametrize("device", [CPU])
def test_chunked_rule_prep_vs_reference(device):
    """``prep=True``: the L2 norm of q, k inside the kernel (chunk 8, one V block)."""
    h, hk, c = 4, 2, 8
    arena, bounds, qkvgb, slots, init, cu = make_case(3, h, hk, BF16, device, lens_for(c))
    ref = arena.clone()
    o = gc.gated_delta_rule_extend_chunked_triton(
        *qkvgb, arena.ssm, slots, cu, init, None, hk, c, prep=True
    )
    o_ref = gc.gated_delta_rule_extend_chunked_reference(
        *qkvgb, ref.ssm, slots, cu, init, None, hk, c, prep=True
    )
    close(o, o_ref, **tol(BF16))  # padded rows: zeros on both sides
    close(arena.ssm, ref.ssm, equal_nan=True, **STATE_TOL)
    assert arena.untouched_outside(SLOTS)


def test_chunked_rejects_bad_arguments():
    arena, _, qkvgb, slots, init, cu = make_case(4, 2, 2, F32, "cpu", [2] * len(SLOTS))
    with pytest.raises(ValueError, match="power of two"):
        gc.gated_delta_rule_extend_chunked_triton(*qkvgb, arena.ssm, slots, cu, init,
                                                  chunk_size=6)  # fmt: skip
    with pytest.raises(ValueError, match="num_k_heads"):
        gc.gated_delta_rule_extend_chunked_triton(*qkvgb, arena.ssm, slots, cu, init,
                                                  num_k_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="dot_precision"):
        gc.gated_delta_rule_extend_chunked_triton(*qkvgb, arena.ssm, slots, cu, init,
                                                  dot_precision="bf16")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the mixer: gdn_forward_triton(..., chunked_prefill=True)
# ---------------------------------------------------------------------------------------------


def mixer_inputs(seed, h, hk, dtype, device, lens, dk=DK, dv=DV):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = gr.mixed_qkv_dim(h, dk, dv, hk)
    n = sum(lens)
    x = torch.randn(n, conv_dim, generator=gen).to(dtype).to(device)
    w = (0.5 * torch.randn(conv_dim, KW, generator=gen)).to(dtype).to(device)
    conv = torch.randn(NUM_SLOTS, conv_dim, KW - 1, generator=gen).to(dtype).to(device)
    g = (-torch.rand(n, h, generator=gen)).to(device)
    beta = torch.rand(n, h, generator=gen).to(device)
    return x, w, conv, g, beta


@pytest.mark.parametrize(
    "dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16", marks=pytest.mark.slow)]
)
def test_mixer_chunked_prefill(dtype):
    """Extend through ``gdn_forward_triton``: chunked vs recurrent rule (same conv), and vs
    ``gdn_reference.gdn_forward`` on the live lanes."""
    if not _INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    h, hk, device = 4, 2, "cpu"
    lens = [0, 1, 3, gc.DEFAULT_CHUNK, 5, gc.DEFAULT_CHUNK + 5]  # lane 4 padded
    arena, bounds, _, slots, init, cu = make_case(7, h, hk, F32, device, lens)
    x, w, conv, g, beta = mixer_inputs(8, h, hk, dtype, device, lens)
    rec, ref = arena.clone(), arena.clone()
    conv_rec, conv_ref = conv.clone(), conv.clone()
    kw = {"has_initial_state": init, "num_k_heads": hk, "max_seqlen": max(lens)}
    o = gdn.gdn_forward_triton("extend", x, w, g, beta, conv, arena.ssm, slots, cu,
                               chunked_prefill=True, **kw)  # fmt: skip
    o_rec = gdn.gdn_forward_triton("extend", x, w, g, beta, conv_rec, rec.ssm, slots, cu, **kw)
    live = [i for i, s in enumerate(SLOTS) if s >= 0]
    rows = rows_of(bounds, live)
    close(o[rows], o_rec[rows], **tol(dtype))
    assert bool((o[rows_of(bounds, [4])] == 0).all()) and bool(o.isfinite().all())
    assert torch.equal(conv, conv_rec)
    live_slots = [SLOTS[i] for i in live]
    close(arena.ssm[live_slots], rec.ssm[live_slots], **STATE_TOL)
    assert arena.untouched_outside(SLOTS)

    lv = torch.tensor(live)
    sub = [0]
    for i in live:
        sub.append(sub[-1] + lens[i])
    o_ref = gr.gdn_forward("extend", x[rows], w, g[rows], beta[rows], conv_ref, ref.ssm,
                           slots[lv], sub, has_initial_state=init[lv], num_k_heads=hk,
                           chunk_size=gc.DEFAULT_CHUNK)  # fmt: skip
    # bf16: the interpreter truncates the conv output to bf16 where torch rounds (see
    # test_gdn_kernels.mixer_state_tol), so the reference is looser there
    rtol = {"rtol": 5e-2, "atol": 3e-2} if dtype == BF16 else STATE_TOL
    close(o[rows], o_ref, **(tol(dtype) if dtype == F32 else rtol))
    close(arena.ssm[live_slots], ref.ssm[live_slots], **rtol)


def test_mixer_chunked_prefill_refuses_batch_invariant():
    h, hk = 2, 2
    arena, _, _, slots, init, cu = make_case(9, h, hk, F32, "cpu", [1] * len(SLOTS))
    x, w, conv, g, beta = mixer_inputs(9, h, hk, F32, "cpu", [1] * len(SLOTS))
    with pytest.raises(ValueError, match="batch-invariant"):
        gdn.gdn_forward_triton("extend", x, w, g, beta, conv, arena.ssm, slots, cu,
                               batch_invariant=True, chunked_prefill=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Qwen3-Next sizes on the GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("c", [16, 32])
@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")])
def test_chunked_rule_qwen3_next_gpu(c, dtype):
    lens = [*lens_for(c)[:5], 3 * c + 2 + 1000]
    arena, bounds, qkvgb, slots, init, cu = make_case(
        11 + c, 32, 16, dtype, "cuda", lens, dk=128, dv=128
    )
    rec = arena.clone()
    o = gc.gated_delta_rule_extend_chunked_triton(*qkvgb, arena.ssm, slots, cu, init, None, 16, c)
    o_rec = gdn.gated_delta_rule_extend_triton(*qkvgb, rec.ssm, slots, cu, init)
    torch.cuda.synchronize()
    live = [i for i, s in enumerate(SLOTS) if s >= 0]
    rows = rows_of(bounds, live)
    close(o[rows], o_rec[rows], **({"rtol": 2e-2, "atol": 2e-2} if dtype == BF16 else
                                   {"rtol": 1e-3, "atol": 1e-4}))  # fmt: skip
    live_slots = [SLOTS[i] for i in live]
    close(arena.ssm[live_slots], rec.ssm[live_slots], rtol=1e-3, atol=1e-4)
    assert bool(o.isfinite().all()) and bool((o[rows_of(bounds, [4])] == 0).all())
    assert arena.untouched_outside(SLOTS)


@pytest.mark.gpu
def test_chunked_rule_tf32_gpu():
    """Tensor-core dots: looser, still the same function."""
    check_rule(32, 16, BF16, "cuda", 32, block_v=32, seed=5, lens=[0, 1, 31, 32, 33, 2000],
               precision="tf32", otol={"rtol": 3e-2, "atol": 3e-2},
               stol={"rtol": 1e-2, "atol": 1e-2})  # fmt: skip


@pytest.mark.gpu
def test_mixer_chunked_prefill_qwen3_next_gpu():
    h, hk, dk, dv = 32, 16, 128, 128
    lens = [0, 1, 15, 16, 17, 700]
    arena, bounds, _, slots, init, cu = make_case(13, h, hk, F32, "cuda", lens, dk=dk, dv=dv)
    x, w, conv, g, beta = mixer_inputs(14, h, hk, BF16, "cuda", lens, dk=dk, dv=dv)
    rec = arena.clone()
    conv_rec = conv.clone()
    kw = {"has_initial_state": init, "num_k_heads": hk, "max_seqlen": max(lens)}
    o = gdn.gdn_forward("extend", x, w, g, beta, conv, arena.ssm, slots, cu,
                        chunked_prefill=True, **kw)  # fmt: skip
    o_rec = gdn.gdn_forward("extend", x, w, g, beta, conv_rec, rec.ssm, slots, cu, **kw)
    rows = rows_of(bounds, [i for i, s in enumerate(SLOTS) if s >= 0])
    close(o[rows], o_rec[rows], rtol=2e-2, atol=2e-2)
    live_slots = [s for s in SLOTS if s >= 0]
    close(arena.ssm[live_slots], rec.ssm[live_slots], rtol=1e-3, atol=1e-4)
    assert arena.untouched_outside(SLOTS)
