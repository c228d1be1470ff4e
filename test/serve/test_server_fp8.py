"""The real server (``python -m unimem.launch_server --quantization fp8``) serving a tiny FP8
Qwen3-Next checkpoint in the hub's block layout (written here from a bf16 one): a completion
equals ``unimem.Engine``'s greedy output on the same checkpoint. Server helpers:
``test_server.py``'s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import tiny_qwen3_next
import tiny_tokenizer
from test_server import API_KEY, START_TIMEOUT_S, Server, _free_port

import unimem
from unimem.models.fp8_checkpoint import write_fp8_checkpoint

MODEL = "tiny-fp8"


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    src = tmp_path_factory.mktemp("tiny_qwen3_next")
    hf = tiny_qwen3_next.build(src)
    tiny_tokenizer.save(src, hf.config.vocab_size)
    path = tmp_path_factory.mktemp("tiny_qwen3_next_fp8")
    write_fp8_checkpoint(src, path)
    port = _free_port()
    log_path = path / "server.log"
    cmd = [
        sys.executable, "-m", "unimem.launch_server", "--model-path", str(path),
        "--port", str(port), "--served-model-name", MODEL, "--api-key", API_KEY,
        "--dtype", "float32", "--page-size", "4", "--max-total-tokens", "1024",
        "--quantization", "fp8", "--disable-radix-cache", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(path, proc, port, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"server exited: {log_path.read_text()}"
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)
    yield srv
    srv.http.close()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the server did not stop on SIGTERM")
    assert rc == 0, log_path.read_text()


@pytest.mark.slow  # a second server process; the FP8 engine runs in the fast tier (test_fp8.py)
def test_fp8_checkpoint_is_served(fp8_server):
    engine = unimem.Engine(
        model_path=str(fp8_server.path), device="cpu", dtype="float32", page_size=4,
        max_total_tokens=1024, disable_radix_cache=True,
    )  # fmt: skip
    prompt = "w5 w6 w7 w8 w9 w10"
    want = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0})
    engine.shutdown()
    got = fp8_server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0
    )
    assert got.choices[0].text == want["text"]
    assert got.usage.completion_tokens == 10
