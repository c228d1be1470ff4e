"""SGLang's native routes: ``POST /generate``, ``GET /health``, ``GET /health_generate``,
``GET /get_model_info``, ``GET /get_server_info``, ``POST /flush_cache``, and ``GET /metrics``.

``/generate`` takes ``text`` or ``input_ids`` (one prompt, or a list of them without
``stream``), ``sampling_params`` with SGLang's names (``max_new_tokens`` — default 128 —,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``n``, ``no_stop_trim``, ``skip_special_tokens``, ``min_new_tokens``,
``logit_bias``, the penalties, ``json_schema`` / ``regex`` / ``ebnf``: structured output),
``stream`` and
``return_logprob`` (with ``logprob_start_len`` and ``top_logprobs_num``: the prompt's
log-probabilities, :class:`_Logprobs`); it answers ``{"text", "output_ids", "meta_info"}`` with
``meta_info.finish_reason`` as SGLang spells it (``{"type": "stop", "matched": ...}``,
``{"type": "length", "length": n}``). Streamed, each event carries the text and ids so far
(SGLang's cumulative stream) and the last is ``data: [DONE]``.

``/get_server_info`` includes the engine thread's snapshot (``used_bytes``, ``live_units``
per kind, running / queued requests, the prefix cache's statistics under ``prefix_cache``,
...), so a client can watch memory return to idle: what the prefix cache holds counts as
used until ``/flush_cache``, which empties the cache when no request is queued or running
(400 otherwise, as SGLang answers, with SGLang's message in an error body).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from unimem.engine.api import SAMPLING_KEYS as ENGINE_SAMPLING_KEYS
from unimem.serve.engine_loop import PromptScores
from unimem.serve.errors import ApiError, error_body
from unimem.serve.generation import Generation, GenParams, Piece, Serving, token_bias
from unimem.serve.metrics import CONTENT_TYPE, ServerMetrics
from unimem.serve.openai_api import SSE_HEADERS, read_json, sse
from unimem.serve.protocol import GenerateRequest, parse_body
from unimem.serve.router_compat import model_info, server_info
from unimem.serve.sglang_fields import refuse_sglang_unsupported
from unimem.serve.structured import grammar_of_fields

__all__ = ["native_router"]

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens``."""

SAMPLING_KEYS = (*ENGINE_SAMPLING_KEYS, "stop", "n", "no_stop_trim", "skip_special_tokens")
"""``sampling_params`` keys: the engine's (:data:`unimem.engine.api.SAMPLING_KEYS`) and those
the server applies to text or choices."""

HEALTH_POLL_S = 0.05
"""How often ``/health_generate`` looks for engine output."""


def _gen_params(raw: dict | None, where: str, defaults: Mapping) -> GenParams:
    """``sampling_params`` over ``defaults`` (the checkpoint's sampling defaults)."""
    raw = dict(raw or {})
    for key in raw:
        if key not in SAMPLING_KEYS:
            raise ApiError(
                400,
                f"{where}: unknown key {key!r}; supported: {', '.join(SAMPLING_KEYS)}",
                param=f"{where}.{key}",
                code="unrecognized_argument",
            )
    p = GenParams.with_defaults(
        defaults, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, max_tokens_field=f"{where}.max_new_tokens"
    )
    for key in (
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
        "presence_penalty", "frequency_penalty", "repetition_penalty",
    ):  # fmt: skip
        if raw.get(key) is not None:
            setattr(p, key, raw[key])
    stop = raw.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop or ()
    ids = raw.get("stop_token_ids") or ()
    ignore = raw.get("ignore_eos", False)
    for key in ("no_stop_trim", "skip_special_tokens"):
        if not isinstance(raw.get(key, False), bool):
            raise ApiError(400, f"{where}.{key} must be a bool", param=f"{where}.{key}")
    p.no_stop_trim = raw.get("no_stop_trim", False)
    p.skip_special_tokens = raw.get("skip_special_tokens", True)
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) for s in stop):
        raise ApiError(
            400, f"{where}.stop must be a string or a list of strings", param=f"{where}.stop"
        )
    if not isinstance(ids, (list, tuple)) or any(
        isinstance(t, bool) or not isinstance(t, int) for t in ids
    ):
        raise ApiError(
            400, f"{where}.stop_token_ids must be a list of ints", param=f"{where}.stop_token_ids"
        )
    if not isinstance(ignore, bool):
        raise ApiError(400, f"{where}.ignore_eos must be a bool", param=f"{where}.ignore_eos")
    if isinstance(p.n, bool) or not isinstance(p.n, int):
        raise ApiError(400, f"{where}.n must be an int", param=f"{where}.n")
    p.stop, p.stop_token_ids, p.ignore_eos = tuple(stop), tuple(ids), ignore
    p.logit_bias = token_bias(raw.get("logit_bias"), f"{where}.logit_bias")
    p.min_tokens = raw.get("min_new_tokens") or 0
    p.min_tokens_field = f"{where}.min_new_tokens"
    fields = {key: raw.get(key) for key in ("json_schema", "regex", "ebnf")}
    p.grammar, p.grammar_field = grammar_of_fields(fields, where)
    return p


def _finish(piece: Piece, completion_tokens: int) -> dict | None:
    if piece.finish_reason is None:
        return None
    if piece.finish_reason == "stop":
        return {"type": "stop", "matched": piece.matched}
    if piece.finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "abort", "message": "aborted"}


def _result(
    gen: Generation,
    rid: str,
    text: str,
    ids: list[int],
    lps: list[float],
    last: Piece,
    logprobs: _Logprobs | None,
    prompt: PromptScores | None = None,
    tops: list | None = None,
) -> dict:
    meta = {
        "id": rid,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "finish_reason": _finish(last, gen.completion_tokens),
        "e2e_latency": time.monotonic() - gen.arrival,
    }
    if logprobs is not None:
        meta.update(logprobs.fields(ids, lps, prompt, tops or []))
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


class _Logprobs:
    """SGLang's log-probability fields of ``meta_info``: ``output_token_logprobs``
    (``[logprob, id, text]`` per output token), with ``start`` >= 0 (``logprob_start_len``)
    ``input_token_logprobs`` from that prompt position (position 0's logprob None), and with
    ``top`` (``top_logprobs_num``) > 0 ``output_top_logprobs`` / ``input_top_logprobs`` (a
    list of ``[logprob, id, text]`` per position, most likely first; None where not scored).
    ``token_text``: the entries' text (``return_text_in_logprobs``), else None."""

    def __init__(self, start: int, top: int, token_text=None) -> None:
        self.start, self.top, self.token_text = start, top, token_text

    def _entry(self, lp, tok) -> list:
        return [lp, tok, self.token_text(tok) if self.token_text else None]

    def fields(
        self, ids: list[int], lps: list[float], prompt: PromptScores | None, tops: list
    ) -> dict:
        outputs = [self._entry(lp, t) for lp, t in zip(lps, ids, strict=True)]
        out = {"output_token_logprobs": outputs}
        if self.top:
            out["output_top_logprobs"] = [[self._entry(lp, i) for i, lp in alts] for alts in tops]
        if self.start >= 0 and prompt is not None:
            span = range(self.start, len(prompt.token_ids))
            out["input_token_logprobs"] = [
                self._entry(prompt.logprobs[j], prompt.token_ids[j]) for j in span
            ]
            if self.top and prompt.top is not None:
                tops = [prompt.top[j] for j in span]
                out["input_top_logprobs"] = [
                    None if t is None else [self._entry(lp, i) for i, lp in t] for t in tops
                ]
        return out


def _logprobs_of(body: GenerateRequest, params: list[GenParams], token_text) -> _Logprobs | None:
    """The request's log-probability fields (None without ``return_logprob``); sets each
    prompt's :class:`GenParams` to score its prompt from ``logprob_start_len`` (>= 0) with
    ``top_logprobs_num`` top tokens (checked by :meth:`Serving.prepare`)."""
    start, top = body.logprob_start_len, body.top_logprobs_num
    if start < -1:
        raise ApiError(
            400,
            f"logprob_start_len must be -1 (output tokens only) or a prompt position, got {start}",
            param="logprob_start_len",
            code="invalid_value",
        )
    if not body.return_logprob:
        return None
    for p in params:
        p.top_logprobs, p.top_logprobs_field = top, "top_logprobs_num"
        if start >= 0:
            p.prompt_logprobs_from, p.prompt_logprobs_field = start, "logprob_start_len"
    return _Logprobs(start, top, token_text)


def native_router(serving: Serving, metrics: ServerMetrics) -> APIRouter:
    """SGLang's native routes over ``serving``."""
    router = APIRouter()

    def prompts(body: GenerateRequest) -> tuple[list[list[int]], str, bool]:
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(
                400, "give exactly one of text and input_ids", param="text", code="invalid_value"
            )
        if body.text is not None:
            serving.require_tokenizer()
            single = isinstance(body.text, str)
            texts = [body.text] if single else body.text
            return [serving.tokenizer.encode(t) for t in texts], "text", single
        ids = body.input_ids
        single = not ids or not isinstance(ids[0], list)
        return ([list(ids)] if single else [list(x) for x in ids]), "input_ids", single

    @router.post("/generate")
    async def generate(request: Request):
        body = parse_body(GenerateRequest, await read_json(request))
        serving.check_model(body.model)
        refuse_sglang_unsupported(body)
        text_of = serving.token_text if body.return_text_in_logprobs else None
        batch, field, single = prompts(body)
        if not batch:
            raise ApiError(400, f"{field} is empty", param=field)
        sp, defaults = body.sampling_params, serving.engine.sampling_defaults
        if isinstance(sp, list):
            if len(sp) != len(batch):
                raise ApiError(
                    400,
                    f"sampling_params has {len(sp)} entries for {len(batch)} prompts",
                    param="sampling_params",
                )
            params = [_gen_params(p, "sampling_params", defaults) for p in sp]
        else:
            params = [_gen_params(sp, "sampling_params", defaults)] * len(batch)
        if body.stream and not single:
            raise ApiError(400, "stream takes one prompt", param="stream")
        logprobs = _logprobs_of(body, params, text_of)
        subs = [serving.prepare(ids, p, field) for ids, p in zip(batch, params, strict=True)]
        gens = [
            Generation(serving, s, p.stop, request, p) for s, p in zip(subs, params, strict=True)
        ]
        rid = body.rid or uuid.uuid4().hex
        if not body.stream:
            outs = await asyncio.gather(*(g.collect() for g in gens))
            res = [
                _result(
                    g,
                    rid if single else f"{rid}-{i}",
                    o.text,
                    o.token_ids,
                    o.logprobs,
                    o,
                    logprobs,
                    o.prompt,
                    o.top_logprobs,
                )
                for i, (g, o) in enumerate(zip(gens, outs, strict=True))
            ]
            return JSONResponse(res[0] if single else res)
        gen = gens[0]
        it = gen.pieces()
        first = await it.__anext__()

        async def events():
            text, ids, lps, tops = "", [], [], []
            piece, prompt = first, first.prompt
            try:
                while piece is not None:
                    text += piece.text
                    ids += piece.token_ids
                    lps += piece.logprobs
                    tops += piece.top_logprobs
                    prompt = prompt or piece.prompt
                    if piece.text or piece.token_ids or piece.finish_reason is not None:
                        res = _result(gen, rid, text, ids, lps, piece, logprobs, prompt, tops)
                        yield sse(res)
                    piece = await anext(it, None)
            except ApiError as e:
                yield sse(error_body(e))
            finally:
                await it.aclose()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.get("/health")
    async def health():
        if serving.draining:
            raise serving.shutting_down_error()
        if not serving.loop.alive:
            raise ApiError(
                503, serving.loop.error or "the engine is not running", code="engine_error"
            )
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate(request: Request):
        """SGLang's semantics: healthy once the engine produces a token after the probe
        arrived, its own one-token probe's or any running request's (a busy server is not
        slowed by, nor failed for, its queue); 503 if nothing comes out within
        ``--health-generate-timeout`` seconds, or while shutting down."""
        if serving.draining:
            raise serving.shutting_down_error()
        if not serving.loop.alive:
            raise ApiError(
                503, serving.loop.error or "the engine is not running", code="engine_error"
            )
        tic = time.monotonic()
        p = GenParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        sub = serving.prepare([0], p, "input_ids")
        sub.counted = False  # a probe: not a request the metrics count
        gen = Generation(serving, sub, (), None)
        probe = asyncio.ensure_future(gen.collect())
        timeout = serving.options.health_generate_timeout
        try:
            while not probe.done() and serving.loop.last_output <= tic:
                if time.monotonic() - tic > timeout:
                    raise ApiError(
                        503,
                        f"the engine produced no token in {timeout:g}s (--health-generate-timeout)",
                        code="timeout",
                    )
                await asyncio.sleep(HEALTH_POLL_S)
            if probe.done():
                probe.result()  # an engine error is answered as such
        finally:
            if not probe.done():
                probe.cancel()  # aborts the probe in the engine (or drops it from the queue)
        return Response(status_code=200)

    @router.get("/get_model_info")
    async def get_model_info():
        return model_info(serving)

    @router.get("/get_server_info")
    async def get_server_info():
        return server_info(serving)

    @router.post("/flush_cache")
    async def flush_cache():
        # on the engine thread, between two steps
        try:
            done = await asyncio.wrap_future(
                serving.loop.call(lambda core: serving.engine.flush_cache())
            )
        except ValueError as e:  # not supported here (tensor parallelism)
            raise ApiError(400, f"Cache not flushed: {e}.", code="unsupported_value") from None
        if not done:
            raise ApiError(400, "Cache not flushed: requests are running.", code="requests_running")
        return PlainTextResponse("Cache flushed.")

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router
