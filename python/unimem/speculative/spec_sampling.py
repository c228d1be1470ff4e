"""Chain speculative sampling (temperature > 0), exact (docs/spec_decoding.md).

A verify step of a sampled request holds, for ``gamma`` drafted tokens ``x_1 .. x_gamma``:

- ``q [bs, gamma, V]``: the distribution each ``x_j`` was drawn from (the drafter's logits with
  the Markov bias, the request's temperature and the same top-k / top-p / min-p filtering as
  the target; a point mass where the acceptance control replaced the draft);
- ``p [bs, gamma + 1, V]``: the target's filtered distributions over the verify rows (row
  ``j`` predicts the position of ``x_{j+1}``; row ``gamma`` the token after ``x_gamma``).

:func:`chain_accept` accepts ``x_{j+1}`` with probability ``min(1, p_j(x_{j+1}) /
q_j(x_{j+1}))`` left to right; at the first rejection (row ``j``) the step's last token is
drawn from :func:`residual_distribution` ``norm(max(0, p_j - q_j))``; after a fully
accepted chain, from ``p_gamma`` (the residual with ``q_gamma = 0``). The committed tokens
are then distributed exactly as tokens sampled one by one from ``p`` (Leviathan et al. 2023,
Chen et al. 2023). :func:`residual_distribution` is looked up at call time, so a test can
replace it (and a wrong residual is caught by the distribution test).

Randomness is counter-based, never a generator's state: every draw is a pure function of the
request's seed, the absolute position of the token it concerns (its index in prompt + output)
and a *stream* id — :data:`STREAM_DRAFT` (the drafter's Gumbel noise), :data:`STREAM_ACCEPT`
(the accept uniforms), :data:`STREAM_RESIDUAL` (the Gumbel noise of the residual / bonus
draw) — all distinct from the token-sampling stream 0 of non-speculative sampling
(:func:`unimem_kernel.sampling.stream_keys`). A request's output therefore does not depend on
its batch, its lane, the memory mode or retractions. Exactness holds because a position's
accept and residual draws are used once in a run, and a draft redrawn at a position (after a
rejection before it) reuses noise that never influenced a committed token.

Everything is fixed-shape torch on device tensors with no host read (capturable); draws use
:func:`unimem_kernel.sampling.gumbel_argmax` (the fused Triton kernel on CUDA) over
``log(probs)``.

What the accept needs of ``p`` and ``q`` is little: each drafted token's probability under
both (``px``, ``qx``: ``[bs, gamma]``) and, per lane, one draw from the row the chain stopped
at. :func:`chain_accept_rows` takes exactly that (the draw as a function of the row), so that
the engine never materialises ``[bs, gamma + 1, V]`` distributions: the verify step computes
``px`` by one normalising pass over the logits
(:func:`unimem.models.sampler.filtered_token_stats`) and draws the last token over the
target's vocabulary in one more (:func:`unimem_kernel.residual_draw.residual_draw`), the
drafter's proposals staying in its own (reduced) vocabulary (:class:`Proposals`).
:func:`rows_draw` is that draw from materialised rows — :func:`residual_distribution` and
:func:`draw`, the definition; :func:`chain_accept` is the accept over materialised ``q`` and
``p`` (tests, and the definition the compact form is checked against).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

import unimem_kernel.sampling as kernel

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RESIDUAL",
    "ChainSample",
    "Proposals",
    "chain_accept",
    "chain_accept_rows",
    "draw",
    "replace_proposal",
    "residual_distribution",
    "rows_draw",
    "stream_keys",
    "uniforms",
]

STREAM_DRAFT = 1
"""Gumbel noise of the drafter's draw of the token at a position."""
STREAM_ACCEPT = 2
"""The uniform that decides whether the draft at a position is accepted."""
STREAM_RESIDUAL = 3
"""Gumbel noise of the target's draw at a position (residual after a rejection, or bonus)."""

_FLOOR = torch.finfo(torch.float32).min  # a finite cut: log(0) = -inf entries are never drawn


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """32-bit keys (int64) of ``stream`` for ``seeds [bs]`` (int64) at ``positions [bs]`` or
    ``[bs, k]`` (each row's seed for all its positions); the shape of ``positions``."""
    s = seeds.long()
    if positions.dim() == 2:
        s = s[:, None].expand_as(positions)
    flat = kernel.position_keys(s.reshape(-1), positions.long().reshape(-1), stream)
    return flat.reshape(positions.shape)


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """A uniform in ``(0, 1)`` (float32) per key, any shape (a pure function of the key)."""
    return kernel.hash_uniform(keys.reshape(-1), 1).reshape(keys.shape)


def draw(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (non-negative weights, need not be normalised),
    int64 ``[N]``: the Gumbel-max draw over ``log(probs)`` with the noise of ``keys [N]``.
    Tokens of weight 0 are never drawn."""
    logp = torch.log(probs.float()).contiguous()
    cut = torch.full((probs.shape[0],), _FLOOR, dtype=torch.float32, device=probs.device)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    return kernel.gumbel_argmax(logp, cut, keys.long().contiguous(), out)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` along the last dimension (any leading shape); where the
    residual has no mass (``p <= q`` everywhere, so a rejection could only come from
    rounding), ``p`` itself."""
    r = torch.clamp(p - q, min=0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, 1.0), p)


def replace_proposal(
    tokens: torch.Tensor, probs: torch.Tensor, take: torch.Tensor, ref: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft column after a deterministic replacement (the acceptance control): where
    ``take [bs]``, the token is ``ref [bs]`` and its proposal distribution the point mass on
    it (the replacement does not depend on the request's randomness, so acceptance then
    keeps ``ref`` with probability ``p(ref)`` and the output stays exact). Returns
    ``(tokens [bs], probs [bs, V])``."""
    tok = torch.where(take, ref.long(), tokens.long())
    point = torch.zeros_like(probs).scatter_(1, tok[:, None], 1.0)
    return tok, torch.where(take[:, None], point, probs)


class ChainSample(NamedTuple):
    """``accepted [bs]`` int32 in ``0..gamma``: drafts accepted; ``tokens [bs, gamma + 1]``
    int64: the step commits ``tokens[b, :accepted[b] + 1]`` (the accepted drafts, then the
    residual or bonus draw); later columns are meaningless."""

    accepted: torch.Tensor
    tokens: torch.Tensor


class Proposals(NamedTuple):
    """A sampled draft block in compact form: ``tokens [bs, gamma]`` int64 (target ids),
    ``qx [bs, gamma]`` float32 (the probability each token was proposed with), ``q_draft [bs,
    gamma, K]`` float32 (each column's distribution over the drafter's ``K``-token
    vocabulary), ``point [bs, gamma]`` bool (the acceptance control replaced the token: its
    proposal is the point mass on it), ``d2t [K]`` int64 (draft id to target id) and ``t2d
    [V]`` int64 (target id to draft id, ``K`` off the draft vocabulary) — both None when the
    drafter scores the whole target vocabulary."""

    tokens: torch.Tensor
    qx: torch.Tensor
    q_draft: torch.Tensor
    point: torch.Tensor
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None = None

    def rows(self, col: torch.Tensor, vocab: int) -> torch.Tensor:
        """``[bs, vocab]`` float32: lane ``b``'s proposal distribution of column ``col[b]``
        over the target vocabulary (zero off ``d2t``; the point mass where replaced)."""
        bs, _, k = self.q_draft.shape
        c = col.long()
        q = self.q_draft.gather(1, c[:, None, None].expand(bs, 1, k))[:, 0].float()
        if self.d2t is not None:
            q = q.new_zeros(bs, vocab).index_copy_(1, self.d2t, q)
        tok = self.tokens.gather(1, c[:, None])
        point = torch.zeros_like(q).scatter_(1, tok, 1.0)
        return torch.where(self.point.gather(1, c[:, None]), point, q)


def chain_accept(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    limit: torch.Tensor | None = None,
) -> ChainSample:
    """Speculative sampling of one verify step (module docstring).

    ``draft [bs, gamma]`` drafted tokens, ``q [bs, gamma, V]`` the distributions they were
    drawn from, ``p [bs, gamma + 1, V]`` the target's filtered distributions, ``seeds [bs]``
    int64, ``positions [bs, gamma + 1]``: the absolute position of the token each verify row
    predicts (``kv_len + 1 + j``). Fixed shapes, no host read.

    ``limit [bs]`` (optional; a ragged verify of ``limit + 1`` rows): the chain of request
    ``b`` is its first ``limit[b]`` drafts — drafts past it are never accepted and row
    ``limit[b]`` is the bonus draw from ``p`` (its ``q`` counts as 0), exactly the chain
    accept of ``gamma = limit[b]``; rows of ``p`` past ``limit`` are never used. Only the
    one row a lane draws from (its first rejection, or the bonus) becomes a residual
    distribution: ``[bs, V]`` temporaries, not ``[bs, gamma + 1, V]``."""
    bs, gamma = draft.shape
    vocab = p.shape[-1]
    if q.shape != (bs, gamma, vocab) or p.shape != (bs, gamma + 1, vocab):
        raise ValueError(
            f"need q [{bs}, {gamma}, V] and p [{bs}, {gamma + 1}, V] for draft [{bs}, {gamma}], "
            f"got {tuple(q.shape)} and {tuple(p.shape)}"
        )
    d = draft.long()
    px = p[:, :gamma].gather(2, d[:, :, None])[:, :, 0].float()
    qx = q.gather(2, d[:, :, None])[:, :, 0].float()

    def rows(x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        return x.gather(1, col[:, None, None].expand(bs, 1, vocab))[:, 0]

    last = rows_draw(lambda col: rows(q, col), lambda col: rows(p, col), gamma)
    return chain_accept_rows(draft, qx, px, last, seeds, positions, limit)


def rows_draw(
    q_rows: Callable[[torch.Tensor], torch.Tensor],
    p_rows: Callable[[torch.Tensor], torch.Tensor],
    gamma: int,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last draw of :func:`chain_accept_rows` from materialised rows: ``q_rows(col)`` /
    ``p_rows(col)`` (``col [bs]`` int64) give lane ``b``'s rows ``[bs, V]`` of column
    ``col[b]`` (``q_rows`` is asked for columns ``< gamma`` only); the draw is
    :func:`draw` over :func:`residual_distribution` of ``p`` and ``q`` (``q`` counting as 0
    at ``col >= end``)."""

    def last(col: torch.Tensor, end: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        p_row = p_rows(col)
        q_row = q_rows(col.clamp(max=gamma - 1)) if gamma else torch.zeros_like(p_row)
        q_row = q_row * (col < end).to(q_row.dtype)[:, None]
        return draw(residual_distribution(p_row, q_row), keys)

    return last


def chain_accept_rows(
    draft: torch.Tensor,
    qx: torch.Tensor,
    px: torch.Tensor,
    last_draw: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    seeds: torch.Tensor,
    positions: torch.Tensor,
    limit: torch.Tensor | None = None,
) -> ChainSample:
    """:func:`chain_accept` from what it reads of ``q`` and ``p`` (module docstring):
    ``qx [bs, gamma]`` and ``px [bs, gamma]`` float32, each drafted token's probability under
    the distribution it was drawn from and under the target's row that predicts it;
    ``last_draw(col, end, keys)`` (each ``[bs]`` int64; called once) each lane's last token,
    drawn with the noise of ``keys[b]`` from ``norm(max(0, p - q))`` of lane ``b``'s column
    ``col[b]`` — ``q`` counting as 0 at ``col[b] >= end[b]`` (the bonus row) — or from ``p``
    where that has no mass (:func:`rows_draw` over materialised rows, the definition). The
    other arguments and the result as :func:`chain_accept`."""
    bs, gamma = draft.shape
    if qx.shape != (bs, gamma) or px.shape != (bs, gamma):
        raise ValueError(
            f"need qx and px [{bs}, {gamma}] for draft [{bs}, {gamma}], "
            f"got {tuple(qx.shape)} and {tuple(px.shape)}"
        )
    if positions.shape != (bs, gamma + 1):
        raise ValueError(f"positions must be [{bs}, {gamma + 1}], got {tuple(positions.shape)}")
    d = draft.long()
    u = uniforms(stream_keys(seeds, positions[:, :gamma], STREAM_ACCEPT))
    ok = u * qx < px  # u < p / q without dividing (q(x) > 0 for a drawn x)
    if limit is not None:  # drafts past the chain are never accepted
        ok = ok & (torch.arange(gamma, device=draft.device)[None, :] < limit.long()[:, None])
    accepted = ok.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)
    # the one draw a lane commits: from row `accepted` (the first rejection's residual, or
    # the bonus from p where q counts as 0 -- past the drafts, or at a ragged chain's end);
    # only that row is materialised, [bs, V], not the whole [bs, gamma + 1, V] chain
    sel = accepted.long()
    end = torch.full_like(sel, gamma) if limit is None else limit.long()
    keys = stream_keys(seeds, positions.gather(1, sel[:, None])[:, 0], STREAM_RESIDUAL)
    repl = last_draw(sel, end, keys)
    cols = torch.arange(gamma + 1, device=draft.device)[None, :]
    d_pad = torch.cat([d, torch.zeros_like(d[:, :1])], dim=1)
    tokens = torch.where(cols < accepted.long()[:, None], d_pad, repl[:, None])
    return ChainSample(accepted, tokens)
