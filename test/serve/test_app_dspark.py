"""The application in-process (FastAPI's test client, the engine thread running) over a
DSPARK engine on a unified arena: greedy outputs equal ``unimem.Engine``'s, temperature > 0
samples (speculative sampling; a seed repeats its text), the accept length reaches
``/metrics``, memory returns to idle once the prefix cache is flushed."""

from __future__ import annotations

import json

import pytest
import tiny_qwen3_next
import tiny_tokenizer
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import unimem
from unimem.serve.app import make_app
from unimem.serve.args import ServerOptions

PROMPTS = ["w5 w6 w7", "w40 w41 w42 w43 w44", "w9"]
PARAMS = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next_dspark")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    engine = unimem.Engine(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=1024,
        max_running_requests=8,
        enable_unified_memory=True,
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=4,
    )
    expected = [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=PARAMS)]
    options = ServerOptions("127.0.0.1", 0, "tiny", None, "warning")
    with TestClient(make_app(engine, options)) as client:
        yield client, expected
    engine.shutdown()


def test_dspark_greedy_equals_engine(served):
    client, expected = served
    for prompt, want in zip(PROMPTS, expected, strict=True):
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == want


@pytest.mark.parametrize("extra", [{"temperature": 0.7}, {}])  # OpenAI's default is 1.0
def test_dspark_samples_at_temperature_above_zero(served, extra):
    client, _ = served
    body = {"model": "tiny", "prompt": "w5", "max_tokens": 8, "seed": 3, **extra}
    texts = []
    for _ in range(2):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]  # a seeded request repeats itself


def test_accept_length_in_metrics_and_memory_back_to_idle(served):
    client, _ = served
    assert client.post("/flush_cache").status_code == 200
    info = client.get("/get_server_info").json()
    assert info["running_requests"] == 0 and info["used_bytes"] == 0
    assert info["prefix_cache"]["cached_pages"] == 0
    assert info["enable_unified_memory"] is True
    assert info["drafter_path"] is None  # no drafter given or shipped: the seeded one
    assert info["spec_verify_steps_total"] > 0
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    accept = families["unimem:spec_accept_length"].samples[0].value
    assert accept >= 1.0  # tokens committed per verify step
