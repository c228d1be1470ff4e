"""Which kernel runs a Gated DeltaNet extend (prefill), and fla's chunked kernel on arena slots.

An extend of ``L`` tokens through the recurrent delta rule (``unimem_kernel.gdn``) is ``L``
dependent steps per (request, head, V block) on CUDA cores; fla's chunked (WY) kernel
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, the one SGLang's Qwen3-Next prefill
uses) does ``L / 64`` steps of tensor-core matmuls. Measured on the H200 for one layer of the
``small`` preset (``docs/benchmarks.md``, "Chunked GDN prefill"): one 32k-token prompt 16.5 ms
recurrent vs 1.4 ms through fla, four of them 19.6 vs 4.0 ms, four of 4k tokens 2.5 vs 0.7 ms;
through the whole engine the time to first token of one prompt drops 1.27x at 4k tokens and
1.31x at 28k (``benchmark/bench_prefill.py``).

:func:`prefill_kernel` picks per extend step, from ``UNIMEM_GDN_CHUNKED_PREFILL``:

- ``off`` (default): the recurrent kernel;
- ``auto``: fla when it is importable, the states are on a GPU and the step's longest chunk has
  at least :data:`FLA_MIN_TOKENS` tokens; else the recurrent kernel;
- ``fla``: fla for every extend on a GPU (tests; an error if fla is missing);
- ``triton``: our own chunked kernel (``unimem_kernel.gdn_chunked``: slower than fla, kept as
  the measured alternative).

Status: opt-in. The fla path ran end to end on the H200 (the timings above), but its GPU tests
(``test/models/test_gdn_prefill.py``: outputs and states against the recurrent kernel on slot
views, static == unified through the engine) have not yet completed a run there; ``auto``
becomes the default once they have.

Batch-invariant mode (``--enable-deterministic-inference``) always takes the recurrent kernel:
a token's state must be the same bits whether an extend, a decode or a verify computed it, and
a chunked form rounds differently (bf16 outputs within ~6e-3 relative of the recurrent
form's). Outside it, a request's prefill states differ from the recurrent form's by rounding
only; static and unified runs take the same kernel for the same steps.

:func:`gdn_extend_fla` is the extend half of ``unimem_kernel.gdn.gdn_forward`` with fla's rule:
the causal conv runs our Triton kernel (the conv window is read from and written back to each
request's slot, in place), SiLU on its output, then fla with the L2 norm of q and k in its
kernel; the SSM states are gathered from the slots into fla's ``initial_state`` and its final
states scattered back (a copy of ``H * Dk * Dv`` floats per request and layer, small next to a
long prompt). fla is never imported at module import: only when an extend asks for it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from unimem_kernel import gdn as gdn_ops

__all__ = [
    "FLA_MIN_TOKENS",
    "PREFILL_ENV",
    "PREFILL_MODES",
    "fla_chunk_rule",
    "gdn_extend_fla",
    "prefill_kernel",
    "prefill_mode",
]

PREFILL_ENV = "UNIMEM_GDN_CHUNKED_PREFILL"
PREFILL_MODES = ("auto", "fla", "triton", "off")

FLA_MIN_TOKENS = 1024
"""Shortest longest-chunk of an extend that ``auto`` hands to fla: below it the recurrent
kernel's few hundred dependent steps cost about what fla's fixed launches do."""


@functools.cache
def fla_chunk_rule() -> Callable | None:
    """fla's ``chunk_gated_delta_rule``, or None when fla (``fla-core``) is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def prefill_mode(device: torch.device) -> str:
    """The ``UNIMEM_GDN_CHUNKED_PREFILL`` mode (default ``off``). ValueError naming the
    variable for an unknown value, or for ``fla`` on a GPU without fla installed: the engine
    calls this at start-up, so a bad setting fails there and not at the first prefill."""
    mode = os.environ.get(PREFILL_ENV, "off")
    if mode not in PREFILL_MODES:
        raise ValueError(f"{PREFILL_ENV} must be one of {PREFILL_MODES}, got {mode!r}")
    if mode == "fla" and device.type == "cuda" and fla_chunk_rule() is None:
        raise ValueError(f"{PREFILL_ENV}=fla needs fla (pip install fla-core)")
    return mode


def prefill_kernel(max_seqlen: int, device: torch.device, batch_invariant: bool) -> str:
    """``"fla"``, ``"triton"`` (our chunked kernel) or ``"recurrent"`` for an extend whose
    longest chunk has ``max_seqlen`` tokens, states on ``device`` (module docstring; errors
    as :func:`prefill_mode`)."""
    mode = prefill_mode(device)
    if batch_invariant or mode == "off" or device.type != "cuda":
        return "recurrent"
    if mode in ("triton", "fla"):
        return mode
    return "fla" if max_seqlen >= FLA_MIN_TOKENS and fla_chunk_rule() is not None else "recurrent"


def gdn_extend_fla(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int,
    cu_seqlens_host: Sequence[int],
    num_k_heads: int | None = None,
) -> torch.Tensor:
    """The GDN mixer core of an extend, with fla's chunked rule (module docstring).

    ``mixed_qkv [T, conv_dim]`` (channels ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]``), ``g, beta [T,
    H]`` (log-decay and post-sigmoid gates), ``conv_state [N, conv_dim, K-1]`` and
    ``ssm_state [N, H, Dk, Dv]`` slot views (read and written in place at ``slots [bs]``),
    ``cu_seqlens [bs + 1]`` int32 on the device with its host copy ``cu_seqlens_host`` and
    ``max_seqlen`` (the longest chunk). Returns ``o [T, H, Dv]`` in ``mixed_qkv``'s dtype, as
    ``gdn_forward("extend", ...)``. Raises if fla is missing."""
    rule = fla_chunk_rule()
    if rule is None:
        raise ValueError(f"gdn_extend_fla needs fla (pip install fla-core); or {PREFILL_ENV}=off")
    _, h, dk, dv = ssm_state.shape
    t, conv_dim = mixed_qkv.shape
    hk = h if num_k_heads is None else num_k_heads
    if conv_dim != hk * (2 * dk) + h * dv:
        raise ValueError(
            f"mixed_qkv has {conv_dim} channels, expected Hk*2*Dk + H*Dv = {hk * 2 * dk + h * dv}"
        )
    if len(cu_seqlens_host) != slots.shape[0] + 1 or cu_seqlens_host[-1] != t:
        raise ValueError(
            f"cu_seqlens_host must be [bs + 1 = {slots.shape[0] + 1}] ending at T = {t}, got "
            f"{len(cu_seqlens_host)} entries ending at {cu_seqlens_host[-1]}"
        )
    y = gdn_ops.causal_conv1d_extend_triton(
        mixed_qkv, conv_weight, conv_state, slots, cu_seqlens, out=None, max_seqlen=max_seqlen
    )
    y = F.silu(y)
    kd = hk * dk
    # fla reads [1, T, heads, D] rows at a stride of heads * D: contiguous copies
    q = y[:, :kd].reshape(1, t, hk, dk).contiguous()
    k = y[:, kd : 2 * kd].reshape(1, t, hk, dk).contiguous()
    v = y[:, 2 * kd :].reshape(1, t, h, dv).contiguous()
    idx = slots.long()
    initial = ssm_state.index_select(0, idx).float()
    cu = cu_seqlens.long()
    cu_host = torch.tensor(list(cu_seqlens_host), dtype=torch.long)
    o, final = rule(
        q, k, v, g.float().reshape(1, t, h), beta.float().reshape(1, t, h), scale=dk**-0.5,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu, cu_seqlens_cpu=cu_host,
    )  # fmt: skip
    ssm_state.index_copy_(0, idx, final.to(ssm_state.dtype))
    return o.reshape(t, h, dv).to(mixed_qkv.dtype)
