"""What a run held, engine step by engine step (:class:`StepSeries`), recorded from the
host's counts while the engine runs (:class:`SeriesRecorder`): the report's ``"series"``,
which ``--plot`` draws (:mod:`unimem.validate.plot`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unimem.engine.core import EngineCore
from unimem.memory.layout import PageLayout, SlotLayout
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory


@dataclass
class StepSeries:
    """What one run held, engine step by engine step, from the host's counts only (the pool's
    live-unit counters, its stats and the scheduler's lists; nothing is read from the device).

    ``units[kind][i]``: units of ``kind`` (``"full"``, ``"swa"``, ``"state"``) in use at the
    fullest moment of engine step ``i + 1`` (the step's start included: a step that only frees
    keeps the bytes it started with). ``unit_bytes[kind]``: one unit's bytes, of which
    ``draft_unit_bytes[kind]`` belong to the drafter's lanes (0 without speculation). So
    :meth:`used_bytes` is the pool's ``used_bytes()`` at those moments, and its largest value
    is the run's ``peak_bytes``. ``running[i]``: requests running after step ``i + 1``.
    ``compaction_steps`` / ``retraction_steps``: the step of each compaction / retraction, one
    entry each (their lengths are the run's counts). ``capacity``: the fixed walls in bytes,
    static: each pool's size by kind (its sink included; they sum to ``capacity_bytes``),
    unified: ``{"arena": capacity_bytes}``."""

    units: dict[str, list[int]]
    unit_bytes: dict[str, int]
    draft_unit_bytes: dict[str, int]
    running: list[int] = field(default_factory=list)
    compaction_steps: list[int] = field(default_factory=list)
    retraction_steps: list[int] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.running)

    def kind_bytes(self, kind: str, draft: bool = False) -> list[int]:
        """Per step, the bytes of ``kind``'s units in use that hold the target model's layers
        (``draft`` False) or the drafter's lanes (``draft`` True)."""
        d = self.draft_unit_bytes[kind]
        per = d if draft else self.unit_bytes[kind] - d
        return [n * per for n in self.units[kind]]

    def used_bytes(self) -> list[int]:
        """Per step, the bytes of every unit in use (all kinds, draft lanes included)."""
        kinds = list(self.units)
        return [
            sum(self.units[k][i] * self.unit_bytes[k] for k in kinds) for i in range(self.steps)
        ]


class SeriesRecorder:
    """Records a :class:`StepSeries` while an engine runs on ``pool``: call :meth:`step`
    after every engine step and :meth:`close` at the end.

    Host counts only. A step allocates (admission, growth) before it accounts the previous
    step (retirement, release), so its fullest moment lies inside it: the recorder observes
    the pool's usage (``pool.add_usage_observer``: host arithmetic after every operation
    that changes what it holds) to keep, per step, the per-kind counts at the moment the
    total was largest. :meth:`close` stops observing."""

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        kinds = pool.spec.kinds
        self._kinds = [k.value for k in kinds]
        self.series = StepSeries(
            units={k: [] for k in self._kinds},
            unit_bytes={k.value: pool.layout.unit_bytes(k) for k in kinds},
            draft_unit_bytes={k.value: _draft_unit_bytes(pool.layout.of(k)) for k in kinds},
            capacity=_capacity(pool),
        )
        self._fullest = self._sample()
        self._compactions = pool.stats.compactions
        self._retractions = 0
        self._steps = 0
        pool.add_usage_observer(self._observe)

    def _observe(self) -> None:
        now = self._sample()
        if self._bytes(now) > self._bytes(self._fullest):
            self._fullest = now

    def _sample(self) -> tuple[int, ...]:
        return tuple(self.pool.live_units(LayerKind(k)) for k in self._kinds)

    def _bytes(self, units: tuple[int, ...]) -> int:
        return sum(n * self.series.unit_bytes[k] for k, n in zip(self._kinds, units, strict=True))

    def step(self, engine: EngineCore) -> None:
        """Close the step the engine just ran: its fullest counts, running requests, and the
        compactions and retractions it made."""
        s = self.series
        for k, n in zip(self._kinds, self._fullest, strict=True):
            s.units[k].append(n)
        self._fullest = self._sample()
        s.running.append(len(engine.scheduler.running))
        self._steps = engine.steps
        self._marks(engine.scheduler.retractions)

    def _marks(self, retractions: int) -> None:
        s, step = self.series, self._steps
        compactions = self.pool.stats.compactions
        s.compaction_steps += [step] * (compactions - self._compactions)
        s.retraction_steps += [step] * (retractions - self._retractions)
        self._compactions, self._retractions = compactions, retractions

    def close(self, engine: EngineCore) -> StepSeries:
        """Stop observing the pool; compactions or retractions after the last step (the
        final drain) are marked on the last step. Returns the series."""
        self.pool.remove_usage_observer(self._observe)
        self._marks(engine.scheduler.retractions)
        return self.series


def _draft_unit_bytes(layout: PageLayout | SlotLayout) -> int:
    """Bytes of one unit from its first draft lane's block on (the draft lanes follow the
    target's in the envelope), 0 without draft lanes."""
    if layout.num_lanes == layout.num_target:
        return 0
    offsets = layout.k_offsets if isinstance(layout, PageLayout) else layout.conv_offsets
    return layout.unit_bytes - offsets[layout.num_target]


def _capacity(pool: MemoryPool) -> dict[str, int]:
    if isinstance(pool, StaticMemory):
        return {k.value: pool.pools[k].numel() for k in pool.kinds}
    return {"arena": pool.stats.capacity_bytes}
