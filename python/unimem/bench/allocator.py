"""Cost of the allocator's batched operations: launches, GPU time and host time.

On the ``small`` preset's memory spec (``--preset``) in a realistic arena (``--arena-gb``),
for each batch size ``bs`` (``--bs``, default 1 48 256), one repetition runs, each operation
timed on its own:

- ``admit``: ``bs`` calls of ``admit(context)`` (host time only: it is ``bs`` separate calls);
- ``retire``: ``retire_swa`` of the batch retiring exactly one SWA page per request (an untimed
  retire first takes every request to one page short of that);
- ``compact``: ``compact(SWA)`` right after: the retired pages are the band's holes; the live
  units at its boundary move into them and the band shrinks to its live size;
- ``alloc``: ``grow`` of every request by one page (one FULL and one SWA page each);
- ``free``: ``release`` of the batch;

then an untimed reset (every band compacted back to empty), so every repetition starts alike.

``move`` (a forced band move): in a second, tight arena, the batch plus filler requests take
every byte; after two SWA pages per batch request are retired, ``grow`` of the batch by one
page finds no room for FULL, so the planner has SWA evacuate its top units into its holes
(copying their bytes) before FULL extends into the freed range. ``units`` is units moved.

Columns: ``units``: units bound, unbound or moved per operation; ``uk``: calls of
``unimem_kernel`` ops (counted by wrapping them; on CPU too); ``kernels`` and ``copies``: CUDA
kernels and memcpy/memset on the device, counted by ``torch.profiler`` over one repetition;
``GPU us``: CUDA events around the operation while a sleep kernel enqueued just before holds
the GPU, so the host has enqueued all of it before the GPU starts: the device time alone (a
``*`` marks rows where the host outran the sleep in some repetition); ``host us``: wall time of
the Python call, which the host spends out of its step budget (nothing in it waits for the
GPU). Times are medians over ``--reps`` repetitions after ``--warmup`` untimed ones.

``--device cpu`` (the default without CUDA) runs the same protocol on the torch references
at tiny sizes (preset ``tiny``, bs 1 and 4): a logic check, not a measurement. ``--json PATH``
writes every row.

    python -m unimem bench allocator --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton

import unimem_kernel
from unimem.memory.checks import check_unified
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import RequestMemory, pages_for
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem_kernel.timing import wall_clock

SWA = LayerKind.SWA
GiB = 1 << 30
KERNEL_OPS = ("bind_units", "unbind_units", "compact_band", "copy_units", "fill_units")
OPS = ("admit", "retire", "compact", "alloc", "free", "move")
HOST_ONLY = {"admit"}
PROG = "python -m unimem bench allocator"
MAX_SLEEP_US = 50_000


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cuda", "cpu"],
    )
    ap.add_argument("--preset", default=None, help="model preset (default: small; cpu: tiny)")
    ap.add_argument("--bs", type=int, nargs="+", default=None, help="default 1 48 256; cpu 1 4")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=None, help="tokens per request (W + 4 pages)")
    ap.add_argument("--arena-gb", type=float, default=None, help="default 8; cpu 1/16")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (20; cpu 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    ap.add_argument("--poison", action="store_true", help="pools in poison mode")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.preset = args.preset or ("tiny" if cpu else "small")
    args.bs = args.bs or ([1, 4] if cpu else [1, 48, 256])
    args.arena_gb = args.arena_gb or (1 / 16 if cpu else 8.0)
    args.reps = args.reps or (2 if cpu else 20)
    args.warmup = max(1, args.warmup)  # the warm-up sets each operation's sleep length
    return args


# ---------------------------------------------------------------------------------------------
# measuring one operation
# ---------------------------------------------------------------------------------------------


@contextmanager
def count_kernel_ops() -> Iterator[Counter]:
    """Count calls of the ``unimem_kernel`` ops (the memory layer calls them as ``uk.<op>``)."""
    counts: Counter = Counter()
    saved = {name: getattr(unimem_kernel, name) for name in KERNEL_OPS}

    def wrap(name, fn):
        def counted(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)

        return counted

    for name, fn in saved.items():
        setattr(unimem_kernel, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(unimem_kernel, name, fn)


def device_launches(fn: Callable[[], object]) -> tuple[object, int | None, int | None]:
    """Run ``fn`` under torch.profiler; ``(result, kernels, memcpy + memset)`` on the device."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    ran, out = False, None
    try:
        with profile(activities=acts) as prof:
            out, ran = fn(), True
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        names = [e.name for e in prof.events() if e.device_type == cuda]
    except RuntimeError as e:  # the profiler, not the operation, failed (e.g. no CUPTI)
        if not ran:
            raise
        print(f"bench_allocator: torch.profiler failed ({e}); launch counts left out")
        return out, None, None
    copies = sum(1 for n in names if "memcpy" in n.lower() or "memset" in n.lower())
    return out, len(names) - copies, copies


@dataclass
class OpStats:
    units: list[int] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    sleep_us: float = 0.0
    starved: int = 0
    uk: int | None = None
    kernels: int | None = None
    copies: int | None = None


class Timer:
    """Runs operations in one of three modes: ``warm`` (untimed; host time sets the sleep),
    ``profile`` (launch counts) and ``time`` (host time; GPU time behind a sleep)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ops: dict[str, OpStats] = {}
        self.mode = "warm"
        self.cycles_per_us = self._calibrate() if self.cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1000)

    def __call__(self, op: str, fn: Callable[[], object], units: Callable[[], int]) -> object:
        st = self.ops.setdefault(op, OpStats())
        if self.mode == "profile":
            with count_kernel_ops() as counts:
                if self.cuda:
                    out, st.kernels, st.copies = device_launches(fn)
                else:
                    out = fn()
            st.uk = sum(counts.values())
            return out
        gpu = self.cuda and op not in HOST_ONLY and self.mode == "time"
        if gpu:
            torch.cuda._sleep(int(st.sleep_us * self.cycles_per_us))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with wall_clock() as watch:
            out = fn()
        host_us = watch.seconds * 1e6
        if gpu:
            end.record()
            st.events.append((start, end))
            st.starved += host_us > st.sleep_us
        if self.mode == "warm":
            # Hold the GPU well past the host's enqueueing; the fastest warm-up call sets it
            # (the first may include Triton compiles), capped so no repetition idles for long.
            sleep = min(3 * host_us + 100, MAX_SLEEP_US)
            st.sleep_us = min(st.sleep_us, sleep) if st.sleep_us else sleep
        else:
            st.host_us.append(host_us)
            st.units.append(units())
        return out


# ---------------------------------------------------------------------------------------------
# the protocol
# ---------------------------------------------------------------------------------------------


def live_total(mem: UnifiedMemory) -> int:
    return sum(mem.live_units(k) for k in mem.kinds)


def retire_positions(mem: UnifiedMemory, context: int) -> tuple[int, int]:
    """``(pre, pos)``: retiring at ``pre`` then ``pos`` retires exactly one page the second time."""
    p, w = mem.page_size, mem.swa_window
    stop = min((context - w + 1) // p, pages_for(context, p))
    if stop < 2:
        raise ValueError(f"context {context} is too short to retire two pages (window {w})")
    return w - 1 + (stop - 1) * p, context


def reset(mem: UnifiedMemory) -> None:
    """Compact every (empty) band to nothing, so that the next repetition starts alike."""
    for k in mem.kinds:
        mem.compact(k)


def main_rep(mem: UnifiedMemory, timer: Timer, bs: int, context: int) -> None:
    p = mem.page_size
    pre, pos = retire_positions(mem, context)

    changed = [0]  # units bound or unbound by the last operation

    def counted(fn):
        before = live_total(mem)
        out = fn()
        changed[0] = abs(live_total(mem) - before)
        return out

    def op(name, fn):
        return timer(name, lambda: counted(fn), lambda: changed[0])

    reqs = op("admit", lambda: [mem.admit(context) for _ in range(bs)])
    assert all(r is not None for r in reqs), "the batch does not fit the arena"
    mem.retire_swa([(r, pre) for r in reqs])
    n = op("retire", lambda: mem.retire_swa([(r, pos) for r in reqs]))
    assert n == bs, f"retired {n} pages, want {bs}"
    moved = mem.stats.moved_units
    timer("compact", lambda: mem.compact(SWA), lambda: mem.stats.moved_units - moved)
    assert op("alloc", lambda: mem.grow([(r, context + p) for r in reqs])), "grow failed"
    op("free", lambda: mem.release(reqs))
    reset(mem)


def fill(mem: UnifiedMemory, context: int) -> list[RequestMemory]:
    """Admit ``context``-token fillers until none fits, then grow them until no page fits."""
    fillers: list[tuple[RequestMemory, int]] = []
    while mem.free_rows:
        req = mem.admit(context)
        if req is None:
            break
        fillers.append((req, context))
    if not fillers:
        raise ValueError("the move arena has no room for a filler: raise --context or bs")
    p = mem.page_size
    for step in (64, 16, 4, 1):
        for i, (req, tokens) in enumerate(fillers):
            while tokens + step * p <= mem.max_context and mem.grow([(req, tokens + step * p)]):
                tokens += step * p
            fillers[i] = (req, tokens)
    return [r for r, _ in fillers]


def move_rep(mem: UnifiedMemory, timer: Timer, bs: int, context: int) -> None:
    p, w = mem.page_size, mem.swa_window
    reqs = [mem.admit(context) for _ in range(bs)]
    assert all(r is not None for r in reqs), "the batch does not fit the move arena"
    fillers = fill(mem, context)
    mem.retire_swa([(r, w - 1 + 2 * p) for r in reqs])  # two SWA holes per request
    moved = mem.stats.moved_units
    ok = timer(
        "move",
        lambda: mem.grow([(r, context + p) for r in reqs]),
        lambda: mem.stats.moved_units - moved,
    )
    assert ok, "the forced-move grow failed"
    mem.release(reqs + fillers)
    reset(mem)


def run_protocol(
    make: Callable[[], UnifiedMemory],
    rep: Callable[[UnifiedMemory, Timer, int, int], None],
    timer: Timer,
    bs: int,
    context: int,
    args: argparse.Namespace,
) -> None:
    mem = make()
    sync = torch.cuda.synchronize if timer.cuda else (lambda: None)
    for mode, count in (("warm", args.warmup), ("profile", 1), ("time", args.reps)):
        timer.mode = mode
        for _ in range(count):
            rep(mem, timer, bs, context)
            sync()  # between repetitions only: each starts with an idle GPU
    check_unified(mem)
    del mem
    if timer.cuda:
        torch.cuda.empty_cache()


def arena_for(spec: MemorySpec, bs: int, context: int, page_size: int) -> int:
    """Bytes that hold ``bs`` requests of ``context`` tokens plus one page, and the sinks."""
    lay = MemoryLayout.build(spec)
    pages = pages_for(context, page_size) + 1
    per_req = sum(lay.unit_bytes(k) * (1 if k is LayerKind.STATE else pages) for k in spec.kinds)
    return bs * per_req + 2 * max(lay.unit_bytes(k) for k in spec.kinds)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA device (--device cpu runs a logic check)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    cfg = preset(args.preset)
    spec = memory_spec(cfg, args.page_size)
    p, w = args.page_size, spec.max_window
    context = args.context or (w + 4 * p)
    arena = int(args.arena_gb * GiB)
    lay = MemoryLayout.build(spec)
    unit_bytes = {k.value: lay.unit_bytes(k) for k in spec.kinds}

    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (torch references)"
    print(f"device: {gpu}  torch {torch.__version__}  triton {triton.__version__}")
    print(
        f"preset {args.preset}: page_size {p}, window {w}, unit bytes {unit_bytes}; "
        f"context {context} tokens/request; arena {arena / GiB:.2f} GiB (move: tight); "
        f"reps {args.reps} (+{args.warmup} warm-up){'; poison' if args.poison else ''}"
    )

    rows = []
    for bs in args.bs:
        need = arena_for(spec, bs, context, p)
        if need > arena:
            raise SystemExit(f"bs {bs} needs {need / GiB:.2f} GiB: raise --arena-gb")
        timer = Timer(dev)
        max_ctx = context + 2 * p

        def make_main(bs=bs, max_ctx=max_ctx):
            return UnifiedMemory(spec, arena, bs, max_ctx, dev, poison=args.poison)

        def make_move(bs=bs):
            tight = arena_for(spec, bs + max(2, bs // 4), context, p)
            return UnifiedMemory(spec, tight, 2 * bs + 16, cfg.max_context, dev, args.poison)

        run_protocol(make_main, main_rep, timer, bs, context, args)
        run_protocol(make_move, move_rep, timer, bs, context, args)
        if timer.cuda:
            torch.cuda.synchronize()
        for op in OPS:
            st = timer.ops[op]
            gpu_us = [s.elapsed_time(e) * 1000 for s, e in st.events]
            rows.append(
                {
                    "op": op,
                    "bs": bs,
                    "units": statistics.mean(st.units),
                    "uk_calls": st.uk,
                    "kernels": st.kernels,
                    "copies": st.copies,
                    "gpu_us": statistics.median(gpu_us) if gpu_us else None,
                    "gpu_us_mean": statistics.mean(gpu_us) if gpu_us else None,
                    "host_us": statistics.median(st.host_us),
                    "host_us_mean": statistics.mean(st.host_us),
                    "reps": len(st.host_us),
                    "host_outran_sleep": st.starved,
                }
            )

    def fmt(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    head = f"{'op':<8}{'bs':>5}{'units':>8}{'uk':>5}{'kernels':>9}{'copies':>8}"
    print(f"\n{head}{'GPU us':>11}{'host us':>10}")
    for r in rows:
        star = "*" if r["host_outran_sleep"] else " "
        print(
            f"{r['op']:<8}{r['bs']:>5}{r['units']:>8.0f}{fmt(r['uk_calls'], 'd'):>5}"
            f"{fmt(r['kernels'], 'd'):>9}{fmt(r['copies'], 'd'):>8}"
            f"{fmt(r['gpu_us']):>10}{star}{fmt(r['host_us']):>10}"
        )
    if any(r["host_outran_sleep"] for r in rows):
        print("* the host outran the sleep in some repetition: its GPU time includes host gaps")
    if args.json:
        meta = {
            "device": gpu,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "preset": args.preset,
            "page_size": p,
            "window": w,
            "unit_bytes": unit_bytes,
            "context": context,
            "arena_bytes": arena,
            "args": {k: v for k, v in vars(args).items() if k != "json"},
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0
