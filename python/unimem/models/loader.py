"""Load a HuggingFace-format checkpoint directory into a :class:`~unimem.models.base.CausalLM`.

A checkpoint directory holds ``config.json``, one or many ``*.safetensors`` shards (several:
named by ``model.safetensors.index.json``), optionally ``generation_config.json`` and the
tokenizer files. Everything is read from the directory: loading never touches the network.

:func:`load_model` reads the config through ``transformers.AutoConfig``, picks the class for
``config.architectures[0]`` from :mod:`unimem.models.registry`, builds it with uninitialised
parameters of the target dtype on the target device, and streams every shard's tensors
(``safetensors.safe_open`` straight onto the device) through the model's ``load_weights``
— for a tensor-parallel rank only the slice of each tensor it holds
(``CausalLM.checkpoint_shard``, read through ``get_slice``).
Then every parameter must have been filled — ``lm_head.weight`` is tied to the input
embedding when the config says ``tie_word_embeddings`` and the checkpoint has none.

Every function here takes a model path as :func:`unimem.models.model_path.resolve_model_path`
does: a checkpoint directory, a GGUF file (converted once, cached), an embedded model's name,
or None for the default model.

Errors are one line naming the problem (:class:`CheckpointError`, a ``ValueError``): no
config, a missing shard, an unsupported architecture, an unexpected tensor, a tensor of the
wrong shape, a tensor the checkpoint lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unimem.models import fp8_convert
from unimem.models.base import CausalLM
from unimem.models.model_path import resolve_model_path
from unimem.models.quant_config import resolve_quantization
from unimem.models.registry import model_class
from unimem.models.tensor_parallel import SINGLE, TensorParallel

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "checkpoint_files",
    "copy_param",
    "load_checkpoint",
    "load_hf_config",
    "load_model",
    "resolve_dtype",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor ``name`` into ``param`` (cast to its dtype and device), after
    checking the shape; :class:`CheckpointError` naming the tensor on a mismatch."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(
            f"tensor {name}: shape {tuple(tensor.shape)} in the checkpoint, "
            f"expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(device=param.device, dtype=param.dtype))


def load_hf_config(path: str | os.PathLike):
    """``transformers.AutoConfig`` of the checkpoint directory (local files only)."""
    from transformers import AutoConfig

    root = Path(resolve_model_path(path))
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: no config.json (not a HuggingFace checkpoint directory)")
    return AutoConfig.from_pretrained(str(root), local_files_only=True)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors shards of the checkpoint: those ``model.safetensors.index.json`` names,
    else ``model.safetensors``, else every ``*.safetensors``. A shard the index names but the
    directory lacks is an error naming it."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (root / name).is_file():
                raise CheckpointError(f"{root}: shard {name} named by {INDEX_FILE} is missing")
        return [root / name for name in files]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weights")
    return files


def iter_checkpoint(
    files: Sequence[Path],
    device: torch.device,
    skip_prefixes: Sequence[str] = (),
    model: CausalLM | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of the shards, read onto ``device``, except names
    starting with one of ``skip_prefixes``. With a tensor-parallel ``model``, only the part
    its :meth:`~unimem.models.base.CausalLM.checkpoint_shard` names is read."""
    from safetensors import safe_open

    dev = "cpu" if device.type == "cpu" else str(device)
    sharded = model is not None and model.tp.size > 1
    for file in files:
        with safe_open(str(file), framework="pt", device=dev) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(tuple(skip_prefixes)):
                    continue
                if sharded:
                    sliced = f.get_slice(name)
                    part = model.checkpoint_shard(name, tuple(sliced.get_shape()))
                    if part is not None:
                        yield name, part.read(sliced)
                        continue
                yield name, f.get_tensor(name)


def resolve_dtype(dtype: str | torch.dtype | None, hf_config, device: torch.device) -> torch.dtype:
    """The compute dtype: an explicit dtype (``torch.dtype`` or ``"bfloat16"``,
    ``"float16"``, ``"float32"``, ``"float64"``), or ``"auto"``/None: the checkpoint's dtype,
    except that a float32 checkpoint runs in bfloat16 on CUDA (as SGLang's ``auto`` picks a
    16-bit type for 32-bit checkpoints)."""
    names = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp16": torch.float16,
        "float32": torch.float32,
        "float": torch.float32,
        "fp32": torch.float32,
        "float64": torch.float64,
    }
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        try:
            return names[dtype]
        except KeyError:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(sorted(names))}, got {dtype!r}"
            ) from None
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = names.get(stored, torch.float32)
    if stored is None or stored == torch.float32:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return stored


def load_weights_into(
    model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]], tie_embeddings: bool, where: str
) -> None:
    """Feed ``weights`` to ``model.load_weights`` and check that every parameter was
    filled, tying ``lm_head.weight`` to the embedding when ``tie_embeddings`` and the
    checkpoint has none."""
    filled = set(model.load_weights(weights))
    params = dict(model.named_parameters(remove_duplicate=False))
    if tie_embeddings and "lm_head.weight" in params and "lm_head.weight" not in filled:
        params["lm_head.weight"].data = model.embed_weight.data
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing tensor(s) {', '.join(missing[:5])}{more}")


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")
"""The ``generation_config.json`` fields that give a request's sampling defaults (SGLang's
``--sampling-defaults model``)."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model, its HF config, the tokenizer (None if the directory
    has none), the token ids that end a generation (from ``generation_config.json``,
    else the config, else the tokenizer) and the sampling defaults its
    ``generation_config.json`` gives (:func:`sampling_defaults`)."""

    path: Path
    model: CausalLM
    hf_config: object
    tokenizer: object | None
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict = field(default_factory=dict)


def sampling_defaults(path: str | os.PathLike) -> dict:
    """``temperature``, ``top_p``, ``top_k``, ``min_p`` as the directory's
    ``generation_config.json`` sets them (absent or null fields left out; no file: ``{}``)."""
    gen = Path(path) / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        data = json.loads(gen.read_text())
    except ValueError as e:
        raise CheckpointError(f"{gen}: not JSON ({e})") from None
    return {k: data[k] for k in SAMPLING_DEFAULT_KEYS if data.get(k) is not None}


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_context: int | None = None,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> CausalLM:
    """The model of checkpoint directory ``path`` (module docstring); with ``tp``, rank
    ``tp.rank``'s shard of it, read from the shards' slices. FP8 linears (an FP8
    checkpoint's, or all eligible ones with ``quantization="fp8"``) are set up by
    :mod:`unimem.models.fp8_convert` (:mod:`unimem.models.quant_config` says which)."""
    root = Path(resolve_model_path(path))
    hf_config = load_hf_config(root)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise CheckpointError(f"{root}/config.json names no architecture ('architectures')")
    cls = model_class(archs[0])
    dev = torch.device(device)
    fp8 = resolve_quantization(hf_config, quantization, cls.__name__)
    # FP8: parameters allocated once, after the FP8 ones are known (never in bf16 first)
    with fp8_convert.deferred_weights() if fp8 is not None else contextlib.nullcontext():
        model = cls.from_hf_config(
            hf_config,
            dtype=resolve_dtype(dtype, hf_config, dev),
            device=dev,
            max_context=max_context,
            tp=tp,
        )
    files = checkpoint_files(root)
    weights = iter_checkpoint(files, dev, cls.ignored_checkpoint_prefixes, model)
    if fp8 is not None:
        names, _ = fp8_convert.prepare(model, fp8, files, dev)
        weights = fp8_convert.fp8_weight_stream(model, fp8, names, weights)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    load_weights_into(model, weights, tie, str(root))
    if fp8 is not None:
        fp8_convert.attach_block_scales(model)  # the FP8 weights' block tables, once filled
    return model.eval()


def load_tokenizer(path: str | os.PathLike):
    """``transformers.AutoTokenizer`` of the directory, or None when it has no tokenizer
    files."""
    from transformers import AutoTokenizer

    root = Path(resolve_model_path(path))
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((root / n).is_file() for n in names):
        return None
    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def eos_token_ids(path: str | os.PathLike, hf_config, tokenizer) -> tuple[int, ...]:
    """Token ids that end a generation: ``generation_config.json``'s ``eos_token_id``, else
    the model config's, else the tokenizer's (an int or a list in each)."""
    gen = Path(path) / "generation_config.json"
    value = None
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is None and tokenizer is not None:
        value = tokenizer.eos_token_id
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def load_checkpoint(
    path: str | os.PathLike | None,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_context: int | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> Checkpoint:
    """Model (rank ``tp.rank``'s shard), config, tokenizer (from ``tokenizer_path`` or
    ``path``) and EOS ids of a checkpoint directory."""
    root = Path(resolve_model_path(path))
    tokenizer_path = None if tokenizer_path is None else resolve_model_path(tokenizer_path)
    model = load_model(
        root, dtype=dtype, device=device, max_context=max_context, tp=tp,
        quantization=quantization,
    )  # fmt: skip
    hf_config = load_hf_config(root)
    tokenizer = load_tokenizer(tokenizer_path or root)
    eos = eos_token_ids(root, hf_config, tokenizer)
    return Checkpoint(root, model, hf_config, tokenizer, eos, sampling_defaults(root))
