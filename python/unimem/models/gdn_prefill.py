"""Which kernel runs a Gated DeltaNet extend (prefill), and fla's chunked kernel on arena slots.

An extend of ``L`` tokens through the recurrent delta rule (``unimem_kernel.gdn``) is ``L``
dependent steps per (request, head, V block) on CUDA cores; fla's chunked (WY) kernel
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, the one SGLang's Qwen3-Next prefill
uses) does ``L / 64`` steps of tensor-core matmuls, so long prompts prefill much faster
through fla (``docs/decisions.md``).

:func:`prefill_kernel` picks per extend step, from ``UNIMEM_GDN_CHUNKED_PREFILL``:

- ``auto`` (default): fla when it is importable, the states are on a GPU and the recurrent
  kernel's estimated time for the step (:func:`recurrent_extend_us`) reaches fla's fixed cost
  per layer call (:data:`FLA_FIXED_US`); else the recurrent kernel;
- ``fla``: fla for every extend on a GPU (tests; an error if fla is missing);
- ``off``: the recurrent kernel always;
- ``triton``: our own chunked kernel (``unimem_kernel.gdn_chunked``: slower than fla, kept as
  the alternative it is compared with).

Why a cost estimate and not a token count. fla's path is many launches per GDN layer, and
its host time exceeds its GPU time up to several thousand tokens; the recurrent path is 3
launches whose GPU time grows with the longest chunk and, past a few dozen (request, head)
pairs, with the requests. A prefill step launches every layer eagerly, so it runs at the pace
of the slower of the two, and fla pays only where the recurrent kernel's GPU time is above
fla's launches. The constants of the estimate were chosen by measurement
(``docs/decisions.md``).

The fla path's GPU tests (``test/models/test_gdn_prefill.py``) compare its outputs and states
with the recurrent kernel's on slot views at the ``small`` preset's and Qwen3-Next's head
layouts, and static with unified through the engine.

fla compiles and autotunes its kernels on first use (long on a cold Triton cache; its
autotuner times candidates with host synchronisations). :func:`warm_up_fla` runs that at
engine start-up — the runner calls it when the mode can take fla — so no request's prefill
pays it and no step of the serving loop synchronises for it.

Batch-invariant mode (``--enable-deterministic-inference``) always takes the recurrent kernel:
a token's state must be the same bits whether an extend, a decode or a verify computed it, and
a chunked form rounds differently from the recurrent form. Outside it, a request's prefill
states differ from the recurrent form's by rounding only; static and unified runs take the same
kernel for the same steps.

:func:`gdn_extend_fla` is the extend half of ``unimem_kernel.gdn.gdn_forward`` with fla's rule:
the causal conv runs our Triton kernel (the conv window is read from and written back to each
request's slot, in place) with SiLU before its output's rounding, then fla with the L2 norm
of q and k in its kernel; the SSM states are gathered from the slots into fla's
``initial_state`` and its final states scattered back (a copy of ``H * Dk * Dv`` floats per
request and layer, small next to a long prompt). fla is never imported at module import:
only when an extend asks for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from unimem_kernel import envs
from unimem_kernel import gdn as gdn_ops

__all__ = [
    "FLA_FIXED_US",
    "FlaVarlen",
    "PREFILL_ENV",
    "PREFILL_MODES",
    "fla_chunk_rule",
    "fla_varlen",
    "gdn_extend_fla",
    "prefill_kernel",
    "prefill_mode",
    "recurrent_extend_us",
    "warm_up_fla",
    "warm_up_lengths",
]

PREFILL_ENV = "UNIMEM_GDN_CHUNKED_PREFILL"
PREFILL_MODES = ("auto", "fla", "triton", "off")

FLA_CHUNK = 64
"""Tokens per chunk of fla's chunked rule (its default; it also accepts 16 and 32)."""

FLA_FIXED_US = 1300.0
"""What one GDN layer's extend through fla costs a prefill step at least, in µs: the host time
of its launches, which a host-bound prefill step waits for, taken near the low end (over a
prefill of several steps the host runs ahead of the GPU and fla's smaller GPU time counts).
Chosen by measurement (``docs/decisions.md``)."""

RECURRENT_US_PER_TOKEN = 0.58
"""The recurrent extend's GPU µs per token of the longest chunk while its programs fit the GPU
(chosen by measurement, ``docs/decisions.md``)."""

RECURRENT_PAIRS_KNEE = 56
"""(request, value head) pairs, counted in heads of 128 values, beyond which the recurrent
extend's time per token grows in proportion: its one-warp programs (one per 32 values of a
head) stop finding free issue slots (chosen by measurement, ``docs/decisions.md``)."""

_L2NORM_ROWS_PER_BUCKET = 65536
"""fla's L2-norm kernel autotunes per ``ceil(rows / 65 536)`` (``NB`` in
``fla.modules.norm.l2norm.l2norm_fwd``, rows = tokens x key heads); every other kernel of the
chunked rule autotunes on head counts and sizes only. :func:`warm_up_fla` covers each bucket."""


@functools.cache
def fla_chunk_rule() -> Callable | None:
    """fla's ``chunk_gated_delta_rule``, or None when fla (``fla-core``) is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def prefill_mode(device: torch.device) -> str:
    """The ``UNIMEM_GDN_CHUNKED_PREFILL`` mode (default ``auto``). ValueError naming the
    variable for an unknown value, or for ``fla`` on a GPU without fla installed: the engine
    calls this at start-up, so a bad setting fails there and not at the first prefill."""
    mode = envs.get(PREFILL_ENV)
    if mode == "fla" and device.type == "cuda" and fla_chunk_rule() is None:
        raise ValueError(f"{PREFILL_ENV}=fla needs fla (pip install fla-core)")
    return mode


def recurrent_extend_us(max_seqlen: int, requests: int, value_heads: int, head_v_dim: int) -> float:
    """Estimated GPU µs of one GDN layer's recurrent extend of ``requests`` chunks whose longest
    has ``max_seqlen`` tokens, with ``value_heads`` heads of ``head_v_dim`` values: the
    dependent token steps of the longest chunk, slowed in proportion once the pairs pass
    :data:`RECURRENT_PAIRS_KNEE` (module docstring)."""
    pairs = requests * value_heads * head_v_dim / 128
    return max_seqlen * RECURRENT_US_PER_TOKEN * max(1.0, pairs / RECURRENT_PAIRS_KNEE)


def prefill_kernel(
    max_seqlen: int,
    device: torch.device,
    batch_invariant: bool,
    *,
    requests: int = 1,
    value_heads: int,
    head_v_dim: int,
) -> str:
    """``"fla"``, ``"triton"`` (our chunked kernel) or ``"recurrent"`` for an extend of
    ``requests`` chunks whose longest has ``max_seqlen`` tokens, states of ``value_heads``
    heads of ``head_v_dim`` values on ``device`` (module docstring; errors as
    :func:`prefill_mode`). With ``requests=1`` it answers whether any extend of at most
    ``max_seqlen`` tokens can take fla (the estimate is largest for one chunk of them all)."""
    mode = prefill_mode(device)
    if batch_invariant or mode == "off" or device.type != "cuda":
        return "recurrent"
    if mode in ("triton", "fla"):
        return mode
    slow = recurrent_extend_us(max_seqlen, requests, value_heads, head_v_dim) >= FLA_FIXED_US
    return "fla" if slow and fla_chunk_rule() is not None else "recurrent"


def warm_up_lengths(max_tokens: int, num_k_heads: int) -> list[int]:
    """Token counts whose extends reach every autotune bucket of fla's L2 norm that an extend
    of at most ``max_tokens`` tokens can (one per bucket, the bucket's largest count capped at
    ``max_tokens``; :data:`_L2NORM_ROWS_PER_BUCKET`), ascending."""
    if max_tokens < 1 or num_k_heads < 1:
        raise ValueError(f"max_tokens and num_k_heads must be >= 1: {max_tokens}, {num_k_heads}")
    per = _L2NORM_ROWS_PER_BUCKET
    buckets = -(-max_tokens * num_k_heads // per)
    return sorted({min(max_tokens, b * per // num_k_heads) for b in range(1, buckets + 1)})


def warm_up_fla(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    *,
    max_tokens: int,
    num_k_heads: int | None = None,
    dtype: torch.dtype | None = None,
) -> list[int]:
    """Compile and autotune fla's chunked rule for one GDN layer layout before serving.

    ``conv_state [N, conv_dim, K-1]`` and ``ssm_state [N, H, Dk, Dv]`` are the pool's slot
    views of a GDN layer; only their shapes, dtypes and device are used (one scratch slot of
    each is allocated here: no pool slot is read or written). ``dtype``: the model's
    activations and conv weight (default the conv state's).
    Runs :func:`gdn_extend_fla` once per L2-norm autotune bucket that an extend of at most
    ``max_tokens`` tokens can reach (:data:`_L2NORM_ROWS_PER_BUCKET`), on seeded random
    inputs, and synchronises. Returns the token counts it ran (empty when the choice can never
    be fla: a CPU device, ``off``/``triton``, fla missing, or ``auto`` where no extend of at
    most ``max_tokens`` tokens reaches :data:`FLA_FIXED_US`). Errors as :func:`prefill_mode`."""
    device = ssm_state.device
    _, h, dk, dv = ssm_state.shape
    choice = prefill_kernel(max_tokens, device, False, value_heads=h, head_v_dim=dv)
    if choice != "fla":
        return []
    hk = h if num_k_heads is None else num_k_heads
    conv_dim, conv_width = conv_state.shape[1], conv_state.shape[2] + 1
    act = conv_state.dtype if dtype is None else dtype
    lens = warm_up_lengths(max_tokens, hk)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    conv = randn(1, conv_dim, conv_state.shape[2], dtype=conv_state.dtype)
    ssm = (0.1 * randn(1, h, dk, dv)).to(ssm_state.dtype)
    weight = (0.5 * randn(conv_dim, conv_width)).to(act)
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    for t in lens:
        x = randn(t, conv_dim, dtype=act)
        g = -0.5 * torch.rand(t, h, generator=gen, device=device) - 0.01
        beta = torch.rand(t, h, generator=gen, device=device)
        cu = torch.tensor([0, t], dtype=torch.int32, device=device)
        gdn_extend_fla(
            x, weight, g, beta, conv, ssm, slots, cu, max_seqlen=t,
            varlen=fla_varlen(cu, (0, t)), num_k_heads=hk,
        )  # fmt: skip
    torch.cuda.synchronize(device)
    return lens


def _chunk_indices(cu_host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """fla's varlen ``chunk_indices`` ``[chunks, 2]`` int64 (sequence, chunk within it) for
    ``FLA_CHUNK``-token chunks, built on the host from the host offsets and uploaded without
    a synchronisation (fla would otherwise build it on the host and copy it with a blocking
    ``.to``)."""
    counts = (cu_host[1:] - cu_host[:-1] + (FLA_CHUNK - 1)) // FLA_CHUNK
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    within = torch.arange(seq.numel()) - starts
    rows = torch.stack([seq, within], 1)
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class FlaVarlen:
    """fla's view of one extend's ragged batch, shared by every GDN layer of the step:
    ``cu`` the offsets ``[bs + 1]`` int64 on the device, ``cu_host`` the same on the host,
    ``chunk_indices`` fla's chunk table (:func:`_chunk_indices`) on the device. Build with
    :func:`fla_varlen` once per extend."""

    cu: torch.Tensor
    cu_host: torch.Tensor
    chunk_indices: torch.Tensor


def fla_varlen(cu_seqlens: torch.Tensor, cu_seqlens_host: Sequence[int]) -> FlaVarlen:
    """:class:`FlaVarlen` of an extend whose offsets are ``cu_seqlens [bs + 1]`` (int32, on the
    device) with host copy ``cu_seqlens_host``; reads nothing back from the device."""
    cu_host = torch.tensor(list(cu_seqlens_host), dtype=torch.long)
    return FlaVarlen(cu_seqlens.long(), cu_host, _chunk_indices(cu_host, cu_seqlens.device))


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
    varlen: FlaVarlen,
    num_k_heads: int | None = None,
) -> torch.Tensor:
    """The GDN mixer core of an extend, with fla's chunked rule (module docstring).

    ``mixed_qkv [T, conv_dim]`` (channels ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]``), ``g, beta [T,
    H]`` (log-decay and post-sigmoid gates), ``conv_state [N, conv_dim, K-1]`` and
    ``ssm_state [N, H, Dk, Dv]`` slot views (read and written in place at ``slots [bs]``),
    ``cu_seqlens [bs + 1]`` int32 on the device, ``max_seqlen`` (the longest chunk) and
    ``varlen`` (:func:`fla_varlen` of those offsets, built once per extend). Returns
    ``o [T, H, Dv]`` in ``mixed_qkv``'s dtype, as ``gdn_forward("extend", ...)``. Raises if
    fla is missing."""
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
    n, end = varlen.cu_host.numel(), int(varlen.cu_host[-1])
    if n != slots.shape[0] + 1 or end != t:
        raise ValueError(
            f"varlen offsets must be [bs + 1 = {slots.shape[0] + 1}] ending at T = {t}, got "
            f"{n} entries ending at {end}"
        )
    y = gdn_ops.causal_conv1d_extend_triton(
        mixed_qkv, conv_weight, conv_state, slots, cu_seqlens, out=None, max_seqlen=max_seqlen,
        activation="silu",
    )  # fmt: skip
    kd = hk * dk
    # fla reads [1, T, heads, D] rows at a stride of heads * D: contiguous copies
    q = y[:, :kd].reshape(1, t, hk, dk).contiguous()
    k = y[:, kd : 2 * kd].reshape(1, t, hk, dk).contiguous()
    v = y[:, 2 * kd :].reshape(1, t, h, dv).contiguous()
    idx = slots.long()
    initial = ssm_state.index_select(0, idx).float()
    o, final = rule(
        q, k, v, g.float().reshape(1, t, h), beta.float().reshape(1, t, h), scale=dk**-0.5,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=varlen.cu, cu_seqlens_cpu=varlen.cu_host,
        chunk_indices=varlen.chunk_indices, chunk_size=FLA_CHUNK,
    )  # fmt: skip
    ssm_state.index_copy_(0, idx, final.to(ssm_state.dtype))
    return o.reshape(t, h, dv).to(mixed_qkv.dtype)
