"""The real server (``python -m unimem.launch_server``) in a subprocess on a loopback port, over
a tiny Qwen3-Next checkpoint built here, driven by the official ``openai`` client and plain
HTTP: outputs equal the greedy outputs of ``unimem.Engine`` with the prefix cache off (the
server runs with it on, the default, with a checkpoint every two pages), streamed or not; a
repeated prompt is served from the cache with the same output; 32 concurrent streams; a client
dropping mid-stream gives its memory back (what the cache holds is flushed first: a flush is
refused while a request runs); bad inputs get their status while a good request runs on;
``/metrics`` parses. One server for the module, stopped by its pid."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import tiny_qwen3_next
import tiny_tokenizer
import torch
from prometheus_client.parser import text_string_to_metric_families

import unimem

API_KEY = "test-key"
MODEL = "tiny"
ENGINE_ARGS = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_total_tokens=2048,
    max_running_requests=32,
    disable_radix_cache=True,  # the reference: the server's cache must not change outputs
)
TRACK = 8
"""The server's --mamba-track-interval: a state checkpoint every two pages, so that the tiny
model's short prompts reach one (the default, 512 tokens, is past its context)."""
START_TIMEOUT_S = 120
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, path, proc: subprocess.Popen, port: int, log_path) -> None:
        self.path = path
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0)

    def info(self) -> dict:
        r = self.http.get("/get_server_info")
        assert r.status_code == 200
        return r.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    port = _free_port()
    log_path = path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "unimem.launch_server",
        "--model-path",
        str(path),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--dtype",
        "float32",
        "--page-size",
        "4",
        "--max-total-tokens",
        "2048",
        "--max-running-requests",
        "32",
        "--mamba-track-interval",
        str(TRACK),
        "--log-level",
        "warning",
    ]
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
    assert rc == 0, log_path.read_text()  # a graceful stop


@pytest.fixture(scope="module")
def engine(server):
    eng = unimem.Engine(model_path=str(server.path), **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def _chat_ids(engine, messages) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _idle(server) -> dict:
    """Poll until no request runs, then flush the prefix cache (what it holds is in use until
    then); the server info after the flush."""
    deadline = time.monotonic() + 30
    while True:
        info = server.info()
        if info["running_requests"] == 0 and info["queued_requests"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    r = server.http.post("/flush_cache")
    assert r.status_code == 200, r.text
    info = server.info()
    assert info["prefix_cache"]["cached_pages"] == 0 and info["prefix_cache"]["checkpoints"] == 0
    return info


GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


# ---------------------------------------------------------------------- equal to the engine


def test_completion_equals_engine(server, engine):
    prompt = "w5 w6 w7 w8 w9"
    want = engine.generate(prompt=prompt, sampling_params=GREEDY, return_logprob=True)
    got = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0
    )
    choice = got.choices[0]
    assert choice.text == want["text"]
    assert choice.finish_reason == want["meta_info"]["finish_reason"]["type"]
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert got.usage.completion_tokens == want["meta_info"]["completion_tokens"]
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    lps = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=1e-5)


def test_completion_stream_equals_engine(server, engine):
    prompt = "w10 w11 w12"
    want = engine.generate(prompt=prompt, sampling_params=GREEDY)
    stream = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == want["meta_info"]["finish_reason"]["type"]
    assert all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == want["meta_info"]["completion_tokens"]


def test_completion_batch_equals_engine(server, engine):
    """A batch of prompts (strings and token ids): a choice per prompt, each the engine's own
    output for it, the usage summed; streamed, each prompt's pieces under its index."""
    prompts = ["w5 w6 w7", "w40 w41", "w12 w13 w14 w15"]
    wants = [engine.generate(prompt=p, sampling_params=GREEDY) for p in prompts]
    got = server.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w["text"] for w in wants]
    meta = [w["meta_info"] for w in wants]
    assert got.usage.prompt_tokens == sum(m["prompt_tokens"] for m in meta)
    assert got.usage.completion_tokens == sum(m["completion_tokens"] for m in meta)
    ids = [engine.tokenizer.encode(p) for p in prompts[:2]]
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in by_ids.choices] == [w["text"] for w in wants[:2]]
    stream = server.client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finals = ["", "", ""], [None, None, None]
    chunks = list(stream)
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        assert finals[choice.index] is None  # nothing after a choice's last piece
        finals[choice.index] = choice.finish_reason
    assert texts == [w["text"] for w in wants]
    assert finals == [m["finish_reason"]["type"] for m in meta]
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    # one bad prompt refuses the whole batch before any runs
    r = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": [[5, 6], [5, 10**6]], "max_tokens": 2}
    )
    assert r.status_code == 400 and "outside the vocabulary" in r.text
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": ["w5"] * 257})
    assert r.status_code == 400 and "at most 256" in r.text


def test_echo_puts_the_prompt_before_each_choice(server, engine):
    prompts = ["w5 w6 w7", "w40 w41"]
    wants = [engine.generate(prompt=p, sampling_params=GREEDY)["text"] for p in prompts]
    kw = dict(model=MODEL, max_tokens=12, temperature=0, echo=True)
    got = server.client.completions.create(prompt=prompts, **kw)
    assert [c.text for c in got.choices] == [p + w for p, w in zip(prompts, wants, strict=True)]
    ids = engine.tokenizer.encode(prompts[0])
    by_ids = server.client.completions.create(prompt=ids, **kw).choices[0].text
    assert by_ids == engine.tokenizer.decode(ids) + wants[0]
    texts = ["", ""]
    for c in server.client.completions.create(prompt=prompts, stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in got.choices]


def _oracle_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """``[L, vocab]`` log-softmax of every position of ``ids`` from the model's dense oracle."""
    (logits,) = engine.model.reference_forward([torch.tensor(ids)])
    return torch.log_softmax(logits.double(), dim=-1)


def _lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's ``local-completions`` reads from a log-likelihood response (its
    ``parse_logprobs``): the continuation's summed log-probability and whether each of its
    tokens was the most likely one."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server, engine):
    """lm-eval's log-likelihood request (token-id prompts in a batch, ``echo``, ``logprobs:
    1``, ``max_tokens: 1``, ``temperature: 0``): the continuation's log-likelihood is the
    model's, ``is_greedy`` holds exactly for the greedy continuation — also for a prompt the
    server's prefix cache already holds."""
    ctx = [5, 6, 7, 8, 9, 10, 11]
    three = {"max_new_tokens": 3, "temperature": 0.0}
    greedy = engine.generate(input_ids=ctx, sampling_params=three)["output_ids"]
    other = [40, 41, 42]
    prompts = [ctx + greedy, ctx + other]
    server.client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=2)  # cached
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, ids, cont, want_greedy in zip(
        choices, prompts, (greedy, other), (True, False), strict=True
    ):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt's tokens, then the output's
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = _oracle_logprobs(engine, ids)
        for j in range(1, len(ids)):
            assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
            (best,) = lp["top_logprobs"][j].values()
            assert best == pytest.approx(float(ref[j - 1].max()), abs=1e-4)
        total, is_greedy = _lm_eval_parse(choice, len(ctx))
        want = sum(float(ref[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
        assert total == pytest.approx(want, abs=1e-4)
        assert is_greedy == want_greedy
    # the same through the openai client, whole and streamed (the first chunk carries them)
    kw = dict(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=1, temperature=0)
    # (alone, not batched: the same up to the CPU GEMMs' rounding at another row count)
    whole = server.client.completions.create(**kw).choices[0].logprobs
    batched = choices[0]["logprobs"]["token_logprobs"]
    assert whole.token_logprobs[0] is None
    assert whole.token_logprobs[1:] == pytest.approx(batched[1:], abs=1e-5)
    chunks = list(server.client.completions.create(stream=True, **kw))
    first = chunks[0].choices[0].logprobs
    assert len(first.token_logprobs) > len(prompts[0])  # the prompt's, then the output's
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-5)
    assert first.tokens == whole.tokens


def test_logit_bias_and_min_tokens_are_the_engines(server, engine):
    """``logit_bias`` (OpenAI's, token ids as strings) and ``min_tokens`` (vLLM's and
    SGLang's; ``/generate``'s ``min_new_tokens``): the engine's outputs for the same
    adjustments, through both routes; bad values name their field."""
    ids = [5, 6, 7, 8, 9]
    plain = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    favoured = (plain[0] + 7) % 100 + 10
    sp = dict(GREEDY, logit_bias={str(favoured): 8.0}, stop_token_ids=[plain[1]],
              min_new_tokens=4)  # fmt: skip
    want = engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
    assert want != plain and len(want) >= 4 and plain[1] not in want[:4]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0,
            "logit_bias": {str(favoured): 8.0}, "stop_token_ids": [plain[1]],
            "min_tokens": 4}  # fmt: skip
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text == engine.tokenizer.decode(want, skip_special_tokens=True)
    got = server.http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
    assert got["output_ids"] == want
    for bad, param in (
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"min_tokens": 13}, "min_tokens"),
    ):
        r = server.http.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    too_many = {"input_ids": ids, "sampling_params": dict(sp, min_new_tokens=99)}
    r = server.http.post("/generate", json=too_many)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.min_new_tokens"


def test_structured_output_is_the_engines(server, engine):
    """SGLang's ``regex`` / ``ebnf`` and ``/generate``'s ``json_schema``, and OpenAI's
    ``response_format``, through the ``openai`` client and ``/generate``: the engine's outputs
    for the same grammar, which the output follows and which ends the request (on EOS);
    grammars that do not compile, that the word vocabulary cannot spell, or two at once are
    refused naming their field. (The tiny model's word vocabulary spells no JSON: JSON
    output is the engine tests' and the real model's.)"""
    ids = [5, 6, 7, 8, 9]
    regex = "w1[0-3](w2[0-3]){1,3}"
    sp = dict(GREEDY, regex=regex)
    want = engine.generate(input_ids=ids, sampling_params=sp)
    assert want["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}
    words = engine.tokenizer.decode(want["output_ids"], skip_special_tokens=True).split()
    assert re.fullmatch(regex, "".join(words))
    got = server.http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
    assert got["output_ids"] == want["output_ids"]
    text = " ".join(words)
    got = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"regex": regex}
    )
    assert got.choices[0].text == text and got.choices[0].finish_reason == "stop"
    ebnf = 'root ::= "w14" ("w15" | "w16")'
    want = engine.generate(input_ids=ids, sampling_params=dict(GREEDY, ebnf=ebnf))["output_ids"]
    assert engine.tokenizer.decode(want[:-1]).split()[0] == "w14" and len(want) == 3
    msgs = [{"role": "user", "content": "w5 w6"}]
    chat = server.client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, extra_body={"ebnf": ebnf}
    )
    assert chat.choices[0].message.content.split()[0] == "w14"
    assert chat.choices[0].finish_reason == "stop"
    body = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for bad, param in (
        ({"regex": "w1[0-"}, "regex"),
        ({"ebnf": "root ::= nothing"}, "ebnf"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"response_format": {"type": "json_object"}}, "response_format"),  # no JSON spelling
        ({"response_format": schema}, "response_format"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"regex": "w4", "ebnf": 'root ::= "w4"'}, "ebnf"),
    ):
        r = server.http.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    r = server.http.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"json_schema": "{}"}}
    )
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "sampling_params.json_schema"
    plain = server.http.post("/v1/completions", json={**body, "response_format": {"type": "text"}})
    assert plain.status_code == 200


def test_penalties_are_the_engines(server, engine):
    """``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` through both
    routes: the engine's outputs for the same penalties (ones that change the tiny model's
    greedy output); out-of-range values name their field."""
    ids = [5, 6, 7, 8, 9]
    pens = {"presence_penalty": -2.0, "frequency_penalty": -1.0, "repetition_penalty": 0.5}
    want = engine.generate(input_ids=ids, sampling_params={**GREEDY, **pens})["output_ids"]
    assert want != engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    got = server.http.post(
        "/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, **pens}}
    )
    assert got.json()["output_ids"] == want
    body = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, **pens}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(want, skip_special_tokens=True)
    for name, bad in (
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
    ):
        r = server.http.post("/v1/completions", json={**body, name: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_zero_output_tokens_score_the_prompt_only(server, engine):
    """A prefill: ``max_new_tokens: 0`` (SGLang's) / ``max_tokens: 0`` with ``echo`` and
    ``logprobs`` (a legacy completions client's): the prompt's log-probabilities, no output
    token, finish reason length; the same through ``Engine.generate``."""
    ids = [5, 6, 7, 8, 9, 10]
    want = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=0)  # fmt: skip
    assert want["output_ids"] == [] and want["meta_info"]["completion_tokens"] == 0
    assert want["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in want["meta_info"]["input_token_logprobs"]] == ids
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
    got = server.http.post("/generate", json=body).json()
    assert got["output_ids"] == [] and got["meta_info"]["output_token_logprobs"] == []
    assert [e[1] for e in got["meta_info"]["input_token_logprobs"]] == ids
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    comp = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    for stream in (False, True):
        r = server.http.post("/v1/completions", json=dict(comp, stream=stream))
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            choice = chunks[0]["choices"][0]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["completion_tokens"] == 0
            assert choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert choice["text"] == engine.tokenizer.decode(ids)


def test_generate_scores_the_prompt_from_logprob_start_len(server, engine):
    ids = [5, 6, 7, 8, 9, 10]
    sp = {"max_new_tokens": 3, "temperature": 0.0}
    want = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True,
                           logprob_start_len=2, top_logprobs_num=1)["meta_info"]  # fmt: skip
    assert [e[1] for e in want["input_token_logprobs"]] == ids[2:]
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
            "logprob_start_len": 2, "top_logprobs_num": 1,
            "return_text_in_logprobs": True}  # fmt: skip
    got = server.http.post("/generate", json=body).json()["meta_info"]
    ref = _oracle_logprobs(engine, ids)
    for (lp, tok, text), j in zip(got["input_token_logprobs"], range(2, len(ids)), strict=True):
        assert tok == ids[j] and text == engine.tokenizer.decode([tok])
        assert lp == pytest.approx(float(ref[j - 1, tok]), abs=1e-4)
    for (lp, tok, _), (elp, etok, _) in zip(
        got["input_token_logprobs"], want["input_token_logprobs"], strict=True
    ):
        assert tok == etok and lp == pytest.approx(elp, abs=1e-5)
    tops = got["input_top_logprobs"]
    assert [t[0][1] for t in tops] == [int(ref[j - 1].argmax()) for j in range(2, len(ids))]
    assert [t[0][1] for t in got["output_top_logprobs"]] == [
        e[1] for e in got["output_token_logprobs"]
    ]
    # sampled, three alternatives a position: the engine's, through the server
    sampled = {"max_new_tokens": 5, "temperature": 0.8, "seed": 3}
    want = engine.generate(input_ids=ids, sampling_params=sampled, return_logprob=True,
                           top_logprobs_num=3)["meta_info"]  # fmt: skip
    body3 = dict(body, sampling_params=sampled, top_logprobs_num=3, logprob_start_len=-1)
    got3 = server.http.post("/generate", json=body3).json()["meta_info"]
    assert "input_token_logprobs" not in got3
    for alts, exp in zip(got3["output_top_logprobs"], want["output_top_logprobs"], strict=True):
        assert [a[1] for a in alts] == [e[1] for e in exp]
        assert [a[0] for a in alts] == pytest.approx([e[0] for e in exp], abs=1e-5)
    from_zero = dict(body, logprob_start_len=0, top_logprobs_num=0)
    first = server.http.post("/generate", json=from_zero).json()["meta_info"]
    assert first["input_token_logprobs"][0] == [None, ids[0], engine.tokenizer.decode([ids[0]])]
    assert "input_top_logprobs" not in first
    for bad in (-2, len(ids) + 1):
        r = server.http.post("/generate", json=dict(body, logprob_start_len=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"


def test_n_choices_are_seeded_requests(server):
    """``n`` choices of each prompt: choice ``j`` is the request with ``seed + j``; prompts x
    ``n`` indexed prompt-major; streamed under the same indices."""
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    one = [
        server.client.completions.create(prompt="w5 w6", seed=7 + j, **kw).choices[0].text
        for j in range(3)
    ]
    got = server.client.completions.create(prompt="w5 w6", seed=7, n=3, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == one
    assert len(set(one)) > 1  # different seeds, different samples
    batch = server.client.completions.create(prompt=["w5 w6", "w40"], seed=7, n=3, **kw)
    assert [c.text for c in batch.choices[:3]] == one
    assert got.usage.completion_tokens == 30 and batch.usage.completion_tokens == 60
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=6, n=2,
        temperature=0, stream=True,
    )  # fmt: skip
    texts, roles = ["", ""], []
    for c in chat:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.append(ch.index)
    assert roles == [0, 1]
    assert texts[0] == texts[1] and texts[0]  # greedy: the same twice


def test_chat_equals_engine(server, engine):
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w7 w8"}]
    want = engine.generate(input_ids=_chat_ids(engine, messages), sampling_params=GREEDY)
    got = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    # any model name is the served model, as SGLang's server takes it, and is echoed back
    other = server.client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0
    )
    assert other.model == "default" and other.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    stream = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == want["meta_info"]["finish_reason"]["type"]


def test_generate_native_equals_engine(server, engine):
    ids = [[5, 6, 7, 8, 9, 10], [40, 41]]
    want = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    r = server.http.post(
        "/generate",
        json={"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True},
    )
    assert r.status_code == 200
    for got, exp in zip(r.json(), want, strict=True):
        assert got["output_ids"] == exp["output_ids"]
        assert got["text"] == exp["text"]
        assert got["meta_info"]["finish_reason"] == exp["meta_info"]["finish_reason"]
        lps = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        exp_lps = [lp for lp, _, _ in exp["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(exp_lps, abs=1e-5)
    # streamed: cumulative events, the last one the whole output, then [DONE]
    with server.http.stream(
        "POST", "/generate", json={"input_ids": ids[0], "sampling_params": GREEDY, "stream": True}
    ) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == want[0]["output_ids"] and last["text"] == want[0]["text"]


def test_32_concurrent_streams(server, engine):
    prompts = [" ".join(f"w{4 + (7 * i + j) % 400}" for j in range(3 + i % 9)) for i in range(32)]
    params = {"max_new_tokens": 10, "temperature": 0.0}
    want = [o["text"] for o in engine.generate(prompt=prompts, sampling_params=params)]

    async def one(client, prompt):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run_all()) == want
    assert _idle(server)["used_bytes"] == IDLE["used_bytes"]


# ---------------------------------------------------------------------- the prefix cache


def test_repeated_prompt_is_served_from_the_cache(server, engine):
    hits_before = _idle(server)["prefix_cache"]["hit_tokens"]  # an empty cache
    prompt = " ".join(f"w{n}" for n in range(100, 122))  # 22 words: anchors at 8 and 16
    want = engine.generate(prompt=prompt, sampling_params=GREEDY)  # the cache off
    assert want["meta_info"]["cached_tokens"] == 0
    got = []
    for _ in range(2):
        r = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0
        )
        got.append(r)
    assert [r.choices[0].text for r in got] == [want["text"]] * 2
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in got]
    prompt_tokens = want["meta_info"]["prompt_tokens"]
    assert cached[0] == 0
    # the longest anchor (a multiple of the interval) short of the prompt's last token
    assert cached[1] == (prompt_tokens - 1) // TRACK * TRACK > 0
    native = server.http.post("/generate", json={"text": prompt, "sampling_params": GREEDY})
    assert native.json()["meta_info"]["cached_tokens"] == cached[1]
    assert native.json()["output_ids"] == want["output_ids"]
    stats = server.info()["prefix_cache"]
    assert stats["hit_tokens"] - hits_before == 2 * cached[1] and stats["checkpoints"] > 0
    assert stats["checkpoint_interval_pages"] == TRACK // ENGINE_ARGS["page_size"]
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    }
    assert families["unimem:cache_hit_rate"].samples[0].value > 0
    assert families["unimem:prefix_cache_tokens"].samples[0].value > 0
    assert _idle(server)["used_bytes"] == IDLE["used_bytes"]


# ---------------------------------------------------------------------- memory comes back

IDLE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def idle_values(server):
    info = _idle(server)
    IDLE.update(used_bytes=info["used_bytes"], live_units=info["live_units"])


def test_client_drop_mid_stream_releases_memory(server):
    before = server.info()["requests_finished"].get("abort", 0)
    body = {
        "model": MODEL,
        "prompt": "w5 w6 w7",
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    client = httpx.Client(base_url=server.url, headers=AUTH, timeout=30)
    with client, client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        busy = server.info()
        assert busy["running_requests"] == 1 and busy["used_bytes"] > IDLE["used_bytes"]
        r = server.http.post("/flush_cache")  # refused while a request runs (as in SGLang)
        assert r.status_code == 400 and "running" in r.text
        assert r.json()["error"]["code"] == "requests_running"  # an error body, as every 4xx
    # leaving the block closes the connection mid-stream
    info = _idle(server)
    assert info["used_bytes"] == IDLE["used_bytes"]
    assert info["live_units"] == IDLE["live_units"]
    assert info["requests_finished"].get("abort", 0) == before + 1  # aborted, not run to the end


def test_client_drop_mid_batch_stream_aborts_every_prompt(server):
    before = server.info()["requests_finished"].get("abort", 0)
    body = {"model": MODEL, "prompt": ["w5 w6 w7", "w8 w9"], "max_tokens": 240,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    client = httpx.Client(base_url=server.url, headers=AUTH, timeout=30)
    with client, client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        busy = server.info()
        assert busy["running_requests"] + busy["queued_requests"] == 2
    info = _idle(server)
    assert info["used_bytes"] == IDLE["used_bytes"]
    assert info["requests_finished"].get("abort", 0) == before + 2


def test_client_drop_while_waiting_for_a_whole_response_aborts_it(server):
    """A non-streaming request whose client goes away is noticed by polling (no stream to
    cancel) and aborted: counted as an abort, its memory back."""
    before = server.info()["requests_finished"].get("abort", 0)
    body = json.dumps({"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 240,
                       "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
                f"{AUTH['Authorization']}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while server.info()["running_requests"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    info = _idle(server)
    assert info["used_bytes"] == IDLE["used_bytes"]
    assert info["requests_finished"].get("abort", 0) == before + 1


def test_stop_string_cuts_text_and_ends_request(server, engine):
    prompt = "w5 w6 w7 w8 w9"
    full = engine.generate(prompt=prompt, sampling_params={**GREEDY, "ignore_eos": True})
    words = full["text"].split()
    stop = words[3]
    cut = full["text"][: full["text"].index(stop)]
    got = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == cut
    assert got.choices[0].finish_reason == "stop"
    stream = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert _idle(server)["used_bytes"] == IDLE["used_bytes"]


def test_seeded_sampling_is_reproducible(server):
    kw = dict(model=MODEL, prompt="w5 w6", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    a = server.client.completions.create(**kw).choices[0].text
    b = server.client.completions.create(**kw).choices[0].text
    assert a == b


# ---------------------------------------------------------------------- bad input


def _bad_requests(server, engine):
    """(what, method, path, body or raw bytes, headers, expected status)."""
    long_prompt = " ".join(["w9"] * (engine.context_length + 4))
    ok = {"model": MODEL, "prompt": "w5 w6"}
    return [
        ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', AUTH, 400),
        ("not an object", "/v1/completions", b"[1, 2]", AUTH, 400),
        ("a LoRA adapter", "/v1/completions", {**ok, "model": f"{MODEL}:sql"}, AUTH, 400),
        ("prompt past context", "/v1/completions", {**ok, "prompt": long_prompt}, AUTH, 400),
        ("max_tokens -1", "/v1/completions", {**ok, "max_tokens": -1}, AUTH, 400),
        (
            "max_tokens -3",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": -3},
            AUTH,
            400,
        ),
        ("max_tokens past context", "/v1/completions", {**ok, "max_tokens": 10_000}, AUTH, 400),
        ("temperature -1", "/v1/completions", {**ok, "temperature": -1}, AUTH, 400),
        ("top_p 2", "/v1/completions", {**ok, "top_p": 2.0}, AUTH, 400),
        ("top_k -5", "/v1/completions", {**ok, "top_k": -5}, AUTH, 400),
        (
            "min_p 1.5",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "min_p": 1.5},
            AUTH,
            400,
        ),
        ("n 0", "/v1/completions", {**ok, "n": 0}, AUTH, 400),
        (
            "n past the choices",
            "/v1/completions",
            {**ok, "prompt": ["w5"] * 2, "n": 129},
            AUTH,
            400,
        ),
        ("unknown field", "/v1/completions", {**ok, "frobnicate": 1}, AUTH, 400),
        ("token outside vocab", "/generate", {"input_ids": [5, 10**6]}, AUTH, 400),
        (
            "bad sampling key",
            "/generate",
            {"text": "w5", "sampling_params": {"bogus": 1}},
            AUTH,
            400,
        ),
        ("missing api key", "/v1/completions", ok, {}, 401),
        ("wrong api key", "/v1/completions", ok, {"Authorization": "Bearer nope"}, 401),
        ("unknown route", "/v1/nothing", ok, AUTH, 404),
    ]


def test_bad_inputs_get_their_status_while_a_good_request_runs(server, engine):
    prompt = "w30 w31 w32"
    params = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    want = engine.generate(prompt=prompt, sampling_params=params)["text"]
    result = {}

    def good():
        stream = server.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        result["text"] = "".join(c.choices[0].text for c in stream)

    t = threading.Thread(target=good)
    t.start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for what, path, body, headers, status in _bad_requests(server, engine):
            if isinstance(body, bytes):
                r = c.post(
                    path, content=body, headers={**headers, "Content-Type": "application/json"}
                )
            else:
                r = c.post(path, json=body, headers=headers)
            assert r.status_code == status, (what, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, what
            assert err["message"], what
    t.join(60)
    assert result["text"] == want
    assert server.http.get("/health").status_code == 200


def test_openai_client_raises_typed_errors(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="tiny:adapter", prompt="w5", max_tokens=2)
    assert e.value.body["param"] == "model" and "adapter" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="w5", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    anon = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.completions.create(model=MODEL, prompt="w5", max_tokens=2)


# ---------------------------------------------------------------------- the other routes


def test_models_info_health_flush(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-9")
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert server.http.get("/health_generate").status_code == 200
    info = server.http.get("/get_model_info").json()
    assert info["model_path"] == str(server.path) and info["is_generation"] is True
    si = server.info()
    assert si["max_running_requests"] == 32 and si["server_args"]["page_size"] == 4
    assert "api_key" not in si["server_args"]
    assert si["server_args"]["disable_radix_cache"] is False
    assert si["server_args"]["mamba_track_interval"] == TRACK
    # the start-up's phases in the order they ran (CPU: no graphs)
    phases = si["startup_seconds"]
    assert list(phases) == ["checkpoint", "grammar", "pools", "step_loop", "warm_up"]
    assert all(sec >= 0 for sec in phases.values()) and phases["checkpoint"] > 0
    assert server.http.post("/flush_cache").status_code == 200


def test_metrics_parse(server):
    r = httpx.get(server.url + "/metrics")  # no key needed
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "unimem:num_running_reqs",
        "unimem:num_queue_reqs",
        "unimem:tokens_in_use",
        "unimem:arena_occupancy",
        "unimem:compactions",
        "unimem:retractions",
        "unimem:cache_hit_rate",
        "unimem:spec_accept_length",
        "unimem:prompt_throughput",
        "unimem:gen_throughput",
        "unimem:time_to_first_token_seconds",
        "unimem:inter_token_latency_seconds",
        "unimem:generation_tokens",
        "unimem:prompt_tokens",
    ):
        assert name in families, name
    kinds = {s.labels["kind"] for s in families["unimem:tokens_in_use"].samples}
    assert kinds == {"full", "state"}  # Qwen3-Next: full attention + Gated DeltaNet
    gen = [s.value for s in families["unimem:generation_tokens"].samples]
    assert gen and gen[0] > 0
    ttft = families["unimem:time_to_first_token_seconds"].samples
    assert any(s.name.endswith("_count") and s.value > 0 for s in ttft)
    # where the engine thread's time went: its working iterations and the steps inside them
    took = {
        n: families["unimem:" + n].samples[0].value
        for n in ("engine_iterations", "engine_iteration_seconds", "engine_step_seconds",
                  "engine_step_cpu_seconds")
    }  # fmt: skip
    assert took["engine_iterations"] > 0
    assert 0 < took["engine_step_seconds"] <= took["engine_iteration_seconds"]
    assert 0 < took["engine_step_cpu_seconds"] <= took["engine_step_seconds"] + 1e-3
