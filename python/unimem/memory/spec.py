"""What one model asks of the memory: the declarative ``MemorySpec``.

A spec lists the target model's layers in model order — attention layers of kind FULL or
SWA (sliding window), and recurrent STATE layers (conv state + SSM state) — plus the draft
model's layers as **draft lanes**, each attached to a host kind. The spec says nothing about
where bytes live; ``layout.py`` turns it into byte offsets.

Lanes. For each kind, the lanes are the target layers of that kind in model order followed
by the draft lanes of that host in declaration order. Lane ``i`` of a kind is the ``i``-th
per-layer block inside that kind's unit (KV page or state slot).

Validation happens at construction and raises ``ValueError`` whose message starts with the
path of the offending field (``MemorySpec.page_size``, ``draft_lanes[0].host``,
``AttentionLayerSpec.window``; through :meth:`MemorySpec.from_dict`, ``layers[3].window``).

Alignment rule (TMA). Every per-token K row and V row of an attention layer,
``num_kv_heads * head_dim * itemsize`` bytes, must be a multiple of 16 bytes. The token
stride of a K/V view is exactly one row, and TMA requires every non-innermost global stride
to be a multiple of 16 B; blocks and envelopes are 16-byte aligned by the layout, so only
the row size is the spec's responsibility. (A kernel that also describes the head axis to
TMA needs ``head_dim * itemsize % 16 == 0``; see :attr:`AttentionLayerSpec.head_tma_aligned`.)
State blocks are padded to 16 B by the layout, so state shapes carry no alignment demand.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ROW_ALIGN = 16
"""Bytes every per-token K/V row must be a multiple of (TMA global-stride rule)."""


class LayerKind(enum.Enum):
    """Kind of a layer, and of the memory unit that holds it. Definition order is canonical."""

    FULL = "full"
    SWA = "swa"
    STATE = "state"


# --------------------------------------------------------------------------- checks


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_positive(where: str, name: str, value: object) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{where}.{name} must be a positive int, got {value!r}")


def _check_float_dtype(where: str, name: str, value: object) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{where}.{name} must be a floating torch.dtype, got {value!r}")


def _check_shape(where: str, name: str, value: object) -> None:
    ok = isinstance(value, tuple) and len(value) > 0
    if not ok or not all(_is_int(d) and d > 0 for d in value):
        raise ValueError(
            f"{where}.{name} must be a non-empty tuple of positive ints, got {value!r}"
        )


def _check_attention(
    where: str,
    kind: object,
    num_kv_heads: object,
    k_head_dim: object,
    v_head_dim: object,
    dtype: object,
    window: object,
) -> None:
    """Raise ``ValueError`` naming ``{where}.{field}`` if these attention fields are invalid."""
    if kind not in (LayerKind.FULL, LayerKind.SWA):
        raise ValueError(f"{where}.kind must be LayerKind.FULL or LayerKind.SWA, got {kind!r}")
    _check_positive(where, "num_kv_heads", num_kv_heads)
    _check_positive(where, "k_head_dim", k_head_dim)
    _check_positive(where, "v_head_dim", v_head_dim)
    _check_float_dtype(where, "dtype", dtype)
    for name, dim in (("k_head_dim", k_head_dim), ("v_head_dim", v_head_dim)):
        row = num_kv_heads * dim * dtype.itemsize
        if row % ROW_ALIGN:
            raise ValueError(
                f"{where}.{name}: a per-token row of num_kv_heads*{name}*itemsize = "
                f"{num_kv_heads}*{dim}*{dtype.itemsize} = {row} bytes is not a multiple of "
                f"{ROW_ALIGN} (TMA stride alignment)"
            )
    if kind is LayerKind.SWA:
        if not _is_int(window) or window <= 0:
            raise ValueError(f"{where}.window must be > 0 for SWA, got {window!r}")
    elif window is not None:
        raise ValueError(f"{where}.window must be None for FULL, got {window!r}")


def _check_state(
    where: str, conv_shape: object, conv_dtype: object, ssm_shape: object, ssm_dtype: object
) -> None:
    """Raise ``ValueError`` naming ``{where}.{field}`` if these state fields are invalid."""
    _check_shape(where, "conv_shape", conv_shape)
    _check_float_dtype(where, "conv_dtype", conv_dtype)
    _check_shape(where, "ssm_shape", ssm_shape)
    _check_float_dtype(where, "ssm_dtype", ssm_dtype)


# --------------------------------------------------------------------------- layer specs


@dataclass(frozen=True)
class AttentionLayerSpec:
    """One attention layer's KV rows: ``num_kv_heads`` heads of ``k_head_dim`` (K) and
    ``v_head_dim`` (V) elements of ``dtype`` per token. ``window`` is the SWA window in
    tokens (> 0) for ``kind == SWA`` and ``None`` for FULL. Validated at construction."""

    kind: LayerKind
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    window: int | None = None

    def __post_init__(self) -> None:
        _check_attention(
            "AttentionLayerSpec",
            self.kind,
            self.num_kv_heads,
            self.k_head_dim,
            self.v_head_dim,
            self.dtype,
            self.window,
        )

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one token's K row: ``num_kv_heads * k_head_dim * itemsize``."""
        return self.num_kv_heads * self.k_head_dim * self.dtype.itemsize

    @property
    def v_row_bytes(self) -> int:
        """Bytes of one token's V row: ``num_kv_heads * v_head_dim * itemsize``."""
        return self.num_kv_heads * self.v_head_dim * self.dtype.itemsize

    @property
    def head_tma_aligned(self) -> bool:
        """Whether the head stride of both K and V views is a multiple of 16 B too."""
        size = self.dtype.itemsize
        return (self.k_head_dim * size) % ROW_ALIGN == 0 and (
            self.v_head_dim * size
        ) % ROW_ALIGN == 0


@dataclass(frozen=True)
class StateLayerSpec:
    """One recurrent layer's per-request state: a conv state of ``conv_shape`` (e.g.
    ``(conv_dim, kernel_size - 1)``) in ``conv_dtype`` and an SSM state of ``ssm_shape``
    (e.g. ``(heads, k_dim, v_dim)``) in ``ssm_dtype``. Lists are accepted for the shapes and
    stored as tuples. Validated at construction."""

    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]
    ssm_dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("conv_shape", "ssm_shape"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        _check_state(
            "StateLayerSpec", self.conv_shape, self.conv_dtype, self.ssm_shape, self.ssm_dtype
        )

    @property
    def kind(self) -> LayerKind:
        return LayerKind.STATE

    @property
    def conv_bytes(self) -> int:
        """Bytes of one request's conv state (unpadded)."""
        return math.prod(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        """Bytes of one request's SSM state (unpadded)."""
        return math.prod(self.ssm_shape) * self.ssm_dtype.itemsize


LayerSpec = AttentionLayerSpec | StateLayerSpec
"""Either layer spec: the type of one lane."""
_LAYER_TYPES = (AttentionLayerSpec, StateLayerSpec)


@dataclass(frozen=True)
class DraftLane:
    """One draft-model layer stored alongside the target's layers of kind ``host``.

    An attention lane's ``host`` is FULL or SWA and equals ``layer.kind``; a state lane's
    ``host`` is STATE. The lane lives inside the host's units (pages or slots) and shares
    their lifetime: allocating a page for the target allocates it for the drafter too."""

    host: LayerKind
    layer: LayerSpec

    def __post_init__(self) -> None:
        if not isinstance(self.host, LayerKind):
            raise ValueError(f"DraftLane.host must be a LayerKind, got {self.host!r}")
        if not isinstance(self.layer, _LAYER_TYPES):
            raise ValueError(
                f"DraftLane.layer must be an AttentionLayerSpec or StateLayerSpec, "
                f"got {type(self.layer).__name__}"
            )
        if self.layer.kind is not self.host:
            raise ValueError(
                f"DraftLane.host is {self.host.name} but DraftLane.layer is of kind "
                f"{self.layer.kind.name}"
            )


# --------------------------------------------------------------------------- memory spec


@dataclass(frozen=True)
class MemorySpec:
    """Everything one model needs from the memory.

    ``page_size``: tokens per KV page, a power of two >= 1. ``layers``: the target model's
    layers in model order (at least one). ``draft_lanes``: the drafter's layers, each hosted
    by a kind the target model has. Lists are accepted and stored as tuples. Immutable and
    hashable; validated at construction."""

    page_size: int
    layers: tuple[LayerSpec, ...]
    draft_lanes: tuple[DraftLane, ...] = ()

    def __post_init__(self) -> None:
        for name in ("layers", "draft_lanes"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        ps = self.page_size
        if not _is_int(ps) or ps < 1 or ps & (ps - 1):
            raise ValueError(f"MemorySpec.page_size must be a power of two >= 1, got {ps!r}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ValueError(f"MemorySpec.layers must be a non-empty tuple, got {self.layers!r}")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, _LAYER_TYPES):
                raise ValueError(
                    f"layers[{i}] must be an AttentionLayerSpec or StateLayerSpec, "
                    f"got {type(layer).__name__}"
                )
        if not isinstance(self.draft_lanes, tuple):
            raise ValueError(f"MemorySpec.draft_lanes must be a tuple, got {self.draft_lanes!r}")
        present = {layer.kind for layer in self.layers}
        for j, lane in enumerate(self.draft_lanes):
            if not isinstance(lane, DraftLane):
                raise ValueError(f"draft_lanes[{j}] must be a DraftLane, got {type(lane).__name__}")
            if lane.host not in present:
                raise ValueError(
                    f"draft_lanes[{j}].host is {lane.host.name} but the model has no "
                    f"{lane.host.name} layer"
                )

    # ------------------------------------------------------------------ queries

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Kinds of the target model's layers, in canonical order (FULL, SWA, STATE)."""
        return tuple(k for k in LayerKind if self.has(k))

    def has(self, kind: LayerKind) -> bool:
        """Whether the target model has at least one layer of ``kind``."""
        return any(layer.kind is kind for layer in self.layers)

    def attention_lanes(self, kind: LayerKind) -> tuple[AttentionLayerSpec, ...]:
        """Lanes of a FULL or SWA unit: target layers of ``kind`` in model order, then draft
        lanes hosted by ``kind`` in order. Empty if the model has no layer of ``kind``."""
        if kind not in (LayerKind.FULL, LayerKind.SWA):
            raise ValueError(f"attention_lanes: kind must be FULL or SWA, got {kind!r}")
        return self._lanes(kind)

    def state_lanes(self) -> tuple[StateLayerSpec, ...]:
        """Lanes of a state slot: target STATE layers in model order, then STATE draft lanes."""
        return self._lanes(LayerKind.STATE)

    def lanes(self, kind: LayerKind) -> tuple[LayerSpec, ...]:
        """Lanes of a unit of ``kind`` (any kind); see the module docstring."""
        return self._lanes(kind)

    def _lanes(self, kind: LayerKind) -> tuple[Any, ...]:
        target = [layer for layer in self.layers if layer.kind is kind]
        draft = [lane.layer for lane in self.draft_lanes if lane.host is kind]
        return tuple(target + draft)

    def num_target_lanes(self, kind: LayerKind) -> int:
        """Number of target layers of ``kind`` (they are lanes ``0 .. n-1`` of that kind)."""
        return sum(1 for layer in self.layers if layer.kind is kind)

    def lane_of_layer(self, i: int) -> int:
        """Lane index of target layer ``i`` within its kind's lanes."""
        if not 0 <= i < len(self.layers):
            raise IndexError(f"layer index {i} out of range for {len(self.layers)} layers")
        kind = self.layers[i].kind
        return sum(1 for layer in self.layers[:i] if layer.kind is kind)

    def lane_of_draft(self, j: int) -> int:
        """Lane index of draft lane ``j`` within its host kind's lanes."""
        if not 0 <= j < len(self.draft_lanes):
            raise IndexError(f"draft lane index {j} out of range for {len(self.draft_lanes)}")
        host = self.draft_lanes[j].host
        earlier = sum(1 for lane in self.draft_lanes[:j] if lane.host is host)
        return self.num_target_lanes(host) + earlier

    @property
    def max_window(self) -> int | None:
        """Largest SWA window among target layers and SWA draft lanes; None without SWA."""
        windows = [layer.window for layer in self._lanes(LayerKind.SWA)]
        return max(windows) if windows else None

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` inverts it exactly."""
        return {
            "page_size": self.page_size,
            "layers": [_layer_to_dict(layer) for layer in self.layers],
            "draft_lanes": [
                {"host": lane.host.value, "layer": _layer_to_dict(lane.layer)}
                for lane in self.draft_lanes
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemorySpec:
        """Build from :meth:`to_dict`'s format. Errors name the path (``layers[3].window``).

        Layer dicts carry ``kind`` ("full", "swa", "state") and the dataclass fields; dtypes
        are torch attribute names ("bfloat16", "float8_e4m3fn")."""
        layers = tuple(
            _layer_from_dict(f"layers[{i}]", x) for i, x in enumerate(d.get("layers", ()))
        )
        lanes = []
        for j, x in enumerate(d.get("draft_lanes", ())):
            host = _parse_kind(f"draft_lanes[{j}]", "host", x.get("host"))
            layer = _layer_from_dict(f"draft_lanes[{j}].layer", x.get("layer") or {})
            lanes.append(DraftLane(host, layer))
        return cls(page_size=d.get("page_size"), layers=layers, draft_lanes=tuple(lanes))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(where: str, name: str, value: object) -> torch.dtype:
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}.{name} must name a torch dtype, got {value!r}")
    return dtype


def _parse_kind(where: str, name: str, value: object) -> LayerKind:
    try:
        return LayerKind(value)
    except ValueError:
        raise ValueError(
            f"{where}.{name} must be one of {[k.value for k in LayerKind]}, got {value!r}"
        ) from None


def _layer_to_dict(layer: LayerSpec) -> dict[str, Any]:
    if isinstance(layer, StateLayerSpec):
        return {
            "kind": LayerKind.STATE.value,
            "conv_shape": list(layer.conv_shape),
            "conv_dtype": _dtype_name(layer.conv_dtype),
            "ssm_shape": list(layer.ssm_shape),
            "ssm_dtype": _dtype_name(layer.ssm_dtype),
        }
    return {
        "kind": layer.kind.value,
        "num_kv_heads": layer.num_kv_heads,
        "k_head_dim": layer.k_head_dim,
        "v_head_dim": layer.v_head_dim,
        "dtype": _dtype_name(layer.dtype),
        "window": layer.window,
    }


def _layer_from_dict(where: str, d: Mapping[str, Any]) -> LayerSpec:
    kind = _parse_kind(where, "kind", d.get("kind"))
    if kind is LayerKind.STATE:
        conv_shape = tuple(d.get("conv_shape") or ())
        ssm_shape = tuple(d.get("ssm_shape") or ())
        conv_dtype = _parse_dtype(where, "conv_dtype", d.get("conv_dtype"))
        ssm_dtype = _parse_dtype(where, "ssm_dtype", d.get("ssm_dtype"))
        _check_state(where, conv_shape, conv_dtype, ssm_shape, ssm_dtype)
        return StateLayerSpec(conv_shape, conv_dtype, ssm_shape, ssm_dtype)
    fields = (d.get("num_kv_heads"), d.get("k_head_dim"), d.get("v_head_dim"))
    dtype = _parse_dtype(where, "dtype", d.get("dtype"))
    window = d.get("window")
    _check_attention(where, kind, *fields, dtype, window)
    return AttentionLayerSpec(kind, *fields, dtype, window)
