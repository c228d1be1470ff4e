"""The OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{model}``), and SGLang's ``POST /v1/tokenize`` /
``/v1/detokenize`` (also without ``/v1``: ``{"tokens", "count", "max_model_len"}`` and
``{"text"}``, one or a list; the text also as vLLM's ``prompt``), and vLLM's ``GET
/tokenizer_info`` (the special tokens, the chat template, ``model_max_length``): what
lm-eval's remote tokenizer reads, so that ``lm_eval --model local-completions`` needs no
local copy of the tokenizer.

Responses follow OpenAI's shapes: ``usage`` (``prompt_tokens``, ``completion_tokens``,
``total_tokens``, ``prompt_tokens_details.cached_tokens``); with ``stream: true`` server-sent
events of ``text_completion`` / ``chat.completion.chunk`` objects ending in ``data: [DONE]``,
the usage in a last chunk with no choices when ``stream_options.include_usage`` is set (and in
every chunk with ``continuous_usage_stats``, as vLLM does). Each choice also carries SGLang's
``matched_stop`` (the stop token id or string that ended it).

A completion's ``prompt`` may be a batch (a list of strings or of token-id lists), as in
OpenAI's API and SGLang's, and ``n`` asks for several choices of each prompt: each (prompt,
choice) is its own request in the engine (submitted together, each runs its own prefill:
the prefix cache holds a prompt only once one has run it), all checked before any is
queued, and the response has a choice for each (``index`` = prompt position x ``n`` +
choice; streamed, each chunk carries one choice's piece as it comes), the usage summed over
them. Choice ``j`` of a request with a ``seed`` samples with ``seed + j`` (without one, each
draws its own). An engine error or a client that goes away ends all.

``echo`` with ``logprobs`` on a completion scores the prompt
(:mod:`unimem.engine.prompt_logprobs`): each choice's ``logprobs`` starts with the prompt's
tokens, their log-probabilities (None for the first) and, with ``logprobs: k``, the k most
likely tokens at each — a request as lm-eval's ``local-completions`` sends it for
log-likelihood tasks (``max_tokens: 1``, ``logprobs: 1``, ``temperature: 0``, token-id
prompts); ``max_tokens: 0`` scores the prompt alone. ``logprobs: k`` / chat's
``top_logprobs: k`` (up to 20) list each output token's k most likely tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from unimem.serve.chat_template import KNOWN_TEMPLATES
from unimem.serve.errors import ApiError, error_body
from unimem.serve.generation import Generation, GenParams, Piece, Serving, token_bias
from unimem.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_unicode,
    parse_body,
    refuse_unsupported,
)
from unimem.serve.sglang_fields import refuse_sglang_unsupported
from unimem.serve.structured import grammar_of_fields

__all__ = ["openai_router", "read_json", "sse"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json(request: Request):
    """The decoded body; 400 with OpenAI's message if it is not JSON."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ApiError(
            400,
            "We could not parse the JSON body of your request. (HINT: This "
            "likely means you aren't using your HTTP library correctly.)",
            code="invalid_json",
        ) from None
    check_unicode(data)
    return data


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (or the literal ``[DONE]``), as the
    UTF-8 bytes the response writes. orjson (SGLang's and vLLM's encoder for the same
    events): a streamed chunk's encoding ~4x faster than ``json.dumps``, non-ASCII text
    unescaped as with ``ensure_ascii=False``."""
    data = obj.encode() if isinstance(obj, str) else orjson.dumps(obj)
    return b"data: " + data + b"\n\n"


def _params(body, max_tokens: int | None, max_field: str, defaults: Mapping) -> GenParams:
    """The request's parameters over ``defaults`` (the checkpoint's sampling defaults)."""
    stop = body.stop
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    p = GenParams.with_defaults(
        defaults,
        max_new_tokens=max_tokens,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        n=body.n,
        seed=body.seed,
        no_stop_trim=body.no_stop_trim,
        skip_special_tokens=body.skip_special_tokens,
        max_tokens_field=max_field,
    )
    for name in ("temperature", "top_p", "top_k", "min_p"):
        value = getattr(body, name)
        if value is not None:
            setattr(p, name, value)
    p.logit_bias = token_bias(body.logit_bias, "logit_bias")
    p.min_tokens = body.min_tokens
    fields = {
        key: getattr(body, key, None) for key in ("response_format", "json_schema", "regex", "ebnf")
    }
    p.grammar, p.grammar_field = grammar_of_fields(fields)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(p, name, value)
    return p


def _usage(gens: list[Generation]) -> dict:
    """The usage of a response's generations (one a choice), summed."""
    prompt = sum(g.prompt_tokens for g in gens)
    completion = sum(g.completion_tokens for g in gens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in gens)},
    }


async def _first(it: AsyncIterator):
    """The first item, so that an early error is answered with its status, not a stream."""
    return await it.__anext__()


async def _collect_all(gens: list[Generation]) -> list[Piece]:
    """Every generation run to its end, concurrently; on the first error the others are
    cancelled (which aborts them in the engine) before it is raised."""
    if len(gens) == 1:  # the common case: no task of its own
        return [await gens[0].collect()]
    tasks = [asyncio.ensure_future(g.collect()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _merged_pieces(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """``(index, piece)`` of every generation as the pieces come. On an error in one, or when
    the consumer stops early, the others are cancelled (aborted in the engine)."""
    if len(gens) == 1:
        it = gens[0].pieces()
        try:
            async for piece in it:
                yield 0, piece
        finally:
            await it.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                queue.put_nowait((i, piece))
        except Exception as e:  # noqa: BLE001 (handed to the consumer, which raises it)
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    running = len(tasks)
    try:
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Route:
    """What a completion and a chat completion share: checks, running, streaming."""

    def __init__(self, serving: Serving, kind: str) -> None:
        self.serving = serving
        self.kind = kind  # "completion" or "chat"

    def logprobs(self, piece: Piece, top: int, offset: int) -> dict | None:
        """A choice's ``logprobs`` for ``piece``: each token's log-probability and, with
        ``top`` > 0, its most likely tokens (the engine's, :class:`Piece`'s
        ``top_logprobs``) — chat's ``content`` list, or a completion's ``tokens`` /
        ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` (with an echoed, scored
        prompt's tokens first)."""
        s = self.serving
        text = s.token_text
        toks = [text(t) for t in piece.token_ids]
        tops = piece.top_logprobs if top else [()] * len(toks)
        if self.kind == "chat":

            def entry(t: str, lp: float) -> dict:
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {
                "content": [
                    {**entry(t, lp), "top_logprobs": [entry(text(i), v) for i, v in alts]}
                    for t, lp, alts in zip(toks, piece.logprobs, tops, strict=True)
                ]
            }
        lps: list[float | None] = list(piece.logprobs)
        top_maps: list[dict | None] = [{text(i): v for i, v in alts} for alts in tops]
        scored = piece.prompt
        if scored is not None:  # echo: the prompt's tokens come first, as scored
            texts = [text(t) for t in scored.token_ids]
            prompt_tops: list[dict | None] = [None] * len(texts)
            if scored.top is not None:
                prompt_tops = [
                    None if alts is None else {text(i): v for i, v in alts} for alts in scored.top
                ]
            toks, lps, top_maps = texts + toks, list(scored.logprobs) + lps, prompt_tops + top_maps
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": toks,
            "token_logprobs": lps,
            "top_logprobs": top_maps if top else None,
            "text_offset": offsets,
        }

    def choice(
        self, piece: Piece, want_lp: bool, top: int, offset: int, stream: bool, index: int = 0
    ) -> dict:
        c: dict = {"index": index}
        if self.kind == "chat":
            if stream:
                c["delta"] = {"content": piece.text} if piece.text else {}
            else:
                c["message"] = {"role": "assistant", "content": piece.text}
        else:
            c["text"] = piece.text
        c["logprobs"] = self.logprobs(piece, top, offset) if want_lp else None
        c["finish_reason"] = piece.finish_reason
        c["matched_stop"] = piece.matched
        return c

    async def run(
        self,
        request: Request,
        body,
        prompts: list[list[int]],
        prompt_field: str,
        params: GenParams,
        want_lp: bool,
        top: int,
        echo: list[str] | None = None,
    ):
        """Run ``prompts`` (one, or a completion's batch), ``params.n`` choices of each (module
        docstring), and answer. ``echo``: each prompt's text, put before its choices' text."""
        s = self.serving
        copies = _choice_params(params, len(prompts))
        lead = [echo[i // len(copies)] for i in range(len(prompts) * len(copies))] if echo else None
        subs = [s.prepare(prompt, c, prompt_field) for prompt in prompts for c in copies]
        gens = [Generation(s, sub, params.stop, request, params) for sub in subs]
        rid = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        # the request's model name, as SGLang answers (the served name when it sent none)
        model = body.model if body.model is not None else s.options.served_model_name
        head = {"id": rid, "object": obj, "created": created, "model": model}
        if not body.stream:
            outs = await _collect_all(gens)
            if any(g.disconnected for g in gens):  # the client is gone; nobody reads this
                raise ApiError(499, "client disconnected", code="client_closed_request")
            if lead:
                for out, text in zip(outs, lead, strict=True):
                    out.text = text + out.text
            choices = [
                self.choice(out, want_lp, top, 0, stream=False, index=i)
                for i, out in enumerate(outs)
            ]
            return JSONResponse({**head, "choices": choices, "usage": _usage(gens)})
        it = _merged_pieces(gens)
        first = await _first(it)
        opts = body.stream_options
        usage_last = bool(opts and opts.include_usage)
        usage_each = bool(opts and opts.continuous_usage_stats)
        head["object"] = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return StreamingResponse(
            self._events(it, first, head, want_lp, top, usage_last, usage_each, gens, lead),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def _events(self, it, first, head, want_lp, top, usage_last, usage_each, gens, lead):
        offsets = [0] * len(gens)  # text streamed so far, per choice
        lead = list(lead) if lead else None  # echo: each choice's first piece carries it
        try:
            if self.kind == "chat":  # each choice opens with the assistant's role
                for i in range(len(gens)):
                    role = {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield sse({**head, "choices": [role], **self._usage_field(usage_last)})
            item: tuple[int, Piece] | None = first
            while item is not None:
                i, piece = item
                if lead and lead[i]:
                    piece.text, lead[i] = lead[i] + piece.text, ""
                if piece.text or piece.finish_reason is not None or (want_lp and piece.token_ids):
                    choice = self.choice(piece, want_lp, top, offsets[i], True, index=i)
                    chunk = {**head, "choices": [choice]}
                    if usage_each:
                        chunk["usage"] = _usage(gens)
                    elif usage_last:
                        chunk["usage"] = None
                    yield sse(chunk)
                offsets[i] += len(piece.text)
                item = await anext(it, None)
            if usage_last:
                yield sse({**head, "choices": [], "usage": _usage(gens)})
        except ApiError as e:
            yield sse(error_body(e))
        finally:
            await it.aclose()
        yield sse("[DONE]")

    @staticmethod
    def _usage_field(usage_last: bool) -> dict:
        return {"usage": None} if usage_last else {}


SPECIAL_TOKEN_NAMES = ("eos_token", "bos_token", "pad_token", "unk_token")
"""The tokenizer's special tokens ``/tokenizer_info`` reports (their text; None if unset)."""


def openai_router(serving: Serving) -> APIRouter:
    """The OpenAI routes over ``serving``."""
    router = APIRouter()
    completions = _Route(serving, "completion")
    chats = _Route(serving, "chat")

    @router.post("/v1/completions")
    async def create_completion(request: Request):
        body = parse_body(CompletionRequest, await read_json(request))
        serving.check_model(body.model)
        refuse_unsupported(body)
        refuse_sglang_unsupported(body)
        prompts = _completion_prompts(serving, body.prompt)
        lp = body.logprobs
        echo = None
        if body.echo:
            echo = _prompt_texts(serving, body.prompt, prompts)
        params = _params(body, body.max_tokens, "max_tokens", serving.engine.sampling_defaults)
        params.top_logprobs = lp or 0
        params.top_logprobs_field = "logprobs"
        if body.echo and lp is not None:  # the prompt's log-probabilities lead each choice's
            params.prompt_logprobs_from = 0
        return await completions.run(
            request, body, prompts, "prompt", params, lp is not None, lp or 0, echo
        )

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        body = parse_body(ChatCompletionRequest, await read_json(request))
        serving.check_model(body.model)
        refuse_unsupported(body)
        refuse_sglang_unsupported(body)
        serving.require_tokenizer()
        prompt = _chat_prompt(serving, body)
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise ApiError(
                400,
                "top_logprobs needs logprobs: true",
                param="top_logprobs",
                code="invalid_value",
            )
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(
                400,
                "give max_tokens or max_completion_tokens, not both",
                param="max_completion_tokens",
            )
        if body.max_completion_tokens is not None:
            params = _params(
                body,
                body.max_completion_tokens,
                "max_completion_tokens",
                serving.engine.sampling_defaults,
            )
        else:
            params = _params(body, body.max_tokens, "max_tokens", serving.engine.sampling_defaults)
        params.top_logprobs = top
        return await chats.run(request, body, [prompt], "messages", params, body.logprobs, top)

    async def tokenize(request: Request):
        body = parse_body(TokenizeRequest, await read_json(request))
        serving.check_model(body.model)
        serving.require_tokenizer()
        enc = serving.tokenizer.encode
        if isinstance(body.prompt, str):
            tokens = enc(body.prompt, add_special_tokens=body.add_special_tokens)
            count = len(tokens)
        else:
            tokens = [enc(p, add_special_tokens=body.add_special_tokens) for p in body.prompt]
            count = [len(t) for t in tokens]
        return {"tokens": tokens, "count": count, "max_model_len": serving.context_length}

    async def detokenize(request: Request):
        body = parse_body(DetokenizeRequest, await read_json(request))
        serving.check_model(body.model)
        serving.require_tokenizer()
        batch = bool(body.tokens) and isinstance(body.tokens[0], list)
        lists = body.tokens if batch else [body.tokens]
        for ids in lists:
            serving.check_token_ids(ids, "tokens")
        skip = body.skip_special_tokens
        texts = [serving.tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]
        text = texts if batch else texts[0]
        return {"text": text, "prompt": text}  # SGLang's name, then vLLM's

    async def tokenizer_info():
        serving.require_tokenizer()
        tok = serving.tokenizer
        info = {name: getattr(tok, name, None) for name in SPECIAL_TOKEN_NAMES}
        # the template chat requests are rendered with (--chat-template, else the tokenizer's)
        info["chat_template"] = serving.options.chat_template or getattr(tok, "chat_template", None)
        info["model_max_length"] = serving.context_length
        info["tokenizer_class"] = type(tok).__name__
        return info

    for path in ("/v1/tokenize", "/tokenize"):
        router.add_api_route(path, tokenize, methods=["POST"])
    for path in ("/v1/detokenize", "/detokenize"):
        router.add_api_route(path, detokenize, methods=["POST"])
    router.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])

    def model_card() -> dict:
        return {
            "id": serving.options.served_model_name,
            "object": "model",
            "created": int(serving.started),
            "owned_by": "unimem",
            "root": serving.engine.args.model_path,
            "max_model_len": serving.context_length,
        }

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """OpenAI's model retrieval: the served model's card; 404 for another name (a lookup
        of what is served, unlike a request's ``model``, which any name may fill)."""
        if model != serving.options.served_model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return model_card()

    return router


MAX_BATCH_PROMPTS = 256
"""Most prompts one completion request may carry, and most choices (prompts x ``n``) one
request may ask for."""


def _choice_params(params: GenParams, prompts: int) -> list[GenParams]:
    """The parameters of each of ``params.n`` choices of a prompt (``n`` 1 each; choice ``j``
    seeded ``seed + j``); 400 naming ``n`` if it is not an int from 1 or the request would
    run more than :data:`MAX_BATCH_PROMPTS` choices."""
    n = params.n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ApiError(400, f"n must be an int >= 1, got {n!r}", param="n", code="invalid_value")
    if n * prompts > MAX_BATCH_PROMPTS:
        raise ApiError(
            400,
            f"n {n} x {prompts} prompt(s) asks for {n * prompts} choices, at most "
            f"{MAX_BATCH_PROMPTS}",
            param="n",
            code="invalid_value",
        )
    if n == 1:
        return [params]
    seed = params.seed
    return [
        dataclasses.replace(params, n=1, seed=None if seed is None else seed + j) for j in range(n)
    ]


def _sent_prompts(prompt) -> list:
    """The prompts as sent: one (a string or a list of ids) or a batch (a list of strings or
    of id lists), at most :data:`MAX_BATCH_PROMPTS`."""
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (list, str))
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise ApiError(
            400,
            f"prompt: {len(prompts)} prompts in one request, at most {MAX_BATCH_PROMPTS}",
            param="prompt",
            code="invalid_value",
        )
    return prompts


def _completion_prompts(serving: Serving, prompt) -> list[list[int]]:
    """The request's prompts (:func:`_sent_prompts`) as token ids."""
    out = []
    for p in _sent_prompts(prompt):
        if isinstance(p, str):
            serving.require_tokenizer()
            out.append(serving.tokenizer.encode(p))
        else:
            out.append(list(p))
    return out


def _prompt_texts(serving: Serving, prompt, ids: list[list[int]]) -> list[str]:
    """Each prompt's text for ``echo``: as sent, or its token ids (``ids``) decoded."""
    out = []
    for p, toks in zip(_sent_prompts(prompt), ids, strict=True):
        if isinstance(p, str):
            out.append(p)
        else:
            serving.require_tokenizer()
            out.append(serving.tokenizer.decode(toks))
    return out


def _template_arguments(tok) -> set[str]:
    """The named arguments of ``tok.apply_chat_template`` (what ``chat_template_kwargs`` may
    not set: the rest reaches the template as variables)."""
    params = inspect.signature(tok.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}


def _chat_prompt(serving: Serving, body: ChatCompletionRequest) -> list[int]:
    tok = serving.tokenizer
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
    template = serving.options.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise ApiError(
            400,
            "this model has no chat template (a base model): start the server with "
            "--chat-template FILE|NAME (a Jinja file, or one of: "
            f"{', '.join(sorted(KNOWN_TEMPLATES))}), or send the text to /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    extra = body.chat_template_kwargs or {}
    taken = sorted(set(extra) & _template_arguments(tok)) if extra else []
    if taken:
        raise ApiError(
            400,
            f"chat_template_kwargs: {taken[0]!r} is an argument the server sets, not a "
            "template variable",
            param="chat_template_kwargs",
            code="invalid_value",
        )
    try:
        text = tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **extra,
        )
    except Exception as e:  # a template may refuse a conversation (raise_exception)
        raise ApiError(
            400,
            f"messages: the chat template failed: {e}",
            param="messages",
            code="invalid_value",
        ) from None
    return tok.encode(text, add_special_tokens=False)
