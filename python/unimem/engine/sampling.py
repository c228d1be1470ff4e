"""Per-request sampling options and the on-device sampler of a step.

:class:`SamplingOptions` is what a caller asks for (SGLang's names and conventions:
``temperature`` 0 is greedy, ``top_k`` -1 or 0 is off). :func:`sample` turns a step's logits
into tokens on the device, one row per lane, from per-row parameter tensors:

1. rows with ``temperature == 0`` take ``argmax(logits)`` — bit-identical to greedy decoding;
2. the others: ``logits / temperature``, then top-k, top-p (on the top-k renormalised
   distribution), then min-p (relative to the most likely token); the most likely token is
   always kept. Filters keep every token whose scaled logit is at least the cut-off value of
   the last kept rank, so tokens tied at the cut-off are kept together;
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
shape). Log-probabilities are not its business: the runner reports the chosen token's
log-probability under the *unfiltered*, untempered distribution (SGLang's raw logprob).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import unimem_kernel.sampling as kernel

__all__ = [
    "SamplingOptions",
    "default_seed",
    "filtered_probs",
    "gumbel_noise",
    "hash_uniform",
    "keep_threshold",
    "sample",
    "seed_to_int64",
]

GREEDY_TEMPERATURE = 0.0


@dataclass(frozen=True)
class SamplingOptions:
    """How one request picks its tokens. ``temperature`` 0 (default): greedy. ``top_p`` in
    ``(0, 1]``, ``top_k`` -1 or 0 for off (else a positive int), ``min_p`` in ``[0, 1]``.
    ``seed``: any int (reduced modulo 2**64); None: the engine draws one from its
    ``random_seed`` and the request id. ``ValueError`` naming the field if invalid."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == GREEDY_TEMPERATURE


GREEDY = SamplingOptions()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def seed_to_int64(seed: int) -> int:
    """``seed`` modulo 2**64 as a signed int64 (what the device tensors hold)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def default_seed(random_seed: int, rid: int) -> int:
    """The seed of a request without one: a 64-bit mix of the engine's ``random_seed`` and
    the request id ``rid`` (deterministic per engine run), as a signed int64."""
    return seed_to_int64(_splitmix64(_splitmix64(random_seed % (1 << 64)) ^ rid))


# ------------------------------------------------------------------- counter-based noise


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u [N, vocab]`` float32 in ``(0, 1)``: a pure function of ``(seeds[n],
    positions[n], v)`` (:func:`unimem_kernel.sampling.hash_uniform` of the row keys)."""
    return kernel.hash_uniform(kernel.row_keys(seeds, positions), vocab)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of :func:`hash_uniform`, ``[N, vocab]``."""
    return kernel.gumbel_noise(kernel.row_keys(seeds, positions), vocab)


# ------------------------------------------------------------------- filters and sampling


def keep_threshold(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per row, the smallest scaled logit that top-k, then top-p (over the top-k
    renormalised probabilities: keep the smallest prefix of descending probability whose mass
    reaches ``top_p``), then min-p (probability at least ``min_p`` times the largest) keep;
    the most likely token is always kept. ``scaled [N, V]`` float32 → ``[N]``."""
    n, vocab = scaled.shape
    desc, _ = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(desc, dim=-1)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k[:, None] > 0, top_k[:, None].long(), vocab)
    keep = ranks < k
    pk = probs * keep
    before = torch.cumsum(pk, dim=-1) - pk  # mass of higher-ranked kept tokens
    total = pk.sum(dim=-1, keepdim=True)
    keep &= (before < top_p[:, None] * total) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep |= ranks == 0
    last = keep.sum(dim=-1, keepdim=True) - 1  # kept ranks form a prefix
    return desc.gather(1, last)[:, 0]


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """``[N, V]`` float32: per row the distribution :func:`sample` draws from —
    ``softmax(logits / temperature)`` restricted to the tokens :func:`keep_threshold` keeps and
    renormalised (exact zeros elsewhere); a row with ``temperature == 0`` is the one-hot of
    ``argmax(logits)`` (greedy as a distribution). Speculative sampling's ``p`` and ``q``.
    Fixed shapes, no host reads."""
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    cut = keep_threshold(scaled, top_k, top_p.float(), min_p.float())
    probs = torch.softmax(torch.where(scaled >= cut[:, None], scaled, -math.inf), dim=-1)
    onehot = torch.zeros_like(probs).scatter_(1, torch.argmax(logits, dim=-1)[:, None], 1.0)
    return torch.where(live[:, None], probs, onehot)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (int64 ``[N]``), from per-row ``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``seeds`` (int64) and ``positions`` (the index of the
    token being sampled in its request's prompt + output). Module docstring for the
    semantics; fixed shapes, no host reads."""
    greedy = torch.argmax(logits, dim=-1)
    live = temperature > 0
    t = torch.where(live, temperature.float(), 1.0)
    scaled = logits.float() / t[:, None]
    cut = keep_threshold(scaled, top_k, top_p.float(), min_p.float())
    keys = kernel.row_keys(seeds, positions)
    drawn = kernel.gumbel_argmax(scaled, cut.contiguous(), keys, torch.empty_like(greedy))
    return torch.where(live, drawn, greedy)
