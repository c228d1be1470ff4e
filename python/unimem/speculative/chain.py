"""What an engine needs to decode with a DSPARK chain: the drafter, the block size and the
optional acceptance control, validated together in one place."""

from __future__ import annotations

from dataclasses import dataclass

from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter

__all__ = ["DsparkChain"]


@dataclass(frozen=True)
class DsparkChain:
    """Chain speculative decoding: ``drafter`` proposes ``gamma >= 1`` tokens per step, the
    target verifies ``gamma + 1``. ``control`` (tests, benchmarks) replaces drafted tokens by
    a reference continuation with a seeded probability; None proposes the drafter's tokens."""

    drafter: DsparkDrafter
    gamma: int
    control: AcceptanceControl | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1:
            raise ValueError(f"DsparkChain.gamma must be an int >= 1, got {self.gamma!r}")
        if not isinstance(self.drafter, DsparkDrafter):
            raise ValueError("DsparkChain.drafter must be a DsparkDrafter")

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per request and step: ``gamma + 1``."""
        return self.gamma + 1
