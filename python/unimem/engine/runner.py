"""Runs one scheduled batch through the model with paged memory (eager).

The runner owns a :class:`MetadataBuilder` (capture-stable buffers) and an attention backend;
the pool owns the memory and its tables. For each batch it builds the step's attention
metadata from the request table and the pool's live ``v2p`` tables, wraps pool views in a
:class:`PagedContext` and calls the model. The model never sees pages or slots.

With a :class:`~unimem.spec.chain.DsparkChain` the runner also drives chain speculative
decoding (DESIGN §6): an extend pass captures the chosen target layers' hidden states and
writes the drafter's context K/V for every token it runs; :meth:`ModelRunner.verify` runs a
whole verify step — write window, draft, target verify, accept, commit — on the device
without reading anything back, and returns device tensors for the caller to read once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.engine.forward_context import ForwardContext, ForwardMode
from unimem.engine.model import HybridModel
from unimem.engine.scheduler import Batch
from unimem.engine.speculative import DraftRunner
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.memory.staging import upload_int32
from unimem.spec.accept import commit_mask, greedy_accept
from unimem.spec.chain import DsparkChain
from unimem_kernel import gdn as gdn_ops
from unimem_kernel.state_commit import StateCommitPlan, commit_states_multi


class PagedContext(ForwardContext):
    """A ``ForwardContext`` over a pool: attention through paged K/V views and the step's
    metadata, GDN through the requests' state slots — updated in place (extend, decode) or,
    in verify, left alone while the state after every position goes to the runner's scratch.
    ``capture``: target layers whose hidden states are kept in :attr:`hidden`."""

    def __init__(
        self,
        runner: ModelRunner,
        mode: ForwardMode,
        meta: AttentionMetadata,
        state_slots: torch.Tensor | None,
        logits_indices: torch.Tensor,
        cu_seqlens_q_host: list[int],
        capture: tuple[int, ...] = (),
    ) -> None:
        super().__init__(mode, meta.positions, meta.cu_seqlens_q, logits_indices)
        self.runner = runner
        self.meta = meta
        self.state_slots = state_slots
        self.cu_seqlens_q_host = cu_seqlens_q_host
        self.capture = capture
        self.hidden: dict[int, torch.Tensor] = {}

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
        scratch = {}
        if self.mode is ForwardMode.VERIFY:
            bs = self.state_slots.shape[0]
            conv_scratch, ssm_scratch = r.verify_scratch[layer_idx]
            scratch = {"conv_scratch": conv_scratch[:bs], "ssm_scratch": ssm_scratch[:bs]}
        return gdn_ops.gdn_forward(
            self.mode.value,
            mixed_qkv,
            conv_weight,
            g,
            beta,
            conv,
            ssm,
            self.state_slots,
            self.cu_seqlens_q_host,
            **scratch,
        )

    def capture_hidden(self, layer_idx, hidden):
        if layer_idx in self.capture:
            self.hidden[layer_idx] = hidden


class VerifyOutput(NamedTuple):
    """Device results of one verify step (nothing read back yet): ``target [bs, gamma + 1]``
    int64, the target's greedy token after each verify row; ``accepted [bs]`` int32, drafts
    accepted. The step committed ``target[b, :accepted[b] + 1]``."""

    target: torch.Tensor
    accepted: torch.Tensor


class ModelRunner:
    """Eager forward of scheduled batches over ``pool`` with ``backend``; with ``chain``, also
    the draft and commit halves of chain speculative decoding."""

    def __init__(
        self,
        model: HybridModel,
        pool: MemoryPool,
        backend: AttentionBackend,
        max_bs: int,
        max_tokens: int,
        chain: DsparkChain | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.spec = pool.spec
        self.device = pool.device
        self.layer_kinds = [layer.kind for layer in pool.spec.layers]
        self.max_bs = max_bs
        if chain is not None:
            max_tokens = max(max_tokens, max_bs * chain.verify_width)
        self.builder = MetadataBuilder(
            max_bs=max_bs,
            max_pages_per_req=pool.max_pages_per_request,
            max_tokens=max_tokens,
            page_size=pool.page_size,
            swa=pool.spec.has(LayerKind.SWA),
            device=pool.device,
        )
        self.chain = chain
        self.drafts: DraftRunner | None = None
        self.verify_scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._commit_plan: StateCommitPlan | None = None
        if chain is not None:
            self.drafts = DraftRunner(chain, pool, backend, max_bs)
            self._init_verify_scratch(chain.verify_width)

    def _init_verify_scratch(self, width: int) -> None:
        """Per GDN layer, ``[max_bs, width, *S]`` scratch for the conv and SSM states after
        every verified position (the states' dtypes), and one commit plan moving scratch
        entries into the pool's state views."""
        scratches, dests = [], []
        for i, kind in enumerate(self.layer_kinds):
            if kind is not LayerKind.STATE:
                continue
            conv, ssm = self.pool.state_cache(self.spec.lane_of_layer(i))
            pair = tuple(
                torch.zeros(self.max_bs, width, *v.shape[1:], dtype=v.dtype, device=self.device)
                for v in (conv, ssm)
            )
            self.verify_scratch[i] = pair
            scratches += pair
            dests += [conv, ssm]
        if scratches:
            self._commit_plan = StateCommitPlan(scratches, dests)

    # ----------------------------------------------------------------------------- extend/decode

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits ``[bs, vocab]`` of the last consumed token of each request. With a chain,
        also stores the drafter's context K/V for every token consumed."""
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
        elif batch.mode == "extend":
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
        else:
            raise ValueError(f"ModelRunner.forward runs extend and decode, not {batch.mode!r}")
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        last = upload_int32(cu[1:], self.device).long() - 1
        capture = self.drafts.target_layers if self.drafts is not None else ()
        ctx = PagedContext(self, mode, meta, self._state_slots(vslots), last, cu, capture)
        logits = self.model.forward(input_ids.long(), ctx)
        if self.drafts is not None:
            self.drafts.write_context(ctx.hidden, meta)
        return logits

    def _state_slots(self, vslots: torch.Tensor) -> torch.Tensor | None:
        if not self.spec.has(LayerKind.STATE):
            return None
        return self.pool.physical_state_slots(vslots)

    # ----------------------------------------------------------------------------- verify

    @torch.inference_mode()
    def verify(self, batch: Batch) -> VerifyOutput:
        """One chain step for every request of ``batch`` (mode "verify": each request's
        anchor is its token at ``kv_len``, and its pages cover ``kv_len + gamma + 1`` tokens).

        1. write window: the verify metadata gathers and translates the ``gamma + 1`` write
           slots per request (one launch) — they were reserved ahead by the scheduler;
        2. draft: ``gamma`` tokens per request (block K/V into the draft lanes);
        3. target verify of ``[anchor, d_1 .. d_gamma]``: K/V into the write window, GDN
           states after every position into scratch (slots untouched), hidden states of the
           drafter's target layers captured;
        4. greedy accept;
        5. commit: every GDN layer's conv and SSM state at row ``accepted`` into the request's
           slot (one launch translating virtual slots), and the drafter's context K/V for the
           committed rows only.

        Nothing is read back and nothing is freed (rejected rows are overwritten next step).
        """
        if self.chain is None or batch.mode != "verify":
            raise ValueError("ModelRunner.verify needs a chain and a verify batch")
        gamma, width = self.chain.gamma, self.chain.verify_width
        reqs = batch.reqs
        bs = len(reqs)
        starts = [r.kv_len for r in reqs]
        anchors = [r.tokens[r.kv_len] for r in reqs]
        packed = upload_int32(
            [r.mem.row for r in reqs]
            + starts
            + [r.mem.state_slot for r in reqs]
            + [r.rid for r in reqs]
            + anchors,
            self.device,
        )
        rows, seq_lens, vslots, rids, anchor_ids = packed.view(5, bs)
        pool = self.pool
        meta = self.builder.verify(
            pool.req_to_token, rows, seq_lens, pool.full_v2p, pool.swa_v2p, gamma=gamma
        )
        draft = self.drafts.propose(rows, seq_lens, anchor_ids, rids)
        input_ids = torch.cat([anchor_ids.long()[:, None], draft], dim=1).reshape(-1)
        logits_rows = torch.arange(bs * width, device=self.device)
        cu = list(range(0, bs * width + 1, width))
        ctx = PagedContext(
            self,
            ForwardMode.VERIFY,
            meta,
            self._state_slots(vslots),
            logits_rows,
            cu,
            self.drafts.target_layers,
        )
        logits = self.model.forward(input_ids, ctx)
        target = torch.argmax(logits, dim=-1).reshape(bs, width)
        accepted, _ = greedy_accept(draft, target)
        if self._commit_plan is not None:
            commit_states_multi(self._commit_plan, accepted, vslots, pool.state_v2p)
        keep = commit_mask(accepted, width).reshape(-1)
        self.drafts.write_context(ctx.hidden, meta, keep)
        return VerifyOutput(target, accepted)
