"""Per-request sampling options: what a caller asks for.

:class:`SamplingOptions` uses SGLang's names and conventions (``temperature`` 0 is greedy,
``top_k`` -1 or 0 is off); a request without a seed gets :func:`default_seed` of the
engine's ``random_seed`` and its id. The device sampler that turns a step's logits into
tokens from these options, row by row, is :mod:`unimem.models.sampler` (re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unimem.models.sampler import (
    cut_rule,
    filtered_probs,
    gumbel_noise,
    hash_uniform,
    keep_threshold,
    sample,
)

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

    @property
    def cut_rule(self) -> str | None:
        """The cut-off rule this request fits (:func:`unimem.models.sampler.cut_rule`; None:
        greedy, any rule)."""
        return cut_rule(self.temperature, self.top_k, self.top_p, self.min_p)


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
