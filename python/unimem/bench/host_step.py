"""The host's per-step work of the engine loop, on the CPU, without model compute.

Drives the real :class:`~unimem.engine.core.EngineCore` — scheduler planning, pool growth and
SWA retirement, lane staging (:mod:`unimem.engine.step_io`), the result ring and the
accounting of every step — through a steady state of ``--requests`` running requests
verifying DSPARK chains (gamma 7, page 64, the ``small`` preset's memory spec with the
default drafter's lanes; ``--gamma 0``: decoding one token a step, no drafter), over static
pools and over a unified arena.

Only the device work is replaced, by something trivial:

- the runner's steps: an extend writes a fixed token per lane; a verify step writes fixed
  tokens and a deterministic accept pattern (``1 .. gamma + 1`` tokens per lane, mean about
  4) into the step outputs — :meth:`ModelRunner.launch` (lane staging, the sampling check)
  runs as it is;
- the pools' bulk byte work (``unimem_kernel.fill_units`` / ``copy_units``: zeroing handed
  out units, compaction copies) is a no-op; the id / table ops (``bind_units``,
  ``unbind_units``, request-table writes) run their torch references on the CPU, standing in
  for the launches they cost on a GPU.

Every step is timed (``EngineCore.step``: plan, grow, launch, stage, account the previous
step; on the CPU nothing waits), then the same number of steps runs under cProfile. Prints
ms per step (median, p90) and the top functions per memory kind; ``--json`` writes them.

    python -m unimem bench step-profile --host-only --requests 48 --steps 200 --json out.json

Runs on any machine (the CPU variant of the ``step-profile`` suite). It replaces the
process's ``unimem_kernel.fill_units`` / ``copy_units``: run it in a process of its own.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import pstats
import statistics
from types import SimpleNamespace

import torch

import unimem.engine.core as core_mod
import unimem_kernel as uk
from unimem.attention.torch_backend import TorchReferenceBackend
from unimem.engine.core import EngineCore
from unimem.engine.runner import ModelRunner
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import pages_for
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.speculative.drafter import draft_config_for
from unimem_kernel.timing import wall_clock

TOKEN = 7
"""The token every stub step outputs (no stop tokens are set)."""


class StubRunner(ModelRunner):
    """The engine's runner with trivial device steps (module docstring)."""

    PATTERNS = 16

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_stub_outputs(self.width)

    def _init_stub_outputs(self, width: int) -> None:
        """The stub verify step's accept patterns and tokens."""
        g = torch.Generator().manual_seed(0)
        n = self.PATTERNS
        self._counts = torch.randint(1, width + 1, (n, self.max_bs), generator=g).int()
        self._counts = torch.minimum(
            self._counts, torch.randint(1, width + 1, (n, self.max_bs), generator=g)
        )
        self._tokens = torch.full((self.max_bs, width), TOKEN, dtype=torch.int64)
        self._k = 0

    def _extend(self, batch, top_k: int = 0, in_flight=None) -> None:
        bs = len(batch.reqs)
        self.out.tokens[:bs, 0] = TOKEN
        self.out.counts[:bs] = 1

    def _verify_step(self, width: int, draw: bool = False, rule=None, extras=None) -> None:
        self.out.tokens[:width] = self._tokens[:width]
        self.out.counts[:width] = self._counts[self._k % self.PATTERNS, :width]
        self._k += 1

    def _decode_step(self, width: int, draw: bool = False, rule=None, extras=None) -> None:
        self.out.tokens[:width, 0] = TOKEN
        self.out.counts[:width] = 1


def _no_device_bytes() -> None:
    """Bulk byte work of the pools becomes a no-op (module docstring)."""
    uk.fill_units = lambda *a, **k: None
    uk.copy_units = lambda *a, **k: None


def build(kind: str, args) -> EngineCore:
    cfg = preset("small")
    dcfg = draft_config_for(cfg)
    spec = memory_spec(cfg, args.page_size, dcfg.lanes() if args.gamma else ())
    n = args.requests
    total = args.input_len + args.output_len + 2 * (args.gamma + 1)
    full = n * pages_for(total, args.page_size)
    # Each request's SWA peak as the engine's admission check counts it (its window plus one
    # step's chunk, see ``EngineCore._swa_peak_tokens``), capped by the request's length.
    step = max(args.chunk, 4 * (args.gamma + 1))
    per_request = pages_for(cfg.window, args.page_size) + pages_for(step, args.page_size) + 2
    swa = n * min(per_request, pages_for(total, args.page_size) + 1)
    pool = StaticMemory(spec, full, swa, n, n, cfg.max_context)
    if kind == "unified":
        nbytes = args.arena_gib << 30 if args.arena_gib else pool.stats.capacity_bytes
        del pool
        pool = UnifiedMemory(spec, nbytes, n, cfg.max_context)
    model = SimpleNamespace(config=cfg, device=torch.device("cpu"))
    chain = (
        None
        if args.gamma == 0
        else SimpleNamespace(
            drafter=SimpleNamespace(config=dcfg),
            gamma=args.gamma,
            verify_width=args.gamma + 1,
            control=None,
            adaptive=False,
            verify_lengths="fixed",
            verify_budget=None,
        )
    )
    core_mod.ModelRunner = StubRunner
    try:
        eng = EngineCore(model, pool, TorchReferenceBackend(), n, args.chunk, chain=chain)
    finally:
        core_mod.ModelRunner = ModelRunner
    return eng


def measure(kind: str, args) -> dict:
    eng = build(kind, args)
    g = torch.Generator().manual_seed(1)
    vocab = eng.model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.requests, args.input_len), generator=g).tolist()
    for p in prompts:
        eng.submit(p, args.output_len)
    sched = eng.scheduler
    while sched.waiting or any(r.kv_len < args.input_len for r in sched.running):
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    assert len(sched.running) == args.requests and not sched.waiting

    gc.collect()
    times = []
    out0 = sum(len(r.output) for r in sched.running)
    for _ in range(args.steps):
        with wall_clock() as watch:
            eng.step()
        times.append(watch.seconds)
    tokens = sum(len(r.output) for r in sched.running) - out0
    assert len(sched.running) == args.requests, "a request finished: raise --output-len"

    rows = []
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            eng.step()
        prof.disable()
        assert len(sched.running) == args.requests, "a request finished: raise --output-len"
        for (file, line, fn), (_cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
            where = file.split("/python/")[-1] if "/python/" in file else file
            rows.append((tt, ct, nc, f"{where}:{line}({fn})"))
        rows.sort(reverse=True)
    top = [
        {
            "function": name,
            "tottime_us_per_step": tt / args.steps * 1e6,
            "cumtime_us_per_step": ct / args.steps * 1e6,
            "calls_per_step": nc / args.steps,
        }
        for tt, ct, nc, name in rows[: args.top]
    ]
    ms = sorted(t * 1e3 for t in times)
    eng.drain()
    state = [
        (r.rid, r.kv_len, r.output, r.mem.row, r.mem.pages, r.mem.swa_start, r.mem.state_slot)
        for r in sched.running
    ]
    st = eng.pool.stats
    state.append((st.used_bytes, st.peak_bytes, st.compactions, st.moved_units))
    digest = hashlib.sha256(repr(state).encode()).hexdigest()[:16]
    result = {
        "memory": kind,
        "requests": args.requests,
        "steps": args.steps,
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "mean_ms": statistics.fmean(ms),
        "tokens_per_step": tokens / args.steps,
        "digest": digest,
        "top_tottime": top,
    }
    del eng
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m unimem bench step-profile --host-only",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--gamma", type=int, default=7, help="0: plain decoding, no chain")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--no-profile", dest="profile", action="store_false", help="timing only, no cProfile"
    )
    ap.add_argument("--memory", default="static,unified", help="comma-separated kinds")
    ap.add_argument(
        "--arena-gib",
        type=int,
        default=0,
        help="unified arena size (default: the static pools' capacity)",
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    _no_device_bytes()
    torch.set_num_threads(1)
    lanes = draft_config_for(preset("small")).lanes() if args.gamma else ()
    spec = memory_spec(preset("small"), args.page_size, lanes)
    lay = MemoryLayout.build(spec)
    units = ", ".join(f"{k.value} {lay.unit_bytes(k) >> 10} KiB" for k in spec.kinds)
    what = f"verifying, gamma {args.gamma}" if args.gamma else "decoding (no speculation)"
    print(
        f"host work per engine step, CPU, no model compute: small preset ({units}), "
        f"{args.requests} requests {what}, page {args.page_size}"
    )
    results = []
    for kind in args.memory.split(","):
        r = measure(kind, args)
        results.append(r)
        print(
            f"[{kind}] {r['median_ms']:.3f} ms/step median, {r['p90_ms']:.3f} p90, "
            f"{r['mean_ms']:.3f} mean ({r['steps']} steps, {r['tokens_per_step']:.1f} tokens/step; "
            f"state digest {r['digest']})"
        )
        if not r["top_tottime"]:
            continue
        print(f"  {'tottime us/step':>16}{'cum us/step':>13}{'calls/step':>11}  function")
        for t in r["top_tottime"]:
            print(
                f"  {t['tottime_us_per_step']:>16.1f}{t['cumtime_us_per_step']:>13.1f}"
                f"{t['calls_per_step']:>11.1f}  {t['function']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results}, f, indent=2)
    return 0
