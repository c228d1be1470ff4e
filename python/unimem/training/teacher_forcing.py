"""The target's residual streams over whole token sequences, in batched teacher-forced passes.

A drafter trains on the hidden states of its ``target_layers`` at every position of the
sequences the target wrote. Capturing them while generating costs a decode step per token;
recomputing them afterwards is one extend forward over many whole sequences at once.

:class:`BatchedSequencesContext` is that forward's :class:`~unimem.models.forward_context.
ForwardContext`: ``B`` sequences of one length ``S`` extended from an empty cache, attention
as one masked ``scaled_dot_product_attention`` over ``[B, H, S, D]`` (causal, the layer's
sliding window, GQA; a sink logit per head joins the softmax as in
:func:`~unimem.models.forward_context.masked_attention`). Sequences of different lengths are
padded at the end: a causal forward never lets a position see a later one, so the states of
real positions do not depend on the padding. Models with GDN layers go through the dense
reference context instead (one extend per sequence chunk, the recurrent state per request).

:func:`teacher_forced_states` returns :class:`~unimem.training.distill.Rollouts`
(``tokens``, ``hidden`` for the layers asked, ``prompt_lens``, ``lengths``) on the target's
device, the hidden states in the target's dtype.

Stored states cost ``sequences x length x layers x d_model`` elements of device memory (Gemma
3 270M, 3 layers: ~0.58 MB a 152-token sequence, 35 GB for 60 000 of them). For more text
than that, :func:`tokens_only` keeps the tokens alone and :func:`states_of` computes one
training batch's states when it is drawn (a forward of the target over the batch's
sequences: on an H100 with Gemma 3 270M, 64 sequences and 48 anchors a step, 67 ms a step
against 49 ms with stored states — the price of text that does not fit the GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from unimem.models.base import CausalLM
from unimem.models.config import HybridConfig
from unimem.models.forward_context import (
    DenseCache,
    DenseContext,
    ForwardContext,
    ForwardMode,
    masked_attention,
)
from unimem.training.distill import Rollouts

__all__ = [
    "SOFT_BATCH_TOKENS",
    "BatchedSequencesContext",
    "states_of",
    "teacher_forced_states",
    "tokens_only",
]

SOFT_BATCH_TOKENS = {False: 4096, True: 512}
"""Tokens per teacher-forced forward with soft targets (GPU, CPU): every row's logits are
held at once (4096 x a 262 144-token vocabulary: 4 GiB in float32)."""


class BatchedSequencesContext(ForwardContext):
    """``batch`` sequences of ``length`` tokens each, one extend from an empty cache (module
    docstring). Records the residual streams of ``layers`` (``captured[i] [B * S, d]``).
    Logits for each sequence's last row, or with ``all_logits`` for every row. No GDN
    layers (``gdn`` raises)."""

    def __init__(
        self,
        config: HybridConfig,
        batch: int,
        length: int,
        layers: Sequence[int],
        device: torch.device | str,
        all_logits: bool = False,
    ) -> None:
        dev = torch.device(device)
        positions = torch.arange(length, device=dev).repeat(batch)
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int64) * length
        rows = torch.arange(batch * length, device=dev) if all_logits else cu[1:] - 1
        super().__init__(ForwardMode.EXTEND, positions, cu, rows)
        self.config = config
        self.batch, self.length = batch, length
        self.layers = set(layers)
        self.captured: dict[int, torch.Tensor] = {}

    def attention(self, layer_idx, q, k, v, *, sinks=None):
        c, b, s = self.config, self.batch, self.length
        window = c.layer_window(layer_idx)
        if sinks is not None:  # rare: the reference math, one sequence at a time
            pos = self.positions[:s]
            out = [
                masked_attention(
                    q[i * s : (i + 1) * s],
                    k[i * s : (i + 1) * s],
                    v[i * s : (i + 1) * s],
                    pos,
                    pos,
                    window,
                    c.attention_scale,
                    sinks,
                )
                for i in range(b)
            ]
            return torch.cat(out)
        qq = q.reshape(b, s, *q.shape[1:]).transpose(1, 2)
        kk = k.reshape(b, s, *k.shape[1:]).transpose(1, 2)
        vv = v.reshape(b, s, *v.shape[1:]).transpose(1, 2)
        group = qq.shape[1] // kk.shape[1]
        if group > 1:
            kk = kk.repeat_interleave(group, dim=1)
            vv = vv.repeat_interleave(group, dim=1)
        pos = torch.arange(s, device=q.device)
        dist = pos[:, None] - pos[None, :]
        mask = dist >= 0
        if window is not None:
            mask &= dist < window
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=c.attention_scale)
        return o.transpose(1, 2).reshape(b * s, q.shape[1], v.shape[-1])

    def gdn(self, layer_idx, mixed_qkv, g, beta, *, conv_weight):
        raise NotImplementedError("BatchedSequencesContext: no GDN layers (use DenseContext)")

    def capture_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        if layer_idx in self.layers:
            self.captured[layer_idx] = hidden.clone()


class _DenseCapture(DenseContext):
    def __init__(self, cache, slots, num_tokens, layers):
        super().__init__(cache, slots, num_tokens, ForwardMode.EXTEND)
        self.layers = set(layers)
        self.captured: dict[int, torch.Tensor] = {}

    def capture_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        if layer_idx in self.layers:
            self.captured[layer_idx] = hidden.clone()


def _check_sequences(
    who: str, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
) -> None:
    """``ValueError`` for an empty set, a count mismatch or a prompt length outside
    ``[1, len)``."""
    if len(sequences) != len(prompt_lens) or not sequences:
        raise ValueError(f"{who}: need as many prompt lengths as sequences (>0)")
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        if not 1 <= p < len(seq):
            raise ValueError(f"sequence {i}: prompt length {p} outside [1, {len(seq)})")


def _padded(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [N, longest] int64 padded with 0, lengths [N])`` on the host."""
    lens = torch.tensor([len(s) for s in sequences])
    tokens = torch.zeros(len(sequences), int(lens.max()), dtype=torch.long)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    return tokens, lens


@torch.no_grad()
def teacher_forced_states(
    model: CausalLM,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    layers: Sequence[int],
    *,
    max_batch_tokens: int | None = None,
    soft_top_k: int = 0,
) -> Rollouts:
    """The residual streams after ``layers`` at every position of every sequence (module
    docstring), ``max_batch_tokens`` padded tokens per forward (default: 4096 on the CPU,
    262 144 on a GPU). ``prompt_lens[i]``: where sequence ``i``'s continuation starts (the
    first anchor a drafter trains on). With ``soft_top_k`` ``k > 0`` also the target's own
    next-token distribution at every position, its ``k`` most probable tokens
    (``Rollouts.soft_ids`` / ``soft_probs``: float32 softmax of the logits, stored as float16;
    the forwards then hold every row's logits, so they take at most
    :data:`SOFT_BATCH_TOKENS` tokens; models without GDN layers). ``ValueError`` for an
    empty sequence, a prompt length outside ``[1, len)``, a sequence past the target's
    context, or soft targets of a model with GDN layers."""
    c, dev = model.config, model.device
    layers = tuple(layers)
    _check_sequences("teacher_forced_states", sequences, prompt_lens)
    for i, seq in enumerate(sequences):
        if len(seq) > c.max_context:
            raise ValueError(f"sequence {i}: {len(seq)} tokens exceed the context {c.max_context}")
    if any(not 0 <= i < c.num_layers for i in layers):
        raise ValueError(f"layers {layers} out of range for a target of {c.num_layers} layers")
    if soft_top_k < 0 or soft_top_k > c.vocab_size:
        raise ValueError(f"soft_top_k must be in [0, {c.vocab_size}], got {soft_top_k}")
    if soft_top_k and c.gdn_layers:
        raise ValueError("soft targets: models with GDN layers are not supported")
    cpu = torch.device(dev).type == "cpu"
    if max_batch_tokens is None:
        max_batch_tokens = 4096 if cpu else 262_144
    if soft_top_k:
        max_batch_tokens = min(max_batch_tokens, SOFT_BATCH_TOKENS[cpu])
    n = len(sequences)
    tokens, lens = _padded(sequences)
    longest = tokens.shape[1]
    tokens = tokens.to(dev)
    hidden = [torch.zeros(n, longest, c.d_model, dtype=c.dtype, device=dev) for _ in layers]
    soft_ids = soft_probs = None
    if soft_top_k:
        soft_ids = torch.zeros(n, longest, soft_top_k, dtype=torch.int32, device=dev)
        soft_probs = torch.zeros(n, longest, soft_top_k, dtype=torch.float16, device=dev)
    order = torch.argsort(lens, descending=True).tolist()  # similar lengths share a batch
    batched = not c.gdn_layers
    start = 0
    while start < n:
        width = len(sequences[order[start]])
        rows = max(1, max_batch_tokens // width)
        idx = order[start : start + rows]
        start += len(idx)
        if batched:
            rows_t = torch.tensor(idx, device=dev)
            ctx = BatchedSequencesContext(c, len(idx), width, layers, dev, bool(soft_top_k))
            ids = tokens[rows_t, :width].reshape(-1)
            out = model.forward_with_hidden(ids, ctx)
            for h, i in zip(hidden, layers, strict=True):
                h[rows_t, :width] = ctx.captured[i].reshape(len(idx), width, -1)
            if soft_top_k:
                logits = out.logits.float()
                top, which = logits.topk(soft_top_k, dim=-1)
                probs = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
                shape = (len(idx), width, soft_top_k)
                soft_ids[rows_t, :width] = which.reshape(shape).to(torch.int32)
                soft_probs[rows_t, :width] = probs.reshape(shape).to(torch.float16)
            continue
        cache = DenseCache(c, len(idx), dev)
        slots = [cache.alloc() for _ in idx]
        counts = [len(sequences[r]) for r in idx]
        ids = torch.cat([tokens[r, : len(sequences[r])] for r in idx])
        ctx = _DenseCapture(cache, slots, counts, layers)
        model.forward_with_hidden(ids, ctx)
        offset = 0
        for r, m in zip(idx, counts, strict=True):
            for h, i in zip(hidden, layers, strict=True):
                h[r, :m] = ctx.captured[i][offset : offset + m]
            offset += m
    if soft_top_k:  # nothing past each sequence's end
        past = torch.arange(longest, device=dev)[None, :] >= lens.to(dev)[:, None]
        soft_probs[past] = 0
    return Rollouts(
        tokens, hidden, torch.tensor(list(prompt_lens)), lens, layers, soft_ids, soft_probs
    )


def tokens_only(
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    layers: Sequence[int],
    device: torch.device | str,
) -> Rollouts:
    """``sequences`` as :class:`~unimem.training.distill.Rollouts` without states
    (``hidden`` empty, tokens padded with 0 on ``device``): training text whose states
    :func:`states_of` computes per batch. ``ValueError`` as :func:`teacher_forced_states`
    for an empty set or a prompt length outside ``[1, len)``."""
    _check_sequences("tokens_only", sequences, prompt_lens)
    tokens, lens = _padded(sequences)
    return Rollouts(tokens.to(device), [], torch.tensor(list(prompt_lens)), lens, tuple(layers))


@torch.no_grad()
def states_of(model: CausalLM, part: Rollouts, *, soft_top_k: int = 0) -> Rollouts:
    """``part`` (a few sequences, e.g. one training batch of :func:`tokens_only` text) with
    the residual streams of ``part.layers`` (and with ``soft_top_k`` the soft targets)
    computed now by :func:`teacher_forced_states`: the same values that function gives when
    it runs over the whole text, since each sequence's states depend on its own tokens only
    (bitwise only if the forwards batch the same sequences: GEMMs of another shape may
    round differently)."""
    lengths = part.lengths.tolist()
    rows = part.tokens.cpu()
    seqs = [rows[i, :n].tolist() for i, n in enumerate(lengths)]
    return teacher_forced_states(
        model, seqs, part.prompt_lens.tolist(), part.layers, soft_top_k=soft_top_k
    )
