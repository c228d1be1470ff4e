"""A decode step at its floor: unimem against llama.cpp on one model, one GPU, one command.

    python -m unimem bench decode-floor --model-path MODEL --json OUT.json \\
        [--prompts FILE] [--llama-bin DIR --gguf FILE] [--compile]

``MODEL`` is whatever ``unimem.Engine(model_path=...)`` resolves (an HF directory, or a
``.gguf`` file where the GGUF loader is present). It builds two engines side by side, static
pools and the unified arena, each with the same KV token count (``--max-total-tokens``,
default two full waves of the largest), and runs waves of 1, 8 and 48 concurrent requests
(``--concurrency``), each request ``--tokens`` (256) greedy tokens with EOS ignored (no stop
tokens), prompts the first ``c`` of the prompt set (cut to :data:`MAX_PROMPT_TOKENS`): per
``c`` an untimed wave on each engine, then four timed waves in ABBA order (``--order``), so
that a drift of the host's speed weighs on both alike; and reports:

- **tok/s**: the generated tokens of a memory kind's two timed waves over their wall time
  (prefill included), static and unified, each wave's own figure beside it; static ==
  unified token for token, and each engine's two waves alike, are checked (a mismatch fails
  the run);
- **wall ms/step**: the wave's wall time over its engine steps, and the host's share of it
  outside its one wait for the previous step (``host_ms_per_step``: when it nears the GPU
  step, the host, not the GPU, sets the pace);
- **GPU ms/step, kernels per step and per layer, GPU busy fraction**: ``torch.profiler`` over
  ``--profile-steps`` (64) steady decode steps of a wave of ``c`` (static pools): the union of
  kernel intervals per step, the kernel count (memcpy / memset excluded) per step and over the
  model's decoder layers, and busy time over wall (the profiler's own host overhead lowers
  this one; ``gpu_ms_per_step / wall_ms_per_step`` of the unprofiled wave is the other
  estimate); the idle time between kernels split at :data:`LAUNCH_GAP_US` into launch gaps
  inside a step's graph and gaps where the GPU waits for the host, and the fraction of wall
  the GPU is fed (busy or between two kernels of a step: ``gpu_fed_fraction``);
- **floor**: bytes a decode step must move (every weight once — the embedding table only for
  its ``c`` rows unless it is the LM head — plus the K/V the step's attention reads) over the
  measured device-to-device copy bandwidth, plus kernels per step times the measured cost of
  one kernel inside a CUDA graph; ``floor_ratio = gpu_ms_per_step / floor_ms``;
- the **Qwen3-Next-shaped synthetic model** (``small`` preset, no speculation): kernels per
  decode step and per layer by the same profiler count (``--no-synthetic`` skips it);
- with ``--llama-bin DIR --gguf FILE``: llama.cpp's ``llama-batched-bench`` (``-npp 16 -ntg
  256 -npl 1,8,48 -ngl 99 -fa on``; its decode speed ``S_TG``) and ``llama-server``
  (``--parallel 48``; the same prompt token ids, 256 tokens, greedy, ``ignore_eos``; tokens
  predicted over the wave's wall time);
- with ``--compile``: the hand-fused Triton kernels against ``torch.compile`` (Inductor) of
  their torch references (the unfused step code), each timed on the GPU alone (CUDA graphs of
  20 calls) at the model's shapes and 1, 8 and 48 rows (post-norm + add + norm, GeGLU, q/k
  norms + RoPE + K/V store, the greedy pick with its log-probability);
- with ``--host-top N``: after the timed waves of each ``c``, one more wave per memory kind
  under cProfile, its ``N`` top host functions per step (``host_top_functions``): where
  unified's host time outside its wait differs from static's.

Prompts: ``--prompts FILE`` (a ``.json`` list of token-id lists or of strings, or text with
one prompt per line, encoded by the checkpoint's tokenizer); without it, 48 seeded random
prompts of 16 token ids (said loudly). Fewer prompts than the largest wave are cycled.

The JSON (``--json``) has the issue's schema (``model``, ``gpu``, ``commit``, ``rows``: one per
concurrency with ``unimem_static_tok_s``, ``unimem_unified_tok_s``, ``llamacpp_engine_tok_s``,
``llamacpp_server_tok_s``, ``kernels_per_layer``, ``gpu_ms_per_step``, ``wall_ms_per_step``)
plus the details above. Any failure (a missing binary, a server that does not come up, a
mismatch, an exception) ends with exit status 1 after the JSON is written with ``"errors"``.
``--device cpu`` is a dry run of the unimem part (no profiler, floor or peers); without
CUDA, ``--device cuda`` ends with one line and status 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from functools import partial
from pathlib import Path

import torch

from unimem_kernel import envs
from unimem_kernel.timing import Stopwatch, graph_median_ms, median_ms, wall_clock

ROOT = Path(__file__).resolve().parents[3]
"""The repository root, when run from a checkout (for the commit it records)."""
PROG = "python -m unimem bench decode-floor"

WARMUP_TOKENS = 16
"""Tokens per request of the untimed wave that precedes each timed wave."""

MAX_PROMPT_TOKENS = 512
"""Prompt tokens per request the default pool size allows for (prompts are cut to this)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------- prompts


def load_prompts(args, tokenizer, vocab: int, n: int) -> tuple[list[list[int]], str]:
    """``n`` prompts as token ids and where they came from (module docstring)."""
    path = args.prompts
    if path is None:
        log("WARNING: no prompt set (--prompts): 48 random 16-token prompts")
        rng = random.Random(0)
        ids = [[rng.randrange(4, vocab) for _ in range(16)] for _ in range(max(n, 48))]
        return ids[:n] if n <= len(ids) else ids, "random 16-token ids (seed 0)"
    text = Path(path).read_text()
    if path.endswith(".json"):
        items = json.loads(text)
        if isinstance(items, dict):
            items = items.get("prompts", items.get("input_ids"))
    else:
        items = [line for line in text.splitlines() if line.strip()]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty list of prompts")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(f"{path}: text prompts need the checkpoint's tokenizer")
            out.append(list(tokenizer.encode(item)))
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            out.append(list(item))
        else:
            raise ValueError(f"{path}: prompt {i} is neither text nor a list of token ids")
    bad = [t for p in out for t in p if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{path}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    if any(len(p) > MAX_PROMPT_TOKENS for p in out):
        log(f"WARNING: prompts cut to their first {MAX_PROMPT_TOKENS} tokens")
        out = [p[:MAX_PROMPT_TOKENS] for p in out]
    if len(out) < n:
        log(f"WARNING: {len(out)} prompts in {path}, cycled to {n}")
    return [out[i % len(out)] for i in range(n)], path


# ---------------------------------------------------------------------- unimem


def build_engine(args, unified: bool, max_total_tokens: int | None = None):
    """An Engine of ``args``' model with static pools or the unified arena; on CUDA with
    ``max_total_tokens`` KV tokens (two engines share the GPU)."""
    import unimem

    kw = dict(
        model_path=args.model_path,
        device=args.device,
        dtype=args.dtype,
        enable_unified_memory=unified,
        max_running_requests=max(args.concurrency),
        page_size=args.page_size,
        random_seed=0,
    )
    if args.context_length:
        kw["context_length"] = args.context_length
    if max_total_tokens and args.device == "cuda":
        kw["max_total_tokens"] = max_total_tokens
    if args.device == "cpu":
        kw["attention_backend"] = "torch"
    return unimem.Engine(**kw)


def run_wave(core, prompts: list[list[int]], tokens: int) -> dict:
    """``prompts`` submitted together, run to the end; wall time, steps, outputs, and the
    host's time per step outside its one wait for the previous step's results (the GPU runs
    ahead of the host while that is shorter than a GPU step)."""
    from unimem.engine.step_io import StagedResult

    steps0 = core.steps
    waited = Stopwatch()
    read = StagedResult.read

    def timed_read(self):
        with wall_clock(into=waited):
            return read(self)

    StagedResult.read = timed_read
    try:
        with wall_clock(core.runner.device) as watch:
            reqs = [core.submit(p, tokens) for p in prompts]
            core.run()
        wall = watch.seconds
    finally:
        StagedResult.read = read
    outs = [list(r.output) for r in reqs]
    if any(len(o) != tokens for o in outs):
        raise RuntimeError(f"a request stopped early: {[len(o) for o in outs]} of {tokens}")
    steps = core.steps - steps0
    return {
        "wall_s": wall,
        "steps": steps,
        "tok_s": len(prompts) * tokens / wall,
        "wall_ms_per_step": 1e3 * wall / steps,
        "host_ms_per_step": 1e3 * (wall - waited.seconds) / steps,
        "wait_ms_per_step": 1e3 * waited.seconds / steps,
        "outputs": outs,
    }


def profiled_wave(core, prompts: list[list[int]], tokens: int, top: int) -> list[dict]:
    """One more wave of ``prompts`` under cProfile: its ``top`` host functions by own time,
    in microseconds per engine step (``step_profile.top_functions``). cProfile slows the host
    several-fold, so these rank functions; they are not timings of the unprofiled loop."""
    import cProfile

    from unimem.bench.step_profile import top_functions

    steps0 = core.steps
    prof = cProfile.Profile()
    prof.enable()
    try:
        for p in prompts:
            core.submit(p, tokens)
        core.run()
    finally:
        prof.disable()
    return top_functions(prof, max(core.steps - steps0, 1), "step", top)


def sync(core) -> None:
    if torch.cuda.is_available() and core.runner.device.type == "cuda":
        torch.cuda.synchronize()


def decoder_layers(model) -> int:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    return len(layers if layers is not None else model.layers)


LAUNCH_GAP_US = 5.0
"""Idle gaps between two kernels shorter than this are the launch of the next kernel inside
a step's graph (~1.2 µs measured on the H100 and H200); longer ones are the GPU waiting for
the host (the next step's graph not yet launched)."""


def gap_profile(spans: list[tuple[float, float]], threshold_us: float) -> dict:
    """The GPU timeline of kernel ``spans`` (start, end; µs, any order, overlaps merged):
    ``busy_us`` (the union of the spans) and the idle gaps between them, ``short_gap_us``
    below ``threshold_us`` and ``long_gap_us`` at or above it, with their counts."""
    busy, end = 0.0, None
    short = long = 0.0
    n_short = n_long = 0
    for s, t in sorted(spans):
        if end is not None and s > end:
            gap = s - end
            if gap < threshold_us:
                short, n_short = short + gap, n_short + 1
            else:
                long, n_long = long + gap, n_long + 1
        if end is not None and t <= end:
            continue
        busy += t - (s if end is None else max(s, end))
        end = t
    return {
        "busy_us": busy,
        "short_gap_us": short,
        "long_gap_us": long,
        "short_gaps": n_short,
        "long_gaps": n_long,
    }


def profile_decode(core, prompts: list[list[int]], steps: int, n_layers: int) -> dict:
    """``torch.profiler`` over ``steps`` steady decode steps of the batch ``prompts``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    reqs = [core.submit(p, steps + 16) for p in prompts]
    while not all(len(r.output) >= 2 for r in reqs):  # prefill done, decoding
        core.step()
    for _ in range(4):
        core.step()
    sync(core)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with wall_clock(core.runner.device) as watch:
            for _ in range(steps):
                core.step()
        wall = watch.seconds
    core.run()
    kernels, spans, kernel_us = {}, [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        if not re.match(r"(?i)memcpy|memset", e.name):
            kernels[e.name] = kernels.get(e.name, 0) + 1
            kernel_us[e.name] = kernel_us.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    gaps = gap_profile(spans, LAUNCH_GAP_US)
    busy = gaps["busy_us"]
    n_kernels = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "steps": steps,
        "kernels_per_step": n_kernels / steps,
        "kernels_per_layer": n_kernels / steps / n_layers,
        "gpu_ms_per_step": busy / 1e3 / steps,
        "profiled_wall_ms_per_step": 1e3 * wall / steps,
        "gpu_busy_fraction_profiled": (busy / 1e6) / wall,
        # the idle time between kernels, split at LAUNCH_GAP_US: the short gaps are a launch
        # each inside a step's graph; the long ones are the GPU waiting for the host
        "launch_gap_us_per_step": gaps["short_gap_us"] / steps,
        "host_wait_gap_us_per_step": gaps["long_gap_us"] / steps,
        "gpu_fed_fraction_profiled": ((busy + gaps["short_gap_us"]) / 1e6) / wall,
        "top_kernels_per_step": {k: round(v / steps, 2) for k, v in top},
        "top_kernel_us_per_step": {
            k[:120]: round(v / steps, 2)
            for k, v in sorted(kernel_us.items(), key=lambda kv: -kv[1])[:25]
        },
    }


def step_bytes(model, c: int, ctx_len: int) -> int:
    """Bytes one decode step of ``c`` requests at context ``ctx_len`` must read: every weight
    storage once (an embedding table that is not also the LM head: ``c`` rows), and the K/V
    rows its attention layers read (a sliding layer at most its window)."""
    storages = {}
    embed = getattr(model, "embed_weight", None)
    head = getattr(model, "lm_head_weight", None)
    for p in list(model.parameters()) + list(model.buffers()):
        st = p.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    total = sum(storages.values())
    if embed is not None and head is not None:
        e = embed.untyped_storage()
        if e.data_ptr() != head.untyped_storage().data_ptr():
            total -= e.nbytes() - c * embed.shape[1] * embed.element_size()
    cfg = model.config
    esz = torch.tensor([], dtype=cfg.dtype).element_size()
    for kind in cfg.layer_pattern:
        if kind == "full":
            keys = ctx_len
        elif kind == "swa":
            keys = min(ctx_len, cfg.window or ctx_len)
        else:
            continue
        total += c * keys * cfg.n_kv_heads * (cfg.head_dim_k + cfg.head_dim_v) * esz
    return total


def measure_bandwidth_and_launch() -> dict:
    """Device copy bandwidth (read + write bytes per second) and one tiny kernel's cost
    inside a CUDA graph (µs)."""
    n = 1 << 29
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = partial(dst.copy_, src)
    copy_ms = median_ms(copy, warmup=3, iters=10, repeats=1, device="cuda")
    bw = 2 * n / (copy_ms / 1e3)
    del src, dst, copy
    x = torch.zeros(1, device="cuda")
    launch_us = 1e3 * graph_median_ms(lambda: x.add_(1), warmup=1, iters=256, repeats=10)
    return {"copy_bandwidth_gb_s": bw / 1e9, "graph_kernel_us": launch_us}


def synthetic_kernels(args) -> dict:
    """Kernels per decode step / layer of the ``small`` preset (no speculation)."""
    from unimem.attention.fa4_backend import FA4Backend
    from unimem.engine.core import EngineCore
    from unimem.memory.static import StaticMemory
    from unimem.models.config import memory_spec
    from unimem.models.presets import preset
    from unimem.models.synthetic import HybridModel

    cfg = preset("small")
    model = HybridModel(cfg, seed=0, device="cuda")
    out = {}
    for c in (1, 48):
        pages = c * -(-(64 + args.profile_steps + 64) // 64)
        pool = StaticMemory(memory_spec(cfg, 64, ()), pages, pages, c, c, cfg.max_context,
                            torch.device("cuda"))  # fmt: skip
        core = EngineCore(model, pool, FA4Backend(), c, 8192, cuda_graphs=True)
        rng = random.Random(1)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(64)] for _ in range(c)]
        out[str(c)] = profile_decode(core, prompts, args.profile_steps, len(cfg.layer_pattern))
        del core, pool
        gc.collect()
        torch.cuda.empty_cache()
    return {"preset": "small", "layers": len(cfg.layer_pattern), "by_concurrency": out}


# ---------------------------------------------------------------------- torch.compile


def compile_vs_fused(model, rows_list=(1, 8, 48)) -> dict:
    """Hand-fused Triton kernels against ``torch.compile`` of their torch references, GPU time
    per call (µs) at the model's shapes."""
    from unimem_kernel import fused as fu
    from unimem_kernel import greedy_pick, kv_store

    cfg = model.config
    dt, dev = cfg.dtype, torch.device("cuda")
    d, hd, hq, hk, ffn = cfg.d_model, cfg.head_dim_k, cfg.n_q_heads, cfg.n_kv_heads, cfg.ffn_dim
    eps = cfg.rms_eps
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dt)

    def gpu_us(fn) -> float:
        return 1e3 * graph_median_ms(fn, warmup=2, iters=20, repeats=10)

    ref_chain = torch.compile(fu.norm_add_rms_norm_reference)
    ref_gelu = torch.compile(fu.gelu_tanh_mul_reference)
    ref_rope = torch.compile(kv_store.rope_store_kv_reference)
    ref_pick = torch.compile(greedy_pick.greedy_logprob_reference)
    out = {}
    for rows in rows_list:
        x, h = rnd(rows, d), rnd(rows, d)
        pw, nw = rnd(d) * 0.1, rnd(d) * 0.1
        gu = rnd(rows, 2 * ffn)
        q, k, v = rnd(rows, hq, hd), rnd(rows, hk, hd), rnd(rows, hk, hd)
        qw, kw = rnd(hd) * 0.1, rnd(hd) * 0.1
        ang = torch.arange(rows, device=dev)[:, None] * torch.rand(hd // 2, device=dev)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        pages = rows + 2
        kc = torch.zeros(pages, 16, hk, hd, dtype=dt, device=dev)
        vc = torch.zeros_like(kc)
        slots = (torch.arange(rows, device=dev, dtype=torch.int32) + 1) * 16
        norms = (qw, kw, eps)
        logits = torch.randn(rows, cfg.vocab_size, generator=gen, device=dev) * 8
        rope_args = (q, k, v, cos, sin, kc, vc, slots)
        cases = {
            "post_norm_add_norm": (
                partial(fu.norm_add_rms_norm, x, h, pw, nw, eps, zero_centered=True),
                partial(ref_chain, x, h, pw, nw, eps, zero_centered=True),
            ),
            "gelu_tanh_mul": (partial(fu.gelu_tanh_mul, gu), partial(ref_gelu, gu)),
            "qk_norm_rope_store": (
                partial(kv_store.rope_store_kv, *rope_args, qk_norm=norms),
                partial(ref_rope, *rope_args, qk_norm=norms),
            ),
            "greedy_logprob": (
                partial(greedy_pick.greedy_logprob, logits),
                partial(ref_pick, logits),
            ),
        }
        for name, (fused_fn, compiled_fn) in cases.items():
            f_us, c_us = gpu_us(fused_fn), gpu_us(compiled_fn)
            out.setdefault(name, {})[str(rows)] = {"fused_us": f_us, "inductor_us": c_us}
            log(f"  {name} rows {rows}: fused {f_us:.2f} us, inductor {c_us:.2f} us")
    return out


# ---------------------------------------------------------------------- llama.cpp


def llama_batched_bench(bin_dir: Path, gguf: str, conc: list[int], tokens: int) -> dict:
    exe = bin_dir / "llama-batched-bench"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found")
    ctx = max(conc) * (16 + tokens) + 256
    cmd = [str(exe), "-m", gguf, "-npp", "16", "-ntg", str(tokens),
           "-npl", ",".join(map(str, conc)), "-ngl", "99", "-fa", "on", "-c", str(ctx)]  # fmt: skip
    log("llama.cpp: " + " ".join(cmd))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({run.returncode}): {run.stderr[-2000:]}")
    header, out = None, {}
    for line in run.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
            continue
        if header and len(cells) == len(header) and cells[0].isdigit():
            row = dict(zip(header, cells, strict=True))
            out[int(row["B"])] = float(row["S_TG t/s"])
    if set(out) != set(conc):
        raise RuntimeError(f"llama-batched-bench: no S_TG for {set(conc) - set(out)}:\n"
                           f"{run.stdout[-3000:]}")  # fmt: skip
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_server(bin_dir: Path, gguf: str, prompts: list[list[int]], conc: list[int],
                 tokens: int) -> dict:  # fmt: skip
    exe = bin_dir / "llama-server"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found")
    par = max(conc)
    per_slot = max(len(p) for p in prompts) + tokens + 16
    port = _free_port()
    cmd = [str(exe), "-m", gguf, "-ngl", "99", "-fa", "on", "--parallel", str(par),
           "-c", str(par * per_slot), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log("llama.cpp: " + " ".join(cmd))
    logf = open("/tmp/bench_decode_floor_llama_server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}; see its log")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline:
                raise RuntimeError("llama-server did not become healthy in 180 s")
            time.sleep(0.5)

        def one(ids, n):
            body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "cache_prompt": False}  # fmt: skip
            r = _post(base + "/completion", body, timeout=600)
            got = r.get("tokens_predicted", r.get("timings", {}).get("predicted_n"))
            if got != n:
                raise RuntimeError(f"llama-server predicted {got} tokens, asked {n}")
            return got

        one(prompts[0], 8)  # warm-up
        out = {}
        for c in conc:
            with wall_clock() as watch, concurrent.futures.ThreadPoolExecutor(c) as ex:
                done = list(ex.map(lambda p: one(p, tokens), prompts[:c]))
            out[c] = sum(done) / watch.seconds
            log(f"  llama-server c={c}: {out[c]:.0f} tok/s")
        return out
    finally:
        if proc.poll() is None:  # (a server that died on its own has nothing to stop)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        logf.close()


# ---------------------------------------------------------------------- main


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,8,48")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--profile-steps", type=int, default=64)
    ap.add_argument("--llama-bin", default=None, help="llama.cpp build/bin directory")
    ap.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile vs fused")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument(
        "--order",
        choices=["static,unified", "unified,static"],
        default="static,unified",
        help="which memory kind's engine is built first and times the A waves of each ABBA round",
    )
    ap.add_argument(
        "--host-top",
        type=int,
        default=0,
        help="after the timed waves, one more wave per memory kind under cProfile: this many "
        "host functions per step (where unified's host time differs from static's)",
    )
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV tokens of each engine's pools (default: two full waves of the largest)",
    )
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if (args.llama_bin is None) != (args.gguf is None):
        ap.error("--llama-bin and --gguf go together")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(f"{PROG}: error: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    import triton

    result = {
        "model": args.model_path,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "commit": git_commit(),
        "settings": {
            "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
            "tokens": args.tokens, "concurrency": args.concurrency, "page_size": args.page_size,
            "fused_ops": envs.get("UNIMEM_FUSED_OPS"),
            "norm_linear_rows": envs.get("UNIMEM_NORM_LINEAR_ROWS"),
            "norm_linear_plain": envs.get("UNIMEM_NORM_LINEAR_PLAIN"),
            "pdl": envs.get("UNIMEM_PDL"), "order": args.order,
        },
        "rows": [],
        "errors": [],
    }  # fmt: skip
    log(f"{result['gpu']}  torch {torch.__version__}  triton {triton.__version__}  "
        f"commit {result['commit'][:12]}")  # fmt: skip
    rows = {c: {"concurrency": c} for c in args.concurrency}
    outputs: dict[str, dict[int, list]] = {}
    prompts = None
    # both engines' pools: every wave's requests at full length, twice over (the prefix
    # cache keeps finished prompts), the same token count for both memory kinds
    pool = args.max_total_tokens or 2 * max(args.concurrency) * (
        args.tokens + WARMUP_TOKENS + MAX_PROMPT_TOKENS + args.page_size
    )
    model_info = {}
    t_start = time.time()
    try:
        order = args.order.split(",")
        engines = {}
        for mode in order:  # both alive: their timed waves alternate
            log(f"unimem {mode}: building the engine")
            engines[mode] = build_engine(args, unified=mode == "unified", max_total_tokens=pool)
        eng = engines["static"]
        core = eng.core
        n_layers = decoder_layers(eng.model)
        prompts, source = load_prompts(args, eng.tokenizer, eng.model.config.vocab_size,
                                       max(args.concurrency))  # fmt: skip
        result["prompts"] = {"source": source, "lengths": [len(p) for p in prompts]}
        log(f"prompts: {source}, lengths {min(map(len, prompts))}-{max(map(len, prompts))}")
        outputs = {mode: {} for mode in order}
        a, b = order
        for c in args.concurrency:
            # an untimed wave of the same size on each engine first: what a batch of c
            # compiles or captures on first use stays out of the timed waves; then the
            # timed waves in ABBA order, so that a drift of the host's speed during the run
            # weighs on both memory kinds alike
            for mode in order:
                run_wave(engines[mode].core, prompts[:c], WARMUP_TOKENS)
            waves = {mode: [] for mode in order}
            for mode in (a, b, b, a):
                w = run_wave(engines[mode].core, prompts[:c], args.tokens)
                outs = w.pop("outputs")
                if outputs[mode].setdefault(c, outs) != outs:
                    result["errors"].append(f"{mode}: two waves of {c} gave other tokens")
                waves[mode].append(w)
            for mode in order:
                ws = waves[mode]
                wall = sum(w["wall_s"] for w in ws)
                steps = sum(w["steps"] for w in ws)
                host = sum(w["host_ms_per_step"] * w["steps"] for w in ws)
                merged = {
                    "tok_s": len(ws) * c * args.tokens / wall,
                    "wall_ms_per_step": 1e3 * wall / steps,
                    "host_ms_per_step": host / steps,
                    "steps": steps,
                    "runs": ws,
                }
                rows[c][f"unimem_{mode}_tok_s"] = merged["tok_s"]
                rows[c][f"{mode}_wave"] = merged
                log(f"  {mode} c={c}: {merged['tok_s']:.0f} tok/s, "
                    f"{merged['wall_ms_per_step']:.3f} ms/step wall, host "
                    f"{merged['host_ms_per_step']:.3f} outside its wait (runs "
                    + ", ".join(f"{w['tok_s']:.0f}" for w in ws) + ")")  # fmt: skip
            rows[c]["wall_ms_per_step"] = rows[c]["static_wave"]["wall_ms_per_step"]
            if args.host_top:
                rows[c]["host_top_functions"] = {
                    mode: profiled_wave(
                        engines[mode].core, prompts[:c], args.tokens, args.host_top
                    )  # fmt: skip
                    for mode in order
                }
        if cuda:
            bwl = measure_bandwidth_and_launch()
            result["device"] = bwl
            log(f"copy bandwidth {bwl['copy_bandwidth_gb_s']:.0f} GB/s, "
                f"{bwl['graph_kernel_us']:.2f} us per kernel in a graph")  # fmt: skip
            for c in args.concurrency:
                p = profile_decode(core, prompts[:c], args.profile_steps, n_layers)
                ctx = sum(len(x) for x in prompts[:c]) / c + 8 + args.profile_steps / 2
                nbytes = step_bytes(eng.model, c, int(ctx))
                floor_ms = (1e3 * nbytes / (bwl["copy_bandwidth_gb_s"] * 1e9)
                            + p["kernels_per_step"] * bwl["graph_kernel_us"] / 1e3)  # fmt: skip
                p.update(
                    bytes_per_step=nbytes,
                    floor_ms=floor_ms,
                    floor_ratio=p["gpu_ms_per_step"] / floor_ms,
                    gpu_busy_fraction=p["gpu_ms_per_step"] / rows[c]["wall_ms_per_step"],
                    gpu_fed_fraction=(p["gpu_ms_per_step"] + p["launch_gap_us_per_step"] / 1e3)
                    / rows[c]["wall_ms_per_step"],
                )
                rows[c]["profile"] = p
                rows[c]["kernels_per_layer"] = p["kernels_per_layer"]
                rows[c]["gpu_ms_per_step"] = p["gpu_ms_per_step"]
                log(f"  profile c={c}: {p['kernels_per_layer']:.2f} kernels/layer, GPU "
                    f"{p['gpu_ms_per_step']:.3f} ms/step, floor {floor_ms:.3f} ms "
                    f"(x{p['floor_ratio']:.2f}), busy {p['gpu_busy_fraction']:.2f} "
                    f"(profiled {p['gpu_busy_fraction_profiled']:.2f}; with the launch "
                    f"gaps {p['gpu_fed_fraction_profiled']:.2f}: "
                    f"{p['launch_gap_us_per_step']:.0f} us/step of launch gaps, "
                    f"{p['host_wait_gap_us_per_step']:.0f} waiting for the host)")  # fmt: skip
                for name, t_us in list(p["top_kernel_us_per_step"].items())[:10]:
                    log(f"    {t_us:8.1f} us/step  {name[:90]}")
            if args.compile:
                log("torch.compile (Inductor) vs the fused kernels")
                result["compile_vs_fused"] = compile_vs_fused(eng.model)
        model_info = {"layers": n_layers, "config": repr(eng.model.config)}
        del eng, core
        for e in engines.values():
            e.shutdown()
        engines.clear()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        result["model_info"] = model_info
        for c in args.concurrency:
            same = outputs["static"][c] == outputs["unified"][c]
            rows[c]["static_equals_unified"] = same
            # to compare the tokens of runs with other settings (kernel switches)
            digest = hashlib.sha256(json.dumps(outputs["static"][c]).encode()).hexdigest()
            rows[c]["static_tokens_sha256"] = digest[:16]
            rows[c]["unified_over_static"] = (
                rows[c]["unimem_unified_tok_s"] / rows[c]["unimem_static_tok_s"]
            )
            if not same:
                result["errors"].append(f"static != unified at concurrency {c}")
    except Exception:
        result["errors"].append(traceback.format_exc())
        log("ERROR:\n" + traceback.format_exc())
    if cuda and not args.no_synthetic:
        try:
            log("synthetic small preset (Qwen3-Next-shaped): kernels per layer")
            result["synthetic"] = synthetic_kernels(args)
            for c, p in result["synthetic"]["by_concurrency"].items():
                log(f"  synthetic c={c}: {p['kernels_per_layer']:.2f} kernels/layer, "
                    f"GPU {p['gpu_ms_per_step']:.3f} ms/step")  # fmt: skip
        except Exception:
            result["errors"].append(traceback.format_exc())
            log("ERROR:\n" + traceback.format_exc())
    if args.llama_bin and prompts is not None:
        bin_dir = Path(args.llama_bin)
        try:
            eng_tok = llama_batched_bench(bin_dir, args.gguf, args.concurrency, args.tokens)
            for c in args.concurrency:
                rows[c]["llamacpp_engine_tok_s"] = eng_tok[c]
                log(f"  llama-batched-bench B={c}: {eng_tok[c]:.0f} tok/s (S_TG)")
        except Exception:
            result["errors"].append(traceback.format_exc())
            log("ERROR:\n" + traceback.format_exc())
        try:
            srv = llama_server(bin_dir, args.gguf, prompts, args.concurrency, args.tokens)
            for c in args.concurrency:
                rows[c]["llamacpp_server_tok_s"] = srv[c]
        except Exception:
            result["errors"].append(traceback.format_exc())
            log("ERROR:\n" + traceback.format_exc())
    for c in args.concurrency:
        r = rows[c]
        for key in ("llamacpp_engine_tok_s", "llamacpp_server_tok_s", "kernels_per_layer",
                    "gpu_ms_per_step", "wall_ms_per_step", "unimem_static_tok_s",
                    "unimem_unified_tok_s"):  # fmt: skip
            r.setdefault(key, None)
        if r["llamacpp_engine_tok_s"] and r["unimem_static_tok_s"]:
            r["static_over_llamacpp_engine"] = r["unimem_static_tok_s"] / r["llamacpp_engine_tok_s"]
        result["rows"].append(r)
    result["elapsed_s"] = time.time() - t_start
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(f"{'c':>3} {'static':>8} {'unified':>8} {'llama-eng':>9} {'llama-srv':>9} "
          f"{'k/layer':>7} {'gpu ms':>7} {'wall ms':>7}")  # fmt: skip
    cols = (
        "unimem_static_tok_s",
        "unimem_unified_tok_s",
        "llamacpp_engine_tok_s",
        "llamacpp_server_tok_s",
        "kernels_per_layer",
        "gpu_ms_per_step",
        "wall_ms_per_step",
    )
    for r in result["rows"]:
        cells = [f"{r[k]:>8.1f}" if isinstance(r[k], float) else f"{'-':>8}" for k in cols]
        print(f"{r['concurrency']:>3} " + " ".join(cells))
    log(f"wrote {args.json} ({result['elapsed_s']:.0f} s)")
    if result["errors"]:
        print(f"FAILED: {len(result['errors'])} error(s):", file=sys.stderr)
        for e in result["errors"]:
            print(e.strip().splitlines()[-1], file=sys.stderr)
        return 1
    return 0
