"""Capacity: how many requests can run at once in one byte budget, static pools vs one arena.

What is measured. For a byte budget and a workload mix (a cycle of request lengths in a fixed,
seeded order), the number of requests admitted one after another before the first admission
fails, for

- ``static default``: :class:`StaticMemory` split the way SGLang splits a hybrid model's memory
  by default (state slots take ``0.9 / 1.9`` of the budget, FULL:SWA pages ``1 : 0.8``; see
  :func:`sglang_default_split`);
- ``static best``: :class:`StaticMemory` with the best split for *this* mix: the better of a
  grid sweep of the state share and the SWA:FULL page ratio (``static best (grid)``) and the
  exact optimum (``static best (exact)``: the smallest pools that admit the first ``n``
  requests, for the largest ``n`` that fits; no static split admits more);
- ``unified``: :class:`UnifiedMemory` over the same budget, whose split follows the workload;
- ``ideal arena`` (computed, not run): what a byte-perfect single arena would admit, the
  ceiling for ``unified``.

A request of length ``L`` (prompt + output tokens) is admitted with FULL and SWA pages for all
``L`` tokens and one state slot (``pool.admit(L)``); its SWA pages wholly behind the window are
then released (``pool.retire_swa([(req, L)])``) before the next admission, as the engine does
every step, so a running request holds at most ``ceil(window / page) + 1`` SWA pages. Nothing
is ever released otherwise: the count is how many requests of the mix are resident at once.
``max_requests`` is sized so that request rows never bind (checked).

Which code runs. The real pools and their real admission logic: the band planner, compaction,
the id spaces' bind/unbind/compact ops and the request table. Two substitutions keep a CPU run
short, and neither touches a decision:

- on CPU the two byte ops (``fill_units``: zero handed-out units; ``copy_units``: move units
  during compaction) run as per-unit numpy slice memsets/copies instead of the torch
  reference, whose int64 index tensors make zeroing gigabytes slow (the same bytes are
  written; on CUDA the Triton kernels run as usual);
- the grid sweep runs :class:`StaticMemory` on the ``meta`` device with its device writes
  skipped (:class:`MetaStaticMemory`; static admission is decided by host counts only, by
  design). The default split, the grid's best and the exact optimum are then re-run on real
  pools on ``--device``, where the counts must match.

Prints the device, budget, page size, unit sizes and, per mix, the counts with the splits
behind them and the ratios unified/best and unified/default; ``--json PATH`` writes the results,
``--plot PATH`` draws them as grouped bars (:func:`unimem.validate.plot.capacity_figure`).
Targets: unified >= 0.97x the best static split on every mix, >= 1.3x the default split on
the skewed mixes; exit status 1 when the first is missed.

    python -m unimem bench capacity --preset small --page-size 64 --budget-gb 2 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import unimem_kernel as uk
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import MemoryPool, pages_for
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem_kernel.timing import wall_clock

GIB = 1 << 30
MIB = 1 << 20

# SGLang's defaults for hybrid models (sgl-project/sglang):
# - python/sglang/srt/server_args.py, ServerArgs: ``swa_full_tokens_ratio: float = 0.8`` and
#   ``mamba_full_memory_ratio: float = 0.9`` (``max_mamba_cache_size`` defaults to None);
# - python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py,
#   ``handle_max_mamba_cache``: with ``max_mamba_cache_size`` unset (and no explicit
#   ``max_running_requests`` with the radix cache off) it solves
#   ``mamba_state_memory / full_kv_cache_memory == mamba_full_memory_ratio``, i.e. the state
#   pool gets ``ratio / (1 + ratio)`` of the memory left for caches, as whole slots; the rest
#   is KV. ``set_num_tokens_hybrid_swa`` then splits the KV bytes so that
#   ``swa_tokens = swa_full_tokens_ratio * full_tokens``.
# (SGLang further caps running requests at ``max_mamba_cache_size // 3`` when the radix cache
# is on, keeping spare slots for prefix-cache state snapshots; this engine keeps none, so that
# cap is *not* applied here: the default baseline is measured more generously than SGLang.)
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9
SGLANG_SWA_FULL_TOKENS_RATIO = 0.8

KINDS = (LayerKind.FULL, LayerKind.SWA, LayerKind.STATE)


# --------------------------------------------------------------------------- workload mixes


@dataclass(frozen=True)
class Mix:
    """A workload: ``lengths`` is one cycle of request lengths (prompt + output tokens), in
    admission order; admissions cycle through it."""

    name: str
    description: str
    lengths: tuple[int, ...]


def standard_mixes(
    long_range: tuple[int, int], short_range: tuple[int, int], seed: int = 0
) -> list[Mix]:
    """The three mixes, lengths drawn uniformly (seeded) from the given inclusive ranges:

    - ``long``: few long prompts (FULL-heavy): 16 long requests;
    - ``short``: many short requests (STATE-heavy: every request needs a state slot whatever
      its length): 64 short requests;
    - ``mixed``: 1 long request in 8 (8 long, 56 short), shuffled.
    """
    rng = random.Random(seed)

    def draw(lo_hi: tuple[int, int], n: int) -> list[int]:
        return [rng.randint(*lo_hi) for _ in range(n)]

    long_ = draw(long_range, 16)
    short = draw(short_range, 64)
    mixed = draw(long_range, 8) + draw(short_range, 56)
    rng.shuffle(mixed)
    lo, hi = long_range
    slo, shi = short_range
    return [
        Mix("long", f"few long prompts: {lo}..{hi} tokens", tuple(long_)),
        Mix("short", f"many short requests: {slo}..{shi} tokens", tuple(short)),
        Mix("mixed", f"1 in 8 of {lo}..{hi} tokens, the rest {slo}..{shi}", tuple(mixed)),
    ]


# --------------------------------------------------------------------------- byte ops


@contextlib.contextmanager
def host_byte_ops() -> Iterator[None]:
    """Within the block: ``fill_units``/``copy_units`` on CPU tensors run as per-unit numpy
    slice memsets/copies (same bytes as the torch reference, far faster), and every
    ``unimem_kernel`` op on ``meta`` tensors is a no-op (meta tensors hold no data). CUDA
    tensors are untouched.

    The pools call the ops through the ``unimem_kernel`` module attribute, so patching that
    attribute reaches them."""
    names = ("fill_units", "copy_units", "bind_units", "unbind_units", "compact_band")
    orig = {n: getattr(uk, n) for n in names}

    def fill_units(
        buf: torch.Tensor, base: int, unit_bytes: int, ids: torch.Tensor, byte_value: int
    ) -> None:
        if buf.is_meta:
            return
        if buf.device.type != "cpu":
            return orig["fill_units"](buf, base, unit_bytes, ids, byte_value)
        arr = buf.numpy()
        for u in ids.tolist():
            if u >= 0:
                start = base + u * unit_bytes
                arr[start : start + unit_bytes] = byte_value

    def copy_units(
        buf: torch.Tensor, base: int, unit_bytes: int, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        if buf.is_meta:
            return
        if buf.device.type != "cpu":
            return orig["copy_units"](buf, base, unit_bytes, src, dst)
        arr = buf.numpy()
        # Sources and destinations are disjoint (compaction's precondition): order is free.
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            if s >= 0 and d >= 0:
                a, b = base + s * unit_bytes, base + d * unit_bytes
                arr[b : b + unit_bytes] = arr[a : a + unit_bytes]

    def skip_on_meta(name: str) -> Callable[..., None]:
        fn = orig[name]

        def op(v2p: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if v2p.is_meta:
                return None
            return fn(v2p, *args, **kwargs)

        return op

    patched = {
        "fill_units": fill_units,
        "copy_units": copy_units,
        "bind_units": skip_on_meta("bind_units"),
        "unbind_units": skip_on_meta("unbind_units"),
        "compact_band": skip_on_meta("compact_band"),
    }
    try:
        for n, fn in patched.items():
            setattr(uk, n, fn)
        yield
    finally:
        for n, fn in orig.items():
            setattr(uk, n, fn)


# --------------------------------------------------------------------------- counting


def count_admitted(pool: MemoryPool, lengths: Sequence[int], limit: int) -> int:
    """Admit requests of ``lengths`` (cycled) one by one, retiring each one's SWA pages behind
    the window right after its admission; return how many were admitted before the first
    failure (at most ``limit``)."""
    n = 0
    while n < limit:
        length = lengths[n % len(lengths)]
        req = pool.admit(length)
        if req is None:
            break
        pool.retire_swa([(req, length)])
        n += 1
    return n


def request_bound(spec: MemorySpec, budget_bytes: int) -> int:
    """More requests than any pool of ``budget_bytes`` can hold (each needs at least one unit
    of every kind), so that ``max_requests`` never binds."""
    lay = MemoryLayout.build(spec)
    smallest = sum(lay.unit_bytes(k) for k in spec.kinds)
    return budget_bytes // smallest + 2


@dataclass
class StaticSplit:
    """A static split: pool sizes (units, sinks excluded) and the byte share of each kind."""

    num_state_slots: int
    swa_to_full: float
    full_pages: int
    swa_pages: int
    state_bytes_share: float
    full_bytes_share: float
    swa_bytes_share: float


class MetaStaticMemory(StaticMemory):
    """:class:`StaticMemory` for the split sweep, on the ``meta`` device: its two request-table
    and zeroing writes are skipped (meta tensors hold no data, and running them through meta
    kernels costs milliseconds per admission); admission — the free counts of the page, SWA
    and slot pools, all or nothing — and retirement run unchanged."""

    def _write_pages(self, pages: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
        pass

    def _zero(self, kind: LayerKind, ids: torch.Tensor, byte: int = 0) -> None:
        pass


def static_pool(
    spec: MemorySpec,
    budget_bytes: int,
    num_state_slots: int,
    swa_to_full: float,
    max_requests: int,
    max_context: int,
    device: str,
) -> StaticMemory | None:
    """``StaticMemory.from_budget`` (:class:`MetaStaticMemory` on ``meta``) or None when the
    split leaves a pool empty."""
    cls = MetaStaticMemory if device == "meta" else StaticMemory
    try:
        return cls.from_budget(
            spec, budget_bytes, num_state_slots, swa_to_full, max_requests, max_context, device
        )
    except ValueError:
        return None


def describe_split(pool: StaticMemory, swa_to_full: float, budget_bytes: int) -> StaticSplit:
    lay = pool.layout
    cap = pool.capacity

    def share(kind: LayerKind) -> float:
        return cap.get(kind, 0) * lay.unit_bytes(kind) / budget_bytes if kind in cap else 0.0

    return StaticSplit(
        num_state_slots=cap.get(LayerKind.STATE, 0),
        swa_to_full=swa_to_full,
        full_pages=cap.get(LayerKind.FULL, 0),
        swa_pages=cap.get(LayerKind.SWA, 0),
        state_bytes_share=share(LayerKind.STATE),
        full_bytes_share=share(LayerKind.FULL),
        swa_bytes_share=share(LayerKind.SWA),
    )


def sglang_default_split(spec: MemorySpec, budget_bytes: int) -> tuple[int, float]:
    """``(num_state_slots, swa_to_full)`` of SGLang's default split of ``budget_bytes``:
    whole state slots in ``mamba_full_memory_ratio / (1 + mamba_full_memory_ratio)`` of the
    budget, the rest FULL and SWA pages with ``swa_full_tokens_ratio`` SWA tokens per FULL
    token (pages hold ``page_size`` tokens of either kind, so the page ratio is the same)."""
    r = SGLANG_MAMBA_FULL_MEMORY_RATIO
    slots = 0
    if spec.has(LayerKind.STATE):
        slot_bytes = MemoryLayout.build(spec).unit_bytes(LayerKind.STATE)
        slots = int(budget_bytes * r / (1 + r)) // slot_bytes
    return slots, SGLANG_SWA_FULL_TOKENS_RATIO


def grid(lo: float, hi: float, step: float) -> list[float]:
    """``lo, lo + step, ...`` up to ``hi`` inclusive (rounded to 6 decimals)."""
    n = int(round((hi - lo) / step))
    return [round(lo + i * step, 6) for i in range(n + 1)]


def sweep_static(
    spec: MemorySpec,
    budget_bytes: int,
    mix: Mix,
    max_requests: int,
    max_context: int,
    shares: Sequence[float],
    ratios: Sequence[float],
) -> tuple[int, int, float, int]:
    """Best static split of the grid: ``(count, num_state_slots, swa_to_full, points)``.

    Every point of ``shares x ratios`` — state slots filling ``share`` of the budget (whole
    slots, at least one), FULL and SWA pages in the page ratio ``swa_to_full`` — is counted
    with :class:`MetaStaticMemory`. Ties go to the first point found; ``points`` is the number
    of distinct splits counted."""
    lay = MemoryLayout.build(spec)
    slot_bytes = lay.unit_bytes(LayerKind.STATE) if spec.has(LayerKind.STATE) else 0
    seen: dict[tuple[int, float], int] = {}
    best = (-1, 0, 0.0)
    for share in shares:
        slots = max(1, int(share * budget_bytes) // slot_bytes) if slot_bytes else 0
        for ratio in ratios:
            if (slots, ratio) not in seen:
                pool = static_pool(
                    spec, budget_bytes, slots, ratio, max_requests, max_context, "meta"
                )
                n = -1 if pool is None else count_admitted(pool, mix.lengths, max_requests)
                seen[(slots, ratio)] = n
                if n > best[0]:
                    best = (n, slots, ratio)
    return best[0], best[1], best[2], len(seen)


def exact_static_split(
    spec: MemorySpec, budget_bytes: int, lengths: Sequence[int], max_requests: int
) -> tuple[int, int, int, int]:
    """The best static split for admitting ``lengths`` (cycled) in this order, computed:
    ``(count, full_pages, swa_pages, state_slots)``.

    Static pools are independent, so admitting the first ``n`` requests needs exactly: ``n``
    slots, the sum of their FULL pages, and as many SWA pages as the worst admission needs
    (the SWA pages the earlier requests still hold after retirement, plus all the pages of the
    one being admitted). ``count`` is the largest ``n`` whose pools (plus the two sinks) fit in
    the budget: no static split admits more. The FULL pool is then given every byte left over.
    The retirement rule mirrors :meth:`MemoryPool.retire_swa`; the caller checks the count on
    a real pool."""
    lay = MemoryLayout.build(spec)
    ps = spec.page_size
    per = {k: (lay.unit_bytes(k) if spec.has(k) else 0) for k in KINDS}
    window = spec.max_window
    full = swa_held = swa_peak = n = 0
    fixed = per[LayerKind.FULL] + per[LayerKind.SWA]  # the sinks
    while n < max_requests:
        length = lengths[n % len(lengths)]
        pages = pages_for(length, ps)
        retired = 0
        if window is not None:
            retired = min(max(0, (length - window + 1) // ps), pages)
        need_full = full + pages
        need_swa = max(swa_peak, swa_held + pages) if per[LayerKind.SWA] else 0
        total = (
            fixed
            + (n + 1) * per[LayerKind.STATE]
            + need_full * per[LayerKind.FULL]
            + need_swa * per[LayerKind.SWA]
        )
        if total > budget_bytes:
            break
        full, swa_peak, swa_held, n = need_full, need_swa, swa_held + pages - retired, n + 1
    slots = n if per[LayerKind.STATE] else 0
    if per[LayerKind.FULL]:
        left = budget_bytes - fixed - slots * per[LayerKind.STATE] - swa_peak * per[LayerKind.SWA]
        full = left // per[LayerKind.FULL]
    return n, full, swa_peak, slots


def ideal_arena_count(
    spec: MemorySpec, budget_bytes: int, lengths: Sequence[int], max_requests: int
) -> int:
    """The ceiling of any single-arena allocator: the largest ``n`` such that the units the
    first ``n - 1`` requests hold after retirement, plus everything the ``n``-th needs at its
    admission (all its FULL and SWA pages and a slot), plus the two sinks, fit in the budget
    — byte-perfect packing, no granularity or fragmentation loss. Computed, not run."""
    lay = MemoryLayout.build(spec)
    ps = spec.page_size
    per = {k: (lay.unit_bytes(k) if spec.has(k) else 0) for k in KINDS}
    window = spec.max_window
    held = per[LayerKind.FULL] + per[LayerKind.SWA]  # the sinks
    n = 0
    while n < max_requests:
        length = lengths[n % len(lengths)]
        pages = pages_for(length, ps)
        retired = min(max(0, (length - window + 1) // ps), pages) if window is not None else 0
        admit = pages * (per[LayerKind.FULL] + per[LayerKind.SWA]) + per[LayerKind.STATE]
        if held + admit > budget_bytes:
            break
        held += admit - retired * per[LayerKind.SWA]
        n += 1
    return n


# --------------------------------------------------------------------------- one mix


@dataclass
class MixResult:
    """Counts of one mix (requests resident at once) and the splits behind them."""

    name: str
    description: str
    num_shapes: int
    mean_tokens: float
    static_default: int
    default_split: StaticSplit
    static_grid: int
    grid_split: StaticSplit
    grid_points: int
    static_exact: int
    exact_split: StaticSplit | None
    static_best: int
    unified: int
    ideal_arena: int
    unified_compactions: int
    unified_moved_units: int
    unified_peak_bytes_share: float
    seconds: float
    unified_over_best: float = field(init=False)
    unified_over_default: float = field(init=False)

    def __post_init__(self) -> None:
        self.unified_over_best = self.unified / self.static_best if self.static_best else math.inf
        self.unified_over_default = (
            self.unified / self.static_default if self.static_default else math.inf
        )


def measure_mix(
    spec: MemorySpec,
    budget_bytes: int,
    mix: Mix,
    device: str = "cpu",
    shares: Sequence[float] | None = None,
    ratios: Sequence[float] | None = None,
) -> MixResult:
    """Static default, static best and unified counts of ``mix`` in ``budget_bytes``.

    The best static count is the larger of the grid sweep's best (:func:`sweep_static`, on
    meta pools; default grid: state share 0.02..0.90 step 0.04, swa_to_full 0.05..1.0 step
    0.05) and the exact optimum (:func:`exact_static_split`). The default split, both best
    splits and the unified arena are then counted on real pools on ``device``; the grid and
    exact counts must match their real runs. Run inside :func:`host_byte_ops`."""
    with wall_clock() as watch:
        result = _measure_mix(spec, budget_bytes, mix, device, shares, ratios)
    result.seconds = watch.seconds
    return result


def _measure_mix(
    spec: MemorySpec,
    budget_bytes: int,
    mix: Mix,
    device: str,
    shares: Sequence[float] | None,
    ratios: Sequence[float] | None,
) -> MixResult:
    shares = grid(0.02, 0.90, 0.04) if shares is None else shares
    ratios = grid(0.05, 1.0, 0.05) if ratios is None else ratios
    max_requests = request_bound(spec, budget_bytes)
    max_context = max(mix.lengths)

    def run(pool: StaticMemory | UnifiedMemory | None, what: str) -> int:
        if pool is None:
            raise ValueError(f"{mix.name}: the {what} split does not fit the budget")
        n = count_admitted(pool, mix.lengths, max_requests)
        assert n < max_requests, "max_requests bound the count"
        return n

    def run_static(slots: int, ratio: float, what: str) -> tuple[int, StaticSplit]:
        pool = static_pool(spec, budget_bytes, slots, ratio, max_requests, max_context, device)
        n = run(pool, what)
        return n, describe_split(pool, ratio, budget_bytes)

    d_slots, d_ratio = sglang_default_split(spec, budget_bytes)
    default_n, default_split = run_static(d_slots, d_ratio, "default")

    swept, g_slots, g_ratio, points = sweep_static(
        spec, budget_bytes, mix, max_requests, max_context, shares, ratios
    )
    grid_n, grid_split = run_static(g_slots, g_ratio, "grid best")
    if grid_n != swept:
        raise AssertionError(f"{mix.name}: meta sweep counted {swept}, {device} run {grid_n}")

    exact_n, e_full, e_swa, e_slots = exact_static_split(
        spec, budget_bytes, mix.lengths, max_requests
    )
    exact_split = None
    if exact_n > 0:
        pool = StaticMemory(
            spec, e_full, max(e_swa, 1), max(e_slots, 1), max_requests, max_context, device
        )
        real = run(pool, "exact")
        if real != exact_n:
            raise AssertionError(f"{mix.name}: exact split computed {exact_n}, real run {real}")
        ratio = e_swa / e_full if e_full else 0.0
        exact_split = describe_split(pool, round(ratio, 4), budget_bytes)
        del pool

    pool = UnifiedMemory(spec, budget_bytes, max_requests, max_context, device)
    unified_n = run(pool, "unified")
    pool.bands.check()
    stats = pool.stats
    result = MixResult(
        name=mix.name,
        description=mix.description,
        num_shapes=len(mix.lengths),
        mean_tokens=sum(mix.lengths) / len(mix.lengths),
        static_default=default_n,
        default_split=default_split,
        static_grid=grid_n,
        grid_split=grid_split,
        grid_points=points,
        static_exact=exact_n,
        exact_split=exact_split,
        static_best=max(grid_n, exact_n),
        unified=unified_n,
        ideal_arena=ideal_arena_count(spec, budget_bytes, mix.lengths, max_requests),
        unified_compactions=stats.compactions,
        unified_moved_units=stats.moved_units,
        unified_peak_bytes_share=stats.peak_bytes / budget_bytes,
        seconds=0.0,
    )
    del pool
    return result


# --------------------------------------------------------------------------- report


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {model}, {torch.get_num_threads()} threads"


def _split_str(s: StaticSplit | None) -> str:
    if s is None:
        return "(no split admits one request)"
    return (
        f"{s.num_state_slots} slots / {s.full_pages} F / {s.swa_pages} S pages "
        f"(bytes: state {s.state_bytes_share:.1%}, full {s.full_bytes_share:.1%}, "
        f"swa {s.swa_bytes_share:.1%}; swa:full {s.swa_to_full:g})"
    )


def format_table(results: Sequence[MixResult]) -> str:
    """A Markdown table of the counts and ratios, one row per mix."""
    cols = (
        "mix",
        "static default",
        "static best (grid)",
        "static best (exact)",
        "unified",
        "ideal arena",
        "unified / best",
        "unified / default",
    )
    rows = [
        (
            r.name,
            str(r.static_default),
            str(r.static_grid),
            str(r.static_exact),
            str(r.unified),
            str(r.ideal_arena),
            f"{r.unified_over_best:.3f}x",
            f"{r.unified_over_default:.3f}x",
        )
        for r in results
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        first = f" {cells[0]:<{widths[0]}} "
        rest = [f" {c:>{w}} " for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "|" + "|".join([first, *rest]) + "|"

    rule = (
        "|"
        + "|".join([":" + "-" * (widths[0] + 1)] + ["-" * (w + 1) + ":" for w in widths[1:]])
        + "|"
    )
    return "\n".join([line(cols), rule, *(line(row) for row in rows)])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m unimem bench capacity", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--preset", default="small", help="model preset whose MemorySpec is used")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--budget-gb", type=float, default=2.0, help="byte budget, GiB")
    ap.add_argument("--device", default="cpu", help="device of the real pools")
    ap.add_argument("--long", type=int, nargs=2, default=[12288, 20480], metavar=("LO", "HI"))
    ap.add_argument("--short", type=int, nargs=2, default=[256, 512], metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw the counts per mix as grouped bars into PATH (.png, .svg or .pdf; needs "
        "matplotlib: pip install 'unimem[plot]')",
    )
    args = ap.parse_args(argv)
    if args.plot:
        from unimem.validate import plot

        try:
            plot.check_plot_path(args.plot)
            plot.require_matplotlib()
        except ValueError as e:
            ap.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = preset(args.preset)
    spec = memory_spec(config, args.page_size)
    budget = int(args.budget_gb * GIB)
    lay = MemoryLayout.build(spec)
    units = {k.value: lay.unit_bytes(k) for k in KINDS if spec.has(k)}
    mixes = standard_mixes(tuple(args.long), tuple(args.short), args.seed)
    print(f"device: {device_name(args.device)}; torch {torch.__version__}")
    print(
        f"preset {args.preset}: {spec.num_target_lanes(LayerKind.FULL)} FULL, "
        f"{spec.num_target_lanes(LayerKind.SWA)} SWA (window {spec.max_window}), "
        f"{spec.num_target_lanes(LayerKind.STATE)} STATE layers; page size {spec.page_size}"
    )
    print(
        "unit bytes: "
        + ", ".join(f"{k} {b} ({b / MIB:.3f} MiB)" for k, b in units.items())
        + f"; budget {budget} bytes ({args.budget_gb:g} GiB)"
    )
    results = []
    with host_byte_ops():
        for mix in mixes:
            r = measure_mix(spec, budget, mix, args.device)
            results.append(r)
            print(
                f"\n[{r.name}] {r.description}; {r.num_shapes} shapes cycled, "
                f"mean {r.mean_tokens:.0f} tokens"
            )
            print(f"  static default:      {r.static_default:>5}  {_split_str(r.default_split)}")
            print(f"  static best (grid):  {r.static_grid:>5}  {_split_str(r.grid_split)}")
            print(f"  static best (exact): {r.static_exact:>5}  {_split_str(r.exact_split)}")
            print(
                f"  unified:             {r.unified:>5}  ({r.unified_compactions} compactions, "
                f"{r.unified_moved_units} units moved; peak {r.unified_peak_bytes_share:.1%} "
                f"of the budget in use)"
            )
            print(f"  ideal arena:         {r.ideal_arena:>5}  (byte-perfect packing, computed)")
            print(f"  ({r.grid_points} grid splits counted; {r.seconds:.1f} s)")
    print()
    print(format_table(results))
    ok_best = all(r.unified_over_best >= 0.97 for r in results)
    print(f"\nunified >= 0.97x best static on every mix: {'yes' if ok_best else 'NO'}")
    for r in results:
        print(f"unified / default on {r.name}: {r.unified_over_default:.3f}x")
    if args.json or args.plot:
        payload = {
            "date": datetime.date.today().isoformat(),
            "device": device_name(args.device),
            "torch": torch.__version__,
            "preset": args.preset,
            "page_size": spec.page_size,
            "budget_bytes": budget,
            "unit_bytes": units,
            "sglang_defaults": {
                "mamba_full_memory_ratio": SGLANG_MAMBA_FULL_MEMORY_RATIO,
                "swa_full_tokens_ratio": SGLANG_SWA_FULL_TOKENS_RATIO,
            },
            "mixes": [{"name": m.name, "lengths": list(m.lengths)} for m in mixes],
            "results": [asdict(r) for r in results],
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot:
        from unimem.validate.plot import capacity_figure

        capacity_figure(payload, args.plot)
    return 0 if ok_best else 1
