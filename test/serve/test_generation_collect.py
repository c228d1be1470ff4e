"""A whole-body (not streamed) response asks the engine loop for its deltas
``WHOLE_RESPONSE_INTERVAL`` tokens at a time, unless stop strings need the text as it comes;
the loop's own interval wins when larger."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from unimem.serve.engine_loop import Delta, Submission
from unimem.serve.generation import WHOLE_RESPONSE_INTERVAL, Generation


class OneDeltaLoop:
    """Answers every submission with one finished delta; keeps the submission."""

    alive = True

    def __init__(self, stream_interval: int) -> None:
        self.stream_interval = stream_interval
        self.sub: Submission | None = None

    def submit(self, sub: Submission) -> str:
        self.sub = sub
        sub.sink(Delta(tokens=(5, 6), logprobs=(-0.5, -1.0), finish_reason="length"))
        return "handle"

    def abort(self, handle, report_as=None) -> None:
        raise AssertionError("nothing to abort")


@pytest.mark.parametrize(
    "stops, loop_interval, want",
    [((), 1, WHOLE_RESPONSE_INTERVAL), (("x",), 1, None), ((), 80, 80)],
)
def test_collect_asks_for_fewer_deltas(stops, loop_interval, want):
    loop = OneDeltaLoop(loop_interval)
    serving = SimpleNamespace(tokenizer=None, loop=loop, draining=False)
    sub = Submission(prompt=[2, 3], max_new_tokens=2, stop_token_ids=frozenset(), sampling=None,
                     sink=lambda d: None)  # fmt: skip
    out = asyncio.run(Generation(serving, sub, stops, None).collect())
    assert out.token_ids == [5, 6] and out.finish_reason == "length"
    assert loop.sub.stream_interval == want
