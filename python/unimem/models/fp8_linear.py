"""FP8 linears in the models: the weight format, turning a built model's linears into FP8
parameters, the checkpoint stream that fills them, and the products that use them.

Format. A quantised linear keeps its parameter name and shape with dtype
``torch.float8_e4m3fn`` and gains a float32 sibling ``<name>_scale_inv`` with one scale per
row and group of 128 columns: ``weight [N, K]`` -> ``weight_scale_inv [N, KG]``, stacked
experts ``gate_up_proj [E, 2I, d]`` -> ``gate_up_proj_scale_inv [E, 2I, KG]``
(:mod:`unimem_kernel.fp8_gemm`). A checkpoint's ``[128, 128]`` block scales are expanded to
rows on the way in (:func:`expand_block_scales`), so the models' own re-layouts of rows
(Qwen3-Next's per-key-head groups, stacked projections, per-expert pieces) apply to weights
and scales alike and no row range depends on block alignment.

Loading (:func:`prepare`, called by :func:`unimem.models.loader.load_model`): the model is
built under :func:`deferred_weights` (parameters on the meta device) and :func:`materialize`
allocates each parameter once — the chosen ones (:func:`quantized_param_names`) as empty FP8
ones plus scales — and re-stacks :class:`~unimem.models.stacked_linear.StackedRows` (a model
built normally is converted by :func:`convert_params`);
:func:`fp8_weight_stream` wraps the checkpoint's ``(name, tensor)`` stream: block scales are
expanded to rows (the weight's row count is taken from the weight, which may come before or
after its scales), and with online quantisation each chosen bf16 weight is quantised
block-wise (:func:`quantize_blockwise`) and followed by its scales.

Products: :func:`linear` (``F.linear`` or the FP8 GEMM by the module's weight),
:func:`row_parallel` (a row-parallel output projection), :func:`fp8_matmul` (a weight and
its scales). In batch-invariant mode the GEMM runs its fixed tile.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from unimem.models import batch_invariant
from unimem.models.quant_config import Fp8Config, online_config
from unimem_kernel.fp8_gemm import FP8_DTYPE, FP8_MAX, GROUP, fp8_linear, num_groups

__all__ = [
    "SCALE_SUFFIX",
    "convert_params",
    "deferred_weights",
    "materialize",
    "expand_block_scales",
    "fp8_matmul",
    "fp8_weight_stream",
    "is_fp8",
    "linear",
    "prepare",
    "quantize_model_online",
    "dequantize",
    "quantize_blocks",
    "quantize_blockwise",
    "quantize_in_place",
    "quantized_param_names",
    "row_parallel",
    "synthetic_fp8_names",
    "weight_bytes",
]

SCALE_SUFFIX = "_scale_inv"

PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
"""A per-expert checkpoint weight (hub layout): group 1 the experts' module, 3 the projection."""


# ------------------------------------------------------------------ products


def is_fp8(module: nn.Module, leaf: str = "weight") -> bool:
    """Whether ``module``'s parameter ``leaf`` is an FP8 weight with scales."""
    return getattr(module, leaf + SCALE_SUFFIX, None) is not None


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` times FP8 ``weight [N, K]`` (``scale [N, KG]``) transposed, in ``x``'s
    dtype (:func:`unimem_kernel.fp8_linear`; the fixed tile under batch invariance)."""
    return fp8_linear(x, weight, scale, invariant=batch_invariant.covers(x))


def linear(x: torch.Tensor, module: nn.Module, leaf: str = "weight") -> torch.Tensor:
    """``F.linear(x, module.<leaf>)``, or the FP8 product when that weight is FP8."""
    w = getattr(module, leaf)
    if is_fp8(module, leaf):
        return fp8_matmul(x, w, getattr(module, leaf + SCALE_SUFFIX))
    return F.linear(x, w)


def row_parallel(
    x: torch.Tensor,
    module: nn.Module,
    zero_bias: torch.Tensor | None,
    tp,
    leaf: str = "weight",
) -> torch.Tensor:
    """A row-parallel output projection by ``module.<leaf>``: for a model-dtype weight
    :func:`~unimem.models.tensor_parallel.row_parallel_linear_lt` (``zero_bias`` given) or
    ``row_parallel_linear``; the FP8 product, then the all-reduce, otherwise."""
    from unimem.models.tensor_parallel import row_parallel_linear, row_parallel_linear_lt

    w = getattr(module, leaf)
    if not is_fp8(module, leaf):
        if zero_bias is None:
            return row_parallel_linear(x, w, None, tp)
        return row_parallel_linear_lt(x, w, zero_bias, tp)
    y = fp8_matmul(x, w, getattr(module, leaf + SCALE_SUFFIX))
    return y if tp.size == 1 else tp.all_reduce(y)


# ------------------------------------------------------------------ weight format


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(q [..., N, K] e4m3, scale [..., NB, KG] float32)``: one scale
    per 128 x 128 block, ``amax / 448`` (the hub's FP8 checkpoint layout), ``q = w / scale``
    rounded to e4m3."""
    *lead, n, k = w.shape
    nb, kg = (n + GROUP - 1) // GROUP, num_groups(k)
    pad = torch.zeros(*lead, nb * GROUP, kg * GROUP, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w.float()
    blocks = pad.view(*lead, nb, GROUP, kg, GROUP)
    s = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-10) / FP8_MAX  # [..., NB, KG]
    q = (blocks / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * GROUP, kg * GROUP)[..., :n, :k].to(FP8_DTYPE).contiguous()
    return q, s


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blocks` with the scales expanded to rows (``[..., N, KG]``)."""
    q, s = quantize_blocks(w)
    return q, expand_block_scales(s, w.shape[-2])


def dequantize(q: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """``q [..., N, K]`` times its per-row-group scales ``[..., N, KG]``, float32."""
    k = q.shape[-1]
    return q.float() * row_scales.repeat_interleave(GROUP, dim=-1)[..., :k]


def expand_block_scales(block_scales: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., NB, KB]`` block scales of a weight with ``n`` rows -> ``[..., n, KB]`` float32
    (row ``r`` takes block row ``r // 128``); ValueError if ``NB != ceil(n / 128)``."""
    nb = block_scales.shape[-2]
    if nb != (n + GROUP - 1) // GROUP:
        raise ValueError(
            f"{nb} block rows of scales do not cover a weight of {n} rows in blocks of {GROUP}"
        )
    rows = block_scales.float().repeat_interleave(GROUP, dim=-2)
    return rows[..., :n, :].contiguous()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters (each storage once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape))
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


# ------------------------------------------------------------------ converting a model


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
    from unimem.models.stacked_linear import stacks_of

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
    """Quantise the filled parameters ``names`` block-wise (:func:`quantize_blockwise`) into
    FP8 parameters with scales, as :func:`convert_params` lays them out (for models built
    with their weights, e.g. the synthetic presets)."""
    from unimem.models.stacked_linear import stacks_of

    for name in sorted(names):
        path, leaf = name.rsplit(".", 1)
        module = model.get_submodule(path)
        q, s = quantize_blockwise(getattr(module, leaf).detach())
        setattr(module, leaf, nn.Parameter(q, requires_grad=False))
        module.register_parameter(leaf + SCALE_SUFFIX, nn.Parameter(s, requires_grad=False))
    for stack in stacks_of(model):
        stack.regroup()
    _release_cached_memory(model)


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
    from unimem.models.stacked_linear import stacks_of

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
"""Model classes whose linears run through :func:`linear` / :func:`row_parallel` and whose
experts take FP8 scales."""


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
