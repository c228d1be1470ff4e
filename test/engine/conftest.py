"""Fixtures shared by the engine tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import tiny_gemma3  # noqa: E402


@pytest.fixture(scope="session")
def gemma2_ckpt(tmp_path_factory):
    """A tiny random Gemma 3 checkpoint of two layers, one sliding-window and one full
    attention (no tokenizer: the tests pass token ids). Read-only for its users."""
    path = tmp_path_factory.mktemp("gemma2")
    tiny_gemma3.build(path, num_hidden_layers=2,
                      layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return path
