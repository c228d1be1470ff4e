"""Where each lane's bytes live inside one unit.

A **unit** is the fixed-size envelope the arena hands out: a KV page of one attention kind
(FULL or SWA), or a state slot (STATE). A layout maps every lane of a :class:`MemorySpec`
(target layers of that kind, then draft lanes) to byte offsets inside the envelope, and
makes per-lane tensors as ``as_strided`` views of the arena.

Page envelope (layer-major): for each lane in order, a contiguous ``[page_size, H, Dk]`` K
block then a contiguous ``[page_size, H, Dv]`` V block. State slot: for each lane in order, a
contiguous ``conv_shape`` block then a contiguous ``ssm_shape`` block. Every block starts on
a multiple of ``align`` bytes (default 16) and the envelope size ``unit_bytes`` is a multiple
of ``align``. Blocks are packed in order with only the padding alignment needs, so blocks
never overlap and all lie inside ``[0, unit_bytes)``.

Why 16 B and not more: TMA needs 16-byte aligned global addresses and 16-byte multiple
strides. With ``base`` 16-aligned, every block start is 16-aligned; the page stride is
``unit_bytes`` and the token stride is one row (a multiple of 16 by the spec's rule), so all
non-innermost strides are multiples of 16. A larger ``align`` (e.g. 128 for cache-line
starts) can be passed to ``build``; views then require ``base % align == 0``.

Views. ``arena`` is a 1-D contiguous ``uint8`` tensor whose ``data_ptr`` is 16-byte
aligned. A view of ``num_units`` units starting at byte ``base`` has the lane's shape with a
leading unit axis; unit ``u`` of lane ``l`` starts at byte
``base + u * unit_bytes + block_offset(l)`` of the arena. Views alias the arena (writes go
through) and own nothing. All byte arithmetic uses Python ints, so offsets past 2^31 are
exact; views carry them as int64 strides and storage offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unimem.memory.spec import AttentionLayerSpec, LayerKind, MemorySpec, StateLayerSpec

BLOCK_ALIGN = 16
"""Default alignment (bytes) of every block start and of every envelope size."""


def align_up(n: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``n`` (``align`` > 0)."""
    return -(-n // align) * align


def _check_align(align: int) -> None:
    if not isinstance(align, int) or align < BLOCK_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two >= {BLOCK_ALIGN}, got {align!r}")


def _lane_sources(spec: MemorySpec, kind: LayerKind) -> tuple[str, ...]:
    target = [f"layers[{i}]" for i, layer in enumerate(spec.layers) if layer.kind is kind]
    draft = [f"draft_lanes[{j}]" for j, lane in enumerate(spec.draft_lanes) if lane.host is kind]
    return tuple(target + draft)


def _strided_view(
    arena: torch.Tensor,
    base: int,
    num_units: int,
    unit_bytes: int,
    align: int,
    block_offset: int,
    dtype: torch.dtype,
    inner_shape: tuple[int, ...],
) -> torch.Tensor:
    """``[num_units, *inner_shape]`` view of ``dtype``: unit ``u`` is a contiguous block at
    byte ``base + u * unit_bytes + block_offset`` of ``arena``. Validates inputs."""
    if not isinstance(arena, torch.Tensor) or arena.dtype != torch.uint8 or arena.dim() != 1:
        raise ValueError("arena must be a 1-D torch.uint8 tensor")
    if arena.stride(0) != 1:
        raise ValueError("arena must be contiguous")
    if arena.data_ptr() % BLOCK_ALIGN:
        raise ValueError(f"arena.data_ptr() must be {BLOCK_ALIGN}-byte aligned")
    if not isinstance(base, int) or base < 0 or base % align:
        raise ValueError(f"base must be a non-negative multiple of {align}, got {base!r}")
    if not isinstance(num_units, int) or num_units < 0:
        raise ValueError(f"num_units must be a non-negative int, got {num_units!r}")
    end = base + num_units * unit_bytes
    if end > arena.numel():
        raise ValueError(
            f"units [{base}, {end}) exceed the arena of {arena.numel()} bytes "
            f"({num_units} units of {unit_bytes} bytes from base {base})"
        )
    size = dtype.itemsize
    if unit_bytes % size or block_offset % size:
        raise ValueError(
            f"unit_bytes {unit_bytes} and block offset {block_offset} must be multiples of "
            f"the {dtype} itemsize {size}"
        )
    if arena.storage_offset() % size:
        raise ValueError(
            f"arena.storage_offset() {arena.storage_offset()} must be a multiple of {size}"
        )
    n = arena.numel()
    typed = arena[: n - n % size].view(dtype)
    inner_strides = []
    stride = 1
    for d in reversed(inner_shape):
        inner_strides.append(stride)
        stride *= d
    strides = (unit_bytes // size, *reversed(inner_strides))
    offset = typed.storage_offset() + (base + block_offset) // size
    return typed.as_strided((num_units, *inner_shape), strides, offset)


# --------------------------------------------------------------------------- KV pages


@dataclass(frozen=True)
class PageLayout:
    """Layer-major envelope of one KV page of ``kind`` (FULL or SWA). Build with
    :meth:`build`.

    ``lanes[l]`` is lane ``l``'s spec (target layers, then draft lanes; ``num_target`` are
    target layers) and ``sources[l]`` names it in the spec (``"layers[3]"``,
    ``"draft_lanes[0]"``). Lane ``l``'s K block ``[page_size, H, Dk]`` starts at byte
    ``k_offsets[l]`` of the envelope, its V block ``[page_size, H, Dv]`` at ``v_offsets[l]``.
    """

    kind: LayerKind
    page_size: int
    lanes: tuple[AttentionLayerSpec, ...]
    sources: tuple[str, ...]
    num_target: int
    k_offsets: tuple[int, ...]
    v_offsets: tuple[int, ...]
    unit_bytes: int
    align: int = BLOCK_ALIGN

    @classmethod
    def build(cls, spec: MemorySpec, kind: LayerKind, align: int = BLOCK_ALIGN) -> PageLayout:
        """Pack ``spec``'s lanes of ``kind`` in order; raises ``ValueError`` if ``kind`` is
        not an attention kind of the model."""
        if kind not in (LayerKind.FULL, LayerKind.SWA):
            raise ValueError(f"PageLayout.build: kind must be FULL or SWA, got {kind!r}")
        if not spec.has(kind):
            raise ValueError(f"PageLayout.build: the model has no {kind.name} layer")
        _check_align(align)
        lanes = spec.attention_lanes(kind)
        k_offsets, v_offsets = [], []
        off = 0
        for lane in lanes:
            k_offsets.append(off)
            off = align_up(off + spec.page_size * lane.k_row_bytes, align)
            v_offsets.append(off)
            off = align_up(off + spec.page_size * lane.v_row_bytes, align)
        return cls(
            kind=kind,
            page_size=spec.page_size,
            lanes=lanes,
            sources=_lane_sources(spec, kind),
            num_target=spec.num_target_lanes(kind),
            k_offsets=tuple(k_offsets),
            v_offsets=tuple(v_offsets),
            unit_bytes=off,
            align=align,
        )

    @property
    def num_lanes(self) -> int:
        return len(self.lanes)

    def k_block_bytes(self, lane: int) -> int:
        """Bytes of lane ``lane``'s K block: ``page_size * k_row_bytes``."""
        return self.page_size * self.lanes[lane].k_row_bytes

    def v_block_bytes(self, lane: int) -> int:
        """Bytes of lane ``lane``'s V block: ``page_size * v_row_bytes``."""
        return self.page_size * self.lanes[lane].v_row_bytes

    def block_byte_ranges(self, lane: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((k_start, k_end), (v_start, v_end))``: half-open byte ranges of the lane's K and
        V blocks, relative to the envelope start (padding excluded)."""
        k, v = self.k_offsets[lane], self.v_offsets[lane]
        return (k, k + self.k_block_bytes(lane)), (v, v + self.v_block_bytes(lane))

    def k_view(self, arena: torch.Tensor, base: int, num_units: int, lane: int) -> torch.Tensor:
        """K cache of ``lane`` over ``num_units`` pages from byte ``base``:
        ``[num_units, page_size, H, Dk]`` in the lane's dtype, page stride ``unit_bytes``,
        aliasing ``arena``. Raises ``ValueError`` on a misaligned ``base`` or an overrun."""
        spec = self.lanes[lane]
        shape = (self.page_size, spec.num_kv_heads, spec.k_head_dim)
        return _strided_view(
            arena,
            base,
            num_units,
            self.unit_bytes,
            self.align,
            self.k_offsets[lane],
            spec.dtype,
            shape,
        )

    def v_view(self, arena: torch.Tensor, base: int, num_units: int, lane: int) -> torch.Tensor:
        """V cache of ``lane``: ``[num_units, page_size, H, Dv]``; as :meth:`k_view`."""
        spec = self.lanes[lane]
        shape = (self.page_size, spec.num_kv_heads, spec.v_head_dim)
        return _strided_view(
            arena,
            base,
            num_units,
            self.unit_bytes,
            self.align,
            self.v_offsets[lane],
            spec.dtype,
            shape,
        )


# --------------------------------------------------------------------------- state slots


@dataclass(frozen=True)
class SlotLayout:
    """Envelope of one state slot (one request's state for every STATE lane). Build with
    :meth:`build`.

    Lane ``l``'s conv block (``lanes[l].conv_shape``, contiguous) starts at byte
    ``conv_offsets[l]``, its SSM block (``ssm_shape``) at ``ssm_offsets[l]``; each block is
    padded to ``align`` bytes. ``lanes``, ``sources`` and ``num_target`` as in
    :class:`PageLayout`."""

    lanes: tuple[StateLayerSpec, ...]
    sources: tuple[str, ...]
    num_target: int
    conv_offsets: tuple[int, ...]
    ssm_offsets: tuple[int, ...]
    unit_bytes: int
    align: int = BLOCK_ALIGN

    @classmethod
    def build(cls, spec: MemorySpec, align: int = BLOCK_ALIGN) -> SlotLayout:
        """Pack ``spec``'s STATE lanes in order; ``ValueError`` if the model has none."""
        if not spec.has(LayerKind.STATE):
            raise ValueError("SlotLayout.build: the model has no STATE layer")
        _check_align(align)
        lanes = spec.state_lanes()
        conv_offsets, ssm_offsets = [], []
        off = 0
        for lane in lanes:
            conv_offsets.append(off)
            off = align_up(off + lane.conv_bytes, align)
            ssm_offsets.append(off)
            off = align_up(off + lane.ssm_bytes, align)
        return cls(
            lanes=lanes,
            sources=_lane_sources(spec, LayerKind.STATE),
            num_target=spec.num_target_lanes(LayerKind.STATE),
            conv_offsets=tuple(conv_offsets),
            ssm_offsets=tuple(ssm_offsets),
            unit_bytes=off,
            align=align,
        )

    @property
    def kind(self) -> LayerKind:
        return LayerKind.STATE

    @property
    def num_lanes(self) -> int:
        return len(self.lanes)

    def block_byte_ranges(self, lane: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((conv_start, conv_end), (ssm_start, ssm_end))`` relative to the envelope
        (padding excluded)."""
        c, s = self.conv_offsets[lane], self.ssm_offsets[lane]
        spec = self.lanes[lane]
        return (c, c + spec.conv_bytes), (s, s + spec.ssm_bytes)

    def conv_view(self, arena: torch.Tensor, base: int, num_units: int, lane: int) -> torch.Tensor:
        """Conv state of ``lane`` over ``num_units`` slots: ``[num_units, *conv_shape]`` in
        ``conv_dtype``, slot stride ``unit_bytes``, aliasing ``arena``."""
        spec = self.lanes[lane]
        return _strided_view(
            arena,
            base,
            num_units,
            self.unit_bytes,
            self.align,
            self.conv_offsets[lane],
            spec.conv_dtype,
            spec.conv_shape,
        )

    def ssm_view(self, arena: torch.Tensor, base: int, num_units: int, lane: int) -> torch.Tensor:
        """SSM state of ``lane``: ``[num_units, *ssm_shape]`` in ``ssm_dtype``; as
        :meth:`conv_view`."""
        spec = self.lanes[lane]
        return _strided_view(
            arena,
            base,
            num_units,
            self.unit_bytes,
            self.align,
            self.ssm_offsets[lane],
            spec.ssm_dtype,
            spec.ssm_shape,
        )


# --------------------------------------------------------------------------- all kinds


@dataclass(frozen=True)
class MemoryLayout:
    """The layouts of every unit kind of one spec; a kind the model lacks is ``None``."""

    page_size: int
    full: PageLayout | None
    swa: PageLayout | None
    state: SlotLayout | None

    @classmethod
    def build(cls, spec: MemorySpec, align: int = BLOCK_ALIGN) -> MemoryLayout:
        def page(kind: LayerKind) -> PageLayout | None:
            return PageLayout.build(spec, kind, align) if spec.has(kind) else None

        state = SlotLayout.build(spec, align) if spec.has(LayerKind.STATE) else None
        return cls(spec.page_size, page(LayerKind.FULL), page(LayerKind.SWA), state)

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Kinds with a layout, in canonical order."""
        return tuple(k for k in LayerKind if self._get(k) is not None)

    def _get(self, kind: LayerKind) -> PageLayout | SlotLayout | None:
        return {LayerKind.FULL: self.full, LayerKind.SWA: self.swa, LayerKind.STATE: self.state}[
            kind
        ]

    def of(self, kind: LayerKind) -> PageLayout | SlotLayout:
        """The layout of ``kind``; ``ValueError`` if the model has no layer of that kind."""
        layout = self._get(kind)
        if layout is None:
            raise ValueError(f"the model has no {kind.name} layer")
        return layout

    def unit_bytes(self, kind: LayerKind) -> int:
        """Envelope size in bytes of one unit of ``kind``."""
        return self.of(kind).unit_bytes

    def describe(self) -> str:
        """A plain-text table of every block's offset and size, per envelope."""
        out = []
        for kind in self.kinds:
            layout = self.of(kind)
            if isinstance(layout, PageLayout):
                title = f"{kind.name} page: page_size {layout.page_size}"
            else:
                title = f"{kind.name} slot"
            out.append(
                f"{title}, {layout.num_lanes} lanes ({layout.num_target} target), "
                f"unit_bytes {layout.unit_bytes}, align {layout.align}"
            )
            out.append(
                f"  {'lane':>4}  {'source':<16}{'block':<6}{'dtype':<15}{'shape':<20}"
                f"{'offset':>10}{'bytes':>10}"
            )
            for lane in range(layout.num_lanes):
                for name, dtype, shape, (start, end) in _blocks(layout, lane):
                    shape_s = "[" + ", ".join(map(str, shape)) + "]"
                    dtype_s = str(dtype).removeprefix("torch.")
                    out.append(
                        f"  {lane:>4}  {layout.sources[lane]:<16}{name:<6}{dtype_s:<15}"
                        f"{shape_s:<20}{start:>10}{end - start:>10}"
                    )
            blocks = [b for ln in range(layout.num_lanes) for b in _blocks(layout, ln)]
            used = sum(end - start for *_, (start, end) in blocks)
            out.append(f"  padding {layout.unit_bytes - used} bytes")
        return "\n".join(out)


def _blocks(
    layout: PageLayout | SlotLayout, lane: int
) -> list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, int]]]:
    """``(name, dtype, shape, (start, end))`` of each block of ``lane``, in envelope order."""
    first, second = layout.block_byte_ranges(lane)
    spec = layout.lanes[lane]
    if isinstance(layout, PageLayout):
        h, ps = spec.num_kv_heads, layout.page_size
        return [
            ("K", spec.dtype, (ps, h, spec.k_head_dim), first),
            ("V", spec.dtype, (ps, h, spec.v_head_dim), second),
        ]
    return [
        ("conv", spec.conv_dtype, spec.conv_shape, first),
        ("ssm", spec.ssm_dtype, spec.ssm_shape, second),
    ]
