"""What the model sees of the memory during one forward: the ``ForwardContext`` interface,
and two plain implementations that serve as oracles.

The model knows nothing of pages, pools or slots. For each batch it is handed
a context that says which positions its tokens sit at and which rows need logits, and that
performs the two memory-touching operations of a hybrid model: attention over each
request's K/V cache, and the GDN conv + delta rule over each request's recurrent state.

Implementations:

* :class:`DenseContext` (with :class:`DenseCache`): per-request K/V and GDN state in plain
  tensors, no paging. The reference plumbing for tests and for other implementations.
* :class:`WholeSequenceContext`: one request's whole sequence in one extend from an empty
  cache, with attention as one masked softmax and the GDN conv as a sum over unfolded
  zero-padded inputs followed by the token-by-token delta rule. Used by
  ``CausalLM.reference_forward`` as the oracle.

The paged implementation over a memory pool, which the engine runs, is
:class:`unimem.models.paged_context.PagedContext`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from unimem.models.config import HybridConfig
from unimem_kernel import bi_rms_norm, rope_qk
from unimem_kernel import gdn_reference as gdn_ref


class ForwardMode(str, enum.Enum):
    """Kind of forward. Members compare equal to their string values."""

    EXTEND = "extend"
    """Prefill (possibly continuing a cached prefix): a ragged number of tokens per request;
    writes K/V and advances GDN state in place. Logits for each request's last token."""
    DECODE = "decode"
    """One token per request; writes K/V and advances GDN state in place. Logits for all."""
    VERIFY = "verify"
    """The same number ``T`` of tokens per request (speculative verify). K/V of the ``T``
    tokens are written to the cache's write window; GDN states after every position go to
    scratch and the persistent state is NOT advanced (a later commit picks the accepted
    position). Logits for all tokens."""


class ForwardContext(ABC):
    """Per-step view of the memory that the model calls during one forward of a batch.

    Batch layout: the batch's ``T`` token rows are request-major: request ``i`` owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, in position order. In decode ``T == bs``; in verify
    every request owns the same number of rows.

    Attributes (set by the implementation, read by the model):

    * ``mode``: a :class:`ForwardMode`.
    * ``positions [T]`` int64: the absolute position of each token in its request (RoPE
      position; also the cache index its K/V is written at).
    * ``cu_seqlens_q [bs+1]`` int32 or int64: row offsets of the requests.
    * ``logits_indices [N]`` int64: rows whose final-normed hidden states the model returns,
      in output order — each request's last row in extend (and every row of a request that
      asked for its prompt's log-probabilities), every row in decode and verify.
    * ``head_indices [M]`` int64 or None: which of those ``N`` rows also get logits, in
      order (None: all of them). An extend with prompt log-probabilities returns the hidden
      states of every row of such a request but logits only for each request's last row;
      the engine runs the LM head over the other rows itself, in bounded pieces
      (:mod:`unimem.engine.prompt_logprobs`).
    * ``run_head`` bool (default True): False — the model stops at the final-normed hidden
      states and returns no logits; the caller runs :meth:`~unimem.models.base.CausalLM.
      head_logits` on them itself (a recorded forward whose pick runs eagerly after it).

    Calling protocol: one forward per context; the model calls ``attention`` or ``gdn``
    exactly once per layer, in layer order, then ``capture_hidden`` after each layer.
    Everything passed in is ``config.dtype`` unless stated and is contiguous.
    """

    def __init__(
        self,
        mode: ForwardMode | str,
        positions: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> None:
        self.mode = ForwardMode(mode)
        self.positions = positions
        self.cu_seqlens_q = cu_seqlens_q
        self.logits_indices = logits_indices
        self.head_indices: torch.Tensor | None = None
        self.run_head = True

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of ``hidden [N, d]`` (the :meth:`logits_rows` of the final-normed stream)
        that get logits: ``hidden`` itself unless ``head_indices`` is set."""
        return hidden if self.head_indices is None else hidden[self.head_indices]

    def logits_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x[logits_indices]`` for ``x [T, ...]``: ``x`` itself in decode and verify, where
        every row needs logits in row order (no gather; the caller must not write it)."""
        if self.mode is not ForwardMode.EXTEND and self.logits_indices.shape[0] == x.shape[0]:
            return x
        return x[self.logits_indices]

    @abstractmethod
    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of attention layer ``layer_idx`` (FULL or SWA).

        ``q [T, Hq, Dk]``, ``k [T, Hkv, Dk]``, ``v [T, Hkv, Dv]``, RoPE already applied to
        q and k. Stores k/v of these tokens in the request's cache at ``positions``, then
        each query at position ``p`` attends, with softmax scale ``config.attention_scale``,
        every cached key of its request at position ``j <= p`` — and ``j > p - window`` for
        an SWA layer. Query head ``h`` uses K/V head ``h // (Hq // Hkv)`` (GQA).
        ``sinks [Hq]`` (float32, optional): a learned logit per query head that joins every
        softmax as a key with no value (it takes probability mass and contributes nothing).
        Returns ``[T, Hq, Dv]``.
        """

    def rope_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """:meth:`attention` after RoPE on ``q`` and ``k`` (``unimem_kernel.rope_qk``:
        ``cos, sin [T, R/2]``, rotate-half over the first ``R`` dims of every head). The
        same result as ``attention(layer_idx, *rope_qk(q, k, cos, sin), v)``, which is what
        this default runs; a context that stores K into paged caches does both in one pass
        (the rotated K is then written only into the cache).

        ``qk_norm = (q_weight, k_weight, eps)``: q and k first go through their zero-centred
        RMS norms over the head dim (``unimem_kernel.kv_store.qk_norm_reference``'s math;
        Gemma's and Qwen3-Next's ``q_norm`` / ``k_norm``), fused into the same pass where
        the context stores K into paged caches."""
        if qk_norm is not None:
            q_w, k_w, eps = qk_norm
            q = bi_rms_norm(q, q_w, eps, zero_centered=True)
            k = bi_rms_norm(k, k_w, eps, zero_centered=True)
        q, k = rope_qk(q, k, cos, sin)
        return self.attention(layer_idx, q, k, v, sinks=sinks)

    @abstractmethod
    def gdn(
        self,
        layer_idx: int,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        conv_weight: torch.Tensor,
    ) -> torch.Tensor:
        """GDN mixer core of GDN layer ``layer_idx``, as ``gdn_reference.gdn_forward``.

        ``mixed_qkv [T, conv_dim]`` (``[q | k | v]`` channels, head-major; q and k have
        ``config.gdn_key_heads`` heads, v ``config.gdn_heads``),
        ``g [T, H]`` (log decay, ``<= 0``) and ``beta [T, H]`` in ``config.state_dtype``,
        ``conv_weight [conv_dim, K]`` (the layer's depthwise conv taps). Runs the causal conv
        continuing from the request's conv state with SiLU (one rounding to ``mixed_qkv``'s
        dtype, after the SiLU), splits q/k/v, L2-normalises q and k and runs the gated delta
        rule from the request's recurrent state. Extend and decode
        update both states in place; verify writes the states after every position to
        scratch and leaves them as they were. Returns ``[T, H, Dv]``.
        """

    def capture_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """Hook: ``hidden [T, d_model]`` is the residual stream after layer ``layer_idx``
        (mixer and MLP). Default: ignore. A drafter's context records the layers it reads;
        it must not modify ``hidden``."""
        return None


# ---------------------------------------------------------------------- shared math


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention of one request: ``q [Lq, Hq, Dk]`` at ``q_positions [Lq]`` over
    ``k [Lk, Hkv, Dk]``, ``v [Lk, Hkv, Dv]`` at ``k_positions [Lk]``; key ``j`` is visible
    to query ``p`` iff ``j <= p`` and (no window or ``p - j < window``). Every query must see
    at least one key. ``sinks [Hq]``: per-head logits that join the softmax without a value.
    Softmax in float32 (float64 for float64 inputs). Returns ``[Lq, Hq, Dv]`` in ``q``'s
    dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    kk = k.to(acc).repeat_interleave(group, dim=1)
    vv = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), kk) * scale
    dist = q_positions[:, None] - k_positions[None, :]
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)


def _offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------- dense cache


class DenseCache:
    """Per-request memory of a :class:`DenseContext`: K/V of every attention layer as one
    growing ``[L, Hkv, D]`` tensor per request, GDN state as ``[max_requests, ...]`` slot
    tensors (slot = request handle). No paging, no window retirement (SWA layers keep all
    keys and mask). CPU or any device; sized by ``max_requests`` only.
    """

    def __init__(
        self, config: HybridConfig, max_requests: int, device: torch.device | str = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        c = config
        self.conv_state = {
            i: torch.zeros(max_requests, *c.conv_state_shape, dtype=c.dtype, device=device)
            for i in c.gdn_layers
        }
        self.ssm_state = {
            i: torch.zeros(max_requests, *c.ssm_state_shape, dtype=c.state_dtype, device=device)
            for i in c.gdn_layers
        }
        self.keys: dict[int, list[torch.Tensor]] = {i: [] for i in c.attention_layers}
        self.values: dict[int, list[torch.Tensor]] = {i: [] for i in c.attention_layers}
        for i in c.attention_layers:
            for _ in range(max_requests):
                self.keys[i].append(self._empty(c.head_dim_k))
                self.values[i].append(self._empty(c.head_dim_v))
        self.seq_lens = [0] * max_requests
        """Tokens whose K/V and state are in the cache, per slot."""
        self.pending_verify: set[int] = set()
        """Slots with a verify forward whose ``commit`` has not been called yet."""
        self._free = list(range(max_requests - 1, -1, -1))

    def _empty(self, dim: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(0, c.n_kv_heads, dim, dtype=c.dtype, device=self.device)

    def alloc(self) -> int:
        """A fresh request handle (slot) with an empty cache and zero state."""
        if not self._free:
            raise RuntimeError("DenseCache: no free request slot")
        slot = self._free.pop()
        self.seq_lens[slot] = 0
        for i in self.keys:
            self.keys[i][slot] = self._empty(self.config.head_dim_k)
            self.values[i][slot] = self._empty(self.config.head_dim_v)
        for i in self.conv_state:
            self.conv_state[i][slot].zero_()
            self.ssm_state[i][slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot``; its contents are dropped at the next ``alloc``."""
        if slot in self._free:
            raise ValueError(f"DenseCache.free: slot {slot} is not allocated")
        self.pending_verify.discard(slot)
        self._free.append(slot)


class DenseContext(ForwardContext):
    """A :class:`ForwardContext` over a :class:`DenseCache`.

    Built for one forward of the requests ``slots`` with ``num_tokens[i]`` new tokens each,
    positioned right after the tokens already cached. Extend and decode write the cache
    during the forward (``seq_lens`` advance at construction: the write window is planned
    before the forward). Verify writes nothing persistent: K/V of the ``T`` tokens and the
    GDN states after every position stay in this context until :meth:`commit` keeps a prefix
    of them; building another context on these slots before that raises.
    """

    def __init__(
        self,
        cache: DenseCache,
        slots: Sequence[int],
        num_tokens: Sequence[int],
        mode: ForwardMode | str,
    ) -> None:
        mode = ForwardMode(mode)
        slots, num_tokens = list(slots), list(num_tokens)
        if len(slots) != len(num_tokens) or not slots:
            raise ValueError("DenseContext: slots and num_tokens must be non-empty, same length")
        if len(set(slots)) != len(slots):
            raise ValueError(f"DenseContext: duplicate slots {slots}")
        if busy := cache.pending_verify.intersection(slots):
            raise RuntimeError(f"DenseContext: slots {sorted(busy)} have an uncommitted verify")
        if any(n < 1 for n in num_tokens):
            raise ValueError(f"DenseContext: every request needs >= 1 token, got {num_tokens}")
        if mode is ForwardMode.DECODE and any(n != 1 for n in num_tokens):
            raise ValueError(f"DenseContext: decode takes 1 token per request, got {num_tokens}")
        if mode is ForwardMode.VERIFY and len(set(num_tokens)) != 1:
            raise ValueError(f"DenseContext: verify takes T tokens per request, got {num_tokens}")
        dev = cache.device
        starts = [cache.seq_lens[s] for s in slots]
        positions = torch.cat(
            [
                torch.arange(p, p + n, dtype=torch.int64, device=dev)
                for p, n in zip(starts, num_tokens, strict=True)
            ]
        )
        cu = _offsets(num_tokens, dev)
        if mode is ForwardMode.EXTEND:
            logits_indices = cu[1:].long() - 1
        else:
            logits_indices = torch.arange(int(cu[-1]), dtype=torch.int64, device=dev)
        super().__init__(mode, positions, cu, logits_indices)
        self.cache = cache
        self.slots = slots
        self.num_tokens = num_tokens
        self._starts = starts
        self._bounds = cu.tolist()
        self._slot_ids = torch.tensor(slots, dtype=torch.int64, device=dev)
        self._pending_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._conv_scratch: dict[int, torch.Tensor] = {}
        self._ssm_scratch: dict[int, torch.Tensor] = {}
        if mode is ForwardMode.VERIFY:
            cache.pending_verify.update(slots)
        else:
            for s, n in zip(slots, num_tokens, strict=True):
                cache.seq_lens[s] += n

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cache, config = self.cache, self.cache.config
        window = config.layer_window(layer_idx)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        pending = []
        for i, slot in enumerate(self.slots):
            s, e = self._bounds[i], self._bounds[i + 1]
            keys = torch.cat([cache.keys[layer_idx][slot], k[s:e]])
            values = torch.cat([cache.values[layer_idx][slot], v[s:e]])
            k_pos = torch.arange(keys.shape[0], device=q.device)
            out[s:e] = masked_attention(
                q[s:e],
                keys,
                values,
                self.positions[s:e],
                k_pos,
                window,
                config.attention_scale,
                sinks,
            )
            if self.mode is ForwardMode.VERIFY:
                pending.append((k[s:e].clone(), v[s:e].clone()))
            else:
                cache.keys[layer_idx][slot] = keys
                cache.values[layer_idx][slot] = values
        if self.mode is ForwardMode.VERIFY:
            self._pending_kv[layer_idx] = pending
        return out

    def gdn(
        self,
        layer_idx: int,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        conv_weight: torch.Tensor,
    ) -> torch.Tensor:
        cache = self.cache
        conv_state, ssm_state = cache.conv_state[layer_idx], cache.ssm_state[layer_idx]
        kwargs = {}
        if self.mode is ForwardMode.EXTEND:
            kwargs["has_initial_state"] = torch.tensor(
                [p > 0 for p in self._starts], device=cache.device
            )
        elif self.mode is ForwardMode.VERIFY:
            bs, tv = len(self.slots), self.num_tokens[0]
            kwargs["conv_scratch"] = conv_state.new_empty(bs, tv, *conv_state.shape[1:])
            kwargs["ssm_scratch"] = ssm_state.new_empty(bs, tv, *ssm_state.shape[1:])
            self._conv_scratch[layer_idx] = kwargs["conv_scratch"]
            self._ssm_scratch[layer_idx] = kwargs["ssm_scratch"]
        return gdn_ref.gdn_forward(
            self.mode.value,
            mixed_qkv,
            conv_weight,
            g,
            beta,
            conv_state,
            ssm_state,
            self._slot_ids,
            self.cu_seqlens_q,
            num_k_heads=cache.config.gdn_key_heads,
            **kwargs,
        )

    def commit(self, num_kept: Sequence[int]) -> None:
        """After a verify forward: keep the first ``num_kept[i]`` (1..T) tokens of request
        ``i`` — append their K/V, set the GDN states to those after token ``num_kept[i] - 1``
        and advance ``seq_lens``. Call exactly once per verify context."""
        if self.mode is not ForwardMode.VERIFY:
            raise RuntimeError("DenseContext.commit: only a verify context is committed")
        cache = self.cache
        if not cache.pending_verify.issuperset(self.slots):
            raise RuntimeError("DenseContext.commit: this verify was already committed")
        num_kept = list(num_kept)
        tv = self.num_tokens[0]
        if len(num_kept) != len(self.slots) or any(not 1 <= n <= tv for n in num_kept):
            raise ValueError(f"DenseContext.commit: need 1 <= num_kept <= {tv}, got {num_kept}")
        for layer_idx, pending in self._pending_kv.items():
            for slot, n, (k, v) in zip(self.slots, num_kept, pending, strict=True):
                cache.keys[layer_idx][slot] = torch.cat([cache.keys[layer_idx][slot], k[:n]])
                cache.values[layer_idx][slot] = torch.cat([cache.values[layer_idx][slot], v[:n]])
        rows = torch.arange(len(self.slots), device=cache.device)
        last = torch.tensor(num_kept, device=cache.device) - 1
        for layer_idx, scratch in self._conv_scratch.items():
            cache.conv_state[layer_idx].index_copy_(0, self._slot_ids, scratch[rows, last])
        for layer_idx, scratch in self._ssm_scratch.items():
            cache.ssm_state[layer_idx].index_copy_(0, self._slot_ids, scratch[rows, last])
        for slot, n in zip(self.slots, num_kept, strict=True):
            cache.seq_lens[slot] += n
        cache.pending_verify.difference_update(self.slots)


# ---------------------------------------------------------------------- oracle context


class WholeSequenceContext(ForwardContext):
    """One request's whole sequence of ``length`` tokens as a single extend from an empty
    cache, computed without any cache machinery: attention is one masked softmax over the
    given K/V; the GDN conv sums unfolded zero-padded inputs and the delta rule runs
    token by token from a zero state. Logits for every position. The oracle of
    ``CausalLM.reference_forward``."""

    def __init__(self, config: HybridConfig, length: int, device: torch.device | str = "cpu"):
        if length < 1:
            raise ValueError(f"WholeSequenceContext: length must be >= 1, got {length}")
        positions = torch.arange(length, dtype=torch.int64, device=device)
        cu = torch.tensor([0, length], dtype=torch.int32, device=device)
        super().__init__(ForwardMode.EXTEND, positions, cu, positions.clone())
        self.config = config

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        c = self.config
        pos = self.positions
        window = c.layer_window(layer_idx)
        return masked_attention(q, k, v, pos, pos, window, c.attention_scale, sinks)

    def gdn(
        self,
        layer_idx: int,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        conv_weight: torch.Tensor,
    ) -> torch.Tensor:
        c = self.config
        kernel = conv_weight.shape[1]
        acc = c.state_dtype
        padded = F.pad(mixed_qkv.to(acc), (0, 0, kernel - 1, 0))  # zeros before token 0
        taps = padded.unfold(0, kernel, 1)  # [L, D, K]: inputs t-K+1 .. t
        y = (taps * conv_weight.to(acc)).sum(-1)
        y = F.silu(y).to(mixed_qkv.dtype).to(acc)  # SiLU before the one rounding, as the conv
        hk, dk = c.gdn_key_heads, c.gdn_head_dim_k
        q = y[:, : hk * dk].unflatten(1, (hk, dk))
        k = y[:, hk * dk : 2 * hk * dk].unflatten(1, (hk, dk))
        v = y[:, 2 * hk * dk :].unflatten(1, (c.gdn_heads, c.gdn_head_dim_v))
        group = c.gdn_heads // hk  # value head h reads key head h // group
        q = gdn_ref.l2norm(q).repeat_interleave(group, dim=1)
        k = gdn_ref.l2norm(k).repeat_interleave(group, dim=1)
        state = torch.zeros(1, *c.ssm_state_shape, dtype=acc, device=mixed_qkv.device)
        o, _ = gdn_ref.gated_delta_rule_recurrent(
            q[None], k[None], v[None], g[None], beta[None], state
        )
        return o[0].to(mixed_qkv.dtype)
