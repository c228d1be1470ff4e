"""GDN kernels (``unimem_kernel.gdn``) against the torch reference ``unimem_kernel.gdn_reference``.

Every Triton launcher is compared with its reference function on fresh random inputs. States
live in strided slot views carved from one ``uint8`` arena poisoned with 0xFF (NaN in float32
and bfloat16): only the live lanes' slots hold data. After each call

- the outputs of live lanes match the reference, and every output is finite (a kernel that read
  a poisoned byte - another slot, the envelope's padding, the slot of a lane without an initial
  state - would produce NaN);
- every arena byte outside the live lanes' state blocks is still 0xFF (nothing else written);
  verify leaves the whole arena as it was;
- padded lanes (slot -1) give zero output rows and leave their scratch entries untouched.

The reference has no padded lanes, so it runs on the live lanes only. On CPU the kernels run in
the Triton interpreter (``TRITON_INTERPRET=1``, root conftest): sizes stay tiny and tiles are
lowered so that a request spans several token, channel and V blocks. The ``cuda`` variants are
marked ``gpu``; so are the tests at realistic sizes (the ``small`` preset) and under CUDA-graph
capture.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import DEVICES

from unimem_kernel import gdn
from unimem_kernel import gdn_reference as gr

POISON = 0xFF
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
# (input dtype, state dtype): conv state in the input dtype, SSM state in float32/float64
DTYPES = [pytest.param((F32, F32), id="f32"), pytest.param((BF16, F32), id="bf16")]
H, DK, DV, K = 2, 8, 16, 4  # tiny GDN layer: conv_dim = H * (2 DK + DV) = 64
NUM_SLOTS = 7
SLOTS = [5, -1, 0, 3]  # lane 1 is padded
# (value heads H, key heads Hk): ungrouped, and grouped key heads (value head h reads key head
# h // (H // Hk), as Qwen3-Next with 16 key and 32 value heads)
# The fast tier runs h2 (ungrouped) and h4k2 (grouped); h4 and h4k1, the same indexing at
# other ratios, are the slow tier.
HEADS = [
    pytest.param((H, H), id="h2"),
    pytest.param((4, 4), id="h4", marks=pytest.mark.slow),
    pytest.param((4, 2), id="h4k2"),
    pytest.param((4, 1), id="h4k1", marks=pytest.mark.slow),
]
# the costliest cases (the extend rule, the mixer's two launches): grouped key heads only in the
# fast tier
GROUPED_HEADS = [
    pytest.param((H, H), id="h2", marks=pytest.mark.slow),
    pytest.param((4, 4), id="h4", marks=pytest.mark.slow),
    pytest.param((4, 2), id="h4k2"),
    pytest.param((4, 1), id="h4k1", marks=pytest.mark.slow),
]


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Outputs: float32 to rounding; bf16 outputs to about one bf16 ulp."""
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == BF16 else {"rtol": 1e-4, "atol": 1e-5}


def mixer_state_tol(dtype: torch.dtype, device: str) -> dict[str, float]:
    """SSM states of the mixer. With bf16 inputs the conv output is rounded to bf16 before it
    feeds q, k, v: on the GPU (round to nearest even, as torch) both sides round alike, but the
    Triton interpreter truncates float32 -> bf16, moving q, k, v by up to one ulp (0.4 %)."""
    if dtype != BF16:
        return {"rtol": 1e-4, "atol": 1e-5}
    return {"rtol": 5e-2, "atol": 3e-2} if device == "cpu" else {"rtol": 1e-3, "atol": 2e-3}


# ---------------------------------------------------------------------------------------------
# the arena
# ---------------------------------------------------------------------------------------------


def _align(n: int, a: int = 16) -> int:
    return -(-n // a) * a


def arena_view(buf, byte_offset, num_slots, slot_bytes, dtype, shape):
    """``[num_slots, *shape]`` of ``dtype``: slot ``s`` is a contiguous block at byte
    ``byte_offset + s * slot_bytes`` of ``buf`` (as the memory layout builds them)."""
    size = dtype.itemsize
    assert byte_offset % size == 0 and slot_bytes % size == 0
    n = buf.numel()
    typed = buf[: n - n % size].view(dtype)
    inner, stride = [], 1
    for d in reversed(shape):
        inner.append(stride)
        stride *= d
    return typed.as_strided((num_slots, *shape), (slot_bytes // size, *reversed(inner)),
                            byte_offset // size)  # fmt: skip


class SlotArena:
    """Conv and SSM state views over ``NUM_SLOTS`` slot envelopes of a poisoned byte arena:
    ``[head | per slot: pad, conv block, pad, ssm block, pad | tail]``."""

    HEAD = 48

    def __init__(self, conv_dtype, ssm_dtype, device, conv_dim=H * (2 * DK + DV), kw=K,
                 ssm_shape=(H, DK, DV), num_slots=NUM_SLOTS, buf=None):  # fmt: skip
        self.num_slots = num_slots
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        self.conv_shape, self.ssm_shape = (conv_dim, kw - 1), tuple(ssm_shape)
        self.conv_bytes = math.prod(self.conv_shape) * conv_dtype.itemsize
        self.ssm_bytes = math.prod(self.ssm_shape) * ssm_dtype.itemsize
        self.conv_off = 16
        self.ssm_off = _align(self.conv_off + self.conv_bytes) + 16
        self.slot_bytes = _align(self.ssm_off + self.ssm_bytes) + 32
        if buf is None:
            total = self.HEAD + num_slots * self.slot_bytes + 40
            buf = torch.full((total,), POISON, dtype=torch.uint8, device=device)
        self.buf = buf
        self.conv = arena_view(buf, self.HEAD + self.conv_off, num_slots, self.slot_bytes,
                               conv_dtype, self.conv_shape)  # fmt: skip
        self.ssm = arena_view(buf, self.HEAD + self.ssm_off, num_slots, self.slot_bytes,
                              ssm_dtype, self.ssm_shape)  # fmt: skip

    def clone(self) -> SlotArena:
        return SlotArena(self.conv_dtype, self.ssm_dtype, self.buf.device, self.conv_shape[0],
                         self.conv_shape[1] + 1, self.ssm_shape, self.num_slots,
                         self.buf.clone())  # fmt: skip

    def fill(self, gen, slots) -> None:
        for s in slots:
            if s >= 0:
                self.conv[s] = torch.randn(self.conv_shape, generator=gen).to(self.conv_dtype)
                self.ssm[s] = (0.5 * torch.randn(self.ssm_shape, generator=gen)).to(self.ssm_dtype)

    def footprint(self, slots) -> torch.Tensor:
        """Bytes of the state blocks of ``slots`` (``slot >= 0``)."""
        mask = torch.zeros(self.buf.numel(), dtype=torch.bool)
        for s in slots:
            if s >= 0:
                base = self.HEAD + s * self.slot_bytes
                mask[base + self.conv_off : base + self.conv_off + self.conv_bytes] = True
                mask[base + self.ssm_off : base + self.ssm_off + self.ssm_bytes] = True
        return mask

    def assert_untouched_outside(self, slots) -> None:
        outside = ~self.footprint(slots)
        assert bool((self.buf.cpu()[outside] == POISON).all()), "wrote outside the live slots"


def make_arena(gen, conv_dtype, ssm_dtype, device, slots=SLOTS, **kw) -> SlotArena:
    arena = SlotArena(conv_dtype, ssm_dtype, device, **kw)
    arena.fill(gen, slots)
    assert not arena.conv.is_contiguous() and not arena.ssm.is_contiguous()
    return arena


def live_lanes(slots) -> list[int]:
    return [i for i, s in enumerate(slots) if s >= 0]


def padded_lanes(slots) -> list[int]:
    return [i for i, s in enumerate(slots) if s < 0]


def nan_like(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def ragged_rows(bounds, lanes) -> list[int]:
    return [r for i in lanes for r in range(bounds[i], bounds[i + 1])]


def sub_bounds(bounds, lanes) -> list[int]:
    out = [0]
    for i in lanes:
        out.append(out[-1] + bounds[i + 1] - bounds[i])
    return out


def rand(gen, shape, dtype, device, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(device)


def rule_inputs(gen, lead, dtype, sdt, device, h=H, dk=DK, dv=DV, hk=None):
    """q, k (``hk`` heads, default ``h``; k unit norm, as the mixer passes it), v in ``dtype``;
    g (<= 0), beta in ``sdt``."""
    hk = h if hk is None else hk
    q = rand(gen, (*lead, hk, dk), dtype, device)
    k = gr.l2norm(torch.randn(*lead, hk, dk, generator=gen)).to(dtype).to(device)
    v = rand(gen, (*lead, h, dv), dtype, device)
    g = (-torch.rand(*lead, h, generator=gen)).to(sdt).to(device)
    beta = torch.rand(*lead, h, generator=gen).to(sdt).to(device)
    return q, k, v, g, beta


def close(a, b, **kw) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), **kw)


# ---------------------------------------------------------------------------------------------
# causal conv1d
# ---------------------------------------------------------------------------------------------


ACTIVATIONS = [pytest.param(None, id="linear"), pytest.param("silu", id="silu")]
SLOW = pytest.mark.slow
F32S, BF16S = (F32, F32), (BF16, F32)


def pairs(first, second, fast):
    """``first`` x ``second`` as ``(a, b)`` params, ``id`` ``"a-b"``; the pairs whose ids are in
    ``fast`` (one pair per value of each: the activation or head layout is a constexpr
    branch, the dtype the loads' and stores' casts) run in the fast tier, the others in the
    slow tier."""
    out = []
    for a in first:
        for b in second:
            pid = f"{a.id}-{b.id}"
            marks = [*a.marks, *b.marks, *(() if pid in fast else (SLOW,))]
            out.append(pytest.param(a.values[0], b.values[0], id=pid, marks=marks))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "activation,dtypes", pairs(ACTIVATIONS, DTYPES, fast={"linear-f32", "silu-bf16"})
)
def test_conv_decode(device, dtypes, activation):
    dtype, sdt = dtypes
    gen = torch.Generator().manual_seed(1)
    arena = make_arena(gen, dtype, sdt, device)
    ref = arena.clone()
    dim = arena.conv_shape[0]
    x = rand(gen, (len(SLOTS), dim), dtype, device)
    w = rand(gen, (dim, K), dtype, device, 0.5)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=device)
    out = nan_like(x.shape, dtype, device)
    y = gdn.causal_conv1d_decode_triton(
        x, w, arena.conv, slots, out=out, block_d=32, activation=activation
    )
    assert y is out
    live = live_lanes(SLOTS)
    lv = torch.tensor(live, device=device)
    y_ref = gr.causal_conv1d_decode(x[lv], w, ref.conv, slots[lv], activation)
    close(y[lv], y_ref, **tol(dtype))
    assert bool((y[padded_lanes(SLOTS)] == 0).all())
    close(arena.conv, ref.conv, rtol=0, atol=0, equal_nan=True)  # states: moved, not computed
    arena.assert_untouched_outside(SLOTS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t_len", [1, 4])
@pytest.mark.parametrize(
    "activation,dtypes", pairs(ACTIVATIONS, DTYPES, fast={"linear-f32", "silu-bf16"})
)
def test_conv_verify(device, dtypes, t_len, activation):
    dtype, sdt = dtypes
    gen = torch.Generator().manual_seed(2 + t_len)
    arena = make_arena(gen, dtype, sdt, device)
    before = arena.buf.clone()
    dim = arena.conv_shape[0]
    bs = len(SLOTS)
    x = rand(gen, (bs, t_len, dim), dtype, device)
    w = rand(gen, (dim, K), dtype, device, 0.5)
    slots = torch.tensor(SLOTS, dtype=torch.int64, device=device)
    scratch = nan_like((bs, t_len, dim, K - 1), dtype, device)
    y = gdn.causal_conv1d_verify_triton(
        x, w, arena.conv, slots, scratch, block_d=32, activation=activation
    )
    assert torch.equal(arena.buf, before), "verify must not touch the arena"
    live = torch.tensor(live_lanes(SLOTS), device=device)
    ref_scratch = nan_like((live.numel(), t_len, dim, K - 1), dtype, device)
    y_ref = gr.causal_conv1d_verify(x[live], w, arena.conv, slots[live], ref_scratch, activation)
    close(y[live], y_ref, **tol(dtype))
    close(scratch[live], ref_scratch, rtol=0, atol=0)
    pad = padded_lanes(SLOTS)
    assert bool((y[pad] == 0).all()) and bool(scratch[pad].isnan().all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_t", [4, pytest.param(None, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "activation,dtypes", pairs(ACTIVATIONS, DTYPES, fast={"linear-f32", "silu-bf16"})
)
def test_conv_extend(device, dtypes, block_t, activation):
    """Ragged: lengths 0 (no initial state: slot zeroed), 2 (< K-1: the final state mixes old
    state and inputs), padded, 11 (several token blocks with block_t=4), 0 with a state."""
    dtype, sdt = dtypes
    gen = torch.Generator().manual_seed(5)
    slots_l = [4, 2, -1, 6, 1]
    lens = [0, 2, 3, 11, 0]
    init_l = [False, True, True, True, True]
    arena = make_arena(gen, dtype, sdt, device, slots=slots_l)
    ref = arena.clone()
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    dim = arena.conv_shape[0]
    x = rand(gen, (bounds[-1], dim), dtype, device)
    w = rand(gen, (dim, K), dtype, device, 0.5)
    slots = torch.tensor(slots_l, dtype=torch.int32, device=device)
    init = torch.tensor(init_l, device=device)
    arena.conv[4] = float("nan")  # no initial state: the slot's bytes must not be read
    ref.conv[4] = float("nan")
    y = gdn.causal_conv1d_extend_triton(
        x, w, arena.conv, slots, bounds, init, block_d=32, block_t=block_t, activation=activation
    )
    live = live_lanes(slots_l)
    lv = torch.tensor(live, device=device)
    rows = torch.tensor(ragged_rows(bounds, live), dtype=torch.long, device=device)
    y_ref = gr.causal_conv1d_extend(
        x[rows], w, ref.conv, slots[lv], sub_bounds(bounds, live), init[lv], activation
    )
    close(y[rows], y_ref, **tol(dtype))
    pad_rows = ragged_rows(bounds, padded_lanes(slots_l))
    assert bool((y[pad_rows] == 0).all()) and bool(y.isfinite().all())
    close(arena.conv, ref.conv, rtol=0, atol=0, equal_nan=True)
    assert bool((arena.conv[4] == 0).all())  # zero tokens, no initial state: zeros
    arena.assert_untouched_outside(slots_l)


def test_conv_refuses_an_unknown_activation():
    arena = make_arena(torch.Generator().manual_seed(9), F32, F32, "cpu")
    dim = arena.conv_shape[0]
    x, w = torch.randn(len(SLOTS), dim), torch.randn(dim, K)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    with pytest.raises(ValueError, match="activation must be one of"):
        gdn.causal_conv1d_decode_triton(x, w, arena.conv, slots, activation="relu")


# ---------------------------------------------------------------------------------------------
# gated delta rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,dtypes", pairs(HEADS, DTYPES, fast={"h2-f32", "h4k2-bf16"}))
def test_rule_decode(device, dtypes, heads):
    dtype, sdt = dtypes
    h, hk = heads
    gen = torch.Generator().manual_seed(11 + 10 * h + hk)
    arena = make_arena(gen, dtype, sdt, device, ssm_shape=(h, DK, DV))
    ref = arena.clone()
    bs = len(SLOTS)
    q, k, v, g, beta = rule_inputs(gen, (bs,), dtype, sdt, device, h=h, hk=hk)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=device)
    out = nan_like(v.shape, dtype, device)
    o = gdn.gated_delta_rule_decode_triton(q, k, v, g, beta, arena.ssm, slots, out=out)
    assert o is out
    lv = torch.tensor(live_lanes(SLOTS), device=device)
    o_ref = gr.gated_delta_rule_decode(q[lv], k[lv], v[lv], g[lv], beta[lv], ref.ssm, slots[lv])
    close(o[lv], o_ref, **tol(dtype))
    assert bool((o[padded_lanes(SLOTS)] == 0).all())
    close(arena.ssm, ref.ssm, rtol=1e-5, atol=1e-6, equal_nan=True)
    arena.assert_untouched_outside(SLOTS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t_len", [1, 4])
@pytest.mark.parametrize("heads,dtypes", pairs(HEADS, DTYPES, fast={"h2-f32", "h4k2-bf16"}))
def test_rule_verify(device, dtypes, t_len, heads):
    dtype, sdt = dtypes
    h, hk = heads
    gen = torch.Generator().manual_seed(12 + t_len + 10 * h + hk)
    arena = make_arena(gen, dtype, sdt, device, ssm_shape=(h, DK, DV))
    before = arena.buf.clone()
    bs = len(SLOTS)
    q, k, v, g, beta = rule_inputs(gen, (bs, t_len), dtype, sdt, device, h=h, hk=hk)
    slots = torch.tensor(SLOTS, dtype=torch.int64, device=device)
    scratch = nan_like((bs, t_len, h, DK, DV), sdt, device)
    o = gdn.gated_delta_rule_verify_triton(q, k, v, g, beta, arena.ssm, slots, scratch)
    assert torch.equal(arena.buf, before), "verify must not touch the arena"
    lv = torch.tensor(live_lanes(SLOTS), device=device)
    ref_scratch = nan_like((lv.numel(), t_len, h, DK, DV), sdt, device)
    o_ref = gr.gated_delta_rule_verify(
        q[lv], k[lv], v[lv], g[lv], beta[lv], arena.ssm, slots[lv], ref_scratch
    )
    close(o[lv], o_ref, **tol(dtype))
    close(scratch[lv], ref_scratch, rtol=1e-5, atol=1e-6)
    pad = padded_lanes(SLOTS)
    assert bool((o[pad] == 0).all()) and bool(scratch[pad].isnan().all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [pytest.param(F32S, id="f32", marks=SLOW),
                                    pytest.param(BF16S, id="bf16")])  # fmt: skip
@pytest.mark.parametrize("heads", GROUPED_HEADS)
def test_rule_extend(device, dtypes, heads):
    """Ragged: zero tokens without an initial state (slot zeroed), one token, padded, 20 tokens
    without an initial state (longer than the reference's chunk of 8), 5 tokens from a state,
    zero tokens with a state (kept)."""
    dtype, sdt = dtypes
    h, hk = heads
    gen = torch.Generator().manual_seed(21 + 10 * h + hk)
    slots_l = [4, 2, -1, 6, 3, 1]
    lens = [0, 1, 3, 20, 5, 0]
    init_l = [False, True, True, False, True, True]
    arena = make_arena(gen, dtype, sdt, device, slots=slots_l, ssm_shape=(h, DK, DV))
    arena.ssm[6] = float("nan")  # no initial state: never read
    ref = arena.clone()
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q, k, v, g, beta = rule_inputs(gen, (bounds[-1],), dtype, sdt, device, h=h, hk=hk)
    slots = torch.tensor(slots_l, dtype=torch.int64, device=device)
    init = torch.tensor(init_l, device=device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    o = gdn.gated_delta_rule_extend_triton(q, k, v, g, beta, arena.ssm, slots, cu, init)
    live = live_lanes(slots_l)
    lv = torch.tensor(live, device=device)
    rows = torch.tensor(ragged_rows(bounds, live), dtype=torch.long, device=device)
    o_ref = gr.gated_delta_rule_extend(
        q[rows], k[rows], v[rows], g[rows], beta[rows], ref.ssm, slots[lv],
        sub_bounds(bounds, live), init[lv], chunk_size=8,
    )  # fmt: skip
    close(o[rows], o_ref, **tol(dtype))
    pad_rows = ragged_rows(bounds, padded_lanes(slots_l))
    assert bool((o[pad_rows] == 0).all()) and bool(o.isfinite().all())
    close(arena.ssm, ref.ssm, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert bool((arena.ssm[4] == 0).all())
    arena.assert_untouched_outside(slots_l)


# ---------------------------------------------------------------------------------------------
# the mixer core
# ---------------------------------------------------------------------------------------------


def mixer_case(gen, mode, dtype, sdt, device, slots_l, *, t_len=4, lens=None, h=H, dk=DK,
               dv=DV, hk=None):  # fmt: skip
    """``(row bounds, mixed_qkv, conv_weight, g, beta)`` of one ``gdn_forward`` call (``hk``
    key heads, default ``h``)."""
    conv_dim = gr.mixed_qkv_dim(h, dk, dv, hk)
    bs = len(slots_l)
    if mode == "extend":
        bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
        n = bounds[-1]
    else:
        tv = 1 if mode == "decode" else t_len
        bounds = [i * tv for i in range(bs + 1)]
        n = bs * tv
    x = rand(gen, (n, conv_dim), dtype, device)
    w = rand(gen, (conv_dim, K), dtype, device, 0.5)
    g = (-torch.rand(n, h, generator=gen)).to(sdt).to(device)
    beta = torch.rand(n, h, generator=gen).to(sdt).to(device)
    return bounds, x, w, g, beta


def run_mixer(mode, arena, ref, bounds, x, w, g, beta, slots_l, init_l, device, t_len,
              chunk_size=8, num_k_heads=None):  # fmt: skip
    """``gdn_forward_triton`` on all lanes of ``arena``, the reference on the live lanes of
    ``ref``; returns ``(out, ref_out, rows of live lanes, rows of padded lanes, scratches)``."""
    bs = len(slots_l)
    slots = torch.tensor(slots_l, dtype=torch.int32, device=device)
    live = live_lanes(slots_l)
    lv = torch.tensor(live, device=device)
    rows = torch.tensor(ragged_rows(bounds, live), dtype=torch.long, device=device)
    kw, kw_ref, scratch = {"num_k_heads": num_k_heads}, {"num_k_heads": num_k_heads}, {}
    if mode == "extend":
        init = torch.tensor(init_l, device=device)
        kw["has_initial_state"] = init
        kw_ref.update(has_initial_state=init[lv], chunk_size=chunk_size)
    if mode == "verify":
        conv_shape, ssm_shape = arena.conv_shape, arena.ssm_shape
        scratch = {
            "conv_scratch": nan_like((bs, t_len, *conv_shape), arena.conv_dtype, device),
            "ssm_scratch": nan_like((bs, t_len, *ssm_shape), arena.ssm_dtype, device),
        }
        kw.update(scratch)
        kw_ref.update(
            conv_scratch=nan_like((len(live), t_len, *conv_shape), arena.conv_dtype, device),
            ssm_scratch=nan_like((len(live), t_len, *ssm_shape), arena.ssm_dtype, device),
        )
    o = gdn.gdn_forward_triton(mode, x, w, g, beta, arena.conv, arena.ssm, slots, bounds, **kw)
    o_ref = gr.gdn_forward(
        mode, x[rows], w, g[rows], beta[rows], ref.conv, ref.ssm, slots[lv],
        sub_bounds(bounds, live), **kw_ref,
    )  # fmt: skip
    pad_rows = ragged_rows(bounds, padded_lanes(slots_l))
    return o, o_ref, rows, pad_rows, (scratch, kw_ref, lv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,dtypes",
    pairs(
        [pytest.param(m, id=m) for m in ("decode", "verify", "extend")],
        [
            pytest.param(F32S, id="f32"),
            pytest.param(BF16S, id="bf16"),
            pytest.param((F64, F64), id="f64"),
        ],
        # bf16 (the serving dtype) through decode and verify, float64 (the tiny preset's,
        # checked tightest) through extend; float32 and the other pairs: the slow tier
        fast={"decode-bf16", "verify-bf16", "extend-f64"},
    ),
)
@pytest.mark.parametrize("heads", GROUPED_HEADS)
def test_gdn_forward(device, mode, dtypes, heads):
    """conv + SiLU -> split -> L2 norm -> delta rule, two launches, against the reference
    (float64: the ``tiny`` preset's dtype, float64 arithmetic in both kernels). Grouped key
    heads: ``mixed_qkv`` is ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]``. Extend: no tokens and no
    initial state, 1 and 2 tokens from a state, padded, 13 tokens without an initial state."""
    dtype, sdt = dtypes
    h, hk = heads
    gen = torch.Generator().manual_seed(31 + len(mode) + 10 * h + hk)
    slots_l = [5, -1, 0, 3] if mode != "extend" else [4, 2, 1, -1, 6]
    lens, init_l = [0, 1, 2, 3, 13], [False, True, True, True, False]
    conv_dim = gr.mixed_qkv_dim(h, DK, DV, hk)
    arena = make_arena(gen, dtype, sdt, device, slots=slots_l, conv_dim=conv_dim,
                       ssm_shape=(h, DK, DV))  # fmt: skip
    if mode == "extend":
        for s in (4, 6):  # no initial state: never read
            arena.conv[s] = float("nan")
            arena.ssm[s] = float("nan")
    ref = arena.clone()
    before = arena.buf.clone()
    t_len = 4
    bounds, x, w, g, beta = mixer_case(gen, mode, dtype, sdt, device, slots_l, lens=lens, h=h,
                                       hk=hk)  # fmt: skip
    o, o_ref, rows, pad_rows, (scratch, kw_ref, lv) = run_mixer(
        mode, arena, ref, bounds, x, w, g, beta, slots_l, init_l, device, t_len,
        num_k_heads=None if hk == h else hk,
    )  # fmt: skip
    assert o.dtype == dtype and o.shape == (x.shape[0], h, DV)
    close(o[rows], o_ref, **tol(dtype))
    assert bool((o[pad_rows] == 0).all()) and bool(o.isfinite().all())
    if mode == "verify":
        assert torch.equal(arena.buf, before)
        for name in ("conv_scratch", "ssm_scratch"):
            t = mixer_state_tol(dtype, device) if name == "ssm_scratch" else {}
            close(scratch[name][lv], kw_ref[name], **(t or {"rtol": 0, "atol": 0}))
            assert bool(scratch[name][1].isnan().all())  # padded lane untouched
    else:
        close(arena.conv, ref.conv, rtol=0, atol=0, equal_nan=True)
        close(arena.ssm, ref.ssm, **mixer_state_tol(dtype, device), equal_nan=True)
        arena.assert_untouched_outside(slots_l)


def test_public_entry_dispatches_to_reference_on_cpu(monkeypatch):
    """CPU tensors (backend ``auto``) go to the reference: bit-identical results."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "auto")
    gen = torch.Generator().manual_seed(41)
    slots_l = [5, 0, 3]
    arena = make_arena(gen, F32, F32, "cpu", slots=slots_l)
    ref = arena.clone()
    bounds, x, w, g, beta = mixer_case(gen, "decode", F32, F32, "cpu", slots_l)
    slots = torch.tensor(slots_l)
    out = torch.empty(len(slots_l), H, DV)
    o = gdn.gdn_forward("decode", x, w, g, beta, arena.conv, arena.ssm, slots, out=out)
    o_ref = gr.gdn_forward("decode", x, w, g, beta, ref.conv, ref.ssm, slots)
    assert o is out and torch.equal(o, o_ref) and torch.equal(arena.buf, ref.buf)


def test_rejects_bad_inputs():
    arena = SlotArena(F32, F32, "cpu")
    slots = torch.tensor([0, 1])
    conv_dim = H * (2 * DK + DV)
    x = torch.zeros(2, conv_dim)
    w = torch.zeros(conv_dim, K)
    gb = torch.zeros(2, H)
    with pytest.raises(ValueError, match="conv_dim"):
        gdn.gdn_forward_triton("decode", x[:, :-1], w, gb, gb, arena.conv, arena.ssm, slots)
    with pytest.raises(ValueError, match="mode"):
        gdn.gdn_forward_triton("prefill", x, w, gb, gb, arena.conv, arena.ssm, slots)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn.gdn_forward_triton("extend", x, w, gb, gb, arena.conv, arena.ssm, slots)
    with pytest.raises(ValueError, match="scratch"):
        gdn.gdn_forward_triton("verify", x, w, gb, gb, arena.conv, arena.ssm, slots)
    with pytest.raises(ValueError, match="bs \\+ 1"):
        gdn.gdn_forward_triton("extend", x, w, gb, gb, arena.conv, arena.ssm, slots, [0, 2])
    with pytest.raises(ValueError, match="slots"):
        gdn.causal_conv1d_decode_triton(x, w, arena.conv, slots.float())
    with pytest.raises(ValueError, match="state_scratch"):
        q = torch.zeros(2, 3, H, DK)
        v = torch.zeros(2, 3, H, DV)
        gb3 = torch.zeros(2, 3, H)
        bad = torch.zeros(2, 2, H, DK, DV)
        gdn.gated_delta_rule_verify_triton(q, q, v, gb3, gb3, arena.ssm, slots, bad)


def test_rejects_key_heads_not_dividing_value_heads():
    """``Hk`` must divide ``H``, and ``mixed_qkv`` must have ``2 Hk Dk + H Dv`` channels."""
    h, dk, dv = 4, DK, DV
    arena = SlotArena(F32, F32, "cpu", conv_dim=gr.mixed_qkv_dim(h, dk, dv, 3),
                      ssm_shape=(h, dk, dv))  # fmt: skip
    slots = torch.tensor([0, 1])
    x = torch.zeros(2, arena.conv_shape[0])
    w = torch.zeros(arena.conv_shape[0], K)
    gb = torch.zeros(2, h)
    args = (x, w, gb, gb, arena.conv, arena.ssm, slots)
    with pytest.raises(ValueError, match="num_k_heads 3 must divide .* 4"):
        gdn.gdn_forward_triton("decode", *args, num_k_heads=3)
    with pytest.raises(ValueError, match="num_k_heads 3 must divide .* 4"):
        gdn.gdn_forward("decode", *args, num_k_heads=3)  # CPU: the reference
    with pytest.raises(ValueError, match=f"conv_dim {x.shape[1]} != .* = {2 * 2 * dk + h * dv}"):
        gdn.gdn_forward_triton("decode", *args, num_k_heads=2)
    with pytest.raises(ValueError, match="num_k_heads 3 must divide .* 4"):
        q = torch.zeros(2, 3, dk)
        gdn.gated_delta_rule_decode_triton(q, q, torch.zeros(2, h, dv), gb, gb, arena.ssm, slots)
    with pytest.raises(ValueError, match="k must be"):
        q, k = torch.zeros(2, 2, dk), torch.zeros(2, 1, dk)
        gdn.gated_delta_rule_decode_triton(q, k, torch.zeros(2, h, dv), gb, gb, arena.ssm, slots)


# ---------------------------------------------------------------------------------------------
# GPU only: realistic sizes, CUDA-graph capture
# ---------------------------------------------------------------------------------------------

SMALL = {"h": 16, "dk": 128, "dv": 128}  # the engine's ``small`` preset; conv_kernel 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "verify", "extend"])
@pytest.mark.parametrize("dtypes", DTYPES)
def test_gdn_forward_small_preset(mode, dtypes):
    """``small`` preset sizes (16 heads, Dk = Dv = 128, conv_dim 6144, K = 4): decode bs 48,
    verify 16 x 4, extend with lengths 0 .. 700 (several conv token blocks, 11 reference
    chunks). float32: relative error < 1e-3; bf16 inputs: < 2e-2 on the output."""
    dtype, sdt = dtypes
    device = "cuda"
    gen = torch.Generator().manual_seed(51)
    if mode == "extend":
        slots_l, lens = [4, 2, 6, 1, 0], [0, 1, 37, 300, 700]
        init_l = [False, True, True, False, True]
    else:
        slots_l = [(i * 5) % 61 if i % 7 else -1 for i in range(48 if mode == "decode" else 16)]
        lens = init_l = None
    arena = make_arena(gen, dtype, sdt, device, slots=slots_l, conv_dim=16 * 384,
                       ssm_shape=(16, 128, 128), num_slots=64)  # fmt: skip
    ref = arena.clone()
    bounds, x, w, g, beta = mixer_case(gen, mode, dtype, sdt, device, slots_l, lens=lens,
                                       **SMALL)  # fmt: skip
    o, o_ref, rows, pad_rows, (scratch, kw_ref, lv) = run_mixer(
        mode, arena, ref, bounds, x, w, g, beta, slots_l, init_l, device, 4, chunk_size=64
    )
    # bf16: the conv output is rounded to bf16, where a last-bit difference moves q/k/v by 0.4 %
    bound_o, bound_s = (2e-2, 1e-2) if dtype == BF16 else (1e-3, 1e-3)
    assert rel_err(o[rows], o_ref) < bound_o
    assert bool((o[pad_rows] == 0).all()) and bool(o.isfinite().all())
    live_slots = torch.tensor([s for s in slots_l if s >= 0], device=device)
    if mode == "verify":
        assert rel_err(scratch["ssm_scratch"][lv], kw_ref["ssm_scratch"]) < bound_s
        assert torch.equal(scratch["conv_scratch"][lv], kw_ref["conv_scratch"])
    else:
        assert rel_err(arena.ssm[live_slots], ref.ssm[live_slots]) < bound_s
        assert torch.equal(arena.conv[live_slots], ref.conv[live_slots])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_gdn_forward_cuda_graph(mode):
    """Decode and verify with caller-owned ``out``/``conv_out``: captured once, replayed after
    the slots are repointed and the inputs changed in place; each replay equals an eager call
    on copies of the same state."""
    device, dtype, sdt, t_len = "cuda", BF16, F32, 4
    gen = torch.Generator().manual_seed(61)
    slots_l = [5, -1, 0, 3]
    arena = make_arena(gen, dtype, sdt, device, slots=list(range(NUM_SLOTS)))
    bs = len(slots_l)
    tv = 1 if mode == "decode" else t_len
    bounds, x, w, g, beta = mixer_case(gen, mode, dtype, sdt, device, slots_l)
    slots = torch.tensor(slots_l, dtype=torch.int32, device=device)
    kw = {}
    if mode == "verify":
        kw = {
            "conv_scratch": nan_like((bs, tv, *arena.conv_shape), dtype, device),
            "ssm_scratch": nan_like((bs, tv, *arena.ssm_shape), sdt, device),
        }
    out = torch.empty(bs * tv, H, DV, dtype=dtype, device=device)
    conv_out = torch.empty_like(x)

    def step(a: SlotArena, o, c, extra):
        return gdn.gdn_forward_triton(mode, x, w, g, beta, a.conv, a.ssm, slots, None,
                                      out=o, conv_out=c, **extra)  # fmt: skip

    shadow = arena.clone()
    step(shadow, torch.empty_like(out), torch.empty_like(conv_out), kw)  # compile eagerly
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(arena, out, conv_out, kw)
    for i in range(3):
        slots.copy_(torch.tensor([(s + i) % NUM_SLOTS if s >= 0 else -1 for s in slots_l]))
        x.copy_(rand(gen, tuple(x.shape), dtype, device))
        expect = arena.clone()
        kw_e = {n: nan_like(t.shape, t.dtype, device) for n, t in kw.items()}
        o_e = step(expect, None, None, kw_e)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, o_e)
        assert torch.equal(arena.buf, expect.buf)
        for n in kw:
            assert torch.equal(kw[n][[0, 2, 3]], kw_e[n][[0, 2, 3]])
