"""Gated DeltaNet (GDN) mixer core on the GPU: causal conv1d and the gated delta rule, reading
and writing each request's state in its arena slot in place. This module states the contract,
holds the mixer (:func:`gdn_forward`) and is the import path of every GDN op; the pieces live
by seam: the conv in :mod:`~unimem_kernel.gdn_conv`, the recurrent delta rule in
:mod:`~unimem_kernel.gdn_rule` (the chunked one in :mod:`~unimem_kernel.gdn_chunked`), the
replay commit in :mod:`~unimem_kernel.gdn_replay`, what they share in
:mod:`~unimem_kernel.gdn_common`.

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
  ``state_commit.commit_states``. Or, with a ``gdn_reference.VerifyRecord`` in
  place of both scratches, only the step's inputs are kept — the conv input rows, the conv
  output rows (the record's ``y`` *is* the conv output) and the gates, far fewer bytes than
  the states — and ``gdn_replay_commit`` rebuilds each lane's conv
  window and re-runs the delta rule over tokens ``0 .. accepted`` from the slot: the very
  ``_rule_kernel`` binary the verify ran (its step kind is a runtime flag, and the replay
  passes the same kinds of arguments through ``_mixer_rule``), so the committed state is
  bitwise the verify's state after that token. A :class:`ReplayCommitPlan` commits every
  GDN layer of a model in one launch per kernel (``gdn_replay_commit_layers``: the same
  kernels with a layer table, ``n_layers x bs`` programs on the first grid axis), which
  keeps more programs in flight than one launch per layer.

Padded lanes (``slots[b] < 0``, as in a fixed-size CUDA-graph batch) are skipped by the Triton
path: their slots and scratch entries are neither read nor written and their output rows are
zeros. (The torch reference has no padded lanes: on CPU pass live lanes only.)

Kernels: ``_conv_kernel`` and ``_conv_commit_kernel`` (:mod:`~unimem_kernel.gdn_conv`,
:mod:`~unimem_kernel.gdn_replay`: the conv's step kinds are constexpr switches) and
``_rule_kernel`` (:mod:`~unimem_kernel.gdn_rule`: its step kinds are runtime flags, so that
decode, verify and the replay commit of one tile run one binary). The recurrent form runs
``L`` dependent steps per program in extend; the chunked (WY) form
(``chunked_prefill``, :mod:`~unimem_kernel.gdn_chunked`) has ``L / C`` dependent steps of
matmuls for long prompts. Decode and verify are memory-bound on the state (``H * Dk * Dv``
elements read, and written back or to scratch, per request and layer): the recurrent form is
the one for them.

Launchers (``*_triton``) allocate only when ``out`` (and, for the mixer, ``conv_out``) is not
given, and read nothing back from the device in decode/verify; extend reads ``cu_seqlens`` on
the host when it is a device tensor and ``max_seqlen`` is not given (extend is not captured).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from unimem_kernel import gdn_reference
from unimem_kernel._dispatch import kernel_op
from unimem_kernel.gdn_chunked import gated_delta_rule_extend_chunked_triton
from unimem_kernel.gdn_common import (
    L2NORM_EPS,
    check_device,
    check_shape,
    check_slots,
    cu_seqlens_on_device,
    init_flags,
    into,
)
from unimem_kernel.gdn_conv import (
    _check_conv,
    _launch_conv,
    causal_conv1d_decode,
    causal_conv1d_decode_triton,
    causal_conv1d_extend,
    causal_conv1d_extend_triton,
    causal_conv1d_verify,
    causal_conv1d_verify_triton,
)
from unimem_kernel.gdn_replay import (
    ReplayCommitPlan,
    gdn_replay_commit,
    gdn_replay_commit_layers,
    gdn_replay_commit_layers_triton,
    gdn_replay_commit_triton,
)
from unimem_kernel.gdn_rule import (
    _launch_rule,  # noqa: F401 (the kernel benchmarks drive it from here)
    _mixer_rule,
    _row_strides,
    _rule_config,
    _split_conv_out,
    gated_delta_rule_decode,
    gated_delta_rule_decode_triton,
    gated_delta_rule_extend,
    gated_delta_rule_extend_triton,
    gated_delta_rule_verify,
    gated_delta_rule_verify_triton,
)

__all__ = [
    "L2NORM_EPS",
    "ReplayCommitPlan",
    "causal_conv1d_decode",
    "causal_conv1d_decode_triton",
    "causal_conv1d_extend",
    "causal_conv1d_extend_triton",
    "causal_conv1d_verify",
    "causal_conv1d_verify_triton",
    "gated_delta_rule_decode",
    "gated_delta_rule_decode_triton",
    "gated_delta_rule_extend",
    "gated_delta_rule_extend_triton",
    "gated_delta_rule_verify",
    "gated_delta_rule_verify_triton",
    "gdn_forward",
    "gdn_forward_reference",
    "gdn_forward_triton",
    "gdn_replay_commit",
    "gdn_replay_commit_layers",
    "gdn_replay_commit_layers_triton",
    "gdn_replay_commit_triton",
]


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
    bs = check_slots(slots, ssm_state.device)
    check_device(ssm_state.device, mixed_qkv=mixed_qkv, g=g, beta=beta, out=out)
    check_device(ssm_state.device, conv_out=conv_out, conv_state=conv_state)
    check_shape("g", g, (n, h))
    check_shape("beta", beta, (n, h))
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
    check_shape("conv_out", y, mixed_qkv.shape)
    if y.dtype != mixed_qkv.dtype:
        raise ValueError(f"conv_out dtype {y.dtype} != mixed_qkv dtype {mixed_qkv.dtype}")
    o = mixed_qkv.new_empty(n, h, dv) if out is None else out
    check_shape("out", o, (n, h, dv))

    cu = init = None
    write_final = True
    if mode == "extend":
        if cu_seqlens is None:
            raise ValueError("gdn_forward: extend needs cu_seqlens")
        cu, max_len = cu_seqlens_on_device(cu_seqlens, bs, ssm_state.device, max_seqlen)
        init = init_flags(has_initial_state, bs, ssm_state.device)
        tv = 0
    elif mode == "decode":
        if n != bs:
            raise ValueError(f"gdn_forward: decode needs T == bs, got {n}, {bs}")
        tv = max_len = 1
    elif mode == "verify":
        tv = tv_verify
        if record is None:
            check_shape("conv_scratch", conv_scratch, (bs, tv, *conv_state.shape[1:]))
            check_shape("ssm_scratch", ssm_scratch, (bs, tv, *ssm_state.shape[1:]))
            check_device(ssm_state.device, conv_scratch=conv_scratch, ssm_scratch=ssm_scratch)
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


def gdn_forward_reference(
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
    """The GDN mixer core (module docstring), drop-in for ``gdn_reference.gdn_forward``:
    ``out``/``conv_out`` make the Triton side's decode and verify allocation-free; a device
    ``cu_seqlens`` with ``max_seqlen`` spares its extend a host-to-device copy.
    ``num_k_heads``: the key heads ``Hk`` (default ``H``). ``batch_invariant``: one tile
    configuration for every step kind; ``chunked_prefill``: the Triton extend runs the chunked
    kernel (:func:`gdn_forward_triton`).

    The reference is ``gdn_reference.gdn_forward``, into ``out`` (``conv_out``,
    ``max_seqlen``, ``batch_invariant`` and ``chunked_prefill`` have no effect there: its
    extend is the chunked form at the default chunk size, exact to rounding in the float64
    CPU runs it serves)."""
    result = gdn_reference.gdn_forward(
        mode, mixed_qkv, conv_weight, g, beta, conv_state, ssm_state, slots, cu_seqlens,
        conv_scratch=conv_scratch, ssm_scratch=ssm_scratch,
        has_initial_state=has_initial_state, num_k_heads=num_k_heads, record=record,
    )  # fmt: skip
    return into(out, result)


gdn_forward = kernel_op(
    "gdn_forward", triton=gdn_forward_triton, reference=gdn_forward_reference, device_of="ssm_state"
)
