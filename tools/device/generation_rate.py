"""How fast the Engine writes a drafter's training text, and where a wide step's time goes.

    python3 tools/device/generation_rate.py --model-path GGUF --json OUT.json \\
        [--max-running 512] [--prompts 2048] [--prompt-len 24] [--gen-len 128] \\
        [--variants "page16-mem0.4 page64-small"] [--profile-steps 16]

``train_drafter`` generated its text at ~12 000 tok/s with 512 requests running (H100,
`training.json` of the shipped drafter: 2.6 M tokens in 228 s with the engine's start-up),
while a 48-request decode wave runs at ~45 000: this measures which part of that is the
engine's start-up (kernel compilation and the CUDA graphs of every batch bucket) and which
the step, per engine configuration (``--variants``, each a name of words joined by ``-``):

- ``pageN``: ``page_size`` N;
- ``memF``: ``mem_fraction_static`` F (train_drafter's ``--gen-mem-fraction``, 0.4: a pool
  of ~1.6 M tokens on an 80 GB GPU);
- ``small``: ``max_total_tokens`` for just the wave (2 x requests x (prompt + output + a page));
- ``nologprobs``: the core without per-token log-probabilities (``Engine`` computes them);
- ``delayN``: the prefill delayer at N passes.

Per variant: start-up seconds, a first short wave (``--max-running`` prompts x 4 tokens:
what compiles on first use, timed apart), one greedy wave of ``--prompts`` `<bos>`-led prompts of
``--prompt-len`` random tokens x ``--gen-len`` tokens (EOS ignored) through
``Engine.generate`` (tok/s, steps, extend steps, mean decode batch), then ``torch.profiler``
over ``--profile-steps`` steady decode steps of ``--max-running`` requests (GPU and wall ms
per step, kernels per step, the top kernels by time); the wave's launch-to-launch intervals (median
decode step, the slowest steps: a step that compiled or captured shows there) and, with
``--host-profile N``, a cProfile of one more wave. CUDA only (``--device cpu`` is a dry
run of the same code without the profile).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections import Counter

import torch


def _variant_kwargs(name: str, args) -> dict:
    kw: dict = {}
    for word in name.split("-"):
        if word.startswith("page"):
            kw["page_size"] = int(word[4:])
        elif word.startswith("mem"):
            kw["mem_fraction_static"] = float(word[3:])
        elif word == "small":
            page = kw.get("page_size", 16)
            kw["max_total_tokens"] = (
                2 * args.max_running * (args.prompt_len + 1 + args.gen_len + page)
            )
        elif word == "nologprobs":
            kw["_nologprobs"] = True
        elif word.startswith("delay"):
            kw["enable_prefill_delayer"] = True
            kw["prefill_delayer_max_delay_passes"] = int(word[5:])
        else:
            raise SystemExit(f"generation_rate: unknown variant word {word!r} in {name!r}")
    if args.device != "cuda":
        kw.pop("mem_fraction_static", None)
    return kw


def _profile(core, prompts, steps: int, n_layers: int) -> dict:
    from unimem.bench.decode_floor import profile_decode

    return profile_decode(core, prompts, steps, n_layers)


def _host_profile(eng, prompts, params, args) -> list[dict]:
    """One more wave of ``prompts`` under cProfile: the host functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    eng.generate(input_ids=prompts, sampling_params=params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"fn": f"{file.rsplit('/', 1)[-1]}:{line}:{fn}", "calls": nc,
                     "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})  # fmt: skip
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[: args.host_profile]


def run_variant(name: str, args) -> dict:
    from unimem.engine import api

    kw = _variant_kwargs(name, args)
    nologprobs = kw.pop("_nologprobs", False)
    real_core = api.EngineCore
    if nologprobs:  # Engine always asks its core for log-probabilities
        api.EngineCore = lambda *a, **k: real_core(*a, **{**k, "logprobs": False})
    t0 = time.perf_counter()
    try:
        eng = api.Engine(
            model_path=args.model_path,
            device=args.device,
            dtype=args.dtype,
            max_running_requests=args.max_running,
            disable_radix_cache=True,
            **kw,
        )
    finally:
        api.EngineCore = real_core
    start_s = time.perf_counter() - t0
    core = eng.core
    rng = random.Random(args.seed)  # the same prompts for every variant
    vocab = eng.model.config.vocab_size
    prompts = [
        [2] + [rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    modes: Counter[str] = Counter()
    decode_lanes = 0
    launch = core.runner.launch
    starts: list[tuple[float, str, int]] = []  # (perf_counter at launch, mode, lanes)

    def counting(batch, in_flight=None):
        nonlocal decode_lanes
        modes[batch.mode.name] += 1
        if batch.mode.name == "DECODE":
            decode_lanes += len(batch.reqs)
        starts.append((time.perf_counter(), batch.mode.name, len(batch.reqs)))
        return launch(batch, in_flight)

    # a first short wave of the same shapes compiles what the engine's start-up did not (the
    # extend step's kernels, FA4's prefill variants): timed apart from the measured wave
    if args.device == "cuda":
        torch.cuda.synchronize()
    t_warm = time.perf_counter()
    eng.generate(
        input_ids=prompts[: args.max_running],
        sampling_params={"max_new_tokens": 4, "ignore_eos": True},
    )
    if args.device == "cuda":
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t_warm
    core.runner.launch = counting
    params = {"max_new_tokens": args.gen_len, "ignore_eos": True}
    t1 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    wave_s = time.perf_counter() - t1
    core.runner.launch = launch
    tokens = sum(len(o["output_ids"]) for o in outs)
    # launch-to-launch intervals: a step that compiled or captured something shows up here
    ends = [s[0] for s in starts[1:]] + [t1 + wave_s]
    gaps = [(end - s[0], s[1], s[2]) for s, end in zip(starts, ends, strict=True)]
    decode_gaps = sorted(g[0] for g in gaps if g[1] == "DECODE")
    row = {
        "variant": name,
        "engine_kwargs": {**kw, "nologprobs": nologprobs},
        "engine_start_s": round(start_s, 2),
        "first_wave_s": round(warm_s, 3),
        "graph_buckets": list(core.runner.graphs.buckets) if core.runner.graphs else None,
        "wave_s": round(wave_s, 3),
        "tok_s": round(tokens / wave_s),
        "steps": dict(modes),
        "mean_decode_batch": round(decode_lanes / max(1, modes["DECODE"]), 1),
        "wave_ms_per_decode_step": round(1e3 * wave_s / max(1, modes["DECODE"]), 3),
        "max_total_num_tokens": eng.max_total_num_tokens,
        "decode_step_ms_p50": round(1e3 * decode_gaps[len(decode_gaps) // 2], 3)
        if decode_gaps
        else None,
        "slowest_steps": [
            {"ms": round(1e3 * g, 1), "mode": m, "lanes": n}
            for g, m, n in sorted(gaps, reverse=True)[:8]
        ],
        "seconds_in_steps_over_50ms": round(sum(g[0] for g in gaps if g[0] > 0.05), 3),
    }
    if args.host_profile:
        row["host_profile"] = _host_profile(eng, prompts[: args.max_running], params, args)
    if args.device == "cuda" and args.profile_steps:
        row["profile"] = _profile(
            core, prompts[: args.max_running], args.profile_steps, eng.model.config.num_layers
        )
    print(json.dumps(row), flush=True)
    eng.shutdown()
    del eng, core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-running", type=int, default=512)
    p.add_argument("--prompts", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--variants", default="page16-mem0.4 page64-small page16-mem0.4-nologprobs")
    p.add_argument("--profile-steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="after the timed wave, one wave of --max-running prompts under cProfile: "
        "this many host functions by own time",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("generation_rate: no CUDA device", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"generation_rate: {gpu}, torch {torch.__version__}, {args.prompts} prompts x "
          f"{args.gen_len} tokens, {args.max_running} running", flush=True)  # fmt: skip
    out = {
        "gpu": gpu,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "rows": [],
    }
    for v in args.variants.split():  # the JSON after every variant: a cut-off run keeps its rows
        out["rows"].append(run_variant(v, args))
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
