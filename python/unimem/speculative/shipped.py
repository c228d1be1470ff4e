"""Drafters shipped with the package, used by default for the models they were trained for.

``unimem/data/drafters/<key>/`` holds a drafter checkpoint (:mod:`.checkpoint`) for the model
whose name reduces to ``<key>`` (:func:`model_key`: the last path component, lower case,
without a ``.gguf`` extension or a quantisation suffix such as ``-q4_k_m``): a model given
as ``gemma-3-270m``, ``/models/gemma-3-270m`` or ``.../gemma-3-270m-q4_k_m.gguf`` finds
``data/drafters/gemma-3-270m/``. Each directory's ``training.json`` records the command that
produced it.

:func:`shipped_drafter` returns that directory only if its drafter fits the loaded target
(same vocabulary and width, layers in range): a different model that happens to share the
name keeps the seeded drafter rather than failing. An explicit
``speculative_draft_model_path`` always wins (the callers check it first).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from unimem.models.base import CausalLM
from unimem.speculative.checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_fits, read_config

__all__ = ["DRAFTERS_DIR", "model_key", "shipped_drafter", "untrained_drafter_warning"]

DRAFTERS_DIR = Path(__file__).resolve().parents[1] / "data" / "drafters"
"""Where the shipped drafters live (inside the package)."""

_QUANT = re.compile(r"[-_.](i?q\d(_[a-z0-9]+)*|f16|bf16|f32|fp16|fp8)$")


def model_key(model_path: str | os.PathLike) -> str:
    """The shipped-drafter key of a model path or name (module docstring)."""
    name = Path(os.fspath(model_path).rstrip("/\\")).name.lower()
    name = name.removesuffix(".gguf")
    return _QUANT.sub("", name)


def shipped_drafter(
    model_path: str | os.PathLike | None,
    target: CausalLM,
    root: str | os.PathLike | None = None,
) -> Path | None:
    """The shipped drafter directory for ``model_path`` under ``root`` (default
    :data:`DRAFTERS_DIR`) if there is one and it fits ``target``; else None."""
    if model_path is None:
        return None
    key = model_key(model_path)
    if not key:
        return None
    path = Path(root if root is not None else DRAFTERS_DIR) / key
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        return None
    try:
        check_fits(read_config(path), target)
    except ValueError:
        return None
    return path


def untrained_drafter_warning(gamma: int) -> str:
    """What DSPARK with no trained drafter costs, said once at start-up by whoever builds the
    engine (it falls back to a seeded, untrained drafter when neither a drafter path nor a
    shipped drafter is there)."""
    return (
        "DSPARK without a trained drafter (no --speculative-draft-model-path, and none shipped "
        "for this model): the drafter is UNTRAINED (random weights) and nearly every draft is "
        "rejected (accept length about 1 token per step), so each step pays the drafter and a "
        f"{gamma + 1}-token verify for one token: slower than serving without DSPARK. Train a "
        "drafter (python -m unimem.training.train_drafter) and pass "
        "--speculative-draft-model-path, or leave --speculative-algorithm out."
    )
