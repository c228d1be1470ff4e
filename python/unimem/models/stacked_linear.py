"""Several projections of one input as one GEMM: their weights stored as row ranges of one tensor.

A decoder layer often multiplies the same normed input by several weights (a GDN mixer's
``in_proj_qkvz`` and ``in_proj_ba``, a MoE block's router and its shared expert's gate and
up projections). Narrow ones (64 router rows, 2 x 32 GDN gate rows) cost a whole GEMM
launch each for almost no work (~10 us each on an H200 at 384 rows). :class:`StackedRows`
allocates one ``[sum N_i, K]`` tensor, copies the weights in and re-points each module's
``weight`` parameter to its row range (a view: the checkpoint names, the shapes and
``named_parameters`` stay as they were, and a loader's in-place ``copy_`` fills the stack),
so :meth:`StackedRows.linear` computes every product with one ``F.linear`` and returns
column views of the result.

If a part stops being a view of the stack (the module was moved or cast, or a loader
replaced ``.data``), :meth:`~StackedRows.linear` notices (a host-side pointer check, no
device sync) and runs one GEMM per part from then on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["StackedRows", "stacks_of"]


class StackedRows:
    """The ``weight`` parameters of ``modules`` (each ``[N_i, K]``, one dtype and device) as
    row ranges of one tensor, in the order given. Not an ``nn.Module``: the stack is owned
    by the parts' parameters (views of it), never registered twice."""

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
        self.sizes = [w.shape[0] for w in weights]
        self._modules = modules
        stack = torch.empty(sum(self.sizes), k, dtype=dtype, device=device)
        row = 0
        with torch.no_grad():
            for m, w, n in zip(modules, weights, self.sizes, strict=True):
                view = stack[row : row + n]
                view.copy_(w)
                m.weight = nn.Parameter(view, requires_grad=w.requires_grad)
                row += n
        self._stack: torch.Tensor | None = stack

    def stacked(self) -> bool:
        """Whether :meth:`linear` runs one GEMM (every part is still its row range of the
        stack); False for good once a part was re-pointed."""
        return self._intact()

    def _intact(self) -> bool:
        stack = self._stack
        if stack is None:
            return False
        base, row, step = stack.data_ptr(), 0, stack.stride(0) * stack.element_size()
        for m, n in zip(self._modules, self.sizes, strict=True):
            w = m.weight
            if w.data_ptr() != base + row * step or w.shape != (n, stack.shape[1]):
                self._stack = None  # drop the stale stack; the parts run one GEMM each
                return False
            row += n
        return True

    def linear(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[F.linear(x, m.weight) for m in modules]``: one GEMM over the stack (column views
        of its ``[..., sum N_i]`` output) while the parts are views of it, else one each."""
        if self._intact():
            return list(F.linear(x, self._stack).split(self.sizes, dim=-1))
        return [F.linear(x, m.weight) for m in self._modules]


def stacks_of(model: nn.Module) -> Iterator[StackedRows]:
    """Every :class:`StackedRows` held by ``model``'s modules (for checks after loading)."""
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, StackedRows):
                yield v
