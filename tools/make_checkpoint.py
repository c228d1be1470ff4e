"""Build a random HuggingFace checkpoint of a real hybrid architecture for GPU runs.

    python tools/make_checkpoint.py --arch qwen3_next|gpt_oss --out DIR [--size small|bench]
        [--fp8] [--layers N] [--dtype bfloat16|float32]
    python tools/make_checkpoint.py --arch qwen3_next --size 80b --fp8 --layers 24 --out DIR
    python tools/make_checkpoint.py --arch qwen3_next --size tiny --dtype float32 --out DIR

The config is transformers' own (``Qwen3NextConfig`` / ``GptOssConfig``) and the weights are
transformers' own initialisation (``AutoModelForCausalLM.from_config`` in ``--dtype``,
bfloat16 by default, created directly on the GPU when there is one);
``save_pretrained`` writes ``config.json`` and safetensors shards, and a word-level
tokenizer of the model's vocabulary is saved beside them (``unimem.models.word_tokenizer``: the
server and ``python -m unimem bench serving`` / ``router`` need one; ``python -m unimem
validate/bench --model-path DIR`` draws random token prompts either way).

Sizes:
  qwen3_next bench: hidden 2048, 24 layers (full_attention_interval 4: 18 Gated DeltaNet +
    6 gated full attention), 16 query / 2 KV heads of dim 256 (partial rotary 0.25), GDN 16
    key / 32 value heads of dim 128, conv 4, MoE 64 experts top-8 of width 512 with a shared
    expert of width 512 on every layer, vocab 32000, 32768 positions.
  gpt_oss bench: hidden 2048, 12 layers alternating sliding (window 128) / full attention
    with sinks, 32 query / 8 KV heads of dim 64, 32 experts top-4 of width 1024 (clamped
    SwiGLU, biases), vocab 32000, YaRN RoPE as gpt-oss (theta 150000, factor 32 from 4096).
  small: the same architectures at ~50-100 M parameters (smoke tests).
  qwen3_next tiny: 3 Gated DeltaNet + 1 full-attention layer, hidden 256, vocab 4096 (a
    checkpoint two CPU servers run side by side: ``python -m unimem bench router``).
  qwen3_next 80b: Qwen3-Next-80B-A3B's shape (hidden 2048, 48 layers, 512 experts top-10 of
    width 512 with a shared expert of width 512, GDN 16 key / 32 value heads of dim 128,
    16 query / 2 KV heads of dim 256, vocab 151936); ``--layers`` keeps the first N layers
    (a multiple of 4 keeps the 3 GDN : 1 attention pattern) so it fits a disk;
    ``--overflow-dir`` puts the shards the disk cannot hold on another filesystem (all 48
    layers are ~83 GB).

``--fp8`` writes the hub's block-wise FP8 layout (``unimem.models.fp8_checkpoint``:
``weight`` e4m3 + ``weight_scale_inv`` per 128 x 128 block for attention, GDN qkvz/out,
shared and routed experts per expert; ``quantization_config`` in ``config.json``). For
``small``/``bench`` the bf16 model is saved first and converted; for ``80b`` the tensors are
drawn on the device layer by layer (norms as HF initialises them, projections
``randn / sqrt(fan_in)``), quantised there and written one shard per layer, never holding the
bf16 model.
Prints the total parameter count and the parameters active per token.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

SIZES = {
    ("qwen3_next", "80b"): dict(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        intermediate_size=5120,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    ("qwen3_next", "bench"): dict(
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=24,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        intermediate_size=5632,  # unused: every layer is MoE (mlp_only_layers empty)
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    ("qwen3_next", "small"): dict(
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        intermediate_size=1024,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    ("qwen3_next", "tiny"): dict(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        intermediate_size=512,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    ("gpt_oss", "bench"): dict(
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        intermediate_size=1024,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=GPT_OSS_YARN,
        tie_word_embeddings=False,
    ),
    ("gpt_oss", "small"): dict(
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=4,
        intermediate_size=512,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=GPT_OSS_YARN,
        tie_word_embeddings=False,
    ),
}


def make_config(arch: str, size: str, layers: int | None = None):
    """The transformers config of ``arch`` at ``size`` (module docstring), with ``layers``
    layers when given."""
    if (arch, size) not in SIZES:
        raise ValueError(f"no size {size!r} for {arch}")
    kwargs = dict(SIZES[(arch, size)])
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        rotary = kwargs.pop("partial_rotary_factor")
        cfg = Qwen3NextConfig(**kwargs)
        # transformers 5 keeps the partial rotary factor inside rope_parameters
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope["partial_rotary_factor"] = rotary
        cfg.rope_parameters = rope
        cfg.partial_rotary_factor = rotary
    elif arch == "gpt_oss":
        from transformers import GptOssConfig

        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(n)]
        cfg = GptOssConfig(**kwargs)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    names = {"qwen3_next": "Qwen3NextForCausalLM", "gpt_oss": "GptOssForCausalLM"}
    cfg.architectures = [names[arch]]
    cfg.eos_token_id = None
    cfg.bos_token_id = None
    cfg.pad_token_id = None
    return cfg


def count_params(model: torch.nn.Module, cfg, arch: str) -> tuple[int, int]:
    """(total, active per token): active counts ``top_k / num_experts`` of the routed
    experts' weights."""
    total = sum(p.numel() for p in model.parameters())
    if arch == "qwen3_next":
        e, k = cfg.num_experts, cfg.num_experts_per_tok
    else:
        e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - routed + routed * k // e


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """A random float32 tensor for HF parameter ``name`` (module docstring's rules)."""
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith("norm.weight"):  # zero-centred (1 + w) norms
        return torch.zeros(shape, device=device)
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1, 16, generator=gen).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape, device=device)
    w = torch.randn(shape, generator=gen, device=device)
    if name.endswith("embed_tokens.weight"):
        return w
    return w / math.sqrt(shape[-1])


def write_fp8_direct(
    meta_model,
    cfg,
    out: Path,
    device: torch.device,
    seed: int,
    overflow: Path | None = None,
    keep_free: int = 2 << 30,
) -> None:
    """Write ``meta_model``'s parameters (a meta-device HF model: names and shapes only) as
    an FP8 checkpoint in the hub layout, one shard per layer plus one for the rest: each
    tensor drawn on ``device`` (:func:`_draw`), stacked experts split per expert, quantised
    there (:func:`unimem.models.fp8_checkpoint.quantize_tensors`), moved to the CPU and
    saved; ``model.safetensors.index.json`` and ``config.json`` (with its
    ``quantization_config``) beside them.

    ``overflow``: a directory on another filesystem (e.g. ``/dev/shm``) for the shards that
    would leave ``out``'s filesystem with less than ``keep_free`` bytes; each is written
    there and linked into ``out`` under its own name, so the checkpoint reads as one
    directory (a model larger than one disk). Without it such a shard fails with a clear
    error before anything of it is written."""
    from safetensors.torch import save_file

    from unimem.models.fp8_checkpoint import fp8_quantization_config, quantize_tensors

    gen = torch.Generator(device=device).manual_seed(seed)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, p in meta_model.named_parameters():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append((name, tuple(p.shape)))
    weight_map: dict[str, str] = {}
    unconverted: set[str] = set()
    total = 0
    for i, params in enumerate(groups.values()):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in params:
            w = _draw(name, shape, gen, device)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                base = name.rsplit(".", 1)[0]
                half = shape[1] // 2
                pieces = []
                for e in range(shape[0]):
                    if name.endswith("down_proj"):
                        pieces.append((f"{base}.{e}.down_proj.weight", w[e]))
                    else:
                        pieces.append((f"{base}.{e}.gate_proj.weight", w[e, :half]))
                        pieces.append((f"{base}.{e}.up_proj.weight", w[e, half:]))
            else:
                pieces = [(name, w)]
            for qname, qt in quantize_tensors(pieces):
                if qt.dtype == torch.float32 and not qname.endswith(
                    ("_scale_inv", "A_log", "dt_bias")
                ):
                    qt = qt.bfloat16()
                if qt.dim() == 2 and qt.dtype == torch.bfloat16 and qname.endswith(".weight"):
                    unconverted.add(qname[: -len(".weight")])  # a linear left in bf16
                tensors[qname] = qt.contiguous().cpu()
                weight_map[qname] = shard
            del w, pieces
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        target = out / shard
        if shutil.disk_usage(out).free - nbytes < keep_free:
            if overflow is None:
                raise SystemExit(
                    f"{shard} ({nbytes / 1e9:.2f} GB) would leave {out}'s disk with less than "
                    f"{keep_free / 1e9:.1f} GB free: pass --overflow-dir or fewer --layers"
                )
            overflow.mkdir(parents=True, exist_ok=True)
            target = overflow / shard
            if shutil.disk_usage(overflow).free - nbytes < keep_free:
                raise SystemExit(f"{shard} ({nbytes / 1e9:.2f} GB) fits neither {out} nor "
                                 f"{overflow}: fewer --layers")  # fmt: skip
            (out / shard).unlink(missing_ok=True)
            (out / shard).symlink_to(target.resolve())
        save_file(tensors, str(target), metadata={"format": "pt"})
        total += nbytes
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = cfg.to_dict()
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    config["quantization_config"] = fp8_quantization_config(unconverted)
    (out / "config.json").write_text(json.dumps(config, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", required=True, choices=["qwen3_next", "gpt_oss"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="bench", choices=["tiny", "small", "bench", "80b"])
    ap.add_argument("--layers", type=int, help="number of layers (default: the size's)")
    ap.add_argument("--fp8", action="store_true", help="write the hub's block-wise FP8 layout")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--overflow-dir",
        help="80b: shards that would leave --out's disk under 2 GB free go here (another "
        "filesystem, e.g. /dev/shm) and are linked into --out",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the weights' dtype (not with --fp8)",
    )
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from unimem.models.word_tokenizer import save_word_tokenizer

    if args.fp8 and args.arch != "qwen3_next":
        raise SystemExit("--fp8: only qwen3_next (gpt-oss ships MXFP4, and unimem's gpt-oss "
                         "does not run FP8)")  # fmt: skip
    t0 = time.perf_counter()
    cfg = make_config(args.arch, args.size, args.layers)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.size == "80b":
        if not args.fp8:
            raise SystemExit("--size 80b is written in FP8 only (add --fp8)")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        total, active = count_params(model, cfg, args.arch)
        t1 = time.perf_counter()
        overflow = Path(args.overflow_dir) if args.overflow_dir else None
        write_fp8_direct(model, cfg, out, torch.device(args.device), args.seed, overflow)
    else:
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
        total, active = count_params(model, cfg, args.arch)
        t1 = time.perf_counter()
        if args.fp8:
            from unimem.models.fp8_checkpoint import write_fp8_checkpoint

            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                model.save_pretrained(tmp, safe_serialization=True)
                write_fp8_checkpoint(tmp, out)
        else:
            model.save_pretrained(str(out), safe_serialization=True)
    save_word_tokenizer(out, cfg.vocab_size)
    t2 = time.perf_counter()
    info = {
        "arch": args.arch,
        "size": args.size,
        "layers": cfg.num_hidden_layers,
        "fp8": args.fp8,
        "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "architecture": cfg.architectures[0],
        "params": total,
        "active_params": active,
        "device": args.device,
        "overflow_shards": sum(f.is_symlink() for f in out.glob("*.safetensors")),
        "init_s": round(t1 - t0, 2),
        "save_s": round(t2 - t1, 2),
    }
    (out / "make_checkpoint.json").write_text(json.dumps(info, indent=1))
    print(
        f"{args.arch} ({args.size}): {total / 1e9:.3f} B parameters, {active / 1e9:.3f} B active "
        f"per token; init {t1 - t0:.1f} s on {args.device}, saved to {out} in {t2 - t1:.1f} s"
    )
    del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
