"""``tools/block_verify_paired.py``'s expectations are the rules' own: given fixed drafts, the
token rule's expected accepted drafts is ``sum_k prod_{j<k} min(1, p/q)`` (checked by a loop),
and the block rule's is the mean of what ``chain_accept_block`` accepts over many seeds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from unimem.speculative import spec_sampling as ss

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "block_verify_paired", ROOT / "tools" / "block_verify_paired.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_expectations_are_the_rules_own():
    tool = _tool()
    g = torch.Generator().manual_seed(2)
    vocab, gamma, lanes = 6, 4, 20_000
    p1 = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 1.5, -1)
    q1 = torch.softmax(torch.randn(gamma, vocab, generator=g) * 1.5, -1)
    draft1 = torch.multinomial(q1, 1, generator=g)[:, 0]  # one fixed draft chain
    p = p1.expand(lanes, -1, -1)
    q = q1.expand(lanes, -1, -1)
    draft = draft1.expand(lanes, -1)
    px = p1[:gamma].gather(1, draft1[:, None])[:, 0][None, :]
    qx = q1.gather(1, draft1[:, None])[:, 0][None, :]

    def rho_of(w):
        return torch.clamp(w[:, :, None] * p1[None, :gamma] - q1[None], min=0).sum(-1)

    token, block = tool.expected_accepts(px, qx, rho_of, torch.tensor([gamma]))
    want, run = 0.0, 1.0
    for k in range(gamma):
        run *= min(1.0, float(px[0, k] / qx[0, k]))
        want += run
    assert abs(float(token[0]) - want) < 1e-6
    seeds = torch.arange(lanes, dtype=torch.int64) * 7919 + 3
    pos = 100 + torch.arange(gamma + 1)[None, :].expand(lanes, -1)
    got = ss.chain_accept_block(draft, q, p, seeds, pos).accepted.double()
    se = float(got.std()) / lanes**0.5
    assert abs(float(got.mean()) - float(block[0])) < 4 * se + 1e-6, (got.mean(), block)
