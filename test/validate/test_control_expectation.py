"""The acceptance control's accept length as validate reports it: the expectation (closed
form; finite outputs do not change it because the references run gamma tokens past the
output), checked against a simulation of the control's coin flips that counts what the
engine counts (``accepted + 1`` per verify step, before truncation at the output length);
and the replay of the control's own draws for one run against the control's decisions."""

from __future__ import annotations

import random

import pytest
import torch

from unimem.speculative.control import AcceptanceControl
from unimem.validate.protocol import control_draws_accept_length, control_expected_accept_length


def _simulate(rate: float, gamma: int, tokens: int, requests: int, seed: int) -> float:
    """Counted tokens per verify step over ``requests`` requests committing ``tokens`` each,
    every draft position covered by the reference."""
    rng = random.Random(seed)
    counted = steps = 0
    for _ in range(requests):
        left = tokens
        while left > 0:
            accepted = 0  # drafts survive while the coin says "reference"
            while accepted < gamma and rng.random() < rate:
                accepted += 1
            counted += accepted + 1  # + the bonus token, counted even past the end
            left -= min(accepted + 1, left)
            steps += 1
    return counted / steps


@pytest.mark.parametrize(
    "rate, gamma", [(0.8, 7), (0.5, 3), pytest.param(0.95, 4, marks=pytest.mark.slow)]
)
def test_closed_form_matches_a_simulation_for_finite_outputs(rate, gamma):
    want = control_expected_accept_length(rate, gamma)
    assert want == pytest.approx(sum(rate**i for i in range(gamma + 1)))
    for tokens in (5, 199):
        got = _simulate(rate, gamma, tokens, requests=40_000, seed=tokens)
        assert got == pytest.approx(want, rel=0.01)


def test_edges():
    assert control_expected_accept_length(0.0, 7) == 1.0
    assert control_expected_accept_length(1.0, 7) == 8.0


def _by_decisions(control: AcceptanceControl, gamma, references, prompts, output_len):
    """The same walk as ``control_draws_accept_length``, asking the control itself (its
    device-side ``decide``) for every drafted position."""
    steps = counted = 0
    for rid in references:
        done, at = 1, len(prompts[rid]) + 1
        while done < output_len:
            positions = torch.arange(at, at + gamma)
            _, take = control.decide(torch.full_like(positions, rid), positions)
            accepted = 0
            while accepted < gamma and bool(take[accepted]):
                accepted += 1
            steps += 1
            counted += accepted + 1
            done += accepted + 1
            at += accepted + 1
    return counted / steps


@pytest.mark.parametrize("rate, gamma, output_len", [(0.8, 7, 60), (0.5, 3, 41)])
def test_draws_replay_the_controls_decisions(rate, gamma, output_len):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (int(n),), generator=g).tolist() for n in (5, 17, 30, 9)]
    # references as validate builds them: prompt + output, gamma tokens past the output
    references = {
        rid: p + torch.randint(0, 100, (output_len + gamma,), generator=g).tolist()
        for rid, p in enumerate(prompts)
    }
    control = AcceptanceControl(rate, 11, references)
    got = control_draws_accept_length(11, rate, gamma, references, prompts, output_len)
    assert got == _by_decisions(control, gamma, references, prompts, output_len)
    # another seed draws otherwise
    other = control_draws_accept_length(12, rate, gamma, references, prompts, output_len)
    assert other != got
    # rate 1: every draft is accepted where the reference is known — all of them with
    # validate's references, fewer on a last step past the end of shorter ones
    assert control_draws_accept_length(11, 1.0, gamma, references, prompts, output_len) == (
        gamma + 1
    )
    short = {rid: ref[: len(prompts[rid]) + output_len] for rid, ref in references.items()}
    full = control_draws_accept_length(11, 1.0, gamma, short, prompts, output_len)
    assert full == _by_decisions(
        AcceptanceControl(1.0, 11, short), gamma, short, prompts, output_len
    )
    assert 1.0 < full <= gamma + 1
