"""What the protocol compares: outputs request by request (:func:`compare_outputs`),
speculative outputs against the non-speculative ones with the oracle's logit margin at the
first difference (:func:`spec_mismatches`, :func:`near_tie_margin`), the accept length the
acceptance control should give (:func:`control_expected_accept_length`,
:func:`control_draws_accept_length`) and, with ``--oracle transformers``, HuggingFace
transformers' greedy outputs and log-probabilities (:func:`add_oracle`).
"""

from __future__ import annotations

import torch

from unimem.models.base import CausalLM
from unimem.speculative.control import uniform_draws
from unimem.validate.config import ValidateConfig
from unimem.validate.runs import RunResult, logprob_run


def compare(static: RunResult, unified: RunResult) -> list[dict]:
    """Requests whose outputs differ, with the first differing position."""
    return compare_outputs(static.outputs, unified.outputs)


def compare_outputs(expected: dict[int, list[int]], got: dict[int, list[int]]) -> list[dict]:
    """Requests of ``expected`` whose output in ``got`` differs, with the first differing
    position."""
    diffs = []
    for rid, a in expected.items():
        b = got.get(rid)
        if a != b:
            pairs = zip(a, b or [], strict=False)
            first = next((i for i, (x, y) in enumerate(pairs) if x != y), len(b or []))
            diffs.append({"rid": rid, "first_diff": first})
    return diffs


def spec_mismatches(
    model: CausalLM,
    prompts: list[list[int]],
    expected: dict[int, list[int]],
    runs: dict[str, dict[int, list[int]]],
    max_margins: int | None = None,
) -> list[dict]:
    """Requests (rid = prompt index) whose output in a speculative run (``runs[label]``)
    differs from the non-speculative ``expected`` output: the first differing output position,
    both tokens there, and the dense oracle's top-2 tokens and logit margin after the common
    prefix (a near-tie explains a flipped token — ``near_tie`` — a clear margin means a bug).
    Margins are computed for the first ``max_margins`` mismatches (None: all); the others
    have ``logit_margin`` None."""
    out = []
    tie = near_tie_margin(model.config.dtype)
    margins: dict[tuple[int, int], dict] = {}
    for label, outputs in runs.items():
        for d in compare_outputs(expected, outputs):
            rid, first = d["rid"], d["first_diff"]
            d["mode"] = label
            d["spec_token"] = _at(outputs.get(rid, []), first)
            d["reference_token"] = _at(expected[rid], first)
            key = (rid, first)
            if key not in margins and (max_margins is None or len(margins) < max_margins):
                margins[key] = _margin(model, prompts[rid] + expected[rid][:first])
            d.update(margins.get(key, {"oracle_top2": None, "logit_margin": None}))
            m = d["logit_margin"]
            d["near_tie"] = m is not None and m < tie
            out.append(d)
    return out


def _at(tokens: list[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None


def _margin(model: CausalLM, prefix: list[int]) -> dict:
    """The target's choice after ``prefix`` by the dense oracle: its top-2 tokens and the
    logit margin between them (a near-tie explains a flipped token)."""
    ids = torch.tensor(prefix, dtype=torch.long)
    logits = model.reference_forward([ids])[0][-1]
    top = torch.topk(logits.double(), 2)
    return {
        "oracle_top2": [int(i) for i in top.indices],
        "logit_margin": float(top.values[0] - top.values[1]),
    }


def near_tie_margin(dtype: torch.dtype) -> float:
    """Oracle logit margins below this explain a speculative token flip (module docstring):
    0 for float64 (no flip is explained), 1e-3 for float32, 1/16 for 16-bit models (logits
    of O(1) computed from bf16 activations carry errors of ~1e-2)."""
    if dtype == torch.float64:
        return 0.0
    if dtype == torch.float32:
        return 1e-3
    return 1 / 16


def control_expected_accept_length(rate: float, gamma: int) -> float:
    """The accept length validate measures (``Request.verified_tokens`` per verify step:
    ``accepted + 1`` per step, counted before truncation at the output length) when the
    acceptance control replaces each drafted token by the reference's with probability
    ``rate`` and nothing else is accepted: a step accepts ``j < gamma`` drafts with
    probability ``rate ** j * (1 - rate)`` and all ``gamma`` with ``rate ** gamma``, so
    ``sum_{i=0..gamma} rate ** i`` tokens per step.

    Finite outputs do not change it: validate's references run ``gamma`` tokens past the
    output, so a request's last step draws like any other (its surplus is counted, not
    committed), and by Wald's identity the expected count over a request's steps is the
    expected number of steps times this mean. A drafter's own correct guesses add to it.
    Speculative outputs must follow the reference for this to hold, which on the GPU takes
    batch-invariant kernels."""
    return float(sum(rate**i for i in range(gamma + 1)))


def control_draws_accept_length(
    seed: int,
    rate: float,
    gamma: int,
    references: dict[int, list[int]],
    prompts: list[list[int]],
    output_len: int,
) -> float:
    """The accept length the acceptance control's own draws give for this run (its hash of
    ``(seed, rid, position)``, replayed on the host): each request from the token its
    prefill gives to ``output_len`` tokens (or its reference's end), every verify step
    accepting drafts while the draw says "reference" and the reference is known, ``gamma``
    at most, plus the bonus token. A run whose speculative outputs follow the reference
    measures this plus its drafter's own correct guesses; the difference from
    :func:`control_expected_accept_length` is the sample of draws."""
    steps = counted = 0
    for rid, ref in references.items():
        start = len(prompts[rid])
        out_len = min(output_len, len(ref) - start)
        positions = torch.arange(len(ref) + gamma + 1)
        take = (uniform_draws(seed, torch.full_like(positions, rid), positions) < rate) & (
            positions < len(ref)
        )
        take = take.tolist()
        done, at = 1, start + 1  # the prefill's token is committed
        while done < out_len:
            accepted = 0
            while accepted < gamma and take[at + accepted]:
                accepted += 1
            steps += 1
            counted += accepted + 1
            done += accepted + 1
            at += accepted + 1
    return counted / steps if steps else 0.0


def add_oracle(
    report: dict,
    cfg: ValidateConfig,
    model: CausalLM,
    prompts: list[list[int]],
    runs: dict[str, dict[int, list[int]]],
) -> None:
    """With ``--oracle transformers``: the same prompts through
    ``transformers.AutoModelForCausalLM.generate`` (greedy, eager attention, the model's
    dtype) — ``oracle_matches`` (requests whose static and unified outputs both equal it),
    ``oracle_mismatches`` and ``oracle_max_logprob_diff`` (the largest difference between
    our per-token log-probabilities, from a static run, and transformers' over the common
    prefix)."""
    if cfg.oracle != "transformers":
        return
    from transformers import AutoModelForCausalLM

    device = model.device
    hf = AutoModelForCausalLM.from_pretrained(
        cfg.checkpoint_dir, dtype=model.config.dtype, attn_implementation="eager"
    ).to(device)
    hf.eval()
    expected, hf_logprobs = {}, {}
    for rid, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=cfg.output_len,
                # our runs ignore EOS (it may be the argmax and is kept); so here: no EOS
                # stopping and no EOS suppression (min_new_tokens would mask it)
                eos_token_id=None,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        toks = out.sequences[0, len(ids) :].tolist()
        logits = torch.stack([x[0] for x in out.logits]).float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks, device=device)[:, None])
        expected[rid], hf_logprobs[rid] = toks, lp[:, 0].tolist()
    del hf
    ours = logprob_run(model, cfg, prompts)
    diffs = []
    for label in runs:
        for d in compare_outputs(expected, runs[label]):
            diffs.append({**d, "mode": label})
    worst = 0.0
    for rid, (toks, lps) in ours.items():
        n = 0
        while n < min(len(toks), len(expected[rid])) and toks[n] == expected[rid][n]:
            n += 1
        n = min(n + 1, len(toks), len(expected[rid]))  # the first differing token's too
        worst = max(
            [worst] + [abs(a - b) for a, b in zip(lps[:n], hf_logprobs[rid][:n], strict=True)]
        )
    report["oracle_matches"] = len(prompts) - len({d["rid"] for d in diffs})
    report["oracle_mismatches"] = diffs
    report["oracle_max_logprob_diff"] = worst
