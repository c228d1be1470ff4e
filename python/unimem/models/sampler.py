"""The on-device sampler of a step: logits to tokens, one row per lane, from per-row
parameter tensors (:class:`SamplingRows`).

:func:`sample`:

1. rows with ``temperature == 0`` take ``argmax(logits)`` — bit-identical to greedy decoding;
2. the others: ``logits / temperature``, then top-k, top-p (on the top-k renormalised
   distribution), then min-p (relative to the most likely token); the most likely token is
   always kept. Filters keep every token whose scaled logit is at least the cut-off value of
   the last kept rank, so tokens tied at the cut-off are kept together. A row with ``0 <
   top_k <=`` :data:`TOP_K_BOUND` finds its cut-off among its ``TOP_K_BOUND`` largest logits
   (:func:`unimem_kernel.top_values.top_values`: ``torch.topk``'s values, selected among the
   chunks with the largest maxima; the filters compare probabilities with each other, so each
   value's weight relative to the largest is all they need), any other row in its whole sorted row:
   which rule a row takes depends on its own top-k only, never on the batch. A batch whose
   every sampled row is bounded (:attr:`SamplingRows.rule` :data:`BOUNDED`, known on the
   host) skips the whole-row sort: one order of magnitude less work over a 262 144-token
   vocabulary; one whose sampled rows have no filter at all
   (:data:`UNFILTERED`: top-k off, top-p 1, min-p 0) sorts nothing: its cut-off is ``-inf``,
   the value the sorted rule finds for such a row (its smallest logit) keeps the same tokens;
3. a token is drawn by the Gumbel-max trick: ``argmax(filtered + g)`` with ``g =
   -log(-log(u))`` and ``u`` from a counter-based hash of ``(seed, position, vocab index)``
   (:func:`unimem_kernel.sampling.gumbel_argmax`: one fused Triton kernel on CUDA — noise,
   mask and argmax without materialising the noise — and its torch reference elsewhere).

The noise depends only on the request's seed, the position of the token it samples (its index
in prompt + output) and the vocabulary index — never on a generator's state, the batch, its
bucket or the neighbouring lanes — so a request's tokens for a fixed seed do not depend on how
it was batched, and a retracted request that recomputes samples the same tokens again.

:func:`sample` has fixed shapes, reads nothing back on the host and never indexes by a mask,
so it can be recorded in a CUDA graph (sorting with ``torch.sort`` is data-independent in
shape). :func:`filtered_probs` is the distribution it draws from (speculative sampling's
``p`` and ``q``). :func:`token_logprobs` is the chosen token's log-probability under the
*unfiltered*, untempered distribution (SGLang's raw logprob).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

import unimem_kernel.sampling as kernel
from unimem_kernel import envs
from unimem_kernel.greedy_pick import (
    greedy_logprob,
    tempered_token_stats,
)
from unimem_kernel.sorted_cut import sorted_cut
from unimem_kernel.top_values import top_values

__all__ = [
    "BOUNDED",
    "CUT_RULES",
    "SORTED",
    "TOP_K_BOUND",
    "UNFILTERED",
    "SamplingRows",
    "batch_cut_rule",
    "cut_rule",
    "filtered_probs",
    "filtered_token_probs",
    "filtered_token_stats",
    "gumbel_noise",
    "hash_uniform",
    "THRESHOLD_CHUNK_ELEMENTS",
    "keep_threshold",
    "sample",
    "tempered_keep_threshold",
    "token_logprobs",
    "top_logprobs",
]


TOP_K_BOUND = 256
"""Rows whose top-k is at most this take the cut-off among their ``TOP_K_BOUND`` largest
logits (module docstring)."""


SORTED = "sorted"
BOUNDED = "bounded"
UNFILTERED = "unfiltered"
CUT_RULES = (SORTED, BOUNDED, UNFILTERED)
"""How a step finds its sampled rows' cut-offs: the host's promise about them
(:attr:`SamplingRows.rule`, from :func:`batch_cut_rule`). :data:`SORTED`: any rows, each by
the rule its own top-k calls for (the bounded cut-off, or its whole sorted row).
:data:`BOUNDED`: every sampled row has ``0 < top_k <= TOP_K_BOUND``; no whole-row sort (a row
that breaks the promise is cut at ``TOP_K_BOUND``). :data:`UNFILTERED`: no sampled row has a
filter (top-k off, top-p 1, min-p 0); nothing is sorted, the cut-off is ``-inf`` (a row that
breaks the promise is not filtered)."""


@dataclass(frozen=True)
class SamplingRows:
    """Sampling parameters of a step's lanes (``[bs]`` device tensors each), and ``rule``:
    the host's promise about the lanes with temperature > 0 (:data:`CUT_RULES`)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int32, <= 0: off
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    rule: str = SORTED

    def __post_init__(self) -> None:
        _check_rule(self.rule)


def _check_rule(rule: str) -> None:
    if rule not in CUT_RULES:
        raise ValueError(f"cut-off rule must be one of {', '.join(CUT_RULES)}, got {rule!r}")


def cut_rule(temperature: float, top_k: int, top_p: float, min_p: float) -> str | None:
    """The :data:`CUT_RULES` member a request with these parameters fits best (None for a
    greedy request, which fits any): :data:`UNFILTERED` without filters, :data:`BOUNDED`
    with ``0 < top_k <= TOP_K_BOUND``, else :data:`SORTED`."""
    if temperature <= 0:
        return None
    if top_k <= 0 and top_p >= 1 and min_p <= 0:
        return UNFILTERED
    if 0 < top_k <= TOP_K_BOUND:
        return BOUNDED
    return SORTED


def batch_cut_rule(rules) -> str:
    """The rule a step takes for lanes of ``rules`` (each a :func:`cut_rule`): the one rule
    every sampled lane shares, else :data:`SORTED` (it serves every lane by its own top-k)."""
    live = {r for r in rules if r is not None}
    return live.pop() if len(live) == 1 else SORTED


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[i, tokens[i]]`` per row (float32): ``logits [N, V]``,
    ``tokens [N]`` int64. Float32 logits take one pass over the rows
    (:func:`unimem_kernel.greedy_pick.greedy_logprob`: each row's argmax ``a`` and its
    log-probability, then ``logits[t] - logits[a] + log p(a)``, exact where ``t`` is the
    argmax) instead of ``logsumexp``'s several; other dtypes compute
    ``logits[t] - logsumexp(logits)`` in their own precision."""
    chosen = logits.gather(1, tokens[:, None].long())[:, 0]
    if logits.dtype != torch.float32:
        return (chosen - torch.logsumexp(logits, dim=-1)).float()
    top, top_lp = greedy_logprob(logits)
    return (chosen - logits.gather(1, top[:, None])[:, 0]) + top_lp


def top_logprobs(
    logits: torch.Tensor, k: int, chosen: torch.Tensor, chosen_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row under ``log_softmax(logits)`` (``logits [N,
    V]``: a step's, before temperature and filters): ``(values [N, k] float32,
    ids [N, k] int64)``, most likely first. ``chosen [N]`` / ``chosen_logprobs [N]``: the
    rows' output tokens and the log-probabilities the step reported for them; where a chosen
    token is among the top ones its value is that one bit for bit (a client comparing a
    token's log-probability with its top list's, as lm-eval's ``is_greedy`` does, sees them
    equal)."""
    top, ids = torch.topk(logits, k, dim=-1)
    values = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).float()
    same = ids == chosen.long()[:, None]
    return torch.where(same, chosen_logprobs.float()[:, None], values), ids


# ------------------------------------------------------------------- counter-based noise


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u [N, vocab]`` float32 in ``(0, 1)``: a pure function of ``(seeds[n],
    positions[n], v)`` (:func:`unimem_kernel.sampling.hash_uniform` of the row keys)."""
    return kernel.hash_uniform(kernel.position_keys(seeds, positions, 0), vocab)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of :func:`hash_uniform`, ``[N, vocab]``."""
    return kernel.gumbel_noise(kernel.position_keys(seeds, positions, 0), vocab)


# ------------------------------------------------------------------- filters and sampling


THRESHOLD_CHUNK_ELEMENTS = 1 << 24
"""Logits per chunk of rows that :func:`keep_threshold` and :func:`filtered_probs` work on
at once (64 rows of a 262 144-token vocabulary). The filters sort and scan whole rows, ~35
bytes of temporaries per logit: over a verify step's ``bs x (gamma + 1)`` rows at once that
is tens of GiB at the largest captured batch, memory the pools were sized without. In
chunks it is ~0.6 GiB whatever the batch; rows are independent, so the result is the same."""


BOUNDED_CHUNK_ELEMENTS = 1 << 28
"""Logits per chunk of rows where no whole row is sorted (:data:`BOUNDED` and
:data:`UNFILTERED` cut-offs and what reads them): the temporaries are per row, not per logit,
so the chunks only keep the top-k's element count within 32-bit indexing (1 024 rows of a
262 144-token vocabulary) — a verify step's rows in one call, not one per 64 rows."""


def _chunk_elements(rule: str) -> int:
    """Logits per chunk of rows for a cut-off of ``rule``."""
    return THRESHOLD_CHUNK_ELEMENTS if rule == SORTED else BOUNDED_CHUNK_ELEMENTS


def _row_chunks(n: int, vocab: int, elements: int | None = None) -> list[slice]:
    if elements is None:  # read at call time (tests shrink it)
        elements = THRESHOLD_CHUNK_ELEMENTS
    rows = max(1, elements // max(vocab, 1))
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _over_row_chunks(fn, first: torch.Tensor, *rest: torch.Tensor, elements: int | None = None):
    """``fn`` of the rows of ``first [N, V]`` and the per-row ``rest``, one chunk of rows
    (``elements`` logits, :data:`THRESHOLD_CHUNK_ELEMENTS` by default) at a time, the results
    written into one output (one per tensor where ``fn`` returns a tuple of per-row
    tensors); a single chunk is ``fn`` itself, with no copy."""
    n, vocab = first.shape
    chunks = _row_chunks(n, vocab, elements)
    if len(chunks) == 1:
        return fn(first, *rest)
    outs = None
    for c in chunks:
        part = fn(first[c], *(t[c] for t in rest))
        parts = part if isinstance(part, tuple) else (part,)
        if outs is None:
            outs = tuple(x.new_empty((n, *x.shape[1:])) for x in parts)
        for o, x in zip(outs, parts, strict=True):
            o[c] = x
    return outs if isinstance(part, tuple) else outs[0]


def keep_threshold(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rule: str = SORTED,
) -> torch.Tensor:
    """Per row, the smallest scaled logit that top-k, then top-p (over the top-k
    renormalised probabilities: keep the smallest prefix of descending probability whose mass
    reaches ``top_p``), then min-p (probability at least ``min_p`` times the largest) keep;
    the most likely token is always kept. ``scaled [N, V]`` float32 → ``[N]``. A row with
    ``0 < top_k <= TOP_K_BOUND`` is cut among its ``TOP_K_BOUND`` largest values, any other
    in its whole sorted row; ``rule`` (:data:`CUT_RULES`): :data:`BOUNDED` takes every row as
    bounded (no whole-row sort), :data:`UNFILTERED` every row as unfiltered (``-inf``, no
    work). Works on chunks of rows (:data:`THRESHOLD_CHUNK_ELEMENTS`) so its temporaries
    stay bounded."""
    _check_rule(rule)
    if rule == UNFILTERED:
        return torch.full((scaled.shape[0],), -math.inf, device=scaled.device)
    fn = _bounded_threshold_rows if rule == BOUNDED else _keep_threshold_rows
    return _over_row_chunks(fn, scaled, top_k, top_p, min_p, elements=_chunk_elements(rule))


def tempered_keep_threshold(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rule: str = SORTED,
) -> torch.Tensor:
    """:func:`keep_threshold` of ``logits / t`` (``t`` the row's temperature, 1 where it is 0),
    float32 ``[N]``, without the tempered ``[N, V]`` copy: the leading values are found among
    the logits and divided afterwards — the same values, since dividing by ``t > 0`` keeps
    their order (ties apart, which are equal values). ``logits [N, V]`` any float dtype;
    ``temperature [N]``; the rest as :func:`keep_threshold`."""
    _check_rule(rule)
    if rule == UNFILTERED:
        return torch.full((logits.shape[0],), -math.inf, device=logits.device)
    t = torch.where(temperature > 0, temperature.float(), 1.0)
    fn = _bounded_threshold_rows if rule == BOUNDED else _keep_threshold_rows
    return _over_row_chunks(
        fn, logits, top_k, top_p.float(), min_p.float(), t, elements=_chunk_elements(rule)
    ).float()


def _descending(values: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """``values [N, W]`` (already in descending order) divided by each row's ``t`` (float32),
    or as they are (``t`` None: already scaled)."""
    return values if t is None else values.float() / t[:, None]


def _keep_threshold_rows(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of either rule: the bounded cut-off where ``0 < top_k <= TOP_K_BOUND`` (and the
    vocabulary is larger than the bound), the whole-row one elsewhere. ``values``: the
    scaled logits, or the logits with ``t`` their rows' temperatures."""
    vocab = values.shape[1]
    desc = _descending(torch.sort(values, dim=-1, descending=True, stable=True)[0], t)
    full = sorted_cut(desc, top_k, top_p, min_p)
    if vocab <= TOP_K_BOUND:
        return full
    bounded = (top_k > 0) & (top_k <= TOP_K_BOUND)
    return torch.where(bounded, _bounded_threshold_rows(values, top_k, top_p, min_p, t), full)


def _bounded_threshold_rows(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    t: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cut-off among each row's ``TOP_K_BOUND`` largest values (top-k clamped to the
    bound). The filters compare probabilities with each other only (top-p over the kept
    ones' renormalised mass, min-p against the largest), so they need each value's weight
    relative to the row's largest (:func:`unimem_kernel.sorted_cut.sorted_cut`): no pass
    over the whole row beyond the top-k. ``values`` and ``t`` as in
    :func:`_keep_threshold_rows`."""
    vocab = values.shape[1]
    if vocab <= TOP_K_BOUND:
        desc = _descending(torch.sort(values, dim=-1, descending=True, stable=True)[0], t)
        return sorted_cut(desc, top_k, top_p, min_p)
    desc = _descending(_leading_values(values), t)
    k = torch.where((top_k > 0) & (top_k <= TOP_K_BOUND), top_k, TOP_K_BOUND)
    return sorted_cut(desc, k, top_p, min_p)


def _leading_values(values: torch.Tensor) -> torch.Tensor:
    """Each row's :data:`TOP_K_BOUND` largest values, descending (``UNIMEM_TOP_VALUES``:
    the select by chunk maxima — its maxima by a Triton kernel on CUDA, or by torch's amax
    to measure it — or ``torch.topk`` over the whole row to measure it)."""
    how = envs.get("UNIMEM_TOP_VALUES")
    if how == "topk":
        return torch.topk(values, TOP_K_BOUND, dim=-1, sorted=True).values
    return top_values(values, TOP_K_BOUND, maxima="torch" if how == "amax" else "kernel")


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rule: str = SORTED,
) -> torch.Tensor:
    """``[N, V]`` float32: per row the distribution :func:`sample` draws from —
    ``softmax(logits / temperature)`` restricted to the tokens :func:`keep_threshold` keeps and
    renormalised (exact zeros elsewhere); a row with ``temperature == 0`` is the one-hot of
    ``argmax(logits)`` (greedy as a distribution). Speculative sampling's ``p`` and ``q``.
    Fixed shapes, no host reads; the temporaries are per chunk of rows
    (:data:`THRESHOLD_CHUNK_ELEMENTS`), the result the only ``[N, V]`` allocation.
    ``rule``: see :func:`keep_threshold`."""
    _check_rule(rule)
    fn = functools.partial(_filtered_rows, rule=rule)
    return _over_row_chunks(fn, logits, temperature, top_k, top_p, min_p)


def _filtered_rows(logits, temperature, top_k, top_p, min_p, rule: str = SORTED) -> torch.Tensor:
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    if rule == UNFILTERED:  # every token kept: the same as a cut at the row's smallest value
        probs = torch.softmax(scaled, dim=-1)
    else:
        threshold = _bounded_threshold_rows if rule == BOUNDED else _keep_threshold_rows
        cut = threshold(scaled, top_k, top_p.float(), min_p.float())
        probs = torch.softmax(torch.where(scaled >= cut[:, None], scaled, -math.inf), dim=-1)
    onehot = torch.zeros_like(probs).scatter_(1, torch.argmax(logits, dim=-1)[:, None], 1.0)
    return torch.where(live[:, None], probs, onehot)


def filtered_token_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    tokens: torch.Tensor,
    rule: str = SORTED,
) -> torch.Tensor:
    """``[N]`` float32: ``filtered_probs(...)[i, tokens[i]]`` without the ``[N, V]``
    distribution: the row's cut-off (:func:`keep_threshold`; none for :data:`UNFILTERED`),
    one normalising pass (the log-sum-exp of the kept scaled logits) and the token's own
    value, ``exp(s_x - lse)`` where kept, 0 where cut; temperature-0 rows: 1 for their argmax,
    else 0. Equal to the gather from :func:`filtered_probs` up to float32 rounding (the
    softmax normalises in another order). ``tokens [N]`` int64; other arguments as there.
    After the cut-off, one pass over the logits (:func:`filtered_token_stats`, whose other
    results it drops)."""
    return filtered_token_stats(logits, temperature, top_k, top_p, min_p, tokens, rule)[0]


def filtered_token_stats(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    tokens: torch.Tensor,
    rule: str = SORTED,
    raw: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`filtered_token_probs` with what the same pass finds of each row besides:
    ``(probs [N], lse [N], first [N], cut [N])`` — ``lse`` the log-sum-exp of the row's kept
    tempered values, ``first`` the first index of their maximum (on a temperature-0 row the
    row's first ``argmax``: the greedy token), ``cut`` the row's cut-off (float32, ``-inf``
    where nothing is cut); with ``raw`` a fifth, ``raw_lse [N]``, the log-sum-exp of the
    logits themselves (untempered, uncut: what reported log-probabilities subtract). A
    sampled verify step's one pass over its ``[bs x (gamma + 1), V]`` logits: the drafts'
    probabilities, the greedy lanes' tokens, each row's normaliser and cut-off for the last
    token's draw (:func:`unimem_kernel.residual_draw.residual_draw`) and the committed
    tokens' log-probabilities."""
    _check_rule(rule)
    fn = functools.partial(_filtered_token_stat_rows, rule=rule, raw=raw)
    return _over_row_chunks(
        fn, logits, temperature, top_k, top_p, min_p, tokens, elements=_chunk_elements(rule)
    )


def _filtered_token_stat_rows(
    logits, temperature, top_k, top_p, min_p, tokens, rule: str = SORTED, raw: bool = False
) -> tuple[torch.Tensor, ...]:
    cut = None
    if rule != UNFILTERED:
        cut = tempered_keep_threshold(logits, temperature, top_k, top_p, min_p, rule)
    probs, lse, first, *raw_lse = tempered_token_stats(logits, temperature, tokens, cut, raw=raw)
    if cut is None:  # nothing cut
        cut = torch.full_like(temperature, -math.inf, dtype=torch.float32)
    return (probs, lse, first, cut, *raw_lse)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    rule: str = SORTED,
) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (int64 ``[N]``), from per-row ``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``seeds`` (int64) and ``positions`` (the index of the
    token being sampled in its request's prompt + output). Module docstring for the
    semantics (``rule``: :func:`keep_threshold`); fixed shapes, no host reads."""
    greedy = torch.argmax(logits, dim=-1)
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    cut = keep_threshold(scaled, top_k, top_p.float(), min_p.float(), rule)
    keys = kernel.position_keys(seeds, positions, 0)
    drawn = kernel.gumbel_argmax(scaled, cut.contiguous(), keys, torch.empty_like(greedy))
    return torch.where(live, drawn, greedy)
