"""DSPARK on a real model, measured without the acceptance control, in one command (H200).

    python3 tools/device/dspark_real.py --model-path gemma-3-270m \\
        --eval-prompts PROMPTS.jsonl --eval-split heldout \\
        [--train-prompts PROMPTS.jsonl --train-split train] \\
        --json docs/results/dspark_real_h200.json

1. **Train** (unless ``--drafter DIR`` is given): ``python -m unimem.training.train_drafter``
   with this script's defaults (prompts sampled by the target from ``<bos>`` at temperature
   1 plus the training split of ``--train-prompts``, continuations by unimem's Engine at
   temperatures 0 / 0.7 / 1.0, teacher-forced states, bf16 training under a time budget,
   held-out accept length, confidence head) into ``--drafter-out`` (default: the
   package's shipped-drafter directory for the model, so that the result is what
   ``--speculative-algorithm DSPARK`` loads by default once committed). Any
   ``train_drafter`` flag given after ``--`` overrides a default
   (e.g. ``-- --draft-layers 1 --draft-vocab 0``).
2. **LM-head cost**: the drafter's base-logits GEMM and Markov pick over the reduced draft
   vocabulary vs the full one, at the block sizes of 1 / 8 / 48 requests (CUDA events).
3. **End to end** on the held-out prompts (never trained on; ``ignore_eos``, the same
   ``--output-len`` tokens for every run), DSPARK at gamma ``--gamma`` with the trained
   drafter and no acceptance control (the Engine has none) against no speculation, at 1 / 8
   / 48 concurrent requests: tok/s, ratio, DSPARK's accept length. ``--schedule closed``
   (the default) keeps that many requests in flight and starts the next prompt as soon as
   one finishes, as a client holding that many connections does (bench_serving's
   ``--max-concurrency``), over at least ``--rounds`` times that many requests (the prompts
   repeated, each request seeded by its index; each run also reports its steps by kind —
   extend, decode, verify — with the host's launch-to-launch milliseconds); ``waves`` runs
   ``Engine.generate`` on that many at a time, each wave ending with its slowest request —
   which under DSPARK is the request with the lowest accept length, so waves understate it;
   greedy, and DSPARK sampled at temperature 0.7 (with no top-k, and with Gemma 3's own
   top-k 64 / top-p 0.95); static == unified memory token for token (greedy, 48); adaptive
   verify lengths (the confidence head under ``--verify-budget`` rows) against fixed gamma
   at 48; under ``--enable-deterministic-inference``, DSPARK == no speculation token for
   token at 48. The greedy comparison runs ``--repeats`` rounds (default 2), each with a
   fresh engine of each kind, in ABBA order across rounds; its ratio is that of the median
   tok/s, every round's figures beside it (one closed loop at 48 lasts about half a second,
   and one engine once ran every step kind ~20-40 % slower than the next: one round alone
   can mislead).

Prints the GPU, sizes and settings; writes everything to ``--json``. Fails loudly (non-zero
exit, the reason on stderr) without CUDA, without the prompt files, or when the held-out
prompts would be trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_ROUNDS = 8
"""Closed loops: at least this many times the concurrency in requests (``--rounds``)."""

DEFAULT_TRAIN = [
    "--bos-prompts", "6144", "--prompt-len", "24", "--gen-len", "128",
    "--gen-chunk", "1024", "--gen-time-budget", "90",
    "--draft-layers", "2", "--draft-ffn-dim", "1024", "--draft-vocab", "32768",
    "--markov-rank", "16", "--gamma", "7",
    "--steps", "4000", "--batch", "64", "--anchors-per-step", "48", "--lr", "2e-3",
    "--warmup", "100", "--time-budget", "120", "--eval-every", "500", "--save-every", "500",
    "--head-steps", "300", "--eval-sequences", "48",
]  # fmt: skip


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a dry run of the whole script on a small model (no LM-head timing)",
    )
    p.add_argument("--eval-prompts", required=True, help="the held-out prompt file")
    p.add_argument("--eval-split", help="its held-out split (a .jsonl with splits)")
    p.add_argument("--train-prompts", help="a prompt file to train on (its --train-split)")
    p.add_argument("--train-split")
    p.add_argument("--drafter", help="evaluate this drafter (skip training)")
    p.add_argument(
        "--drafter-out",
        help="where the trained drafter goes (default: the package's shipped-drafter "
        "directory for this model, python/unimem/data/drafters/<model key>)",
    )
    p.add_argument("--checkpoint-dir", help="resumable training state (continued if present)")
    p.add_argument("--json", required=True, help="where the results go")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--eval-requests", type=int, default=48)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--concurrency", default="1,8,48")
    p.add_argument(
        "--schedule",
        choices=["closed", "waves"],
        default="closed",
        help="closed: that many requests in flight, each finished one replaced at once; "
        "waves: Engine.generate on that many at a time",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="closed schedule: at least this many times the concurrency in requests (at 48 "
        "in flight, 3 rounds last half a second on an H100: too short to be steady)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds of the greedy comparison, each with fresh engines, in ABBA order; the "
        "ratio is that of the median tok/s",
    )
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--verify-budget", type=int, default=None, help="default: 4 per request")
    p.add_argument(
        "--skip", default="", help="comma list of: lmhead,sampled,unified,adaptive,deterministic"
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an Engine argument for every engine of the run, DSPARK's and plain's alike "
        "(repeatable; VALUE as JSON, else a string), e.g. enable_prefill_delayer=true",
    )
    own, rest = argv, []
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1 :]
    return p.parse_args(own), rest


def _fail(msg: str) -> None:
    print(f"dspark_real: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _train(args, rest) -> tuple[str, dict]:
    from unimem.training import train_drafter

    argv = [
        "--model-path", args.model_path, "--out", args.drafter_out, "--device", args.device,
        "--eval-prompts", args.eval_prompts, "--max-prompt-len", str(args.max_prompt_len),
        *DEFAULT_TRAIN,
    ]  # fmt: skip
    if args.checkpoint_dir:
        argv += ["--checkpoint-dir", args.checkpoint_dir]
    if args.eval_split:
        argv += ["--eval-split", args.eval_split]
    if args.train_prompts:
        argv += ["--train-prompts", args.train_prompts]
        if args.train_split:
            argv += ["--train-split", args.train_split]
    argv += ["--gamma", str(args.gamma), *rest]
    targs = train_drafter.parser().parse_args(argv)
    targs.argv = argv
    print("train_drafter", " ".join(argv), flush=True)
    return args.drafter_out, train_drafter.run(targs)


def _lm_head_bench(drafter_dir: str, gamma: int) -> list[dict]:
    """Base logits GEMM + Markov pick, reduced vs full vocabulary, at 1/8/48 requests."""
    from unimem.models.tensor_parallel import logits_matmul
    from unimem_kernel import markov_pick
    from unimem_kernel.timing import median_ms

    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    v, d, r = cfg["vocab_size"], cfg["d_model"], cfg["markov_rank"]
    k = cfg.get("draft_vocab_size") or v
    dev, dt = "cuda", torch.bfloat16
    out = []
    for bs in (1, 8, 48):
        h = torch.randn(bs * gamma, d, device=dev, dtype=dt)
        anchors = torch.randint(0, min(k, v), (bs,), device=dev)
        for rows in sorted({k, v}):
            w = torch.randn(rows, d, device=dev, dtype=dt) * 0.05
            u = torch.randn(rows + 1, r, device=dev, dtype=dt)
            mw = torch.randn(rows, r, device=dev, dtype=dt) * 0.25

            def head(h=h, w=w):
                return logits_matmul(h, w, torch.float32)

            base = head().reshape(bs, gamma, rows)
            gemm = median_ms(head, warmup=5, iters=50, repeats=5)
            pick = median_ms(
                lambda base=base, u=u, mw=mw, a=anchors: markov_pick(base, a, u, mw),
                warmup=5,
                iters=50,
                repeats=5,
            )
            out.append({"requests": bs, "rows": rows, "logits_ms": gemm, "pick_ms": pick})
            print(f"lm head bs {bs:2d} rows {rows:6d}: logits {gemm:.4f} ms, pick {pick:.4f} ms")
    return out


def engine_overrides(items: list[str]) -> dict:
    """``--engine-arg NAME=VALUE`` items as Engine keyword arguments: VALUE parsed as JSON
    (``true``, ``4``, ``0.5``), else kept as a string. Names are checked against
    :class:`~unimem.engine.args.EngineArgs` (``ValueError`` naming the bad item), so a typo
    fails before any training or engine start; the speculative settings, the model, the
    device and the memory kinds are the script's own."""
    from unimem.engine.args import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    own = {
        "model_path", "device", "speculative_algorithm", "speculative_draft_model_path",
        "speculative_num_draft_tokens", "enable_unified_memory", "enable_deterministic_inference",
        "mem_fraction_static",
    }  # fmt: skip
    out: dict = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--engine-arg takes NAME=VALUE, got {item!r}")
        if name not in known:
            raise ValueError(f"--engine-arg {item!r}: Engine has no argument {name!r}")
        if name in own:
            raise ValueError(f"--engine-arg {item!r}: {name} is set by the script itself")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[name] = value
    return out


def _engine(args, **kw):
    from unimem.engine.api import Engine

    overrides = args.engine_overrides
    if kw.get("speculative_algorithm") is None:  # speculative_* overrides: the DSPARK engines'
        overrides = {k: v for k, v in overrides.items() if not k.startswith("speculative_")}
    kw = overrides | kw
    gc.collect()  # the engine closed before this one (``_close``) holds GPU memory until now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.mem_fraction_static is not None:
        kw["mem_fraction_static"] = args.mem_fraction_static
    return Engine(model_path=args.model_path, device=args.device, **kw)


def _closed_loop(engine, ids: list[list[int]], params: list[dict], conc: int) -> list[dict]:
    """``ids`` generated with at most ``conc`` requests in flight: each one that finishes is
    replaced by the next prompt between two steps (a client holding ``conc`` connections).
    Results in prompt order, as ``Engine.generate`` gives them."""
    from unimem.engine.api import SamplingParams

    reqs: list = [None] * len(ids)
    live: list = []
    nxt = 0

    def top_up(_core=None) -> None:
        nonlocal nxt, live
        live = [r for r in live if not r.finished]
        while nxt < len(ids) and len(live) < conc:
            p = SamplingParams(params[nxt], engine.sampling_defaults)
            reqs[nxt] = engine._submit(ids[nxt], p)
            live.append(reqs[nxt])
            nxt += 1

    top_up()
    while live:
        engine.core.run(on_step=top_up)
        top_up()
    return [engine._result(r, False) for r in reqs]


def _steps_by_kind(started: list[tuple[float, str, int]], t_end: float) -> dict:
    """Per step kind: steps, host milliseconds from each launch to the next (the last to
    ``t_end``: the GPU work a step waits for shows up in the step after it, which under a
    pipelined loop is the same kind almost always), and mean lanes."""
    ends = [t for t, _, _ in started[1:]] + [t_end]
    out: dict = {}
    for (t, kind, lanes), end in zip(started, ends, strict=True):
        k = out.setdefault(kind, {"steps": 0, "ms_total": 0.0, "lanes": 0})
        k["steps"] += 1
        k["ms_total"] += 1e3 * (end - t)
        k["lanes"] += lanes
    return {
        kind: {
            "steps": k["steps"],
            "ms_total": round(k["ms_total"], 2),
            "ms_per_step": round(k["ms_total"] / k["steps"], 3),
            "mean_lanes": round(k["lanes"] / k["steps"], 1),
        }  # fmt: skip
        for kind, k in out.items()
    }


def _run(
    engine, ids, conc, output_len, temperature, schedule="closed", rounds=DEFAULT_ROUNDS, **extra
):
    """``conc`` concurrent requests over ``ids`` (``schedule``: module docstring; closed:
    ``max(len(ids), rounds * conc)`` requests, the prompts repeated); tok/s over all,
    accept length, outputs. ``extra``: more sampling parameters (top_k, top_p)."""
    n = len(ids) if schedule == "waves" or conc == 1 else max(len(ids), rounds * conc)
    ids = [ids[i % len(ids)] for i in range(n)]
    params = [
        {"max_new_tokens": output_len, "ignore_eos": True, "temperature": temperature, "seed": i,
         **extra}
        for i in range(n)
    ]  # fmt: skip
    from unimem_kernel.timing import wall_clock

    # warm with one whole wave (its prefill batch and step sizes), a few tokens each: the
    # first wave of a new size would otherwise pay first-call costs inside the timing
    warm = min(conc, n)
    engine.generate(
        input_ids=ids[:warm],
        sampling_params=[p | {"max_new_tokens": min(output_len, 16)} for p in params[:warm]],
    )
    outs = []
    launch = engine.core.runner.launch
    started: list[tuple[float, str, int]] = []  # (host time at launch, step kind, lanes)

    def timed_launch(batch, in_flight=None):
        started.append((time.perf_counter(), batch.mode.name, len(batch.reqs)))
        return launch(batch, in_flight)

    engine.core.runner.launch = timed_launch
    try:
        with wall_clock(None) as watch:  # synchronises a CUDA device when there is one
            if schedule == "closed":
                outs = _closed_loop(engine, ids, params, conc)
            else:
                for s in range(0, n, conc):
                    wave = slice(s, s + conc)
                    outs += engine.generate(input_ids=ids[wave], sampling_params=params[wave])
        t_end = time.perf_counter()
    finally:
        engine.core.runner.launch = launch
    wall = watch.seconds
    toks = sum(len(o["output_ids"]) for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    committed = sum(
        o["meta_info"].get("spec_accept_length", 0) * o["meta_info"].get("spec_verify_ct", 0)
        for o in outs
    )
    res = {"concurrency": conc, "schedule": schedule, "requests": n, "tokens": toks,
           "seconds": wall, "tok_s": toks / wall,
           "steps_by_kind": _steps_by_kind(started, t_end)}  # fmt: skip
    if steps:
        res["accept_length"] = committed / steps
    return res, [o["output_ids"] for o in outs]


def _close(eng) -> None:
    """Shut ``eng`` down; ``eng = _close(eng)`` drops the caller's reference so that
    ``_engine`` can free its GPU memory (CUDA-graph pools included) before building the next:
    ``eng = _engine(...)`` alone builds the new engine while the old one is alive."""
    eng.shutdown()


def _greedy_comparison(args, texts, concs, spec_kw, skip, e2e) -> tuple[dict, list]:
    """No speculation against DSPARK, greedy, at every concurrency: ``--repeats`` rounds,
    each with a fresh engine of each kind, in ABBA order across rounds (none, DSPARK, DSPARK,
    none, ...) so that a drift of the machine weighs on both. Fills ``e2e["greedy"]`` (per
    concurrency: the first round's runs in full, every round's tok/s, and the ratio of the
    medians) and, unless skipped, the sampled runs at the largest concurrency (first
    round). Returns the first round's ``(result, outputs)`` by ``(kind, concurrency)`` and
    the prompt ids."""
    sched = {"schedule": args.schedule, "rounds": args.rounds}
    samples: dict = {(kind, c): [] for kind in ("none", "dspark") for c in concs}
    ids: list = []
    for rep in range(args.repeats):
        for kind in ("none", "dspark") if rep % 2 == 0 else ("dspark", "none"):
            eng = _engine(args, **(spec_kw if kind == "dspark" else {}))
            if not ids:
                ids = [eng.tokenizer.encode(t)[: args.max_prompt_len] for t in texts]
                e2e["prompt_tokens"] = sum(len(i) for i in ids)
            for c in concs:
                samples[(kind, c)].append(_run(eng, ids, c, args.output_len, 0.0, **sched))
                print(kind, f"round {rep + 1}", samples[(kind, c)][-1][0], flush=True)
            if rep == 0 and "sampled" not in skip:
                # Gemma 3's own generation defaults (top-k 64, top-p 0.95): the bounded filters
                for key, extra in (("", {}), ("_top_k_64", {"top_k": 64, "top_p": 0.95})):
                    r = _run(eng, ids, max(concs), args.output_len, 0.7, **sched, **extra)[0]
                    e2e[f"{kind}_temperature_0.7{key}"] = r
                    print(f"{kind} t=0.7{key}", r, flush=True)
            eng = _close(eng)
    runs = {key: runs[0] for key, runs in samples.items()}
    rows = []
    for c in concs:
        none = [r[0]["tok_s"] for r in samples[("none", c)]]
        spec = [r[0]["tok_s"] for r in samples[("dspark", c)]]
        rows.append({
            "concurrency": c,
            "none": runs[("none", c)][0],
            "dspark": runs[("dspark", c)][0],
            "none_tok_s_by_round": none,
            "dspark_tok_s_by_round": spec,
            "speedup": statistics.median(spec) / statistics.median(none),
            "speedup_by_round": [b / a for a, b in zip(none, spec, strict=True)],
            "spec_equals_nonspec": sum(
                a == b for a, b in zip(runs[("dspark", c)][1], runs[("none", c)][1], strict=True)
            ),
        })  # fmt: skip
    e2e["greedy"] = rows
    return runs, ids


def main(argv: list[str]) -> int:
    args, rest = _args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        _fail("no CUDA device")
    for path in filter(None, (args.eval_prompts, args.train_prompts)):
        if not Path(path).is_file():
            _fail(f"prompt file {path} does not exist")
    same_file = args.train_prompts and (
        Path(args.train_prompts).resolve() == Path(args.eval_prompts).resolve()
    )
    if same_file and (
        not args.train_split or not args.eval_split or args.train_split == args.eval_split
    ):
        _fail("the training prompts would include the held-out prompts: name both splits")
    if args.drafter_out is None:
        from unimem.speculative.shipped import model_key

        args.drafter_out = f"python/unimem/data/drafters/{model_key(args.model_path)}"
    skip = set(filter(None, args.skip.split(",")))
    if args.device == "cpu" and "deterministic" not in skip:
        print("deterministic inference is CUDA only: skipped on the CPU", flush=True)
        skip.add("deterministic")
    concs = [int(c) for c in args.concurrency.split(",")]
    if len(set(concs)) != len(concs) or min(concs) < 1:
        _fail(f"--concurrency takes distinct positive values, got {args.concurrency}")
    if args.rounds < 1:  # before any training or engine: a bad flag costs no device time
        _fail(f"--rounds must be >= 1, got {args.rounds}")
    if args.repeats < 1:
        _fail(f"--repeats must be >= 1, got {args.repeats}")
    try:
        args.engine_overrides = engine_overrides(args.engine_arg)
    except ValueError as e:
        _fail(str(e))
    report: dict = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none (cpu dry run)",
        "torch": torch.__version__,
        "settings": vars(args) | {"train_overrides": rest},
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UNIMEM_")},
        "acceptance_control": "off (Engine has none: every accepted draft is the drafter's)",
    }
    print(json.dumps(report, indent=1), flush=True)
    t0 = time.perf_counter()
    if args.drafter:
        drafter = args.drafter
    else:
        drafter, summary = _train(args, rest)
        report["training"] = summary
    gc.collect()  # the training's copy of the target goes before the engines load theirs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    drafter_bytes = sum(f.stat().st_size for f in Path(drafter).iterdir() if f.is_file())
    report["drafter"] = {"path": drafter, "bytes": drafter_bytes}
    print(f"drafter {drafter}: {drafter_bytes / 2**20:.2f} MiB ({time.perf_counter() - t0:.0f} s)")
    if drafter_bytes > 20 * 10**6:
        print(
            f"WARNING: the drafter is {drafter_bytes / 1e6:.1f} MB, over the 20 MB limit for "
            "shipping it in the repository (fewer layers, a smaller --draft-ffn-dim or "
            "--draft-vocab)",
            flush=True,
        )
    if "lmhead" not in skip and args.device == "cuda":
        report["lm_head_bench"] = _lm_head_bench(drafter, args.gamma)

    from unimem.training.prompt_sets import read_prompts

    texts = read_prompts(args.eval_prompts, args.eval_split)[: args.eval_requests]
    spec_kw = dict(
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=args.gamma + 1,
        speculative_draft_model_path=drafter,
    )
    e2e: dict = {"requests": len(texts), "output_len": args.output_len, "gamma": args.gamma,
                 "schedule": args.schedule, "rounds": args.rounds,
                 "repeats": args.repeats}  # fmt: skip
    sched = {"schedule": args.schedule, "rounds": args.rounds}
    runs, ids = _greedy_comparison(args, texts, concs, spec_kw, skip, e2e)
    big = max(concs)
    if "unified" not in skip:
        eng = _engine(args, enable_unified_memory=True, **spec_kw)
        uni, outs = _run(eng, ids, big, args.output_len, 0.0, **sched)
        eng = _close(eng)
        e2e["unified"] = uni | {
            "static_equals_unified": sum(
                a == b for a, b in zip(outs, runs[("dspark", big)][1], strict=True)
            )
        }
        print("unified", e2e["unified"], flush=True)
    if "adaptive" not in skip:
        budget = args.verify_budget or 4 * big
        eng = _engine(
            args,
            speculative_verify_lengths="adaptive",
            speculative_verify_budget=budget,
            **spec_kw,
        )
        ada = _run(eng, ids, big, args.output_len, 0.0, **sched)[0]
        eng = _close(eng)
        e2e["adaptive"] = ada | {
            "verify_budget": budget,
            "vs_fixed": ada["tok_s"] / runs[("dspark", big)][0]["tok_s"],
        }
        print("adaptive", e2e["adaptive"], flush=True)
    if "deterministic" not in skip:
        det = {}
        for name, kw in (("none", {}), ("dspark", spec_kw)):
            eng = _engine(args, enable_deterministic_inference=True, **kw)
            det[name] = _run(eng, ids, big, args.output_len, 0.0, **sched)
            eng = _close(eng)
        e2e["deterministic"] = {
            "none": det["none"][0],
            "dspark": det["dspark"][0],
            "spec_equals_nonspec": sum(
                a == b for a, b in zip(det["dspark"][1], det["none"][1], strict=True)
            ),
        }
        print("deterministic", e2e["deterministic"], flush=True)
    report["end_to_end"] = e2e
    report["seconds"] = time.perf_counter() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    for row in e2e["greedy"]:
        none = statistics.median(row["none_tok_s_by_round"])
        spec = statistics.median(row["dspark_tok_s_by_round"])
        rounds = ", ".join(f"{r:.2f}x" for r in row["speedup_by_round"])
        print(
            f"concurrency {row['concurrency']:3d}: none {none:9.1f} tok/s, dspark {spec:9.1f} "
            f"tok/s (medians of {args.repeats}: {row['speedup']:.2f}x; rounds {rounds}), "
            f"accept {row['dspark'].get('accept_length', float('nan')):.3f}"
        )
    print(f"wrote {args.json} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
