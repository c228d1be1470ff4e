"""Gated DeltaNet (GDN) mixer core in plain torch: the CPU implementation and the oracle of
GPU kernels.

Pure functions of tensors. Nothing here holds memory: per-request state lives in
caller-owned tensors indexed by physical slot ids, which may be strided views into a byte
arena. Functions index them with ``slots`` and write back in place (``index_copy_``); they
never assume more contiguity than indexing needs.

State layouts (per GDN layer):

* ``conv_state [num_slots, conv_dim, K - 1]`` (conv dtype, usually the model dtype): the last
  ``K - 1`` inputs of the causal conv, oldest in column 0. A fresh request's state is zeros.
* ``ssm_state [num_slots, H, Dk, Dv]`` (float32, or float64 for float64 models): the
  recurrent state ``S`` of every head, mapping keys (``Dk``) to values (``Dv``).

Conventions (Qwen3-Next / fla):

* Causal depthwise conv, no bias: ``y_t[c] = sum_{i<K} w[c, i] * x_{t-K+1+i}[c]``, where
  inputs before the request's first token come from the conv state (zeros when fresh); with
  ``activation="silu"`` the conv applies SiLU to its accumulator before the one rounding to
  the output dtype (the ``activation`` of ``causal_conv1d_fn``, as SGLang and vLLM run it).
* Gated delta rule, per head, with ``a_t = exp(g_t)`` (``g_t <= 0`` is the log decay),
  ``beta_t`` in (0, 1), ``q_t`` scaled by ``scale = Dk ** -0.5``::

      S'  = a_t * S_{t-1}
      S_t = S' + beta_t * k_t (v_t - S'^T k_t)^T
      o_t = S_t^T (scale * q_t)

  ``S`` is ``[Dk, Dv]``; ``o_t`` and ``v_t`` are ``[Dv]``.
* The mixer (:func:`gdn_forward`): conv with SiLU over ``mixed_qkv = [q | k | v]`` (each
  head-major: ``Hk * Dk``, ``Hk * Dk``, ``H * Dv`` channels), its output rounded once to
  ``mixed_qkv``'s dtype, split, L2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``, in the
  state's dtype), delta rule.
* Grouped key heads (Qwen3-Next: 16 key heads, 32 value heads): q and k have ``Hk`` heads,
  v, g, beta and the state ``H``, with ``Hk`` dividing ``H``. Value head ``h`` uses key head
  ``h // (H // Hk)``, i.e. q and k are ``repeat_interleave``'d over the value heads (as
  HuggingFace's ``Qwen3NextGatedDeltaNet``). ``Hk == H`` is the ungrouped layer.

Arithmetic runs in the SSM state dtype (the conv in float32, or float64 for float64 inputs);
outputs are cast back to the input dtype. Run time is deterministic: no randomness, and a
fixed order of every reduction for given shapes.

Three modes, as in the engine:

* ``extend``: a ragged batch (``cu_seqlens``); reads each request's state from its slot and
  writes the final state back. The delta rule runs in its chunked (WY) form.
* ``decode``: one token per request; state updated in place.
* ``verify``: ``T`` tokens per request; the state after *every* position goes to caller-owned
  scratch (``[bs, T, ...]``, entry ``t`` = state after token ``t``) and the slot is NOT
  touched. Committing ``n`` accepted tokens means copying scratch entry ``n - 1`` into the
  slot (``unimem_kernel.state_commit``).

  Or, with a :class:`VerifyRecord` in place of both scratches: the verify keeps only the
  step's own inputs — per token the conv input row ``x``, the conv output row ``y`` and the
  gates ``g``, ``beta`` — and the commit (:func:`gdn_replay_commit`) rebuilds each lane's
  conv window from its slot and ``x``, and re-runs the recurrence over the accepted tokens
  from the slot's SSM state, which the verify left untouched. Same committed states, bitwise,
  in far fewer bytes (rows in the model's dtype against fp32 states and conv windows) and
  no per-position state at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
"""Epsilon of the q/k L2 normalisation: ``x / sqrt(sum(x^2) + eps)``."""

DEFAULT_CHUNK = 64
"""Chunk length of the chunked delta rule."""

CONV_ACTIVATIONS = (None, "silu")
"""Values of the convs' ``activation`` argument (``causal_conv1d_fn``'s names)."""


def check_activation(activation: str | None) -> bool:
    """True for ``"silu"``, False for None; ValueError naming the value otherwise."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"conv activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    return activation == "silu"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the conv: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _seg_bounds(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    """Host list of ``cu_seqlens`` (extend is not captured, so a host read is fine)."""
    return cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------- causal conv


def _conv_windows(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, activation: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv of ``x [B, T, D]`` continuing from ``state [B, D, K-1]``.

    Returns ``y [B, T, D]`` (accumulation dtype; SiLU applied when ``activation`` is
    ``"silu"``) and ``windows [B, T + 1, D, K - 1]``: entry ``t`` is the conv state after ``t``
    tokens (entry 0 = ``state``), in ``state``'s dtype.
    """
    silu = check_activation(activation)
    k = weight.shape[1]
    acc = _acc_dtype(x.dtype)
    xs = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, K-1+T, D]
    xa = xs.to(acc)
    w = weight.to(acc)
    t = x.shape[1]
    y = xa[:, 0:t] * w[:, 0]
    for i in range(1, k):
        y = y + xa[:, i : i + t] * w[:, i]
    windows = xs.unfold(1, k - 1, 1).to(state.dtype)  # [B, T+1, D, K-1]
    return (F.silu(y) if silu else y), windows


def causal_conv1d_extend(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Causal conv over a ragged batch; returns ``y [T, D]`` in ``x``'s dtype (``activation``:
    None or ``"silu"``, applied before the rounding to that dtype).

    ``x [T, D]``: tokens of ``bs`` requests back to back, request ``i`` at rows
    ``cu_seqlens[i]:cu_seqlens[i+1]``. ``weight [D, K]``. ``conv_state [N, D, K-1]`` indexed
    by ``slots [bs]``: request ``i`` continues from ``conv_state[slots[i]]`` — or from zeros
    where ``has_initial_state[i]`` is False (the slot's bytes are then never read into the
    result, so stale or NaN bytes are harmless) — and its last ``K - 1`` inputs are written
    back to that slot. A request with zero tokens keeps its state (zeros if it had none).
    """
    bounds = _seg_bounds(cu_seqlens)
    bs = len(bounds) - 1
    init = conv_state[slots.long()]
    if has_initial_state is not None:
        init = torch.where(has_initial_state.view(bs, 1, 1), init, torch.zeros_like(init))
    y = torch.empty_like(x)
    finals = []
    for i in range(bs):
        s, e = bounds[i], bounds[i + 1]
        yi, windows = _conv_windows(x[s:e].unsqueeze(0), init[i : i + 1], weight, activation)
        y[s:e] = yi[0].to(x.dtype)
        finals.append(windows[0, -1])
    if bs:
        conv_state.index_copy_(0, slots.long(), torch.stack(finals))
    return y


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """One token per request: ``x [bs, D]`` -> ``y [bs, D]``; slot states updated in place."""
    idx = slots.long()
    y, windows = _conv_windows(x.unsqueeze(1), conv_state[idx], weight, activation)
    conv_state.index_copy_(0, idx, windows[:, -1])
    return y[:, 0].to(x.dtype)


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    state_scratch: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """``T`` tokens per request without touching the slots.

    ``x [bs, T, D]`` -> ``y [bs, T, D]``. ``state_scratch [bs, T, D, K-1]`` (caller-owned,
    conv state dtype) receives in entry ``t`` the conv state after token ``t``.
    """
    y, windows = _conv_windows(x, conv_state[slots.long()], weight, activation)
    state_scratch.copy_(windows[:, 1:])
    return y.to(x.dtype)


# ---------------------------------------------------------------------- delta rule


def check_heads(num_heads: int, num_k_heads: int) -> int:
    """``H // Hk``, the value heads per key head; ValueError unless ``Hk`` divides ``H``."""
    if num_k_heads <= 0 or num_heads % num_k_heads:
        raise ValueError(
            f"num_k_heads {num_k_heads} must divide the number of value heads {num_heads}"
        )
    return num_heads // num_k_heads


def expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``x [..., Hk, D]`` with each key head repeated for its ``H // Hk`` value heads (value
    head ``h`` gets key head ``h // (H // Hk)``); ``x`` itself when ``Hk == H``."""
    hk = x.shape[-2]
    if hk == num_heads:
        return x
    return x.repeat_interleave(check_heads(num_heads, hk), dim=-2)


def _prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    dtype: torch.dtype,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """Casts to ``dtype``, scales q and expands q, k from ``Hk`` to ``H = v.shape[-2]`` heads."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if k.shape != q.shape:
        raise ValueError(f"q and k must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    h = v.shape[-2]
    q, k = expand_heads(q, h), expand_heads(k, h)
    return (
        q.to(dtype) * scale,
        k.to(dtype),
        v.to(dtype),
        g.to(dtype),
        beta.to(dtype),
    )


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    states_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule for ``B`` sequences of equal length ``L``.

    ``q, k [B, L, Hk, Dk]`` (``Hk`` dividing ``H``: value head ``h`` uses key head
    ``h // (H // Hk)``), ``v [B, L, H, Dv]``, ``g, beta [B, L, H]``,
    ``initial_state [B, H, Dk, Dv]`` (its dtype is the arithmetic dtype; not modified).
    ``scale`` defaults to ``Dk ** -0.5``. If given, ``states_out [B, L, H, Dk, Dv]`` receives
    the state after every token. Returns ``o [B, L, H, Dv]`` (``v``'s dtype) and the final
    state ``[B, H, Dk, Dv]`` (a new tensor).
    """
    dtype = initial_state.dtype
    qs, ks, vs, gs, bs_ = _prep(q, k, v, g, beta, dtype, scale)
    state = initial_state.clone()
    outs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(gs[:, t])[..., None, None]
        kt = ks[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, state)
        u = bs_[:, t, :, None] * (vs[:, t] - pred)
        state = state + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qs[:, t], state))
        if states_out is not None:
            states_out[:, t] = state
    o = torch.stack(outs, dim=1) if outs else vs.new_empty(vs.shape)
    return o.to(v.dtype), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form of :func:`gated_delta_rule_recurrent`: same arguments and result
    (equal up to rounding; ~1e-12 relative in float64), ``O(L / C)`` sequential steps.

    Within a chunk of ``C`` tokens starting from state ``S0``, with ``G_t`` the cumulative
    log decay inside the chunk (``G_t = g_1 + ... + g_t``) and ``D[t, s] = exp(G_t - G_s)``
    for ``s <= t``, the pre-update values ``u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)``
    solve the unit lower-triangular system::

        (I + A) U = beta * (V - exp(G) * K S0),   A[t, s] = beta_t D[t, s] k_t.k_s  (s < t)

    and then ``O = exp(G) * Q S0 + (D * Q K^T) U`` (``s <= t``) and
    ``S_C = exp(G_C) S0 + K^T (exp(G_C - G) * U)``. Everything except the ``S0`` terms is
    computed for all chunks at once; the chunk loop carries only the state.
    """
    dtype = initial_state.dtype
    qs, ks, vs, gs, bts = _prep(q, k, v, g, beta, dtype, scale)
    b, length, h, dk = qs.shape  # q, k expanded to H heads
    dv = vs.shape[-1]
    if length == 0:
        return vs.to(v.dtype), initial_state.clone()
    c = chunk_size
    n = -(-length // c)
    pad = n * c - length

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, L, H, *D] -> [B, H, N, C, *D]; padding is g = beta = k = v = q = 0, which
        # leaves the state unchanged (no decay, no update).
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(b, n, c, h, *x.shape[3:]).movedim(3, 1)

    qc, kc, vc = chunks(qs), chunks(ks), chunks(vs)  # [B, H, N, C, D]
    gc, bc = chunks(gs), chunks(bts)  # [B, H, N, C]
    gcum = gc.cumsum(-1)
    diff = gcum[..., :, None] - gcum[..., None, :]  # [.., C(t), C(s)]
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp(diff.masked_fill(~incl, float("-inf")))  # D[t, s], 0 above diagonal
    strict = decay.tril(-1)
    a = bc[..., :, None] * strict * (kc @ kc.transpose(-1, -2))
    eye = torch.eye(c, dtype=dtype, device=q.device)
    rhs = torch.cat([bc[..., None] * vc, (bc * gcum.exp())[..., None] * kc], dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., :dv], solved[..., dv:]  # U = u0 - w @ S0
    qdec = gcum.exp()[..., None] * qc  # exp(G) * Q
    attn = decay * (qc @ kc.transpose(-1, -2))  # (D * Q K^T), lower incl.
    glast = gcum[..., -1:]  # [B, H, N, 1]
    kdec = (glast - gcum).exp()[..., None] * kc  # exp(G_C - G) * K

    state = initial_state.clone()
    outs = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ state
        outs.append(qdec[:, :, i] @ state + attn[:, :, i] @ u)
        state = glast[:, :, i, :, None].exp() * state + kdec[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
    o = o.movedim(1, 3).reshape(b, n * c, h, dv)[:, :length]
    return o.to(v.dtype), state


def gated_delta_rule_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Chunked delta rule over a ragged batch: ``q, k [T, Hk, Dk]``, ``v [T, H, Dv]``,
    ``g, beta [T, H]``, rows split by ``cu_seqlens [bs+1]``. Request ``i`` starts from
    ``ssm_state[slots[i]]`` (zeros where ``has_initial_state[i]`` is False) and its final
    state is written back there. Returns ``o [T, H, Dv]``.
    """
    bounds = _seg_bounds(cu_seqlens)
    bs = len(bounds) - 1
    idx = slots.long()
    init = ssm_state[idx]
    if has_initial_state is not None:
        init = torch.where(has_initial_state.view(bs, 1, 1, 1), init, torch.zeros_like(init))
    o = v.new_empty(v.shape)
    finals = []
    for i in range(bs):
        s, e = bounds[i], bounds[i + 1]
        oi, fi = gated_delta_rule_chunked(
            q[None, s:e],
            k[None, s:e],
            v[None, s:e],
            g[None, s:e],
            beta[None, s:e],
            init[i : i + 1],
            scale=scale,
            chunk_size=chunk_size,
        )
        o[s:e] = oi[0]
        finals.append(fi[0])
    if bs:
        ssm_state.index_copy_(0, idx, torch.stack(finals))
    return o


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per request (``q, k [bs, Hk, Dk]``, ``v [bs, H, Dv]``, ``g, beta [bs, H]``);
    slot states updated in place. Returns ``o [bs, H, Dv]``."""
    idx = slots.long()
    o, final = gated_delta_rule_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], ssm_state[idx], scale
    )
    ssm_state.index_copy_(0, idx, final)
    return o[:, 0]


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    state_scratch: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``T`` tokens per request (``q, k [bs, T, Hk, Dk]``, ``v [bs, T, H, Dv]``,
    ``g, beta [bs, T, H]``) from the slot states, which are NOT modified. Entry ``t`` of
    ``state_scratch [bs, T, H, Dk, Dv]`` (caller-owned, SSM state dtype) receives the state
    after token ``t``. Returns ``o [bs, T, H, Dv]``."""
    o, _ = gated_delta_rule_recurrent(
        q, k, v, g, beta, ssm_state[slots.long()], scale, states_out=state_scratch
    )
    return o


# ---------------------------------------------------------------------- replay commit


def rule_dtype(ssm_dtype: torch.dtype) -> torch.dtype:
    """The delta rule's arithmetic dtype for an SSM state dtype: float64 for float64 states,
    else float32 (the dtype of a :class:`VerifyRecord`'s gates, so that stored values are
    exactly those consumed)."""
    return torch.float64 if ssm_dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class VerifyRecord:
    """What one GDN layer's verify keeps for its commit: the step's own inputs, per lane and
    position (request-major, ``T`` positions a lane).

    - ``x [bs, T, conv_dim]``: the conv inputs (``mixed_qkv`` rows), in the conv state's
      dtype — a lane's conv window after ``n`` tokens is the last ``K - 1`` of its slot's
      window followed by ``x[b, :n]``;
    - ``y [bs, T, conv_dim]``: the conv outputs (SiLU applied), in ``mixed_qkv``'s dtype —
      what the delta rule reads;
    - ``g, beta [bs, T, H]``: the gates, in :func:`rule_dtype`.

    Caller-owned buffers (the runner keeps one record per layer, for its largest batch, and
    passes :meth:`lanes` views); the verify overwrites the live lanes' rows, the commit only
    reads them.
    """

    x: torch.Tensor
    y: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def empty(
        cls,
        bs: int,
        t_len: int,
        conv_dim: int,
        num_heads: int,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fill: float = 0.0,
    ) -> VerifyRecord:
        """A record for ``bs`` lanes of ``t_len`` positions, every entry ``fill``."""

        def full(width: int, dt: torch.dtype) -> torch.Tensor:
            return torch.full((bs, t_len, width), fill, dtype=dt, device=device)

        gdt = rule_dtype(ssm_dtype)
        return cls(full(conv_dim, dtype), full(conv_dim, dtype), full(num_heads, gdt),
                   full(num_heads, gdt))  # fmt: skip

    @property
    def lanes_and_positions(self) -> tuple[int, int]:
        return int(self.x.shape[0]), int(self.x.shape[1])

    def lanes(self, bs: int) -> VerifyRecord:
        """Views of the first ``bs`` lanes."""
        return VerifyRecord(self.x[:bs], self.y[:bs], self.g[:bs], self.beta[:bs])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.y, self.g, self.beta))

    def check(self, bs: int, t_len: int, conv_state: torch.Tensor, ssm_state: torch.Tensor,
              io_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """ValueError naming the field unless the record fits ``bs`` lanes of ``t_len``
        positions of a layer with these states (and conv outputs in ``io_dtype``)."""
        conv_dim = conv_state.shape[1]
        h = ssm_state.shape[1]
        gdt = rule_dtype(ssm_state.dtype)
        if io_dtype is not None and io_dtype != conv_state.dtype:
            raise ValueError(
                f"a verify with a VerifyRecord needs mixed_qkv in the conv state's dtype "
                f"({conv_state.dtype}), got {io_dtype}"
            )
        for name, t, width, dt in (
            ("x", self.x, conv_dim, conv_state.dtype),
            ("y", self.y, conv_dim, io_dtype or self.y.dtype),
            ("g", self.g, h, gdt),
            ("beta", self.beta, h, gdt),
        ):
            if tuple(t.shape) != (bs, t_len, width) or t.dtype != dt:
                raise ValueError(
                    f"VerifyRecord.{name} must be [{bs}, {t_len}, {width}] {dt}, got "
                    f"{tuple(t.shape)} {t.dtype}"
                )
            if t.device != ssm_state.device:
                raise ValueError(f"VerifyRecord.{name} is on {t.device}, the states on "
                                 f"{ssm_state.device}")  # fmt: skip
            if t.stride(-1) != 1:
                raise ValueError(f"VerifyRecord.{name} rows must be contiguous")


def _commit_lanes(
    accepted: torch.Tensor, slots: torch.Tensor, t_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots as int64, accepted as int64, live lane indices)``: a lane commits when its
    slot is ``>= 0`` and ``0 <= accepted < T``."""
    idx, acc = slots.long(), accepted.long()
    lanes = ((idx >= 0) & (acc >= 0) & (acc < t_len)).nonzero().flatten()
    return idx, acc, lanes


def gdn_replay_commit(
    record: VerifyRecord,
    accepted: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int | None = None,
) -> None:
    """Commit after a verify that kept a :class:`VerifyRecord` (``gdn_forward(...,
    record=)``): for every lane ``b`` with ``slots[b] >= 0`` and ``0 <= accepted[b] < T``,
    the conv window and the SSM state after token ``accepted[b]`` are written into slot
    ``slots[b]``, in place; other lanes are skipped (their slots untouched). The conv window
    is the last ``K - 1`` of ``[slot window | x[b, :accepted + 1]]``; the state runs tokens
    ``0 .. accepted[b]`` of the record (the L2 norm of ``y``'s k as the mixer, the same
    :func:`gated_delta_rule_recurrent`) from the slot's state. Bitwise the states the verify's
    per-position scratches would hold at entry ``accepted[b]``."""
    bs, t_len = record.lanes_and_positions
    h, dk, dv = ssm_state.shape[1:]
    if accepted.shape != (bs,) or slots.shape != (bs,):
        raise ValueError(f"need accepted and slots [{bs}], got {accepted.shape}, {slots.shape}")
    record.check(bs, t_len, conv_state, ssm_state)
    nk = check_conv_dim(conv_state.shape[1], h, dk, dv, num_k_heads)
    idx, acc, lanes = _commit_lanes(accepted, slots, t_len)
    if not lanes.numel():
        return
    kw1 = conv_state.shape[2]
    win = torch.cat([conv_state[idx[lanes]], record.x[lanes].transpose(1, 2)], dim=2)
    keep = torch.stack([win[i, :, a + 1 : a + 1 + kw1] for i, a in enumerate(acc[lanes].tolist())])
    conv_state.index_copy_(0, idx[lanes], keep)
    n = int(acc[lanes].max()) + 1
    # the mixer's L2 norm on the same [bs * T] rows as the verify (same shapes, same bits)
    _, k, v = split_qkv(record.y.reshape(bs * t_len, -1).to(ssm_state.dtype), h, dk, dv, nk)
    k = l2norm(k).reshape(bs, t_len, nk, dk)[:, :n]
    v = v.reshape(bs, t_len, h, dv)[:, :n]
    states = ssm_state.new_empty(bs, n, h, dk, dv)
    init = ssm_state[idx.clamp(min=0)]
    gated_delta_rule_recurrent(
        k, k, v, record.g[:, :n], record.beta[:, :n], init, states_out=states
    )  # q := k: its output is unused
    ssm_state.index_copy_(0, idx[lanes], states[lanes, acc[lanes]])


# ---------------------------------------------------------------------- the mixer core


def mixed_qkv_dim(
    num_heads: int, head_dim_k: int, head_dim_v: int, num_k_heads: int | None = None
) -> int:
    """Channels of ``mixed_qkv``: ``2 * Hk * Dk + H * Dv`` (``Hk`` defaults to ``H``)."""
    hk = num_heads if num_k_heads is None else num_k_heads
    return 2 * hk * head_dim_k + num_heads * head_dim_v


def check_conv_dim(
    dim: int, num_heads: int, head_dim_k: int, head_dim_v: int, num_k_heads: int | None = None
) -> int:
    """``Hk`` (``H`` when None) after checking that it divides ``H`` and that ``dim`` channels
    are ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]``; ValueError naming the numbers otherwise."""
    hk = num_heads if num_k_heads is None else num_k_heads
    check_heads(num_heads, hk)
    want = mixed_qkv_dim(num_heads, head_dim_k, head_dim_v, hk)
    if dim != want:
        raise ValueError(
            f"conv_dim {dim} != 2 * Hk * Dk + H * Dv = 2 * {hk} * {head_dim_k} + {num_heads} * "
            f"{head_dim_v} = {want}"
        )
    return hk


def split_qkv(
    y: torch.Tensor,
    num_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    num_k_heads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split conv output ``y [..., 2*Hk*Dk + H*Dv]`` into ``q, k [..., Hk, Dk]`` and
    ``v [..., H, Dv]`` (``num_k_heads`` = ``Hk``, default ``H``)."""
    nk = num_heads if num_k_heads is None else num_k_heads
    hk = nk * head_dim_k
    lead = y.shape[:-1]
    q = y[..., :hk].reshape(*lead, nk, head_dim_k)
    k = y[..., hk : 2 * hk].reshape(*lead, nk, head_dim_k)
    v = y[..., 2 * hk :].reshape(*lead, num_heads, head_dim_v)
    return q, k, v


def verify_width(
    bs: int,
    mixed_qkv: torch.Tensor,
    conv_scratch: torch.Tensor | None,
    ssm_scratch: torch.Tensor | None,
    record: VerifyRecord | None,
) -> int:
    """``Tv`` of a verify call (positions per lane) from its scratches or record; ValueError
    unless exactly one of (``conv_scratch`` and ``ssm_scratch``) and ``record`` is given and
    ``mixed_qkv`` has ``bs * Tv`` rows."""
    if record is not None:
        if conv_scratch is not None or ssm_scratch is not None:
            raise ValueError("gdn_forward: verify takes a record or the scratches, not both")
        tv = record.lanes_and_positions[1]
    elif conv_scratch is None or ssm_scratch is None:
        raise ValueError("gdn_forward: verify needs a record, or conv_scratch and ssm_scratch")
    else:
        tv = ssm_scratch.shape[1] if ssm_scratch.dim() == 5 else -1
        if conv_scratch.dim() != 4 or conv_scratch.shape[:2] != (bs, tv):
            raise ValueError(
                f"gdn_forward: conv_scratch must be [bs={bs}, Tv={tv}, conv_dim, K-1], got "
                f"{tuple(conv_scratch.shape)}"
            )
    if mixed_qkv.shape[0] != bs * tv:
        raise ValueError(
            f"gdn_forward: verify needs T == bs * Tv = {bs} * {tv} rows, got {mixed_qkv.shape[0]}"
        )
    return tv


def gdn_forward(
    mode: str,
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    *,
    conv_scratch: torch.Tensor | None = None,
    ssm_scratch: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    num_k_heads: int | None = None,
    record: VerifyRecord | None = None,
) -> torch.Tensor:
    """The GDN mixer core for one layer and one batch: conv with SiLU (rounded once to
    ``mixed_qkv``'s dtype) -> split -> L2-norm q, k -> gated delta rule. Returns ``o [T, H,
    Dv]`` in ``mixed_qkv``'s dtype.

    ``mixed_qkv [T, conv_dim]`` with channels ``[q: Hk*Dk | k: Hk*Dk | v: H*Dv]``,
    ``conv_weight [conv_dim, K]``, ``g, beta [T, H]``; ``H``, ``Dk``, ``Dv`` are read from
    ``ssm_state [N, H, Dk, Dv]``, ``Hk`` is ``num_k_heads`` (default ``H``; it must divide
    ``H``: value head ``h`` uses key head ``h // (H // Hk)``); ``conv_state [N, conv_dim,
    K-1]``; ``slots [bs]``. ``chunk_size``: chunk length of the chunked delta rule (extend).
    Per ``mode``:

    * ``"extend"``: rows split by ``cu_seqlens [bs+1]`` (read on the host);
      ``has_initial_state [bs]`` optional (False: start from zeros, ignoring the slot).
      Slots updated in place.
    * ``"decode"``: ``T == bs``, one token per request; slots updated in place.
    * ``"verify"``: ``T == bs * Tv`` request-major (request ``i`` owns rows
      ``i*Tv:(i+1)*Tv``), ``Tv`` taken from the scratch shapes ``conv_scratch [bs, Tv,
      conv_dim, K-1]`` and ``ssm_scratch [bs, Tv, H, Dk, Dv]``, which receive the states after
      every token. Slots not touched. ``cu_seqlens`` is not read. With ``record`` (a
      :class:`VerifyRecord` of ``bs`` lanes, ``Tv`` from its shape) instead of both
      scratches, the step's conv inputs, conv outputs and gates go there and no state is
      stored: commit with :func:`gdn_replay_commit`.
    """
    num_heads, dk, dv = ssm_state.shape[1:]
    nk = check_conv_dim(mixed_qkv.shape[-1], num_heads, dk, dv, num_k_heads)
    bs = slots.shape[0]
    sdt = ssm_state.dtype
    if mode == "extend":
        if cu_seqlens is None:
            raise ValueError("gdn_forward: extend needs cu_seqlens")
        y = causal_conv1d_extend(
            mixed_qkv, conv_weight, conv_state, slots, cu_seqlens, has_initial_state, "silu"
        )
    elif mode == "decode":
        if mixed_qkv.shape[0] != bs:
            raise ValueError(f"gdn_forward: decode needs T == bs, got {mixed_qkv.shape[0]}, {bs}")
        y = causal_conv1d_decode(mixed_qkv, conv_weight, conv_state, slots, "silu")
    elif mode == "verify":
        tv = verify_width(bs, mixed_qkv, conv_scratch, ssm_scratch, record)
        x3 = mixed_qkv.reshape(bs, tv, -1)
        if record is not None:
            record.check(bs, tv, conv_state, ssm_state, mixed_qkv.dtype)
            yv, _ = _conv_windows(x3, conv_state[slots.long()], conv_weight, "silu")
            y = yv.to(mixed_qkv.dtype)
            record.x.copy_(x3)
            record.y.copy_(y)
            record.g.copy_(g.reshape(bs, tv, -1))
            record.beta.copy_(beta.reshape(bs, tv, -1))
        else:
            y = causal_conv1d_verify(x3, conv_weight, conv_state, slots, conv_scratch, "silu")
        y = y.reshape(bs * tv, -1)
    else:
        raise ValueError(f"gdn_forward: mode must be extend, decode or verify, got {mode!r}")

    q, k, v = split_qkv(y.to(sdt), num_heads, dk, dv, nk)
    q, k = l2norm(q), l2norm(k)
    if mode == "extend":
        o = gated_delta_rule_extend(
            q, k, v, g, beta, ssm_state, slots, cu_seqlens, has_initial_state, chunk_size=chunk_size
        )
    elif mode == "decode":
        o = gated_delta_rule_decode(q, k, v, g, beta, ssm_state, slots)
    else:
        qkvgb = (
            q.reshape(bs, tv, nk, dk),
            k.reshape(bs, tv, nk, dk),
            v.reshape(bs, tv, num_heads, dv),
            g.reshape(bs, tv, num_heads),
            beta.reshape(bs, tv, num_heads),
        )
        if record is None:
            o = gated_delta_rule_verify(*qkvgb, ssm_state, slots, ssm_scratch)
        else:
            o, _ = gated_delta_rule_recurrent(*qkvgb, ssm_state[slots.long()])
        o = o.reshape(bs * tv, num_heads, dv)
    return o.to(mixed_qkv.dtype)
