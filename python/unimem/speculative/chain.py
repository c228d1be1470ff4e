"""What an engine needs to decode with a DSPARK chain: the drafter, the block size, the
optional acceptance control and the verify-length policy, validated together in one place."""

from __future__ import annotations

from dataclasses import dataclass

from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter
from unimem.speculative.spec_sampling import SAMPLED_VERIFY, STEP_COLUMNS

__all__ = ["VERIFY_LENGTHS", "DsparkChain"]

VERIFY_LENGTHS = ("fixed", "adaptive")
"""Valid ``DsparkChain.verify_lengths``."""


@dataclass(frozen=True)
class DsparkChain:
    """Chain speculative decoding: ``drafter`` proposes ``gamma >= 1`` tokens per step, the
    target verifies ``gamma + 1``. ``control`` (tests, benchmarks) replaces drafted tokens by
    a reference continuation with a seeded probability; None proposes the drafter's tokens.

    ``verify_lengths``: "fixed" verifies ``gamma + 1`` rows per request (the original step);
    "adaptive" chooses each request's length in ``1 .. gamma + 1`` on the device from the
    drafter's confidence head under ``verify_budget`` rows per step (None: ``bs * (gamma +
    1)``, no cut) and packs the rows (:mod:`unimem.speculative.verify_lengths`). A drafter
    without a confidence head runs "adaptive" as "fixed" (:attr:`adaptive` is False).

    ``sampled_verify``: how lanes with temperature > 0 decide their chain — "token" (draft
    by draft) or "block" (jointly; as exact, never fewer tokens in expectation:
    :mod:`unimem.speculative.spec_sampling`). Greedy lanes are unaffected."""

    drafter: DsparkDrafter
    gamma: int
    control: AcceptanceControl | None = None
    verify_lengths: str = "fixed"
    verify_budget: int | None = None
    sampled_verify: str = "token"

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1:
            raise ValueError(f"DsparkChain.gamma must be an int >= 1, got {self.gamma!r}")
        if self.sampled_verify not in SAMPLED_VERIFY:
            raise ValueError(
                f"DsparkChain.sampled_verify must be one of {SAMPLED_VERIFY}, got "
                f"{self.sampled_verify!r}"
            )
        if self.sampled_verify == "block" and self.gamma + 1 > STEP_COLUMNS:
            raise ValueError(
                f"block verification keys at most {STEP_COLUMNS - 1} drafts a step, "
                f"gamma is {self.gamma}"
            )
        if not isinstance(self.drafter, DsparkDrafter):
            raise ValueError("DsparkChain.drafter must be a DsparkDrafter")
        if self.verify_lengths not in VERIFY_LENGTHS:
            raise ValueError(
                f"DsparkChain.verify_lengths must be one of {VERIFY_LENGTHS}, got "
                f"{self.verify_lengths!r}"
            )
        b = self.verify_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"DsparkChain.verify_budget must be None or an int >= 1, got {b!r}")

    @property
    def adaptive(self) -> bool:
        """Whether verify steps choose per-request lengths (adaptive mode and a drafter with
        a confidence head)."""
        return self.verify_lengths == "adaptive" and self.drafter.config.confidence

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per request and step: ``gamma + 1``."""
        return self.gamma + 1
