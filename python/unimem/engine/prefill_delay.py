"""Holding admissions back while a full decode batch runs: SGLang's prefill delayer
(``--enable-prefill-delayer`` and its ``--prefill-delayer-*`` flags), for one scheduler.

Why. Every admission costs an extend step. Extend steps run eagerly (their prompt lengths
vary, so they have no CUDA graph), their launch cost hardly depends on how many requests they
admit, and while one runs no request decodes. In a saturated batch requests finish a few at a
time; admitting on every finish then runs an extend step every step or two for one or two
requests each (a CPU run of 512 staggered requests over 64 lanes: 279 extend steps of 1.8
requests beside 526 decode steps). Holding admissions until a batch's worth of lanes is free
trades a few idle lanes for far fewer extend steps. It costs time to first token (bounded by
``max_delay_passes``), so it is off by default, as in SGLang; offline generation (the
drafter's training text) turns it on.

Policy, decided once per scheduling pass (a pass launches one forward) by :meth:`hold`:

- never hold when no request waits, when none runs (nothing would decode meanwhile) or when
  the pool's usage (used over capacity bytes) is below ``token_usage_low_watermark``;
- *slot trigger*: hold while the free lanes (``max_running`` less the running requests) are
  fewer than the largest admission seen, a running maximum that decays by
  :data:`ADMISSION_DECAY` a pass (so one large admission does not set the bar for good);
- *queue trigger* (only with ``queue_min_ratio``): hold while fewer requests wait than
  ``min(running * queue_min_ratio, that maximum)``, for at most ``max_delay_ms`` of wall time
  per episode (default :data:`DEFAULT_MAX_DELAY_MS`);
- never more than ``max_delay_passes`` passes in a row.

An *episode* is a run of held passes; it ends when the next pass admits (or finds nothing to
hold), with an outcome counted in :attr:`PrefillDelayer.outcomes`: ``ready`` (the trigger no
longer holds), ``max_passes``, ``max_delay_ms``, ``watermark`` or ``idle`` (nothing running or
waiting). Everything but the wall-clock cap is a function of the scheduler's state, so ranks
that replay the same scheduling decide alike; the wall-clock cap is refused with more than one
rank (:class:`~unimem.engine.args.EngineArgs`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

__all__ = ["ADMISSION_DECAY", "DEFAULT_MAX_DELAY_MS", "DEFAULT_MAX_DELAY_PASSES", "PrefillDelayer"]

DEFAULT_MAX_DELAY_PASSES = 30
"""SGLang's default ``--prefill-delayer-max-delay-passes``."""
DEFAULT_MAX_DELAY_MS = 5000.0
"""Wall-clock cap of one queue-trigger episode when ``max_delay_ms`` is not given (SGLang's)."""
ADMISSION_DECAY = 0.998
"""Factor a pass applies to the largest admission seen (the slot trigger's bar)."""

OUTCOMES = ("ready", "max_passes", "max_delay_ms", "watermark", "idle")


class PrefillDelayer:
    """The policy of the module docstring. ``max_delay_passes`` >= 1; ``token_usage_low_watermark``
    in ``[0, 1]`` or None; ``queue_min_ratio`` > 0 or None (no queue trigger);
    ``max_delay_ms`` > 0 or None (:data:`DEFAULT_MAX_DELAY_MS`), read only with the queue
    trigger; ``clock`` returns seconds (tests pass their own). ``ValueError`` naming a bad
    value."""

    def __init__(
        self,
        max_delay_passes: int = DEFAULT_MAX_DELAY_PASSES,
        token_usage_low_watermark: float | None = None,
        queue_min_ratio: float | None = None,
        max_delay_ms: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(max_delay_passes, bool) or not isinstance(max_delay_passes, int):
            raise ValueError(f"max_delay_passes must be an int, got {max_delay_passes!r}")
        if max_delay_passes < 1:
            raise ValueError(f"max_delay_passes must be >= 1, got {max_delay_passes}")
        mark = token_usage_low_watermark
        if mark is not None and not (_is_number(mark) and 0 <= mark <= 1):
            raise ValueError(f"token_usage_low_watermark must be in [0, 1], got {mark!r}")
        ratio = queue_min_ratio
        if ratio is not None and not (_is_number(ratio) and ratio > 0):
            raise ValueError(f"queue_min_ratio must be > 0, got {ratio!r}")
        if max_delay_ms is not None and not (_is_number(max_delay_ms) and max_delay_ms > 0):
            raise ValueError(f"max_delay_ms must be > 0, got {max_delay_ms!r}")
        self.max_delay_passes = max_delay_passes
        self.token_usage_low_watermark = mark
        self.queue_min_ratio = queue_min_ratio
        self.max_delay_s = (max_delay_ms or DEFAULT_MAX_DELAY_MS) / 1000
        self.clock = clock
        self.largest_admission = 0.0
        self.delayed = 0  # passes held in the current episode
        self._episode_start: float | None = None
        self.held_passes = 0
        self.outcomes: Counter[str] = Counter()

    def hold(self, *, waiting: int, running: int, max_running: int, usage: float) -> bool:
        """Whether this pass admits nothing (module docstring). Call once per pass, before
        admitting; ``waiting`` / ``running``: the queue's and the running requests' counts,
        ``usage``: the pool's used over capacity bytes. Decays the slot trigger's bar and
        counts the pass."""
        self.largest_admission *= ADMISSION_DECAY
        if not waiting or not running:
            return self._release("idle")
        mark = self.token_usage_low_watermark
        if mark is not None and usage < mark:
            return self._release("watermark")
        slots = max_running - running < self.largest_admission
        queue = False
        if self.queue_min_ratio is not None and not slots:
            queue = waiting < min(running * self.queue_min_ratio, self.largest_admission)
            start = self._episode_start
            if queue and start is not None and self.clock() - start >= self.max_delay_s:
                return self._release("max_delay_ms")
        if not (slots or queue):
            return self._release("ready")
        if self.delayed >= self.max_delay_passes:
            return self._release("max_passes")
        if self.delayed == 0:
            self._episode_start = self.clock()
        self.delayed += 1
        self.held_passes += 1
        return True

    def admitted(self, n: int) -> None:
        """Record that a pass admitted ``n`` requests (raises the slot trigger's bar)."""
        if n > self.largest_admission:
            self.largest_admission = float(n)

    def stats(self) -> dict:
        """``held_passes`` (passes that admitted nothing because of this policy) and
        ``outcomes`` (ended episodes by outcome, every outcome listed)."""
        return {
            "held_passes": self.held_passes,
            "outcomes": {k: self.outcomes[k] for k in OUTCOMES},
        }

    def _release(self, outcome: str) -> bool:
        if self.delayed:
            self.outcomes[outcome] += 1
        self.delayed = 0
        self._episode_start = None
        return False


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and x == x  # not NaN
