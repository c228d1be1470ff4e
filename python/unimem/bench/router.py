"""Prefix-cache locality behind SGLang's router: two unimem servers, ``cache_aware`` vs
``round_robin``, on a workload of shared prefixes.

    python -m unimem bench router --model-path DIR --json OUT.json [--prefixes 8]
        [--requests-per-prefix 64] [--concurrency 16] [--policies cache_aware round_robin]

For each policy it starts two fresh ``python -m unimem.launch_server`` workers on free ports
of 127.0.0.1 and ``python -m sglang_router.launch_router`` over them, sends the workload
through the router with the ``openai`` client (``--concurrency`` threads, greedy, ``max_tokens``
``--output-len``, ``ignore_eos``), reads each worker's ``/get_server_info`` and stops
everything. The workload: ``--prefixes`` shared prefixes of ``--prefix-len`` tokens, each
followed by ``--requests-per-prefix`` distinct suffixes of ``--suffix-len`` tokens, in one
seeded shuffled order (the same for every policy). Each worker's KV budget
(``--max-total-tokens``) holds about half of the prefixes, so where a prefix goes decides
whether it is found in a cache.

Reported per policy: wall time, requests and output tokens per second, the prefix-cache hit
rate over all prompt tokens (``cached_tokens`` / prompt tokens, from the responses' usage),
and per worker: requests served, the cache's hit tokens over looked-up tokens, evictions,
flushes under memory pressure, retractions.

``--model-path`` is a checkpoint with a tokenizer; the small random Qwen3-Next one the
CPU run uses is ``python tools/make_checkpoint.py --arch qwen3_next --size tiny --dtype
float32 --out DIR``. ``--device cuda``: worker i on GPU i (two GPUs needed). All traffic
stays on 127.0.0.1. Needs ``sglang-router`` (the ``[router]`` extra); ends with one line and
status 2 without it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from unimem_kernel.timing import wall_clock

PROG = "python -m unimem bench router"


def workload(args) -> list[tuple[int, str]]:
    """``(prefix index, prompt)`` pairs in one seeded shuffled order."""
    rng = random.Random(args.seed)
    words = range(8, 4000)
    prefixes = [" ".join(f"w{rng.choice(words)}" for _ in range(args.prefix_len))]
    prefixes += [
        " ".join(f"w{rng.choice(words)}" for _ in range(args.prefix_len))
        for _ in range(args.prefixes - 1)
    ]
    items = []
    for p, prefix in enumerate(prefixes):
        for _ in range(args.requests_per_prefix):
            suffix = " ".join(f"w{rng.choice(words)}" for _ in range(args.suffix_len))
            items.append((p, f"{prefix} {suffix}"))
    rng.shuffle(items)
    return items


def wait_http(url: str, proc: subprocess.Popen, path: str, ok, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            r = httpx.get(url + path, timeout=2)
            if r.status_code == 200 and ok(r):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}{path} did not become ready")
        time.sleep(0.3)


def run_policy(policy: str, model: Path, items, args, logdir: Path) -> dict:
    import httpx
    import openai

    from unimem.serve.data_parallel import free_port, router_command, stop_process

    flags = ["--device", args.device, "--dtype", args.dtype, "--page-size", str(args.page_size)]
    flags += ["--max-total-tokens", str(args.max_total_tokens)]
    flags += ["--max-running-requests", str(args.max_running)]
    flags += ["--mamba-track-interval", str(args.page_size * 4), "--log-level", "warning"]
    procs, urls = [], []
    try:
        for i in range(2):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if args.device == "cuda":  # worker i on GPU i
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            port = free_port()
            cmd = [sys.executable, "-m", "unimem.launch_server", "--model-path", str(model)]
            cmd += ["--served-model-name", "m", "--port", str(port), *flags]
            log = open(logdir / f"{policy}_worker{i}.log", "w")  # noqa: SIM115
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_http(url, proc, "/health", lambda r: True)
        rport = free_port()
        rlog = open(logdir / f"{policy}_router.log", "w")  # noqa: SIM115
        router = subprocess.Popen(
            router_command("127.0.0.1", rport, urls, policy),
            stdout=rlog,
            stderr=subprocess.STDOUT,
        )
        procs.append(router)
        rurl = f"http://127.0.0.1:{rport}"
        wait_http(rurl, router, "/readiness", lambda r: r.json().get("healthy_workers") == 2)
        client = openai.OpenAI(base_url=rurl + "/v1", api_key="none", max_retries=0, timeout=600)

        def one(item):
            out = client.completions.create(
                model="m",
                prompt=item[1],
                max_tokens=args.output_len,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            u = out.usage
            return u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens

        with wall_clock() as watch, concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, items))
        wall = watch.seconds
        prompt = sum(r[0] for r in results)
        completion = sum(r[1] for r in results)
        cached = sum(r[2] for r in results)
        workers = []
        for url in urls:
            info = httpx.get(url + "/get_server_info", timeout=10).json()
            pc = info["prefix_cache"] or {}
            workers.append(
                {
                    "url": url,
                    "requests": sum(info["requests_finished"].values()),
                    "prompt_tokens": info["prompt_tokens_total"],
                    "cached_tokens": info["cached_tokens_total"],
                    "hit_rate": pc.get("hit_rate", 0.0),
                    "hit_tokens": pc.get("hit_tokens", 0),
                    "lookup_tokens": pc.get("lookup_tokens", 0),
                    "evictions": pc.get("evictions", 0),
                    "pressure_flushes": pc.get("pressure_flushes", 0),
                    "retractions": info["retractions"],
                }
            )
        return {
            "policy": policy,
            "wall_s": wall,
            "requests": len(results),
            "requests_per_s": len(results) / wall,
            "output_tok_s": completion / wall,
            "total_tok_s": (prompt + completion) / wall,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "workers": workers,
        }
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the report")
    ap.add_argument(
        "--model-path",
        required=True,
        help="a checkpoint with a tokenizer (tools/make_checkpoint.py --size tiny builds one)",
    )
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--requests-per-prefix", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=8, help="each worker's running requests")
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=2560,
        help="each worker's KV tokens (default: about half of the prefixes fit)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: GPU i each")
    ap.add_argument("--dtype", default="float32", help="the workers' --dtype")
    args = ap.parse_args(argv)
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: needs sglang-router: pip install 'unimem[router]'", file=sys.stderr)
        return 2
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    logdir = out.parent / (out.stem + "_logs")
    logdir.mkdir(exist_ok=True)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(f"{PROG}: error: --device cuda needs 2 GPUs (one per worker)", file=sys.stderr)
            return 2
    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        print(f"{PROG}: error: --model-path {model}: no config.json", file=sys.stderr)
        return 2
    items = workload(args)
    print(
        f"{len(items)} requests: {args.prefixes} prefixes x {args.requests_per_prefix}, "
        f"prefix {args.prefix_len} + suffix {args.suffix_len} tokens, {args.output_len} out; "
        f"2 workers of {args.max_total_tokens} KV tokens; concurrency {args.concurrency}"
    )
    runs = {}
    for policy in args.policies:
        runs[policy] = r = run_policy(policy, model, items, args, logdir)
        per = ", ".join(
            f"{w['requests']} req / hit {w['hit_rate']:.3f} / {w['evictions']} evictions / "
            f"{w['retractions']} retractions"
            for w in r["workers"]
        )
        print(
            f"{policy:12s} {r['wall_s']:7.1f} s  {r['requests_per_s']:6.2f} req/s  "
            f"{r['total_tok_s']:8.1f} tok/s  hit rate {r['hit_rate']:.3f}  workers: {per}"
        )
    report = {"config": vars(args), "model": str(model), "runs": runs}
    if args.device == "cuda":
        import torch

        report["gpu"] = torch.cuda.get_device_name(0)
    if "cache_aware" in runs and "round_robin" in runs:
        ca, rr = runs["cache_aware"], runs["round_robin"]
        report["cache_aware_over_round_robin"] = {
            "throughput": ca["total_tok_s"] / rr["total_tok_s"],
            "hit_rate": ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None,
        }
        print(json.dumps(report["cache_aware_over_round_robin"]))
    out.write_text(json.dumps(report, indent=1))
    return 0
