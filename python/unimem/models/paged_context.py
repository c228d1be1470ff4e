"""The paged :class:`~unimem.models.forward_context.ForwardContext`: what the model sees of a
memory pool during one forward.

Attention goes through the pool's paged K/V views and the step's attention metadata; GDN
goes through the requests' state slots, updated in place (extend, decode) or, in verify, left
alone while the layer's record of the step's inputs (or the state after every position) goes
to buffers the caller owns. The context takes values only — the pool's per-layer views
(:class:`PagedLayers`, built once), the step's metadata, slots and row layout, the attention
backend — so the runner that builds extend and decode steps and the speculative verify step
build it alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import AttentionMetadata
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.models import batch_invariant, gdn_prefill
from unimem.models.batch_invariant import gdn_batch_invariant
from unimem.models.config import HybridConfig
from unimem.models.forward_context import ForwardContext, ForwardMode
from unimem_kernel import gdn as gdn_ops
from unimem_kernel.gdn_reference import VerifyRecord

__all__ = ["GdnVerifyBuffers", "PackedLanes", "PagedContext", "PagedLayers"]


@dataclass(frozen=True)
class PagedLayers:
    """A pool's memory as the model's layers see it. ``kv[i]``: attention layer ``i``'s K view
    ``[num_pages, page_size, Hkv, Dk]`` and V view ``[..., Dv]``; ``swa``: the attention
    layers that are sliding-window; ``state[i]``: GDN layer ``i``'s conv view
    ``[num_slots, *conv_shape]`` and SSM view ``[num_slots, *ssm_shape]``; ``config``: the
    model's (windows, softmax scale, GDN key heads). The views are the pool's own, fixed for
    its lifetime, so this is built once per pool."""

    config: HybridConfig
    kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
    swa: frozenset[int]
    state: Mapping[int, tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, pool: MemoryPool, config: HybridConfig) -> PagedLayers:
        """The target model's layers over ``pool`` (draft lanes are not among them)."""
        kv, swa, state = {}, set(), {}
        for i, layer in enumerate(pool.spec.layers):
            lane = pool.spec.lane_of_layer(i)
            if layer.kind is LayerKind.STATE:
                state[i] = pool.state_cache(lane)
            else:
                kv[i] = pool.kv_cache(layer.kind, lane)
                if layer.kind is LayerKind.SWA:
                    swa.add(i)
        return cls(config, kv, frozenset(swa), state)


GdnVerifyBuffers = VerifyRecord | tuple[torch.Tensor, torch.Tensor]
"""Where a verify's GDN layer writes, for ``max_bs`` lanes: a
:class:`~unimem_kernel.gdn_reference.VerifyRecord` of the step's inputs, or the
``(conv_scratch, ssm_scratch)`` states after every position (``[max_bs, width, ...]``)."""


class PackedLanes(NamedTuple):
    """A ragged verify's packed rows (:func:`unimem.speculative.verify_lengths.packed_layout`
    makes them): ``valid [R]`` bool (the row belongs to a lane), ``uniform_index [R]`` int64
    (its index in the uniform ``[bs, width]`` layout; padding rows: ``bs * width``) and
    ``width`` (``gamma + 1``)."""

    valid: torch.Tensor
    uniform_index: torch.Tensor
    width: int


class PagedContext(ForwardContext):
    """A ``ForwardContext`` of one step over ``layers`` (a pool's views) with ``backend``:
    ``mode``, the step's ``meta`` (positions, ``cu_seqlens_q``, page tables, write slots),
    ``state_slots [bs]`` (physical slots, -1 for padded lanes; None without GDN layers) and
    ``logits_indices``. ``capture``: layers whose hidden states are kept in :attr:`hidden`.
    ``cu_seqlens_host``: an extend's ``cu_seqlens_q`` as host ints (fla's chunked GDN prefill
    plans its chunks from them without reading the device). ``verify_buffers[i]``: where GDN
    layer ``i`` of a verify writes (:data:`GdnVerifyBuffers`); required in verify.

    ``packed`` (a ragged verify, :class:`PackedLanes`): the step's rows are packed lanes of
    uneven lengths. Attention runs on the packed rows (the metadata's ``cu_seqlens_q``) and
    zeroes the padding rows' outputs (a varlen kernel leaves them unwritten); GDN scatters
    the packed rows into the uniform ``[bs, width]`` layout (rows past a lane's length are
    zeros: no decay, no update), runs the fixed-width verify form into the layer's buffers,
    and gathers its output back to the packed rows."""

    def __init__(
        self,
        mode: ForwardMode,
        meta: AttentionMetadata,
        layers: PagedLayers,
        backend: AttentionBackend,
        state_slots: torch.Tensor | None,
        logits_indices: torch.Tensor,
        *,
        capture: tuple[int, ...] = (),
        packed: PackedLanes | None = None,
        verify_buffers: Mapping[int, GdnVerifyBuffers] | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> None:
        super().__init__(mode, meta.positions, meta.cu_seqlens_q, logits_indices)
        self.meta = meta
        self.layers = layers
        self.backend = backend
        self.state_slots = state_slots
        self.capture = capture
        self.packed = packed
        self.verify_buffers = verify_buffers
        self.cu_seqlens_host = cu_seqlens_host
        self._fla_varlen: gdn_prefill.FlaVarlen | None = None  # built by the first fla layer
        self.hidden: dict[int, torch.Tensor] = {}

    def attention(self, layer_idx, q, k, v, *, sinks=None):
        caches, swa = self.layers.kv[layer_idx], layer_idx in self.layers.swa
        self.backend.store_kv(k, v, *caches, self.meta, swa=swa)
        return self._attend(layer_idx, q, caches, swa, sinks)

    def rope_attention(self, layer_idx, q, k, v, cos, sin, *, sinks=None, qk_norm=None):
        # (the q/k norms,) RoPE and the K/V store in one launch: the rotated K is written
        # only into the cache
        caches, swa = self.layers.kv[layer_idx], layer_idx in self.layers.swa
        q = self.backend.rope_store_kv(
            q, k, v, cos, sin, *caches, self.meta, swa=swa, qk_norm=qk_norm
        )
        return self._attend(layer_idx, q, caches, swa, sinks)

    def _attend(self, layer_idx, q, caches, swa, sinks):
        """The backend's attention of ``q`` over the layer's caches (K/V already stored)."""
        config = self.layers.config
        out = self.backend.attend(
            q,
            *caches,
            self.meta,
            swa=swa,
            window=config.layer_window(layer_idx),
            scale=config.attention_scale,
            sinks=sinks,
            invariant=batch_invariant.covers(q),
        )
        if self.packed is not None:  # padding rows: finite zeros, whatever the kernel left
            out = torch.where(self.packed.valid[:, None, None], out, 0)
        return out

    def gdn(self, layer_idx, mixed_qkv, g, beta, *, conv_weight):
        if self.packed is None:
            return self._gdn(layer_idx, mixed_qkv, g, beta, conv_weight)
        idx = self.packed.uniform_index
        n = self.state_slots.shape[0] * self.packed.width

        def uniform(x: torch.Tensor) -> torch.Tensor:  # packed rows -> [bs * width]
            buf = x.new_zeros(n + 1, *x.shape[1:])
            buf[idx] = x  # padding rows land on the dump row n
            return buf[:n]

        o = self._gdn(layer_idx, uniform(mixed_qkv), uniform(g), uniform(beta), conv_weight)
        return torch.cat([o, o.new_zeros(1, *o.shape[1:])])[idx]

    def _verify_outputs(self, layer_idx: int) -> dict[str, object]:
        """The keyword arguments that send a verify's GDN layer to its buffers."""
        bs = self.state_slots.shape[0]
        buffers = self.verify_buffers[layer_idx]
        if isinstance(buffers, VerifyRecord):
            return {"record": buffers.lanes(bs)}
        conv_scratch, ssm_scratch = buffers
        return {"conv_scratch": conv_scratch[:bs], "ssm_scratch": ssm_scratch[:bs]}

    def _gdn(self, layer_idx, mixed_qkv, g, beta, conv_weight):
        conv, ssm = self.layers.state[layer_idx]
        key_heads = self.layers.config.gdn_key_heads
        outputs = self._verify_outputs(layer_idx) if self.mode is ForwardMode.VERIFY else {}
        bi = gdn_batch_invariant(ssm)
        kernel = "recurrent"
        if self.mode is ForwardMode.EXTEND:
            # chunked prefill (fla's kernel where the recurrent one would cost more than
            # fla's launches, or ours; never batch-invariant: it rounds differently from the
            # recurrent decode/verify form): unimem.models.gdn_prefill
            kernel = gdn_prefill.prefill_kernel(
                self.meta.max_seqlen_q, ssm.device, bi, requests=self.state_slots.shape[0],
                value_heads=ssm.shape[1], head_v_dim=ssm.shape[3],
            )  # fmt: skip
        if kernel == "fla":
            if self._fla_varlen is None:  # one chunk table for every GDN layer of the extend
                self._fla_varlen = gdn_prefill.fla_varlen(
                    self.meta.cu_seqlens_q, self.cu_seqlens_host
                )
            return gdn_prefill.gdn_extend_fla(
                mixed_qkv, conv_weight, g, beta, conv, ssm, self.state_slots,
                self.meta.cu_seqlens_q, max_seqlen=self.meta.max_seqlen_q,
                varlen=self._fla_varlen, num_k_heads=key_heads,
            )  # fmt: skip
        return gdn_ops.gdn_forward(
            self.mode.value,
            mixed_qkv,
            conv_weight,
            g,
            beta,
            conv,
            ssm,
            self.state_slots,
            # extend rows: device offsets with a host bound (no host read, no upload)
            self.meta.cu_seqlens_q,
            max_seqlen=self.meta.max_seqlen_q,
            num_k_heads=key_heads,
            batch_invariant=bi,
            chunked_prefill=kernel == "triton",  # our own chunked kernel (opt-in)
            **outputs,
        )

    def capture_hidden(self, layer_idx, hidden):
        if layer_idx in self.capture:
            self.hidden[layer_idx] = hidden
