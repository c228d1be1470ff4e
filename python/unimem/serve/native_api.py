"""SGLang's native routes: ``POST /generate``, ``GET /health``, ``GET /health_generate``,
``GET /get_model_info``, ``GET /get_server_info``, ``POST /flush_cache``, and ``GET /metrics``.

``/generate`` takes ``text`` or ``input_ids`` (one prompt, or a list of them without
``stream``), ``sampling_params`` with SGLang's names (``max_new_tokens`` — default 128 —,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``n``), ``stream`` and ``return_logprob``; it answers ``{"text",
"output_ids", "meta_info"}`` with ``meta_info.finish_reason`` as SGLang spells it
(``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}``). Streamed, each
event carries the text and ids so far (SGLang's cumulative stream) and the last is
``data: [DONE]``.

``/get_server_info`` includes the engine thread's snapshot (``used_bytes``, ``live_units``
per kind, running / queued requests, the prefix cache's statistics under ``prefix_cache``,
...), so a client can watch memory return to idle: what the prefix cache holds counts as
used until ``/flush_cache``, which empties the cache when no request is queued or running
(400 otherwise, as SGLang answers).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from unimem.models.fp8_linear import weight_bytes
from unimem.serve.generation import Generation, GenParams, Piece, Serving
from unimem.serve.metrics import CONTENT_TYPE, ServerMetrics
from unimem.serve.openai_api import SSE_HEADERS, read_json, sse
from unimem.serve.protocol import ApiError, GenerateRequest, error_body, parse_body

__all__ = ["native_router"]

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens``."""

SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
)

HEALTH_GENERATE_TIMEOUT_S = 20.0


def _gen_params(raw: dict | None, where: str) -> GenParams:
    raw = dict(raw or {})
    for key in raw:
        if key not in SAMPLING_KEYS:
            raise ApiError(
                400,
                f"{where}: unknown key {key!r}; supported: {', '.join(SAMPLING_KEYS)}",
                param=f"{where}.{key}",
                code="unrecognized_argument",
            )
    p = GenParams(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, max_tokens_field=f"{where}.max_new_tokens")
    for key in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n"):
        if raw.get(key) is not None:
            setattr(p, key, raw[key])
    stop = raw.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop or ()
    ids = raw.get("stop_token_ids") or ()
    ignore = raw.get("ignore_eos", False)
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
    return_logprob: bool,
) -> dict:
    meta = {
        "id": rid,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "finish_reason": _finish(last, gen.completion_tokens),
        "e2e_latency": time.monotonic() - gen.arrival,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(lps, ids, strict=True)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def native_router(serving: Serving, metrics: ServerMetrics) -> APIRouter:
    """SGLang's native routes over ``serving``."""
    router = APIRouter()

    def prompts(body: GenerateRequest) -> tuple[list[list[int]], str, bool]:
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", param="text")
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
        batch, field, single = prompts(body)
        if not batch:
            raise ApiError(400, f"{field} is empty", param=field)
        sp = body.sampling_params
        if isinstance(sp, list):
            if len(sp) != len(batch):
                raise ApiError(
                    400,
                    f"sampling_params has {len(sp)} entries for {len(batch)} prompts",
                    param="sampling_params",
                )
            params = [_gen_params(p, "sampling_params") for p in sp]
        else:
            params = [_gen_params(sp, "sampling_params")] * len(batch)
        if body.stream and not single:
            raise ApiError(400, "stream takes one prompt", param="stream")
        subs = [serving.prepare(ids, p, field) for ids, p in zip(batch, params, strict=True)]
        gens = [Generation(serving, s, p.stop, request) for s, p in zip(subs, params, strict=True)]
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
                    body.return_logprob,
                )
                for i, (g, o) in enumerate(zip(gens, outs, strict=True))
            ]
            return JSONResponse(res[0] if single else res)
        gen = gens[0]
        it = gen.pieces()
        first = await it.__anext__()

        async def events():
            text, ids, lps = "", [], []
            piece = first
            try:
                while piece is not None:
                    text += piece.text
                    ids += piece.token_ids
                    lps += piece.logprobs
                    if piece.text or piece.token_ids or piece.finish_reason is not None:
                        yield sse(_result(gen, rid, text, ids, lps, piece, body.return_logprob))
                    piece = await anext(it, None)
            except ApiError as e:
                yield sse(error_body(e))
            finally:
                await it.aclose()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.get("/health")
    async def health():
        if not serving.loop.alive:
            raise ApiError(
                503, serving.loop.error or "the engine is not running", code="engine_error"
            )
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate(request: Request):
        p = GenParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        gen = Generation(serving, serving.prepare([0], p, "input_ids"), (), request)
        try:
            await asyncio.wait_for(gen.collect(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(503, "the engine did not answer in time", code="timeout") from None
        return Response(status_code=200)

    @router.get("/get_model_info")
    async def get_model_info():
        args = serving.engine.args
        return {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "served_model_name": serving.options.served_model_name,
            "is_generation": True,
            "context_length": serving.context_length,
            "vocab_size": serving.vocab_size,
        }

    @router.get("/get_server_info")
    async def get_server_info():
        e = serving.engine
        opts = {k: v for k, v in asdict(serving.options).items() if k != "api_key"}
        return {
            "server_args": {**asdict(e.args), **opts},
            "max_total_num_tokens": e.max_total_num_tokens,
            "max_running_requests": e.max_running_requests,
            "context_length": e.context_length,
            "page_size": e.pool.page_size,
            "enable_unified_memory": e.args.enable_unified_memory,
            "attention_backend": e.backend_name,
            "cuda_graphs": e.cuda_graphs,
            "weight_bytes": weight_bytes(e.model),
            **serving.loop.snapshot(),
        }

    @router.post("/flush_cache")
    async def flush_cache():
        # on the engine thread, between two steps
        try:
            done = await asyncio.wrap_future(
                serving.loop.call(lambda core: serving.engine.flush_cache())
            )
        except ValueError as e:  # not supported here (tensor parallelism)
            return PlainTextResponse(f"Cache not flushed: {e}.", status_code=400)
        if not done:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router
