"""Commit of a verify run with a record (``gdn_reference.VerifyRecord``): the replay of each
lane's accepted tokens from its slot, for one layer (``gdn_replay_commit``) or every GDN
layer of a model in one launch per kernel (:class:`ReplayCommitPlan`,
``gdn_replay_commit_layers``). Contract: :mod:`unimem_kernel.gdn`.

``_conv_commit_kernel`` (grid ``(bs, channel blocks)``) rebuilds each lane's conv window after
token ``accepted[b]`` from its slot and the record's input rows; the delta rule runs the
verify's own ``_rule_kernel`` with the replay flag, so the committed state is bitwise the
verify's state after that token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unimem_kernel import gdn_reference
from unimem_kernel._dispatch import kernel_op, next_pow2
from unimem_kernel.gdn_common import check_device, check_shape, check_slots, layer_row, table_offset
from unimem_kernel.gdn_rule import _mixer_rule, _rule_config


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
        row = layer_row(layers_ptr, layer)
        xr_ptr += table_offset(row, 4, xr_ptr)
        state_ptr += table_offset(row, 5, state_ptr)
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


_CONV_COMMIT_BLOCK_D = 256


def gdn_replay_commit_triton(
    record: gdn_reference.VerifyRecord,
    accepted: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    batch_invariant: bool = False,
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
    the committed state is bitwise the verify's state after that token; with
    ``batch_invariant`` (the verify ran ``gdn_forward(batch_invariant=True)``) the tiles are
    that mode's, and explicit ones are refused."""
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be [N, H, Dk, Dv], got {tuple(ssm_state.shape)}")
    _, h, dk, dv = ssm_state.shape
    conv_dim = conv_state.shape[1] if conv_state.dim() == 3 else -1
    nk = gdn_reference.check_conv_dim(conv_dim, h, dk, dv, num_k_heads)
    if batch_invariant:
        if block_v is not None or num_warps is not None:
            raise ValueError("gdn_replay_commit: batch_invariant fixes block_v and num_warps")
        _, block_v, num_warps = _rule_config(h, dk, dv, None, None, "batch_invariant")
    bs = check_slots(slots, ssm_state.device)
    tv = record.lanes_and_positions[1]
    record.check(bs, tv, conv_state, ssm_state)
    check_device(ssm_state.device, accepted=accepted, conv_state=conv_state)
    check_shape("accepted", accepted, (bs,))
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


def gdn_replay_commit_layers_triton(
    plan: ReplayCommitPlan,
    accepted: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    batch_invariant: bool = False,
) -> None:
    """Triton launcher of :func:`gdn_replay_commit_layers` for a ``stacked`` plan: one
    conv-window launch and one delta-rule launch for all layers (``n_layers x bs`` lanes
    each)."""
    if not plan.stacked:
        raise ValueError("gdn_replay_commit_layers_triton: the plan's layers are not stacked")
    bs = check_slots(slots, plan.ssm_states[0].device)
    conv0, ssm0 = plan.conv_states[0], plan.ssm_states[0]
    _, h, dk, dv = ssm0.shape
    nk = gdn_reference.check_conv_dim(conv0.shape[1], h, dk, dv, num_k_heads)
    record = plan.records[0].lanes(bs)
    tv = record.lanes_and_positions[1]
    record.check(bs, tv, conv0, ssm0)
    check_device(ssm0.device, accepted=accepted)
    check_shape("accepted", accepted, (bs,))
    if accepted.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"accepted must be int32/int64, got {accepted.dtype}")
    if bs == 0 or tv == 0:
        return
    bv = nw = None
    if batch_invariant:
        _, bv, nw = _rule_config(h, dk, dv, None, None, "batch_invariant")
    _launch_replay(record, accepted, conv0, ssm0, slots, nk, bv, nw, (plan.table, plan.n_layers))


def _replay_commit_layer_by_layer(
    plan: ReplayCommitPlan,
    accepted: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    batch_invariant: bool = False,
) -> None:
    """:func:`gdn_replay_commit` of the first ``bs = len(slots)`` lanes of every layer of
    ``plan``: on CUDA, when the plan is ``stacked``, one conv-window launch and one
    delta-rule launch for all layers (``n_layers x bs`` lanes each:
    ``gdn_replay_commit_layers_triton``), else (this function) one :func:`gdn_replay_commit`
    per layer. The same results, bitwise; no allocation, no host read (capturable)."""
    bs = check_slots(slots, plan.ssm_states[0].device)
    for rec, conv, ssm in zip(plan.records, plan.conv_states, plan.ssm_states, strict=True):
        gdn_replay_commit(rec.lanes(bs), accepted, conv, ssm, slots, num_k_heads,
                          batch_invariant=batch_invariant)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# public ops (unimem_kernel._dispatch: Triton on CUDA tensors, the reference elsewhere)
# ---------------------------------------------------------------------------------------------


def gdn_replay_commit_reference(
    record: gdn_reference.VerifyRecord,
    accepted: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
    *,
    batch_invariant: bool = False,
) -> None:
    """Commit of a verify run with a ``record`` (module docstring): bitwise the states the same
    verify would have stored in its per-position scratches at entry ``accepted[b]`` (and
    ``state_commit.commit_states`` copied), each side against itself. ``batch_invariant``: the
    verify ran ``gdn_forward(batch_invariant=True)``, whose tiles the replay must use (the
    Triton side: ``gdn_replay_commit_triton``). The reference is
    ``gdn_reference.gdn_replay_commit`` (``batch_invariant`` has no effect there: one
    arithmetic)."""
    gdn_reference.gdn_replay_commit(record, accepted, conv_state, ssm_state, slots, num_k_heads)


gdn_replay_commit = kernel_op(
    "gdn_replay_commit",
    triton=gdn_replay_commit_triton,
    reference=gdn_replay_commit_reference,
    device_of="ssm_state",
)


gdn_replay_commit_layers = kernel_op(
    "gdn_replay_commit_layers",
    triton=gdn_replay_commit_layers_triton,
    reference=_replay_commit_layer_by_layer,
    device_of=lambda plan, *args, **kwargs: plan.ssm_states[0],
    check=lambda plan, *args, **kwargs: plan.stacked,
)
