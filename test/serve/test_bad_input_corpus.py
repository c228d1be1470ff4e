"""The bad-input corpus over every endpoint, in-process: malformed bodies, every field of
every generation body set to values of the wrong type, out of range, non-finite, huge, or
invalid Unicode. No request-path exception becomes a 500: each answer is a success or a 4xx
with an OpenAI error body carrying a ``code``; the server keeps serving."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from unimem.serve.app import make_app
from unimem.serve.args import ServerOptions

MODEL = "tiny"
HEADERS = {"Content-Type": "application/json"}

BAD_VALUES = [
    None,
    True,
    -1,
    2**70,
    1.5,
    float("nan"),
    "x",
    "a\ud800b",
    [],
    [None],
    [2**40],
    {"\ud800": 1},
]
"""Values every field gets in turn (NaN travels as JSON's common extension)."""

BODIES = {
    "/v1/completions": {
        "model": MODEL,
        "prompt": "w5 w6",
        "max_tokens": 1,
        "temperature": 0,
        "fields": [
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "stream",
            "stream_options",
            "n",
            "logprobs",
            "echo",
            "suffix",
            "best_of",
            "user",
            "logit_bias",
            "min_tokens",
            "presence_penalty",
        ],
    },
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w5"}],
        "max_tokens": 1,
        "temperature": 0,
        "fields": [
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "stream",
            "logprobs",
            "top_logprobs",
            "logit_bias",
            "min_tokens",
            "response_format",
            "tools",
            "tool_choice",
        ],
    },
    "/generate": {
        "text": "w5 w6",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "fields": [
            "text",
            "input_ids",
            "sampling_params",
            "stream",
            "return_logprob",
            "rid",
            "sampling_params.max_new_tokens",
            "sampling_params.temperature",
            "sampling_params.top_p",
            "sampling_params.top_k",
            "sampling_params.min_p",
            "sampling_params.seed",
            "sampling_params.stop",
            "sampling_params.stop_token_ids",
            "sampling_params.ignore_eos",
            "sampling_params.n",
        ],
    },
}

RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"text"',
    b"42",
    b"\xff\xfe",
    b'{"model": "tiny", "prompt": "\\ud800"}',
    b"[" * 5000 + b"]" * 5000,
    b"[" * 900 + b"]" * 900,
]

ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/metrics"),
    ("POST", "/flush_cache"),
]


@pytest.fixture(scope="module")
def client(small_engine):
    options = ServerOptions("127.0.0.1", 0, MODEL, None, "warning")
    with TestClient(make_app(small_engine, options), raise_server_exceptions=False) as c:
        yield c


def _with(body: dict, field: str, value) -> dict:
    out = json.loads(json.dumps({k: v for k, v in body.items() if k != "fields"}))
    if "." in field:
        outer, inner = field.split(".", 1)
        out[outer] = {**out[outer], inner: value}
    else:
        out[field] = value
    if field == "input_ids":
        out.pop("text")
    return out


def _check(r, what) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), (what, r.text)
        err = r.json()["error"]
        assert err["code"], (what, r.text)
        assert err["message"], (what, r.text)


@pytest.mark.parametrize("route", list(BODIES))
def test_every_field_with_every_bad_value(client, route):
    body = BODIES[route]
    answered = 0
    for field in body["fields"]:
        for value in BAD_VALUES:
            data = json.dumps(_with(body, field, value))  # NaN / Infinity kept
            r = client.post(route, content=data, headers=HEADERS)
            _check(r, (route, field, value))
            answered += r.status_code >= 400
    assert answered > 0
    ok = {k: v for k, v in body.items() if k != "fields"}
    assert client.post(route, json=ok).status_code == 200  # still serving


@pytest.mark.parametrize("route", list(BODIES))
def test_malformed_bodies(client, route):
    for raw in RAW_BODIES:
        r = client.post(route, content=raw, headers=HEADERS)
        assert 400 <= r.status_code < 500, (route, raw[:20], r.text)
        _check(r, (route, raw[:20]))


def test_other_routes_with_wrong_methods_and_bodies(client):
    for method, route in ROUTES:
        wrong = "DELETE" if method == "GET" else "GET"
        r = client.request(wrong, route)
        assert r.status_code == 405
        _check(r, (wrong, route))
        r = client.request(method, route, content=b"\xff{junk", headers=HEADERS)
        _check(r, (method, route))
    r = client.get("/no/such/route")
    assert r.status_code == 404
    _check(r, "unknown route")
