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

*Block verification* (``verify="block"``; Sun et al., "Block Verification Accelerates
Speculative Decoding", ICLR 2025) decides the chain jointly instead of draft by draft, and is
as exact while never committing fewer tokens in expectation. With ``r_j = p_j(x_{j+1}) /
q_j(x_{j+1})``, the weights ``w_0 = 1``, ``w_i = min(1, w_{i-1} r_{i-1})``
(:func:`block_weights`), the masses ``rho_i = sum_v max(0, w_i p_i(v) - q_i(v))`` and stop
probabilities ``h_i = rho_i / (rho_i + 1 - w_i)`` for ``i`` below the chain's end, ``h_end =
w_end``: going down from the end, the step keeps the first ``i`` drafts with probability
``h_i`` (``h_0 = 1``), then draws its last token from ``norm(max(0, w_i p_i - q_i))`` — from
``p_end`` after a whole chain. The drafts past the kept ones influence that decision, so a
step's draft noise and stop uniforms are keyed by the step (:func:`step_keys`), not by the
position a token lands on: a position drafted again in a later step must not reuse noise an
earlier decision depended on. (Token verification's drafts past the first rejection influence
nothing, so they keep position keys.)

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
from unimem_kernel.block_overlap import block_overlap

__all__ = [
    "SAMPLED_VERIFY",
    "STEP_COLUMNS",
    "STREAM_ACCEPT",
    "STREAM_BLOCK_DRAFT",
    "STREAM_BLOCK_STOP",
    "STREAM_DRAFT",
    "STREAM_RESIDUAL",
    "ChainSample",
    "Proposals",
    "block_stop_probabilities",
    "block_weights",
    "chain_accept",
    "chain_accept_block",
    "chain_accept_block_rows",
    "chain_accept_rows",
    "compact_residual_mass",
    "draft_keys",
    "draw",
    "replace_proposal",
    "residual_distribution",
    "rows_draw",
    "step_keys",
    "stream_keys",
    "uniforms",
    "weighted_residual",
]

STREAM_DRAFT = 1
"""Gumbel noise of the drafter's draw of the token at a position."""
STREAM_ACCEPT = 2
"""The uniform that decides whether the draft at a position is accepted."""
STREAM_RESIDUAL = 3
"""Gumbel noise of the target's draw at a position (residual after a rejection, or bonus)."""
STREAM_BLOCK_DRAFT = 4
"""Block verification: the drafter's Gumbel noise of a step's column (:func:`step_keys`)."""
STREAM_BLOCK_STOP = 5
"""Block verification: the uniform of a step's stop decision at a column (:func:`step_keys`)."""
STEP_COLUMNS = 64
"""Columns a step's keys can tell apart (:func:`step_keys`): ``gamma + 1 <= STEP_COLUMNS``."""

SAMPLED_VERIFY = ("token", "block")
"""How a sampled verify step decides its chain: draft by draft (:func:`chain_accept_rows`) or
jointly (:func:`chain_accept_block_rows`)."""

_FLOOR = torch.finfo(torch.float32).min  # a finite cut: log(0) = -inf entries are never drawn


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """32-bit keys (int64) of ``stream`` for ``seeds [bs]`` (int64) at ``positions [bs]`` or
    ``[bs, k]`` (each row's seed for all its positions); the shape of ``positions``."""
    s = seeds.long()
    if positions.dim() == 2:
        s = s[:, None].expand_as(positions)
    flat = kernel.position_keys(s.reshape(-1), positions.long().reshape(-1), stream)
    return flat.reshape(positions.shape)


def step_keys(seeds: torch.Tensor, first: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """``[bs, count]`` keys of ``stream`` for columns ``0 .. count - 1`` of the verify step
    whose first row predicts position ``first [bs]`` (``seq_len + 1``: it grows every step of
    a request, so no two of its steps share keys). ``count <= STEP_COLUMNS``."""
    if count > STEP_COLUMNS:
        raise ValueError(f"a step has at most {STEP_COLUMNS} columns of keys, asked {count}")
    cols = torch.arange(count, device=first.device)
    return stream_keys(seeds, first.long()[:, None] * STEP_COLUMNS + cols[None, :], stream)


def draft_keys(
    seeds: torch.Tensor, seq_lens: torch.Tensor, gamma: int, verify: str
) -> torch.Tensor:
    """``[bs, gamma]`` keys of the drafter's Gumbel noise for a step from committed lengths
    ``seq_lens [bs]`` (column ``i`` proposes the token at ``seq_len + 1 + i``): by position
    under token verification, by step under block verification (module docstring)."""
    first = seq_lens.long() + 1
    if verify == "block":
        return step_keys(seeds, first, gamma, STREAM_BLOCK_DRAFT)
    if verify != "token":
        raise ValueError(f"verify must be one of {SAMPLED_VERIFY}, got {verify!r}")
    cols = torch.arange(gamma, device=first.device)
    return stream_keys(seeds, first[:, None] + cols[None, :], STREAM_DRAFT)


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
    px, qx, last = _dense_inputs(draft, q, p)
    return chain_accept_rows(draft, qx, px, last, seeds, positions, limit)


def _dense_inputs(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor):
    """``(px, qx, last_draw)`` of a chain over materialised ``q [bs, gamma, V]`` and ``p [bs,
    gamma + 1, V]``: each draft's probabilities under both and :func:`rows_draw` over their
    rows (``ValueError`` on other shapes)."""
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

    return px, qx, rows_draw(lambda col: rows(q, col), lambda col: rows(p, col), gamma)


def rows_draw(
    q_rows: Callable[[torch.Tensor], torch.Tensor],
    p_rows: Callable[[torch.Tensor], torch.Tensor],
    gamma: int,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last draw of :func:`chain_accept_rows` from materialised rows: ``q_rows(col)`` /
    ``p_rows(col)`` (``col [bs]`` int64) give lane ``b``'s rows ``[bs, V]`` of column
    ``col[b]`` (``q_rows`` is asked for columns ``< gamma`` only); the draw is
    :func:`draw` over :func:`residual_distribution` of ``p`` and ``q`` (``q`` counting as 0
    at ``col >= end``). With ``weight [bs]`` (block verification's ``w``, in ``(0, 1]``) the
    residual is ``norm(max(0, w p - q))``, drawn as ``norm(max(0, p - q / w))``."""

    def last(
        col: torch.Tensor, end: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        p_row = p_rows(col)
        q_row = q_rows(col.clamp(max=gamma - 1)) if gamma else torch.zeros_like(p_row)
        q_row = q_row * (col < end).to(q_row.dtype)[:, None]
        if weight is not None:
            return draw(weighted_residual(p_row, q_row, weight.to(q_row.dtype)[:, None]), keys)
        return draw(residual_distribution(p_row, q_row), keys)

    return last


def _check_compact(
    draft: torch.Tensor, qx: torch.Tensor, px: torch.Tensor, positions: torch.Tensor
) -> None:
    """The shapes :func:`chain_accept_rows` and :func:`chain_accept_block_rows` take."""
    bs, gamma = draft.shape
    if qx.shape != (bs, gamma) or px.shape != (bs, gamma):
        raise ValueError(
            f"need qx and px [{bs}, {gamma}] for draft [{bs}, {gamma}], "
            f"got {tuple(qx.shape)} and {tuple(px.shape)}"
        )
    if positions.shape != (bs, gamma + 1):
        raise ValueError(f"positions must be [{bs}, {gamma + 1}], got {tuple(positions.shape)}")


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
    _check_compact(draft, qx, px, positions)
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


def block_weights(
    px: torch.Tensor, qx: torch.Tensor, end: torch.Tensor | None = None
) -> torch.Tensor:
    """Block verification's ``w [bs, gamma + 1]`` float32 from ``px, qx [bs, gamma]``:
    ``w_0 = 1``, ``w_i = min(1, w_{i-1} px_{i-1} / qx_{i-1})`` — in closed form ``exp(S_i -
    max_{j <= i} S_j)`` with ``S`` the running sum of ``log(px / qx)`` (one cumsum and one
    cummax, no loop over columns). Columns at or past ``end [bs]`` (a ragged chain's) count
    as ratio 1 (their ``w`` is never read)."""
    bs, gamma = px.shape
    ratio = torch.log(px.float()) - torch.log(qx.float())
    valid = qx > 0
    if end is not None:
        valid = valid & (torch.arange(gamma, device=px.device)[None, :] < end.long()[:, None])
    ratio = torch.where(valid, ratio, 0.0)
    run = torch.cat([ratio.new_zeros(bs, 1), torch.cumsum(ratio, dim=1)], dim=1)
    return torch.exp(run - torch.cummax(run, dim=1).values)


def block_stop_probabilities(w: torch.Tensor, rho: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Block verification's ``h [bs, gamma + 1]``: the probability of keeping exactly the
    first ``i`` drafts once no longer prefix was kept — ``rho_i / (rho_i + 1 - w_i)`` below
    the chain's ``end [bs]`` (1 where that is 0 / 0), ``w_end`` at it, 0 past it; ``h_0 = 1``.
    ``w [bs, gamma + 1]`` from :func:`block_weights`, ``rho [bs, gamma]`` the residual masses
    ``sum_v max(0, w_i p_i(v) - q_i(v))``."""
    bs, width = w.shape
    rho = rho.float().clamp(min=0.0)
    den = rho + (1.0 - w[:, : width - 1])
    mid = torch.where(den > 0, rho / torch.where(den > 0, den, 1.0), 1.0)
    mid = torch.cat([mid, mid.new_zeros(bs, 1)], dim=1)
    cols = torch.arange(width, device=w.device)[None, :]
    e = end.long()[:, None]
    h = torch.where(cols == e, w, torch.where(cols < e, mid, 0.0))
    return torch.where(cols == 0, 1.0, h)


def weighted_residual(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, w p - q))`` along the last dimension for ``w`` broadcast against it (as
    ``norm(max(0, p - q / w))``; :func:`residual_distribution`'s fallback to ``p``)."""
    return residual_distribution(p, q / w)


def chain_accept_block_rows(
    draft: torch.Tensor,
    qx: torch.Tensor,
    px: torch.Tensor,
    residual_mass: Callable[[torch.Tensor], torch.Tensor],
    last_draw: Callable[..., torch.Tensor],
    seeds: torch.Tensor,
    positions: torch.Tensor,
    limit: torch.Tensor | None = None,
) -> ChainSample:
    """Block verification (module docstring) of one sampled verify step; arguments and result
    as :func:`chain_accept_rows`, plus ``residual_mass(w [bs, gamma]) -> [bs, gamma]``
    float32: ``sum_v max(0, w_i p_i(v) - q_i(v))`` of each lane's column ``i`` (read below
    the chain's end only). ``last_draw(col, end, keys, weight)`` draws from
    ``norm(max(0, weight p - q))`` (``weight [bs]``; 1 where the whole chain is kept, whose
    draw is the bonus from ``p``). Fixed shapes, no host read."""
    bs, gamma = draft.shape
    _check_compact(draft, qx, px, positions)
    end = torch.full((bs,), gamma, device=draft.device) if limit is None else limit.long()
    w = block_weights(px, qx, end)  # [bs, gamma + 1]
    rho = residual_mass(w[:, :gamma])
    h = block_stop_probabilities(w, rho, end)
    cols = torch.arange(gamma + 1, device=draft.device)[None, :]
    # going down from the end, the first column whose uniform falls below its h; h_0 = 1
    eta = uniforms(step_keys(seeds, positions[:, 0], gamma + 1, STREAM_BLOCK_STOP))
    stop = (eta < h) | (cols == 0)
    accepted = torch.where(stop, cols, 0).amax(dim=1).to(torch.int32)
    sel = accepted.long()
    weight = torch.where(sel < end, w.gather(1, sel[:, None])[:, 0], 1.0)
    keys = stream_keys(seeds, positions.gather(1, sel[:, None])[:, 0], STREAM_RESIDUAL)
    repl = last_draw(sel, end, keys, weight)
    d_pad = torch.cat([draft.long(), draft.new_zeros(bs, 1, dtype=torch.long)], dim=1)
    tokens = torch.where(cols < sel[:, None], d_pad, repl[:, None])
    return ChainSample(accepted, tokens)


def chain_accept_block(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    limit: torch.Tensor | None = None,
) -> ChainSample:
    """Block verification over materialised ``q [bs, gamma, V]`` and ``p [bs, gamma + 1, V]``
    (arguments as :func:`chain_accept`): the definition
    :func:`chain_accept_block_rows`' compact callers are checked against."""
    px, qx, last = _dense_inputs(draft, q, p)
    gamma = draft.shape[1]

    def residual_mass(w: torch.Tensor) -> torch.Tensor:
        return torch.clamp(w[:, :, None] * p[:, :gamma].float() - q.float(), min=0.0).sum(-1)

    return chain_accept_block_rows(draft, qx, px, residual_mass, last, seeds, positions, limit)


def compact_residual_mass(
    logits: torch.Tensor,
    vw: int,
    temperature: torch.Tensor,
    cut: torch.Tensor,
    lse: torch.Tensor,
    proposals: Proposals,
    px: torch.Tensor,
    w: torch.Tensor,
) -> torch.Tensor:
    """``[bs, gamma]`` float32: ``sum_v max(0, w_i p_i(v) - q_i(v))`` for every lane and
    column without a ``[bs, gamma, V]`` distribution: since ``p`` sums to 1 it is ``w -
    sum_v min(w p(v), q(v))``, the overlap in one pass over the verify rows' logits
    (:func:`unimem_kernel.block_overlap.block_overlap`: ``p`` as ``residual_draw`` reads it,
    row ``b * vw + i`` of ``logits [M, V]`` over ``temperature [bs]``, kept where ``>= cut``,
    ``exp(s - lse)``; ``q`` the proposals' columns over the draft vocabulary). Where the
    acceptance control replaced a draft (``q`` the point mass on it) it is ``w (1 - px)``.
    Temperature-0 lanes get garbage (never read)."""
    overlap = block_overlap(
        logits, vw, temperature.float(), cut.float(), lse.float(),
        proposals.q_draft.float(), proposals.t2d, proposals.d2t, w.float(),
    )  # fmt: skip
    mass = w.float() - overlap
    return torch.where(proposals.point, w.float() * (1.0 - px.float()), mass).clamp(min=0.0)
