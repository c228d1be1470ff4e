"""A greedy step's pick and its log-probability in one pass over the logits.

``greedy_logprob(logits)`` returns, per row of ``logits [N, V]`` (float32: the engine's logits;
other dtypes run the reference, whose ``logsumexp`` rounds to their dtype), the
argmax token (the first index of the maximum, as ``torch.argmax``) and its log-probability
``logits[token] - logsumexp(logits)`` in float32 — what a greedy decode step with log-probs
computed with ``argmax``, ``gather``, ``logsumexp`` (itself several kernels) and a
subtraction.

Two launches with a grid that depends on ``V`` and ``N`` only: the first splits each row into
fixed chunks of :data:`SPLIT` elements (a function of nothing but the constant) and keeps per
chunk its maximum, the first index of it and ``sum(exp(x - max))`` (an online rescaled sum over
blocks); the second combines a row's chunks in index order. A row's results therefore do not
depend on the other rows (batch-invariant). The token is exact (``torch.argmax``'s, NaN
aside: a NaN row's pick is unspecified); the log-probability agrees with torch's to float32
rounding (``exp``/``log`` and the sum's order). ``greedy_logprob_reference`` is the torch code.

``tempered_token_probs(logits, temperature, tokens, cut=None)`` is the same pass over
tempered logits: per row, the probability of ``tokens[i]`` under ``softmax(logits /
temperature)`` (float32: ``logits / t`` divided as torch divides, IEEE-rounded, then
``exp(s_x - logsumexp(s))``) — with a ``cut`` (a top-k / top-p / min-p cut-off of the tempered
row) over the values ``>= cut`` only, 0.0 for a cut token — and for a row of temperature 0 the
greedy indicator (1.0 where ``tokens[i]`` is the row's first argmax, else 0.0): what a
sampled verify step needs of each row, in two launches instead of a ``where`` over the
tempered logits, a ``logsumexp`` of several passes and an argmax. The same chunks and
combination as above, so a row's value depends on that row only; the division and the
comparison with the cut are torch's own, so a token is kept or cut exactly as the sampler
keeps or cuts it. ``tempered_token_stats`` is the same two launches returning also each
row's log-sum-exp of its kept tempered values and the first index of their maximum (on a
temperature-0 row: the logits' own, the greedy token): a sampled verify step's greedy lanes
take their tokens from it, and its last draw (:mod:`unimem_kernel.residual_draw`) its
normaliser, with no other pass over the logits; with ``raw=True`` the same pass also sums the
untempered, uncut row (``raw_lse``, one more online sum), so the committed tokens' reported
log-probabilities need no greedy pass either.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from unimem_kernel._dispatch import kernel_op, next_pow2

__all__ = [
    "SPLIT",
    "greedy_logprob",
    "greedy_logprob_reference",
    "greedy_logprob_triton",
    "tempered_token_probs",
    "tempered_token_probs_reference",
    "tempered_token_probs_triton",
    "tempered_token_stats",
    "tempered_token_stats_reference",
    "tempered_token_stats_triton",
]

SPLIT = 4096
"""Elements of a row per program of the first pass."""
_BLOCK = 1024
_BIG = 2**62


@triton.jit
def _partial_kernel(x_ptr, t_ptr, c_ptr, m_ptr, i_ptr, s_ptr, rm_ptr, rs_ptr, V, stride_x,
                    n_split, SPLIT_: tl.constexpr, BLOCK: tl.constexpr, TEMPERED: tl.constexpr,
                    CUT: tl.constexpr, RAW: tl.constexpr):  # fmt: skip
    # program (row, sp): max, first index of it and sum(exp(x - max)) of chunk sp of the row
    # (TEMPERED: of x / t, t the row's temperature or 1 where it is 0, divided as torch
    # divides; CUT: values below the row's cut count as -inf, on rows of t > 0; RAW: also
    # the max and sum(exp(x - max)) of the logits themselves, untempered and uncut)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mv = tl.full((BLOCK,), float("-inf"), tl.float32)
    sv = tl.zeros((BLOCK,), tl.float32)
    iv = tl.zeros((BLOCK,), tl.int64)
    rmv = tl.full((BLOCK,), float("-inf"), tl.float32)
    rsv = tl.zeros((BLOCK,), tl.float32)
    start = sp.to(tl.int64) * SPLIT_
    t = 1.0
    cut = float("-inf")
    if TEMPERED:
        t = tl.load(t_ptr + row).to(tl.float32)
        if CUT:
            cut = tl.where(t > 0, tl.load(c_ptr + row).to(tl.float32), float("-inf"))
        t = tl.where(t > 0, t, 1.0)
    for off in range(0, SPLIT_, BLOCK):
        idx = start + off + cols
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf"))
        x = x.to(tl.float32)
        if RAW:
            new_rm = tl.maximum(rmv, x)
            r_alpha = tl.where(rmv == new_rm, 1.0, tl.exp(rmv - new_rm))
            rsv = rsv * r_alpha + tl.where(x == float("-inf"), 0.0, tl.exp(x - new_rm))
            rmv = new_rm
        if TEMPERED:
            x = tl.math.div_rn(x, t)
            if CUT:
                x = tl.where(x >= cut, x, float("-inf"))
        new_m = tl.maximum(mv, x)
        alpha = tl.where(mv == new_m, 1.0, tl.exp(mv - new_m))
        e = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m))
        sv = sv * alpha + e
        iv = tl.where(x > mv, idx, iv)  # strictly greater: a lane keeps its first maximum
        mv = new_m
    m = tl.max(mv, axis=0)
    s = tl.sum(sv * tl.where(mv == m, 1.0, tl.exp(mv - m)), axis=0)
    i = tl.min(tl.where(mv == m, iv, 2**62), axis=0)
    out = row * n_split + sp
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(i_ptr + out, i)
    if RAW:
        rm = tl.max(rmv, axis=0)
        tl.store(rm_ptr + out, rm)
        tl.store(rs_ptr + out, tl.sum(rsv * tl.where(rmv == rm, 1.0, tl.exp(rmv - rm)), axis=0))


@triton.jit
def _row_chunks(m_ptr, i_ptr, s_ptr, row, n_split, BS: tl.constexpr):
    """Row ``row``'s chunks combined in index order: ``(max, its first index, sum of
    exp(x - max))`` over the whole row."""
    k = tl.arange(0, BS)
    mask = k < n_split
    m = tl.load(m_ptr + row * n_split + k, mask=mask, other=float("-inf"))
    s = tl.load(s_ptr + row * n_split + k, mask=mask, other=0.0)
    i = tl.load(i_ptr + row * n_split + k, mask=mask, other=2**62)
    big_m = tl.max(m, axis=0)
    total = tl.sum(s * tl.where(m == big_m, 1.0, tl.exp(m - big_m)), axis=0)
    first = tl.min(tl.where(m == big_m, i, 2**62), axis=0)
    return big_m, first, total


@triton.jit
def _combine_kernel(m_ptr, i_ptr, s_ptr, tok_ptr, lp_ptr, stride_lp, n_split,
                    BS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    big_m, tok, total = _row_chunks(m_ptr, i_ptr, s_ptr, row, n_split, BS)
    lse = tl.log(total) + big_m
    tl.store(tok_ptr + row, tok)
    tl.store(lp_ptr + row * stride_lp, big_m - lse)


@triton.jit
def _token_prob_kernel(x_ptr, t_ptr, c_ptr, tok_ptr, m_ptr, i_ptr, s_ptr, rm_ptr, rs_ptr,
                       p_ptr, lse_ptr, first_ptr, raw_ptr, stride_x, n_split, BS: tl.constexpr,
                       CUT: tl.constexpr, STATS: tl.constexpr, RAW: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    big_m, first, total = _row_chunks(m_ptr, i_ptr, s_ptr, row, n_split, BS)
    t = tl.load(t_ptr + row).to(tl.float32)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    live = t > 0
    sx = tl.math.div_rn(
        tl.load(x_ptr + row * stride_x + tok).to(tl.float32), tl.where(live, t, 1.0)
    )
    lse = tl.log(total) + big_m
    prob = tl.exp(sx - lse)
    if CUT:
        prob = tl.where(sx >= tl.load(c_ptr + row).to(tl.float32), prob, 0.0)
    tl.store(p_ptr + row, tl.where(live, prob, tl.where(tok == first, 1.0, 0.0)))
    if STATS:
        tl.store(lse_ptr + row, lse)
        tl.store(first_ptr + row, first)
    if RAW:
        raw_m, _, raw_total = _row_chunks(rm_ptr, i_ptr, rs_ptr, row, n_split, BS)
        tl.store(raw_ptr + row, tl.log(raw_total) + raw_m)


def greedy_logprob_reference(
    logits: torch.Tensor, out_logprobs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [N] int64, logprobs [N] float32)`` of ``logits [N, V]`` (module docstring).
    ``out_logprobs``: an ``[N]`` float32 tensor (any stride, e.g. a column of the step's
    output buffer) that receives the log-probabilities and is returned; else a new one. The
    kernels (two launches) take float32 logits; the reference is ``argmax`` and
    ``(logits[token] - logsumexp(logits)).float()``."""
    tok = torch.argmax(logits, dim=-1)
    chosen = logits.gather(1, tok[:, None])[:, 0]
    lp = (chosen - torch.logsumexp(logits, dim=-1)).float()
    if out_logprobs is None:
        return tok, lp
    out_logprobs.copy_(lp)
    return tok, out_logprobs


def greedy_logprob_triton(
    logits: torch.Tensor, out_logprobs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`greedy_logprob` (arguments already checked; float32
    logits): two launches."""
    n, v = logits.shape
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n_split = triton.cdiv(v, SPLIT)
    m = torch.empty(n, n_split, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    i = torch.empty(n, n_split, dtype=torch.int64, device=x.device)
    tok = torch.empty(n, dtype=torch.int64, device=x.device)
    lp = out_logprobs if out_logprobs is not None else torch.empty(n, dtype=torch.float32,
                                                                    device=x.device)  # fmt: skip
    if n:
        _partial_kernel[(n, n_split)](x, x, x, m, i, s, m, s, v, x.stride(0), n_split,
                                      SPLIT_=SPLIT, BLOCK=_BLOCK, TEMPERED=False,
                                      CUT=False, RAW=False)  # fmt: skip
        _combine_kernel[(n,)](m, i, s, tok, lp, lp.stride(0), n_split, BS=next_pow2(n_split))
    return tok, lp


def _check(logits: torch.Tensor, out_logprobs: torch.Tensor | None = None) -> bool:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    n, v = logits.shape
    if out_logprobs is not None and (
        out_logprobs.shape != (n,)
        or out_logprobs.dtype != torch.float32
        or out_logprobs.device != logits.device
    ):
        raise ValueError(f"out_logprobs must be a [{n}] float32 tensor on {logits.device}")
    if v == 0:
        raise ValueError("logits must have at least one column")
    return logits.dtype == torch.float32


greedy_logprob = kernel_op(
    "greedy_logprob",
    triton=greedy_logprob_triton,
    reference=greedy_logprob_reference,
    device_of="logits",
    check=_check,
)


def tempered_token_probs_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    tokens: torch.Tensor,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` float32 (module docstring): ``softmax(logits / t)[i, tokens[i]]`` for a row of
    temperature ``t > 0``; for ``t == 0`` 1.0 where ``tokens[i]`` is the row's first argmax,
    else 0.0. ``logits [N, V]``, ``temperature [N]``, ``tokens [N]`` int64. ``cut [N]``
    (float32, optional: a top-k / top-p / min-p cut-off of the tempered logits): a row of
    ``t > 0`` keeps only tempered values ``>= cut`` (the softmax over those; 0.0 for a cut
    token)."""
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    tok = tokens.long()[:, None]
    sx = scaled.gather(1, tok)[:, 0]
    if cut is None:
        prob = torch.exp(sx - torch.logsumexp(scaled, dim=-1))
    else:
        kept = torch.where(scaled >= cut[:, None], scaled, -math.inf)
        prob = torch.where(sx >= cut, torch.exp(sx - torch.logsumexp(kept, dim=-1)), 0.0)
    greedy = (torch.argmax(logits, dim=-1, keepdim=True) == tok)[:, 0].float()
    return torch.where(live, prob, greedy)


def _tempered_launch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    tokens: torch.Tensor,
    cut: torch.Tensor | None,
    stats: bool,
    raw: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The two launches of :func:`tempered_token_probs` (with ``stats`` also each row's
    log-sum-exp and first argmax, :func:`tempered_token_stats`; with ``raw`` also the
    untempered log-sum-exp)."""
    n, v = logits.shape
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    t = temperature.contiguous()
    tok = tokens.contiguous()
    c = cut.contiguous() if cut is not None else t
    n_split = triton.cdiv(v, SPLIT)
    m = torch.empty(n, n_split, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    i = torch.empty(n, n_split, dtype=torch.int64, device=x.device)
    prob = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device) if stats else None
    first = torch.empty(n, dtype=torch.int64, device=x.device) if stats else None
    rm = torch.empty_like(m) if raw else m
    rs = torch.empty_like(m) if raw else s
    raw_lse = torch.empty(n, dtype=torch.float32, device=x.device) if raw else None
    if n:
        _partial_kernel[(n, n_split)](x, t, c, m, i, s, rm, rs, v, x.stride(0), n_split,
                                      SPLIT_=SPLIT, BLOCK=_BLOCK, TEMPERED=True,
                                      CUT=cut is not None, RAW=raw)  # fmt: skip
        _token_prob_kernel[(n,)](x, t, c, tok, m, i, s, rm, rs, prob,
                                 lse if stats else prob, first if stats else tok,
                                 raw_lse if raw else prob, x.stride(0), n_split,
                                 BS=next_pow2(n_split), CUT=cut is not None, STATS=stats,
                                 RAW=raw)  # fmt: skip
    return (prob, lse, first) + ((raw_lse,) if raw else ())


def tempered_token_probs_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    tokens: torch.Tensor,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`tempered_token_probs` (arguments already checked; float32
    logits): two launches."""
    return _tempered_launch(logits, temperature, tokens, cut, stats=False)[0]


def _check_tempered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    tokens: torch.Tensor,
    cut: torch.Tensor | None = None,
    raw: bool = False,
) -> bool:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V >= 1, got {tuple(logits.shape)}")
    n = logits.shape[0]
    rows = (temperature, tokens) + ((cut,) if cut is not None else ())
    if any(r.shape != (n,) for r in rows):
        raise ValueError(
            f"temperature, tokens and cut must be [{n}], got "
            f"{', '.join(str(tuple(r.shape)) for r in rows)}"
        )
    if any(r.device != logits.device for r in rows):
        raise ValueError("logits, temperature, tokens and cut must be on one device")
    return logits.dtype == torch.float32 and all(
        r.dtype == torch.float32 for r in rows if r is not tokens
    )


tempered_token_probs = kernel_op(
    "tempered_token_probs",
    triton=tempered_token_probs_triton,
    reference=tempered_token_probs_reference,
    device_of="logits",
    check=_check_tempered,
)


def tempered_token_stats_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    tokens: torch.Tensor,
    cut: torch.Tensor | None = None,
    raw: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(probs [N], lse [N], first [N])``: ``probs`` as :func:`tempered_token_probs`; ``lse``
    (float32) the log-sum-exp of each row's kept tempered values (of the logits themselves on
    a row of temperature 0); ``first`` (int64) the first index of their maximum — on a row of
    temperature 0 the row's first ``argmax``, the greedy token. Arguments as
    :func:`tempered_token_probs`; what a sampled verify step keeps of each row for the
    greedy lanes' tokens and the last token's draw (:mod:`unimem_kernel.residual_draw`).
    ``raw``: a fourth output, ``raw_lse [N]`` float32, the log-sum-exp of the logits
    themselves (untempered, uncut) — each committed token's reported log-probability is
    ``logits[token] - raw_lse``, so a sampled verify step needs no greedy pass for it."""
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    if cut is not None:
        scaled = torch.where(scaled >= torch.where(live, cut, -math.inf)[:, None], scaled,
                             -math.inf)  # fmt: skip
    probs = tempered_token_probs_reference(logits, temperature, tokens, cut)
    out = (probs, torch.logsumexp(scaled, dim=-1), torch.argmax(scaled, dim=-1))
    return out + ((torch.logsumexp(logits.float(), dim=-1),) if raw else ())


def tempered_token_stats_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    tokens: torch.Tensor,
    cut: torch.Tensor | None = None,
    raw: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Triton launcher of :func:`tempered_token_stats` (arguments already checked; float32
    logits): the two launches of :func:`tempered_token_probs`, the untempered log-sum-exp
    (``raw``) summed in the same pass."""
    return _tempered_launch(logits, temperature, tokens, cut, stats=True, raw=raw)


tempered_token_stats = kernel_op(
    "tempered_token_stats",
    triton=tempered_token_stats_triton,
    reference=tempered_token_stats_reference,
    device_of="logits",
    check=_check_tempered,
)
