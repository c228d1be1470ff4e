"""The routes and request fields SGLang's router uses, in-process (FastAPI's test client, the
engine thread running) over a tiny Qwen3-Next checkpoint: the bodies ``sglang-router`` 0.3.2
forwards (SGLang's extra fields at their defaults, captured from the router) are served and
give the same output as the plain OpenAI bodies; ``no_stop_trim``, ``skip_special_tokens``,
``continue_final_message`` and ``return_text_in_logprobs`` do what they say; fields unimem
cannot honour are refused by name; ``/server_info``, ``/model_info``, ``/get_load``,
``/v1/loads`` and the ``sglang:*`` gauges answer what the router reads."""

from __future__ import annotations

import pytest
import tiny_qwen3_next
import tiny_tokenizer
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import unimem
from unimem.serve.app import make_app
from unimem.serve.args import ServerOptions

MODEL = "tiny"

# What sglang-router 0.3.2 adds to the bodies it forwards (seen on the wire).
ROUTER_COMPLETION = {
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
ROUTER_CHAT = {
    "logprobs": False,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTER_GENERATE = {
    "model": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_router_compat")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    engine = unimem.Engine(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=512,
        max_running_requests=4,
        mamba_track_interval=8,  # a cached state checkpoint every two pages
    )
    options = ServerOptions("127.0.0.1", 0, MODEL, None, "warning")
    with TestClient(make_app(engine, options)) as c:
        yield c
    engine.shutdown()


def _completion(client, **body) -> dict:
    base = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/completions", json={**base, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_router_bodies_are_served_like_plain_ones(client):
    plain = _completion(client, ignore_eos=True)
    routed = _completion(client, **{**ROUTER_COMPLETION, "ignore_eos": True})
    assert routed["text"] == plain["text"] and plain["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}]}
    chat["max_completion_tokens"] = 6
    chat["temperature"] = 0
    a = client.post("/v1/chat/completions", json=chat)
    b = client.post("/v1/chat/completions", json={**chat, **ROUTER_CHAT})
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    gen = {"text": "w5 w6 w7", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    a = client.post("/generate", json=gen)
    b = client.post("/generate", json={**gen, **ROUTER_GENERATE})
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["output_ids"] == b.json()["output_ids"]


def test_no_stop_trim_keeps_the_stop_string(client):
    full = _completion(client, ignore_eos=True)["text"]
    words = full.split()
    assert len(words) >= 3
    stop = words[2]
    cut = _completion(client, ignore_eos=True, stop=[stop])
    kept = _completion(client, ignore_eos=True, stop=[stop], no_stop_trim=True)
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop
    assert full.startswith(kept["text"])
    # a stop token: its text stays too (special tokens' text needs skip_special_tokens false)
    ids = client.post(
        "/generate",
        json={"text": "w5 w6 w7", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()["output_ids"]
    tok = ids[1]
    base = {"stop_token_ids": [tok], "ignore_eos": True}
    cut = _completion(client, **base)
    kept = _completion(client, **base, no_stop_trim=True)
    assert kept["matched_stop"] == cut["matched_stop"] == tok
    assert kept["text"].startswith(cut["text"]) and len(kept["text"]) > len(cut["text"])


def test_continue_final_message_and_logprob_text(client):
    chat = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "w5 w6"},
            {"role": "assistant", "content": "w7 w8"},
        ],
        "max_completion_tokens": 4,
        "temperature": 0,
    }
    a = client.post("/v1/chat/completions", json=chat)
    b = client.post("/v1/chat/completions", json={**chat, "continue_final_message": True})
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["usage"]["prompt_tokens"] != b.json()["usage"]["prompt_tokens"]
    gen = {
        "text": "w5 w6",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    r = client.post("/generate", json=gen).json()
    triples = r["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == r["output_ids"]
    assert all(isinstance(t[2], str) and t[2] for t in triples)


@pytest.mark.parametrize(
    "route,body,field",
    [
        ("/v1/completions", {"prompt": "w5", "return_hidden_states": True}, "return_hidden_states"),
        ("/v1/completions", {"prompt": "w5", "lora_path": "adapter"}, "lora_path"),
        ("/generate", {"text": "w5", "background": True}, "background"),
        ("/generate", {"text": "w5", "return_entropy": True}, "return_entropy"),
        (
            "/generate",
            {"text": "w5", "sampling_params": {"structural_tag": "{}"}},
            "structural_tag",
        ),
    ],
)
def test_unhonoured_fields_are_refused_by_name(client, route, body, field):
    r = client.post(route, json=body)
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


def test_worker_info_load_and_gauges(client):
    info = client.get("/server_info").json()
    assert info["served_model_name"] == MODEL and info["model_path"]
    assert info["dp_size"] == 1 and info["max_total_tokens"] == info["max_total_num_tokens"]
    assert client.get("/get_server_info").json().keys() == info.keys()
    model = client.get("/model_info").json()
    assert model["is_generation"] is True
    assert model["model_type"] == "qwen3_next" and model["architectures"]
    assert client.get("/get_model_info").json() == model
    models = client.get("/v1/models").json()["data"][0]
    assert models["owned_by"] and models["max_model_len"] == model["context_length"]
    # what the prefix cache holds counts as load until it is flushed
    _completion(client, prompt="w1 w2 w3 w4 w5 w6 w7 w8 w9", max_tokens=2)
    (load,) = client.get("/get_load").json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_tokens"] > 0
    loads = client.get("/v1/loads").json()["loads"]
    assert loads[0]["num_tokens"] == load["num_tokens"]
    text = client.get("/metrics").text
    values = {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("sglang:")
    }
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage"):
        assert f"sglang:{name}" in values
    assert values["sglang:num_used_tokens"] == load["num_tokens"]
    assert client.post("/flush_cache").status_code == 200
    (load,) = client.get("/get_load").json()
    assert load["num_tokens"] == 0
