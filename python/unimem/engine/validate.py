"""The validation protocol: the same requests through static and unified memory.

Same weights (from the seed), same synthetic prompts, greedy decoding, the same scheduler
policy. The static run uses fixed pools sized so that every running request fits at its full
length (the oracle); the unified run uses one arena of ``arena_mb`` (default: the same bytes
as the static pools) — a small arena forces compaction and retraction. The report says how
many requests produced identical output ids, and compares throughput and memory.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from unimem.engine.config import HybridConfig, memory_spec, preset
from unimem.engine.engine import Engine
from unimem.engine.model import HybridModel
from unimem.memory.pool import MemoryPool, pages_for
from unimem.memory.spec import LayerKind
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory

MB = 1 << 20


@dataclass
class ValidateConfig:
    device: str = "cpu"
    preset: str = "tiny"
    requests: int = 16
    input_len: int = 96
    output_len: int = 32
    seed: int = 0
    page_size: int = 16
    arena_mb: float | None = None
    max_running: int = 8
    chunk_size: int = 128
    backend: str = "torch"


@dataclass
class RunResult:
    """One memory mode's run."""

    outputs: dict[int, list[int]]
    output_tokens: int
    seconds: float
    peak_bytes: int
    capacity_bytes: int
    steps: int
    compactions: int = 0
    retractions: int = 0
    forward_steps: dict[int, int] = field(default_factory=dict)

    def summary(self, with_arena_stats: bool) -> dict:
        out = {
            "output_tokens": self.output_tokens,
            "throughput_tok_s": self.output_tokens / self.seconds if self.seconds else 0.0,
            "peak_bytes": self.peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "steps": self.steps,
            "seconds": self.seconds,
        }
        if with_arena_stats:
            out["compactions"] = self.compactions
            out["retractions"] = self.retractions
        return out


def make_prompts(cfg: ValidateConfig, vocab_size: int) -> list[list[int]]:
    """Fixed synthetic prompts: ``requests`` x ``input_len`` token ids drawn from the seed."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, vocab_size, (cfg.requests, cfg.input_len), generator=g)
    return ids.tolist()


def static_pool(cfg: ValidateConfig, model_cfg: HybridConfig, device: torch.device) -> StaticMemory:
    """Pools sized so that ``max_running`` requests all fit at their full length."""
    spec = memory_spec(model_cfg, cfg.page_size)
    total = cfg.input_len + cfg.output_len
    per_req = pages_for(total, cfg.page_size)
    n = cfg.max_running * per_req
    return StaticMemory(spec, n, n, cfg.max_running, cfg.max_running, model_cfg.max_context, device)


def unified_pool(
    cfg: ValidateConfig, model_cfg: HybridConfig, device: torch.device, default_bytes: int
) -> UnifiedMemory:
    spec = memory_spec(model_cfg, cfg.page_size)
    arena = int(cfg.arena_mb * MB) if cfg.arena_mb is not None else default_bytes
    return UnifiedMemory(spec, arena, cfg.max_running, model_cfg.max_context, device)


def make_backend(name: str):
    if name == "torch":
        from unimem.attention.torch_backend import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "fa4":
        from unimem.attention.fa4_backend import FA4Backend

        return FA4Backend()
    raise ValueError(f"unknown attention backend {name!r}; valid: torch, fa4")


def run_one(
    model: HybridModel,
    pool: MemoryPool,
    cfg: ValidateConfig,
    prompts: list[list[int]],
    label: str,
    progress: bool,
) -> RunResult:
    engine = Engine(model, pool, make_backend(cfg.backend), cfg.max_running, cfg.chunk_size)
    for p in prompts:
        engine.submit(p, cfg.output_len)
    total = len(prompts) * cfg.output_len
    bar = ProgressBar(label, total) if progress else None
    start = time.perf_counter()
    done = engine.run(lambda e: bar.update(sum(len(r.output) for r in _all(e))) if bar else None)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    seconds = time.perf_counter() - start
    if bar:
        bar.close()
    return RunResult(
        outputs={r.rid: r.output for r in done},
        output_tokens=sum(len(r.output) for r in done),
        seconds=seconds,
        peak_bytes=pool.stats.peak_bytes,
        capacity_bytes=pool.stats.capacity_bytes,
        steps=engine.steps,
        compactions=pool.stats.compactions,
        retractions=engine.scheduler.retractions,
        forward_steps={r.rid: r.forward_steps for r in done},
    )


def _all(engine: Engine):
    s = engine.scheduler
    return list(s.finished) + list(s.running) + list(s.waiting)


def compare(static: RunResult, unified: RunResult) -> list[dict]:
    """Requests whose outputs differ, with the first differing position."""
    diffs = []
    for rid, a in static.outputs.items():
        b = unified.outputs.get(rid)
        if a != b:
            pairs = zip(a, b or [], strict=False)
            first = next((i for i, (x, y) in enumerate(pairs) if x != y), len(b or []))
            diffs.append({"rid": rid, "first_diff": first})
    return diffs


def validate(cfg: ValidateConfig, progress: bool = False) -> dict:
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda given but no CUDA device is available")
    model_cfg = preset(cfg.preset)
    model = HybridModel(model_cfg, seed=cfg.seed, device=device)
    prompts = make_prompts(cfg, model_cfg.vocab_size)
    static = static_pool(cfg, model_cfg, device)
    unified = unified_pool(cfg, model_cfg, device, static.stats.capacity_bytes + _header(static))
    res_s = run_one(model, static, cfg, prompts, "static ", progress)
    res_u = run_one(model, unified, cfg, prompts, "unified", progress)
    diffs = compare(res_s, res_u)
    return {
        "config": asdict(cfg),
        "requests": len(prompts),
        "exact_match": len(prompts) - len(diffs),
        "mismatches": diffs,
        "static": res_s.summary(with_arena_stats=False),
        "unified": res_u.summary(with_arena_stats=True),
    }


def _header(static: StaticMemory) -> int:
    """Bytes of the unified arena's sinks (so the default arena holds what static holds)."""
    return sum(static.layout.unit_bytes(k) for k in static.kinds if k is not LayerKind.STATE)


def format_table(report: dict) -> str:
    s, u = report["static"], report["unified"]
    rows = [
        ("", "static", "unified"),
        ("output tokens", s["output_tokens"], u["output_tokens"]),
        ("throughput tok/s", f"{s['throughput_tok_s']:.1f}", f"{u['throughput_tok_s']:.1f}"),
        ("peak bytes", s["peak_bytes"], u["peak_bytes"]),
        ("capacity bytes", s["capacity_bytes"], u["capacity_bytes"]),
        ("steps", s["steps"], u["steps"]),
        ("compactions", "-", u["compactions"]),
        ("retractions", "-", u["retractions"]),
    ]
    w = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [f"{str(a):<{w[0]}}  {str(b):>{w[1]}}  {str(c):>{w[2]}}" for a, b, c in rows]
    lines.append(f"exact match: {report['exact_match']}/{report['requests']} requests")
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    text = json.dumps(report, indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


class ProgressBar:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.enabled = label, max(total, 1), sys.stderr.isatty()

    def update(self, done: int) -> None:
        if self.enabled:
            filled = int(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} tokens")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
