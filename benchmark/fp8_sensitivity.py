"""Where FP8's error comes from on a real model: FP8 emulated in float32, variant by variant.

Loads ``--model-path`` (Gemma 3 270M by default) in float32, generates ``--tokens`` greedy
tokens per prompt (the first ``--requests`` of :func:`unimem.data.prompts.short_prompts`),
and scores every variant teacher-forced on that output against the float32 model: top-1
agreement and mean |delta log-prob| of the chosen token, as ``fp8_agreement.py`` does on the
GPU. A variant replaces the model's linears (``fp8_linear.linear`` / ``row_parallel``) by
float32 products of FP8-rounded operands: the weight quantised per ``wblock`` (``128x128``
blocks, the hub layout and the default; ``1x128`` per row and group; ``row`` one scale per
output row) and the activation per token and group of ``agroup`` columns (``0``: kept in
float32; ``-1``: one scale per token), with e4m3 round-to-nearest-even as on the GPU;
``skip`` lists projections (``q k v o gate up down``) or layers (``L0``, ``L-1`` the last)
left unquantised. The ``bf16`` variant is the model loaded in bfloat16 (no FP8): the floor
any FP8 run is measured against.

    python benchmark/fp8_sensitivity.py --model-path gemma-3-270m --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class Variant:
    """One emulated quantisation (module docstring)."""

    name: str
    wblock: str = "128x128"
    agroup: int = 128
    skip: tuple[str, ...] = ()


VARIANTS = (
    Variant("fp8 default (W 128x128, A 1x128)"),
    Variant("weights only (A float32)", agroup=0),
    Variant("activations only (W float32)", wblock="none"),
    Variant("W 1x128 per row-group", wblock="1x128"),
    Variant("W per output row", wblock="row"),
    Variant("A 1x32", agroup=32),
    Variant("skip down", skip=("down",)),
    Variant("skip gate+up", skip=("gate", "up")),
    Variant("skip attention q k v o", skip=("q", "k", "v", "o")),
    Variant("skip o", skip=("o",)),
    Variant("skip first+last layer", skip=("L0", "L-1")),
    Variant("rowwise: W per output row, A per token", wblock="row", agroup=-1),
    Variant("skip MLP (gate up down)", skip=("gate", "up", "down")),
    Variant("skip gate+up and o", skip=("gate", "up", "o")),
    Variant("skip up+down", skip=("up", "down")),
)


def _round_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def quant_weight(w: torch.Tensor, block: str) -> torch.Tensor:
    """``w [N, K]`` float32 rounded through e4m3 with scales per ``block`` (dequantised)."""
    if block == "none":
        return w
    n, k = w.shape
    rb, cb = {"128x128": (128, 128), "1x128": (1, 128), "row": (1, k)}[block]
    nb, kb = -(-n // rb), -(-k // cb)
    pad = torch.zeros(nb * rb, kb * cb)
    pad[:n, :k] = w
    b = pad.view(nb, rb, kb, cb)
    s = (b.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-10)) / FP8_MAX
    return _round_fp8(b, s).view(nb * rb, kb * cb)[:n, :k].contiguous()


def quant_act(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., K]`` rounded through e4m3 per token and group of ``group`` columns."""
    if group == 0:
        return x
    k = x.shape[-1]
    if group < 0:
        group = k
    kb = -(-k // group)
    pad = F.pad(x, (0, kb * group - k)).unflatten(-1, (kb, group))
    s = pad.abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    return _round_fp8(pad, s).flatten(-2)[..., :k]


def install(model, variant: Variant | None) -> None:
    """Route ``fp8_linear.linear`` / ``row_parallel`` through ``variant`` (None: float32)."""
    from unimem.models import fp8_linear

    names = {id(m): n for n, m in model.named_modules()}
    n_layers = len([m for m in model.modules() if isinstance(m, torch.nn.ModuleList)][0])
    cache: dict[int, torch.Tensor] = {}

    def skipped(module) -> bool:
        name = names.get(id(module), "")
        proj = name.rsplit(".", 1)[-1].removesuffix("_proj")
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        tags = {proj}
        if layer is not None:
            tags |= {f"L{layer}", f"L{layer - n_layers}"}
        return bool(tags & set(variant.skip))

    def lin(x, module, leaf="weight"):
        w = getattr(module, leaf)
        if variant is None or skipped(module):
            return F.linear(x, w)
        key = id(module)
        if key not in cache:
            cache[key] = quant_weight(w.float(), variant.wblock)
        return F.linear(quant_act(x.float(), variant.agroup), cache[key]).to(x.dtype)

    fp8_linear.linear = lin
    fp8_linear.row_parallel = lambda x, module, zero_bias, tp, leaf="weight": lin(x, module, leaf)


def score(ref, got, prompts, gen, tokens) -> dict:
    agree = total = 0
    chosen = []
    for p, g, r, q in zip(prompts, gen, ref, got, strict=True):
        rows = slice(len(p) - 1, len(p) - 1 + tokens)
        lr, lq = r[rows].float().log_softmax(-1), q[rows].float().log_softmax(-1)
        tok = torch.tensor(g)
        agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
        total += len(g)
        chosen.append((lq.gather(1, tok[:, None]) - lr.gather(1, tok[:, None])).abs().flatten())
    c = torch.cat(chosen)
    return {
        "top1_agreement": agree / total,
        "mean_abs_dlogprob_chosen": float(c.mean()),
        "max_abs_dlogprob_chosen": float(c.max()),
        "positions": total,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="gemma-3-270m")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--only", default="", help="comma-separated variant indices (default all)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 floor")
    ap.add_argument("--gen-cache", help="JSON file of the greedy tokens (reused if there)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from fp8_agreement import greedy

    from unimem.data.prompts import short_prompts
    from unimem.models.loader import load_checkpoint

    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model_path, dtype="float32", device="cpu")
    model = ckpt.model
    texts = short_prompts()
    if len(texts) < args.requests:
        raise SystemExit(f"{len(texts)} prompts available, {args.requests} asked")
    prompts = [ckpt.tokenizer.encode(t) for t in texts[: args.requests]]
    install(model, None)
    key = f"{args.model_path} {args.requests} {args.tokens}"
    cached = {}
    if args.gen_cache and os.path.exists(args.gen_cache):
        with open(args.gen_cache) as f:
            cached = json.load(f)
    gen = cached.get(key) or greedy(model, prompts, args.tokens, torch.device("cpu"))
    if args.gen_cache:
        with open(args.gen_cache, "w") as f:
            json.dump({**cached, key: gen}, f)
    seqs = [torch.tensor(p + g[:-1]) for p, g in zip(prompts, gen, strict=True)]
    ref = model.reference_forward(seqs)
    print(f"float32 reference: {time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    only = {int(i) for i in args.only.split(",") if i}
    for i, v in enumerate(VARIANTS):
        if only and i not in only:
            continue
        install(model, v)
        r = score(ref, model.reference_forward(seqs), prompts, gen, args.tokens)
        results.append({"variant": v.name, **v.__dict__, **r})
        print(f"{i:2d} {v.name:40s} top1 {r['top1_agreement']:.4f}  "
              f"mean|dlp| {r['mean_abs_dlogprob_chosen']:.4f}  "
              f"max {r['max_abs_dlogprob_chosen']:.3f}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)  # fmt: skip
    if not args.no_bf16:
        install(model, None)
        bf = load_checkpoint(args.model_path, dtype="bfloat16", device="cpu").model
        r = score(ref, bf.reference_forward(seqs), prompts, gen, args.tokens)
        results.append({"variant": "bf16 model (no FP8)", **r})
        print(f"   {'bf16 model (no FP8)':40s} top1 {r['top1_agreement']:.4f}  "
              f"mean|dlp| {r['mean_abs_dlogprob_chosen']:.4f}", flush=True)  # fmt: skip
    out = {
        "model_path": args.model_path,
        "reference": "float32 model, teacher-forced on its greedy output",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "results": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
