"""SIGTERM under load: the real server (``python -m unimem.launch_server``) in a subprocess on
127.0.0.1, 16 streams running and 16 queued (``--max-running-requests 16``), each asking for
more tokens than it can produce before the drain timeout. On SIGTERM: a new request gets 503
JSON with ``Retry-After``, every queued stream gets the same 503 (its response had not
started), every running stream ends with a final chunk (``finish_reason`` "abort": cut at the
drain timeout) and ``data: [DONE]``, the process exits 0 and its log has no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import tiny_qwen3_next
import tiny_tokenizer

RUNNING = 16
QUEUED = 16
CONTEXT = 4096
DRAIN_S = 2.0
START_TIMEOUT_S = 120
WAIT_S = 60
"""Bound on every wait of the test (the server normally takes a fraction of it)."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    hf = tiny_qwen3_next.build(tmp_path, max_position_embeddings=CONTEXT)
    tiny_tokenizer.save(tmp_path, hf.config.vocab_size)
    port = _free_port()
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "unimem.launch_server",
        "--model-path",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--page-size",
        "16",
        "--max-total-tokens",
        str(RUNNING * CONTEXT),
        "--max-running-requests",
        str(RUNNING),
        "--disable-radix-cache",
        "--graceful-shutdown-timeout",
        str(DRAIN_S),
        "--log-level",
        "info",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"server exited: {log_path.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Stream:
    """One streamed completion read in a thread: its status, events, or error body."""

    def __init__(self, url: str, started: threading.Semaphore) -> None:
        self.status: int | None = None
        self.headers: dict = {}
        self.events: list[str] = []
        self.body: dict | None = None
        self.started = started
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        body = {
            "model": "tiny",
            "prompt": "w5 w6 w7",
            "max_tokens": CONTEXT - 64,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
            self.status, self.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                self.body = json.loads(r.read())
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    if len(self.events) == 1:
                        self.started.release()


def test_sigterm_under_load_drains_and_exits_0(server):
    proc, url, log_path = server
    started = threading.Semaphore(0)
    streams = [Stream(url, started) for _ in range(RUNNING + QUEUED)]
    for _ in range(RUNNING):
        assert started.acquire(timeout=WAIT_S), "the running streams did not start"
    deadline = time.monotonic() + WAIT_S
    while True:
        info = httpx.get(url + "/get_server_info", timeout=WAIT_S).json()
        if (info["running_requests"], info["queued_requests"]) == (RUNNING, QUEUED):
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)

    proc.send_signal(signal.SIGTERM)
    late = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "w5", "max_tokens": 2},
        timeout=WAIT_S,
    )
    assert late.status_code == 503
    assert late.headers["retry-after"]
    assert late.json()["error"]["code"] == "shutting_down"

    for s in streams:
        s.thread.join(WAIT_S)
        assert not s.thread.is_alive()
    rc = proc.wait(timeout=WAIT_S)
    log = log_path.read_text()
    assert rc == 0, log
    assert "Traceback" not in log and "Exception in ASGI" not in log, log

    ran = [s for s in streams if s.status == 200]
    refused = [s for s in streams if s.status != 200]
    assert len(ran) == RUNNING and len(refused) == QUEUED
    for s in ran:
        assert s.events[-1] == "[DONE]"
        last = json.loads(s.events[-2])
        assert last["choices"][0]["finish_reason"] == "abort"
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in s.events[:-2])
    for s in refused:
        assert s.status == 503 and s.headers["retry-after"]
        assert s.body["error"]["code"] == "shutting_down"
        assert "shutting down" in s.body["error"]["message"]
