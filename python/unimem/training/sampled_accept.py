"""A drafter's accept length under speculative *sampling*, estimated offline:
``python -m unimem.training.sampled_accept``.

Chain speculative sampling accepts draft ``x_j`` with probability ``min(1, p_j(x_j) /
q_j(x_j))`` (``p`` the target's distribution at the request's temperature, ``q`` the one the
drafter drew from), so the probability that the first ``k`` drafts are all accepted is
``sum over x_1..x_k of prod_j min(p_j(x_j), q_j(x_j))``. Over sequences the target itself
sampled at that temperature (``x ~ p``) this is the expectation

    P(accept >= k) = E_x[ prod_{j<k} min(1, q_j(x_j) / p_j(x_j)) * alpha_k ],
    alpha_k = sum_v min(p_k(v), q_k(v)),

every factor conditioned on the sampled prefix — which is what the drafter sees after ``j``
accepted drafts (its Markov bias reads the previous token, here the sampled one). A verify
step commits ``1 + sum_k P(accept >= k)`` tokens. :func:`sampled_accept_lengths` averages that
over every anchor of every sequence whose ``gamma`` drafted positions all lie inside it.

``p`` comes from the target's teacher-forced top-``K`` distribution
(:func:`~unimem.training.teacher_forcing.teacher_forced_states` with ``soft_top_k``),
renormalised at the temperature (the tail beyond ``K`` carries no mass at ``T < 1`` worth
counting: ``alpha`` is a slight underestimate). ``q`` is the drafter's column distribution —
block logits plus the Markov bias, over its own (possibly reduced) vocabulary — at the *draft
temperature* ``T * s`` for each scale ``s`` asked (``s = 0``: the drafter's argmax, a point
mass). Any ``q`` keeps speculative sampling exact; the scale only moves the accept length,
so the best one is a property of the drafter worth measuring. The engine drafts at the
request's own temperature (``s = 1``), where the drafter shipped at the time measured best
(``docs/results/sampled_accept_scales_cpu.json``: 0.5 / 0.85 / 1 / 1.2 give 2.13 / 2.22 /
2.22 / 2.17).

    python -m unimem.training.sampled_accept --model-path gemma-3-270m \\
        --drafter python/unimem/data/drafters/gemma-3-270m --prompts short --requests 16 \\
        --tokens 128 --temperature 0.7 --scales 0,0.6,0.8,1,1.2 --device cpu --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

from unimem.speculative.drafter import DsparkDrafter
from unimem.training import distill
from unimem.training.distill import Rollouts
from unimem.training.train_forward import block_logits_dense

__all__ = ["main", "sampled_accept_lengths"]


def _draft_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The drafter's column distribution at ``temperature`` (0: the argmax's point mass)."""
    if temperature == 0:
        pick = logits.argmax(-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, pick, 1.0)
    return torch.softmax(logits / temperature, dim=-1)


def _target_probs(data: Rollouts, pos: torch.Tensor, temperature: float):
    """``(ids [B, A, G, K], p [B, A, G, K] float32)``: the target's top-``K`` tokens at
    positions ``pos [B?, A, G]`` and their probabilities at ``temperature``, renormalised
    over the ``K`` (zeros where the stored probability is 0)."""
    b = data.tokens.shape[0]
    rows = torch.arange(b, device=data.soft_ids.device)[:, None, None]
    ids = data.soft_ids[rows, pos].long()
    p1 = data.soft_probs[rows, pos].float()
    logp = torch.where(p1 > 0, torch.log(p1.clamp(min=1e-30)) / temperature, -torch.inf)
    p = torch.softmax(logp, dim=-1)
    return ids, torch.nan_to_num(p, nan=0.0)


@torch.no_grad()
def sampled_accept_lengths(
    drafter: DsparkDrafter,
    data: Rollouts,
    gamma: int,
    temperature: float,
    scales: Sequence[float],
    rows_per_pass: int = 8,
) -> dict[float, dict]:
    """Per draft-temperature scale ``s`` (module docstring), the expected tokens committed per
    verify step (``"accept"``) and the mean acceptance probability of each draft column given
    the ones before it (``"alpha"``, ``gamma`` values) and the target's mass inside the draft
    vocabulary (``"coverage"``, per column: an upper bound of ``alpha``), over every anchor
    of ``data`` whose ``gamma`` drafted positions lie inside its sequence. ``data``: sequences
    the target sampled at ``temperature`` with its teacher-forced states of the drafter's
    target layers and soft targets (``soft_ids`` / ``soft_probs``). ``ValueError`` without
    soft targets, for ``temperature <= 0`` or a negative scale."""
    if data.soft_ids is None or data.soft_probs is None:
        raise ValueError("sampled_accept_lengths needs the target's soft targets (soft_top_k)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if any(s < 0 for s in scales):
        raise ValueError(f"draft temperature scales must be >= 0, got {list(scales)}")
    c = drafter.config
    kd = c.out_vocab
    sums = {s: torch.zeros(gamma + 1, dtype=torch.float64) for s in scales}
    alphas = {s: torch.zeros(gamma, dtype=torch.float64) for s in scales}
    coverage = torch.zeros(gamma, dtype=torch.float64)
    anchors_seen = 0
    cols = torch.arange(gamma)
    n = len(data)
    for start in range(0, n, rows_per_pass):
        part = data.select(torch.arange(start, min(n, start + rows_per_pass)))
        dev = part.tokens.device
        first = int(part.prompt_lens.min())
        last = int(part.lengths.max()) - gamma  # anchor n drafts positions n+1 .. n+gamma
        if last <= first:
            continue
        b, s_len = part.tokens.shape
        lens = part.lengths.to(dev)[:, None]
        plens = part.prompt_lens.to(dev)[:, None]
        for anchors in distill.anchor_chunks(first, last, b, gamma, kd, dev):
            ok = (anchors[None, :] >= plens) & (anchors[None, :] + gamma < lens)  # [B, A]
            if not bool(ok.any()):
                continue
            base = block_logits_dense(drafter, part.tokens, part.hidden, anchors, gamma)
            pos = (anchors[:, None] + cols.to(dev)[None, :]).clamp(max=s_len - 1)  # [A, G]
            prev = part.tokens[:, pos]  # anchor, then the sampled tokens
            true = part.tokens[:, (pos + 1).clamp(max=s_len - 1)]  # [B, A, G]
            logits = base.float() + drafter.markov_bias(prev).float()
            ids, p = _target_probs(part, pos[None].expand(b, -1, -1), temperature)
            d_ids = drafter.to_draft(ids)  # [B, A, G, K]; kd outside the draft vocabulary
            in_draft = d_ids < kd
            p_true = (p * (ids == true[..., None])).sum(-1)
            d_true = drafter.to_draft(true)
            coverage += (p * in_draft)[ok].sum(-1).double().sum(0).cpu()
            for s in scales:
                q = _draft_distribution(logits, temperature * s)
                q_at = torch.where(in_draft, q.gather(-1, d_ids.clamp(max=kd - 1)), 0.0)
                alpha = torch.minimum(p, q_at).sum(-1)  # [B, A, G]
                q_true = q.gather(-1, d_true.clamp(max=kd - 1)[..., None])[..., 0]
                q_true = torch.where(d_true < kd, q_true, 0.0)
                ratio = (q_true / p_true.clamp(min=1e-30)).clamp(max=1.0)
                ratio = torch.where(p_true > 0, ratio, 0.0)  # min(1, q(x) / p(x))
                before = torch.cumprod(
                    torch.cat([torch.ones_like(ratio[..., :1]), ratio[..., :-1]], dim=-1), dim=-1
                )
                reach = (before * alpha)[ok]  # [N, G]: P(accept >= k + 1) per anchor
                sums[s][1:] += reach.double().sum(0).cpu()
                alphas[s] += alpha[ok].double().sum(0).cpu()
            anchors_seen += int(ok.sum())
    out: dict[float, dict] = {}
    for s in scales:
        m = max(anchors_seen, 1)
        out[s] = {
            "accept": 1.0 + float(sums[s][1:].sum()) / m,
            "alpha": [float(a) / m for a in alphas[s]],
            "anchors": anchors_seen,
            "coverage": [float(x) / m for x in coverage],
        }
    return out


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        msg = f"expected comma-separated numbers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unimem.training.sampled_accept", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--drafter", required=True, help="a drafter checkpoint directory")
    p.add_argument("--prompts", default="short", help="'short' (the package's prompts) or a file")
    p.add_argument("--split", default=None, help="the prompt file's split to use")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="sampled output tokens each")
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--scales", type=_floats, default=(0.0, 0.6, 0.8, 1.0, 1.2))
    p.add_argument("--top-k-probs", type=int, default=256, help="target tokens kept per position")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    from unimem.engine.api import Engine
    from unimem.speculative.checkpoint import load_drafter
    from unimem.training.draft_data import text_continuations
    from unimem.training.prompt_sets import prompt_texts
    from unimem.training.teacher_forcing import teacher_forced_states

    args = parser().parse_args(argv)
    for name in ("requests", "tokens", "gamma", "max_prompt_len", "top_k_probs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0")
    t0 = time.perf_counter()
    engine = Engine(
        model_path=args.model_path, device=args.device, dtype=args.dtype, disable_radix_cache=True
    )
    model = engine.model
    drafter = load_drafter(args.drafter, model, dtype=torch.float32)
    texts = prompt_texts(args.prompts, args.split)
    if len(texts) < args.requests:
        raise SystemExit(f"--prompts has {len(texts)} prompts, --requests {args.requests}")
    seqs, prompt_lens = text_continuations(
        engine, texts[: args.requests], args.max_prompt_len, args.tokens,
        temperature=args.temperature, seed=args.seed,
    )  # fmt: skip
    engine.shutdown()
    data = teacher_forced_states(
        model, seqs, prompt_lens, drafter.config.target_layers, soft_top_k=args.top_k_probs
    )
    rows = sampled_accept_lengths(drafter, data, args.gamma, args.temperature, args.scales)
    print(f"temperature {args.temperature}, gamma {args.gamma}, {len(seqs)} sequences")
    print(f"{'draft scale':>12} {'accept':>7}  alpha by column")
    for s, row in rows.items():
        label = "argmax" if s == 0 else f"{s:g}"
        alpha = " ".join(f"{a:.3f}" for a in row["alpha"])
        print(f"{label:>12} {row['accept']:7.3f}  {alpha}")
    report = {
        "model_path": args.model_path,
        "drafter": args.drafter,
        "device": str(model.device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "prompts": args.prompts,
        "requests": len(seqs),
        "tokens": args.tokens,
        "temperature": args.temperature,
        "gamma": args.gamma,
        "top_k_probs": args.top_k_probs,
        "scales": {f"{s:g}": row for s, row in rows.items()},
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
