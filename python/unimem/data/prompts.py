"""Real prompts, the same on every machine that runs the same Python.

* :func:`short_prompts`: the prompts of ``prompts.json`` (package data) — short, hand-written
  prose, code, dialogue and lists, in a fixed order (``kind`` selects one kind).
* :func:`long_prompts`: long prompts without shipping long text: leading parts of Python
  standard-library source files (:data:`LONG_SOURCES`, read at run time from the running
  interpreter's library), each cut at a line end once it reaches ``min_tokens`` tokens under
  the given tokenizer (or ``min_chars`` characters without one). Which files, and so the text,
  depend on the Python version: compare runs on one machine, not across machines.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from functools import cache
from importlib.resources import files
from pathlib import Path

__all__ = ["LONG_SOURCES", "long_prompts", "short_prompts"]

KINDS = ("prose", "code", "dialogue", "list")

LONG_SOURCES = (
    "textwrap.py",
    "difflib.py",
    "fractions.py",
    "calendar.py",
    "argparse.py",
    "heapq.py",
    "json/decoder.py",
    "string.py",
)
"""Standard-library files (relative to the stdlib directory) that long prompts come from,
in order."""


@cache
def _entries() -> tuple[tuple[str, str], ...]:
    data = json.loads(files("unimem.data").joinpath("prompts.json").read_text("utf-8"))
    return tuple((p["kind"], p["text"]) for p in data["prompts"])


def short_prompts(kind: str | None = None) -> list[str]:
    """The short prompts (all, or those of ``kind``: prose, code, dialogue, list)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return [text for k, text in _entries() if kind is None or k == kind]


def long_prompts(
    count: int = 4,
    min_tokens: int = 1500,
    encode: Callable[[str], list[int]] | None = None,
    min_chars: int = 6000,
) -> list[str]:
    """``count`` long prompts (module docstring): with ``encode`` (text -> token ids), each
    has at least ``min_tokens`` tokens; without it, at least ``min_chars`` characters.
    ``ValueError`` if the standard library does not have enough files long enough."""
    if count > len(LONG_SOURCES):
        raise ValueError(f"at most {len(LONG_SOURCES)} long prompts, asked for {count}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in LONG_SOURCES:
        path = stdlib / name
        if not path.is_file():
            continue
        lines = path.read_text("utf-8").splitlines(keepends=True)
        text = _prefix(lines, min_tokens, encode, min_chars)
        if text is not None:
            out.append(text)
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} of {count} long prompts found under {stdlib}")


def _prefix(lines, min_tokens, encode, min_chars) -> str | None:
    """The shortest run of leading ``lines`` (in steps of 20 lines) long enough, or None."""
    n = 0
    while n < len(lines):
        n = min(n + 20, len(lines))
        text = "".join(lines[:n])
        if len(text) < min_chars:
            continue
        if encode is None or len(encode(text)) >= min_tokens:
            return text
    return None
