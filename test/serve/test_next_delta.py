"""A reader that falls behind the engine reads what has queued up as one delta
(``generation.next_delta``): tokens in order, the last finish, errors and disconnects never
swallowed; a reader that keeps up gets every delta on its own."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

from unimem.serve.engine_loop import Delta, Submission
from unimem.serve.generation import Generation, next_delta


def _read_all(items, reads):
    """``reads`` calls of next_delta over a queue holding ``items``."""

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        held: deque = deque()
        return [await next_delta(queue, held) for _ in range(reads)]

    return asyncio.run(run())


def test_queued_deltas_come_as_one():
    items = [
        Delta((1,), (-0.1,)),
        Delta((2, 3), (-0.2, -0.3)),
        Delta((4,), (-0.4,), finish_reason="length", cached_tokens=7),
    ]
    (got,) = _read_all(items, 1)
    assert got == Delta((1, 2, 3, 4), (-0.1, -0.2, -0.3, -0.4), "length", 7)


def test_nothing_is_joined_past_a_finish_an_error_or_a_disconnect():
    error = Delta(finish_reason="abort", error="engine fault", status=503)
    got = _read_all([Delta((1,), (-0.1,)), Delta((2,), (-0.2,)), error], 2)
    assert got == [Delta((1, 2), (-0.1, -0.2)), error]  # the tokens first, the error intact
    got = _read_all([Delta((1,), (-0.1,)), None, Delta((2,), (-0.2,))], 2)
    assert got == [Delta((1,), (-0.1,)), None]
    done = Delta((1,), (-0.1,), finish_reason="stop")
    assert _read_all([done, Delta((9,), (-0.9,))], 1) == [done]


def test_a_reader_that_keeps_up_gets_each_delta():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        held: deque = deque()
        got = []
        for i in range(3):
            asyncio.get_running_loop().call_later(0.01, queue.put_nowait, Delta((i,), (0.0,)))
            got.append(await next_delta(queue, held))  # waits: nothing queued yet
        return got

    assert asyncio.run(run()) == [Delta((i,), (0.0,)) for i in range(3)]


class BurstLoop:
    """Sinks ``bursts`` of deltas: each burst at once (an engine ahead of its reader), the
    next after the reader had a turn."""

    alive = True
    stream_interval = 1

    def __init__(self, bursts):
        self.bursts = bursts

    def submit(self, sub: Submission) -> str:
        aloop = asyncio.get_running_loop()
        for i, burst in enumerate(self.bursts):
            aloop.call_later(0.01 * (i + 1), lambda b=burst: [sub.sink(d) for d in b])
        return "handle"

    def abort(self, handle, report_as=None) -> None:
        raise AssertionError("nothing to abort")


def test_a_generation_streams_one_piece_a_burst():
    bursts = [
        [Delta((1,), (-0.1,)), Delta((2,), (-0.2,)), Delta((3,), (-0.3,))],
        [Delta((4,), (-0.4,))],
        [Delta((5,), (-0.5,)), Delta((6,), (-0.6,), finish_reason="length")],
    ]
    serving = SimpleNamespace(tokenizer=None, loop=BurstLoop(bursts), draining=False)
    sub = Submission(prompt=[2, 3], max_new_tokens=6, stop_token_ids=frozenset(), sampling=None,
                     sink=lambda d: None)  # fmt: skip
    gen = Generation(serving, sub, (), None)

    async def run():
        return [piece async for piece in gen.pieces()]

    pieces = asyncio.run(run())
    assert [p.token_ids for p in pieces] == [[1, 2, 3], [4], [5, 6]]
    assert [p.logprobs for p in pieces][0] == [-0.1, -0.2, -0.3]
    assert pieces[-1].finish_reason == "length" and gen.completion_tokens == 6
