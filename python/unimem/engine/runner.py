"""Runs one scheduled batch through the model with paged memory (eager).

The runner owns a :class:`MetadataBuilder` (capture-stable buffers) and an attention backend;
the pool owns the memory and its tables. For each batch it builds the step's attention
metadata from the request table and the pool's live ``v2p`` tables, wraps pool views in a
:class:`PagedContext` and calls the model. The model never sees pages or slots.
"""

from __future__ import annotations

import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.engine.forward_context import ForwardContext, ForwardMode
from unimem.engine.model import HybridModel
from unimem.engine.scheduler import Batch
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.memory.staging import upload_int32
from unimem.state import gdn_reference


class PagedContext(ForwardContext):
    """A ``ForwardContext`` over a pool: attention through paged K/V views and the step's
    metadata, GDN through the requests' state slots (updated in place)."""

    def __init__(
        self,
        runner: ModelRunner,
        mode: ForwardMode,
        meta: AttentionMetadata,
        state_slots: torch.Tensor | None,
        logits_indices: torch.Tensor,
        cu_seqlens_q_host: list[int],
    ) -> None:
        super().__init__(mode, meta.positions, meta.cu_seqlens_q, logits_indices)
        self.runner = runner
        self.meta = meta
        self.state_slots = state_slots
        self.cu_seqlens_q_host = cu_seqlens_q_host

    def attention(self, layer_idx, q, k, v):
        r = self.runner
        kind = r.layer_kinds[layer_idx]
        k_cache, v_cache = r.pool.kv_cache(kind, r.spec.lane_of_layer(layer_idx))
        return r.backend.forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            self.meta,
            swa=kind is LayerKind.SWA,
            window=r.model.config.layer_window(layer_idx),
            scale=q.shape[-1] ** -0.5,
        )

    def gdn(self, layer_idx, mixed_qkv, g, beta, *, conv_weight):
        r = self.runner
        conv, ssm = r.pool.state_cache(r.spec.lane_of_layer(layer_idx))
        return gdn_reference.gdn_forward(
            self.mode.value,
            mixed_qkv,
            conv_weight,
            g,
            beta,
            conv,
            ssm,
            self.state_slots,
            self.cu_seqlens_q_host,
        )


class ModelRunner:
    """Eager forward of scheduled batches over ``pool`` with ``backend``."""

    def __init__(
        self,
        model: HybridModel,
        pool: MemoryPool,
        backend: AttentionBackend,
        max_bs: int,
        max_tokens: int,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.spec = pool.spec
        self.device = pool.device
        self.layer_kinds = [layer.kind for layer in pool.spec.layers]
        self.builder = MetadataBuilder(
            max_bs=max_bs,
            max_pages_per_req=pool.max_pages_per_request,
            max_tokens=max_tokens,
            page_size=pool.page_size,
            swa=pool.spec.has(LayerKind.SWA),
            device=pool.device,
        )

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits ``[bs, vocab]`` of the last consumed token of each request."""
        reqs, lens = batch.reqs, batch.lens
        bs = len(reqs)
        starts = [r.kv_len for r in reqs]
        ids = [t for r, s, n in zip(reqs, starts, lens, strict=True) for t in r.tokens[s : s + n]]
        slots_v = [r.mem.state_slot for r in reqs]
        packed = upload_int32(
            [r.mem.row for r in reqs] + starts + lens + slots_v + ids, self.device
        )
        rows, prefix, ext = packed[:bs], packed[bs : 2 * bs], packed[2 * bs : 3 * bs]
        vslots, input_ids = packed[3 * bs : 4 * bs], packed[4 * bs :]
        pool = self.pool
        if batch.mode == "decode":
            meta = self.builder.decode(pool.req_to_token, rows, prefix, pool.full_v2p, pool.swa_v2p)
            mode = ForwardMode.DECODE
        else:
            meta = self.builder.extend(
                pool.req_to_token,
                rows,
                prefix,
                ext,
                pool.full_v2p,
                pool.swa_v2p,
                num_tokens=len(ids),
                max_seqlen_q=max(lens),
            )
            mode = ForwardMode.EXTEND
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        last = upload_int32(cu[1:], self.device).long() - 1
        state_slots = pool.physical_state_slots(vslots) if pool.spec.has(LayerKind.STATE) else None
        ctx = PagedContext(self, mode, meta, state_slots, last, cu)
        return self.model.forward(input_ids.long(), ctx)
