"""Everything a pool (and a prefix cache over it) holds, as comparable values: refused calls
must leave it bit-identical. Tests import this module by name (pytest puts this folder on
``sys.path``).

``snapshot(*objs)`` walks each object's attributes: tensors become their dtype, shape and raw
bytes (the arena, the static pools, ``req_to_token``, every ``v2p`` / ``p2v`` / free stack and
the views over them), host objects (id pools, bands, holder counts, live handles, radix nodes,
stats) become nested tuples of their fields. Shared and cyclic references are walked once.
"""

from __future__ import annotations

import enum

import torch

from unimem.memory.id_space import IdSpace

_PLAIN = (int, float, str, bytes, bool, type(None), enum.Enum, torch.dtype, torch.device)


def _tensor(t: torch.Tensor) -> tuple:
    raw = t.detach().cpu().contiguous().reshape(-1)
    return ("tensor", t.dtype, tuple(t.shape), raw.view(torch.uint8).numpy().tobytes())


def _state(x: object, seen: dict[int, int]) -> object:
    if isinstance(x, torch.Tensor):
        return _tensor(x)
    if isinstance(x, _PLAIN):
        return x
    if id(x) in seen:
        return ("seen", seen[id(x)])
    seen[id(x)] = len(seen)
    if isinstance(x, dict):
        return ("dict", tuple((_state(k, seen), _state(v, seen)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_state(v, seen) for v in x))
    if isinstance(x, (set, frozenset)):
        return ("set", tuple(sorted(x, key=repr)))
    if isinstance(x, IdSpace):  # the stack's entries above its height are not state
        fields = dict(vars(x), free_stack=x.free_stack[: x.free])
        return ("IdSpace", tuple((k, _state(v, seen)) for k, v in fields.items()))
    if hasattr(x, "__dict__"):
        return (type(x).__name__, _state(vars(x), seen))
    return ("repr", repr(x))


def snapshot(*objs: object, skip: frozenset[str] = frozenset()) -> dict[str, object]:
    """``{"<i>.<attribute>": value}`` for each attribute of each of ``objs``, but those named
    in ``skip`` (attributes that never change: e.g. a pool's spec, layout and the views that
    alias its arena)."""
    seen: dict[int, int] = {id(o): i for i, o in enumerate(objs)}
    out: dict[str, object] = {}
    for i, obj in enumerate(objs):
        for name, value in vars(obj).items():
            if name not in skip:
                out[f"{i}.{type(obj).__name__}.{name}"] = _state(value, seen)
    return out


def changed(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The attributes whose value differs between two snapshots."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


IMMUTABLE = frozenset(
    ("spec", "layout", "_kind_bytes", "_unit_bytes", "_kv_views", "_state_views", "_empty_bands")
)
"""Pool attributes fixed at construction (the views alias the arena, compared as bytes)."""


def pool_snapshot(*objs: object) -> dict[str, object]:
    """:func:`snapshot` of ``objs`` without the attributes that never change."""
    return snapshot(*objs, skip=IMMUTABLE)
