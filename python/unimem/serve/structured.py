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

from unimem.engine.grammar import GrammarSpec
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
    name = (lambda key: f"{where}.{key}") if where else (lambda key: key)
    found: list[tuple[GrammarSpec, str]] = []
    for key, value in fields.items():
        if value is None:
            continue
        if key == "response_format":
            spec = _response_format(value, name(key))
            if spec is not None:
                found.append((spec, name(key)))
            continue
        if not isinstance(value, str):
            raise _bad(name(key), f"must be a string, got {type(value).__name__}")
        try:
            found.append((GrammarSpec(key, value), name(key)))
        except ValueError as e:
            raise _bad(name(key), str(e)) from None
    if len(found) > 1:
        names = " and ".join(f for _, f in found)
        raise ApiError(400, f"{names} both constrain the output: set one", param=found[1][1])
    return found[0] if found else (None, "")
