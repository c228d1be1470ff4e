"""The drafter's training-time forward: dense, differentiable, no paged memory.

At inference (:class:`~unimem.speculative.drafter.DsparkDrafter`) one block forward per
request and step reads context K/V from draft lanes. For distillation the same function is
computed for many anchors of many sequences at once, from the target's captured hidden
states, with the drafter's own modules and math (``_qkv``, ``mlp``, the norms, the shared LM
head, :meth:`~unimem.speculative.drafter.DsparkDrafter.markov_bias`):

* context K/V of draft layer ``j`` at every position ``p`` of a sequence: the fused hidden
  states of the ``target_layers`` at ``p`` through layer ``j``'s K/V projection, RoPE at ``p``
  (= ``context_kv``);
* the block of anchor ``n``: rows ``[embed(tokens[n]), mask x (gamma - 1)]`` at positions
  ``n .. n + gamma - 1``; in each layer a row at ``n + i`` attends the context at positions
  ``< n`` and the block rows ``<= i`` (for an SWA-hosted layer only keys within its window),
  softmax scale ``head_dim_k ** -0.5`` (as the draft runner's), one softmax over both;
* base logits ``[B, A, gamma, out_vocab]`` (= ``block_logits``), and for the loss the Markov
  bias of the teacher-forced previous token ``tokens[n + i]``; under a reduced draft
  vocabulary the targets are draft ids and a target outside it adds no cross-entropy (it
  still counts in the mean: the drafter cannot propose it);
* the confidence head (a drafter with ``DraftConfig.confidence``): the survival logit of
  block row ``i`` from its final hidden state (detached: the head is a probe and does not
  shape the drafter) and the embedding of ``tokens[n + i]``, trained by binary cross-entropy
  against whether the drafter's teacher-forced greedy pick at row ``i`` equals the target's
  token ``tokens[n + i + 1]`` — teacher forcing *is* the condition "every earlier draft
  matched", so the head estimates the conditional survival that verify lengths use.

Gradients flow only into the drafter's parameters (the caller turns ``requires_grad`` on);
the target's hidden states, embedding and LM head are constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from unimem.models.nn_ops import rms_norm
from unimem.speculative.drafter import DsparkDrafter

__all__ = [
    "SOFT_LOSSES",
    "DistillLoss",
    "block_forward_dense",
    "block_logits_dense",
    "confidence_targets",
    "context_kv_dense",
    "distill_loss",
    "distill_losses",
]


def context_kv_dense(
    drafter: DsparkDrafter, hidden: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per draft layer ``(k [B, S, Hkv, Dk], v [B, S, Hkv, Dv])`` at positions ``0 .. S-1``
    from ``hidden[i] [B, S, d_model]``, the residual stream after ``target_layers[i]``."""
    c = drafter.config
    if len(hidden) != len(c.target_layers):
        raise ValueError(f"need {len(c.target_layers)} hidden states, got {len(hidden)}")
    b, s, _ = hidden[0].shape
    feats = torch.cat([h.to(c.dtype) for h in hidden], dim=-1).reshape(b * s, -1)
    ctx = rms_norm(F.linear(feats, drafter.fc), drafter.ctx_norm, c.rms_eps)
    positions = torch.arange(s, device=ctx.device).repeat(b)
    rope = drafter._rope_tables(positions)
    out = []
    for j in range(c.num_layers):
        k, v = drafter._kv(j, ctx, rope)
        out.append((k.reshape(b, s, *k.shape[1:]), v.reshape(b, s, *v.shape[1:])))
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    anchors: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Block attention of every anchor: ``q [B, A, G, Hq, Dk]``, block ``k``/``v``
    ``[B, A, G, Hkv, D]``, context ``[B, S, Hkv, D]``. Returns ``[B, A, G, Hq, Dv]``."""
    b, a, g, hq, dk = q.shape
    hkv, s = k.shape[3], ctx_k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = dk**-0.5
    qq = q.to(acc).reshape(b, a, g, hkv, hq // hkv, dk)
    s_ctx = torch.einsum("baikgd,bskd->baikgs", qq, ctx_k.to(acc)) * scale
    s_blk = torch.einsum("baikgd,bajkd->baikgj", qq, k.to(acc)) * scale
    dev = q.device
    rows = torch.arange(g, device=dev)
    q_pos = anchors[:, None] + rows[None, :]  # [A, G]
    k_pos = torch.arange(s, device=dev)
    m_ctx = k_pos[None, None, :] < anchors[:, None, None]  # [A, 1, S]
    m_blk = rows[None, :] <= rows[:, None]  # [G, G]: key j visible to row i iff j <= i
    if window is not None:
        m_ctx = m_ctx & (q_pos[:, :, None] - k_pos[None, None, :] < window)
        m_blk = m_blk & (rows[:, None] - rows[None, :] < window)
    m_ctx = m_ctx.expand(a, g, s)[None, :, :, None, None, :]
    s_ctx = s_ctx.masked_fill(~m_ctx, float("-inf"))
    s_blk = s_blk.masked_fill(~m_blk[None, None, :, None, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    o = torch.einsum("baikgs,bskd->baikgd", probs[..., :s], ctx_v.to(acc))
    o = o + torch.einsum("baikgj,bajkd->baikgd", probs[..., s:], v.to(acc))
    return o.reshape(b, a, g, hq, -1).to(q.dtype)


def block_logits_dense(
    drafter: DsparkDrafter,
    tokens: torch.Tensor,
    hidden: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    gamma: int,
) -> torch.Tensor:
    """Base logits ``[B, A, gamma, vocab]`` of the block forward from every anchor position
    ``anchors [A]`` (each ``>= 1``) of every sequence ``tokens [B, S]``, with the context
    of positions ``< anchor`` from ``hidden[i] [B, S, d_model]`` — what
    :meth:`DsparkDrafter.block_logits` computes for anchor ``tokens[b, n]`` at committed
    length ``n`` when the draft lanes hold the context K/V of positions ``< n``."""
    return block_forward_dense(drafter, tokens, hidden, anchors, gamma)[0]


def block_forward_dense(
    drafter: DsparkDrafter,
    tokens: torch.Tensor,
    hidden: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    gamma: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_logits_dense` and the block's final hidden states ``[B, A, gamma,
    d_model]`` (= :meth:`DsparkDrafter.block_forward`)."""
    c = drafter.config
    b, a = tokens.shape[0], anchors.shape[0]
    anchors = anchors.to(tokens.device).long()
    ctx = context_kv_dense(drafter, hidden)
    first = drafter.embed[tokens[:, anchors]].to(c.dtype)[:, :, None]  # [B, A, 1, d]
    mask = drafter.mask_embed.expand(b, a, gamma - 1, c.d_model)
    x = torch.cat([first, mask], dim=2).reshape(b * a * gamma, c.d_model)
    positions = (anchors[:, None] + torch.arange(gamma, device=anchors.device)).reshape(-1)
    rope = drafter._rope_tables(positions.repeat(b))
    for j, layer in enumerate(drafter.layers):
        q, k, v = drafter._qkv(j, x, rope)
        shape = (b, a, gamma)
        o = _attend(
            q.reshape(*shape, *q.shape[1:]),
            k.reshape(*shape, *k.shape[1:]),
            v.reshape(*shape, *v.shape[1:]),
            *ctx[j],
            anchors,
            c.layer_window(j),
        )
        x = x + F.linear(o.reshape(x.shape[0], -1), layer.o_proj)
        x = x + layer.mlp(x, c.rms_eps)
    h = rms_norm(x, drafter.final_norm, c.rms_eps)
    logits = F.linear(h, drafter.head_weight.to(c.dtype))
    if logits.dtype != torch.float64:
        logits = logits.float()
    return logits.reshape(b, a, gamma, c.out_vocab), h.reshape(b, a, gamma, c.d_model)


SOFT_LOSSES = ("ce", "tv")
"""The soft term of :func:`distill_losses`: cross-entropy or total variation."""


class DistillLoss(NamedTuple):
    """``ce``: mean cross-entropy of the drafts; ``bce``: mean binary cross-entropy of the
    confidence head (zero without one); ``n``: targets counted; ``survival [B, A, gamma]`` the
    head's probabilities and ``accepted [B, A, gamma]`` its 0/1 targets (None without a
    head), ``valid [B, A, gamma]`` which entries count."""

    ce: torch.Tensor
    bce: torch.Tensor
    n: int
    survival: torch.Tensor | None
    accepted: torch.Tensor | None
    valid: torch.Tensor


def confidence_targets(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the greedy pick of ``logits [..., vocab]`` (base + the teacher-forced Markov
    bias) equals ``target [...]``, else 0.0 (the confidence head's BCE targets)."""
    return (logits.argmax(dim=-1) == target).to(logits.dtype)


def distill_loss(
    drafter: DsparkDrafter,
    tokens: torch.Tensor,
    hidden: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    gamma: int,
    first_anchor: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy of the block of each anchor ``n`` against ``tokens[n + 1 ..
    n + gamma]``, the logits being the base logits plus the Markov bias of the teacher-forced
    previous token ``tokens[n + i]``. Per sequence ``b`` only anchors ``>= first_anchor[b]``
    and targets at positions ``< lengths[b]`` count. Returns ``(loss, number of targets)``
    (a zero loss if none counts); :func:`distill_losses` also gives the confidence head's."""
    out = distill_losses(drafter, tokens, hidden, anchors, gamma, first_anchor, lengths)
    return out.ce, out.n


def distill_losses(
    drafter: DsparkDrafter,
    tokens: torch.Tensor,
    hidden: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    gamma: int,
    first_anchor: torch.Tensor,
    lengths: torch.Tensor,
    soft: tuple[torch.Tensor, torch.Tensor] | None = None,
    soft_weight: float = 0.0,
    position_decay: float = 1.0,
    soft_temperature: float = 1.0,
    soft_loss: str = "ce",
) -> DistillLoss:
    """:func:`distill_loss` and, for a drafter with a confidence head, its binary
    cross-entropy against :func:`confidence_targets` over the same entries (module
    docstring).

    ``position_decay`` ``d`` in ``(0, 1]``: the cross-entropy of block column ``i`` weighs
    ``d ** i`` (the mean is over the weights): a draft is accepted only after every earlier
    one, so the early columns carry the accept length. 1 (default): every column alike,
    the plain mean.

    ``soft = (ids, probs)`` (``[B, S, k]``: the target's ``k`` most probable next tokens at
    every position and their probabilities, :class:`~unimem.training.distill.Rollouts`'s
    ``soft_ids`` / ``soft_probs``) with ``soft_weight`` ``w > 0``: each entry's loss is
    ``(1 - w)`` times its cross-entropy against the token plus ``w`` times its cross-entropy
    against the target's distribution at the previous position — the one that picked the
    token — over its ``k`` tokens that the drafter can propose, renormalised (none of them:
    no term). On greedy text that distribution is the verifier's at every block row.

    ``soft_temperature`` ``T``: the soft term compares the distributions at ``T`` (the
    target's ``probs ** (1 / T)`` renormalised over those tokens, the drafter's
    ``softmax(logits / T)``) — the temperature speculative sampling runs at. ``soft_loss``:
    ``"ce"`` the cross-entropy above; ``"tv"`` ``1 - sum min(p, q)`` over the ``k`` tokens,
    the probability that a draft sampled from ``q`` is rejected by a verifier sampling from
    ``p`` (what speculative sampling's accept length is made of; Leviathan et al. 2023)."""
    if soft_loss not in SOFT_LOSSES:
        raise ValueError(f"soft_loss must be one of {SOFT_LOSSES}, got {soft_loss!r}")
    if not soft_temperature > 0:
        raise ValueError(f"soft_temperature must be > 0, got {soft_temperature}")
    base, h = block_forward_dense(drafter, tokens, hidden, anchors, gamma)
    b, s = tokens.shape
    anchors = anchors.to(tokens.device).long()
    steps = torch.arange(gamma, device=tokens.device)
    prev_pos = anchors[:, None] + steps[None, :]  # [A, G]
    tgt_pos = prev_pos + 1
    idx = lambda pos: pos.clamp(max=s - 1).reshape(-1)  # noqa: E731
    prev = tokens[:, idx(prev_pos)].reshape(b, *prev_pos.shape)
    target = tokens[:, idx(tgt_pos)].reshape(b, *tgt_pos.shape)
    logits = base + drafter.markov_bias(prev).to(base.dtype)
    valid = (tgt_pos[None] < lengths[:, None, None].to(tokens.device)) & (
        anchors[None, :, None] >= first_anchor[:, None, None].to(tokens.device)
    )
    # under a reduced vocabulary a target outside it has no class: no cross-entropy term,
    # and its draft is never accepted (the confidence target is 0)
    target = drafter.to_draft(target)
    vocab = logits.shape[-1]
    in_vocab = target < vocab
    if soft is None or soft_weight <= 0:
        ce = F.cross_entropy(
            logits.reshape(-1, vocab),
            target.clamp(max=vocab - 1).reshape(-1),
            reduction="none",
        ).reshape(valid.shape)
        ce = ce * in_vocab
    else:
        logp = torch.log_softmax(logits, dim=-1)
        ce = -logp.gather(-1, target.clamp(max=vocab - 1)[..., None])[..., 0] * in_vocab
        soft_ids, soft_probs = soft
        k = soft_ids.shape[-1]
        at = idx(prev_pos)
        dids = drafter.to_draft(soft_ids[:, at].reshape(b, *prev_pos.shape, k))
        p = soft_probs[:, at].reshape(b, *prev_pos.shape, k).float() * (dids < vocab)
        if soft_temperature != 1.0:
            p = p.clamp_min(0.0) ** (1.0 / soft_temperature)
            logp_t = torch.log_softmax(logits / soft_temperature, dim=-1)
        else:
            logp_t = logp
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        at_ids = logp_t.gather(-1, dids.clamp(max=vocab - 1))
        if soft_loss == "tv":
            soft_term = 1.0 - torch.minimum(p, at_ids.exp() * (dids < vocab)).sum(-1)
        else:
            soft_term = -(p * at_ids).sum(-1)
        ce = (1.0 - soft_weight) * ce + soft_weight * soft_term
    n = int(valid.sum())
    survival = accepted = None
    bce = ce.sum() * 0.0
    weight = valid
    if position_decay != 1.0:
        weight = valid * position_decay ** steps.to(ce.dtype)  # [B, A, G]: column i, d ** i
    if drafter.config.confidence:
        z = drafter.survival_logits(h.detach(), prev)
        accepted = confidence_targets(logits.detach(), target).to(z.dtype)
        survival = torch.sigmoid(z.detach())
        if n:
            terms = F.binary_cross_entropy_with_logits(z, accepted, reduction="none")
            bce = (terms * valid).sum() / n
    if n == 0:
        return DistillLoss(ce.sum() * 0.0, bce, 0, survival, accepted, valid)
    if weight is valid:
        return DistillLoss((ce * valid).sum() / n, bce, n, survival, accepted, valid)
    return DistillLoss((ce * weight).sum() / weight.sum(), bce, n, survival, accepted, valid)
