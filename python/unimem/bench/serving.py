"""Serving benchmark: the real server driven by a real load generator, two servers side by
side: static pools vs the unified arena (``--compare memory``, the default), or one memory kind
without and with DSPARK (``--compare speculation``).

For each of the two the suite starts ``python -m unimem.launch_server`` on a loopback port
(same flags, plus ``--enable-unified-memory`` for the arena, plus ``--speculative-algorithm
DSPARK`` for the speculating one), runs GuideLLM
(``pip install -e ".[bench]"``) against its ``/v1/completions`` at several concurrencies, reads
the server's own counters (peak bytes, retractions, compactions, the engine thread's time per
iteration and per step, wall and CPU) from ``/get_server_info``, and stops the server by its
pid. It prints output throughput, TTFT and ITL p50/p99 per
concurrency for both and their ratios (unified / static, DSPARK / none); ``--json`` writes
them, ``--plot PATH.png`` draws throughput and latency vs concurrency (matplotlib is imported
only then). ``--model-path`` is whatever the server takes (a checkpoint directory, a GGUF
file, an embedded model's name such as ``gemma-3-270m``); the tokenizer GuideLLM counts with
is the resolved checkpoint's.

Why GuideLLM: it installs from PyPI with pip alone (pure Python; genai-perf needs Triton's
``perf_analyzer`` binary, aiperf pulls in a Kubernetes client, a dashboard stack and an
older prometheus-client), targets any OpenAI-compatible endpoint, streams and measures TTFT
and ITL per request, runs fixed-concurrency sweeps in one invocation, and takes its prompts
from a local JSONL file with its tokenizer loaded from the checkpoint directory, so nothing
is downloaded at run time. The prompts (``--prompts``) are random token ids of the
checkpoint's vocabulary decoded to text (``random``, ``--prompt-tokens`` each: works for any
tokenizer, the tiny test ones included), or the package's short real prompts (``short``,
cycled: what a drafter is measured on — random text tells nothing of its acceptance); requests
are greedy (``temperature`` 0: DSPARK verifies greedily) with a fixed output length
(``ignore_eos``).

Issue 41's real-model run (Gemma 3 270M and its shipped drafter)::

    python -m unimem bench serving --model-path gemma-3-270m --compare speculation \
        --prompts short --concurrency 1,8,32,64 --output-tokens 128 \
        --json docs/results/serving_dspark_real_h200.json --plot docs/serving_dspark_real.png

CPU smoke test (a tiny checkpoint, a few seconds per level)::

    python tools/make_checkpoint.py ...  # or any HF checkpoint directory
    python -m unimem bench serving --model-path CKPT --device cpu --dtype float32 \\
        --concurrency 1,4 --prompt-tokens 32 --output-tokens 16 --max-total-tokens 2048

On a GPU, a budget that binds: ``--max-total-tokens`` below what the concurrency needs at
the static split, so the static pools queue or retract while the arena re-splits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROG = "python -m unimem bench serving"
MODES = ("static", "unified")
COMPARES = ("memory", "speculation")
SPECULATION = ("none", "dspark")
"""The two servers of ``--compare speculation``: without and with DSPARK."""
START_TIMEOUT_S = 600


class BenchError(Exception):
    """A command-line or run error: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise BenchError(message)


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="the checkpoint directory to serve (required to run)")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="do not run: draw --plot from an earlier run's --json output",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=_positive_ints, default=[1, 4, 16, 64])
    p.add_argument(
        "--requests",
        type=_positive_int,
        default=None,
        help="requests per concurrency level (default: 4 x concurrency, >= 16)",
    )
    p.add_argument("--prompt-tokens", type=_positive_int, default=256)
    p.add_argument("--output-tokens", type=_positive_int, default=128)
    p.add_argument(
        "--max-seconds", type=_positive_int, default=600, help="time limit per concurrency level"
    )
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of static,unified (default: both; with --compare "
        "speculation one of them, default unified)",
    )
    p.add_argument(
        "--compare",
        choices=COMPARES,
        default="memory",
        help="memory: static pools vs the unified arena; speculation: no speculation vs DSPARK "
        "on one memory kind (its drafter: --speculative-draft-model-path, or the model's "
        "shipped one)",
    )
    p.add_argument(
        "--prompts",
        choices=("random", "short"),
        default="random",
        help="random: --prompt-tokens random vocabulary tokens each; short: the package's "
        "real prompts, cycled",
    )
    p.add_argument("--speculative-algorithm", choices=("DSPARK",), default=None)
    p.add_argument("--speculative-num-draft-tokens", type=_positive_int, default=None)
    p.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="a drafter checkpoint directory (python -m unimem.training.distill)",
    )
    p.add_argument("--max-total-tokens", type=_positive_int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=_positive_int, default=None)
    p.add_argument("--page-size", type=_positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="draw them here (PNG)")
    return p


def _check_args(a: argparse.Namespace) -> None:
    default = "static,unified" if a.compare == "memory" else "unified"
    modes = [m.strip() for m in (a.modes or default).split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise BenchError(f"--modes must be a subset of {','.join(MODES)}, got {a.modes!r}")
    if a.compare == "speculation" and len(modes) != 1:
        raise BenchError(f"--compare speculation runs one memory kind, got --modes {a.modes}")
    a.modes = modes
    frac = a.mem_fraction_static
    if frac is not None and not (math.isfinite(frac) and 0 < frac < 1):
        raise BenchError(f"--mem-fraction-static must be in (0, 1), got {frac}")
    spec = a.speculative_algorithm is not None or a.compare == "speculation"
    if a.speculative_num_draft_tokens is not None and not spec:
        raise BenchError("--speculative-num-draft-tokens needs --speculative-algorithm DSPARK")
    draft = a.speculative_draft_model_path
    if draft is not None:
        if not spec:
            raise BenchError("--speculative-draft-model-path needs --speculative-algorithm DSPARK")
        if not (Path(draft) / "config.json").is_file():
            raise BenchError(f"{draft}: no config.json (not a drafter checkpoint directory)")
    if a.model_path is None:
        raise BenchError("--model-path is required")
    a.checkpoint_dir = _checkpoint_dir(a.model_path)
    for path in (a.json, a.plot):  # checked before the run, not after it
        if path is not None:
            _check_writable(path)
    if a.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--plot needs matplotlib (pip install -e '.[bench]')") from None
    try:
        import guidellm  # noqa: F401
    except ImportError:
        raise BenchError("the load generator is missing: pip install -e '.[bench]'") from None


def _checkpoint_dir(model_path: str) -> str:
    """The HF-format directory ``model_path`` resolves to (as the server resolves it: an
    embedded model's name or a GGUF is converted once and cached); its tokenizer is the one
    GuideLLM counts tokens with."""
    from unimem.models.model_path import resolve_model_path

    try:
        path = resolve_model_path(model_path)
    except (ValueError, OSError) as e:
        raise BenchError(f"{model_path}: {e}") from None
    if not (Path(path) / "config.json").is_file():
        raise BenchError(f"{model_path}: no config.json (not a checkpoint directory)")
    return path


def runs(a: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """The servers to measure, in order: ``(label, memory kind, speculating)``."""
    if a.compare == "speculation":
        return [(label, a.modes[0], label == "dspark") for label in SPECULATION]
    return [(m, m, a.speculative_algorithm is not None) for m in a.modes]


def _check_writable(path: Path) -> None:
    parent = path.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise BenchError(f"{path}: cannot write there")
    if path.exists() and (path.is_dir() or not os.access(path, os.W_OK)):
        raise BenchError(f"{path}: cannot write there")


# ---------------------------------------------------------------------- the prompts


def write_prompts(a: argparse.Namespace, path: Path, count: int) -> None:
    """``count`` prompts (JSONL with GuideLLM's column names): random vocabulary tokens
    decoded to text, or the package's short real prompts cycled (``a.prompts``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.checkpoint_dir)
    if a.prompts == "short":
        from unimem.data.prompts import short_prompts

        texts = short_prompts()
        rows = [(t, len(tok.encode(t, add_special_tokens=False))) for t in texts]
        rows = [rows[i % len(rows)] for i in range(count)]
    else:
        special = set(tok.all_special_ids)
        vocab = [i for i in range(len(tok)) if i not in special]
        rng = random.Random(a.seed)
        rows = [
            (tok.decode([rng.choice(vocab) for _ in range(a.prompt_tokens)]), a.prompt_tokens)
            for _ in range(count)
        ]
    with path.open("w") as f:
        for text, n in rows:
            row = {
                "prompt": text,
                "prompt_tokens_count": n,
                "output_tokens_count": a.output_tokens,
            }
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def server_command(a: argparse.Namespace, memory: str, spec: bool, port: int) -> list[str]:
    """The server's command line: ``memory`` kind, DSPARK when ``spec``."""
    cmd = [
        sys.executable,
        "-m",
        "unimem.launch_server",
        "--model-path",
        a.model_path,
        "--port",
        str(port),
        "--dtype",
        a.dtype,
        "--log-level",
        "warning",
    ]
    if a.device:
        cmd += ["--device", a.device]
    if memory == "unified":
        cmd.append("--enable-unified-memory")
    flags = ["max_total_tokens", "mem_fraction_static", "max_running_requests", "page_size"]
    if spec:
        cmd += ["--speculative-algorithm", a.speculative_algorithm or "DSPARK"]
        flags += ["speculative_num_draft_tokens", "speculative_draft_model_path"]
    for flag in flags:
        value = getattr(a, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    return cmd


class Server:
    """The server in a subprocess, stopped by its pid (SIGTERM, then wait)."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while _get(self.url + "/health", 2)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise BenchError(f"the server did not start: {tail[0]}")
            time.sleep(0.5)

    def info(self) -> dict:
        status, body = _get(self.url + "/get_server_info")
        return json.loads(body) if status == 200 else {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------- the load


def scenario(a: argparse.Namespace, url: str, model: str, prompts: Path, out: Path) -> dict:
    """GuideLLM's scenario: one sub-benchmark per concurrency, greedy fixed-length requests."""
    per_level = [a.requests or max(16, 4 * c) for c in a.concurrency]
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/completions",
                "http2": False,
                "extras": {"body": {"temperature": 0}},
            },
            "profile": {"kind": "concurrent", "streams": a.concurrency[0]},
            "tokenizer": {"kind": "huggingface_auto", "model": a.checkpoint_dir},
            "data": [{"kind": "json_file", "path": str(prompts)}],
            "constraints": [{"kind": "max_duration", "seconds": a.max_seconds}],
            "outputs": [{"kind": "json", "path": str(out)}],
        },
        "benchmarks": [
            {
                "profile.streams": c,
                "constraints": [
                    {"kind": "max_requests", "count": n},
                    {"kind": "max_duration", "seconds": a.max_seconds},
                ],
            }
            for c, n in zip(a.concurrency, per_level, strict=True)
        ],
    }


def _pct(metric: dict, p: str) -> float:
    return metric["successful"]["percentiles"][p]


def parse_results(path: Path) -> list[dict]:
    """Per concurrency: output tok/s, TTFT and ITL p50/p99 (ms), requests ok / failed."""
    rows = []
    for b in json.loads(path.read_text())["benchmarks"]:
        m = b["metrics"]
        totals = m["request_totals"]
        rows.append(
            {
                "concurrency": b["config"]["strategy"]["streams"],
                "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
                "ttft_p50_ms": _pct(m["time_to_first_token_ms"], "p50"),
                "ttft_p99_ms": _pct(m["time_to_first_token_ms"], "p99"),
                "itl_p50_ms": _pct(m["inter_token_latency_ms"], "p50"),
                "itl_p99_ms": _pct(m["inter_token_latency_ms"], "p99"),
                "requests_ok": totals["successful"],
                "requests_failed": totals["errored"] + totals["incomplete"],
            }
        )
    return rows


def warm_up(a: argparse.Namespace, url: str, model: str, prompts: Path) -> None:
    """Untimed requests before the measured levels: one alone, then a burst as wide as the
    largest concurrency, each of the benchmark's prompt and output lengths, so that kernels
    compiled on first use (prefill shapes, Triton autotuning) are not charged to the first
    level's latency."""
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]

    def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": texts[i % len(texts)],
            "max_tokens": a.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=START_TIMEOUT_S) as r:
            if r.status != 200:
                raise BenchError(f"warm-up request answered {r.status}")

    try:
        one(0)
        width = max(a.concurrency)
        with ThreadPoolExecutor(width) as pool:
            list(pool.map(one, range(width)))
    except OSError as e:
        raise BenchError(f"warm-up request failed: {e}") from None


def run_mode(
    a: argparse.Namespace, mode: str, memory: str, spec: bool, work: Path, prompts: Path
) -> dict:
    """One server (``mode`` its label) under the load; its levels and its counters."""
    port = _free_port()
    server = Server(server_command(a, memory, spec, port), port, work / f"server_{mode}.log")
    try:
        model = json.loads(_get(server.url + "/v1/models")[1])["data"][0]["id"]
        warm_up(a, server.url, model, prompts)
        out = work / f"guidellm_{mode}.json"
        scn = work / f"scenario_{mode}.json"
        scn.write_text(json.dumps(scenario(a, server.url, model, prompts, out)))
        log = work / f"guidellm_{mode}.log"
        with log.open("w") as f:
            rc = subprocess.call(
                [sys.executable, "-m", "guidellm", "run", "-c", str(scn), "--disable-console"],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        if rc != 0 or not out.exists():
            tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
            raise BenchError(f"guidellm failed on the {mode} server: {tail[0]}")
        info = server.info()
    finally:
        server.stop()
    keys = (
        "max_total_num_tokens",
        "max_running_requests",
        "capacity_bytes",
        "peak_bytes",
        "retractions",
        "compactions",
        "drafter_path",
        "spec_verify_steps_total",
        "spec_verified_tokens_total",
    )
    server_stats = {k: info.get(k) for k in keys}
    server_stats["engine_time"] = engine_time_per_iteration(info.get("engine_time"))
    steps = server_stats["spec_verify_steps_total"]
    return {
        "levels": parse_results(out),
        "server": server_stats,
        "memory": memory,
        "speculation": "DSPARK" if spec else None,
        # committed tokens per verify step over the whole run, warm-up included
        "accept_length": server_stats["spec_verified_tokens_total"] / steps if steps else None,
    }


def engine_time_per_iteration(t: dict | None) -> dict | None:
    """The server's engine-thread time (``/get_server_info``'s ``engine_time``, the whole run,
    warm-up included) per working iteration, milliseconds: the iteration's wall time, the
    step's wall time, the thread's CPU time in the step, and the step's wait (wall minus
    CPU: the GPU, or the GIL held by the HTTP side). None when the server reported none."""
    if not t or not t.get("iterations"):
        return None
    n = t["iterations"]
    step, cpu = t["step_seconds"], t["step_cpu_seconds"]
    return {
        "iterations": n,
        "iteration_ms": 1e3 * t["iteration_seconds"] / n,
        "step_ms": 1e3 * step / n,
        "step_cpu_ms": 1e3 * cpu / n,
        "step_wait_ms": 1e3 * (step - cpu) / n,
    }


# ---------------------------------------------------------------------- report


def report(results: dict) -> str:
    modes = list(results)
    lines = []
    head = f"{'conc':>5}"
    for m in modes:
        head += f" | {m + ' tok/s':>14} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15}"
    if len(modes) == 2:
        head += f" | {modes[1] + '/' + modes[0] + ' tok/s':>20} {'TTFT p50':>8}"
    lines.append(head)
    lines.append("-" * len(head))
    levels = [r["concurrency"] for r in results[modes[0]]["levels"]]
    for i, c in enumerate(levels):
        row = f"{c:>5}"
        for m in modes:
            r = results[m]["levels"][i]
            ttft = f"{r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f}"
            itl = f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f}"
            fail = f" ({r['requests_failed']} failed)" if r["requests_failed"] else ""
            row += f" | {r['output_tok_s']:>14.1f} {ttft:>17} {itl:>15}{fail}"
        if len(modes) == 2:
            s, u = (results[m]["levels"][i] for m in modes)
            tput = u["output_tok_s"] / s["output_tok_s"] if s["output_tok_s"] else float("nan")
            ttft = u["ttft_p50_ms"] / s["ttft_p50_ms"] if s["ttft_p50_ms"] else float("nan")
            row += f" | {tput:>20.3f} {ttft:>8.3f}"
        lines.append(row)
    for m in modes:
        s = results[m]["server"]
        line = (
            f"{m}: max_total_num_tokens={s['max_total_num_tokens']} "
            f"max_running_requests={s['max_running_requests']} capacity_bytes="
            f"{s['capacity_bytes']} peak_bytes={s['peak_bytes']} "
            f"retractions={s['retractions']} compactions={s['compactions']}"
        )
        if results[m].get("accept_length") is not None:
            drafter = s.get("drafter_path") or "the seeded untrained drafter"
            line += f" accept_length={results[m]['accept_length']:.3f} drafter={drafter}"
        lines.append(line)
        t = s.get("engine_time")
        if t:
            lines.append(
                f"{m}: engine thread, per iteration over the run: {t['iteration_ms']:.3f} ms "
                f"(step {t['step_ms']:.3f} ms wall, {t['step_cpu_ms']:.3f} CPU, "
                f"{t['step_wait_ms']:.3f} waiting; {t['iterations']} iterations)"
            )
    return "\n".join(lines)


def title(args: dict, gpu: str | None, drafter: str | None = None) -> str:
    """The figure's title, two lines: what is compared; model, sizes, memory budget,
    machine. ``drafter``: the drafter the server reported (else the one asked for)."""
    drafter = drafter or args.get("speculative_draft_model_path")
    drafter_note = f" (drafter {Path(drafter).name})" if drafter else " (untrained drafter)"
    if args.get("compare") == "speculation":
        modes = args.get("modes") or ["unified"]
        what = f"no speculation vs DSPARK{drafter_note}, {modes[0]} memory"
    else:
        spec = args.get("speculative_algorithm") or "no speculation"
        if args.get("speculative_algorithm"):
            spec += drafter_note
        what = f"static pools vs unified arena, {spec}"
    if args.get("prompts") == "short":
        sizes = f"real prompts + {args['output_tokens']} tokens"
    else:
        sizes = f"{args['prompt_tokens']} + {args['output_tokens']} tokens"
    budget = (
        f"--max-total-tokens {args['max_total_tokens']}"
        if args.get("max_total_tokens")
        else "default memory"
    )
    return (  # two lines: one is wider than the three panels with a drafter named
        f"unimem serving, {what}\n{Path(args['model_path']).name}, {sizes}, {budget}, "
        f"at most {args.get('max_running_requests') or 'default'} running | {gpu or 'CPU'}"
    )


def plot(results: dict, path: Path, args: dict, gpu: str | None) -> None:
    """Three panels against concurrency: output throughput, TTFT p50/p99, ITL p50/p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import (
        FixedLocator,
        LogLocator,
        NullFormatter,
        NullLocator,
        ScalarFormatter,
    )

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    colors = {
        "static": "tab:blue",
        "unified": "tab:orange",
        "none": "tab:gray",
        "dspark": "tab:green",
    }
    conc = []
    for mode, res in results.items():
        conc = [r["concurrency"] for r in res["levels"]]
        c = colors[mode]
        axes[0].plot(conc, [r["output_tok_s"] for r in res["levels"]], "o-", color=c, label=mode)
        for ax, key in ((axes[1], "ttft"), (axes[2], "itl")):
            for pct, style in (("p50", "o-"), ("p99", "s:")):
                ys = [r[f"{key}_{pct}_ms"] for r in res["levels"]]
                ax.plot(conc, ys, style, color=c, label=f"{mode} {pct}")
    axes[0].set(ylabel="output tokens / s", title="Output throughput")
    axes[0].set_ylim(bottom=0)
    axes[1].set(ylabel="time to first token (ms)", title="TTFT", yscale="log")
    axes[2].set(ylabel="inter-token latency (ms)", title="ITL", yscale="log")
    for ax in axes[1:]:  # plain numbers at 1, 2, 5 x 10^k on the log latency axes
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(conc))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("concurrent requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    reported = [r.get("server", {}).get("drafter_path") for r in results.values()]
    fig.suptitle(title(args, gpu, next((d for d in reported if d), None)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_name(device: str | None) -> str | None:
    """The GPU the server ran on (this process sees the same devices), or None on CPU."""
    if device == "cpu":
        return None
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        return None


def replot(src: Path, dst: Path) -> int:
    """Draw a figure from an earlier run's ``--json`` output."""
    d = json.loads(src.read_text())
    plot(d["results"], dst, d["args"], d.get("gpu"))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
        if a.replot is not None:
            if a.plot is None:
                raise BenchError("--replot needs --plot PATH.png")
            if not a.replot.is_file():
                raise BenchError(f"--replot {a.replot}: no such file")
            _check_writable(a.plot)
            return replot(a.replot, a.plot)
        _check_args(a)
        results = {}
        with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
            work = Path(tmp)
            prompts = work / "prompts.jsonl"
            total = sum(a.requests or max(16, 4 * c) for c in a.concurrency)
            write_prompts(a, prompts, max(total, 64))
            for mode, memory, spec in runs(a):
                print(f"[{mode}] serving and loading ...", file=sys.stderr, flush=True)
                results[mode] = run_mode(a, mode, memory, spec, work, prompts)
    except BenchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    print(report(results))
    gpu = gpu_name(a.device)
    args = _jsonable(vars(a))
    if a.json is not None:
        a.json.write_text(json.dumps({"args": args, "gpu": gpu, "results": results}, indent=1))
    if a.plot is not None:
        plot(results, a.plot, args, gpu)
    return 0


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}
