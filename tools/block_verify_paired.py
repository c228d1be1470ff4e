"""Block against token verification of sampled DSPARK, read on the same verify steps.

Runs the Engine with block verification (``--speculative-sampling-verify block``) on the
package's short prompts and, at every sampled verify step, takes the exact expected number of
accepted drafts under both rules *given that step's drafts*: token verification
``sum_k prod_{j<k} min(1, p_j / q_j)``, block verification ``sum_i i P(tau = i)`` with
``P(tau = i) = h_i prod_{j>i} (1 - h_j)`` from the step's own stop probabilities
(:func:`unimem.speculative.spec_sampling.block_stop_probabilities`). Both rules are exact, so
the states a run visits are the target's text either way; reading both on the same states
removes what makes two separate runs hard to compare (a request's sampled text moves its
accept length far more than the rule does). Also reports the block run's realised tokens a
step (a check: it should match the block expectation).

    python tools/block_verify_paired.py --model-path gemma-3-270m --requests 32 \\
        --tokens 128 --temperature 0.7 --json OUT.json

CPU: ~7 minutes for 32 requests x 128 tokens on 2 cores (the reference attention).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def expected_accepts(
    px: torch.Tensor, qx: torch.Tensor, rho_of, end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token [bs], block [bs])`` float64: the expected accepted drafts of each lane under
    both rules, given its drafts (``px``, ``qx [bs, gamma]``), its residual masses
    (``rho_of(w [bs, gamma]) -> [bs, gamma]``) and chain ends ``end [bs]``."""
    from unimem.speculative import spec_sampling as ss

    bs, gamma = px.shape
    w = ss.block_weights(px, qx, end)
    h = ss.block_stop_probabilities(w, rho_of(w[:, :gamma]), end).double()
    survive = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])  # prod_{j >= i}
    after = torch.cat([survive[:, 1:], torch.ones(bs, 1, dtype=h.dtype)], 1)  # prod_{j > i}
    block = (h * after * torch.arange(gamma + 1, dtype=h.dtype)).sum(1)
    ratio = torch.clamp(px.double() / qx.double(), max=1.0)
    ratio = torch.where(torch.arange(gamma)[None, :] < end[:, None], ratio, 0.0)
    token = torch.cumprod(ratio, 1).sum(1)
    return token, block


def main(argv: list[str] | None = None) -> int:
    from unimem.data.prompts import short_prompts
    from unimem.engine.api import Engine
    from unimem.speculative import spec_sampling as ss

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="gemma-3-270m")
    ap.add_argument("--drafter", default=None, help="default: the model's shipped drafter")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-offset", type=int, default=0, help="first short prompt used")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1000, help="request i samples with seed + i")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    sums = {"token": 0.0, "block": 0.0, "realised": 0.0, "lanes": 0}
    real = ss.chain_accept_block_rows

    def observed(draft, qx, px, residual_mass, last_draw, seeds, positions, limit=None):
        bs, gamma = draft.shape
        end = torch.full((bs,), gamma, device=draft.device) if limit is None else limit.long()
        token, block = expected_accepts(px, qx, residual_mass, end)
        res = real(draft, qx, px, residual_mass, last_draw, seeds, positions, limit)
        sums["token"] += float(token.sum())
        sums["block"] += float(block.sum())
        sums["realised"] += float(res.accepted.double().sum())
        sums["lanes"] += bs
        return res

    ss.chain_accept_block_rows = observed  # the verify step looks it up at call time
    t0 = time.time()
    engine = Engine(
        model_path=args.model_path,
        device=args.device,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=args.drafter,
        speculative_sampling_verify="block",
        max_running_requests=args.requests,
    )
    prompts = short_prompts()[args.prompt_offset : args.prompt_offset + args.requests]
    params = [
        {"temperature": args.temperature, "max_new_tokens": args.tokens, "ignore_eos": True,
         "seed": args.seed + i}
        for i in range(len(prompts))
    ]  # fmt: skip
    engine.generate(prompt=prompts, sampling_params=params)
    lanes = max(sums["lanes"], 1)
    out = {
        "model_path": args.model_path,
        "drafter": engine.drafter_path,
        "requests": len(prompts),
        "prompt_offset": args.prompt_offset,
        "tokens": args.tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "lane_steps": sums["lanes"],
        "token_tokens_per_step": 1 + sums["token"] / lanes,
        "block_tokens_per_step": 1 + sums["block"] / lanes,
        "block_realised_tokens_per_step": 1 + sums["realised"] / lanes,
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
