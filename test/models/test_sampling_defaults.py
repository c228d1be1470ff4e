"""Sampling defaults from the checkpoint's ``generation_config.json`` where a request is
silent (SGLang's ``--sampling-defaults model``), on a tiny Gemma 3 checkpoint."""

from __future__ import annotations

import json

import pytest
import tiny_gemma3

from unimem.engine.api import Engine, SamplingParams
from unimem.models.loader import sampling_defaults


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen")
    tiny_gemma3.build(path)
    gen = {"eos_token_id": 1, "temperature": 0.7, "top_k": 5, "top_p": None}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_defaults_read_from_generation_config(checkpoint, tmp_path):
    assert sampling_defaults(checkpoint) == {"temperature": 0.7, "top_k": 5}
    assert sampling_defaults(tmp_path) == {}  # no generation_config.json


def test_request_wins_where_it_speaks(checkpoint):
    defaults = sampling_defaults(checkpoint)
    silent = SamplingParams({"max_new_tokens": 4}, defaults).sampling
    assert (silent.temperature, silent.top_k, silent.top_p) == (0.7, 5, 1.0)
    greedy = SamplingParams({"temperature": 0.0}, defaults).sampling
    assert greedy.temperature == 0.0 and greedy.top_k == 5
    assert SamplingParams({"temperature": None}, defaults).sampling.temperature == 0.7


def test_engine_applies_them(checkpoint):
    engine = Engine(model_path=str(checkpoint), dtype="float32", max_total_tokens=256)
    try:
        assert engine.sampling_defaults == {"temperature": 0.7, "top_k": 5}
        (params,) = engine._params({"max_new_tokens": 2}, 1)
        assert params.sampling.temperature == 0.7
    finally:
        engine.shutdown()


def test_server_requests_start_from_them():
    """The server's routes (OpenAI and SGLang-native) fill what a request leaves out from the
    engine's defaults, as ``Engine.generate`` does."""
    from unimem.serve.generation import DEFAULT_TEMPERATURE
    from unimem.serve.native_api import _gen_params
    from unimem.serve.openai_api import _params
    from unimem.serve.protocol import CompletionRequest, parse_body

    defaults = {"temperature": 0.7, "top_k": 5}
    silent = _gen_params({"max_new_tokens": 3}, "sampling_params", defaults)
    assert (silent.temperature, silent.top_k, silent.top_p) == (0.7, 5, 1.0)
    greedy = _gen_params({"temperature": 0.0}, "sampling_params", defaults)
    assert (greedy.temperature, greedy.top_k) == (0.0, 5)
    body = parse_body(CompletionRequest, {"model": "m", "prompt": "x"})
    openai_silent = _params(body, None, "max_tokens", defaults)
    assert (openai_silent.temperature, openai_silent.top_k) == (0.7, 5)
    body = parse_body(CompletionRequest, {"model": "m", "prompt": "x", "top_k": 2})
    assert _params(body, None, "max_tokens", defaults).top_k == 2
    # no checkpoint defaults: the server's own (OpenAI's temperature 1)
    assert _gen_params({}, "sampling_params", {}).temperature == DEFAULT_TEMPERATURE
