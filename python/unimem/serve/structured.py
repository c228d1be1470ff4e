"""Structured-output fields of a request, as OpenAI and SGLang spell them, turned into one
:class:`~unimem.engine.grammar.GrammarSpec` (the engine side: :mod:`unimem.engine.grammar`).

- ``response_format`` (OpenAI; chat and, as SGLang takes it, completions): ``{"type":
  "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON value), ``{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- ``json_schema`` (SGLang: a completion's field and ``/generate``'s sampling parameter; a JSON
  schema's text), ``regex``, ``ebnf`` (SGLang: chat, completions, ``/generate``).

At most one may constrain a request; anything else is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from unimem.engine.grammar import GrammarFieldError, GrammarSpec
from unimem.engine.grammar import grammar_of_fields as engine_grammar_of_fields
from unimem.serve.errors import ApiError

__all__ = ["grammar_of_fields"]


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", param=field, code="invalid_value")


def _response_format(fmt: Any, field: str) -> GrammarSpec | None:
    if not isinstance(fmt, Mapping):
        raise _bad(field, "must be an object with a 'type'")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise ApiError(
            400,
            f"{field}: type {kind!r} is not supported (text, json_object or json_schema)",
            param=field,
            code="unsupported_value",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping):
        raise _bad(f"{field}.json_schema", "must be an object holding 'schema'")
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, (Mapping, bool)):
        raise _bad(f"{field}.json_schema.schema", "must be a JSON schema (an object)")
    return GrammarSpec("json_schema", json.dumps(schema))


def grammar_of_fields(fields: Mapping[str, Any], where: str = "") -> tuple[GrammarSpec | None, str]:
    """The grammar that ``fields`` (request field -> value; None: unset) ask for and the name
    of the field that set it (``where`` prefixes it, e.g. ``sampling_params``); ``(None,
    "")`` when none does. 400 naming the field for two at once or a malformed one."""
    fields = dict(fields)
    if fields.get("response_format") is not None:
        name = f"{where}.response_format" if where else "response_format"
        fields["response_format"] = _response_format(fields["response_format"], name)
    try:
        return engine_grammar_of_fields(fields, where)
    except GrammarFieldError as e:
        raise ApiError(400, str(e), param=e.field, code="invalid_value") from None
