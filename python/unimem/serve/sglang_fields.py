"""SGLang's extra request fields, as ``sglang-router`` / ``smg`` forward them to a worker.

The router re-serialises every request it routes through SGLang's request types, so fields a
client never sent arrive set to SGLang's defaults (``no_stop_trim: false``,
``skip_special_tokens: true``, ...). A unimem server therefore accepts every field the router
always sends, and for each one either honours it or accepts only its neutral value:

================================  ============  ==============================================
field (route)                     status        meaning here
================================  ============  ==============================================
``no_stop_trim`` (OpenAI)         honoured      keep the matched stop string / stop token's
                                                text at the end of the output
``skip_special_tokens`` (OpenAI)  honoured      False: special tokens' text stays in the output
``continue_final_message`` (chat) honoured      the last (assistant) message is continued: no
                                                generation prompt is added after it
``chat_template_kwargs`` (chat)   honoured      more variables for the chat template (e.g.
                                                ``enable_thinking``); one that names an
                                                argument the server sets is refused (400)
``separate_reasoning``,           ignored       no reasoning parser: the whole output is
``stream_reasoning`` (chat)                     ``content``, nothing is split out
``return_hidden_states``          neutral only  ``true`` is refused (400)
``model`` (/generate)             honoured      checked like the OpenAI routes' ``model``
``return_text_in_logprobs``       honoured      the token's text in ``output_token_logprobs``
(/generate)
``log_metrics``, ``no_logs``      ignored       every request is counted in ``/metrics``; no
(/generate)                                     request is logged
``background``, ``return_bytes``, neutral only  ``true`` is refused (400)
``return_entropy`` (/generate)
================================  ============  ==============================================

Fields the router forwards only when the client set them are honoured where unimem implements
them (``min_tokens``, ``logit_bias``, ``regex``, ``ebnf``, ``json_schema``: see
``protocol.py``, :mod:`unimem.serve.structured`); the others (``lora_path``, ...) stay
unrecognised: a 400 names them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from unimem.serve.errors import ApiError

__all__ = [
    "SGLangChatFields",
    "SGLangCompletionFields",
    "SGLangGenerateFields",
    "refuse_sglang_unsupported",
]


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SGLangCompletionFields(_Fields):
    """What the router adds to ``POST /v1/completions``."""

    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False


class SGLangChatFields(SGLangCompletionFields):
    """What the router adds to ``POST /v1/chat/completions``."""

    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class SGLangGenerateFields(_Fields):
    """What the router adds to ``POST /generate``."""

    model: str | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


_NEUTRAL_ONLY = ("return_hidden_states", "background", "return_bytes", "return_entropy")


def refuse_sglang_unsupported(body: BaseModel) -> None:
    """400 naming the first SGLang field set to a value unimem cannot honour."""
    for name in _NEUTRAL_ONLY:
        if getattr(body, name, False):
            raise ApiError(
                400,
                f"{name} is not supported by this server",
                param=name,
                code="unsupported_parameter",
            )
