"""``Request.append_token`` (a decode step's accounting) is ``append_output`` of one token:
the same output, log-probabilities and finish state, token by token, through stop tokens, the
``max_new_tokens`` cap and an abort."""

from __future__ import annotations

import random

from unimem.engine.request import Request


def test_append_token_is_append_output_of_one_token():
    rng = random.Random(3)
    for trial in range(200):
        stops = frozenset(rng.sample(range(12), rng.randint(0, 2)))
        a = Request(trial, [1, 2], rng.randint(1, 6), stop_token_ids=stops)
        b = Request(trial, [1, 2], a.max_new_tokens, stop_token_ids=stops)
        abort_at = rng.randint(0, 10)
        for step in range(10):
            if step == abort_at:
                a.aborted = b.aborted = True
            tok, lp = rng.randrange(12), rng.random()
            with_lp = rng.random() < 0.5
            a.append_output([tok], [lp] if with_lp else None)
            b.append_token(tok, lp if with_lp else None)
            assert (a.output, a.output_logprobs, a.stopped) == (
                b.output,
                b.output_logprobs,
                b.stopped,
            )
            assert a.finish_reason == b.finish_reason
