"""The drafter's side of a DSPARK step over a pool: draft lanes, draft metadata, context K/V.

:class:`DraftRunner` connects a :class:`~unimem.speculative.drafter.DsparkDrafter` to the pool's
draft lanes. It owns a second :class:`MetadataBuilder` (the draft pass's metadata must stay
valid next to the target verify's) and nothing else; the drafter's K/V live in the draft
lanes of the target's own pages, reached through the pool's per-lane views.

- :meth:`DraftRunner.propose`: one block forward of ``gamma`` queries per request at
  positions ``kv_len .. kv_len + gamma - 1`` (verify-style metadata of ``gamma`` tokens), its
  K/V written into the draft lanes at those positions; tokens picked left to right, with the
  acceptance control applied to each column as it is chosen.
- :meth:`DraftRunner.propose_sampled`: the same block, with the lanes of sampled requests
  drawing each column from their filtered distribution ``q`` over the drafter's own
  vocabulary (returned with the tokens in compact form,
  :class:`~unimem.speculative.spec_sampling.Proposals`, for speculative sampling's accept
  and residual).
- with ``survival=True`` both also return the confidence head's survival of every drafted
  token (``[bs, gamma]``, :meth:`~unimem.speculative.drafter.DsparkDrafter.survival`), from
  which an adaptive verify step chooses its lengths;
- :meth:`DraftRunner.write_context`: context K/V projected from the target's captured hidden
  states, stored at a step's write slots — every token of a prefill, or only the committed
  rows of a verify (the other rows are redirected to the sink slot 0, which stores zeros:
  a fixed-shape, sync-free masked write).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.models import batch_invariant
from unimem.models.sampler import UNFILTERED, SamplingRows, tempered_keep_threshold
from unimem.speculative import spec_sampling
from unimem.speculative.chain import DsparkChain
from unimem_kernel.draw_probs import draw_with_probs

__all__ = ["DraftRunner"]


class DraftRunner:
    """Runs ``chain.drafter`` over ``pool``'s draft lanes with ``backend`` (module docstring).

    ``max_bs`` requests per step. The pool's spec must carry exactly the drafter's lanes
    (``memory_spec(config, page_size, draft_lanes=drafter.config.lanes())``).
    """

    def __init__(
        self, chain: DsparkChain, pool: MemoryPool, backend: AttentionBackend, max_bs: int
    ) -> None:
        dc = chain.drafter.config
        if pool.spec.draft_lanes != dc.lanes():
            raise ValueError(
                "the pool's MemorySpec.draft_lanes are not the drafter's lanes: build the pool "
                "with memory_spec(config, page_size, draft_lanes=drafter.config.lanes())"
            )
        self.chain = chain
        self.drafter = chain.drafter
        self.pool = pool
        self.backend = backend
        self.gamma = chain.gamma
        self.lanes = [
            (lane.host, pool.spec.lane_of_draft(j), dc.layer_window(j))
            for j, lane in enumerate(pool.spec.draft_lanes)
        ]
        self.builder = MetadataBuilder(
            max_bs=max_bs,
            max_pages_per_req=pool.max_pages_per_request,
            max_tokens=max_bs * chain.gamma,
            page_size=pool.page_size,
            swa=pool.spec.has(LayerKind.SWA),
            device=pool.device,
        )

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the context K/V are projected from."""
        return self.drafter.config.target_layers

    def propose(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        anchors: torch.Tensor,
        rids: torch.Tensor,
        *,
        survival: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens ``[bs, gamma]`` (int64) for requests at request-table ``rows`` with
        committed lengths ``seq_lens`` and anchors ``anchors`` (the token at ``seq_lens``);
        ``rids`` key the acceptance control. Writes the block's K/V into the draft lanes at
        positions ``seq_lens .. seq_lens + gamma - 1``; reads nothing on the host. With
        ``survival``: ``(tokens, survival [bs, gamma] float32)``."""
        base, hidden = self._block_forward(rows, seq_lens, anchors)
        ref = take = None
        if self.chain.control is not None:
            ref, take = self._control_decisions(seq_lens, rids, base.shape[1])
        tokens = self.drafter.pick(base, anchors, ref, take)
        if survival:
            return tokens, self.drafter.survival(hidden, anchors, tokens)
        return tokens

    def propose_sampled(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        anchors: torch.Tensor,
        rids: torch.Tensor,
        params: SamplingRows,
        *,
        survival: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`propose` for a batch with sampled lanes: ``(tokens [bs, gamma] int64,
        proposals)`` (:class:`~unimem.speculative.spec_sampling.Proposals`). A lane with
        temperature > 0 draws column ``i`` from ``q_i`` — the column's logits (Markov bias
        included) under the lane's temperature and top-k / top-p / min-p
        (:func:`unimem.models.sampler.filtered_probs`), over the drafter's own vocabulary
        (a reduced one: the same distribution as over the target's with ``-inf`` off
        ``d2t``, in ``K`` entries instead of the target's ``V``) — the Gumbel-max draw over
        the column's kept tempered logits with the draft stream's noise
        (:func:`~unimem.speculative.spec_sampling.draft_keys`: at the token's position, or
        by step under block verification; :func:`unimem_kernel.draw_probs.draw_with_probs`);
        a greedy lane picks exactly as :meth:`propose` (its ``q`` is never read). A draft the
        acceptance control replaces gets the point mass on the reference as its proposal.
        With ``survival``: ``(tokens, proposals, survival [bs, gamma] float32)``."""
        base, hidden = self._block_forward(rows, seq_lens, anchors)
        control = self.chain.control
        start = seq_lens.long()
        live = params.temperature > 0
        if control is not None:
            ref, take = self._control_decisions(seq_lens, rids, base.shape[1])
        t, k, top_p, min_p = params.temperature, params.top_k, params.top_p, params.min_p
        d2t = self.drafter.d2t if self.drafter.config.reduced else None
        # every column's noise keys in one launch (column i proposes the token at position
        # seq_len + i + 1): by position, or by step under block verification
        gamma = base.shape[1]
        keys = spec_sampling.draft_keys(params.seeds, start, gamma, self.chain.sampled_verify)
        keys = keys.t().contiguous()  # [gamma, bs]: a column's keys contiguous

        filtered = params.rule != UNFILTERED
        if not filtered:
            no_cut = torch.full_like(t, -math.inf, dtype=torch.float32)
        replaced = torch.zeros_like(live)

        def choose(i: int, logits: torch.Tensor) -> tuple[torch.Tensor, tuple]:
            if filtered:  # the sampler's cut-off of the tempered row, without a tempered copy
                cut = tempered_keep_threshold(logits, t, k, top_p, min_p, params.rule)
            else:
                cut = no_cut
            # the draw, q (filtered_probs's distribution) and q(x) in two launches
            idx, q, qx = draw_with_probs(logits, t, cut, keys[i])  # draft ids
            tok = idx if d2t is None else d2t[idx]
            point = replaced
            if control is not None:
                point = take[:, i]
                tok = torch.where(point, ref[:, i].long(), tok)
                qx = torch.where(point, 1.0, qx)
            return tok, (q, qx, point)

        tokens, cols = self.drafter.sample_pick(base, anchors, choose)
        proposals = spec_sampling.Proposals(
            tokens,
            torch.stack([c[1] for c in cols], dim=1),
            torch.stack([c[0] for c in cols], dim=1),
            torch.stack([c[2] for c in cols], dim=1),
            d2t,
            None if d2t is None else self.drafter.t2d,
        )
        if survival:
            return tokens, proposals, self.drafter.survival(hidden, anchors, tokens)
        return tokens, proposals

    def _control_decisions(
        self, seq_lens: torch.Tensor, rids: torch.Tensor, gamma: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance control's ``(reference tokens, take)`` ``[bs, gamma]`` for the
        block's columns, in one gather: column ``i`` proposes the token at position
        ``seq_len + i + 1``."""
        return self.chain.control.decide_window(rids, seq_lens, gamma, offset=1)

    def _block_forward(
        self, rows: torch.Tensor, seq_lens: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block forward's base logits ``[bs, gamma, vocab]`` and final hidden states
        ``[bs, gamma, d_model]`` (block K/V stored)."""
        pool = self.pool
        meta = self.builder.verify(
            pool.req_to_token, rows, seq_lens, pool.full_v2p, pool.swa_v2p, gamma=self.gamma - 1
        )

        def attend(j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kind, lane, window = self.lanes[j]
            k_cache, v_cache = pool.kv_cache(kind, lane)
            return self.backend.forward(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta,
                swa=kind is LayerKind.SWA,
                window=window,
                scale=q.shape[-1] ** -0.5,
                invariant=batch_invariant.covers(q),
            )

        return self.drafter.block_forward(anchors, meta.positions, attend)

    def write_context(
        self,
        hidden: dict[int, torch.Tensor],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Store context K/V for the tokens of ``meta`` (a target step's metadata: their
        positions and write slots) projected from ``hidden[i] [T, d_model]``, the target's
        residual stream after each of :attr:`target_layers`. ``keep [T]`` (bool, optional):
        only those tokens are written; the others go to the sink slot (zeros)."""
        kvs = self.drafter.context_kv([hidden[i] for i in self.target_layers], meta.positions)
        if keep is not None:
            full = torch.where(keep, meta.full_write_slots, 0)
            swa = meta.swa_write_slots
            swa = None if swa is None else torch.where(keep, swa, 0)
            meta = dataclasses.replace(meta, full_write_slots=full, swa_write_slots=swa)
        for (kind, lane, _), (k, v) in zip(self.lanes, kvs, strict=True):
            k_cache, v_cache = self.pool.kv_cache(kind, lane)
            self.backend.store_kv(k, v, k_cache, v_cache, meta, swa=kind is LayerKind.SWA)
