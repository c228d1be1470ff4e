"""What one request with extras costs the batch it runs in (GPU): the synthetic ``small``
preset on FA4 with CUDA graphs, ``--requests`` greedy requests decoding ``--tokens`` each,
plain decoding and DSPARK (gamma 7, the raw drafter), in one engine per mode. Each round
runs the same prompts; in every round but the baselines one request carries an extra:
``logit_bias``, top-5 log-probabilities, penalties (the step in flight's tokens added to the
history on the device), or a regex grammar (structured output: masks from the host, which
reads the step in flight first; drafts read back in verify steps). Prints and writes
(``--json``) tok/s and each round's ratio to the baseline rounds' mean (run first and last)
— each extra's round as the engine runs it (the recorded forward half replayed, the rest
eager) and, with ``--whole-eager`` (the default), again with the halves dropped (the whole
step eager: the cost before the split) — and per engine its start-up's CUDA-graph capture
seconds, the number of recorded forward-half kinds, the bytes of their stable outputs and
the memory the process holds once the engine is built (pool, weights and graphs).

    python tools/device/extras_cost.py --modes plain --json extras_cost_plain_h100.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from unimem.attention.fa4_backend import FA4Backend
from unimem.engine.core import EngineCore
from unimem.engine.grammar import GrammarBackend, GrammarSpec
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.drafter import DsparkDrafter, draft_config_for

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz-"
EXTRAS = {
    "none": {},
    "logit_bias": {"logit_bias": {11: 2.0, 12: -3.0}},
    "top_logprobs_5": {"top_logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "grammar": {"grammar": GrammarSpec("regex", "[a-z]{8,}(-[0-9a-z]+)*")},
}


def _round(eng: EngineCore, prompts, tokens: int, extra: dict) -> tuple[float, int]:
    reqs = []
    for i, p in enumerate(prompts):
        kw = extra if i == 0 else {}
        reqs.append(eng.submit(p, tokens, **kw))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.run()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = sum(len(r.output) for r in reqs)
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return out / dt, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--modes", default="plain,dspark", help="comma-separated: plain, dspark")
    ap.add_argument(
        "--whole-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each extra's round with the forward halves dropped (every step with "
        "extras eager from end to end, as before the split), in the same engine",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("plain", "dspark") for m in modes):
        raise SystemExit(f"--modes: plain and/or dspark, got {args.modes!r}")
    dev = torch.device("cuda")
    cfg = preset("small")
    model = HybridModel(cfg, seed=3, device=dev)
    vocab = ["", "", "", ""] + [ALPHABET[i % len(ALPHABET)] for i in range(cfg.vocab_size - 4)]
    backend = GrammarBackend(cfg.vocab_size, [1], vocab=vocab)
    g = torch.Generator().manual_seed(9)
    prompts = torch.randint(4, cfg.vocab_size, (args.requests, args.prompt_len), generator=g)
    prompts = prompts.tolist()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "preset": "small",
        "requests": args.requests,
        "tokens": args.tokens,
        "prompt_len": args.prompt_len,
        "modes": {},
    }
    for mode in modes:
        chain, lanes = None, ()
        if mode == "dspark":
            drafter = DsparkDrafter(draft_config_for(cfg), model.embed, model.lm_head, seed=5)
            chain, lanes = DsparkChain(drafter, 7), drafter.config.lanes()
        pool = UnifiedMemory(
            memory_spec(cfg, 64, lanes), 6 << 30, args.requests, cfg.max_context, dev
        )
        eng = EngineCore(
            model, pool, FA4Backend(), args.requests, 8192, chain=chain, cuda_graphs=True,
            logprobs=True, grammar_backend=backend,
        )  # fmt: skip
        runner = eng.runner
        setup = {
            "capture_seconds": round(runner.capture_seconds, 2),
            "forward_half_kinds": len(runner.forward_graphs),
            "stable_outputs_mib": round(runner.kept.nbytes() / 2**20, 1),
            "reserved_mib": round(torch.cuda.memory_reserved() / 2**20),
        }
        for name in EXTRAS:  # warm-up: every eager variant compiles here, not in a timed round
            _round(eng, prompts[:4], 16, EXTRAS[name])
        rows = {}
        for name in [*EXTRAS, "none_again"]:
            tok_s, out = _round(eng, prompts, args.tokens, EXTRAS.get(name, {}))
            rows[name] = {"tok_s": round(tok_s, 1), "tokens": out}
        if args.whole_eager:  # the same rounds with the forward halves dropped: as before them
            runner.forward_graphs, runner.extend_halves = {}, {}
            for name in EXTRAS:
                if name != "none":
                    tok_s, out = _round(eng, prompts, args.tokens, EXTRAS[name])
                    rows[f"{name}_whole_eager"] = {"tok_s": round(tok_s, 1), "tokens": out}
        base = (rows["none"]["tok_s"] + rows["none_again"]["tok_s"]) / 2
        for row in rows.values():
            row["ratio"] = round(row["tok_s"] / base, 3)
        report["modes"][mode] = {"setup": setup, "rounds": rows}
        print(mode, json.dumps(setup), json.dumps(rows), flush=True)
        del eng, pool
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
