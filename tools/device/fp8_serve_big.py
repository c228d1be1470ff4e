"""Serve one checkpoint through ``python -m unimem.launch_server`` and measure load time, weight
bytes and decode throughput (the FP8 proof for the largest Qwen3-Next-shaped model one GPU
holds; any checkpoint works).

Starts the server (``--model-path``, ``--device``, extra flags after ``--``), times process
start to a healthy ``/health`` (the load: reading the shards, building the pools, capturing
the CUDA graphs), reads ``weight_bytes``, the pool sizes and the load's phases
(``startup_seconds``) from ``/get_server_info``, then:
one request alone (``--output-tokens`` greedy tokens, ``ignore_eos``; after a warm-up request
at the same prompt length): its tokens over its whole time (``single_stream_tok_s``), the time
of a one-token request (``single_stream_ttft_s``) and the decode rate past it
(``single_stream_decode_tok_s``, tokens after the first over the time after it), and
``--requests`` requests at ``--concurrency`` at once (random-token prompts of
``--prompt-tokens``; output tok/s over the wall time). Stops the server by its pid; writes
``--json``. Exits 1 with the server's log tail when anything fails.

    python tools/device/fp8_serve_big.py --model-path DIR --json out.json \\
        -- --mem-fraction-static 0.9
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(url: str, prompt: list[int], n: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                       "ignore_eos": True}},
        timeout=600,
    )  # fmt: skip
    r.raise_for_status()
    out = r.json()
    return int(out["meta_info"]["completion_tokens"]), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are below this")
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.json).with_suffix(".server.log")
    cmd = [sys.executable, "-m", "unimem.launch_server", "--model-path", args.model_path,
           "--device", args.device, "--port", str(port), "--log-level", "warning",
           *extra]  # fmt: skip
    print("server:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    result: dict = {"model_path": args.model_path, "server_args": extra}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.start_timeout:
                raise RuntimeError("the server did not come up")
            time.sleep(0.5)
        result["load_s"] = round(time.perf_counter() - t0, 2)
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        # startup_seconds: where the load went (checkpoint, pools, step loop and its CUDA
        # graphs, warm-up); the rest of load_s is the process's imports and the HTTP start
        for key in ("weight_bytes", "max_total_num_tokens", "max_running_requests", "cuda_graphs",
                    "attention_backend", "startup_seconds"):  # fmt: skip
            result[key] = info.get(key)
        result["quantization"] = info["server_args"].get("quantization")
        rng = random.Random(0)
        # three prompts of their own (no prefix shared with any other request): the warm-up,
        # the one-token request and the single stream; then the concurrent ones
        prompts = [[rng.randrange(4, args.vocab) for _ in range(args.prompt_tokens)]
                   for _ in range(args.requests + 3)]  # fmt: skip
        warm, one, single, prompts = prompts[0], prompts[1], prompts[2], prompts[3:]
        # the warm-up at the measured prompt length, so that no first-use work (kernel
        # compiles of that extend length) lands in the timed requests
        _complete(url, warm, 8)
        _, first = _complete(url, one, 1)  # time to the first token alone
        n, dt = _complete(url, single, args.output_tokens)
        result["single_stream_tok_s"] = round(n / dt, 1)  # the request's whole time
        result["single_stream_ttft_s"] = round(first, 4)
        result["single_stream_decode_tok_s"] = round((n - 1) / max(dt - first, 1e-9), 1)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            done = list(pool.map(lambda p: _complete(url, p, args.output_tokens), prompts))
        wall = time.perf_counter() - t1
        result.update(
            concurrency=args.concurrency, requests=args.requests,
            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
            output_tok_s=round(sum(k for k, _ in done) / wall, 1), wall_s=round(wall, 2),
        )  # fmt: skip
        ok = True
    except (RuntimeError, httpx.HTTPError) as e:
        result["error"] = str(e)
        ok = False
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if not ok:
        print(log_path.read_text()[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
