"""Gated DeltaNet (GDN) mixer core on the GPU: causal conv1d and the gated delta rule, reading
and writing each request's state in its arena slot in place.

Semantics are those of ``unimem_kernel.gdn_reference`` (the oracle, and the CPU path of the
public entry points here): same arguments, same results up to rounding. In short, per request
with conv state ``[conv_dim, K-1]`` and recurrent state ``S [H, Dk, Dv]``:

* conv: ``y_t[c] = sum_{i<K} w[c, i] * x_{t-K+1+i}[c]`` (inputs before the first token from
  the conv state), then SiLU where ``activation="silu"``; the conv accumulates in float32
  (float64 for float64 inputs), applies the activation there and stores ``y`` in ``x``'s
  dtype (one rounding, as ``causal_conv1d_fn``); a state entry holds inputs rounded to
  ``x``'s dtype;
* delta rule, per head, arithmetic in the SSM state's dtype (float32 for bf16/fp32 models):
  ``S = exp(g_t) S; S += beta_t k_t (v_t - S^T k_t)^T; o_t = S^T (scale q_t)``,
  ``scale = Dk ** -0.5``;
* the mixer (:func:`gdn_forward`): conv with SiLU -> split ``[q | k | v]`` -> L2-normalise q,
  k (``x / sqrt(sum(x^2) + 1e-6)``) -> delta rule. SiLU runs in the conv kernel, once per
  element (the delta rule's programs would each redo it for their V block, and every value
  head of a key head for its q and k); the L2 norm runs inside the delta rule kernel, which
  reads q, k, v straight from the conv output (no intermediate copies);
* grouped key heads: q and k may have ``Hk`` heads dividing the ``H`` value heads (Qwen3-Next:
  16 and 32); value head ``h`` uses key head ``h // (H // Hk)`` (HuggingFace's
  ``repeat_interleave``). The rule kernel indexes the key head directly, so q and k are never
  expanded on the GPU; ``mixed_qkv`` channels are ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]``.

State layouts: ``conv_state [num_slots, conv_dim, K-1]`` and ``ssm_state [num_slots, H, Dk,
Dv]`` are usually ``as_strided`` views into the ``uint8`` arena (slot stride = the slot
envelope); every stride is passed to the kernels, nothing is assumed contiguous. Slot offsets
(``slot * slot_stride``) and row offsets are int64 inside the kernels.

Modes, as in the engine:

* ``extend``: ragged rows (``cu_seqlens [bs+1]``); request ``i`` starts from slot
  ``slots[i]`` (from zeros where ``has_initial_state[i]`` is False: the slot is then not read)
  and its final state is written back to that slot, in place. A zero-length request keeps its
  state (zeros without an initial state).
* ``decode``: one token per request; the slot is updated in place.
* ``verify``: ``T`` tokens per request (request-major rows); the state after every token goes
  to caller-owned scratch (``conv [bs, T, conv_dim, K-1]``, ``ssm [bs, T, H, Dk, Dv]``, in the
  states' dtypes, entry ``t`` = after token ``t``); the slots are only read. Committing is
  ``state_commit.commit_states`` (DESIGN §5). Or, with a ``gdn_reference.VerifyRecord`` in
  place of both scratches, only the step's inputs are kept — the conv input rows, the conv
  output rows (the record's ``y`` *is* the conv output) and the gates, ~40x fewer bytes than
  the states at the ``small`` sizes — and ``gdn_replay_commit`` rebuilds each lane's conv
  window and re-runs the delta rule over tokens ``0 .. accepted`` from the slot: the very
  ``_rule_kernel`` binary the verify ran (its step kind is a runtime flag, and the replay
  passes the same kinds of arguments through ``_mixer_rule``), so the committed state is
  bitwise the verify's state after that token. A :class:`ReplayCommitPlan` commits every
  GDN layer of a model in one launch per kernel (``gdn_replay_commit_layers``: the same
  kernels with a layer table, ``n_layers x bs`` programs on the first grid axis), which
  keeps more programs in flight than one launch per layer (8 layers of the ``small`` preset
  at 48 x 8 tokens: 345 -> 283 us, ``benchmark/bench_gdn_rule.py``).

Padded lanes (``slots[b] < 0``, as in a fixed-size CUDA-graph batch) are skipped by the Triton
path: their slots and scratch entries are neither read nor written and their output rows are
zeros. (The torch reference has no padded lanes: on CPU pass live lanes only.)

Kernels (the rule's step kinds are runtime flags, the conv's constexpr switches):

* ``_conv_kernel``: grid ``(bs, token blocks, channel blocks)``; a program computes a
  ``[BLOCK_T, BLOCK_D]`` tile of ``y`` from ``K`` shifted loads, then SiLU (``SILU``). Only
  token block 0 of a request touches its slot: it reads the initial state and, in
  extend/decode, writes the final ``K-1`` inputs back after a barrier (``BLOCK_T >= K-1``
  whenever there are several token blocks, so later blocks never need the state). Verify
  writes the window after every token (``STORE_STATES``) or, with a record, the input rows
  (``STORE_X``, coalesced).
* ``_conv_commit_kernel``: grid ``(bs, channel blocks)``; the replay commit's conv half.
* ``_rule_kernel``: grid ``(bs, H, cdiv(Dv, BLOCK_V))`` over value heads (q/k read from key head
  ``h // GROUP``, ``GROUP = H // Hk``); the state tile ``[Dk, BLOCK_V]`` stays
  in registers (float32, or float64 for float64 states) across a token loop that prefetches the
  next token's q/k/v/g/beta. Each program owns its slice of the slot, so the in-place read at
  the start and write at the end never race with another program. Its ``flags``
  (``RULE_*``) select ragged rows, initial-state flags, output and final-state stores, the
  record's gates (stored by V block 0), the replay (lane ``b``'s tokens ``0 ..
  accepted[b]``, no output) and several layers in one launch (``RULE_LAYERS``: a
  ``ReplayCommitPlan``'s table of per-layer offsets); constexprs are only the shapes, the
  tile, the dtype, the per-position state stores of the old verify (``STORE_STATES``) and
  the mixer's L2 norm of q and k (``PREP``). The arguments that vary between step kinds
  without changing arithmetic (gate, slot, flag and table pointers; batch strides) are not
  specialised on, so that one tile is one binary.

Expected cost of the recurrent form in extend (an estimate; ``benchmark/bench_gdn.py`` measures
it against fla's chunked kernel plus the gather/scatter copies that kernel needs): each program
runs ``L`` dependent steps (decay, two ``[Dk, BLOCK_V]`` reductions, rank-1 update, on CUDA
cores), roughly 0.5-1 us per step, so a 2048-token prompt costs ~1-2 ms per layer however many
requests run beside it (8 x 2048 tokens at the ``small`` sizes: 2048 programs, all resident at
once). A chunked (WY) kernel has ``L / 64`` dependent steps of tensor-core matmuls: expected
~0.2-0.4 ms for the same batch, i.e. 3-8x faster for long prompts and about even below ~64
tokens. Decode and verify are memory-bound on the state (``H * Dk * Dv * 4`` bytes read, and
written back or to scratch, per request and layer); the recurrent form is the right one there.

Launchers (``*_triton``) allocate only when ``out`` (and, for the mixer, ``conv_out``) is not
given, and read nothing back from the device in decode/verify; extend reads ``cu_seqlens`` on
the host when it is a device tensor and ``max_seqlen`` is not given (extend is not captured).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel import gdn_reference
from unimem_kernel._dispatch import next_pow2, use_triton

L2NORM_EPS = 1e-6
"""Epsilon of the q/k L2 normalisation: ``x / sqrt(sum(x^2) + eps)`` (as the reference)."""

_CONV_MAX_BLOCK_T = 64  # tokens per conv program in long (extend) segments
_CONV_TILE = 4096  # elements of a conv program's [BLOCK_T, BLOCK_D] tile
# (Compiled for sm_90, 4096 spills 150-450 bytes of registers per thread in extend and verify
# and 2048 spills nothing (benchmark/compile_check.py --only conv), yet on the H200 2048 made
# the prefill conv 14-16 % slower (8 x 512: 135 -> 157 us, 8 x 2048: 461 -> 524 us) and left
# decode and verify unchanged: benchmark/bench_gdn.py, docs/benchmarks.md. Per-element
# arithmetic, so the tile changes no result.)
_CONV_SHORT_TILE = (64, 2)  # (BLOCK_D, warps) of segments of 2..16 tokens (verify windows)
# (benchmark/bench_gdn_conv.py on the H200, small preset, 48 lanes x 8 tokens with the record's
# input rows: 7.96 us against 12.91 us for the 512-channel, 4-warp tile these segments had;
# 128 x 2 warps 9.04, 256 x 8 warps 8.94. Decode keeps 512 x 4 warps: 3.99 us, the best
# within 0.2 us. docs/benchmarks.md, "GDN Triton kernels on arena slots".)
_CONV_SHORT_MAX_T = 16
_CONV_WARPS = 4
_MAX_GRID_YZ = 65535  # CUDA limit of grid axes 1 and 2

_TL_ACC = {torch.float64: tl.float64}


def _acc(dtype: torch.dtype):
    """Triton accumulation dtype: float64 for float64 tensors, else float32."""
    return _TL_ACC.get(dtype, tl.float32)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu(x):
    """SiLU, ``x / (1 + exp(-x))``, in ``x``'s dtype (the mixer's conv output)."""
    return x / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["seq_len"])
def _conv_kernel(
    x_ptr,  # [rows, D] inputs (row of (b, t): b * x_sb + (start_b + t) * x_st)
    w_ptr,  # [D, K]
    state_ptr,  # [N, D, K-1] conv state (slot view)
    slots_ptr,  # [bs] physical slots, < 0: padded lane
    cu_ptr,  # [bs+1] row offsets (VARLEN)
    init_ptr,  # [bs] uint8 has_initial_state (HAS_INIT)
    y_ptr,  # like x
    scratch_ptr,  # [bs, T, D, K-1] (STORE_STATES)
    xr_ptr,  # [bs, T, D] the record's conv inputs (STORE_X)
    seq_len,  # tokens per request (not VARLEN)
    dim,
    x_sb,
    x_st,
    x_sd,
    w_sd,
    w_sk,
    s_sn,
    s_sd,
    s_sk,
    y_sb,
    y_st,
    y_sd,
    c_sb,
    c_st,
    c_sd,
    c_sk,
    r_sb,
    r_st,
    KW: tl.constexpr,
    KP: tl.constexpr,  # next_pow2(KW - 1)
    ACC: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_INIT: tl.constexpr,
    STORE_STATES: tl.constexpr,
    STORE_X: tl.constexpr,
    WRITE_FINAL: tl.constexpr,
    SILU: tl.constexpr,  # SiLU on the accumulator before the store (the mixer's activation)
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    tb = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    if VARLEN:
        start = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
        b_off = 0
    else:
        start = 0
        length = seq_len.to(tl.int64)
        b_off = b.to(tl.int64)
    has = live
    if HAS_INIT:
        has = has & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)
    st_base = state_ptr + slot * s_sn

    # Scalar predicates enter block masks as integer bounds (``offs < where(p, n, 0)``): the
    # Triton interpreter mistypes a splatted boolean scalar.
    live_len = tl.where(live, length, 0)
    has_len = tl.where(has, length, 0)

    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < dim
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < length
    t_live = offs_t < live_len
    t_has = offs_t < has_len
    rows = start + offs_t  # int64
    x_base = x_ptr + b_off * x_sb
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for i in tl.static_range(KW):
        # input position of tap i for each output token; < 0: from the conv state
        pos = offs_t - (KW - 1) + i
        from_x = (pos >= 0) & t_live
        from_s = (pos < 0) & t_has
        xv = tl.load(
            x_base + (start + pos)[:, None] * x_st + offs_d[None, :] * x_sd,
            mask=from_x[:, None] & dmask[None, :],
            other=0.0,
        )
        sv = tl.load(
            st_base + offs_d[None, :] * s_sd + (pos + (KW - 1))[:, None] * s_sk,
            mask=from_s[:, None] & dmask[None, :],
            other=0.0,
        )
        xin = tl.where(from_x[:, None], xv, sv.to(xv.dtype))  # rounded to x's dtype
        wi = tl.load(w_ptr + offs_d * w_sd + i * w_sk, mask=dmask, other=0.0).to(ACC)
        acc += xin.to(ACC) * wi[None, :]
        if STORE_STATES and i >= 1:
            # window after token t, column i - 1, is input t - K + 1 + i: this tap's input
            c_ptrs = (
                scratch_ptr
                + b.to(tl.int64) * c_sb
                + offs_t[:, None].to(tl.int64) * c_st
                + offs_d[None, :] * c_sd
                + (i - 1) * c_sk
            )
            smask = t_live[:, None] & dmask[None, :]
            tl.store(c_ptrs, xin.to(scratch_ptr.dtype.element_ty), mask=smask)
        if STORE_X and i == KW - 1:
            # the last tap's input is token t itself: the record keeps the rows, coalesced
            r_ptrs = (
                xr_ptr
                + b.to(tl.int64) * r_sb
                + offs_t[:, None].to(tl.int64) * r_st
                + offs_d[None, :]
            )
            tl.store(r_ptrs, xin.to(xr_ptr.dtype.element_ty), mask=t_live[:, None] & dmask[None, :])
    if SILU:
        acc = _silu(acc)
    ymask = tmask[:, None] & dmask[None, :]
    tl.store(
        y_ptr + b_off * y_sb + rows[:, None] * y_st + offs_d[None, :] * y_sd,
        acc.to(y_ptr.dtype.element_ty),
        mask=ymask,
    )
    if WRITE_FINAL:
        # the last K-1 inputs of the request (token block 0 only: the one program per channel
        # block that reads this slot)
        first = tb == 0
        cols = tl.arange(0, KP)
        c_live = cols < tl.where(live & first, KW - 1, 0)
        c_has = cols < tl.where(has & first, KW - 1, 0)
        pos = length - (KW - 1) + cols
        fx = (pos >= 0) & c_live
        fs = (pos < 0) & c_has
        xv = tl.load(
            x_base + (start + pos)[None, :] * x_st + offs_d[:, None] * x_sd,
            mask=dmask[:, None] & fx[None, :],
            other=0.0,
        )
        sv = tl.load(
            st_base + offs_d[:, None] * s_sd + (pos + (KW - 1))[None, :] * s_sk,
            mask=dmask[:, None] & fs[None, :],
            other=0.0,
        )
        fin = tl.where(fx[None, :], xv, sv.to(xv.dtype))
        # every read of the slot (above and in the tap loop, by any thread) before any write
        tl.debug_barrier()
        tl.store(
            st_base + offs_d[:, None] * s_sd + cols[None, :] * s_sk,
            fin.to(state_ptr.dtype.element_ty),
            mask=dmask[:, None] & c_live[None, :],
        )


@triton.jit
def _conv_commit_kernel(
    xr_ptr,  # [bs, T, D] the record's conv inputs
    state_ptr,  # [N, D, K-1] conv state (slot view)
    slots_ptr,  # [bs] physical slots, < 0: skipped
    acc_ptr,  # [bs] accepted index, outside [0, T): skipped
    layers_ptr,  # int32 layer table of a ReplayCommitPlan (``multi``)
    multi,  # several layers in one launch: program (b * n_layers + layer)
    seq_len,
    dim,
    r_sb,
    r_st,
    s_sn,
    s_sd,
    s_sk,
    KW: tl.constexpr,
    KP: tl.constexpr,  # next_pow2(KW - 1)
    BLOCK_D: tl.constexpr,
):
    """Lane ``b``'s conv window after token ``accepted[b]``, into its slot: column ``c`` is
    input ``accepted - (K - 2) + c`` of the step (the record's row) when that is ``>= 0``,
    else column ``accepted + 1 + c`` of the slot's window. A program owns channels
    ``[BLOCK_D]`` of one lane: it reads them all before it writes them."""
    b = tl.program_id(0)
    if multi != 0:
        n_layers = tl.load(layers_ptr)
        layer = b % n_layers
        b = b // n_layers
        row = layers_ptr + _TABLE_HEAD + layer * _TABLE_ROW
        xr_ptr += _table_offset(row, 4, xr_ptr)
        state_ptr += _table_offset(row, 5, state_ptr)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    acc = tl.load(acc_ptr + b).to(tl.int64)
    ok = (slot >= 0) & (acc >= 0) & (acc < seq_len)
    slot = tl.where(ok, slot, 0)
    acc = tl.where(ok, acc, 0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cols = tl.arange(0, KP)
    dmask = offs_d < tl.where(ok, dim, 0)
    cmask = cols < KW - 1
    pos = acc - (KW - 2) + cols  # step position of each kept column
    from_x = (pos >= 0) & cmask
    from_s = (pos < 0) & cmask
    st = state_ptr + slot * s_sn + offs_d[:, None] * s_sd
    xv = tl.load(
        xr_ptr + b.to(tl.int64) * r_sb + tl.where(from_x, pos, 0)[None, :] * r_st
        + offs_d[:, None],
        mask=dmask[:, None] & from_x[None, :],
        other=0.0,
    )  # fmt: skip
    sv = tl.load(
        st + tl.where(from_s, acc + 1 + cols, 0)[None, :] * s_sk,
        mask=dmask[:, None] & from_s[None, :],
        other=0.0,
    )
    win = tl.where(from_x[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    tl.debug_barrier()  # every read of the slot before any write
    tl.store(st + cols[None, :] * s_sk, win, mask=dmask[:, None] & cmask[None, :])


# A ReplayCommitPlan's int32 layer table: a head ``[n_layers, 0]``, then one row per layer of
# six offsets from layer 0's tensors (record y, g, beta, SSM state, record x, conv state) in
# 16-byte units, each as two int32 ``(lo, hi)`` with ``units = hi * 2**31 + lo`` and ``0 <=
# lo < 2**31`` (int32 so that a single-layer launch passes any int32 index tensor as the
# never-read placeholder and every step kind keeps one kernel signature). In 16-byte units
# because the kernel then moves a pointer by ``units * (16 / element size)`` elements, a
# multiple of 16 bytes the compiler can see: layer 0's alignment, hence its vectorised
# loads and stores, holds for every layer (an offset of unknown divisibility made the state
# loads scalar, 3x slower, on the H200).
TABLE_HEAD = 2
TABLE_OFFSETS = ("y", "g", "beta", "ssm", "x", "conv")
TABLE_ROW = 2 * len(TABLE_OFFSETS)
_TABLE_HEAD = tl.constexpr(TABLE_HEAD)
_TABLE_ROW = tl.constexpr(TABLE_ROW)


@triton.jit
def _table_offset(row, j: tl.constexpr, ptr):
    """Offset ``j`` of a layer row of the table in elements of ``ptr``'s dtype (int64), a
    multiple of 16 bytes by construction."""
    lo = tl.load(row + 2 * j).to(tl.int64)
    hi = tl.load(row + 2 * j + 1).to(tl.int64)
    per_unit: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
    return (hi * 2147483648 + lo) * per_unit


@triton.jit
def _load_token(
    q_row,
    k_row,
    v_row,
    g_row,
    b_row,
    offs_k,
    offs_v,
    q_sd,
    k_sd,
    v_sd,
    ok,
    DK: tl.constexpr,
    DV: tl.constexpr,
    ACC: tl.constexpr,
):
    """q, k, v, g, beta of one token (zeros where ``ok`` is False), in ``ACC``."""
    kmask = offs_k < tl.where(ok, DK, 0)
    vmask = offs_v < tl.where(ok, DV, 0)
    k = tl.load(k_row + offs_k * k_sd, mask=kmask, other=0.0).to(ACC)
    q = tl.load(q_row + offs_k * q_sd, mask=kmask, other=0.0).to(ACC)
    v = tl.load(v_row + offs_v * v_sd, mask=vmask, other=0.0).to(ACC)
    g = tl.load(g_row, mask=ok, other=0.0).to(ACC)
    beta = tl.load(b_row, mask=ok, other=0.0).to(ACC)
    return q, k, v, g, beta


@triton.jit
def _delta_step(state, k, v, g, beta):
    """One token of the gated delta rule on a ``[BK, BV]`` state tile (``k [BK]``, ``v [BV]``,
    scalars ``g``, ``beta``): decay, prediction, rank-1 update."""
    state = state * tl.exp(g)
    pred = tl.sum(state * k[:, None], axis=0)
    u = beta * (v - pred)
    return state + k[:, None] * u[None, :]


# Runtime step flags of ``_rule_kernel`` (bits of ``flags``). They are runtime values, not
# constexprs, so that extend, decode, verify and the replay commit of one tile configuration
# run one compiled kernel: a token's state is then bitwise the same whichever step computes
# it (the compiler cannot contract or reorder one step kind differently from another).
RULE_VARLEN = 1  # rows ragged by cu_seqlens (else seq_len rows per lane, request-major)
RULE_HAS_INIT = 2  # has_initial_state per lane (else every live lane reads its slot)
RULE_STORE_OUT = 4  # store o
RULE_WRITE_FINAL = 8  # write the final state back to the slot
RULE_REPLAY = 16  # tokens 0 .. accepted[b] of each lane (the replay commit)
RULE_SAVE_GATES = 32  # store g and beta of every token into the record (verify)
RULE_LAYERS = 64  # several layers in one launch (a ReplayCommitPlan's table, see below)
# the same bits as the kernel sees them (a jitted function reads globals only as constexprs)
_K_VARLEN = tl.constexpr(RULE_VARLEN)
_K_HAS_INIT = tl.constexpr(RULE_HAS_INIT)
_K_STORE_OUT = tl.constexpr(RULE_STORE_OUT)
_K_WRITE_FINAL = tl.constexpr(RULE_WRITE_FINAL)
_K_REPLAY = tl.constexpr(RULE_REPLAY)
_K_SAVE_GATES = tl.constexpr(RULE_SAVE_GATES)
_K_LAYERS = tl.constexpr(RULE_LAYERS)


@triton.jit(
    do_not_specialize=[
        "g_ptr", "beta_ptr", "slots_ptr", "cu_ptr", "init_ptr", "scratch_ptr", "acc_ptr",
        "rg_ptr", "rb_ptr", "layers_ptr", "flags", "seq_len", "q_sb", "k_sb", "v_sb", "g_sb",
        "g_st", "g_sh", "b_sb", "b_st", "b_sh", "o_sb", "r_sb", "r_st",
    ]
)  # fmt: skip
def _rule_kernel(
    q_ptr,  # [.., Hk, Dk]: token (b, t) at b * q_sb + (start_b + t) * q_st (+ hk * q_sh)
    k_ptr,  # [.., Hk, Dk]
    v_ptr,  # [.., H, Dv]
    g_ptr,  # [.., H]
    beta_ptr,  # [.., H]
    o_ptr,  # [.., H, Dv]
    state_ptr,  # [N, H, Dk, Dv] SSM state (slot view)
    slots_ptr,  # [bs]
    cu_ptr,  # [bs+1] (RULE_VARLEN)
    init_ptr,  # [bs] uint8 (RULE_HAS_INIT)
    scratch_ptr,  # [bs, T, H, Dk, Dv] (STORE_STATES)
    acc_ptr,  # [bs] accepted index per lane (RULE_REPLAY)
    rg_ptr,  # [bs, T, H] record gates g (RULE_SAVE_GATES)
    rb_ptr,  # [bs, T, H] record gates beta (RULE_SAVE_GATES)
    layers_ptr,  # int32 layer table of a ReplayCommitPlan (RULE_LAYERS)
    flags,
    seq_len,
    scale,
    eps,
    q_sb,
    q_st,
    q_sh,
    q_sd,
    k_sb,
    k_st,
    k_sh,
    k_sd,
    v_sb,
    v_st,
    v_sh,
    v_sd,
    g_sb,
    g_st,
    g_sh,
    b_sb,
    b_st,
    b_sh,
    o_sb,
    o_st,
    o_sh,
    o_sd,
    s_sn,
    s_sh,
    s_sk,
    s_sv,
    c_sb,
    c_st,
    c_sh,
    c_sk,
    c_sv,
    r_sb,
    r_st,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    ACC: tl.constexpr,
    STORE_STATES: tl.constexpr,
    PREP: tl.constexpr,  # L2 norm of q, k (the mixer's prologue; SiLU ran in the conv)
    GROUP: tl.constexpr,  # H // Hk: value head h reads q, k of key head h // GROUP
):
    b = tl.program_id(0)
    h = tl.program_id(1)  # value head
    if (flags & _K_LAYERS) != 0:
        # program (b * n_layers + layer): the layer's q/k/v, g, beta and state tensors are
        # layer 0's moved by the table's element offsets
        n_layers = tl.load(layers_ptr)
        layer = b % n_layers
        b = b // n_layers
        row = layers_ptr + _TABLE_HEAD + layer * _TABLE_ROW
        off_y = _table_offset(row, 0, q_ptr)
        q_ptr += off_y
        k_ptr += off_y
        v_ptr += off_y
        g_ptr += _table_offset(row, 1, g_ptr)
        beta_ptr += _table_offset(row, 2, beta_ptr)
        state_ptr += _table_offset(row, 3, state_ptr)
    varlen = (flags & _K_VARLEN) != 0
    store_out = (flags & _K_STORE_OUT) != 0
    write_final = (flags & _K_WRITE_FINAL) != 0
    replay = (flags & _K_REPLAY) != 0
    save_gates = (flags & _K_SAVE_GATES) != 0
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    if varlen:
        start = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
        b_off = b.to(tl.int64) * 0
    else:
        start = b.to(tl.int64) * 0
        length = seq_len.to(tl.int64)
        b_off = b.to(tl.int64)
    if replay:
        # the lane keeps the state after token ``accepted`` (skipped outside [0, T))
        accepted = tl.load(acc_ptr + b).to(tl.int64)
        live = live & (accepted >= 0) & (accepted < length)
        length = tl.where(live, accepted + 1, 0)
    has = live
    if (flags & _K_HAS_INIT) != 0:
        has = has & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)

    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = offs_v < DV
    # scalar predicates as integer bounds (see _conv_kernel)
    m_has = (offs_k < tl.where(has, DK, 0))[:, None] & vmask[None, :]
    m_live = (offs_k < tl.where(live, DK, 0))[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * s_sn + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    state = tl.load(s_ptrs, mask=m_has, other=0.0).to(ACC)

    h64 = h.to(tl.int64)
    hk64 = (h // GROUP).to(tl.int64)  # its key head
    q_row = q_ptr + b_off * q_sb + start * q_st + hk64 * q_sh
    k_row = k_ptr + b_off * k_sb + start * k_st + hk64 * k_sh
    v_row = v_ptr + b_off * v_sb + start * v_st + h64 * v_sh
    g_row = g_ptr + b_off * g_sb + start * g_st + h64 * g_sh
    b_row = beta_ptr + b_off * b_sb + start * b_st + h64 * b_sh
    o_row = o_ptr + b_off * o_sb + start * o_st + h64 * o_sh
    c_base = scratch_ptr + b.to(tl.int64) * c_sb + h64 * c_sh
    c_offs = offs_k[:, None] * c_sk + offs_v[None, :] * c_sv
    # the record's gates (RULE_SAVE_GATES): by the first V block of each head
    r_off = b.to(tl.int64) * r_sb + h64
    r_ok = live & save_gates & (tl.program_id(2) == 0)

    # software prefetch: token t + 1 is loaded while token t is computed
    nq, nk, nv, ng, nb = _load_token(
        q_row, k_row, v_row, g_row, b_row, offs_k, offs_v, q_sd, k_sd, v_sd,
        live & (length > 0), DK, DV, ACC,
    )  # fmt: skip
    for t in range(0, length):
        q, k, v, g, beta = nq, nk, nv, ng, nb
        nxt = t + 1
        nq, nk, nv, ng, nb = _load_token(
            q_row + nxt * q_st, k_row + nxt * k_st, v_row + nxt * v_st, g_row + nxt * g_st,
            b_row + nxt * b_st, offs_k, offs_v, q_sd, k_sd, v_sd,
            live & (nxt < length), DK, DV, ACC,
        )  # fmt: skip
        if PREP:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        tl.store(rg_ptr + r_off + t * r_st, g.to(rg_ptr.dtype.element_ty), mask=r_ok)
        tl.store(rb_ptr + r_off + t * r_st, beta.to(rb_ptr.dtype.element_ty), mask=r_ok)
        state = _delta_step(state, k, v, g, beta)
        if store_out:
            o = tl.sum(state * (q * scale)[:, None], axis=0)
            tl.store(o_row + t * o_st + offs_v * o_sd, o.to(o_ptr.dtype.element_ty), mask=vmask)
        if STORE_STATES:
            tl.store(
                c_base + t * c_st + c_offs,
                state.to(scratch_ptr.dtype.element_ty),
                mask=m_live,
            )
    if write_final:
        tl.debug_barrier()  # every thread's read of the slot before any write
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=m_live)


# ---------------------------------------------------------------------------------------------
# host-side checks (metadata only, no device read)
# ---------------------------------------------------------------------------------------------


def _check_slots(slots: torch.Tensor, device: torch.device) -> int:
    if slots.device != device:
        raise ValueError(f"slots on {slots.device}, the states on {device}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be 1-D int32/int64, got {slots.dtype} {tuple(slots.shape)}")
    return slots.shape[0]


def _check_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, the states on {device}")


def _check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {tuple(shape)}, got {tuple(t.shape)}")


def _init_flags(
    has_initial_state: torch.Tensor | None, bs: int, device: torch.device
) -> torch.Tensor | None:
    """``has_initial_state`` as uint8 (bool and integer tensors accepted; a view for
    bool/uint8, a comparison for other dtypes: the rule kernel takes one pointer dtype)."""
    if has_initial_state is None:
        return None
    _check_device(device, has_initial_state=has_initial_state)
    _check_shape("has_initial_state", has_initial_state, (bs,))
    if has_initial_state.dtype == torch.bool:
        return has_initial_state.view(torch.uint8)
    if has_initial_state.dtype != torch.uint8:
        return (has_initial_state != 0).view(torch.uint8)
    return has_initial_state


def _max_len(bounds: Sequence[int]) -> int:
    return max((bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)), default=0)


def _cu_seqlens(
    cu_seqlens: torch.Tensor | Sequence[int],
    bs: int,
    device: torch.device,
    max_seqlen: int | None,
) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens on device, max_seqlen)``; a host list is copied to the device, a device
    tensor is read on the host only when ``max_seqlen`` is not given."""
    if isinstance(cu_seqlens, torch.Tensor):
        _check_device(device, cu_seqlens=cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be 1-D int32/int64, got {cu_seqlens.dtype}")
        cu = cu_seqlens
        if max_seqlen is None:
            max_seqlen = _max_len(cu.tolist())
    else:
        bounds = list(cu_seqlens)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        if max_seqlen is None:
            max_seqlen = _max_len(bounds)
    if cu.shape[0] != bs + 1:
        raise ValueError(f"cu_seqlens must have bs + 1 = {bs + 1} entries, got {cu.shape[0]}")
    return cu, int(max_seqlen)


def _conv_blocks(
    max_len: int,
    dim: int,
    kw: int,
    block_d: int | None,
    block_t: int | None,
    num_warps: int | None = None,
) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_D, token blocks, warps)``; ``None`` picks the default: a
    ``_CONV_SHORT_TILE`` for segments of 2 .. ``_CONV_SHORT_MAX_T`` tokens (verify), else
    ``_CONV_TILE`` elements of at most 512 channels in ``_CONV_WARPS`` warps. Several token
    blocks only with ``BLOCK_T >= K-1`` (later blocks must never need the conv state)."""
    cap = _CONV_MAX_BLOCK_T if block_t is None else block_t
    if cap <= 0 or cap & (cap - 1):
        raise ValueError(f"block_t must be a power of two, got {cap}")
    block_t = min(next_pow2(max_len), cap)
    n_t = max(1, triton.cdiv(max_len, block_t))
    if n_t > 1 and block_t < kw - 1:
        raise ValueError(f"conv kernel width {kw} too large for {block_t}-token blocks")
    short = 1 < block_t <= _CONV_SHORT_MAX_T and n_t == 1
    if block_d is None:
        if short:
            block_d = max(16, min(_CONV_SHORT_TILE[0], next_pow2(dim)))
        else:
            block_d = max(16, min(512, _CONV_TILE // block_t, next_pow2(dim)))
    if num_warps is None:
        num_warps = _CONV_SHORT_TILE[1] if short else _CONV_WARPS
    if n_t > _MAX_GRID_YZ or triton.cdiv(dim, block_d) > _MAX_GRID_YZ:
        raise ValueError(f"conv grid too large: {n_t} token blocks, dim {dim}")
    return block_t, block_d, n_t, num_warps


_STEP_TILE = (32, 1)  # (BV, warps) of decode, verify and the replay commit
_EXTEND_BV = 8
_BATCH_INVARIANT_TILE = (64, 4)


def _rule_config(
    h: int, dk: int, dv: int, block_v: int | None, num_warps: int | None, kind: str
) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)``: the whole key dim in one tile. ``kind``: ``"step"`` (decode,
    verify and the replay commit: one tile, hence one compiled kernel, so that a token's
    state is bitwise the same whichever of them computes it — the acceptance control and a
    greedy speculative run equal to the plain one depend on it), ``"extend"`` or
    ``"batch_invariant"``. Defaults, measured on an H200 at the ``small`` sizes (H 16, Dk =
    Dv = 128; ``bench_gdn.py --sweep``, ``bench_gdn_commit.py --tiles``, docs/benchmarks.md):

    - step: ``BV = 32`` in one warp (every reduction over ``Dk`` within a warp): verify +
      replay commit of 8 layers at 48 x 8 tokens 1006 us against 1262 us in the ``BV = 64``
      4-warp tile. (When the verify and the replay were separately compiled variants, this
      tile made them round differently; they are one kernel now: ``_rule_kernel``'s runtime
      flags.)
    - extend (long sequences, few requests: bound by the token loop's latency): small V
      blocks in one warp, ``BV = 8`` (as in fla's recurrent kernel), which keeps more
      programs in flight;
    - batch-invariant: ``BV = 64`` in 4 warps for every kind, extend included, so that a
      prefill's state equals a decode's bitwise (``test_gdn_batch_invariant.py``): one
      compiled kernel for every step kind.
    """
    if kind not in ("step", "extend", "batch_invariant"):
        raise ValueError(f"kind must be step, extend or batch_invariant, got {kind!r}")
    bk = next_pow2(dk)
    default_bv, default_warps = {
        "step": _STEP_TILE,
        "extend": (_EXTEND_BV, None),
        "batch_invariant": _BATCH_INVARIANT_TILE,
    }[kind]
    bv = min(next_pow2(dv), default_bv) if block_v is None else block_v
    if bv <= 0 or bv & (bv - 1):
        raise ValueError(f"block_v must be a power of two, got {bv}")
    if num_warps is None:
        if default_warps is not None and block_v is None:
            num_warps = default_warps
        elif kind == "extend":
            num_warps = max(1, min(8, bk * bv // 1024))
        else:
            num_warps = max(1, min(4, bk * bv // 2048))
    if h > _MAX_GRID_YZ or triton.cdiv(dv, bv) > _MAX_GRID_YZ:
        raise ValueError(f"delta rule grid too large: H={h}, Dv={dv}, block_v={bv}")
    return bk, bv, num_warps


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _launch_conv(
    x: torch.Tensor,
    x_strides: tuple[int, int, int],  # (batch, token, channel)
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    y: torch.Tensor,
    y_strides: tuple[int, int, int],
    *,
    seq_len: int,
    max_len: int,
    cu: torch.Tensor | None,
    init: torch.Tensor | None,
    scratch: torch.Tensor | None,
    write_final: bool,
    block_d: int | None = None,
    block_t: int | None = None,
    record_x: torch.Tensor | None = None,
    num_warps: int | None = None,
    silu: bool = False,
) -> None:
    """One ``_conv_kernel`` launch. ``scratch [bs, T, D, K-1]``: the window after every token
    (verify); ``record_x [bs, T, D]`` (row-contiguous): the input rows (verify with a
    record); ``silu``: SiLU on the output before its rounding (the mixer's conv).
    ``block_d`` / ``block_t`` / ``num_warps`` override the tile (``_conv_blocks``; per-element
    arithmetic: no result depends on them; ``benchmark/bench_gdn_conv.py`` sweeps them)."""
    bs = slots.shape[0]
    dim, kw = weight.shape
    if bs == 0 or dim == 0:
        return
    block_t, block_d, n_t, num_warps = _conv_blocks(max_len, dim, kw, block_d, block_t, num_warps)
    grid = (bs, n_t, triton.cdiv(dim, block_d))
    _conv_kernel[grid](
        x, weight, conv_state, slots,
        slots if cu is None else cu,
        slots if init is None else init,
        y,
        y if scratch is None else scratch,
        y if record_x is None else record_x,
        seq_len, dim,
        *x_strides, *weight.stride(), *conv_state.stride(), *y_strides,
        *_strides(scratch, 4), *_strides(record_x, 3)[:2],
        KW=kw,
        KP=next_pow2(max(kw - 1, 1)),
        ACC=_acc(x.dtype),
        VARLEN=cu is not None,
        HAS_INIT=init is not None,
        STORE_STATES=scratch is not None,
        STORE_X=record_x is not None,
        WRITE_FINAL=write_final,
        SILU=silu,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip


def _check_conv(x_dim: int, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    if weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"need weight [D, K] and conv_state [N, D, K-1], got {tuple(weight.shape)} and "
            f"{tuple(conv_state.shape)}"
        )
    dim, kw = weight.shape
    if kw < 2 or tuple(conv_state.shape[1:]) != (dim, kw - 1) or x_dim != dim:
        raise ValueError(
            f"conv shapes disagree: x has {x_dim} channels, weight {tuple(weight.shape)}, "
            f"conv_state {tuple(conv_state.shape)}"
        )
    _check_device(conv_state.device, weight=weight)


def causal_conv1d_extend_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    has_initial_state: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    block_d: int | None = None,
    block_t: int | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton launcher of ``causal_conv1d_extend`` (one launch): ``x [T, D]`` ragged by
    ``cu_seqlens``; reads the initial and writes the final conv state of each request in its
    slot, in place. Returns ``out [T, D]`` (``x``'s dtype). ``activation``: None or
    ``"silu"``. ``block_d``/``block_t`` (powers of two) override the tile; tests lower
    ``block_t`` to split requests over token blocks."""
    silu = gdn_reference.check_activation(activation)
    _check_conv(x.shape[-1], weight, conv_state)
    bs = _check_slots(slots, conv_state.device)
    _check_device(conv_state.device, x=x, out=out)
    cu, max_len = _cu_seqlens(cu_seqlens, bs, conv_state.device, max_seqlen)
    init = _init_flags(has_initial_state, bs, conv_state.device)
    y = torch.empty_like(x) if out is None else out
    _check_shape("out", y, x.shape)
    _launch_conv(
        x, (0, *x.stride()), weight, conv_state, slots, y, (0, *y.stride()),
        seq_len=0, max_len=max_len, cu=cu, init=init, scratch=None, write_final=True,
        block_d=block_d, block_t=block_t, silu=silu,
    )  # fmt: skip
    return y


def causal_conv1d_decode_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton launcher of ``causal_conv1d_decode``: ``x [bs, D]`` -> ``out [bs, D]``; each live
    lane's slot state is updated in place. ``activation``: None or ``"silu"``."""
    silu = gdn_reference.check_activation(activation)
    _check_conv(x.shape[-1], weight, conv_state)
    bs = _check_slots(slots, conv_state.device)
    _check_device(conv_state.device, x=x, out=out)
    _check_shape("x", x, (bs, weight.shape[0]))
    y = torch.empty_like(x) if out is None else out
    _check_shape("out", y, x.shape)
    _launch_conv(
        x, (x.stride(0), 0, x.stride(1)), weight, conv_state, slots, y,
        (y.stride(0), 0, y.stride(1)), seq_len=1, max_len=1, cu=None, init=None, scratch=None,
        write_final=True, block_d=block_d, silu=silu,
    )  # fmt: skip
    return y


def causal_conv1d_verify_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    state_scratch: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton launcher of ``causal_conv1d_verify``: ``x [bs, T, D]`` -> ``out [bs, T, D]``;
    ``state_scratch [bs, T, D, K-1]`` receives the conv state after every token; slots are
    only read. ``activation``: None or ``"silu"``."""
    silu = gdn_reference.check_activation(activation)
    _check_conv(x.shape[-1], weight, conv_state)
    bs = _check_slots(slots, conv_state.device)
    _check_device(conv_state.device, x=x, out=out, state_scratch=state_scratch)
    if x.dim() != 3 or x.shape[0] != bs:
        raise ValueError(f"x must be [bs={bs}, T, D], got {tuple(x.shape)}")
    t = x.shape[1]
    _check_shape("state_scratch", state_scratch, (bs, t, *conv_state.shape[1:]))
    y = torch.empty_like(x) if out is None else out
    _check_shape("out", y, x.shape)
    _launch_conv(
        x, tuple(x.stride()), weight, conv_state, slots, y, tuple(y.stride()), seq_len=t,
        max_len=t, cu=None, init=None, scratch=state_scratch, write_final=False,
        block_d=block_d, silu=silu,
    )  # fmt: skip
    return y


def _launch_rule(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qkv_strides: tuple[tuple[int, ...], ...],  # per tensor (batch, token, head, dim)
    gb: tuple[torch.Tensor, torch.Tensor],
    gb_strides: tuple[tuple[int, ...], ...],  # per tensor (batch, token, head)
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    *,
    seq_len: int,
    cu: torch.Tensor | None,
    init: torch.Tensor | None,
    scratch: torch.Tensor | None,
    write_final: bool,
    prep: bool,
    scale: float | None,
    block_v: int | None,
    num_warps: int | None,
    record_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    accepted: torch.Tensor | None = None,
    kind: str | None = None,
    layers: tuple[torch.Tensor, int] | None = None,
) -> None:
    """One ``_rule_kernel`` launch. ``layers`` (``(table, n_layers)`` of a
    :class:`ReplayCommitPlan`): ``n_layers`` layers' lanes in one launch, the tensors passed
    being layer 0's. ``record_gates`` (``g, beta [bs, T, H]``, a verify with a
    record): every token's gates are stored there. ``accepted [bs]`` (the replay commit):
    each lane runs tokens ``0 .. accepted`` without storing outputs and writes its final
    state (``write_final``). ``kind``: the tile configuration's step kind (default: from the
    call: extend with ``cu``, else step)."""
    bs = slots.shape[0]
    _, h, dk, dv = ssm_state.shape
    if bs == 0 or h == 0 or dv == 0:
        return
    if kind is None:
        kind = "extend" if cu is not None else "step"
    bk, bv, warps = _rule_config(h, dk, dv, block_v, num_warps, kind)
    q, k, v = qkv
    g, beta = gb
    group = gdn_reference.check_heads(h, k.shape[-2])
    flags = (
        (RULE_VARLEN if cu is not None else 0)
        | (RULE_HAS_INIT if init is not None else 0)
        | (RULE_WRITE_FINAL if write_final else 0)
        | (RULE_REPLAY if accepted is not None else RULE_STORE_OUT)
        | (RULE_SAVE_GATES if record_gates is not None else 0)
        | (RULE_LAYERS if layers is not None else 0)
    )
    table, n_layers = (slots.view(torch.int32), 1) if layers is None else layers
    rg, rb = (g, beta) if record_gates is None else record_gates
    r_strides = (0, 0) if record_gates is None else tuple(rg.stride()[:2])
    # index pointers in one dtype whatever the step kind (placeholders are reinterpreting
    # views, never read), so that the kinds share one signature, hence one binary
    cu32 = _as_int32(cu) if cu is not None else slots.view(torch.int32)
    init8 = init if init is not None else slots.view(torch.uint8)
    acc32 = _as_int32(accepted) if accepted is not None else slots.view(torch.int32)
    _rule_kernel[(bs * n_layers, h, triton.cdiv(dv, bv))](
        q, k, v, g, beta, out, ssm_state, slots, cu32, init8,
        ssm_state if scratch is None else scratch,
        acc32, rg, rb, table, flags, seq_len,
        dk**-0.5 if scale is None else scale,
        L2NORM_EPS,
        *qkv_strides[0], *qkv_strides[1], *qkv_strides[2], *gb_strides[0], *gb_strides[1],
        *out_strides, *ssm_state.stride(), *_strides(scratch, 5), *r_strides,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        ACC=_acc(ssm_state.dtype),
        STORE_STATES=scratch is not None,
        PREP=prep,
        GROUP=group,
        num_warps=warps,
    )  # fmt: skip


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int32 (a copy only for other dtypes: the engine's index tensors are int32)."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _check_rule(q, k, v, g, beta, ssm_state: torch.Tensor, lead: tuple[int, ...]) -> None:
    """``q, k [*lead, Hk, Dk]`` (``Hk`` dividing ``H``), ``v [*lead, H, Dv]``,
    ``g, beta [*lead, H]``."""
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be [N, H, Dk, Dv], got {tuple(ssm_state.shape)}")
    _, h, dk, dv = ssm_state.shape
    hk = q.shape[-2] if q.dim() == len(lead) + 2 else h
    gdn_reference.check_heads(h, hk)
    for name, t, shape in (
        ("q", q, (*lead, hk, dk)),
        ("k", k, (*lead, hk, dk)),
        ("v", v, (*lead, h, dv)),
        ("g", g, (*lead, h)),
        ("beta", beta, (*lead, h)),
    ):
        _check_shape(name, t, shape)
        _check_device(ssm_state.device, **{name: t})


def _bthd(t: torch.Tensor, fixed: bool) -> tuple[int, ...]:
    """(batch, token, head[, dim]) strides of a ``[bs, T, H(, D)]`` (fixed) or ``[T, H(, D)]``
    (ragged) or ``[bs, H(, D)]`` (decode: pass as fixed with a unit token dim) tensor."""
    s = tuple(t.stride())
    return s if fixed else (0, *s)


def gated_delta_rule_extend_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``gated_delta_rule_extend`` (recurrent form, one launch): ``q, k [T,
    Hk, Dk]``, ``v [T, H, Dv]``, ``g, beta [T, H]`` ragged by ``cu_seqlens``; initial state read
    from and final state written to each request's slot, in place. Returns ``o [T, H, Dv]``
    (``v``'s dtype). ``max_seqlen`` is accepted for symmetry with the conv (the rule's grid does
    not depend on it)."""
    del max_seqlen
    _check_rule(q, k, v, g, beta, ssm_state, (q.shape[0],))
    bs = _check_slots(slots, ssm_state.device)
    cu, _ = _cu_seqlens(cu_seqlens, bs, ssm_state.device, 0)
    init = _init_flags(has_initial_state, bs, ssm_state.device)
    o = torch.empty_like(v) if out is None else out
    _check_shape("out", o, v.shape)
    _launch_rule(
        (q, k, v), tuple(_bthd(t, False) for t in (q, k, v)), (g, beta),
        tuple(_bthd(t, False) for t in (g, beta)), o, _bthd(o, False), ssm_state, slots,
        seq_len=0, cu=cu, init=init, scratch=None, write_final=True, prep=False, scale=scale,
        block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def _decode_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``[bs, H(, D)]`` as ``[bs, 1, H(, D)]``."""
    return (t.stride(0), 0, *t.stride()[1:])


def gated_delta_rule_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``gated_delta_rule_decode``: one token per lane (``q, k [bs, Hk,
    Dk]``, ``v [bs, H, Dv]``, ``g, beta [bs, H]``); slot states updated in place. Returns ``o
    [bs, H, Dv]``. With ``out`` given: no allocation, no host read."""
    bs = _check_slots(slots, ssm_state.device)
    _check_rule(q, k, v, g, beta, ssm_state, (bs,))
    o = torch.empty_like(v) if out is None else out
    _check_shape("out", o, v.shape)
    _launch_rule(
        (q, k, v), tuple(_decode_strides(t) for t in (q, k, v)), (g, beta),
        tuple(_decode_strides(t) for t in (g, beta)), o, _decode_strides(o), ssm_state, slots,
        seq_len=1, cu=None, init=None, scratch=None, write_final=True, prep=False, scale=scale,
        block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def gated_delta_rule_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    state_scratch: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``gated_delta_rule_verify``: ``T`` tokens per lane (``q, k [bs, T, Hk,
    Dk]``, ``v [bs, T, H, Dv]``, ``g, beta [bs, T, H]``); ``state_scratch [bs, T, H, Dk, Dv]``
    receives the state after every token; slots only read. Returns ``o [bs, T, H, Dv]``."""
    bs = _check_slots(slots, ssm_state.device)
    t = q.shape[1] if q.dim() == 4 else 0
    _check_rule(q, k, v, g, beta, ssm_state, (bs, t))
    _check_device(ssm_state.device, state_scratch=state_scratch)
    _check_shape("state_scratch", state_scratch, (bs, t, *ssm_state.shape[1:]))
    o = torch.empty_like(v) if out is None else out
    _check_shape("out", o, v.shape)
    _launch_rule(
        (q, k, v), tuple(_bthd(x, True) for x in (q, k, v)), (g, beta),
        tuple(_bthd(x, True) for x in (g, beta)), o, _bthd(o, True), ssm_state, slots,
        seq_len=t, cu=None, init=None, scratch=state_scratch, write_final=False, prep=False,
        scale=scale, block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def gdn_forward_triton(
    mode: str,
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    conv_scratch: torch.Tensor | None = None,
    ssm_scratch: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    num_k_heads: int | None = None,
    out: torch.Tensor | None = None,
    conv_out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    batch_invariant: bool = False,
    record: gdn_reference.VerifyRecord | None = None,
    chunked_prefill: bool = False,
) -> torch.Tensor:
    """Triton launcher of ``gdn_forward``: two launches (conv + SiLU; L2 norm + delta rule).

    Arguments as ``gdn_reference.gdn_forward`` (the extend kernel is the recurrent form: no
    chunk size). ``num_k_heads`` (``Hk``, default ``H``) must divide ``H``; ``mixed_qkv``
    channels are ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]`` and q, k are read per key head from the
    conv output, never expanded. ``conv_out [T, conv_dim]`` (``mixed_qkv``'s dtype) holds the
    conv output between the two kernels and ``out [T, H, Dv]`` receives the result; with both
    given, decode and verify allocate nothing and read nothing on the host (the CUDA-graph
    path). ``batch_invariant``: the delta rule runs one tile configuration
    (``_rule_config(kind="batch_invariant")``) for extend, decode and verify, so that a
    token's output and state are bitwise the same whichever step kind computes it (its
    reductions over ``Dk`` follow the tile layout); it refuses an explicit ``block_v`` /
    ``num_warps``. Verify with a ``record`` (``gdn_reference.VerifyRecord``) instead of the
    scratches: the conv stores the input rows into ``record.x``, its output is ``record.y``
    (``conv_out`` must then be None) and the rule stores the gates into ``record.g`` /
    ``record.beta``; no state is stored; commit with ``gdn_replay_commit`` (same
    ``block_v`` / ``num_warps``, or the same ``batch_invariant``). Returns ``out``.
    ``chunked_prefill`` (extend only; refused with ``batch_invariant``): the delta rule runs
    the chunked (WY) kernel of ``gdn_chunked`` instead of the recurrent one (other rounding).
    """
    if chunked_prefill and batch_invariant:
        raise ValueError("gdn_forward: chunked_prefill is not batch-invariant")
    if batch_invariant:
        if block_v is not None or num_warps is not None:
            raise ValueError("gdn_forward: batch_invariant fixes block_v and num_warps")
        if ssm_state.dim() == 4:
            _, h4, dk4, dv4 = ssm_state.shape
            _, block_v, num_warps = _rule_config(h4, dk4, dv4, None, None, "batch_invariant")
    if ssm_state.dim() != 4 or mixed_qkv.dim() != 2:
        raise ValueError(
            f"need ssm_state [N, H, Dk, Dv] and mixed_qkv [T, conv_dim], got "
            f"{tuple(ssm_state.shape)} and {tuple(mixed_qkv.shape)}"
        )
    _, h, dk, dv = ssm_state.shape
    n, conv_dim = mixed_qkv.shape
    nk = gdn_reference.check_conv_dim(conv_dim, h, dk, dv, num_k_heads)
    _check_conv(conv_dim, conv_weight, conv_state)
    bs = _check_slots(slots, ssm_state.device)
    _check_device(ssm_state.device, mixed_qkv=mixed_qkv, g=g, beta=beta, out=out)
    _check_device(ssm_state.device, conv_out=conv_out, conv_state=conv_state)
    _check_shape("g", g, (n, h))
    _check_shape("beta", beta, (n, h))
    if record is not None and mode != "verify":
        raise ValueError(f"gdn_forward: a record is for verify, not {mode}")
    tv_verify = None
    if mode == "verify":
        tv_verify = gdn_reference.verify_width(bs, mixed_qkv, conv_scratch, ssm_scratch, record)
    if record is not None:
        if conv_out is not None:
            raise ValueError("gdn_forward: with a record the conv output is record.y")
        record.check(bs, tv_verify, conv_state, ssm_state, mixed_qkv.dtype)
        conv_out = record.y.view(n, conv_dim)
    # the gates in the rule's dtype in every step kind (the record's, so that the replay's
    # kernel is the verify's); a no-op for the models, whose gates come in that dtype
    rdt = gdn_reference.rule_dtype(ssm_state.dtype)
    g, beta = g.to(rdt), beta.to(rdt)
    y = torch.empty_like(mixed_qkv) if conv_out is None else conv_out
    _check_shape("conv_out", y, mixed_qkv.shape)
    if y.dtype != mixed_qkv.dtype:
        raise ValueError(f"conv_out dtype {y.dtype} != mixed_qkv dtype {mixed_qkv.dtype}")
    o = mixed_qkv.new_empty(n, h, dv) if out is None else out
    _check_shape("out", o, (n, h, dv))

    cu = init = None
    write_final = True
    if mode == "extend":
        if cu_seqlens is None:
            raise ValueError("gdn_forward: extend needs cu_seqlens")
        cu, max_len = _cu_seqlens(cu_seqlens, bs, ssm_state.device, max_seqlen)
        init = _init_flags(has_initial_state, bs, ssm_state.device)
        tv = 0
    elif mode == "decode":
        if n != bs:
            raise ValueError(f"gdn_forward: decode needs T == bs, got {n}, {bs}")
        tv = max_len = 1
    elif mode == "verify":
        tv = tv_verify
        if record is None:
            _check_shape("conv_scratch", conv_scratch, (bs, tv, *conv_state.shape[1:]))
            _check_shape("ssm_scratch", ssm_scratch, (bs, tv, *ssm_state.shape[1:]))
            _check_device(ssm_state.device, conv_scratch=conv_scratch, ssm_scratch=ssm_scratch)
        max_len = tv
        write_final = False
    else:
        raise ValueError(f"gdn_forward: mode must be extend, decode or verify, got {mode!r}")

    # rows: ragged (extend) or request-major with tv rows per request (decode: tv = 1)
    xs, ys = mixed_qkv.stride(0), y.stride(0)
    _launch_conv(
        mixed_qkv, (xs * tv, xs, mixed_qkv.stride(1)), conv_weight, conv_state, slots, y,
        (ys * tv, ys, y.stride(1)), seq_len=tv, max_len=max_len, cu=cu, init=init,
        scratch=conv_scratch if mode == "verify" else None, write_final=write_final,
        block_d=None, record_x=None if record is None else record.x, silu=True,
    )  # fmt: skip

    if mode == "extend" and chunked_prefill:
        from unimem_kernel.gdn_chunked import gated_delta_rule_extend_chunked_triton

        q, k, v = _split_conv_out(y, h, dk, dv, nk)
        return gated_delta_rule_extend_chunked_triton(
            q, k, v, g, beta, ssm_state, slots, cu, init, None, nk, out=o, prep=True
        )  # fmt: skip

    _mixer_rule(
        y, g, beta, o, _row_strides(o, tv, cu is None), ssm_state, slots, nk, tv=tv, cu=cu,
        init=init, scratch=ssm_scratch if mode == "verify" else None, write_final=write_final,
        block_v=block_v, num_warps=num_warps,
        record_gates=None if record is None else (record.g, record.beta),
    )  # fmt: skip
    return o


def _split_conv_out(
    y: torch.Tensor, h: int, dk: int, dv: int, nk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q, k [T, Hk, Dk]`` and ``v [T, H, Dv]`` of a conv output ``y [T, conv_dim]``."""
    kd = nk * dk
    return (
        y[:, :kd].unflatten(1, (nk, dk)),
        y[:, kd : 2 * kd].unflatten(1, (nk, dk)),
        y[:, 2 * kd :].unflatten(1, (h, dv)),
    )


def _row_strides(t: torch.Tensor, tv: int, fixed: bool) -> tuple[int, ...]:
    """(batch, token, ...) strides of a row tensor ``[T, ...]``: request-major with ``tv``
    rows a lane (fixed) or ragged (batch stride 0)."""
    s = tuple(t.stride())
    return (s[0] * tv, *s) if fixed else (0, *s)


def _mixer_rule(
    y: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    nk: int,
    *,
    tv: int,
    cu: torch.Tensor | None,
    init: torch.Tensor | None,
    scratch: torch.Tensor | None,
    write_final: bool,
    block_v: int | None,
    num_warps: int | None,
    record_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    accepted: torch.Tensor | None = None,
    layers: tuple[torch.Tensor, int] | None = None,
) -> None:
    """The mixer's delta rule over a conv output ``y [T, conv_dim]`` (SiLU applied) and gates
    ``g, beta [T, H]`` (the L2 norm of q, k inside): the one call site of the verify, decode,
    extend and the replay commit, so that they pass the kernel the same kinds of arguments."""
    _, h, dk, dv = ssm_state.shape
    q, k, v = _split_conv_out(y, h, dk, dv, nk)
    fixed = cu is None
    _launch_rule(
        (q, k, v), tuple(_row_strides(t, tv, fixed) for t in (q, k, v)), (g, beta),
        tuple(_row_strides(t, tv, fixed) for t in (g, beta)), out, out_strides, ssm_state,
        slots, seq_len=tv, cu=cu, init=init, scratch=scratch, write_final=write_final,
        prep=True, scale=None, block_v=block_v, num_warps=num_warps,
        record_gates=record_gates, accepted=accepted, layers=layers,
    )  # fmt: skip


_CONV_COMMIT_BLOCK_D = 256


def gdn_replay_commit_triton(
    record: gdn_reference.VerifyRecord,
    accepted: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Triton launcher of ``gdn_replay_commit`` (two launches, no allocation, no host read,
    fixed grids): ``_conv_commit_kernel`` rebuilds each live lane's conv window after token
    ``accepted[b]`` from its slot and ``record.x``; ``_rule_kernel`` — the verify's kernel,
    with the replay flag — runs tokens ``0 .. accepted[b]`` of ``record.y`` / ``record.g``
    / ``record.beta`` from the lane's slot and overwrites the slot's state. Lanes with
    ``slots[b] < 0`` or ``accepted[b]`` outside ``[0, T)`` are skipped. Pass the verify's
    ``block_v`` / ``num_warps`` if it had any: the same tile, the same compiled kernel, and
    the committed state is bitwise the verify's state after that token."""
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be [N, H, Dk, Dv], got {tuple(ssm_state.shape)}")
    _, h, dk, dv = ssm_state.shape
    conv_dim = conv_state.shape[1] if conv_state.dim() == 3 else -1
    nk = gdn_reference.check_conv_dim(conv_dim, h, dk, dv, num_k_heads)
    bs = _check_slots(slots, ssm_state.device)
    tv = record.lanes_and_positions[1]
    record.check(bs, tv, conv_state, ssm_state)
    _check_device(ssm_state.device, accepted=accepted, conv_state=conv_state)
    _check_shape("accepted", accepted, (bs,))
    if accepted.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"accepted must be int32/int64, got {accepted.dtype}")
    if bs == 0 or tv == 0:
        return
    _launch_replay(record, accepted, conv_state, ssm_state, slots, nk, block_v, num_warps)


def _launch_replay(
    record: gdn_reference.VerifyRecord,
    accepted: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    nk: int,
    block_v: int | None,
    num_warps: int | None,
    layers: tuple[torch.Tensor, int] | None = None,
) -> None:
    """The replay commit's two launches (arguments checked by the caller); with ``layers``
    (``(table, n_layers)``) for ``n_layers`` layers at once, the tensors being layer 0's."""
    bs, tv = record.lanes_and_positions
    _, h, dk, dv = ssm_state.shape
    conv_dim = conv_state.shape[1]
    kw = conv_state.shape[2] + 1
    block_d = min(_CONV_COMMIT_BLOCK_D, next_pow2(conv_dim))
    table, n_layers = (slots.view(torch.int32), 1) if layers is None else layers
    _conv_commit_kernel[(bs * n_layers, triton.cdiv(conv_dim, block_d))](
        record.x, conv_state, slots, accepted, table, int(layers is not None), tv, conv_dim,
        *record.x.stride()[:2], *conv_state.stride(), KW=kw, KP=next_pow2(max(kw - 1, 1)),
        BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    n = bs * tv
    y = record.y.view(n, conv_dim)
    # the verify's output strides (a contiguous [T, H, Dv]); nothing is stored through them
    o_strides = (tv * h * dv, h * dv, dv, 1)
    _mixer_rule(
        y, record.g.view(n, h), record.beta.view(n, h), y, o_strides, ssm_state, slots, nk,
        tv=tv, cu=None, init=None, scratch=None, write_final=True, block_v=block_v,
        num_warps=num_warps, accepted=accepted, layers=layers,
    )  # fmt: skip


class ReplayCommitPlan:
    """The replay commits of several GDN layers of one model, two launches for all of them.

    ``records[i]``, ``conv_states[i]``, ``ssm_states[i]``: layer ``i``'s full-size
    :class:`~unimem_kernel.gdn_reference.VerifyRecord` (the runner's, for its largest batch)
    and its slot views. Built once, outside any CUDA-graph capture (it uploads a small int32
    table of each layer's offsets from layer 0's tensors, in 16-byte units; no device work
    per step). A step commits the first ``bs`` lanes of every layer with
    :func:`gdn_replay_commit_layers`, bitwise what one :func:`gdn_replay_commit` per layer
    commits (the same kernels, the same tile).

    ``stacked`` says whether one launch per kernel can serve the layers: every layer's
    tensors must have layer 0's shapes, dtypes, strides and device and sit a whole number of
    16-byte units from layer 0's (the kernels' alignment assumptions are layer 0's).
    Otherwise, and where the reference runs (off CUDA), the plan commits layer by layer."""

    def __init__(
        self,
        records: Sequence[gdn_reference.VerifyRecord],
        conv_states: Sequence[torch.Tensor],
        ssm_states: Sequence[torch.Tensor],
    ) -> None:
        if not (len(records) == len(conv_states) == len(ssm_states)) or not records:
            raise ValueError(
                f"ReplayCommitPlan needs one record, conv state and SSM state per layer, got "
                f"{len(records)}, {len(conv_states)}, {len(ssm_states)}"
            )
        self.records = list(records)
        self.conv_states = list(conv_states)
        self.ssm_states = list(ssm_states)
        self.n_layers = len(self.records)
        self.table: torch.Tensor | None = None
        rows = [self._offsets(i) for i in range(self.n_layers)]
        if all(r is not None for r in rows):
            flat = [self.n_layers, 0]
            for r in rows:
                for off in r:
                    flat += [off % 2**31, off // 2**31]
            self.table = torch.tensor(flat, dtype=torch.int32, device=self.ssm_states[0].device)

    @property
    def stacked(self) -> bool:
        return self.table is not None

    def _layer_tensors(self, i: int) -> tuple[torch.Tensor, ...]:
        rec = self.records[i]  # in TABLE_OFFSETS order
        return (rec.y, rec.g, rec.beta, self.ssm_states[i], rec.x, self.conv_states[i])

    def _offsets(self, i: int) -> list[int] | None:
        """Layer ``i``'s offsets from layer 0 in 16-byte units, or None if one launch cannot
        serve it."""
        out = []
        for t, t0 in zip(self._layer_tensors(i), self._layer_tensors(0), strict=True):
            same = (t.shape, t.stride(), t.dtype, t.device) == (
                t0.shape, t0.stride(), t0.dtype, t0.device
            )  # fmt: skip
            delta = t.data_ptr() - t0.data_ptr()
            if not same or delta % 16 or 16 % t.element_size():
                return None
            out.append(delta // 16)
        return out


def gdn_replay_commit_layers(
    plan: ReplayCommitPlan,
    accepted: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    batch_invariant: bool = False,
) -> None:
    """:func:`gdn_replay_commit` of the first ``bs = len(slots)`` lanes of every layer of
    ``plan``: on CUDA, when the plan is ``stacked``, one conv-window launch and one
    delta-rule launch for all layers (``n_layers x bs`` lanes each), else one commit per
    layer. The same results, bitwise, as one :func:`gdn_replay_commit` per layer; no
    allocation, no host read (capturable)."""
    bs = _check_slots(slots, plan.ssm_states[0].device)
    conv0, ssm0 = plan.conv_states[0], plan.ssm_states[0]
    if not (plan.stacked and use_triton(ssm0)):
        for rec, conv, ssm in zip(plan.records, plan.conv_states, plan.ssm_states, strict=True):
            gdn_replay_commit(rec.lanes(bs), accepted, conv, ssm, slots, num_k_heads,
                              batch_invariant=batch_invariant)  # fmt: skip
        return
    _, h, dk, dv = ssm0.shape
    nk = gdn_reference.check_conv_dim(conv0.shape[1], h, dk, dv, num_k_heads)
    record = plan.records[0].lanes(bs)
    tv = record.lanes_and_positions[1]
    record.check(bs, tv, conv0, ssm0)
    _check_device(ssm0.device, accepted=accepted)
    _check_shape("accepted", accepted, (bs,))
    if accepted.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"accepted must be int32/int64, got {accepted.dtype}")
    if bs == 0 or tv == 0:
        return
    bv = nw = None
    if batch_invariant:
        _, bv, nw = _rule_config(h, dk, dv, None, None, "batch_invariant")
    _launch_replay(record, accepted, conv0, ssm0, slots, nk, bv, nw, (plan.table, plan.n_layers))


# ---------------------------------------------------------------------------------------------
# torch references and public entry points
# ---------------------------------------------------------------------------------------------


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def causal_conv1d_extend(
    x, weight, conv_state, slots, cu_seqlens, has_initial_state=None, *, out=None,
    activation=None,
) -> torch.Tensor:  # fmt: skip
    """Triton on CUDA (see ``causal_conv1d_extend_triton``), else the reference."""
    if use_triton(conv_state):
        return causal_conv1d_extend_triton(
            x, weight, conv_state, slots, cu_seqlens, has_initial_state, out=out,
            activation=activation,
        )  # fmt: skip
    ref = gdn_reference.causal_conv1d_extend
    return _into(out, ref(x, weight, conv_state, slots, cu_seqlens, has_initial_state, activation))


def causal_conv1d_decode(
    x, weight, conv_state, slots, *, out=None, activation=None
) -> torch.Tensor:
    """Triton on CUDA (see ``causal_conv1d_decode_triton``), else the reference."""
    if use_triton(conv_state):
        return causal_conv1d_decode_triton(
            x, weight, conv_state, slots, out=out, activation=activation
        )
    ref = gdn_reference.causal_conv1d_decode
    return _into(out, ref(x, weight, conv_state, slots, activation))


def causal_conv1d_verify(
    x, weight, conv_state, slots, state_scratch, *, out=None, activation=None
) -> torch.Tensor:
    """Triton on CUDA (see ``causal_conv1d_verify_triton``), else the reference."""
    if use_triton(conv_state):
        return causal_conv1d_verify_triton(
            x, weight, conv_state, slots, state_scratch, out=out, activation=activation
        )
    ref = gdn_reference.causal_conv1d_verify
    return _into(out, ref(x, weight, conv_state, slots, state_scratch, activation))


def gated_delta_rule_extend(
    q, k, v, g, beta, ssm_state, slots, cu_seqlens, has_initial_state=None, scale=None, *, out=None
) -> torch.Tensor:
    """Triton on CUDA (recurrent form, see ``gated_delta_rule_extend_triton``), else the
    reference (chunked form)."""
    args = (q, k, v, g, beta, ssm_state, slots, cu_seqlens, has_initial_state, scale)
    if use_triton(ssm_state):
        return gated_delta_rule_extend_triton(*args, out=out)
    return _into(out, gdn_reference.gated_delta_rule_extend(*args))


def gated_delta_rule_decode(q, k, v, g, beta, ssm_state, slots, scale=None, *, out=None):
    """Triton on CUDA (see ``gated_delta_rule_decode_triton``), else the reference."""
    args = (q, k, v, g, beta, ssm_state, slots, scale)
    if use_triton(ssm_state):
        return gated_delta_rule_decode_triton(*args, out=out)
    return _into(out, gdn_reference.gated_delta_rule_decode(*args))


def gated_delta_rule_verify(
    q, k, v, g, beta, ssm_state, slots, state_scratch, scale=None, *, out=None
) -> torch.Tensor:
    """Triton on CUDA (see ``gated_delta_rule_verify_triton``), else the reference."""
    args = (q, k, v, g, beta, ssm_state, slots, state_scratch, scale)
    if use_triton(ssm_state):
        return gated_delta_rule_verify_triton(*args, out=out)
    return _into(out, gdn_reference.gated_delta_rule_verify(*args))


def gdn_forward(
    mode: str,
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    conv_scratch: torch.Tensor | None = None,
    ssm_scratch: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    num_k_heads: int | None = None,
    out: torch.Tensor | None = None,
    conv_out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    batch_invariant: bool = False,
    record: gdn_reference.VerifyRecord | None = None,
    chunked_prefill: bool = False,
) -> torch.Tensor:
    """The GDN mixer core, drop-in for ``gdn_reference.gdn_forward``: Triton on CUDA tensors
    (``gdn_forward_triton``; ``out``/``conv_out`` make decode and verify allocation-free; a
    device ``cu_seqlens`` with ``max_seqlen`` spares extend a host-to-device copy), the
    reference otherwise (``conv_out`` and ``max_seqlen`` unused there; its extend runs the
    chunked form at the default chunk size). ``num_k_heads``: the key heads ``Hk`` (default
    ``H``), as ``gdn_reference.gdn_forward``. ``batch_invariant``: one tile configuration
    for every step kind (``gdn_forward_triton``; the reference ignores it: its extend is the
    chunked form, exact to rounding in the float64 CPU runs it serves). ``chunked_prefill``:
    the Triton extend runs the chunked kernel (``gdn_forward_triton``; the reference's extend
    is chunked anyway)."""
    if use_triton(ssm_state):
        return gdn_forward_triton(
            mode, mixed_qkv, conv_weight, g, beta, conv_state, ssm_state, slots, cu_seqlens,
            conv_scratch=conv_scratch, ssm_scratch=ssm_scratch,
            has_initial_state=has_initial_state, num_k_heads=num_k_heads, out=out,
            conv_out=conv_out, max_seqlen=max_seqlen, batch_invariant=batch_invariant,
            record=record, chunked_prefill=chunked_prefill,
        )  # fmt: skip
    result = gdn_reference.gdn_forward(
        mode, mixed_qkv, conv_weight, g, beta, conv_state, ssm_state, slots, cu_seqlens,
        conv_scratch=conv_scratch, ssm_scratch=ssm_scratch,
        has_initial_state=has_initial_state, num_k_heads=num_k_heads, record=record,
    )  # fmt: skip
    return _into(out, result)


def gdn_replay_commit(
    record: gdn_reference.VerifyRecord,
    accepted: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    batch_invariant: bool = False,
) -> None:
    """Commit of a verify run with a ``record``: Triton on CUDA (see
    ``gdn_replay_commit_triton``), else the reference. Bitwise the states the same verify
    would have stored in its per-position scratches at entry ``accepted[b]`` (and
    ``state_commit.commit_states`` copied), each path against itself. ``batch_invariant``:
    the verify ran ``gdn_forward(batch_invariant=True)``, whose tiles the replay must use."""
    args = (record, accepted, conv_state, ssm_state, slots, num_k_heads)
    if use_triton(ssm_state):
        tiles = {}
        if batch_invariant:
            _, h, dk, dv = ssm_state.shape
            _, bv, nw = _rule_config(h, dk, dv, None, None, "batch_invariant")
            tiles = {"block_v": bv, "num_warps": nw}
        gdn_replay_commit_triton(*args, **tiles)
    else:
        gdn_reference.gdn_replay_commit(*args)
