"""Kernel launches of one eager decode (or verify) step, per decoder layer, counted on the host.

A step's GPU time at small batches is set by how many kernels it launches (each costs a
fixed launch gap, however little it does) as much as by the bytes it moves. This module counts them
without a GPU: every aten op that launches a kernel (``TorchDispatchMode``; views, ``empty``
and other metadata ops launch nothing and are skipped) and every Triton kernel launch
(``JITFunction.run`` / the interpreter's ``InterpretedFunction.run``), each attributed to the
decoder layer whose method is on the Python stack (a frame whose ``self`` is one of the
model's layers: its ``forward``, or another body such as Gemma 3's ``forward_small``), or to
the step's body outside the layers (embedding, RoPE tables, final norm, LM head, sampling,
metadata, the step's tail).

The attention backend's ``attend`` counts as **one** launch whatever it runs: the CPU
reference backend runs a chain of torch ops that stand for FA4's one kernel (two at the
batch sizes where the split-KV kernel and its combine run; the GPU benchmark's profiler count
includes those). To see the GPU path on the CPU, force the Triton kernels through the
interpreter (``UNIMEM_KERNEL_BACKEND=triton``, ``TRITON_INTERPRET=1``) before importing
triton; with the references the count measures the reference code, not the step.

    counts = count_step_launches(engine_core)       # after a prefill: requests decoding
    counts.per_layer()                               # launches in each layer's forward
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unimem_kernel import in_interpreter_stand_in

# aten ops that launch no kernel (views, allocation, metadata)
NO_LAUNCH = {
    "_reshape_alias", "_unsafe_view", "alias", "as_strided", "detach", "dim", "empty",
    "empty_like", "empty_strided", "expand", "is_nonzero", "lift_fresh", "narrow", "new_empty",
    "permute", "reshape", "select", "size", "slice", "split", "split_with_sizes", "squeeze",
    "stride", "sym_numel", "sym_size", "sym_storage_offset", "sym_stride", "t", "transpose",
    "unbind", "unflatten", "unsqueeze", "view", "is_same_size", "_local_scalar_dense",
}  # fmt: skip

OUTSIDE = -1
"""The layer index of launches outside every decoder layer (the step's own body)."""


@dataclass
class StepLaunches:
    """Launches of one step: ``by_layer[i]`` (``OUTSIDE`` for the step's body outside the
    layers) and ``names[(i, name)]``: which ops / kernels (``aten.X``, ``triton.K``,
    ``attention``)."""

    n_layers: int
    by_layer: Counter = field(default_factory=Counter)
    names: Counter = field(default_factory=Counter)

    def add(self, layer: int, name: str) -> None:
        self.by_layer[layer] += 1
        self.names[(layer, name)] += 1

    def per_layer(self) -> list[int]:
        """Launches inside each decoder layer's forward, in layer order."""
        return [self.by_layer[i] for i in range(self.n_layers)]

    @property
    def total(self) -> int:
        return sum(self.by_layer.values())

    def layer_names(self, layer: int) -> dict[str, int]:
        return {n: c for (i, n), c in sorted(self.names.items()) if i == layer}

    def summary(self) -> str:
        per = self.per_layer()
        lines = [
            f"launches per step {self.total} = layers {sum(per)} (max {max(per, default=0)} "
            f"per layer) + outside {self.by_layer[OUTSIDE]}; per layer overall "
            f"{self.total / max(self.n_layers, 1):.2f}"
        ]
        for i in sorted({i for i, _ in self.names}, key=lambda i: (i != 0, i)):
            if i in (0, OUTSIDE) or (i == self.n_layers - 1):
                label = "outside" if i == OUTSIDE else f"layer {i}"
                lines.append(f"  {label}: {self.layer_names(i)}")
        return "\n".join(lines)


class _Counter:
    """The live count: maps a Python stack to a layer index through the layers' ids."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layer_of = {id(m): i for i, m in enumerate(layers)}
        self.result = StepLaunches(len(layers))
        self.quiet = 0  # inside a counted launch: its own torch ops are not launches

    def layer(self) -> int:
        f = sys._getframe(2)
        while f is not None:
            i = self.layer_of.get(id(f.f_locals.get("self")))
            if i is not None:  # a method of a layer (forward, or another body of it)
                return i
            f = f.f_back
        return OUTSIDE

    def record(self, name: str) -> None:
        if self.quiet or in_interpreter_stand_in():
            # inside a counted launch (the interpreter's copies, attention's ops), or a torch
            # op standing in for what a compiled kernel does in its own launch
            return
        self.result.add(self.layer(), name)


class _AtenOps(TorchDispatchMode):
    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.counter.record(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_launches(counter: _Counter) -> Iterator[None]:
    """Counts every Triton kernel run (compiled or interpreted) while active."""
    import triton.runtime.jit as jit

    patched = []
    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every supported Triton has it
        pass
    for cls in classes:
        original = cls.run

        def run(self, *args, __original=original, **kwargs):
            fn = getattr(self, "fn", None)
            counter.record(f"triton.{getattr(fn, '__name__', type(self).__name__)}")
            counter.quiet += 1
            try:
                return __original(self, *args, **kwargs)
            finally:
                counter.quiet -= 1

        cls.run = run
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.run = original


@contextlib.contextmanager
def _attend_as_one(counter: _Counter, backend: object) -> Iterator[None]:
    """The backend's ``attend`` counts as one launch (module docstring)."""
    original = backend.attend

    def attend(*args, **kwargs):
        counter.record("attention")
        counter.quiet += 1
        try:
            return original(*args, **kwargs)
        finally:
            counter.quiet -= 1

    backend.attend = attend
    try:
        yield
    finally:
        del backend.attend  # the instance attribute; the class method shows through again


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order (``model.model.layers`` of the HF-named models,
    ``layers`` of the synthetic one)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layer list")
    return list(layers)


def count_step_launches(core, width: int | None = None) -> StepLaunches:
    """Launches of one eager decode (or, with a chain, verify) step of ``core``'s running
    batch (``width`` lanes; default all running requests), the step the engine launches for
    it: the greedy one, or where a request samples the sampled one of the batch's cut-off
    rule. The step is run once first so that first-use work (Triton compiles, caches) stays
    out of the count, then once counted; both advance the requests (call after the prefill,
    with tokens to spare)."""
    runner = core.runner
    reqs = core.scheduler.running
    width = width or len(reqs)
    step = functools.partial(runner.eager_step, width, runner.step_rule(reqs))
    step()
    counter = _Counter(decoder_layers(runner.model))
    with _attend_as_one(counter, runner.backend), _triton_launches(counter), _AtenOps(counter):
        step()
    return counter.result
