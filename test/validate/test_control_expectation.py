"""The acceptance control's expected accept length (what validate compares against on the
GPU): the closed form for unbounded outputs, the recursion for a finite output, and both
against a simulation of the control's coin flips."""

from __future__ import annotations

import random

import pytest

from unimem.validate.protocol import control_expected_accept_length


def _simulate(rate: float, gamma: int, tokens: int, requests: int, seed: int) -> float:
    rng = random.Random(seed)
    committed = steps = 0
    for _ in range(requests):
        left = tokens
        while left > 0:
            k = 1  # the bonus token; drafts survive while the coin says "reference"
            while k <= gamma and rng.random() < rate:
                k += 1
            left -= min(k, left)
            steps += 1
        committed += tokens
    return committed / steps


@pytest.mark.parametrize("rate, gamma", [(0.8, 7), (0.5, 3), (0.95, 4)])
def test_closed_form_and_recursion_match_a_simulation(rate, gamma):
    unbounded = control_expected_accept_length(rate, gamma)
    assert unbounded == pytest.approx(sum(rate**i for i in range(gamma + 1)))
    long = control_expected_accept_length(rate, gamma, 20_000)
    assert long == pytest.approx(unbounded, rel=1e-3)
    for tokens in (5, 199):
        want = control_expected_accept_length(rate, gamma, tokens)
        assert want < unbounded
        got = _simulate(rate, gamma, tokens, requests=40_000, seed=tokens)
        assert got == pytest.approx(want, rel=0.01)


def test_edges():
    assert control_expected_accept_length(0.8, 7, 1) == 1.0
    assert control_expected_accept_length(0.0, 7, 50) == 1.0
    with pytest.raises(ValueError, match="tokens"):
        control_expected_accept_length(0.8, 7, 0)
