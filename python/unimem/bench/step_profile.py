"""Where a decode/verify step's time goes, on one GPU (the data for choosing the next
optimisation).

Builds the ``small`` preset with a DSPARK drafter (gamma 7) over static pools and over a
unified arena (``--memory``), admits ``--requests`` prompts, prefills them, and then, in the
steady state (every request verifying):

1. **engine loop**: ``--steps`` engine steps, wall time per step, and the host's share — the
   time ``EngineCore.step`` spends outside its one wait for the previous step's results (plan,
   grow, launch, account). The GPU is never idle while host time < GPU time per step.
2. **GPU per step**: back-to-back replays of the recorded verify step
   (:func:`unimem_kernel.timing.median_ms` on the device).
3. **kernel breakdown**: ``torch.profiler`` over a few replays; kernels grouped by what they
   do (GEMMs: every projection, MLP and the LM heads; attention: FA4; GDN: our Triton conv +
   delta rule; metadata: our fused builder + write window; state commit; the rest: norms,
   RoPE, argmax, accept, elementwise).
4. **attribution** (``--attribute N``): one verify step run eagerly under ``torch.profiler``
   with Python stacks; the ``N`` torch ops with the most GPU time, each with the unimem
   source lines that launched it (graph replays carry no launch sites; an eager step runs
   the same kernels). Triton kernels are launched outside torch ops and are not listed.

Prints a table per memory kind (and the top kernels) and writes JSON (``--json``). Replays in
parts 2-3 advance the device state past what the host read, so they come last.

    python -m unimem bench step-profile --requests 48 --input-len 512 --json out.json

``--model-path M`` measures a real model's step instead, built as ``unimem.Engine`` builds it
(its CUDA graphs, its attention backend's defaults): DSPARK's verify step with the drafter
shipped for it (``--drafter DIR``: another), the acceptance control off, on the package's
real prompts (joined and cut to ``--input-len`` tokens each, :func:`real_prompts`);
``--no-speculation``: its plain decode step. Each JSON run then also names the
model, the drafter and the accept length.

    python -m unimem bench step-profile --model-path gemma-3-270m --requests 1 --json v1.json

With ``--model-path``, ``--extend`` also times the extend step on its own (what every
admission costs): ``Engine.generate`` of ``--requests`` prompts, cut to ``--input-len``
tokens, for one token each (one extend step), after a warm-up — wall and GPU milliseconds
per extend, kernel launches (per layer too) and, with ``--host-top``, the host's top
functions under cProfile.

Needs a CUDA device. ``--host-only`` (first flag) runs the host's share of a step on any
machine instead, the device work replaced by trivial stand-ins (:mod:`unimem.bench.host_step`;
its flags follow).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import gc
import io
import json
import math
import pstats
import re
import sys
import time
import warnings
from collections import defaultdict

import torch
import triton

from unimem.attention.fa4_backend import SPLIT_KV_MAX_BS, FA4Backend, split_kv_batch
from unimem.engine.core import EngineCore
from unimem.engine.sampling import SamplingOptions
from unimem.engine.step_io import StagedResult
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem_kernel.timing import Stopwatch, median_ms, wall_clock

CATEGORIES = [
    (
        "attention (FA4, split-KV)",
        re.compile(r"flash|fmha|FlashAttn|cute|_split_kv_|(?<!_moe)_combine_kernel", re.I),
    ),
    ("GDN conv + delta rule", re.compile(r"_conv_kernel|_rule_kernel")),
    ("metadata + write window", re.compile(r"_metadata_kernel|_write_window_kernel")),
    ("state commit", re.compile(r"_commit")),
    ("FP8 activation quantisation", re.compile(r"_quant_groups_kernel")),
    ("GEMM (projections, MLP, LM heads)", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas", re.I)),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other (norms, RoPE, sampling, accept, elementwise)"


OUTPUT_LEN = 1024
"""Output tokens each request is submitted for (the measurement ends well before)."""


def synthetic_core(kind: str, split_kv_max_bs: int, args, model, drafter, prompts) -> EngineCore:
    """The ``small`` preset's step loop over ``kind`` memory, DSPARK at ``args.gamma`` with
    the acceptance control at 0.8 (a steady accept length without a trained drafter)."""
    dev = model.device
    cfg = model.config
    refs = {i: p + p for i, p in enumerate(prompts)}
    chain = DsparkChain(drafter, args.gamma, AcceptanceControl(0.8, 0, refs, dev))
    spec = memory_spec(cfg, args.page_size, drafter.config.lanes())
    n = len(prompts)
    if kind == "static":
        pages = n * -(-(args.input_len + OUTPUT_LEN + 2 * (args.gamma + 1)) // args.page_size)
        pool = StaticMemory(spec, pages, pages, n, n, cfg.max_context, dev)
    else:
        pool = UnifiedMemory(spec, 24 << 30, n, cfg.max_context, dev)
    backend = FA4Backend(split_kv_max_bs=split_kv_max_bs)
    return EngineCore(model, pool, backend, n, 8192, chain=chain, cuda_graphs=True)


def model_engine(kind: str, args, device: str = "cuda"):
    """``unimem.Engine`` of ``args.model_path`` with DSPARK (its shipped drafter, or
    ``args.drafter``; no acceptance control: the real drafter's acceptance), or without it
    (``args.no_speculation``), over ``kind`` memory, ``args.requests`` running, pools sized
    for the measurement: each request of at most ``args.input_len`` prompt tokens fits with
    its ``OUTPUT_LEN`` tokens (``device`` "cpu" only for the test of that sizing)."""
    from unimem.engine.api import Engine
    from unimem.engine.args import SWA_FULL_TOKENS_RATIO

    tokens = args.input_len + OUTPUT_LEN + args.page_size
    kw = {}
    if not args.no_speculation:
        kw = dict(speculative_algorithm="DSPARK", speculative_num_draft_tokens=args.gamma + 1)
        tokens += 2 * (args.gamma + 1)  # the write window and the look-ahead
        if args.drafter:
            kw["speculative_draft_model_path"] = args.drafter
    # max_total_tokens counts FULL tokens; the SWA pool holds SWA_FULL_TOKENS_RATIO as many,
    # and a request whose prompt is one chunk holds all its tokens in SWA pages at its peak
    max_total = math.ceil(args.requests * tokens / min(1.0, SWA_FULL_TOKENS_RATIO))
    return Engine(
        model_path=args.model_path, device=device, enable_unified_memory=kind == "unified",
        page_size=args.page_size, max_running_requests=args.requests, disable_radix_cache=True,
        max_total_tokens=max_total, **kw,
    )  # fmt: skip


def sampling_options(args) -> SamplingOptions | None:
    """The requests' sampling (``--temperature``, ``--top-k``, ``--top-p``; seeded): None for
    greedy."""
    if args.temperature <= 0:
        return None
    return SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0)


def step_graphs(runner, sampling: SamplingOptions | None):
    """The recorded steps the engine replays for a batch of requests that all pick with
    ``sampling``: the greedy set, or the set of its cut-off rule."""
    if sampling is None:
        return runner.graphs
    return runner.sample_graphs[sampling.cut_rule]


def measure(eng: EngineCore, kind: str, args, prompts) -> dict:
    """Steady-state numbers of ``eng``'s step loop (one memory ``kind``: "static" or
    "unified"): submit ``prompts``, run until every request holds ``args.input_len`` tokens,
    then measure (module docstring). With ``--temperature``, every request samples (each its
    own seed) and the sampled step of its cut-off rule is the one replayed and profiled."""
    dev = eng.runner.device
    cfg = eng.model.config
    backend = eng.runner.backend
    split_kv_max_bs = backend.split_kv_max_bs
    sampling = sampling_options(args)
    for i, p in enumerate(prompts):
        opts = None if sampling is None else dataclasses.replace(sampling, seed=i)
        eng.submit(p, OUTPUT_LEN, sampling=opts)
    while any(r.kv_len < args.input_len for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    if len(eng.scheduler.running) != len(prompts):
        raise RuntimeError(
            f"{len(eng.scheduler.running)} of {len(prompts)} requests running at the steady "
            "state (the others finished or wait): the profile would measure a smaller batch"
        )

    # 1. engine loop, host share
    waited = Stopwatch()
    read = StagedResult.read

    def timed_read(self):
        with wall_clock(into=waited):
            return read(self)

    StagedResult.read = timed_read
    tokens0 = sum(len(r.output) for r in eng.scheduler.running)
    compiled0 = jit_cache_keys()
    with wall_clock(dev) as watch:
        for _ in range(args.steps):
            eng.step()
        eng.drain()
    wall = watch.seconds / args.steps
    StagedResult.read = read
    tokens = sum(len(r.output) for r in eng.scheduler.running) - tokens0
    host = wall - waited.seconds / args.steps
    compiles = new_compiles(compiled0, jit_cache_keys())
    host_top = profile_host(eng, args.steps, args.host_top) if args.host_top else []

    # 2. GPU time of one verify step (graph replays back to back)
    runner = eng.runner
    graphs = step_graphs(runner, sampling)
    bs = len(eng.scheduler.running)
    width = graphs.bucket(bs)
    gpu_ms = median_ms(
        lambda: graphs.replay(width), warmup=1, iters=args.replays, repeats=1, device=dev
    )

    # 3. kernel breakdown
    n_prof = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n_prof):
            graphs.replay(width)
        torch.cuda.synchronize()
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    per_kernel_calls: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us > 0:
            per_cat[category(evt.key)] += us / 1000 / n_prof
            per_kernel[evt.key[:160]] += us / 1000 / n_prof
            per_kernel_calls[evt.key[:160]] += evt.count / n_prof
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top_kernels]
    launch_sites = attribute_ops(runner, width, args.attribute, sampling) if args.attribute else []
    return {
        "memory": kind,
        "step": "verify" if eng.chain is not None else "decode",
        "sampling": None if sampling is None else dataclasses.asdict(sampling) | {"seed": "index"},
        "accept_length": (
            sum(r.verified_tokens for r in eng.scheduler.running)
            / max(1, sum(r.verify_steps for r in eng.scheduler.running))
            if eng.chain is not None
            else None
        ),
        "split_kv_max_bs": split_kv_max_bs,
        "split_kv": split_kv_batch(
            width, backend.split_kv_max_bs, q_heads=cfg.n_q_heads, head_dim=cfg.head_dim_k
        ),
        "requests": bs,
        "bucket": width,
        "step_wall_ms": wall * 1e3,
        "host_ms_per_step": host * 1e3,
        "tokens_per_step": tokens / args.steps,
        "output_tok_s": tokens / (wall * args.steps),
        "gpu_ms_per_verify_step": gpu_ms,
        "kernel_ms_per_step": dict(per_cat),
        "top_kernels_ms": dict(top),
        "top_kernel_calls_per_step": {name: per_kernel_calls[name] for name, _ in top},
        "kernel_launches_per_step": sum(per_kernel_calls.values()),
        "host_top_functions": host_top,
        "steady_state_compiles": compiles,
        "torch_ops_by_launch_site": launch_sites,
    }


def attribute_ops(
    runner, width: int, top: int, sampling: SamplingOptions | None = None
) -> list[dict]:
    """One eager step of ``width`` lanes (the lanes staged by the last launch; the sampled
    step of ``sampling``'s cut-off rule where given) under
    ``torch.profiler`` with Python stacks and shapes: the ``top`` (torch op, launch site)
    pairs by GPU time, in ms per step. The op is the outermost aten op under the Python caller
    (``aten::to`` rather than the ``aten::copy_`` that launched the kernel; matrix products
    with their two input shapes); the launch site is the three innermost ``unimem`` frames of
    its recorded stack. Runs after every other measurement: it advances
    the device state."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    rule = None if sampling is None else sampling.cut_rule
    step = functools.partial(runner.eager_step, width, rule)
    step()  # the eager path's own first-use work, outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts, with_stack=True, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    ms: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU or not evt.kernels:
            continue
        gpu_us = sum(k.duration for k in evt.kernels)
        # the outermost aten op above the launching one, and the Python frames it recorded
        outer, node = evt, evt.cpu_parent
        while node is not None:
            if node.name.startswith("aten::"):
                outer = node
            node = node.cpu_parent
        frames = [f for f in (getattr(outer, "stack", None) or []) if "unimem/" in f]
        if not frames:  # older profilers: Python function events as parents
            node = outer.cpu_parent
            while node is not None and len(frames) < 3:
                if "unimem/" in node.name:
                    frames.append(node.name)
                node = node.cpu_parent
        site = [f.split("unimem/", 1)[-1] for f in frames[:3]]
        op = outer.name
        shapes = getattr(outer, "input_shapes", None)
        if op in ("aten::linear", "aten::mm", "aten::matmul", "aten::addmm") and shapes:
            op += " " + "x".join(str(tuple(sh)) for sh in shapes[:2] if sh)
        key = (op, " < ".join(site))
        ms[key] += gpu_us / 1000
        calls[key] += 1
    rows = [{"op": k[0], "site": k[1], "ms": v, "calls": calls[k]} for k, v in ms.items()]
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def jit_cache_keys() -> dict[str, set]:
    """Every Triton kernel's compiled-variant keys, by kernel name (found through the garbage
    collector: JIT functions are module globals)."""
    keys: dict[str, set] = defaultdict(set)
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        jits = [o for o in gc.get_objects() if isinstance(o, triton.runtime.jit.JITFunction)]
    for obj in jits:
        for cache in getattr(obj, "device_caches", {}).values():
            keys[obj.__name__] |= set(map(str, cache[0]))
    return keys


def new_compiles(before: dict[str, set], after: dict[str, set]) -> dict[str, list[str]]:
    """Kernel variants compiled between two :func:`jit_cache_keys` snapshots (a steady-state
    step must compile nothing: each compile costs the host tens of ms)."""
    return {
        name: sorted(k[:300] for k in keys - before.get(name, set()))
        for name, keys in after.items()
        if keys - before.get(name, set())
    }


def measure_extend(engine, args, prompts: list[list[int]], calls: int = 10) -> dict:
    """The extend step alone (module docstring): ``engine`` an ``unimem.Engine`` without a
    prefix cache (every call prefills again), ``prompts`` cut to ``args.input_len``."""
    from torch.profiler import ProfilerActivity, profile

    ids = [p[: args.input_len] for p in prompts[: args.requests]]
    params = {"max_new_tokens": 1, "ignore_eos": True}
    sampling = sampling_options(args)
    if sampling is not None:
        params |= {"temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p, "seed": 0}  # fmt: skip
    for _ in range(3):  # compiles what the extend runs first (FA4's prefill variants)
        engine.generate(input_ids=ids, sampling_params=params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        engine.generate(input_ids=ids, sampling_params=params)
    torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.generate(input_ids=ids, sampling_params=params)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in events) / 3 / 1e3
    kernels = sum(e.count for e in events) / 3
    out = {
        "requests": len(ids),
        "tokens": sum(len(i) for i in ids),
        "wall_ms": wall_ms,
        "gpu_ms": gpu_ms,
        "kernels": kernels,
        "kernels_per_layer": kernels / engine.model.config.num_layers,
        "host_top_functions": [],
    }
    if args.host_top:
        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(calls):
            engine.generate(input_ids=ids, sampling_params=params)
        torch.cuda.synchronize()
        prof_host.disable()
        out["host_top_functions"] = top_functions(prof_host, calls, "extend", args.host_top)
    return out


def top_functions(prof: cProfile.Profile, per: int, unit: str, top: int) -> list[dict]:
    """The ``top`` functions of ``prof`` by own time, in microseconds per ``unit`` (``per``
    of them ran): ``function``, ``own_us_per_<unit>``, ``cum_us_per_<unit>``,
    ``calls_per_<unit>``."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = "/".join(file.split("/")[-2:])
        rows.append(
            {
                "function": f"{where}:{line}({fn})",
                f"own_us_per_{unit}": own / per * 1e6,
                f"cum_us_per_{unit}": cum / per * 1e6,
                f"calls_per_{unit}": calls / per,
            }
        )
    rows.sort(key=lambda r: -r[f"own_us_per_{unit}"])
    return rows[:top]


def profile_host(eng: EngineCore, steps: int, top: int) -> list[dict]:
    """``steps`` more engine steps under cProfile: the ``top`` functions by own time, in
    microseconds per step (a profiler slows Python down, so these are shares, not the host
    time itself; the time outside the wait above is measured without it)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    eng.drain()
    torch.cuda.synchronize()
    prof.disable()
    return top_functions(prof, steps, "step", top)


PROG = "python -m unimem bench step-profile"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--host-only"]:
        from unimem.bench import host_step

        return host_step.main(argv[1:])
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--memory", default="static,unified", help="comma-separated kinds")
    ap.add_argument(
        "--split-kv-max-bs",
        default=str(SPLIT_KV_MAX_BS),
        help="comma-separated FA4Backend.split_kv_max_bs values, each measured with every "
        "memory kind (0: FA4 for every step)",
    )
    ap.add_argument("--top-kernels", type=int, default=15)
    ap.add_argument(
        "--host-top",
        type=int,
        default=0,
        help="also run --steps steps under cProfile and report this many functions",
    )
    ap.add_argument(
        "--attribute",
        type=int,
        default=0,
        help="also profile one eager verify step and list this many torch ops by launch site",
    )
    ap.add_argument(
        "--quantization",
        choices=["fp8"],
        help="fp8: the preset's projections in block-wise FP8 (unimem.models.fp8_linear); "
        "the drafter's tables stay bf16",
    )
    ap.add_argument(
        "--model-path",
        help="a real model (as Engine's model_path) instead of the small preset: DSPARK with "
        "its shipped drafter (or --drafter) and no acceptance control",
    )
    ap.add_argument("--drafter", help="with --model-path: the DSPARK drafter checkpoint")
    ap.add_argument(
        "--no-speculation",
        action="store_true",
        help="with --model-path: the plain decode step instead of DSPARK's verify step",
    )
    ap.add_argument(
        "--extend",
        action="store_true",
        help="with --model-path: also time the extend step alone (module docstring)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request samples at this temperature (with --top-k / --top-p): the sampled "
        "step of their cut-off rule is measured (default 0: greedy)",
    )
    ap.add_argument("--top-k", type=int, default=-1, help="with --temperature (-1: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        sampling_options(args)
    except ValueError as e:
        ap.error(str(e))
    if args.temperature <= 0 and (args.top_k != -1 or args.top_p != 1.0):
        ap.error("--top-k and --top-p need --temperature > 0")
    if (args.drafter or args.no_speculation or args.extend) and not args.model_path:
        ap.error("--drafter, --no-speculation and --extend need --model-path")
    for name in ("requests", "gamma", "steps", "replays"):
        if getattr(args, name) < 1:
            ap.error(
                f"--{name} must be >= 1, got {getattr(args, name)}"
                + ("; --no-speculation (with --model-path) profiles the plain decode step"
                   if name == "gamma" else "")
            )  # fmt: skip
    if args.model_path and (args.quantization or args.split_kv_max_bs != str(SPLIT_KV_MAX_BS)):
        ap.error("--model-path runs the Engine's own settings: no --quantization or "
                 "--split-kv-max-bs with it")  # fmt: skip
    if not torch.cuda.is_available():
        print(
            f"{PROG}: error: needs a CUDA device (--host-only measures the host's share on "
            "the CPU)",
            file=sys.stderr,
        )
        return 2
    if args.model_path:
        return _main_model(args)
    dev = torch.device("cuda")
    cfg = preset("small")
    model = HybridModel(cfg, seed=0, device=dev)
    if args.quantization == "fp8":
        from unimem.models.fp8_convert import quantize_model_online
        from unimem.models.fp8_linear import weight_bytes

        quantize_model_online(model)
        print(f"FP8 projections: weights {weight_bytes(model) / 2**30:.2f} GiB")
    drafter = DsparkDrafter(
        draft_config_for(cfg), model.embed_weight, model.lm_head_weight, seed=17
    )
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (args.requests, args.input_len), generator=g)
    prompts = prompts.tolist()
    gpu = torch.cuda.get_device_name(dev)
    print(
        f"{gpu}: small preset, {args.requests} requests verifying, gamma {args.gamma}, "
        f"page {args.page_size}, prompts {args.input_len}; steady state; "
        f"quantization {args.quantization or 'none (bf16)'}"
    )
    results = []
    runs = [(int(m), k) for m in args.split_kv_max_bs.split(",") for k in args.memory.split(",")]
    for max_bs, kind in runs:
        eng = synthetic_core(kind, max_bs, args, model, drafter, prompts)
        r = measure(eng, kind, args, prompts)
        del eng
        gc.collect()
        results.append(r)
        _print_run(r)
    return _finish(args, gpu, results)


def real_prompts(encode, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` token ids each (``encode``: text -> ids): prompt
    ``i`` is the package's short real prompts joined by blank lines, starting at the
    ``i``-th, encoded once and cut. Every request starts at ``length`` tokens, so the steady
    state begins after the prefill: grown from short prompts, the requests with the longest
    accepts ran out of output while the slowest reached ``length``, and a profile of "48
    requests" measured the 26-32 left."""
    from unimem.data.prompts import short_prompts

    texts = short_prompts()
    out = []
    for i in range(n):
        order = texts[i % len(texts) :] + texts[: i % len(texts)]
        text = "\n\n".join(order)
        ids = encode(text)
        while len(ids) < length:
            text = text + "\n\n" + text
            ids = encode(text)
        out.append(ids[:length])
    return out


def _main_model(args) -> int:
    """``--model-path``: the real model's steady-state step per memory kind."""
    gpu = torch.cuda.get_device_name()
    results = []
    for kind in args.memory.split(","):
        engine = model_engine(kind, args)
        prompts = real_prompts(engine.tokenizer.encode, args.requests, args.input_len)
        step = "decode (no speculation)" if args.no_speculation else f"DSPARK gamma {args.gamma}"
        print(f"{gpu}: {args.model_path}, {args.requests} requests, {step}, drafter "
              f"{engine.drafter_path}, page {args.page_size}, {kind}; steady state from "
              f"{args.input_len} tokens")  # fmt: skip
        extend = measure_extend(engine, args, prompts) if args.extend else None
        r = measure(engine.core, kind, args, prompts)
        r["model_path"] = args.model_path
        r["drafter_path"] = engine.drafter_path
        r["startup_seconds"] = dict(engine.startup_seconds)  # where the engine's start went
        if extend is not None:
            r["extend"] = extend
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        results.append(r)
        _print_run(r)
    return _finish(args, gpu, results)


def _print_run(r: dict) -> None:
    if "extend" in r:
        e = r["extend"]
        print(
            f"[{r['memory']}] extend step of {e['requests']} request(s), {e['tokens']} tokens: "
            f"{e['wall_ms']:.2f} ms wall, {e['gpu_ms']:.2f} ms of GPU kernels, "
            f"{e['kernels']:.0f} launches ({e['kernels_per_layer']:.1f} a layer)"
        )
        for f in e["host_top_functions"]:
            print(f"    {f['own_us_per_extend']:8.1f} {f['cum_us_per_extend']:8.1f} "
                  f"{f['calls_per_extend']:7.1f}  {f['function']}")  # fmt: skip
    attn = "split-KV" if r["split_kv"] else "FA4"
    print(
        f"[{r['memory']}, {attn} {r['step']} attention] engine loop: "
        f"{r['step_wall_ms']:.2f} ms/step wall, host "
        f"{r['host_ms_per_step']:.2f} ms/step outside the wait, "
        f"{r['tokens_per_step']:.1f} tokens/step, {r['output_tok_s']:.0f} tok/s; "
        f"{r['step']} step on the GPU (replays): {r['gpu_ms_per_verify_step']:.2f} ms"
    )
    per_cat = r["kernel_ms_per_step"]
    total = sum(per_cat.values())
    print(f"  {'kernels by category':<52}{'ms/step':>9}{'share':>8}")
    for label, ms in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<52}{ms:>9.3f}{100 * ms / total:>7.1f}%")
    print(f"  {'sum of kernel time':<52}{total:>9.3f}")
    print(f"  kernel launches per step: {r['kernel_launches_per_step']:.0f}")
    print("  top kernels (ms/step, calls/step):")
    calls = r["top_kernel_calls_per_step"]
    for name, ms in r["top_kernels_ms"].items():
        print(f"    {ms:7.3f} {calls[name]:5.0f}  {name}")
    for name, keys in r["steady_state_compiles"].items():
        print(f"  COMPILED in the steady state: {name} x{len(keys)}: {keys[0]}")
    if r["host_top_functions"]:
        print("  host under cProfile (us/step own, cumulative, calls/step):")
        for f in r["host_top_functions"]:
            print(f"    {f['own_us_per_step']:8.1f} {f['cum_us_per_step']:8.1f} "
                  f"{f['calls_per_step']:7.1f}  {f['function']}")  # fmt: skip
    if r["torch_ops_by_launch_site"]:
        print("  torch ops of one eager verify step by launch site (ms, calls):")
        for o in r["torch_ops_by_launch_site"]:
            print(f"    {o['ms']:7.3f} {o['calls']:5d}  {o['op']:<28} {o['site']}")


def _finish(args, gpu: str, results: list[dict]) -> int:
    a = results[0]
    for b in results[1:]:
        print(
            f"[{b['memory']}, split_kv_max_bs {b['split_kv_max_bs']}] / [{a['memory']}, "
            f"split_kv_max_bs {a['split_kv_max_bs']}]: wall "
            f"{a['step_wall_ms'] / b['step_wall_ms']:.3f}x throughput, GPU step "
            f"{a['gpu_ms_per_verify_step'] / b['gpu_ms_per_verify_step']:.3f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "gamma": args.gamma, "page_size": args.page_size,
                       "input_len": args.input_len, "quantization": args.quantization,
                       "model_path": args.model_path, "runs": results}, f, indent=2)  # fmt: skip
    return 0
