"""Online FP8 (``--quantization fp8``) against the same model in bf16 on real prompts: per-token
top-1 agreement and mean |delta log-prob|, teacher-forced on the bf16 model's greedy output.

Loads ``--model-path`` in bf16 (``unimem.models.loader.load_checkpoint``: an HF directory, or
whatever else the loader accepts), encodes the first ``--requests`` lines of ``--prompts``
with its tokenizer, generates ``--tokens`` greedy tokens per prompt with the bf16 model
(batched, :class:`~unimem.models.forward_context.DenseCache`), then runs every sequence
(prompt + generated) through the bf16 model and through a second copy quantised online
(:func:`unimem.models.fp8_convert.quantize_model_online`), each request alone
(``reference_forward``). At the ``--tokens`` generated positions it reports: the share of
positions whose FP8 argmax equals the bf16 argmax (the goal: >= ``--goal``), the mean and
max |log p_fp8(t) - log p_bf16(t)| of the bf16 token ``t``, and the mean over the whole
distribution (sum_v p_bf16 |delta log p|). The FP8 model is quantised as ``--quantization
fp8`` does (``quant_config.online_config``: for Gemma 3 gate/up/o stay bf16); ``all_linears``
repeats the scores with every eligible linear in FP8 (the hub checkpoints' choice).
``--json`` writes it; exit 3 when the default's agreement is below the goal, 1 on an error.

    python tools/device/fp8_agreement.py --model-path DIR --prompts prompts.txt --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


@torch.no_grad()
def greedy(model, prompts: list[list[int]], tokens: int, device) -> list[list[int]]:
    """``tokens`` greedy tokens per prompt, all prompts as one batch."""
    from unimem.models.forward_context import DenseCache, DenseContext

    n = len(prompts)
    cache = DenseCache(model.config, n, device)
    slots = [cache.alloc() for _ in range(n)]
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    ctx = DenseContext(cache, slots, [len(p) for p in prompts], "extend")
    nxt = model.forward(ids, ctx).argmax(-1)
    out = [[int(t)] for t in nxt.tolist()]
    for _ in range(tokens - 1):
        ctx = DenseContext(cache, slots, [1] * n, "decode")
        nxt = model.forward(nxt, ctx).argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            out[i].append(t)
    return out


def score(prompts, gen, ref, got, tokens: int, dev) -> dict:
    """Top-1 agreement and |delta log-prob| of ``got`` against ``ref`` at the generated
    positions (module docstring)."""
    agree = total = 0
    chosen, dist = [], []
    for p, g, r, q in zip(prompts, gen, ref, got, strict=True):
        rows = slice(len(p) - 1, len(p) - 1 + tokens)
        lr, lq = r[rows].log_softmax(-1), q[rows].log_softmax(-1)
        tok = torch.tensor(g, device=dev)
        agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
        total += len(g)
        chosen.append((lq.gather(1, tok[:, None]) - lr.gather(1, tok[:, None])).abs().flatten())
        dist.append((lr.exp() * (lq - lr).abs()).sum(-1))
    chosen_t, dist_t = torch.cat(chosen), torch.cat(dist)
    return {
        "positions": total,
        "top1_agreement": agree / total,
        "mean_abs_dlogprob_chosen": float(chosen_t.mean()),
        "max_abs_dlogprob_chosen": float(chosen_t.max()),
        "mean_abs_dlogprob_dist": float(dist_t.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument(
        "--prompts", required=True, help="a prompt file (text lines or .jsonl: prompt_sets)"
    )
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--goal", type=float, default=0.98)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    from unimem.models.fp8_convert import quantize_model_online
    from unimem.models.fp8_linear import weight_bytes
    from unimem.models.loader import load_checkpoint
    from unimem.training.prompt_sets import read_prompts

    dev = torch.device(args.device)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model_path, dtype="bfloat16", device=dev)
    if ckpt.tokenizer is None:
        raise SystemExit(f"{args.model_path}: no tokenizer (the prompts need one)")
    lines = read_prompts(args.prompts)
    if len(lines) < args.requests:
        raise SystemExit(f"--prompts has {len(lines)} prompts, {args.requests} needed")
    prompts = [ckpt.tokenizer.encode(t) for t in lines[: args.requests]]
    bf16 = ckpt.model
    gen = greedy(bf16, prompts, args.tokens, dev)
    seqs = [torch.tensor(p + g[:-1], device=dev) for p, g in zip(prompts, gen, strict=True)]
    ref = [x.float() for x in bf16.reference_forward(seqs)]
    bf16_bytes = weight_bytes(bf16)
    del bf16, ckpt
    from unimem.models.quant_config import Fp8Config

    scores = {}
    for label, cfg in (("default", None), ("all_linears", Fp8Config(from_checkpoint=False))):
        fp8 = load_checkpoint(args.model_path, dtype="bfloat16", device=dev).model
        names = quantize_model_online(fp8, cfg)
        got = [x.float() for x in fp8.reference_forward(seqs)]
        scores[label] = score(prompts, gen, ref, got, args.tokens, dev)
        scores[label]["fp8_linears"] = len(names)
        scores[label]["weight_bytes_fp8"] = weight_bytes(fp8)
        del fp8, got
    total = scores["default"].pop("positions")
    scores["all_linears"].pop("positions")
    default = scores["default"]
    result = {
        "model_path": args.model_path,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "positions": total,
        "weight_bytes_bf16": bf16_bytes,
        **default,
        "all_linears": scores["all_linears"],
        "goal": args.goal,
        "meets_goal": default["top1_agreement"] >= args.goal,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0 if result["meets_goal"] else 3


if __name__ == "__main__":
    sys.exit(main())
