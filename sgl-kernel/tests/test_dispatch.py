"""The one dispatch mechanism (``unimem_kernel._dispatch``): every op is registered with a
Triton side and a reference that accept its arguments, no module dispatches by hand, and a
call takes the side that the backend, the op's switch and its check choose."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import unimem_kernel
from unimem_kernel._dispatch import OPS, KernelOp

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _modules():
    for info in pkgutil.iter_modules(unimem_kernel.__path__):
        yield importlib.import_module(f"unimem_kernel.{info.name}")


def test_every_op_is_registered_with_two_sides_that_take_its_arguments():
    modules = list(_modules())  # importing them registers every op
    assert len(OPS) >= 53
    for name, op in OPS.items():
        assert op.name == name and callable(op.triton) and callable(op.reference), op
        assert op.triton is not op.reference, op
        params = inspect.signature(op).parameters.values()
        positional = [p.name for p in params if p.kind is _POSITIONAL]
        keyword = {p.name for p in params if p.kind is _KEYWORD}
        for side in (op.triton, op.reference):
            got = inspect.signature(side).parameters
            side_positional = [n for n, p in got.items() if p.kind is _POSITIONAL]
            assert side_positional[: len(positional)] == positional, (op, side)
            assert keyword <= set(got), (op, side, keyword - set(got))
            extra = [
                n for n, p in got.items() if n not in positional and n not in keyword
                and p.kind in (_POSITIONAL, _KEYWORD)
            ]  # fmt: skip
            assert all(got[n].default is not inspect.Parameter.empty for n in extra), (op, side)
        # the hooks take any call of the op: its required arguments only, or all of them
        required = [p for p in params if p.default is inspect.Parameter.empty]
        hooks = [op.check] if op.check is not None else []
        for hook in hooks + [op.triton, op.reference]:
            sig = inspect.signature(hook)
            sig.bind(*[None for p in required if p.kind is _POSITIONAL],
                     **{p.name: None for p in required if p.kind is _KEYWORD})  # fmt: skip
            sig.bind(**{p.name: None for p in params})
    # no hand-written dispatcher is left: an ``X`` beside an ``X_reference`` is a kernel op
    for module in modules:
        for attr, value in vars(module).items():
            base = attr.removesuffix("_reference")
            if base != attr and callable(value) and not attr.startswith("_"):
                face = getattr(module, base, None)
                if face is not None and module.__name__ != "unimem_kernel.gdn_reference":
                    assert isinstance(face, KernelOp), f"{module.__name__}.{base}"
                    assert OPS[base] is face


def _toy_triton(x: torch.Tensor, scale: float = 1.0, *, block: int = 4) -> str:
    return "triton"


def _toy_reference(x: torch.Tensor, scale: float = 1.0) -> str:
    """A toy op."""
    return "reference"


def _toy_check(x: torch.Tensor, scale: float = 1.0) -> bool:
    if scale < 0:
        raise ValueError("scale must be >= 0")
    return x.dtype != torch.float64


def _toy_op(**options) -> KernelOp:
    return KernelOp("toy", triton=_toy_triton, reference=_toy_reference, device_of="x", **options)


def test_a_call_takes_the_side_the_backend_switch_and_inputs_choose(monkeypatch):
    op = _toy_op(check=_toy_check, switch="UNIMEM_FUSED_OPS")
    x = torch.zeros(2)
    assert op.__name__ == "toy" and op.__doc__ == "A toy op."
    assert list(inspect.signature(op).parameters) == ["x", "scale"]
    monkeypatch.delenv("UNIMEM_KERNEL_BACKEND", raising=False)
    assert op(x) == "reference"  # auto: CPU tensors take the reference
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    assert op(x) == op(x=x) == op(x, 2.0) == "triton"
    assert op(x.double()) == "reference"  # the check: not covered
    monkeypatch.setenv("UNIMEM_FUSED_OPS", "off")
    assert op(x) == "reference"  # the switch
    monkeypatch.setenv("UNIMEM_FUSED_OPS", "on")
    with pytest.raises(ValueError, match="scale must be"):
        op(x, -1.0)  # the check, before either side
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "reference")
    assert op(x) == "reference"
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "gpu")
    with pytest.raises(ValueError, match="UNIMEM_KERNEL_BACKEND"):
        op(x)


def test_a_side_replaced_in_its_module_takes_effect(monkeypatch):
    op = _toy_op()
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    monkeypatch.setitem(globals(), "_toy_triton", lambda x, scale=1.0: "spy")
    assert op(torch.zeros(1)) == "spy" and op.triton(None) == "spy"


def test_declarations_are_checked():
    with pytest.raises(TypeError, match="device_of"):
        KernelOp("toy", triton=_toy_triton, reference=_toy_reference, device_of="y")
    with pytest.raises(TypeError, match="top level"):
        KernelOp("toy", triton=lambda x: x, reference=_toy_reference, device_of="x")
    with pytest.raises(KeyError, match="UNIMEM_NOPE"):
        KernelOp("toy", triton=_toy_triton, reference=_toy_reference, device_of="x",
                 switch="UNIMEM_NOPE")  # fmt: skip
