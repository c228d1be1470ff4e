"""Turning a model's linears into FP8 parameters: at load (from an FP8 checkpoint or
quantised on the way in) or after loading (online quantisation of a built model). The
format and the products are :mod:`unimem.models.fp8_linear`.

Loading (:func:`prepare`, called by :func:`unimem.models.loader.load_model`): the model is
built under :func:`deferred_weights` (parameters on the meta device) and :func:`materialize`
allocates each parameter once — the chosen ones (:func:`quantized_param_names`) as empty FP8
ones plus scales — and re-stacks :class:`~unimem.models.stacked_linear.StackedRows` (a model
built normally is converted by :func:`convert_params`);
:func:`fp8_weight_stream` wraps the checkpoint's ``(name, tensor)`` stream: block scales are
expanded to rows (the weight's row count is taken from the weight, which may come before or
after its scales), and with online quantisation each chosen bf16 weight is quantised
block-wise (:func:`~unimem.models.fp8_linear.quantize_blockwise`) and followed by its scales.

Online (:func:`quantize_model_online`): a model whose weights are loaded already is
quantised in place (:func:`quantize_in_place`).

Block tables (:func:`attach_block_scales`, once the FP8 weights and scales are filled: by
:func:`unimem.models.loader.load_model` after the checkpoint stream, by
:func:`quantize_in_place` at its end): each 2-D FP8 weight whose row scales are uniform over
every 128-row block gets its ``[ceil(N/128), KG]`` block table as a non-persistent buffer
(:mod:`unimem.models.fp8_linear`), each FP8 run of a
:class:`~unimem.models.stacked_linear.StackedRows` the table of its stack.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from unimem.models.fp8_linear import (
    BLOCKS_SUFFIX,
    SCALE_SUFFIX,
    collapse_block_scales,
    expand_block_scales,
    quantize_blockwise,
)
from unimem.models.quant_config import Fp8Config, online_config
from unimem.models.stacked_linear import stacks_of
from unimem_kernel.fp8_gemm import FP8_DTYPE, num_groups

__all__ = [
    "FP8_MODELS",
    "SYNTHETIC_LINEARS",
    "attach_block_scales",
    "check_supported",
    "checkpoint_keys",
    "convert_params",
    "deferred_weights",
    "fp8_weight_stream",
    "materialize",
    "prepare",
    "quantize_in_place",
    "quantize_model_online",
    "quantized_param_names",
    "synthetic_fp8_names",
]

PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
"""A per-expert checkpoint weight (hub layout): group 1 the experts' module, 3 the projection."""


def _param_name(model: nn.Module, ckpt_name: str) -> str:
    mapped = getattr(model, "_param_name", None)
    return mapped(ckpt_name) if mapped is not None else ckpt_name


def _target_param(model: nn.Module, ckpt_name: str) -> str:
    """The parameter a checkpoint weight fills: its own, or the stacked experts' tensor of a
    per-expert piece."""
    pname = _param_name(model, ckpt_name)
    m = PER_EXPERT.match(pname)
    if m is not None:
        return f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
    return pname


def checkpoint_keys(files: Sequence[Path]) -> list[str]:
    """Every tensor name of the safetensors shards (headers only)."""
    from safetensors import safe_open

    keys: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys.extend(f.keys())
    return keys


def quantized_param_names(model: nn.Module, cfg: Fp8Config, keys: Iterable[str]) -> set[str]:
    """The parameters that hold FP8 weights: for an FP8 checkpoint those whose checkpoint
    tensor has a ``weight_scale_inv`` (names in ``keys``), else those
    :meth:`Fp8Config.online_quantizes` chooses among ``model``'s parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if cfg.from_checkpoint:
        out = set()
        for key in keys:
            if key.endswith(".weight" + SCALE_SUFFIX):
                target = _target_param(model, key[: -len(SCALE_SUFFIX)])
                if target in params:
                    out.add(target)
        return out
    return {n for n, p in params.items() if p.dim() >= 2 and cfg.online_quantizes(n)}


def convert_params(model: nn.Module, names: Iterable[str]) -> None:
    """Replace each named parameter by an empty FP8 one of the same shape plus its float32
    ``<leaf>_scale_inv [..., N, KG]`` on the same module, then re-stack every
    :class:`~unimem.models.stacked_linear.StackedRows`. The bf16 storage is freed once
    nothing else holds it."""
    for name in sorted(names):
        path, leaf = name.rsplit(".", 1)
        module = model.get_submodule(path)
        old = getattr(module, leaf)
        if old.dim() < 2:
            raise ValueError(f"{name}: only matrices (or stacks of them) run in FP8")
        dev = old.device
        setattr(module, leaf, nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=dev),
                                           requires_grad=False))  # fmt: skip
        scale = torch.empty(*old.shape[:-1], num_groups(old.shape[-1]), device=dev)
        module.register_parameter(leaf + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))
        del old
    for stack in stacks_of(model):
        stack.regroup()
    _release_cached_memory(model)


def quantize_in_place(model: nn.Module, names: Iterable[str]) -> None:
    """Quantise the filled parameters ``names`` block-wise
        (:func:`~unimem.models.fp8_linear.quantize_blockwise`) into FP8 parameters with scales,
    as :func:`convert_params` lays them out (for models built with their weights, e.g. the
    synthetic presets)."""
    for name in sorted(names):
        path, leaf = name.rsplit(".", 1)
        module = model.get_submodule(path)
        q, s = quantize_blockwise(getattr(module, leaf).detach())
        setattr(module, leaf, nn.Parameter(q, requires_grad=False))
        module.register_parameter(leaf + SCALE_SUFFIX, nn.Parameter(s, requires_grad=False))
    for stack in stacks_of(model):
        stack.regroup()
    attach_block_scales(model)
    _release_cached_memory(model)


def attach_block_scales(model: nn.Module) -> list[str]:
    """After the FP8 weights and scales of ``model`` are filled: register on each module
    with a 2-D FP8 parameter ``<leaf>`` (and its ``<leaf>_scale_inv [N, KG]``) the
    non-persistent buffer ``<leaf>_scale_blocks [ceil(N/128), KG]`` float32, the scales
    collapsed to one per 128 x 128 block, the last one possibly short
    (:func:`~unimem.models.fp8_linear.collapse_block_scales`), where ``K`` is a multiple of
    128 and every 128-row block's rows have the same scales — checked, not assumed: a
    model's row re-layout may cross block boundaries. Any other FP8 weight (and the stacked
    experts, ``[E, N, K]``: grouped products stay on the Triton kernel) gets none, and
    loses a stale one. Then each
    :class:`~unimem.models.stacked_linear.StackedRows` does the same for its FP8 runs.
    The tables live beside the scales (same device), are owned by their module and are
    not parameters (:func:`~unimem.models.fp8_linear.weight_bytes` and the state dict are
    unchanged). Reads the scales on the host. Returns the buffers' names."""
    names = []
    for path, module in model.named_modules():
        for leaf, p in list(module._parameters.items()):
            scale = module._parameters.get(leaf + SCALE_SUFFIX)
            if p is None or scale is None:
                continue
            table = None
            if p.dtype == FP8_DTYPE and p.dim() == 2:
                table = collapse_block_scales(scale.detach(), p.shape[-1])
            name = leaf + BLOCKS_SUFFIX
            if table is None:
                module._buffers.pop(name, None)
                continue
            module.register_buffer(name, table, persistent=False)
            names.append(f"{path}.{name}" if path else name)
    for stack in stacks_of(model):
        stack.attach_block_scales()
    return names


def _release_cached_memory(model: nn.Module) -> None:
    """Hand the freed model-dtype weights back to the driver (the engine sizes its pools
    from ``torch.cuda.mem_get_info``, which counts the caching allocator's free blocks as
    used)."""
    p = next(model.parameters(), None)
    if p is not None and p.is_cuda:
        torch.cuda.empty_cache()


SYNTHETIC_LINEARS = ("qkv_proj", "o_proj", "in_proj", "out_proj", "gate_up", "down")
"""The synthetic presets' projections (:mod:`unimem.models.synthetic`) that run in FP8 with
``--quantization fp8`` (the GDN ``in_proj`` whole: it holds ``b`` and ``a`` too)."""


def synthetic_fp8_names(model: nn.Module) -> set[str]:
    """The parameters of a synthetic model that ``--quantization fp8`` quantises."""
    return {
        n
        for n, p in model.named_parameters()
        if p.dim() == 2 and n.rsplit(".", 1)[-1] in SYNTHETIC_LINEARS
    }


def fp8_weight_stream(
    model: nn.Module,
    cfg: Fp8Config,
    quantized: set[str],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream for a model after :func:`convert_params` (module docstring).
    ValueError naming the tensor for an FP8 weight the model holds in its own dtype, or a
    scale whose weight never came."""
    rows: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            wname = name[: -len(SCALE_SUFFIX)]
            if wname in rows:
                yield name, expand_block_scales(tensor, rows[wname])
            else:
                pending[wname] = tensor
            continue
        target = _target_param(model, name)
        if target not in quantized:
            if tensor.dtype == FP8_DTYPE:
                raise ValueError(
                    f"tensor {name}: FP8 in the checkpoint but its parameter is not quantised"
                )
            yield name, tensor
            continue
        if cfg.from_checkpoint:
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(f"tensor {name}: {tensor.dtype}, expected float8_e4m3fn")
            rows[name] = tensor.shape[-2]
            yield name, tensor
            if name in pending:
                yield name + SCALE_SUFFIX, expand_block_scales(pending.pop(name), rows[name])
        else:
            q, s = quantize_blockwise(tensor)
            yield name, q
            yield name + SCALE_SUFFIX, s
    if pending:
        raise ValueError(f"tensor {next(iter(pending))}{SCALE_SUFFIX}: its weight is missing")


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` allocates on the meta device (nothing else changes)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Build a model inside this block to get its parameters (every ``torch.empty`` tensor:
    parameters and :class:`~unimem.models.stacked_linear.StackedRows` stacks) on the meta
    device, with nothing allocated; computed buffers (rotary tables, zeros) are real.
    :func:`materialize` then allocates each parameter once, FP8 where chosen — so an FP8
    model's load never holds its model-dtype size."""
    with _EmptyOnMeta():
        yield


def materialize(model: nn.Module, device: torch.device, quantized: Iterable[str]) -> None:
    """Allocate every meta parameter of ``model`` (built under :func:`deferred_weights`)
    empty on ``device``: those named in ``quantized`` in e4m3 with their ``<leaf>_scale_inv
    [..., N, KG]`` float32 scales, the others in their dtype (tied parameters stay one);
    then re-stack the :class:`~unimem.models.stacked_linear.StackedRows`. ValueError naming
    a tensor still on the meta device afterwards."""
    quantized = set(quantized)
    new: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            name = f"{path}.{leaf}" if path else leaf
            if id(p) not in new:
                fp8 = name in quantized
                data = torch.empty(p.shape, dtype=FP8_DTYPE if fp8 else p.dtype, device=device)
                new[id(p)] = nn.Parameter(data, requires_grad=False)
                if fp8:
                    scale = torch.empty(*p.shape[:-1], num_groups(p.shape[-1]), device=device)
                    module.register_parameter(
                        leaf + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False)
                    )
            setattr(module, leaf, new[id(p)])
    for stack in stacks_of(model):
        stack.regroup()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"{name}: still on the meta device after materialising the model")


def prepare(
    model: nn.Module, cfg: Fp8Config, files: Sequence[Path], device: torch.device | None = None
) -> tuple[set[str], list[str]]:
    """Set up ``model``'s FP8 parameters (:func:`quantized_param_names` of the shards'
    names): a model built under :func:`deferred_weights` is materialised on ``device``
    (:func:`materialize`), a built one converted (:func:`convert_params`). Returns the
    quantised names and the shards' keys."""
    check_supported(model)
    keys = checkpoint_keys(files) if cfg.from_checkpoint else []
    names = quantized_param_names(model, cfg, keys)
    if any(p.is_meta for p in model.parameters()):
        if device is None:
            raise ValueError("prepare: a model built under deferred_weights() needs a device")
        materialize(model, device, names)
    else:
        convert_params(model, names)
    return names, keys


FP8_MODELS = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Gemma3ForCausalLM",
    "HybridModel",
)
"""Model classes whose linears run through :func:`~unimem.models.fp8_linear.linear` /
:func:`~unimem.models.fp8_linear.row_parallel` and whose experts take FP8 scales."""


def check_supported(model: nn.Module) -> None:
    """ValueError naming the model class when FP8 weights cannot run in it (or under
    tensor parallelism)."""
    name = type(model).__name__
    if name not in FP8_MODELS:
        raise ValueError(f"FP8 weights are not supported for {name} (only {', '.join(FP8_MODELS)})")
    if getattr(getattr(model, "tp", None), "size", 1) > 1:
        raise ValueError("FP8 weights with tp_size > 1 are not supported")


def quantize_model_online(model: nn.Module, cfg: Fp8Config | None = None) -> set[str]:
    """``--quantization fp8`` applied to a model whose weights are loaded already (any
    loader; the synthetic presets): quantises :func:`quantized_param_names` (or, for a
    synthetic model, :func:`synthetic_fp8_names`) in place, with ``cfg`` or the model
    class's :func:`~unimem.models.quant_config.online_config`. Returns the names."""
    check_supported(model)
    if type(model).__name__ == "HybridModel":
        names = synthetic_fp8_names(model)
    else:
        names = quantized_param_names(model, cfg or online_config(type(model).__name__), [])
    quantize_in_place(model, names)
    return names
