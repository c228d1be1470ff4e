"""The gated delta rule's step kinds (decode, verify, the replay commit) as one persistent
Gluon kernel that streams the next tile's state into shared memory while the current tile's
token loop runs.

Why (``benchmark/bench_gdn_rule.py`` on the H200, docs/benchmarks.md): ``gdn._rule_kernel``
holds a ``[Dk, 32]`` float32 state tile in the registers of one warp (254 registers a
thread, 8 warps an SM) and first loads it, then runs its dependent token steps: a program's
load phase and token phase do not overlap, and the verify ran 2.6x its state-read floor.
Here each CTA (one warp, the same tile) walks tiles ``pid, pid + G, ...`` and, as soon as it
has moved tile ``i``'s state from shared memory into registers, starts ``cp.async`` copies of
tile ``i + 1``'s state and its first ``TC`` tokens' q, k, v, g, beta into shared memory, so the
copies run under tile ``i``'s token loop. The token loop reads its tokens from shared memory
(no global load latency on the dependent chain) and keeps nothing of the next token in
registers.

Semantics are ``gdn._rule_kernel``'s for launches without ragged rows, initial-state flags or
per-position state stores (the step kinds): the same arguments (minus those three and the
unit element strides, which must be 1), the same runtime ``flags`` bits (``RULE_STORE_OUT``,
``RULE_WRITE_FINAL``, ``RULE_REPLAY``, ``RULE_SAVE_GATES``, ``RULE_LAYERS``), the same
arithmetic per token in the same order. Decode, verify and the replay commit of one model run
this one compiled kernel (the step kind is a runtime flag; :func:`eligible` depends on the
model's tensors only, never on the step kind), so a token's state is bitwise the same
whichever of them computes it — the property the acceptance control and a greedy
speculative run equal to the plain one rely on.

What the kernel may assume (checked by :func:`eligible` before any launch): float32 states
with unit V stride; q, k, v rows with unit element stride and every other stride (and the
base addresses) a multiple of 16 bytes, so that each ``cp.async`` moves 16 bytes; the output
likewise (its stores are then vectorised). Padded lanes (``slots[b] < 0``) read nothing and
write nothing but zeros into their output rows, as ``_rule_kernel``.
"""

from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

RULE_STORE_OUT = 4
RULE_WRITE_FINAL = 8
RULE_REPLAY = 16
RULE_SAVE_GATES = 32
RULE_LAYERS = 64
_K_STORE_OUT = gl.constexpr(RULE_STORE_OUT)
_K_WRITE_FINAL = gl.constexpr(RULE_WRITE_FINAL)
_K_REPLAY = gl.constexpr(RULE_REPLAY)
_K_SAVE_GATES = gl.constexpr(RULE_SAVE_GATES)
_K_LAYERS = gl.constexpr(RULE_LAYERS)
_TABLE_HEAD = gl.constexpr(2)  # gdn.TABLE_HEAD
_TABLE_ROW = gl.constexpr(12)  # gdn.TABLE_ROW

TOKEN_CHUNK = 8
"""Tokens of a tile staged in shared memory at once (``TC``); longer lanes take further
chunks synchronously. A constant for every step kind: it shapes the compiled kernel."""


# The Gluon names this kernel uses moved between Triton releases (Gluon is experimental):
# ``cp.async`` into shared memory and a shared buffer's reinterpreting view.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton >= 3.7

    @gluon.jit
    def _as_rows(buf, rows: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):
        """A ``[2, TC, cols]`` buffer as ``[rows, cols]`` rows (indexable by a runtime row)."""
        return buf.reinterpret(buf.dtype, [rows, cols], layout)

else:  # Triton 3.6 (the H200 image)

    @gluon.jit
    def _as_rows(buf, rows: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):
        """A ``[2, TC, cols]`` buffer as ``[rows, cols]`` rows (indexable by a runtime row)."""
        return buf._reinterpret(buf.dtype, [rows, cols], layout)


@gluon.jit
def _units(row, j: gl.constexpr):
    """Offset ``j`` of a layer row of a ``ReplayCommitPlan`` table, in 16-byte units."""
    lo = gl.load(row + 2 * j).to(gl.int64)
    hi = gl.load(row + 2 * j + 1).to(gl.int64)
    return hi * 2147483648 + lo


@gluon.jit
def _tile(
    tile, n_tiles, slots_ptr, acc_ptr, layers_ptr, flags, seq_len,
    H: gl.constexpr, NVB: gl.constexpr,
):  # fmt: skip
    """Lane, head and V block of ``tile`` (``((lane * H) + h) * NVB + vb``, lanes of a layer
    table as ``b * n_layers + layer``), its slot, its token count (0 for a padded lane, a
    skipped replay or a tile past the end), whether its lane is padded (``slots[b] < 0``)
    and its layer's offsets in 16-byte units (q/k/v rows, g, beta, state)."""
    inside = tile < n_tiles
    t = gl.where(inside, tile, 0)
    vb = t % NVB
    h = (t // NVB) % H
    b = t // (NVB * H)
    u_y = (b * 0).to(gl.int64)
    u_g = u_y
    u_b = u_y
    u_s = u_y
    if (flags & _K_LAYERS) != 0:
        n_layers = gl.load(layers_ptr)
        layer = b % n_layers
        b = b // n_layers
        row = layers_ptr + _TABLE_HEAD + layer * _TABLE_ROW
        u_y = _units(row, 0)
        u_g = _units(row, 1)
        u_b = _units(row, 2)
        u_s = _units(row, 3)
    slot = gl.load(slots_ptr + b).to(gl.int64)
    live = inside & (slot >= 0)
    padded = inside & (slot < 0)
    length = seq_len.to(gl.int64)
    if (flags & _K_REPLAY) != 0:
        # the lane keeps the state after token ``accepted`` (skipped outside [0, T))
        accepted = gl.load(acc_ptr + b).to(gl.int64)
        live = live & (accepted >= 0) & (accepted < length)
        length = accepted + 1
    length = gl.where(live, length, 0)
    slot = gl.where(live, slot, 0)
    return b, h, vb, slot, length, padded, u_y, u_g, u_b, u_s


@gluon.jit
def _stage(
    s_buf, q_buf, k_buf, v_buf, g_buf, b_buf,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr,
    b, h, vb, slot, length, t0, with_state,
    u_y, u_g, u_b, u_s,
    q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
    g_sb, g_st, g_sh, b_sb, b_st, b_sh, s_sn, s_sh, s_sk,
    EL_Y: gl.constexpr, EL_G: gl.constexpr, EL_S: gl.constexpr,
    BK: gl.constexpr, BV: gl.constexpr, TC: gl.constexpr, GROUP: gl.constexpr,
    CP_S: gl.constexpr, CP_QK: gl.constexpr, CP_V: gl.constexpr, CP_1: gl.constexpr,
):  # fmt: skip
    """Issue (not wait for) the ``cp.async`` copies of a tile's state (``with_state``) and of
    its tokens ``t0 .. t0 + TC`` into shared memory; masked elements are zero-filled."""
    h64 = h.to(gl.int64)
    hk64 = (h // GROUP).to(gl.int64)
    b64 = b.to(gl.int64)
    if with_state:
        sk = gl.arange(0, BK, gl.SliceLayout(1, CP_S))
        sv = gl.arange(0, BV, gl.SliceLayout(0, CP_S))
        s_row = state_ptr + u_s * EL_S + slot * s_sn + h64 * s_sh + vb * BV
        s_ok = gl.where(length > 0, BK, 0)
        _cp_async(
            s_buf,
            s_row + sk[:, None] * s_sk + sv[None, :],
            (sk < s_ok)[:, None] & (sv < BV)[None, :],
        )
    tq = gl.arange(0, TC, gl.SliceLayout(1, CP_QK))
    dq = gl.arange(0, BK, gl.SliceLayout(0, CP_QK))
    tok_q = (t0 + tq).to(gl.int64)
    m_q = (tok_q < length)[:, None] & (dq < BK)[None, :]
    y_off = u_y * EL_Y
    _cp_async(
        q_buf,
        q_ptr + y_off + b64 * q_sb + hk64 * q_sh + tok_q[:, None] * q_st + dq[None, :],
        m_q,
    )
    _cp_async(
        k_buf,
        k_ptr + y_off + b64 * k_sb + hk64 * k_sh + tok_q[:, None] * k_st + dq[None, :],
        m_q,
    )
    tv = gl.arange(0, TC, gl.SliceLayout(1, CP_V))
    dv = gl.arange(0, BV, gl.SliceLayout(0, CP_V))
    tok_v = (t0 + tv).to(gl.int64)
    _cp_async(
        v_buf,
        v_ptr + y_off + b64 * v_sb + h64 * v_sh + vb * BV + tok_v[:, None] * v_st + dv[None, :],
        (tok_v < length)[:, None] & (dv < BV)[None, :],
    )
    t1 = gl.arange(0, TC, gl.SliceLayout(1, CP_1))
    z1 = gl.arange(0, 1, gl.SliceLayout(0, CP_1))
    tok_1 = (t0 + t1).to(gl.int64)[:, None] + z1[None, :]
    m_1 = tok_1 < length
    _cp_async(g_buf, g_ptr + u_g * EL_G + b64 * g_sb + tok_1 * g_st + h64 * g_sh, m_1)
    _cp_async(b_buf, beta_ptr + u_b * EL_G + b64 * b_sb + tok_1 * b_st + h64 * b_sh, m_1)


@gluon.jit(
    do_not_specialize=[
        "g_ptr", "beta_ptr", "slots_ptr", "acc_ptr", "rg_ptr", "rb_ptr", "layers_ptr",
        "flags", "seq_len", "n_tiles", "g_sb", "g_st", "g_sh", "b_sb", "b_st", "b_sh",
        "r_sb", "r_st",
    ]
)  # fmt: skip
def _rule_step_kernel(
    q_ptr,  # [.., Hk, Dk]: token (b, t) at b * q_sb + t * q_st + hk * q_sh
    k_ptr,  # [.., Hk, Dk]
    v_ptr,  # [.., H, Dv]
    g_ptr,  # [.., H] float32
    beta_ptr,  # [.., H] float32
    o_ptr,  # [.., H, Dv]
    state_ptr,  # [N, H, Dk, Dv] float32 SSM state (slot view)
    slots_ptr,  # [bs]
    acc_ptr,  # [bs] accepted index per lane (RULE_REPLAY)
    rg_ptr,  # [bs, T, H] record gates g (RULE_SAVE_GATES)
    rb_ptr,  # [bs, T, H] record gates beta (RULE_SAVE_GATES)
    layers_ptr,  # int32 layer table of a ReplayCommitPlan (RULE_LAYERS)
    flags,
    seq_len,
    n_tiles,  # lanes (x layers) x H x Dv / BV
    scale,
    eps,
    q_sb,
    q_st,
    q_sh,
    k_sb,
    k_st,
    k_sh,
    v_sb,
    v_st,
    v_sh,
    g_sb,
    g_st,
    g_sh,
    b_sb,
    b_st,
    b_sh,
    o_sb,
    o_st,
    o_sh,
    s_sn,
    s_sh,
    s_sk,
    r_sb,
    r_st,
    H: gl.constexpr,
    DK: gl.constexpr,
    DV: gl.constexpr,
    BV: gl.constexpr,
    TC: gl.constexpr,
    VEC_Y: gl.constexpr,  # q/k/v elements per 16 bytes
    PREP: gl.constexpr,
    GROUP: gl.constexpr,
):
    BK: gl.constexpr = DK
    NVB: gl.constexpr = DV // BV
    # the state tile: 8 x 4 lanes, a lane holds BK/8 rows x BV/4 columns; reductions over
    # Dk are in-lane adds then three shuffle levels
    LS: gl.constexpr = gl.BlockedLayout([BK // 4, BV // 8], [4, 8], [1, 1], [1, 0])
    LK: gl.constexpr = gl.SliceLayout(1, LS)  # [BK] vectors (q, k)
    LV: gl.constexpr = gl.SliceLayout(0, LS)  # [BV] vectors (v, u, o)
    LCK: gl.constexpr = gl.BlockedLayout([BK // 32], [32], [1], [0])  # compact [BK]
    LCV: gl.constexpr = gl.BlockedLayout([BV // 32], [32], [1], [0])  # compact [BV]
    # copy layouts: 16 bytes a lane, rows coalesced
    CP_S: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BV // 4), BV // 4], [1, 1], [1, 0])
    QK_L: gl.constexpr = BK // VEC_Y
    CP_QK: gl.constexpr = gl.BlockedLayout([1, VEC_Y], [32 // QK_L, QK_L], [1, 1], [1, 0])
    V_L: gl.constexpr = BV // VEC_Y
    CP_V: gl.constexpr = gl.BlockedLayout([1, VEC_Y], [32 // V_L, V_L], [1, 1], [1, 0])
    CP_1: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 1], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    EL_Y: gl.constexpr = 128 // q_ptr.dtype.element_ty.primitive_bitwidth
    EL_G: gl.constexpr = 4
    EL_S: gl.constexpr = 4

    s_buf = gl.allocate_shared_memory(gl.float32, [BK, BV], PLAIN2)
    q_buf = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, TC, BK], PLAIN2)
    k_buf = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [2, TC, BK], PLAIN2)
    v_buf = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [2, TC, BV], PLAIN2)
    g_buf = gl.allocate_shared_memory(gl.float32, [2, TC, 1], PLAIN2)
    b_buf = gl.allocate_shared_memory(gl.float32, [2, TC, 1], PLAIN2)
    # the token buffers as rows (a row view is indexed by a runtime row)
    q_rows = _as_rows(q_buf, 2 * TC, BK, PLAIN1)
    k_rows = _as_rows(k_buf, 2 * TC, BK, PLAIN1)
    v_rows = _as_rows(v_buf, 2 * TC, BV, PLAIN1)
    g_rows = _as_rows(g_buf, 2 * TC, 1, PLAIN1)
    b_rows = _as_rows(b_buf, 2 * TC, 1, PLAIN1)

    store_out = (flags & _K_STORE_OUT) != 0
    write_final = (flags & _K_WRITE_FINAL) != 0
    save_gates = (flags & _K_SAVE_GATES) != 0

    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    n_iter = (n_tiles - pid + n_prog - 1) // n_prog

    offs_v = gl.arange(0, BV, LV)
    sk = gl.arange(0, BK, gl.SliceLayout(1, LS))
    sv = gl.arange(0, BV, gl.SliceLayout(0, LS))
    zero1 = gl.arange(0, 1, L1)

    b, h, vb, slot, length, padded, u_y, u_g, u_b, u_s = _tile(
        pid, n_tiles, slots_ptr, acc_ptr, layers_ptr, flags, seq_len, H, NVB
    )
    _stage(
        s_buf, q_buf.index(0), k_buf.index(0), v_buf.index(0), g_buf.index(0), b_buf.index(0),
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, b, h, vb, slot, length, 0, True,
        u_y, u_g, u_b, u_s, q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
        g_sb, g_st, g_sh, b_sb, b_st, b_sh, s_sn, s_sh, s_sk,
        EL_Y, EL_G, EL_S, BK, BV, TC, GROUP, CP_S, CP_QK, CP_V, CP_1,
    )  # fmt: skip
    async_copy.commit_group()

    for i in range(0, n_iter):
        buf = i % 2
        async_copy.wait_group(0)
        _cta_barrier()
        state = s_buf.load(LS)
        _cta_barrier()  # every lane's read of the state buffer before the next copy
        nb, nh, nvb, nslot, nlength, npadded, nu_y, nu_g, nu_b, nu_s = _tile(
            pid + (i + 1) * n_prog, n_tiles, slots_ptr, acc_ptr, layers_ptr, flags, seq_len,
            H, NVB,
        )  # fmt: skip
        _stage(
            s_buf, q_buf.index(1 - buf), k_buf.index(1 - buf), v_buf.index(1 - buf),
            g_buf.index(1 - buf), b_buf.index(1 - buf),
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, nb, nh, nvb, nslot, nlength, 0,
            True, nu_y, nu_g, nu_b, nu_s, q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st,
            v_sh, g_sb, g_st, g_sh, b_sb, b_st, b_sh, s_sn, s_sh, s_sk,
            EL_Y, EL_G, EL_S, BK, BV, TC, GROUP, CP_S, CP_QK, CP_V, CP_1,
        )  # fmt: skip
        async_copy.commit_group()

        h64 = h.to(gl.int64)
        b64 = b.to(gl.int64)
        o_row = o_ptr + b64 * o_sb + h64 * o_sh + vb * BV
        r_off = b64 * r_sb + h64
        r_ok = save_gates & (vb == 0) & (length > 0)
        qb = q_buf.index(buf)
        kb = k_buf.index(buf)
        vbuf = v_buf.index(buf)
        gb = g_buf.index(buf)
        bb = b_buf.index(buf)
        row0 = buf * TC
        for c0 in range(0, length, TC):
            if c0 > 0:
                # a lane longer than TC tokens: stage the next chunk now (and wait for it
                # together with the next tile's copies)
                _cta_barrier()
                _stage(
                    s_buf, qb, kb, vbuf, gb, bb, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                    state_ptr, b, h, vb, slot, length, c0, False, u_y, u_g, u_b, u_s,
                    q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
                    g_sb, g_st, g_sh, b_sb, b_st, b_sh, s_sn, s_sh, s_sk,
                    EL_Y, EL_G, EL_S, BK, BV, TC, GROUP, CP_S, CP_QK, CP_V, CP_1,
                )  # fmt: skip
                async_copy.commit_group()
                async_copy.wait_group(0)
                _cta_barrier()
            n_tok = gl.minimum(length - c0, TC).to(gl.int32)
            for tt in range(0, n_tok):
                t = c0 + tt
                g = gl.sum(g_rows.index(row0 + tt).load(L1), axis=0)
                beta = gl.sum(b_rows.index(row0 + tt).load(L1), axis=0)
                if PREP:
                    # the prologue in compact layouts (each element once per warp), then
                    # broadcast to the state tile's row / column layouts
                    q = q_rows.index(row0 + tt).load(LCK).to(gl.float32)
                    k = k_rows.index(row0 + tt).load(LCK).to(gl.float32)
                    v = v_rows.index(row0 + tt).load(LCV).to(gl.float32)
                    q = q / (1.0 + gl.exp(-q))
                    k = k / (1.0 + gl.exp(-k))
                    v = v / (1.0 + gl.exp(-v))
                    q = q / gl.sqrt(gl.sum(q * q, axis=0) + eps)
                    k = k / gl.sqrt(gl.sum(k * k, axis=0) + eps)
                    qs = gl.convert_layout(q * scale, LK)
                    k = gl.convert_layout(k, LK)
                    v = gl.convert_layout(v, LV)
                else:
                    qs = q_rows.index(row0 + tt).load(LK).to(gl.float32) * scale
                    k = k_rows.index(row0 + tt).load(LK).to(gl.float32)
                    v = v_rows.index(row0 + tt).load(LV).to(gl.float32)
                one = zero1 == 0
                gl.store(rg_ptr + r_off + t * r_st + zero1, g + zero1 * 0.0, mask=r_ok & one)
                gl.store(rb_ptr + r_off + t * r_st + zero1, beta + zero1 * 0.0, mask=r_ok & one)
                state = state * gl.exp(g)
                pred = gl.sum(state * k[:, None], axis=0)
                u = beta * (v - pred)
                state = state + k[:, None] * u[None, :]
                if store_out:
                    o = gl.sum(state * qs[:, None], axis=0)
                    gl.store(o_row + t * o_st + offs_v, o.to(o_ptr.dtype.element_ty))
        if write_final & (length > 0):
            s_row = state_ptr + u_s * EL_S + slot * s_sn + h64 * s_sh + vb * BV
            gl.store(s_row + sk[:, None] * s_sk + sv[None, :], state)
        if store_out & padded:
            # a padded lane's output rows are zeros (as _rule_kernel's)
            for t in range(0, seq_len):
                gl.store(o_row + t * o_st + offs_v, gl.zeros([BV], o_ptr.dtype.element_ty, LV))
        b, h, vb, slot, length, padded = nb, nh, nvb, nslot, nlength, npadded
        u_y, u_g, u_b, u_s = nu_y, nu_g, nu_b, nu_s
    async_copy.wait_group(0)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

_ENV = "UNIMEM_GDN_STEP_KERNEL"
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _aligned(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """``t``'s base address is 16-byte aligned and every stride in ``strides`` (elements) is
    a multiple of 16 elements (so the compiler sees the same alignment in every step kind)."""
    return t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in strides)


def eligible(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qkv_strides: tuple[tuple[int, ...], ...],
    gb: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    ssm_state: torch.Tensor,
) -> bool:
    """Whether a step-kind delta-rule launch over these tensors runs :func:`launch`.

    Depends on the model's tensors only (dtypes, head sizes, strides other than the batch
    stride's multiplier, alignment), never on the step kind, so decode, verify and the
    replay commit of one model all take it or all take ``gdn._rule_kernel``. Off with
    ``UNIMEM_GDN_STEP_KERNEL=triton``, off the GPU and under the Triton interpreter."""
    choice = os.environ.get(_ENV, "gluon")
    if choice not in ("gluon", "triton"):
        raise ValueError(f"{_ENV} must be gluon or triton, got {choice!r}")
    if choice == "triton" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if not ssm_state.is_cuda or _device_limits(ssm_state.device.index)[4] < (8, 0):
        return False
    _, h, dk, dv = ssm_state.shape
    q, k, v = qkv
    if ssm_state.dtype != torch.float32 or dk not in (16, 32, 64, 128) or dv % 32:
        return False
    if q.dtype not in _INPUT_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return False
    if out.dtype not in _INPUT_DTYPES or any(t.dtype != torch.float32 for t in gb):
        return False
    if ssm_state.stride(3) != 1 or not _aligned(ssm_state, ssm_state.stride()[:3]):
        return False
    per16 = 16 // q.element_size()
    for t, s in zip(qkv, qkv_strides, strict=True):
        if s[3] != 1 or t.data_ptr() % 16 or any(x % per16 or x % 16 for x in s[:3]):
            return False
    return out_strides[3] == 1 and _aligned(out, out_strides[:3])


@functools.cache
def _device_limits(index: int | None) -> tuple[int, int, int, int, tuple[int, int]]:
    """(SMs, registers, shared bytes, threads per SM; compute capability) of CUDA device
    ``index``."""
    p = torch.cuda.get_device_properties(index)
    regs = getattr(p, "regs_per_multiprocessor", 65536)
    smem = getattr(p, "shared_memory_per_multiprocessor", 228 * 1024)
    threads = getattr(p, "max_threads_per_multi_processor", 2048)
    return p.multi_processor_count, regs, smem, threads, (p.major, p.minor)


_CTAS: dict[tuple, int] = {}


def _ctas_per_sm(kernel, device: torch.device) -> int:
    """CTAs of the compiled ``kernel`` (one warp each) that fit on one SM together."""
    _, regs, smem, threads, _ = _device_limits(device.index)
    kernel._init_handles()  # loads the module; sets n_regs (Triton's CompiledKernel)
    per_cta_regs = -(-max(kernel.n_regs, 1) * 32 // 256) * 256
    by_regs = regs // per_cta_regs
    by_smem = smem // (kernel.metadata.shared + 1024)  # 1 KiB reserved per CTA
    return max(1, min(by_regs, by_smem, threads // 32, 32))


def launch(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qkv_strides: tuple[tuple[int, ...], ...],
    gb: tuple[torch.Tensor, torch.Tensor],
    gb_strides: tuple[tuple[int, ...], ...],
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    acc32: torch.Tensor,
    rg: torch.Tensor,
    rb: torch.Tensor,
    r_strides: tuple[int, int],
    table: torch.Tensor,
    n_layers: int,
    flags: int,
    seq_len: int,
    scale: float,
    eps: float,
    prep: bool,
    group: int,
) -> None:
    """One launch of :func:`_rule_step_kernel` (arguments as ``gdn._launch_rule`` prepares
    them for ``_rule_kernel``; :func:`eligible` must hold). Grid: as many one-warp CTAs as
    fit on the device at once, at most one per tile; no allocation, no host read (after
    the first launch of a configuration, which compiles and sizes the grid)."""
    bs = slots.shape[0]
    _, h, dk, dv = ssm_state.shape
    q, k, v = qkv
    g, beta = gb
    n_tiles = bs * n_layers * h * (dv // 32)
    args = (
        q, k, v, g, beta, out, ssm_state, slots, acc32, rg, rb, table, flags, seq_len,
        n_tiles, scale, eps,
        *qkv_strides[0][:3], *qkv_strides[1][:3], *qkv_strides[2][:3],
        *gb_strides[0], *gb_strides[1], *out_strides[:3], *ssm_state.stride()[:3], *r_strides,
    )  # fmt: skip
    consts = dict(
        H=h, DK=dk, DV=dv, BV=32, TC=TOKEN_CHUNK, VEC_Y=16 // q.element_size(), PREP=prep,
        GROUP=group,
    )  # fmt: skip
    key = (ssm_state.device.index, q.dtype, out.dtype, tuple(sorted(consts.items())))
    ctas = _CTAS.get(key)
    if ctas is None:
        kernel = _rule_step_kernel.warmup(*args, grid=(1,), num_warps=1, **consts)
        ctas = _CTAS[key] = _ctas_per_sm(kernel, ssm_state.device)
    n_sm = _device_limits(ssm_state.device.index)[0]
    grid = (max(1, min(n_tiles, n_sm * ctas)),)
    _rule_step_kernel[grid](*args, num_warps=1, **consts)
