"""One mechanism that chooses between an op's Triton kernel and its torch reference.

Every op of this package has two sides of one contract: a Triton side (``op_triton``, which
launches the kernels) and a torch reference (``op_reference``: the oracle in tests and the
path off CUDA, whose signature and docstring state the contract). The public ``op`` is
declared once, with :func:`kernel_op`::

    copy_units = kernel_op(
        "copy_units", triton=copy_units_triton, reference=copy_units_reference, device_of="buf"
    )

The result is a :class:`KernelOp` with the reference's signature and docstring, registered
in :data:`OPS` under the op's name. A call

1. runs ``check`` (when given) on the arguments: the contract's validation, whichever side
   runs (it raises ``ValueError``), which also says whether the kernels cover these inputs
   (it returns False where they do not: float64, something autograd would record ...);
2. runs the Triton side when the kernels cover the inputs and :func:`use_triton` accepts
   the op's main tensor (the argument named by ``device_of``; with the op's ``switch``),
   and the reference otherwise.

Both sides receive the op's arguments unchanged, so both accept the op's signature (the Triton
side may take further keyword arguments: tiles for tests and sweeps). Each side is looked up
by name in its module at every call, so that replacing ``module.op_triton`` (a test's spy)
redirects the op too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from unimem_kernel import envs

__all__ = [
    "OPS",
    "KernelOp",
    "grouped_row_tiles",
    "in_interpreter_stand_in",
    "interpreter_stand_in",
    "kernel_op",
    "next_pow2",
    "records_autograd",
    "use_triton",
]


def use_triton(t: torch.Tensor, switch: str | None = None) -> bool:
    """Whether an op whose main tensor is ``t`` runs its Triton side: by
    ``UNIMEM_KERNEL_BACKEND`` (``auto``: when ``t`` is a CUDA tensor; ``triton``: always, on
    CPU through the interpreter with ``TRITON_INTERPRET=1``; ``reference``: never), and never
    while ``switch`` (an on/off switch of :mod:`unimem_kernel.envs`, e.g.
    ``UNIMEM_FUSED_OPS``) is off."""
    if switch is not None and envs.get(switch) == "off":
        return False
    choice = envs.get("UNIMEM_KERNEL_BACKEND")
    if choice == "auto":
        return t.is_cuda
    return choice == "triton"


def records_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op over ``tensors`` (grad mode on and one of them
    requires grad). The kernels have no backward, so an op's ``check`` sends such calls
    to its reference: a module that also trains (the drafter under distillation) calls the
    same ops."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_stand_in = threading.local()


@contextlib.contextmanager
def interpreter_stand_in():
    """Marks torch ops (run inside it, this thread) that stand in for work the compiled
    kernel does in its own launch and the interpreter cannot (its e4m3 stores truncate, so
    the FP8 quantisation stores float32 and casts after): a launch counter
    (``unimem.bench.launches``) counts them as part of that launch, not as launches."""
    _stand_in.depth = getattr(_stand_in, "depth", 0) + 1
    try:
        yield
    finally:
        _stand_in.depth -= 1


def in_interpreter_stand_in() -> bool:
    """Whether this thread is inside :func:`interpreter_stand_in`."""
    return getattr(_stand_in, "depth", 0) > 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


class _Side:
    """A function found by name in its module's globals at each call (see the module
    docstring)."""

    __slots__ = ("name", "scope")

    def __init__(self, fn: Callable[..., Any]) -> None:
        scope = getattr(fn, "__globals__", None)
        if scope is None or scope.get(fn.__name__) is not fn:
            raise TypeError(f"{fn!r} must be a function defined at the top level of its module")
        self.name = fn.__name__
        self.scope = scope

    def get(self) -> Callable[..., Any]:
        return self.scope[self.name]


OPS: dict[str, KernelOp] = {}
"""Every op declared with :func:`kernel_op`, by name (an op's module registers it when it is
imported)."""


class KernelOp:
    """An op with a Triton side and a torch reference of one contract (module docstring).
    Calling it runs one side; :attr:`triton` and :attr:`reference` are the sides themselves,
    :meth:`runs_triton` says which a call would take; ``check`` and ``switch`` are the
    declaration's."""

    def __init__(
        self,
        name: str,
        *,
        triton: Callable[..., Any],
        reference: Callable[..., Any],
        device_of: str | Callable[..., torch.Tensor],
        check: Callable[..., bool | None] | None = None,
        switch: str | None = None,
    ) -> None:
        functools.update_wrapper(self, reference)
        self.name = self.__name__ = self.__qualname__ = name
        self._triton = _Side(triton)
        self._reference = _Side(reference)
        self.check = check
        self.switch = switch
        if switch is not None and switch not in envs.SWITCHES:
            raise KeyError(f"{switch} is not a switch of unimem_kernel.envs")
        self._device_of: Callable[..., torch.Tensor]
        if callable(device_of):
            self._device_of = device_of
        else:
            self._device_of = _argument_getter(reference, device_of)

    @property
    def triton(self) -> Callable[..., Any]:
        """The Triton side (``op_triton``)."""
        return self._triton.get()

    @property
    def reference(self) -> Callable[..., Any]:
        """The torch reference side."""
        return self._reference.get()

    def runs_triton(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a call with these arguments runs the Triton side (``check`` runs first: a
        ValueError for arguments outside the contract)."""
        if self.check is not None and self.check(*args, **kwargs) is False:
            return False
        return use_triton(self._device_of(*args, **kwargs), self.switch)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        side = self._triton if self.runs_triton(*args, **kwargs) else self._reference
        return side.get()(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"<kernel op {self.name}: {self._triton.name} | {self._reference.name}"
            f"{'' if self.switch is None else ', switch ' + self.switch}>"
        )


def _argument_getter(face: Callable[..., Any], name: str) -> Callable[..., torch.Tensor]:
    """A fast ``(*args, **kwargs) -> the argument called name`` for calls of ``face``."""
    params = list(inspect.signature(face).parameters.values())
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if name not in [p.name for p in params]:
        raise TypeError(f"{face.__name__} has no parameter {name!r} (device_of)")
    if name not in positional:
        return lambda *args, **kwargs: kwargs[name]
    at = positional.index(name)
    return lambda *args, **kwargs: args[at] if len(args) > at else kwargs[name]


def kernel_op(
    name: str,
    *,
    triton: Callable[..., Any],
    reference: Callable[..., Any],
    device_of: str | Callable[..., torch.Tensor],
    check: Callable[..., bool | None] | None = None,
    switch: str | None = None,
) -> KernelOp:
    """The op ``name`` over ``triton`` and ``reference`` (a :class:`KernelOp` with the
    reference's signature and docstring), registered in :data:`OPS`.

    ``device_of``: the name of the parameter whose device decides (or a function of the
    op's arguments returning that tensor); ``check``: a function of the op's arguments that
    validates them (ValueError) and returns False where the kernels do not cover them (the
    reference runs; None or True: they do); ``switch``: an on/off switch of
    :mod:`unimem_kernel.envs` that, off, sends the op to its reference."""

    op = KernelOp(
        name, triton=triton, reference=reference, device_of=device_of, check=check,
        switch=switch,
    )  # fmt: skip
    known = OPS.get(name)
    if known is not None and known.__module__ != op.__module__:
        raise ValueError(f"kernel op {name} is declared in {known.__module__} too")
    OPS[name] = op
    return op


def grouped_row_tiles(t: int, e: int, block_m: int) -> int:
    """Row tiles a grouped launch over ``t`` rows and ``e`` experts needs at most: the
    segments (``e`` experts and the tail) are cut into ``block_m``-row tiles, which is at
    most ``cdiv(t, block_m)`` full tiles plus one partial tile per non-empty segment — and
    at most ``min(e + 1, t)`` segments are non-empty. A host-known bound (capturable); the
    programs past the real tiles exit at once. Bounding by ``t`` matters at decode: one
    token routed to 10 of 512 experts needs 11 row tiles, not 514 mostly-empty ones, each
    of which still loads and scans all ``e`` offsets."""
    return -(-t // block_m) + min(e + 1, t)
