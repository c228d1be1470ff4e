"""Greedy acceptance: longest matching prefix of the drafts plus the target's bonus token."""

from __future__ import annotations

import pytest
import torch

from unimem.speculative.accept import greedy_accept


def _naive(draft: list[int], target: list[int]) -> tuple[int, int]:
    k = 0
    while k < len(draft) and draft[k] == target[k]:
        k += 1
    return k, target[k]


def test_prefix_and_bonus_by_case():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor(
        [
            [5, 6, 7],  # all accepted: bonus is the target's last token
            [1, 6, 7],  # first rejected, later matches do not count
            [5, 6, 0],  # two accepted
            [5, 0, 7],  # one accepted
        ]
    )
    accepted, bonus = greedy_accept(draft, target)
    assert accepted.dtype == torch.int32
    assert accepted.tolist() == [3, 0, 2, 1]
    assert bonus.tolist() == [8, 5, 7, 6]


@pytest.mark.parametrize("gamma", [1, 2, 7])
def test_matches_a_naive_loop(gamma):
    g = torch.Generator().manual_seed(gamma)
    bs = 64
    target = torch.randint(0, 3, (bs, gamma + 1), generator=g)
    # drafts mostly copy the target so that long prefixes occur
    noise = torch.randint(0, 3, (bs, gamma), generator=g)
    keep = torch.rand(bs, gamma, generator=g) < 0.7
    draft = torch.where(keep, target[:, :gamma], noise).to(torch.int32)
    accepted, bonus = greedy_accept(draft, target)
    for b in range(bs):
        k, tok = _naive(draft[b].tolist(), target[b].tolist())
        assert (accepted[b].item(), bonus[b].item()) == (k, tok)


def test_rows_are_independent_of_the_batch():
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 2, (16, 5), generator=g)
    draft = torch.randint(0, 2, (16, 4), generator=g)
    whole = greedy_accept(draft, target)
    perm = torch.randperm(16, generator=g)
    permuted = greedy_accept(draft[perm], target[perm])
    assert torch.equal(permuted.accepted, whole.accepted[perm])
    assert torch.equal(permuted.bonus, whole.bonus[perm])


def test_shape_errors():
    with pytest.raises(ValueError, match="target_argmax must be"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="need draft"):
        greedy_accept(torch.zeros(3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
