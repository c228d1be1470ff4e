"""How far can a *block* drafter go under speculative sampling? The ceiling, measured on the
target itself (CPU, Gemma 3 270M; issue 41's temperature-0.7 goal).

A DSPARK drafter proposes all ``gamma`` tokens of a step from one pass: column ``j``'s
distribution ``q_j`` may depend on the context (and, through the rank-16 Markov bias, a
little on the previous draft) but not on the drafts sampled before it. The best such ``q_j``
is the target's own *marginal* over the prefixes it cannot see, ``m_j = E_{x_<j ~ p}[p_j(. |
x_<j)]`` — a perfect block drafter. Under chain speculative sampling it commits

    1 + sum_{k=1..gamma} P(accept >= k),  P(accept >= k) = E_{x ~ p}[prod_{j<=k} min(1,
    m_j(x_j) / p_j(x_j | x_<j))]

tokens a step (``unimem.training.sampled_accept``'s estimator, with ``q = m``). A drafter
that conditions each column on the sampled drafts before it (an autoregressive one, as EAGLE
drafts) can reach ``q_j = p_j``: ``gamma + 1``.

Method: ``--contexts`` of the package's short real prompts, each continued ``--context-tokens``
tokens by the target at ``--temperature`` (so the anchor sits mid-text), then ``--chains``
continuations of ``gamma`` tokens of each context sampled by the target (the engine, one seed
each); one teacher-forced forward of every context + chain gives ``p_j(. | x_<j)`` for every
column (full vocabulary, tempered). The marginal at a chain's own token is the mean of the
*other* chains' probabilities of it (leave-one-out: unbiased for ``m_j``; ``min(1, .)`` makes
the estimate a slight underestimate, shrinking as chains grow — reported at 8, 16, 32 and all
chains). Column 0's marginal is exact (every chain shares its prefix), so its factor is 1.

Also reported per column: ``alpha_j = E[sum_v min(p_j, m_j)]`` (the same leave-one-out), to
compare with a trained drafter's per-column ``alpha`` (``sampled_accept``'s). ~15 min on 2
cores for the defaults.

    python tools/block_draft_ceiling_cpu.py --json docs/results/block_draft_ceiling_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from unimem.engine.api import Engine
from unimem.training.draft_data import text_continuations
from unimem.training.prompt_sets import prompt_texts
from unimem.training.teacher_forcing import BatchedSequencesContext


def column_probs(model, context: list[int], chains: list[list[int]], temperature: float):
    """``p [K, gamma, V]`` float64: the target's tempered distribution of chain ``k``'s token
    ``j`` given the context and the chain's tokens before it."""
    k, gamma = len(chains), len(chains[0])
    length = len(context) + gamma
    ids = torch.tensor([context + c for c in chains]).reshape(-1)
    ctx = BatchedSequencesContext(model.config, k, length, (), model.device)
    starts = torch.arange(k)[:, None] * length + len(context) - 1
    ctx.logits_indices = (starts + torch.arange(gamma)[None, :]).reshape(-1)
    with torch.no_grad():
        logits = model.forward_with_hidden(ids, ctx).logits.double()
    return torch.softmax(logits / temperature, dim=-1).reshape(k, gamma, -1)


def ceiling(p: torch.Tensor, chains: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per column ``P(accept >= k)`` (k = 1..gamma) and ``alpha_j`` of a perfect block
    drafter, leave-one-out over the ``K`` chains (module docstring). ``p [K, gamma, V]``,
    ``chains [K, gamma]`` int64."""
    k, gamma, _ = p.shape
    # own[j, a, b]: chain b's probability, under chain a's prefix, of chain a's token j
    own = torch.stack([p[:, j, :][:, chains[:, j]].T for j in range(gamma)])  # [g, K(a), K(b)]
    # the other chains' mean probability of chain a's token at column j
    diag = torch.diagonal(own, dim1=1, dim2=2)  # [g, K]: p_j(x_j | own prefix)
    others = (own.sum(2) - diag) / (k - 1)
    ratio = torch.clamp(others / diag, max=1.0)
    ratio[0] = 1.0  # column 0: one shared prefix, the marginal is p itself
    prefix = torch.cumprod(ratio, dim=0)  # [g, K]: prod_{j<=i} min(1, m/p)
    p_accept = prefix.mean(1).tolist()  # P(the first k drafts are accepted), k = 1..gamma
    total = p.sum(0)
    alpha = []
    for j in range(gamma):
        m = (total[j][None, :] - p[:, j, :]) / (k - 1)  # leave-one-out marginal per chain
        alpha.append(1.0 if j == 0 else torch.minimum(p[:, j, :], m).sum(-1).mean().item())
    return p_accept, alpha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="gemma-3-270m")
    ap.add_argument("--contexts", type=int, default=24)
    ap.add_argument("--context-tokens", type=int, default=32)
    ap.add_argument("--chains", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(model_path=args.model_path, device="cpu")
    model = engine.model
    texts = prompt_texts("short", None)[: args.contexts]
    contexts, _ = text_continuations(
        engine, texts, 64, args.context_tokens, temperature=args.temperature, seed=100
    )
    subsets = sorted({n for n in (8, 16, 32, args.chains) if 2 <= n <= args.chains})
    per = {n: {"p_accept": [], "alpha": []} for n in subsets}
    for i, context in enumerate(contexts):
        params = [
            {"max_new_tokens": args.gamma, "temperature": args.temperature,
             "seed": 1000 + 97 * i + c, "ignore_eos": True}
            for c in range(args.chains)
        ]  # fmt: skip
        outs = engine.generate(input_ids=[context] * args.chains, sampling_params=params)
        chains = [o["output_ids"] for o in outs]
        p = column_probs(model, context, chains, args.temperature)
        ids = torch.tensor(chains)
        for n in subsets:
            pa, al = ceiling(p[:n], ids[:n])
            per[n]["p_accept"].append(pa)
            per[n]["alpha"].append(al)
        last = 1 + sum(per[subsets[-1]]["p_accept"][-1])
        print(f"context {i + 1}/{len(contexts)}: accept {last:.3f}", flush=True)
    engine.shutdown()
    report = {
        "command": " ".join(["python", "tools/block_draft_ceiling_cpu.py", *sys.argv[1:]]),
        "model": args.model_path,
        "contexts": len(contexts),
        "context_tokens": args.context_tokens,
        "chains": args.chains,
        "gamma": args.gamma,
        "temperature": args.temperature,
        "perfect_block_drafter": {},
        "perfect_autoregressive_drafter": {"accept": args.gamma + 1},
    }
    for n in subsets:
        pa = torch.tensor(per[n]["p_accept"]).mean(0)
        al = torch.tensor(per[n]["alpha"]).mean(0)
        report["perfect_block_drafter"][f"{n}_chains"] = {
            "accept": round(1 + pa.sum().item(), 4),
            "p_accept_at_least": [round(x, 4) for x in pa.tolist()],
            "alpha": [round(x, 4) for x in al.tolist()],
        }
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
