"""The serving tests reuse the tiny checkpoint builders of ``test/models``."""

import sys
from pathlib import Path

MODELS = str(Path(__file__).resolve().parents[1] / "models")
if MODELS not in sys.path:
    sys.path.insert(0, MODELS)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def small_engine(tmp_path_factory):
    """A tiny Qwen3-Next engine on static pools far below its context (256 tokens): 96 FULL
    tokens, 4 running requests, pages of 4, float32 on the CPU."""
    import tiny_qwen3_next
    import tiny_tokenizer

    import unimem

    path = tmp_path_factory.mktemp("tiny_qwen3_next_small")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    eng = unimem.Engine(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=96,
        max_running_requests=4,
    )
    yield eng
    eng.shutdown()
