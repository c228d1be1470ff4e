"""Requests as users send them, in-process (FastAPI's test client, the engine thread running)
over a tiny Qwen3-Next checkpoint on static pools smaller than its context: the defaults of
the ``openai`` client work (chat without ``max_tokens`` near the advertised context), a prompt
that can never fit gets a 400 saying why, finish reasons are counted as responses report
them, invalid Unicode is a 400 naming the position, logprobs come at every temperature,
``/health_generate`` answers for a busy server, ``--chat-template`` serves a model without
a template, and every error carries a ``code``."""

from __future__ import annotations

import dataclasses
import json
import threading

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from unimem.serve.app import make_app
from unimem.serve.args import ServerOptions

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(small_engine):
    return small_engine


def _options(**kw) -> ServerOptions:
    return ServerOptions("127.0.0.1", 0, MODEL, None, "warning", **kw)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(make_app(engine, _options())) as c:
        yield c


def _openai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0
    )


def _max_model_len(client) -> int:
    return client.get("/v1/models").json()["data"][0]["max_model_len"]


def _chat_len(engine, messages) -> int:
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def _messages_of(engine, n_tokens: int) -> list[dict]:
    """One user message whose chat prompt has exactly ``n_tokens`` tokens."""
    words = []
    while True:
        messages = [{"role": "user", "content": " ".join(words)}]
        n = _chat_len(engine, messages)
        if n == n_tokens:
            return messages
        assert n < n_tokens
        words.append(f"w{5 + len(words) % 50}")


def test_advertised_context_is_what_the_memory_holds(client, engine):
    limit = _max_model_len(client)
    assert limit < engine.context_length  # the pools hold less than the model's context
    assert limit == engine.core.max_request_tokens()
    assert client.get("/get_model_info").json()["context_length"] == limit


def test_chat_with_only_model_and_messages_near_the_context(client, engine):
    limit = _max_model_len(client)
    messages = _messages_of(engine, limit - 6)
    out = _openai(client).chat.completions.create(model=MODEL, messages=messages)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == limit - 6
    assert 1 <= out.usage.completion_tokens <= 6
    if choice.finish_reason == "length":
        assert out.usage.total_tokens == limit


def test_default_chat_requests_run_concurrently(client, engine):
    """Four default requests at once, each able to grow to the whole context: admitted by
    their prompts, growth handled by retraction."""
    messages = _messages_of(engine, 20)  # four prompts fit at once; their outputs do not
    retractions = client.get("/get_server_info").json()["retractions"]
    results, errors = [], []

    def one():
        try:
            body = {"model": MODEL, "messages": messages, "ignore_eos": True}
            results.append(client.post("/v1/chat/completions", json=body))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for r in results:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["total_tokens"] == _max_model_len(client)
    assert len(results) == 4
    assert client.get("/get_server_info").json()["retractions"] > retractions


def test_prompt_that_can_never_fit_says_why(client, engine):
    limit = _max_model_len(client)
    messages = _messages_of(engine, limit)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert str(limit) in err["message"] and "--max-total-tokens" in err["message"]


def test_over_long_max_tokens_names_max_tokens(client, engine):
    # within the model's context, past what the memory holds for one request
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": engine.context_length - 10}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}]}
    r = client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 10_000})
    assert r.json()["error"]["param"] == "max_completion_tokens"


def _finished(client) -> dict[str, float]:
    text = client.get("/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(text)}["unimem:requests_finished"]
    return {s.labels["finish_reason"]: s.value for s in fam.samples if s.name.endswith("_total")}


def test_stop_string_is_counted_as_stop(client):
    body = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    words = full["choices"][0]["text"].split()
    assert len(words) > 3
    info_before = client.get("/get_server_info").json()["requests_finished"]
    metrics_before = _finished(client)
    r = client.post("/v1/completions", json={**body, "ignore_eos": True, "stop": [words[2]]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    info = client.get("/get_server_info").json()["requests_finished"]
    assert info.get("stop", 0) == info_before.get("stop", 0) + 1
    assert info.get("abort", 0) == info_before.get("abort", 0)
    metrics = _finished(client)
    assert metrics.get("stop", 0) == metrics_before.get("stop", 0) + 1
    assert metrics.get("abort", 0) == metrics_before.get("abort", 0)


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b"}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "w5 \udfff"}]},
            "messages.0.content",
        ),
        ("/generate", {"text": "w5", "sampling_params": {"stop": ["x\ud800"]}}, None),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_position(client, route, body, param):
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as \\udXXX, valid JSON
    r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_unicode"
    assert "position" in err["message"] and "surrogate" in err["message"]
    if param is not None:
        assert err["param"] == param
    else:
        assert err["param"] == "sampling_params.stop.0"
        assert "position 1" in err["message"]


def test_logprobs_at_temperature_above_zero(client):
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4, "temperature": 0.8, "seed": 1}
    r = client.post("/v1/completions", json={**body, "logprobs": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and all(x <= 0 for x in lp["token_logprobs"])
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w5"}],
        "max_tokens": 4,
        "temperature": 0.8,
        "logprobs": True,
    }
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"]) >= 1
    # the most likely tokens at every temperature (the raw distribution's); each list holds
    # the chosen token's own value where the token is among them
    r = client.post("/v1/completions", json={**body, "logprobs": 3})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert value <= max(top.values()) and (tok not in top or top[tok] == value)
    r = client.post("/v1/chat/completions", json={**chat, "top_logprobs": 5})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 5 for c in content)
    # streamed: every chunk's tokens carry theirs
    r = client.post("/v1/chat/completions", json={**chat, "top_logprobs": 2, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = [
        c for chunk in chunks for ch in chunk["choices"] if ch["logprobs"]
        for c in ch["logprobs"]["content"]
    ]  # fmt: skip
    assert len(streamed) == 4 and all(len(c["top_logprobs"]) == 2 for c in streamed)
    # past 20 the error names the field as sent
    r = client.post("/v1/completions", json={**body, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = client.post("/v1/chat/completions", json={**chat, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_health_generate_answers_for_a_busy_server_with_a_queue(client):
    """SGLang's semantics: any output after the probe arrived proves the engine alive; the
    probe itself is no request the metrics count."""
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 20, "ignore_eos": True}
    threads = [
        threading.Thread(target=client.post, args=("/v1/completions",), kwargs={"json": body})
        for _ in range(6)  # 4 run, 2 wait
    ]
    before = client.get("/get_server_info").json()["requests_finished"]
    for t in threads:
        t.start()
    try:
        assert client.get("/health_generate").status_code == 200
    finally:
        for t in threads:
            t.join(120)
    assert client.get("/health_generate").status_code == 200  # idle: its own probe answers
    after = client.get("/get_server_info").json()["requests_finished"]
    assert after.get("length", 0) == before.get("length", 0) + 6
    assert after.get("abort", 0) == before.get("abort", 0)


def test_health_generate_timeout_is_a_flag_and_a_stalled_engine_gets_503(engine):
    release = threading.Event()
    with TestClient(make_app(engine, _options(health_generate_timeout=0.3))) as c:
        stall = c.app.state.serving.loop.call(lambda core: release.wait(60))
        try:
            r = c.get("/health_generate")
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "timeout"
            assert "--health-generate-timeout" in r.json()["error"]["message"]
        finally:
            release.set()
            stall.result(60)
        assert c.get("/health_generate").status_code == 200


def test_chat_without_a_template_says_how_to_fix_it(engine):
    from unimem.serve.chat_template import KNOWN_TEMPLATES

    tok = engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = None  # a base model's tokenizer
    try:
        with TestClient(make_app(engine, _options())) as c:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}]}
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "no_chat_template" and "--chat-template" in err["message"]
        with TestClient(make_app(engine, _options(chat_template=KNOWN_TEMPLATES["chatml"]))) as c:
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        tok.chat_template = saved


def test_draining_server_answers_503_json_with_retry_after(engine):
    with TestClient(make_app(engine, _options())) as c:
        c.app.state.serving.draining = True
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 2}
        for r in (c.post("/v1/completions", json=body), c.get("/health_generate")):
            assert r.status_code == 503
            assert r.headers["retry-after"]
            assert r.json()["error"]["code"] == "shutting_down"


def test_server_options_default_timeouts():
    opts = _options()
    assert opts.graceful_shutdown_timeout > 0 and opts.health_generate_timeout > 0
    assert dataclasses.replace(opts, health_generate_timeout=1.0).health_generate_timeout == 1.0


def test_tokenize_and_detokenize_as_sglang_answers(client, engine):
    """SGLang's ``/v1/tokenize`` and ``/v1/detokenize`` (and the paths without ``/v1``): one
    prompt or a list, the token counts and the context the server takes; decoding back."""
    tok = engine.tokenizer
    r = client.post("/v1/tokenize", json={"model": MODEL, "prompt": "w5 w6 w7"})
    assert r.status_code == 200, r.text
    one = r.json()
    assert one["tokens"] == tok.encode("w5 w6 w7") and one["count"] == len(one["tokens"])
    assert one["max_model_len"] == _max_model_len(client)
    r = client.post("/tokenize", json={"prompt": ["w5", "w6 w7"], "add_special_tokens": False})
    many = r.json()
    assert many["tokens"] == [tok.encode(t, add_special_tokens=False) for t in ("w5", "w6 w7")]
    assert many["count"] == [len(t) for t in many["tokens"]]
    r = client.post("/v1/detokenize", json={"tokens": one["tokens"]})
    assert r.json()["text"] == tok.decode(one["tokens"], skip_special_tokens=True)
    r = client.post("/detokenize", json={"tokens": many["tokens"], "skip_special_tokens": False})
    assert r.json()["text"] == [tok.decode(t) for t in many["tokens"]]
    assert r.json()["prompt"] == r.json()["text"]  # vLLM's name too
    r = client.post("/v1/detokenize", json={"tokens": [5, 10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = client.post("/v1/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(client, engine):
    """vLLM's ``/tokenizer_info``: lm-eval's remote tokenizer detects a server by it (a dict
    with ``eos_token``) and by ``/tokenize``, then decodes through ``/detokenize``'s
    ``prompt``."""
    tok = engine.tokenizer
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == _max_model_len(client)
    ids = client.post("/tokenize", json={"prompt": "w5 w6", "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode("w5 w6", add_special_tokens=False)
    back = client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert back == "w5 w6"


def test_chat_template_kwargs_reach_the_template(engine):
    """``chat_template_kwargs`` are the template's variables (SGLang's field, e.g.
    ``enable_thinking``); one naming an argument the server sets is a 400."""
    template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}{{ lead | default('w9') }}{% endif %}"
    )
    with TestClient(make_app(engine, _options(chat_template=template))) as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
        plain = c.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
        led = c.post(
            "/v1/chat/completions", json={**body, "chat_template_kwargs": {"lead": "w9 w8 w7"}}
        )
        assert led.status_code == 200, led.text
        assert led.json()["usage"]["prompt_tokens"] == plain + 2
        r = c.post(
            "/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}}
        )
        assert r.status_code == 400 and "'tokenize'" in r.json()["error"]["message"]


def test_parallel_tool_calls_without_tools_is_accepted(client):
    """``parallel_tool_calls`` qualifies ``tools``; alone it asks for nothing, so any value
    passes, while ``tools`` themselves stay refused."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    r = client.post(
        "/v1/chat/completions", json={**body, "tools": [tool], "parallel_tool_calls": False}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
