"""``--dp-size N``: N engine replicas behind SGLang's router, started and stopped together.

What ``python -m unimem.launch_server --dp-size N ...`` does (SGLang's co-launch of
``sglang_router.launch_server``, with unimem servers as the workers):

1. checks that the router (``sglang-router``, the ``[router]`` extra) is installed and, on
   CUDA, that ``N × tp_size`` GPUs are visible; that the front address is free;
2. starts N replicas — each ``python -m unimem.launch_server`` with the same flags, listening
   on a free port of 127.0.0.1 — on CUDA replica ``i`` sees GPUs ``[i·tp, (i+1)·tp)``
   (``CUDA_VISIBLE_DEVICES``), on the CPU they are N processes;
3. waits until every replica answers ``/health`` (a replica that exits first fails the
   start: every process is stopped, exit status 2);
4. starts ``python -m sglang_router.launch_router`` on the front ``--host`` / ``--port``
   over the replicas' URLs with ``--router-policy`` (default ``cache_aware``) and waits
   until it reports every worker ready;
5. watches the processes: a replica that dies is reported on stderr (its pid, URL and exit
   status); its in-flight requests fail at the router with an error status (the router
   retries requests that had not reached it on the other replicas) and the router's health
   check takes it out. When the router dies, or no replica is left, everything is stopped
   and the launcher exits 1;
6. on SIGINT / SIGTERM stops the router, then the replicas (SIGTERM, then SIGKILL after a
   grace period), and exits 0.

``--api-key`` is given to the replicas and to the router: clients present it to the router
(``sglang-router`` 0.3.2 answers 401 without it) and the router presents it to the replicas.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from unimem_kernel import envs

__all__ = [
    "ROUTER_POLICIES",
    "DataParallelError",
    "Fleet",
    "free_port",
    "replica_argv",
    "router_command",
    "run",
]

log = logging.getLogger("unimem.serve")

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
"""The router's ``--policy`` choices for data-parallel replicas."""

DP_ONLY_FLAGS = ("--dp-size", "--data-parallel-size", "--router-policy", "--host", "--port")
"""Flags of the launcher that are not passed on to a replica (it gets its own address)."""

STOP_GRACE_S = 15.0
POLL_S = 0.5
HEALTH_CHECK_INTERVAL_S = 2
"""How often the router checks each replica's ``/health`` (its default is a minute)."""


class DataParallelError(RuntimeError):
    """A start-up failure of the replicas or the router (one line)."""


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_argv(argv: Sequence[str], port: int) -> list[str]:
    """The launcher's ``argv`` for one replica: without the data-parallel flags and the front
    address, listening on ``127.0.0.1:port``."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        flag = token.split("=", 1)[0]
        if flag in DP_ONLY_FLAGS:
            skip = "=" not in token
            continue
        out.append(token)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def router_command(
    host: str,
    port: int,
    worker_urls: Sequence[str],
    policy: str,
    api_key: str | None = None,
    log_level: str = "warn",
    prometheus_port: int | None = None,
) -> list[str]:
    """``python -m sglang_router.launch_router`` over ``worker_urls``. The router's own
    Prometheus exporter listens on 127.0.0.1:``prometheus_port`` (None: a free port; the
    router's default, 29000, would collide between two routers on one machine)."""
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--health-check-interval-secs",
        str(HEALTH_CHECK_INTERVAL_S),
        "--log-level",
        log_level,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port or free_port()),
        "--worker-urls",
        *worker_urls,
    ]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    return cmd


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def _get(url: str) -> tuple[int, bytes]:
    """GET ``url`` (2 s timeout): its status and body; (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, ValueError):
        return 0, b""


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Until ``url``/health answers 200; :class:`DataParallelError` if ``proc`` exits first
    or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise DataParallelError(f"{what} exited with status {proc.returncode} while starting")
        if _get(url + "/health")[0] == 200:
            return
        if time.monotonic() > deadline:
            raise DataParallelError(f"{what} did not answer /health within {timeout:.0f} s")
        time.sleep(POLL_S)


def wait_router_ready(url: str, proc: subprocess.Popen, workers: int, timeout: float) -> None:
    """Until the router at ``url`` reports ``workers`` healthy workers (``/readiness``)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise DataParallelError(f"the router exited with status {proc.returncode}")
        status, body = _get(url + "/readiness")
        with contextlib.suppress(ValueError):
            if status == 200 and json.loads(body).get("healthy_workers", 0) >= workers:
                return
        if time.monotonic() > deadline:
            raise DataParallelError(f"the router did not report {workers} ready workers")
        time.sleep(POLL_S)


def stop_process(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> int:
    """SIGTERM ``proc``, SIGKILL it after ``grace`` seconds; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Fleet:
    """The replicas and the router of one data-parallel launch (module docstring). ``argv``:
    the launcher's flags (passed on to each replica); ``gpus``: the GPU ids each replica
    sees (None on the CPU)."""

    def __init__(
        self,
        argv: Sequence[str],
        dp_size: int,
        host: str,
        port: int,
        policy: str,
        api_key: str | None = None,
        gpus: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.dp_size = dp_size
        self.host, self.port = host, port
        self.policy = policy
        self.api_key = api_key
        self.gpus = gpus
        self.replicas: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.reported: set[int] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float | None = None) -> None:
        """Start the replicas, wait for them, start the router, wait for it; on any failure
        stop what was started and raise :class:`DataParallelError`. ``timeout``: seconds
        each may take to become healthy (None: ``UNIMEM_DP_START_TIMEOUT_S``)."""
        if timeout is None:
            timeout = envs.get("UNIMEM_DP_START_TIMEOUT_S")
        try:
            for i in range(self.dp_size):
                port = free_port()
                env = dict(os.environ)
                if self.gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus[i])
                cmd = [sys.executable, "-m", "unimem.launch_server", *replica_argv(self.argv, port)]
                self.replicas.append(subprocess.Popen(cmd, env=env))
                self.urls.append(f"http://127.0.0.1:{port}")
            for i, (proc, url) in enumerate(zip(self.replicas, self.urls, strict=True)):
                wait_healthy(url, proc, timeout, f"replica {i} ({url})")
            self.router = subprocess.Popen(
                router_command(self.host, self.port, self.urls, self.policy, self.api_key)
            )
            wait_router_ready(self.url, self.router, self.dp_size, timeout)
        except BaseException:
            self.stop()
            raise

    def check(self) -> bool:
        """Report replicas that died since the last call; False once the router is gone or
        no replica is left (the launch cannot serve)."""
        for i, proc in enumerate(self.replicas):
            if proc.poll() is not None and i not in self.reported:
                self.reported.add(i)
                log.error(
                    "data-parallel replica %d (pid %d, %s) exited with status %s: its "
                    "in-flight requests failed; the router's health check takes it out",
                    i,
                    proc.pid,
                    self.urls[i],
                    proc.returncode,
                )
        if self.router is not None and self.router.poll() is not None:
            log.error("the router exited with status %s", self.router.returncode)
            return False
        return len(self.reported) < len(self.replicas)

    def stop(self) -> None:
        """Stop the router, then every replica (idempotent)."""
        if self.router is not None:
            stop_process(self.router)
        for proc in self.replicas:
            with contextlib.suppress(OSError):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        for proc in self.replicas:
            stop_process(proc)


def run(argv: Sequence[str], engine_args, options, dp_size: int, policy: str) -> int:
    """The data-parallel launcher (module docstring); its exit status."""
    prog = "unimem.launch_server"
    if not router_available():
        print(
            f"{prog}: error: --dp-size needs SGLang's router: pip install 'unimem[router]'",
            file=sys.stderr,
        )
        return 2
    gpus = None
    if engine_args.device == "cuda":
        import torch

        need = dp_size * engine_args.tp_size
        have = torch.cuda.device_count()
        if have < need:
            print(
                f"{prog}: error: --dp-size {dp_size} × --tp-size {engine_args.tp_size} needs "
                f"{need} GPUs, {have} visible",
                file=sys.stderr,
            )
            return 2
        tp = engine_args.tp_size
        gpus = [list(range(i * tp, (i + 1) * tp)) for i in range(dp_size)]
    try:  # the front address must be free before anything loads
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((options.host, options.port))
    except OSError as e:
        print(
            f"{prog}: error: cannot listen on {options.host}:{options.port}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    fleet = Fleet(argv, dp_size, options.host, options.port, policy, options.api_key, gpus)
    stopping = started = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not started:  # still starting: unwind (start() stops what it started)
            raise KeyboardInterrupt
        stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            fleet.start()
        except DataParallelError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        started = True
        log.info(
            "serving %s on %s: the router (%s) over %d replicas %s",
            options.served_model_name,
            fleet.url,
            policy,
            dp_size,
            " ".join(fleet.urls),
        )
        while not stopping:
            if not fleet.check():
                return 1
            time.sleep(POLL_S)
        return 0
    finally:
        fleet.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
