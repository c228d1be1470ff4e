"""Several projections of one input as one GEMM: their weights stored as row ranges of one tensor.

A decoder layer often multiplies the same normed input by several weights (a GDN mixer's
``in_proj_qkvz`` and ``in_proj_ba``, a MoE block's router and its shared expert's gate and
up projections). Narrow ones (64 router rows, 2 x 32 GDN gate rows) would cost a whole GEMM
launch each for almost no work. :class:`StackedRows` allocates one ``[sum N_i, K]`` tensor,
copies the weights in and re-points each module's ``weight`` parameter to its row range (a
view: the checkpoint names, the shapes and ``named_parameters`` stay as they were, and a
loader's in-place ``copy_`` fills the stack), so :meth:`StackedRows.linear` computes every
product with one ``F.linear`` and returns column views of the result.

If a part stops being a view of the stack (the module was moved or cast, or a loader
replaced ``.data``), :meth:`~StackedRows.linear` notices (a host-side pointer check, no
device sync) and runs one GEMM per part from then on.

Parts with biases (gpt-oss's q/k/v) stack them too, as one ``[sum N_i]`` vector added by the
same GEMM; the parts have biases all or none.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from unimem.models import fp8_linear

__all__ = ["StackedRows", "stacks_of"]


class StackedRows:
    """The ``weight`` parameters of ``modules`` (each ``[N_i, K]``, one dtype and device) as
    row ranges of one tensor, in the order given. Not an ``nn.Module``: the stack is owned
    by the parts' parameters (views of it), never registered twice.

    After some parts became FP8 (:func:`unimem.models.fp8_convert.convert_params`: an e4m3
    ``weight`` with its ``weight_scale_inv [N_i, KG]``), :meth:`regroup` stacks consecutive
    parts of one kind as one run (FP8 runs stack their scales too); :meth:`linear` then
    runs one GEMM per run. After loading, :meth:`attach_block_scales` gives each FP8 run
    the block table of its stack where it has one (the cuBLASLt path of
    :func:`unimem.models.fp8_linear.fp8_matmul`)."""

    def __init__(self, *modules: nn.Module) -> None:
        if not modules:
            raise ValueError("StackedRows needs at least one module")
        weights = [m.weight for m in modules]
        k, dtype, device = weights[0].shape[1], weights[0].dtype, weights[0].device
        for w in weights:
            if w.dim() != 2 or w.shape[1] != k or w.dtype != dtype or w.device != device:
                raise ValueError(
                    f"stacked weights must be [N, {k}] {dtype} on {device}, got "
                    f"{tuple(w.shape)} {w.dtype} on {w.device}"
                )
        with_bias = [getattr(m, "bias", None) is not None for m in modules]
        if any(with_bias) and not all(with_bias):
            raise ValueError("stacked parts must all have a bias or none")
        self.sizes = [w.shape[0] for w in weights]
        self._modules = modules
        self._runs: list[_Run] = [_Run(modules)]

    def regroup(self) -> None:
        """Re-stack as runs of consecutive parts that are all FP8 or all not (class
        docstring); a no-op when every part is of one kind and still stacked."""
        kinds = [_is_fp8(m) for m in self._modules]
        runs, start = [], 0
        for i in range(1, len(kinds) + 1):
            if i == len(kinds) or kinds[i] != kinds[start]:
                runs.append(_Run(self._modules[start:i]))
                start = i
        self._runs = runs

    def attach_block_scales(self) -> int:
        """Give every intact FP8 run the ``[ceil(sum N_i / 128), KG]`` block table of its stacked
        scales (:func:`~unimem.models.fp8_linear.collapse_block_scales`: None where the
        stack is not block-uniform; the run owns it); call once the weights are filled
        (:func:`unimem.models.fp8_convert.attach_block_scales`). Returns the number of
        runs that got one."""
        count = 0
        for r in self._runs:
            r.block_scales = None
            if r.fp8 and r.intact():
                w, s = r.stacks[0], r.stacks[1]
                r.block_scales = fp8_linear.collapse_block_scales(s, w.shape[-1])
                count += r.block_scales is not None
        return count

    def stacked(self) -> bool:
        """Whether :meth:`linear` runs one GEMM per run (every part is still its row range
        of its run's stack); False for good once a part was re-pointed."""
        return all(r.intact() for r in self._runs)

    def single_weight(self) -> torch.Tensor | None:
        """The ``[sum N_i, K]`` stack when every part is a row range of one 16/32-bit stack
        (one run, not FP8, no biases, intact), else None: what a kernel that takes the whole
        stacked weight (:func:`unimem_kernel.norm_linear`) may multiply by."""
        if len(self._runs) != 1:
            return None
        run = self._runs[0]
        if run.fp8 or run.has_bias or not run.intact():
            return None
        return run.stacks[0]

    def linear(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[linear(x, m) for m in modules]``: one GEMM per run over its stack (column views
        of its ``[..., sum N_i]`` output) while the parts are views of it, else one each
        (:func:`unimem.models.fp8_linear.linear`: F.linear, or the FP8 GEMM)."""
        out: list[torch.Tensor] = []
        for r in self._runs:
            out += r.linear(x)
        return out


def _is_fp8(m: nn.Module) -> bool:
    return getattr(m, "weight_scale_inv", None) is not None


class _Run:
    """Consecutive parts of one kind stacked (see :class:`StackedRows`)."""

    def __init__(self, modules) -> None:
        self.modules = tuple(modules)
        self.fp8 = _is_fp8(self.modules[0])
        self.has_bias = getattr(self.modules[0], "bias", None) is not None
        self.sizes = [m.weight.shape[0] for m in self.modules]
        names = ("weight", "weight_scale_inv") if self.fp8 else ("weight",)
        names += ("bias",) if self.has_bias else ()
        self.stacks: list[torch.Tensor] | None = []
        for name in names:
            parts = [getattr(m, name) for m in self.modules]
            stack = torch.empty(sum(self.sizes), *parts[0].shape[1:], dtype=parts[0].dtype,
                                device=parts[0].device)  # fmt: skip
            row = 0
            with torch.no_grad():
                for m, p, n in zip(self.modules, parts, self.sizes, strict=True):
                    view = stack[row : row + n]
                    view.copy_(p)
                    setattr(m, name, nn.Parameter(view, requires_grad=p.requires_grad))
                    row += n
            self.stacks.append(stack)
        self.names = names
        self.block_scales: torch.Tensor | None = None  # StackedRows.attach_block_scales

    def intact(self) -> bool:
        if self.stacks is None:
            return False
        for name, stack in zip(self.names, self.stacks, strict=True):
            base, row, step = stack.data_ptr(), 0, stack.stride(0) * stack.element_size()
            for m, n in zip(self.modules, self.sizes, strict=True):
                w = getattr(m, name)
                if w.data_ptr() != base + row * step or w.shape != (n, *stack.shape[1:]):
                    self.stacks = None  # drop the stale stack; the parts run one GEMM each
                    return False
                row += n
        return True

    def linear(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.intact():
            bias = self.stacks[-1] if self.has_bias else None
            if self.fp8:
                y = fp8_linear.fp8_matmul(
                    x, self.stacks[0], self.stacks[1], block_scales=self.block_scales
                )
                y = y if bias is None else y + bias
            else:
                y = F.linear(x, self.stacks[0], bias)
            return list(y.split(self.sizes, dim=-1))
        out = [fp8_linear.linear(x, m) for m in self.modules]
        if self.has_bias:
            out = [y + m.bias for y, m in zip(out, self.modules, strict=True)]
        return out


def stacks_of(model: nn.Module) -> Iterator[StackedRows]:
    """Every :class:`StackedRows` held by ``model``'s modules (for checks after loading)."""
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, StackedRows):
                yield v
