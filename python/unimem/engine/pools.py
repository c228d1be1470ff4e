"""Size the memory of an engine the way SGLang sizes its pools, and build it.

The static baseline holds ``max_total_tokens`` FULL tokens, ``SWA_FULL_TOKENS_RATIO`` times
as many SWA tokens (SGLang's ``--swa-full-tokens-ratio`` default) and one state slot per
running request (SGLang's Mamba pool holds one per running request), plus, with the prefix
cache on, ``CHECKPOINT_SLOTS_PER_REQUEST`` more per running request for the cache's state
checkpoints and the snapshots steps take for them (``docs/prefix_cache.md``). The unified
arena gets exactly the bytes of those pools plus the sink pages its header holds, so the
comparison is at equal memory (there, checkpoints take whatever bytes are free).
"""

from __future__ import annotations

import torch

from unimem.engine.args import SWA_FULL_TOKENS_RATIO
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import MemoryPool, pages_for
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory

__all__ = [
    "CHECKPOINT_SLOTS_PER_REQUEST",
    "PoolPlan",
    "checkpoint_slots",
    "plan_pools",
    "tokens_for_budget",
]

CHECKPOINT_SLOTS_PER_REQUEST = 1
"""State slots the static split adds per running request when the prefix cache is on: room
for one in-flight snapshot per request (a step that may end on an anchor copies the
request's state), and, while fewer requests run, for the cache's checkpoints."""


def checkpoint_slots(spec: MemorySpec, max_running: int, prefix_cache: bool) -> int:
    """State slots the static split reserves for prefix-cache checkpoints: 0 without the
    cache or without STATE layers, else ``CHECKPOINT_SLOTS_PER_REQUEST * max_running``."""
    if not prefix_cache or not spec.has(LayerKind.STATE):
        return 0
    return CHECKPOINT_SLOTS_PER_REQUEST * max_running


class PoolPlan:
    """Unit counts of the static split for ``max_total_tokens`` FULL tokens,
    ``max_running`` requests and ``checkpoint_slots`` extra state slots (prefix-cache
    checkpoints), and the bytes they take (sinks included)."""

    def __init__(
        self,
        spec: MemorySpec,
        max_total_tokens: int,
        max_running: int,
        checkpoint_slots: int = 0,
    ) -> None:
        self.spec = spec
        layout = MemoryLayout.build(spec)
        p = spec.page_size
        self.full_pages = pages_for(max_total_tokens, p) if spec.has(LayerKind.FULL) else 0
        self.swa_pages = (
            max(1, int(pages_for(max_total_tokens, p) * SWA_FULL_TOKENS_RATIO))
            if spec.has(LayerKind.SWA)
            else 0
        )
        has_state = spec.has(LayerKind.STATE)
        self.state_slots = max_running + checkpoint_slots if has_state else 0
        self.max_running = max_running
        counts = {
            LayerKind.FULL: self.full_pages + 1,  # + the sink
            LayerKind.SWA: self.swa_pages + 1,
            LayerKind.STATE: self.state_slots,
        }
        self.bytes = sum(counts[k] * layout.unit_bytes(k) for k in spec.kinds)

    def build(self, unified: bool, max_context: int, device: torch.device | str) -> MemoryPool:
        """The static pools of this plan, or a unified arena of the same bytes."""
        if unified:
            return UnifiedMemory(self.spec, self.bytes, self.max_running, max_context, device)
        return StaticMemory(
            self.spec,
            max(self.full_pages, 1),
            max(self.swa_pages, 1),
            max(self.state_slots, 1),
            self.max_running,
            max_context,
            device,
        )


def plan_pools(
    spec: MemorySpec, max_total_tokens: int, max_running: int, checkpoint_slots: int = 0
) -> PoolPlan:
    """The static split of ``max_total_tokens`` FULL tokens (module docstring)."""
    return PoolPlan(spec, max_total_tokens, max_running, checkpoint_slots)


def tokens_for_budget(
    spec: MemorySpec, budget_bytes: int, max_running: int, checkpoint_slots: int = 0
) -> int:
    """The largest ``max_total_tokens`` whose static split (with ``checkpoint_slots`` extra
    state slots) fits ``budget_bytes``: what ``mem_fraction_static`` gives. ``ValueError``
    if not even one page fits."""
    layout = MemoryLayout.build(spec)
    slots = max_running + checkpoint_slots
    fixed = slots * layout.unit_bytes(LayerKind.STATE) if spec.has(LayerKind.STATE) else 0
    per_page = 0.0
    for kind, share in ((LayerKind.FULL, 1.0), (LayerKind.SWA, SWA_FULL_TOKENS_RATIO)):
        if spec.has(kind):
            fixed += layout.unit_bytes(kind)  # its sink
            per_page += share * layout.unit_bytes(kind)
    pages = int((budget_bytes - fixed) // per_page) if per_page else 0
    if pages < 1:
        raise ValueError(
            f"the KV budget of {budget_bytes} bytes holds no page after {fixed} bytes of "
            f"state slots and sinks: raise mem_fraction_static or lower max_running_requests"
        )
    return pages * spec.page_size
