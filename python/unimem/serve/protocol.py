"""Request bodies of the OpenAI routes and SGLang's ``/generate`` (pydantic).

Unknown fields are refused (``extra="forbid"``: OpenAI answers "Unrecognized request argument
supplied"), so a parameter a client relies on is never silently ignored. Fields OpenAI has
and unimem does not implement are declared and refused with a 400 naming them when set to a
non-default value (:func:`refuse_unsupported`). SGLang's extensions to the OpenAI bodies
(``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``) are accepted, as SGLang and vLLM do,
and so are the fields SGLang's router adds to every request it forwards
(:mod:`unimem.serve.sglang_fields`). A bad body is an :class:`~unimem.serve.errors.ApiError`
(re-exported here with :func:`~unimem.serve.errors.error_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from unimem.serve.errors import DEFAULT_CODES, ApiError, error_body
from unimem.serve.sglang_fields import (
    SGLangChatFields,
    SGLangCompletionFields,
    SGLangGenerateFields,
)

__all__ = [
    "ApiError",
    "DEFAULT_CODES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerateRequest",
    "StreamOptions",
    "TokenizeRequest",
    "check_unicode",
    "error_body",
    "parse_body",
    "refuse_unsupported",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(_Body):
    """What the OpenAI routes share: sampling, stopping, streaming, the penalties
    (``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` in (0,
    2], SGLang's and vLLM's), ``logit_bias`` (token id, as a string, -> bias in [-100, 100])
    and ``min_tokens`` (vLLM's and SGLang's: stop tokens suppressed until the output has that
    many), SGLang's ``regex`` / ``ebnf`` (structured output, :mod:`unimem.serve.structured`),
    and the OpenAI fields unimem refuses when set (:func:`refuse_unsupported`)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_SamplingFields, SGLangCompletionFields):
    """``POST /v1/completions``. ``prompt``: a string or a list of token ids, or a batch of
    either (a list of them: a choice per prompt). ``logprobs``: k in 0 .. 20 (the chosen
    token's log-probability and the k most likely tokens at its position). ``echo``:
    each choice's text starts with its prompt; with ``logprobs``, so do its log-probabilities
    (the prompt's tokens scored by the model, the first one None: what lm-eval's
    log-likelihood tasks read)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    json_schema: str | None = None


class ChatCompletionRequest(_SamplingFields, SGLangChatFields):
    """``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template.
    ``max_completion_tokens`` is ``max_tokens``' newer name. ``logprobs`` with
    ``top_logprobs`` 0 .. 20."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    """SGLang's ``POST /v1/tokenize``: ``prompt`` a string or a list of them."""

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """SGLang's ``POST /v1/detokenize``: ``tokens`` a list of ids or a list of such lists."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class GenerateRequest(_Body, SGLangGenerateFields):
    """SGLang's ``POST /generate``: ``text`` (a string or a list of them) or ``input_ids``
    (a list of ids or a list of such lists), ``sampling_params`` (SGLang's names),
    ``stream``, ``return_logprob`` with ``logprob_start_len`` (-1: the output tokens only; a
    prompt position: the prompt's tokens from there too, ``meta_info.input_token_logprobs``)
    and ``top_logprobs_num`` (0 .. 20, output and scored prompt positions), ``rid``
    (ignored beyond being echoed)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: str | None = None


UNSUPPORTED_FIELDS = {
    "suffix": "",
    "best_of": 1,
    "tools": [],
    "tool_choice": "none",
    "parallel_tool_calls": None,
}
"""OpenAI fields unimem does not implement, and the neutral value each may still take."""


def refuse_unsupported(body: BaseModel) -> None:
    """400 naming the first field set to something unimem does not implement
    (``parallel_tool_calls`` means nothing without ``tools``: any value passes then)."""
    for name, neutral in UNSUPPORTED_FIELDS.items():
        value = getattr(body, name, None)
        if name == "parallel_tool_calls" and not getattr(body, "tools", None):
            continue
        if value is not None and value != neutral:
            raise ApiError(
                400,
                f"{name} is not supported by this server",
                param=name,
                code="unsupported_parameter",
            )


def check_unicode(data: Any) -> None:
    """400 naming the field and the position of the first string in a decoded JSON body that
    is not valid Unicode (a lone surrogate such as ``"\\ud800"``: JSON can spell it, UTF-8
    and the tokenizer cannot). Iterative: any nesting depth the JSON decoder accepted."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        where, item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(
                    400,
                    f"{where or 'body'}: invalid Unicode at position {e.start}: lone "
                    f"surrogate U+{ord(item[e.start]):04X}",
                    param=where or None,
                    code="invalid_unicode",
                ) from None
        elif isinstance(item, dict):
            for key, value in reversed(item.items()):
                name = f"{where}.{key}" if where else str(key)
                todo.append((name, value))
                todo.append((where, key))
        elif isinstance(item, list):
            for i in reversed(range(len(item))):
                todo.append((f"{where}.{i}" if where else str(i), item[i]))


def parse_body(model: type[BaseModel], data: Any) -> BaseModel:
    """Validate a decoded JSON body; an :class:`ApiError` 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise ApiError(
                400,
                f"Unrecognized request argument supplied: {loc}",
                param=loc,
                code="unrecognized_argument",
            ) from None
        raise ApiError(400, f"{loc}: {first['msg']}", param=param, code="invalid_value") from None
