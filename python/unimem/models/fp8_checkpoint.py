"""Write block-wise FP8 checkpoints in the hub's layout (as Qwen3-Next-80B-A3B-Instruct-FP8).

:func:`quantize_tensors` turns a stream of ``(name, tensor)`` checkpoint tensors into the FP8
layout: every linear weight :func:`hub_quantizes` (attention q/k/v/o, the GDN ``in_proj_qkvz``
/ ``in_proj_qkv`` / ``in_proj_z`` and ``out_proj``, dense MLPs, shared experts, routed
experts per expert) becomes ``name`` (``float8_e4m3fn``) plus ``name + "_scale_inv"``
(float32 ``[ceil(N/128), ceil(K/128)]``, the weight being ``q * scale`` per block); every
other tensor passes unchanged. :func:`fp8_quantization_config` is the ``quantization_config``
entry of ``config.json`` naming the linear modules left unconverted
(``modules_to_not_convert``). :func:`write_fp8_checkpoint` converts a whole checkpoint
directory (used by the checkpoint-writing tool with ``--fp8`` and by the tests).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from unimem.models.fp8_linear import SCALE_SUFFIX, quantize_blocks
from unimem.models.quant_config import ONLINE_LINEARS

__all__ = [
    "fp8_quantization_config",
    "hub_quantizes",
    "quantize_tensors",
    "write_fp8_checkpoint",
]

PER_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def hub_quantizes(name: str, tensor: torch.Tensor) -> bool:
    """Whether the hub's FP8 checkpoints store checkpoint tensor ``name`` in FP8."""
    if tensor.dim() < 2 or not tensor.is_floating_point():
        return False
    return bool(ONLINE_LINEARS.search(name) or PER_EXPERT_WEIGHT.search(name))


def quantize_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The FP8 checkpoint's tensors of ``tensors`` (module docstring)."""
    for name, t in tensors:
        if hub_quantizes(name, t):
            q, s = quantize_blocks(t)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


def fp8_quantization_config(unconverted: Iterable[str]) -> dict:
    """``config.json``'s ``quantization_config`` of an FP8 checkpoint whose linear modules
    ``unconverted`` stay in the model dtype."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": sorted(unconverted),
    }


def _unconverted(name: str, t: torch.Tensor) -> str | None:
    """The module name of a matrix weight that stays unquantised, else None."""
    if t.dim() == 2 and name.endswith(".weight") and not hub_quantizes(name, t):
        return name[: -len(".weight")]
    return None


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> dict:
    """Convert checkpoint directory ``src`` (safetensors shards, ``config.json``) into an FP8
    one at ``dst``: the same shard files with :func:`quantize_tensors` applied (the index
    rewritten), ``quantization_config`` added to ``config.json``, every other file copied.
    Returns the quantisation config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from unimem.models.loader import INDEX_FILE, checkpoint_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    unconverted: set[str] = set()
    for file in checkpoint_files(src):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                kept = _unconverted(name, t)
                if kept is not None:
                    unconverted.add(kept)
                for qname, qt in quantize_tensors([(name, t)]):
                    out[qname] = qt.contiguous()
                    weight_map[qname] = file.name
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
    if (src / INDEX_FILE).is_file():
        total = sum((dst / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=1))
    for extra in src.iterdir():
        skip = extra.suffix == ".safetensors" or extra.name in (INDEX_FILE, "config.json")
        if extra.is_file() and not skip:
            shutil.copy2(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config(unconverted)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return config["quantization_config"]
