"""Fixtures shared by the speculative-decoding tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import tiny_gemma3  # noqa: E402
import tiny_tokenizer  # noqa: E402

from unimem.models.loader import load_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """``(path, model)``: a tiny random Gemma 3 checkpoint (vocabulary 500, 512 positions)
    with its word-level tokenizer, and the model loaded in float32 on the CPU. Read-only for
    its users; one per test module."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-gemma"
    tiny_gemma3.build(path, max_position_embeddings=512)
    tiny_tokenizer.save(path, 500)
    return path, load_checkpoint(path, dtype="float32").model
