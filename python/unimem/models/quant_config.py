"""Which weights run in FP8, from a checkpoint's ``quantization_config`` and ``--quantization``.

Two sources, one representation (:mod:`unimem.models.fp8_linear`):

- **FP8 checkpoints** (the hub's layout): ``config.json`` carries ``quantization_config`` with
  ``quant_method: "fp8"``, ``weight_block_size: [128, 128]``, ``activation_scheme:
  "dynamic"`` and the modules left in bf16 (``modules_to_not_convert`` or
  ``ignored_layers``); every quantised linear ``X`` has ``X.weight`` (e4m3) and
  ``X.weight_scale_inv`` (float32, one scale per 128 x 128 block; the name is the hub's:
  the weight is ``q * scale``). Which linears are quantised is read from the checkpoint's
  tensor names (those with a ``weight_scale_inv``); everything else stays in the model dtype.
- **Online** (``--quantization fp8`` on a bf16 checkpoint, SGLang's flag): the linears of
  :data:`ONLINE_LINEARS` (attention, GDN input/output projections, dense MLPs, shared and
  routed experts — what the hub's FP8 checkpoints quantise) are quantised at load, block-wise
  ``[128, 128]`` like the checkpoints (not per output channel): one weight format, one GEMM
  kernel and the numbers of a hub checkpoint; per-block scales are at least as accurate as
  per-channel ones. Embeddings, the LM head, norms, routers, the shared-expert gate, the GDN
  ``in_proj_ba`` / ``in_proj_a`` / ``in_proj_b``, ``conv1d``, ``A_log`` and ``dt_bias`` stay.

Activations are quantised at run time per token and group of 128 (``activation_scheme:
dynamic``); a static activation scheme is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ONLINE_KEPT",
    "ONLINE_LINEARS",
    "QUANTIZATION_METHODS",
    "Fp8Config",
    "online_config",
    "resolve_quantization",
]

QUANTIZATION_METHODS = ("fp8",)
"""``--quantization`` values unimem implements."""

BLOCK = (128, 128)

ONLINE_LINEARS = re.compile(
    r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_expert\.(gate_proj|up_proj|down_proj))\.weight$"
    r"|\.mlp\.experts\.(gate_up_proj|down_proj)$"
)
"""Parameter names quantised by ``--quantization fp8`` on a bf16 checkpoint."""

ONLINE_KEPT: dict[str, tuple[str, ...]] = {"Gemma3ForCausalLM": ("gate_proj", "up_proj", "o_proj")}
"""Per model class, the module patterns (:attr:`Fp8Config.ignored`) that online FP8 keeps in
the model dtype besides what :data:`ONLINE_LINEARS` leaves out: the most FP8 weight whose
greedy tokens still agree with the model's float32 self at the accuracy goal (chosen by
measurement, ``docs/fp8.md`` and ``docs/decisions.md``)."""


@dataclass(frozen=True)
class Fp8Config:
    """Block-wise FP8 weights. ``from_checkpoint``: the checkpoint stores them (its
    ``weight_scale_inv`` tensors name the quantised linears); otherwise they are quantised
    at load (:data:`ONLINE_LINEARS`). ``ignored``: module-name patterns kept in the model
    dtype (the checkpoint's ``modules_to_not_convert`` / ``ignored_layers``): a pattern
    matches a parameter whose module path equals it, ends with ``.pattern`` or contains
    ``pattern.``."""

    from_checkpoint: bool
    ignored: tuple[str, ...] = ()

    def skips(self, param_name: str) -> bool:
        """Whether ``param_name`` belongs to a module the config keeps unquantised."""
        module = param_name.rsplit(".", 1)[0]
        for pat in self.ignored:
            if module == pat or module.endswith("." + pat) or f"{pat}." in param_name:
                return True
        return False

    def online_quantizes(self, param_name: str) -> bool:
        """Whether ``--quantization fp8`` quantises parameter ``param_name`` at load."""
        return bool(ONLINE_LINEARS.search(param_name)) and not self.skips(param_name)


MODEL_OWN_METHODS = ("mxfp4",)
"""Quantisation methods a model family loads itself (dequantised at load), not FP8 linears."""


def _get(cfg, key, default=None):
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def checkpoint_fp8_config(hf_config) -> Fp8Config | None:
    """The checkpoint's FP8 config, None without ``quantization_config``; ValueError naming
    the field for a method or layout unimem does not load."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and _get(qc, "quant_method") in MODEL_OWN_METHODS:
        return None  # the model's own loader handles it (gpt-oss's MXFP4 experts)
    if qc is None:
        return None
    method = _get(qc, "quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (only 'fp8')"
        )
    fmt = _get(qc, "fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)")
    block = _get(qc, "weight_block_size")
    if block is None or tuple(int(b) for b in block) != BLOCK:
        raise ValueError(
            f"quantization_config.weight_block_size {block!r} is not supported (only "
            f"[128, 128]; per-tensor FP8 checkpoints are not loaded)"
        )
    scheme = _get(qc, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme {scheme!r} is not supported (only dynamic)"
        )
    ignored = list(_get(qc, "modules_to_not_convert") or []) + list(
        _get(qc, "ignored_layers") or []
    )
    return Fp8Config(from_checkpoint=True, ignored=tuple(ignored))


def online_config(model_class_name: str) -> Fp8Config:
    """The online FP8 config for a model class (:data:`ONLINE_KEPT`)."""
    return Fp8Config(from_checkpoint=False, ignored=ONLINE_KEPT.get(model_class_name, ()))


def resolve_quantization(
    hf_config, quantization: str | None, model_class_name: str = ""
) -> Fp8Config | None:
    """The FP8 config to load with: the checkpoint's when it has one (``quantization``
    None or ``"fp8"``), online FP8 (:func:`online_config` of ``model_class_name``) for
    ``"fp8"`` on an unquantised checkpoint, None for neither; ValueError for an unknown
    method."""
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), "
            f"got {quantization!r}"
        )
    stored = checkpoint_fp8_config(hf_config)
    if stored is not None:
        return stored
    if quantization == "fp8":
        return online_config(model_class_name)
    return None
