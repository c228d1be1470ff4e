"""Prompt files for drafter training and evaluation.

Two formats, by extension:

* ``.jsonl``: one JSON value per line — a string (the prompt), or an object with the prompt
  under ``"text"`` or ``"prompt"`` and optionally ``"split"`` (e.g. ``"train"`` /
  ``"heldout"``);
* anything else: plain text, one prompt per non-empty line (``\\n`` written as the two
  characters backslash-n stands for a newline inside a prompt).

:func:`read_prompts` with ``split`` keeps the entries of that split only; a file without
splits has none, so asking for one is an error (a held-out set must be named, never
guessed). :func:`prompt_texts` adds the package's own short real prompts under the name
``"short"``.
"""

from __future__ import annotations

import json
import os

__all__ = ["prompt_texts", "read_prompts"]


def read_prompts(path: str | os.PathLike, split: str | None = None) -> list[str]:
    """The prompts of ``path`` (module docstring). ``ValueError`` naming the file and line
    for a malformed entry, a missing split, or no prompts at all."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"prompt file {path}: {e.strerror}") from None
    out: list[str] = []
    has_splits = False
    if path.endswith(".jsonl"):
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt file {path}, line {n}: not JSON ({e.msg})") from None
            entry_split = None
            if isinstance(entry, dict):
                text = entry.get("text", entry.get("prompt"))
                entry_split = entry.get("split")
                has_splits = has_splits or entry_split is not None
            else:
                text = entry
            if not isinstance(text, str) or not text:
                raise ValueError(f"prompt file {path}, line {n}: no prompt text")
            if split is None or entry_split == split:
                out.append(text)
    else:
        out = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if split is not None and not has_splits:
        raise ValueError(f"prompt file {path}: has no splits, cannot select split {split!r}")
    if not out:
        what = f" of split {split!r}" if split is not None else ""
        raise ValueError(f"prompt file {path}: no prompts{what}")
    return out


def prompt_texts(spec: str, split: str | None = None) -> list[str]:
    """``"short"``: the package's short real prompts (:func:`unimem.data.prompts.
    short_prompts`; ``split`` ignored); otherwise the prompt file ``spec``
    (:func:`read_prompts` with ``split``)."""
    if spec == "short":
        from unimem.data.prompts import short_prompts

        return short_prompts()
    return read_prompts(spec, split)
