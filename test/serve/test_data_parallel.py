"""``python -m unimem.launch_server --dp-size 2``: two replicas (processes on the CPU) behind
SGLang's router (``sglang-router`` from PyPI), end to end over a tiny Qwen3-Next checkpoint
with the official ``openai`` client: completions (equal to ``unimem.Engine``'s greedy
output), chat and streams through the router, both replicas serving (round robin); killing
one replica mid-run: the launcher reports it, what the clients see is an answer or an error
status (never a hang), the router's health check takes the replica out and new requests
are served by the other; SIGTERM stops the router and the replicas together."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import tiny_qwen3_next
import tiny_tokenizer

import unimem
from unimem.serve.data_parallel import (
    free_port,
    router_command,
    stop_process,
    wait_router_ready,
)

pytest.importorskip("sglang_router")

MODEL = "tiny"
FLAGS = ["--dtype", "float32", "--page-size", "4", "--max-total-tokens", "1024"]
FLAGS += ["--max-running-requests", "8", "--mamba-track-interval", "8"]
START_TIMEOUT_S = 180


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


class Launch:
    def __init__(self, path: Path, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.path, self.proc, self.log = path, proc, log
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=5).json()["workers"]

    def replica_pid(self, url: str) -> int:
        port = url.rsplit(":", 1)[1]
        for pid in _children(self.proc.pid):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"unimem.launch_server" in cmd and port.encode() in cmd:
                return pid
        raise AssertionError(f"no replica process on {url}")


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_dp")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    port = free_port()
    cmd = [sys.executable, "-m", "unimem.launch_server", "--model-path", str(path)]
    cmd += ["--served-model-name", MODEL, "--port", str(port), "--log-level", "warning"]
    cmd += ["--dp-size", "2", "--router-policy", "round_robin", *FLAGS]
    log = path / "launch.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    srv = Launch(path, proc, port, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            r = httpx.get(srv.url + "/readiness", timeout=2)
            if r.status_code == 200 and r.json()["healthy_workers"] == 2:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, "the data-parallel launch did not come up"
        time.sleep(0.3)
    yield srv
    if proc.poll() is None:
        pids = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the launcher did not stop on SIGTERM")
        assert rc == 0, log.read_text()
        for pid in pids:  # the router and the replicas are gone with it
            assert not Path(f"/proc/{pid}").exists() or b"zombie" in _status(pid)


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"


def test_openai_client_through_the_router(launch):
    prompts = ["w5 w6 w7", "w1 w2", "w9 w10 w11 w12"]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with unimem.Engine(
        model_path=str(launch.path),
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=1024,
        disable_radix_cache=True,
    ) as engine:
        want = [o["text"] for o in engine.generate(prompt=prompts, sampling_params=params)]
    c = launch.client
    for _ in range(2):  # round robin: every prompt reaches both replicas
        for prompt, text in zip(prompts, want, strict=True):
            out = c.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == text
    stream = c.completions.create(
        model=MODEL,
        prompt=prompts[0],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want[0]
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5 w6"}],
        max_tokens=4,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    chunks = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5 w6"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == chat.choices[0].message.content
    served = [
        httpx.get(w["url"] + "/get_server_info").json()["prompt_tokens_total"]
        for w in launch.workers()
    ]
    assert len(served) == 2 and all(n > 0 for n in served)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cache_aware", "power_of_two", "random"])
def test_every_router_policy_fronts_the_replicas(launch, policy):
    """A second router (another policy) over the same replicas: completions, a stream, the
    load it reads from every worker's ``/get_load``, ``/flush_cache`` fanned out."""
    urls = [w["url"] for w in launch.workers()]
    port = free_port()
    router = subprocess.Popen(
        router_command("127.0.0.1", port, urls, policy),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_router_ready(url, router, 2, 60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for i in range(4):
            out = client.completions.create(model=MODEL, prompt=f"w{i} w5", max_tokens=3)
            assert out.usage.completion_tokens >= 1
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=3, stream=True
        )
        assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
        loads = httpx.get(url + "/get_loads", timeout=10).json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(urls)
        assert all(w["load"] >= 0 for w in loads)  # every worker answered /get_load
        flushed = httpx.post(url + "/flush_cache", timeout=10).json()
        assert flushed["workers_flushed"] == 2, flushed
    finally:
        stop_process(router)


@pytest.mark.slow
def test_a_dying_replica_is_reported_and_taken_out(launch):
    """Streams in flight on both replicas when one is killed: those on the survivor finish;
    those on the victim end with an error (a status or a broken stream), never a hang and
    never a stream that just stops without a finish reason."""
    victim = launch.workers()[0]["url"]
    pid = launch.replica_pid(victim)
    started = threading.Barrier(9)

    def one(i: int) -> str:
        try:
            stream = launch.client.with_options(timeout=60).completions.create(
                model=MODEL,
                prompt=f"w{i} w{i + 1}",
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish = None
            for n, chunk in enumerate(stream):
                if n == 0:
                    started.wait(30)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return f"finished: {finish}" if finish else "ended without a finish reason"
        except openai.APIStatusError as e:
            return f"status {e.status_code}"
        except (openai.APIConnectionError, httpx.HTTPError) as e:
            return f"broken stream: {type(e).__name__}"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        started.wait(60)  # every stream has its first chunk
        os.kill(pid, signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in futures]
    print(json.dumps({"outcomes": outcomes}))
    finished = [o for o in outcomes if o == "finished: length"]
    assert 0 < len(finished) < len(outcomes), outcomes  # the survivor's finish, the victim's fail
    assert "ended without a finish reason" not in outcomes, outcomes
    deadline = time.monotonic() + 60
    while True:
        health = {w["url"]: w["is_healthy"] for w in launch.workers()}
        if not health.get(victim, False):
            break
        assert time.monotonic() < deadline, "the router kept the dead replica"
        time.sleep(0.5)
    for i in range(4):  # the other replica serves everything now
        out = launch.client.completions.create(model=MODEL, prompt=f"w{i}", max_tokens=2)
        assert out.choices[0].text is not None
    assert launch.proc.poll() is None  # one replica is left: the launch keeps serving
    text = launch.log.read_text()
    assert "replica" in text and victim in text and "exited" in text
