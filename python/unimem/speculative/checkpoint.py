"""DSPARK drafter checkpoints: a directory with ``config.json`` and ``model.safetensors``.

``config.json`` holds the :class:`~unimem.speculative.drafter.DraftConfig` fields (the target
layers it reads, its layer hosts and shapes, window, Markov rank, the ``gamma`` it was trained
for, dtype — by name, e.g. ``"float64"`` — and the target's ``vocab_size`` / ``d_model`` it
fits) plus ``"format": "unimem-dspark-drafter"``. ``model.safetensors`` holds the drafter's own
parameters by their module names (``fc``, ``layers.0.qkv_proj``, ``markov_u``, ...) and,
for a reduced draft vocabulary, ``d2t`` (int64, draft id to target id); the target's
embedding and LM head, which the drafter shares, are never written. With ``fp8_weights``
(:func:`save_drafter`) the projection matrices (:data:`FP8_MATRICES`: each layer's
``qkv_proj``, ``o_proj``, ``gate_up``, ``down`` and the context's ``fc``) are stored as
float8 e4m3 with one float32 scale per row, ``<name>.row_scale`` (the row's largest
magnitude / 448), and dequantised to the drafter's dtype at load: half the bytes of bf16
for the bulk of the weights, so a deeper drafter fits the shipped size limit. Norms, the
mask embedding, the Markov tables and the confidence head stay as they are.

:func:`load_drafter` rebuilds the drafter on a target and refuses, with a ``ValueError``
naming the field or tensor, a checkpoint that does not fit it: a different ``vocab_size`` or
``d_model``, a target layer index out of range, an SWA window larger than the target's, a
missing, unexpected or wrongly shaped tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from unimem.models.base import CausalLM
from unimem.speculative.drafter import DraftConfig, DsparkDrafter

__all__ = [
    "CONFIG_NAME",
    "FORMAT",
    "FP8_MATRICES",
    "ROW_SCALE",
    "WEIGHTS_NAME",
    "load_drafter",
    "save_drafter",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "unimem-dspark-drafter"

FP8_MATRICES = ("qkv_proj", "o_proj", "gate_up", "down", "fc")
"""Last name components of the parameters ``save_drafter(..., fp8_weights=True)`` stores in
float8 (module docstring)."""
ROW_SCALE = ".row_scale"
"""Suffix of a float8 matrix's per-row float32 scale tensor."""
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_FIELDS = {f.name: f for f in dataclasses.fields(DraftConfig)}


def config_to_dict(config: DraftConfig) -> dict:
    """The JSON form of ``config`` (tuples as lists, dtype by name)."""
    out = {"format": FORMAT}
    for name in _FIELDS:
        value = getattr(config, name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[name] = value
    return out


def config_from_dict(d: dict, dtype: torch.dtype | None = None) -> DraftConfig:
    """A :class:`DraftConfig` from its JSON form (``dtype`` overrides the stored one).
    ``ValueError`` naming the field for an unknown, missing or invalid one."""
    if d.get("format") != FORMAT:
        raise ValueError(f"config.json format must be {FORMAT!r}, got {d.get('format')!r}")
    kwargs = {}
    for name, value in d.items():
        if name == "format":
            continue
        if name not in _FIELDS:
            raise ValueError(f"config.json: unknown field {name!r}")
        if name == "dtype":
            if value not in _DTYPES:
                raise ValueError(
                    f"config.json: dtype must be one of {sorted(_DTYPES)}, got {value!r}"
                )
            value = _DTYPES[value]
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    required = [
        n
        for n, f in _FIELDS.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise ValueError(f"config.json: missing field(s) {missing}")
    if dtype is not None:
        kwargs["dtype"] = dtype
    return DraftConfig(**kwargs)


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [R, C] float8 e4m3, scale [R] float32)`` with ``q * scale[:, None]`` ~ ``w``:
    each row scaled so that its largest magnitude maps to 448 (a row of zeros: scale 1)."""
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    return (w32 / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale


def save_drafter(
    drafter: DsparkDrafter, path: str | os.PathLike, *, fp8_weights: bool = False
) -> None:
    """Write ``drafter`` as a checkpoint directory ``path`` (created if needed; its
    ``config.json`` and ``model.safetensors`` are overwritten). ``fp8_weights``: the
    :data:`FP8_MATRICES` in float8 with per-row scales (module docstring)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in drafter.state_dict().items():
        t = t.detach().to("cpu")
        if fp8_weights and name.rsplit(".", 1)[-1] in FP8_MATRICES:
            q, scale = fp8_rows(t)
            tensors[name], tensors[name + ROW_SCALE] = q.contiguous(), scale.contiguous()
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": FORMAT})
    with open(out / CONFIG_NAME, "w") as f:
        json.dump(config_to_dict(drafter.config), f, indent=2)
        f.write("\n")


def read_config(path: str | os.PathLike, dtype: torch.dtype | None = None) -> DraftConfig:
    """The :class:`DraftConfig` of the checkpoint directory ``path``."""
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise ValueError(f"drafter checkpoint {path}: no {CONFIG_NAME} there")
    with open(cfg_path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"drafter checkpoint {path}: {CONFIG_NAME} is not JSON ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"drafter checkpoint {path}: {CONFIG_NAME} must hold an object")
    return config_from_dict(d, dtype)


def check_fits(config: DraftConfig, target: CausalLM) -> None:
    """``ValueError`` naming the field unless a drafter of ``config`` fits ``target``."""
    c = target.config
    for name in ("vocab_size", "d_model"):
        ours, theirs = getattr(config, name), getattr(c, name)
        if ours != theirs:
            raise ValueError(
                f"drafter {name} {ours} does not fit the target's {name} {theirs} (the "
                "embedding and LM head are shared)"
            )
    for i in config.target_layers:
        if i >= c.num_layers:
            raise ValueError(
                f"drafter target_layers: layer index {i} out of range for a target of "
                f"{c.num_layers} layers"
            )
    if "swa" in config.layer_hosts:
        window = c.window if "swa" in c.layer_pattern else None
        if window is None or config.window > window:
            raise ValueError(
                f"drafter window {config.window} is larger than the target's SWA window "
                f"({window}): retirement would free pages the drafter still reads"
            )
    window = c.window if "swa" in c.layer_pattern else None
    config.check_target(c.vocab_size, c.d_model, c.num_layers, window)


def load_drafter(
    path: str | os.PathLike,
    target_model: CausalLM,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DsparkDrafter:
    """The drafter saved in directory ``path``, sharing ``target_model``'s embedding and LM
    head, on ``device`` (default: the target's; another device gets copies of the shared
    tensors) in ``dtype`` (default: the checkpoint's; weights are cast). ``ValueError``
    naming the field or tensor if it does not fit the target (module docstring).
    ``shared``: the ``(embedding, LM head)`` to share instead of the target's own (a
    tensor-parallel target holds only its vocabulary rows: the full tables are passed)."""
    config = read_config(path, dtype)
    check_fits(config, target_model)
    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        raise ValueError(f"drafter checkpoint {path}: no {WEIGHTS_NAME} there")
    dev = target_model.device if device is None else torch.device(device)
    embed, lm_head = shared or (target_model.embed_weight, target_model.lm_head_weight)
    if embed.device != dev:
        embed, lm_head = embed.to(dev), lm_head.to(dev)
    with safe_open(str(weights), framework="pt") as f:
        d2t = None
        stored = set(f.keys())
        if config.reduced:
            if "d2t" not in stored:
                raise ValueError(
                    f"drafter checkpoint {path}: missing tensor 'd2t' (the draft vocabulary "
                    "map of a drafter with draft_vocab_size)"
                )
            d2t = f.get_tensor("d2t")
        try:
            drafter = DsparkDrafter(config, embed, lm_head, d2t=d2t)
        except ValueError as e:
            raise ValueError(f"drafter checkpoint {path}: {e}") from None
        params = dict(drafter.named_parameters())
        names = stored - ({"d2t"} if config.reduced else set())
        scales = {n for n in names if n.endswith(ROW_SCALE) and n[: -len(ROW_SCALE)] in names}
        names -= scales
        missing = sorted(set(params) - names)
        if missing:
            raise ValueError(f"drafter checkpoint {path}: missing tensor {missing[0]!r}")
        unexpected = sorted(names - set(params))
        if unexpected:
            raise ValueError(f"drafter checkpoint {path}: unexpected tensor {unexpected[0]!r}")
        for name, p in params.items():
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"drafter checkpoint {path}: tensor {name!r} has shape {tuple(t.shape)}, "
                    f"the config needs {tuple(p.shape)}"
                )
            if t.dtype == _FP8:
                t = _dequantised(f, stored, name, t, path)
            elif name + ROW_SCALE in scales:
                raise ValueError(
                    f"drafter checkpoint {path}: tensor {name + ROW_SCALE!r} scales "
                    f"{name!r}, which is {t.dtype}, not float8"
                )
            # copied into the parameter's own (aligned) storage: a tensor read from the file
            # may sit at another alignment, and CPU GEMMs may round differently for it
            p.data.copy_(t)
    return drafter


def _dequantised(f, stored: set[str], name: str, q: torch.Tensor, path) -> torch.Tensor:
    """The float32 values of float8 matrix ``name`` stored in the open file ``f`` with its
    per-row scale; ``ValueError`` naming the tensor if the scale is missing or misshapen."""
    if q.dim() != 2 or name + ROW_SCALE not in stored:
        raise ValueError(
            f"drafter checkpoint {path}: float8 tensor {name!r} needs a 2-D shape and its "
            f"per-row scale {name + ROW_SCALE!r}"
        )
    scale = f.get_tensor(name + ROW_SCALE)
    if tuple(scale.shape) != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(
            f"drafter checkpoint {path}: tensor {name + ROW_SCALE!r} must be float32 "
            f"[{q.shape[0]}], got {scale.dtype} {tuple(scale.shape)}"
        )
    return q.float() * scale[:, None]
