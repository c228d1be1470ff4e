"""The verify half of a DSPARK chain step over a pool: draft, target verify, accept, commit.

For every lane (each lane's anchor is its row's next token, its committed length its row's
length, its pages cover ``length + gamma + 1`` tokens — the scheduler reserved them), all on
the device with no host read, so the step is recorded in a CUDA graph:

1. write window: the verify metadata gathers and translates the ``gamma + 1`` write slots
   per request (one launch);
2. draft: ``gamma`` tokens per request (:class:`~unimem.speculative.draft_runner.DraftRunner`:
   block K/V into the draft lanes); lanes with temperature > 0 sample them and keep their
   distributions;
3. target verify of ``[anchor, d_1 .. d_gamma]``
   (:class:`~unimem.models.paged_context.PagedContext`): K/V into the write window, each GDN
   layer's record of the step's inputs (or its states after every position) into this
   step's buffers, the persistent state untouched; hidden states of the drafter's target
   layers captured;
4. accept: greedy (bit-identical to a greedy batch), and speculative sampling for the lanes
   with temperature > 0 (:mod:`unimem.speculative.spec_sampling`);
5. commit: every GDN layer's state after row ``accepted`` into the request's slot, the
   caller's request state (the row advanced by ``accepted + 1``, its next anchor the last
   committed token; :data:`CommitRows`), and the drafter's context K/V of the committed
   rows only.

Nothing is freed (rejected rows are overwritten next step). With an adaptive chain
(:attr:`~unimem.speculative.chain.DsparkChain.adaptive`) the verify is *ragged*: each lane's
length ``1 .. gamma + 1`` is chosen on the device from the drafter's confidence head under the
step's row budget, and the lanes' windows are packed back to back in a fixed number of rows
per batch width (:mod:`unimem.speculative.verify_lengths`).

The step knows the engine only through values: the lanes' device tensors
(:class:`VerifyLanes`), their sampling parameters, and the commit callable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.memory.pool import MemoryPool
from unimem.memory.staging import upload_int32
from unimem.models import logit_adjustments
from unimem.models.base import CausalLM
from unimem.models.batch_invariant import gdn_batch_invariant
from unimem.models.forward_context import ForwardMode
from unimem.models.logit_adjustments import LaneAdjustments
from unimem.models.paged_context import GdnVerifyBuffers, PackedLanes, PagedContext, PagedLayers
from unimem.models.sampler import SamplingRows, filtered_token_stats, top_logprobs
from unimem.models.stable_outputs import StableOutputs
from unimem.speculative import spec_sampling
from unimem.speculative.accept import greedy_accept
from unimem.speculative.chain import DsparkChain
from unimem.speculative.draft_runner import DraftRunner
from unimem.speculative.verify_lengths import (
    PackedRows,
    allocate_lengths,
    packed_layout,
    packed_rows,
)
from unimem_kernel import gdn as gdn_ops
from unimem_kernel import gdn_reference
from unimem_kernel.greedy_accept import greedy_verify_accept
from unimem_kernel.greedy_pick import greedy_logprob
from unimem_kernel.residual_draw import residual_draw
from unimem_kernel.state_commit import StateCommitPlan, commit_states_multi

__all__ = [
    "GDN_REPLAY_COMMIT",
    "CommitRows",
    "VerifyForward",
    "VerifyLanes",
    "VerifyResult",
    "VerifyStep",
]

GDN_REPLAY_COMMIT = True
"""Default of :class:`VerifyStep`'s ``gdn_replay_commit``: a verify keeps per GDN layer only
the step's inputs (a :class:`~unimem_kernel.gdn_reference.VerifyRecord`: conv input and
output rows, gates), no state, and the commit rebuilds each lane's conv window and re-runs
the recurrence over its accepted tokens from its slot (:func:`unimem_kernel.gdn.
gdn_replay_commit`, the verify's own kernel: the committed state is bitwise the verify's
state after the last accepted token). False: the states after every position go to scratch
and the commit copies the accepted ones (:func:`~unimem_kernel.state_commit.
commit_states_multi`; on a GPU that verify is a separately compiled kernel, so its states
agree with the replay's to a few ulps)."""


class VerifyLanes(NamedTuple):
    """A verify step's lanes, ``[width]`` device tensors: request-table ``rows`` (0 for padded
    lanes), virtual state slots ``vslots`` (-1 padded), acceptance-control keys ``rids``, the
    committed ``seq_lens`` (int32) and ``anchors`` (int64, the token at ``seq_lens``), and
    ``state_slots``: the physical state slots (-1 padded; None without GDN layers)."""

    rows: torch.Tensor
    vslots: torch.Tensor
    rids: torch.Tensor
    seq_lens: torch.Tensor
    anchors: torch.Tensor
    state_slots: torch.Tensor | None


CommitRows = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], Sequence[torch.Tensor]
]
"""``commit(bonus [W], tokens [W, gamma + 1], accepted [W] int32, write_slots)``: the caller
commits lane ``b``'s ``tokens[b, :accepted[b] + 1]`` and advances its row to ``seq_lens[b] +
accepted[b] + 1`` with ``bonus[b]`` as its next token; returns ``write_slots`` (``[W *
(gamma + 1)]`` each) with the rows past each lane's committed prefix sent to the sink slot 0
(:meth:`unimem.engine.step_io.DeviceRequestState.commit`)."""


class VerifyResult(NamedTuple):
    """What a verify step leaves for the caller besides what it committed: ``lengths [W]``
    int32, the rows each lane verified (a ragged step; None for a fixed one), and
    ``logprobs [W, gamma + 1]`` float32, each committed-row token's log-probability under the
    target's distribution — raw, or adjusted where the step had logit adjustments — (None
    unless asked for); ``top``: with ``top_k`` k > 0, each row's k most likely tokens under
    that distribution, ``(values [W, gamma + 1, k] float32,
    ids [W, gamma + 1, k] int64)`` (:func:`~unimem.models.sampler.top_logprobs`), else
    None."""

    lengths: torch.Tensor | None
    logprobs: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None = None


class VerifyForward(NamedTuple):
    """What a verify step's first half (:meth:`VerifyStep.forward`: draft and target forward)
    leaves to its second (:meth:`VerifyStep.finish`: accept and commit): the step's ``meta``
    (its write window; in the builder's buffers), ``draft [W, gamma]`` int64, the sampled
    lanes' ``proposals`` (None in a greedy step), and the target's rows — ``logits [rows,
    vocab]``, or, from a head-less forward, None and ``final [rows, d_model]``, the
    final-normed hidden states the LM head reads — with ``captured``, the residual stream
    after each of the drafter's target layers (``{layer: [rows, d_model]}``). A ragged step
    also leaves each lane's ``lengths [W]`` int32 and the rows' ``packed`` layout (None in a
    fixed step)."""

    meta: AttentionMetadata
    draft: torch.Tensor
    proposals: spec_sampling.Proposals | None
    logits: torch.Tensor | None
    final: torch.Tensor | None
    captured: dict[int, torch.Tensor]
    lengths: torch.Tensor | None = None
    packed: PackedRows | None = None


class VerifyStep:
    """The verify step of ``chain`` for ``model`` over ``pool`` (module docstring).

    ``builder``: the caller's metadata builder (its buffers are capture-stable; the step
    builds its verify metadata in them); ``layers``: ``pool``'s views of the model's layers.
    ``max_bs`` lanes, ``max_tokens`` rows per step at most. ``gdn_replay_commit`` (default
    :data:`GDN_REPLAY_COMMIT`): how a verify's GDN states are committed, replayed from the
    step's recorded inputs (True) or copied from per-position state scratch (False); the
    record is much smaller than the scratch. ``logprobs``: also return each verified
    token's log-probability.

    Two test hooks replace the confidence allocation of a ragged step: :attr:`lens_override`
    (a ``[max_bs]`` int32 device tensor, read by the step on the device like any other
    state) and :attr:`planned_lengths` (host ints for the next eager step, which then builds
    its metadata by the eager ``extend`` builder with exactly ``sum(lengths)`` rows — the
    host-planned oracle the device-planned, fixed-row step is compared with)."""

    def __init__(
        self,
        chain: DsparkChain,
        model: CausalLM,
        pool: MemoryPool,
        backend: AttentionBackend,
        builder: MetadataBuilder,
        layers: PagedLayers,
        max_bs: int,
        max_tokens: int,
        *,
        gdn_replay_commit: bool | None = None,
        logprobs: bool = False,
    ) -> None:
        self.chain = chain
        self.model = model
        self.pool = pool
        self.backend = backend
        self.builder = builder
        self.layers = layers
        self.max_bs = max_bs
        self.logprobs = logprobs
        self.gdn_replay_commit = (
            GDN_REPLAY_COMMIT if gdn_replay_commit is None else gdn_replay_commit
        )
        self.device = pool.device
        self.width = chain.verify_width
        self.drafts = DraftRunner(chain, pool, backend, max_bs)
        self._arange = torch.arange(max(max_tokens, max_bs * self.width), device=self.device)
        self.lens_override: torch.Tensor | None = None
        self.planned_lengths: list[int] | None = None
        self.records: dict[int, gdn_reference.VerifyRecord] = {}
        self.scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._commit_plan: StateCommitPlan | None = None
        self._replay_plan: gdn_ops.ReplayCommitPlan | None = None
        self._init_gdn_buffers()
        self.buffers: dict[int, GdnVerifyBuffers] = {**self.records, **self.scratch}
        """Where each GDN layer of a verify writes: :attr:`records` or :attr:`scratch`."""

    def _init_gdn_buffers(self) -> None:
        """Per GDN layer, for ``max_bs`` lanes of ``width`` positions: with
        ``gdn_replay_commit`` a :class:`~unimem_kernel.gdn_reference.VerifyRecord` (conv
        inputs and outputs in the conv state's dtype, gates in the rule's dtype) and one
        replay plan over every layer; without it the conv window and the SSM state after every
        position (the states' dtypes) and one commit plan moving the kept entries into the
        pool's state views."""
        scratches, dests = [], []
        for i, (conv, ssm) in sorted(self.layers.state.items()):
            if self.gdn_replay_commit:
                self.records[i] = gdn_reference.VerifyRecord.empty(
                    self.max_bs, self.width, conv.shape[1], ssm.shape[1], conv.dtype, ssm.dtype,
                    self.device,
                )  # fmt: skip
                continue

            def zeros(*shape, dtype):
                return torch.zeros(self.max_bs, self.width, *shape, dtype=dtype, device=self.device)

            conv_scratch = zeros(*conv.shape[1:], dtype=conv.dtype)
            ssm_scratch = zeros(*ssm.shape[1:], dtype=ssm.dtype)
            self.scratch[i] = (conv_scratch, ssm_scratch)
            scratches += [conv_scratch, ssm_scratch]
            dests += [conv, ssm]
        if scratches:
            self._commit_plan = StateCommitPlan(scratches, dests)
        if self.records:
            layers = sorted(self.records)
            self._replay_plan = gdn_ops.ReplayCommitPlan(
                [self.records[i] for i in layers],
                [self.layers.state[i][0] for i in layers],
                [self.layers.state[i][1] for i in layers],
            )

    def commit_gdn(
        self, accepted: torch.Tensor, vslots: torch.Tensor, slots: torch.Tensor | None
    ) -> None:
        """Every GDN layer's conv and SSM state after position ``accepted`` into the lanes'
        slots: with ``gdn_replay_commit`` from the layers' records, one conv-window launch
        and one delta-rule launch for all layers (``slots``: the verify's physical slots, -1
        for padded lanes; :class:`~unimem_kernel.gdn.ReplayCommitPlan`), else one copy
        launch for every layer (virtual slots ``vslots``, translated in the kernel)."""
        if self._commit_plan is not None:
            commit_states_multi(self._commit_plan, accepted, vslots, self.pool.state_v2p)
        if self._replay_plan is not None:
            ssm = self._replay_plan.ssm_states[0]
            gdn_ops.gdn_replay_commit_layers(
                self._replay_plan, accepted, slots, self.model.config.gdn_key_heads,
                batch_invariant=gdn_batch_invariant(ssm),
            )  # fmt: skip

    def run(
        self,
        lanes: VerifyLanes,
        params: SamplingRows | None,
        commit: CommitRows,
        top_k: int = 0,
        adjust: LaneAdjustments | None = None,
    ) -> VerifyResult:
        """One chain step for every lane of ``lanes`` (module docstring); ``params``: the
        lanes' sampling parameters when some lane samples (None: all greedy). Eager steps
        only (no recorded graph does either): ``top_k``, also each row's most likely tokens
        (needs ``logprobs``); ``adjust``, the lanes' logit adjustments, applied to the target
        rows before the acceptance (:mod:`unimem.models.logit_adjustments`). Device inputs only
        (capturable)."""
        if top_k and not self.logprobs:
            raise ValueError("top_k log-probabilities need a verify step built with logprobs")
        return self.finish(self.forward(lanes, params), lanes, params, commit, top_k, adjust)

    def forward(
        self, lanes: VerifyLanes, params: SamplingRows | None, kept: StableOutputs | None = None
    ) -> VerifyForward:
        """The step's first half: the write window and the draft (module docstring, steps
        1-2; a ragged step also plans its lengths and packs its rows) and the target forward
        (step 3). ``kept``: a head-less forward (the LM head runs in :meth:`finish`) whose
        outputs that grow with the batch — the final and captured hidden rows, the draft
        block's distributions — are copied into ``kept``'s buffers, so that a forward
        recorded per batch bucket holds them once (:mod:`unimem.models.stable_outputs`).
        Device inputs only (capturable); nothing is committed."""
        if self.chain.adaptive:
            fwd = self._ragged_forward(lanes, params, head=kept is None)
        else:
            fwd = self._fixed_forward(lanes, params, head=kept is None)
        if kept is None:
            return fwd
        proposals = fwd.proposals
        if proposals is not None:
            proposals = proposals._replace(q_draft=kept.keep("verify.q_draft", proposals.q_draft))
        return fwd._replace(
            proposals=proposals,
            final=kept.keep("verify.final", fwd.final),
            captured={i: kept.keep(f"verify.captured.{i}", h) for i, h in fwd.captured.items()},
        )

    def finish(
        self,
        fwd: VerifyForward,
        lanes: VerifyLanes,
        params: SamplingRows | None,
        commit: CommitRows,
        top_k: int = 0,
        adjust: LaneAdjustments | None = None,
    ) -> VerifyResult:
        """The step's second half over :meth:`forward`'s ``fwd`` for the same ``lanes`` and
        ``params``: the LM head where the forward was head-less, the adjustments, the
        acceptance and the commits (module docstring, steps 4-5); ``top_k`` and ``adjust`` as
        :meth:`run`. Device inputs only (capturable)."""
        if top_k and not self.logprobs:
            raise ValueError("top_k log-probabilities need a verify step built with logprobs")
        logits = fwd.logits if fwd.logits is not None else self.model.head_logits(fwd.final)
        if self.chain.adaptive:
            return self._ragged_finish(fwd, logits, lanes, params, commit, top_k, adjust)
        return self._fixed_finish(fwd, logits, lanes, params, commit, top_k, adjust)

    @staticmethod
    def _top(
        logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`~unimem.models.sampler.top_logprobs` of the uniform rows ``logits [W * vw,
        V]`` for the committed-row ``tokens`` / ``logprobs [W, vw]``, shaped ``[W, vw, k]``."""
        if not k:
            return None
        values, ids = top_logprobs(logits, k, tokens.reshape(-1), logprobs.reshape(-1))
        shape = (*tokens.shape, k)
        return values.reshape(shape), ids.reshape(shape)

    def _target(
        self,
        input_ids: torch.Tensor,
        meta,
        lanes: VerifyLanes,
        rows: int,
        head: bool,
        packed: PackedLanes | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]:
        """The target verify's forward over ``rows`` rows of ``meta``: ``(logits, None,
        captured)``, or head-less (``head`` False) ``(None, final hidden rows, captured)``."""
        ctx = PagedContext(
            ForwardMode.VERIFY, meta, self.layers, self.backend, lanes.state_slots,
            self._arange[:rows], capture=self.drafts.target_layers, packed=packed,
            verify_buffers=self.buffers,
        )  # fmt: skip
        ctx.run_head = head
        out = self.model.forward_with_hidden(input_ids, ctx)
        return out.logits, (None if head else out.hidden), ctx.hidden

    def _fixed_forward(
        self, lanes: VerifyLanes, params: SamplingRows | None, head: bool = True
    ) -> VerifyForward:
        """``gamma + 1`` rows for every lane (module docstring, steps 1-3)."""
        gamma, vw = self.chain.gamma, self.width
        rows, seq_lens, anchors = lanes.rows, lanes.seq_lens, lanes.anchors
        width = rows.shape[0]
        pool = self.pool
        meta = self.builder.verify(
            pool.req_to_token, rows, seq_lens, pool.full_v2p, pool.swa_v2p, gamma=gamma
        )
        proposals = None
        if params is None:
            draft = self.drafts.propose(rows, seq_lens, anchors, lanes.rids)
        else:
            draft, proposals = self.drafts.propose_sampled(
                rows, seq_lens, anchors, lanes.rids, params
            )
        input_ids = torch.cat([anchors[:, None], draft], dim=1).reshape(-1)
        logits, final, captured = self._target(input_ids, meta, lanes, width * vw, head)
        return VerifyForward(meta, draft, proposals, logits, final, captured)

    def _fixed_finish(
        self,
        fwd: VerifyForward,
        logits: torch.Tensor,
        lanes: VerifyLanes,
        params: SamplingRows | None,
        commit: CommitRows,
        top_k: int = 0,
        adjust: LaneAdjustments | None = None,
    ) -> VerifyResult:
        """Steps 4-5 of a fixed step over its rows' ``logits``."""
        vw, seq_lens = self.width, lanes.seq_lens
        width = seq_lens.shape[0]
        meta, draft, proposals = fwd.meta, fwd.draft, fwd.proposals
        if adjust is not None:  # row (b, j) produces the token at index seq_lens[b] + 1 + j
            lane = self._arange[: width * vw] // vw
            produced = seq_lens.long()[lane] + 1 + self._arange[: width * vw] % vw
            columns = self._arange[: width * vw] % vw
            logit_adjustments.apply(logits, lane, produced, adjust, draft, columns)
        if params is None:
            # the rows' argmax, the accepted prefix and the bonus token in two launches; with
            # log-probabilities each row's log-sum-exp in the same pass over the logits
            tokens, accepted, bonus, *lse = greedy_verify_accept(logits, draft, lse=self.logprobs)
        else:
            # a sampled batch: its greedy lanes' tokens and every row's untempered
            # log-sum-exp come from the sampled pass, no greedy pass over the logits
            accepted, tokens, *lse = self._sampled_accept(
                logits, draft, proposals, seq_lens, params, raw_lse=self.logprobs
            )
            bonus = tokens.gather(1, accepted.long()[:, None])[:, 0]
        self.commit_gdn(accepted, lanes.vslots, lanes.state_slots)
        swa_slots = meta.swa_write_slots
        slots = (meta.full_write_slots,) + (() if swa_slots is None else (swa_slots,))
        full, *swa = commit(bonus, tokens, accepted, slots)
        # the drafter's context K/V of the committed rows only (the others write the sink)
        committed = dataclasses.replace(
            meta, full_write_slots=full, swa_write_slots=swa[0] if swa else None
        )
        self.drafts.write_context(fwd.captured, committed)
        logprobs = None
        if self.logprobs:
            chosen = logits.gather(1, tokens.reshape(-1, 1))[:, 0]
            logprobs = (chosen - lse[0]).float().reshape(width, vw)
        return VerifyResult(None, logprobs, self._top(logits, tokens, logprobs, top_k))

    def _ragged_forward(
        self, lanes: VerifyLanes, params: SamplingRows | None, head: bool = True
    ) -> VerifyForward:
        """The verify step with per-lane lengths ``L_b`` in ``1 .. gamma + 1``, packed
        (``docs/spec_decoding.md``, "Adaptive verify lengths"). Every shape depends on the
        lanes' width alone:

        1. draft ``gamma`` tokens per lane as the fixed step, with the confidence head's
           survival of each;
        2. lengths: :func:`allocate_lengths` of the survivals under :func:`packed_rows`
           ``(width, gamma + 1, budget)`` rows (padded lanes: 1 row); the packed layout
           (``cu_seqlens_q`` etc.) on the device;
        3. metadata: :meth:`MetadataBuilder.verify_ragged` from the live FULL/SWA tables (the
           extend metadata kernel and a ragged write window; padding rows write the sink);
        4. target forward of the packed rows (attention varlen, GDN into the uniform
           record, :class:`~unimem.models.paged_context.PagedContext`);
        5. accept on the uniform ``[width, gamma + 1]`` view of the logits, at most ``L_b -
           1`` drafts (greedy; speculative sampling on the truncated chains for sampled
           lanes);
        6. commit as the fixed step (GDN states after row ``accepted`` of the uniform
           record; drafter context for the committed packed rows), and return the lengths.

        Steps 1-4 here, 5-6 in :meth:`_ragged_finish`.
        """
        vw = self.width
        rows, seq_lens, anchors = lanes.rows, lanes.seq_lens, lanes.anchors
        width = rows.shape[0]
        pool = self.pool
        proposals = None
        if params is None:
            draft, surv = self.drafts.propose(rows, seq_lens, anchors, lanes.rids, survival=True)
        else:
            draft, proposals, surv = self.drafts.propose_sampled(
                rows, seq_lens, anchors, lanes.rids, params, survival=True
            )
        planned, self.planned_lengths = self.planned_lengths, None
        live = rows > 0
        if planned is not None:  # the host-planned oracle (eager only: width == bs)
            planned = list(planned[:width])
            n_rows = sum(planned)
            lengths = upload_int32(list(planned), self.device)
            meta = self.builder.extend(
                pool.req_to_token,
                rows,
                seq_lens,
                lengths,
                pool.full_v2p,
                pool.swa_v2p,
                num_tokens=n_rows,
                max_seqlen_q=max(planned),
            )
        else:
            n_rows = packed_rows(width, vw, self.chain.verify_budget)
            if self.lens_override is not None:
                lengths = torch.where(live, self.lens_override[:width], 1)
                lengths = lengths.to(torch.int32)
            else:
                lengths = allocate_lengths(surv, live, n_rows)
            meta = self.builder.verify_ragged(
                pool.req_to_token,
                rows,
                seq_lens,
                lengths,
                pool.full_v2p,
                pool.swa_v2p,
                num_tokens=n_rows,
                max_seqlen_q=vw,
            )
        packed = packed_layout(lengths, n_rows, vw)
        uniform_ids = torch.cat([anchors[:, None], draft], dim=1).reshape(-1)
        input_ids = torch.cat([uniform_ids, uniform_ids.new_zeros(1)])[packed.uniform_index]
        lanes_of_rows = PackedLanes(packed.valid, packed.uniform_index, vw)
        logits, final, captured = self._target(input_ids, meta, lanes, n_rows, head, lanes_of_rows)
        return VerifyForward(meta, draft, proposals, logits, final, captured, lengths, packed)

    def _ragged_finish(
        self,
        fwd: VerifyForward,
        logits: torch.Tensor,
        lanes: VerifyLanes,
        params: SamplingRows | None,
        commit: CommitRows,
        top_k: int = 0,
        adjust: LaneAdjustments | None = None,
    ) -> VerifyResult:
        """Steps 5-6 of a ragged step over its packed rows' ``logits``."""
        vw, seq_lens = self.width, lanes.seq_lens
        width = seq_lens.shape[0]
        meta, draft, proposals = fwd.meta, fwd.draft, fwd.proposals
        lengths, packed = fwd.lengths, fwd.packed
        if adjust is not None:  # packed row (b, j) produces the token at seq_lens[b] + 1 + j
            produced = seq_lens.long()[packed.lane] + 1 + packed.offset
            logit_adjustments.apply(logits, packed.lane, produced, adjust, draft, packed.offset)
        # the packed row of (lane b, column j): cu[b] + min(j, L_b - 1) (columns past a lane's
        # length repeat its last row; the accept never reads them)
        cols = torch.minimum(self._arange[:vw][None, :], lengths.long()[:, None] - 1)
        src = (packed.cu_seqlens[:-1].long()[:, None] + cols).reshape(-1)
        limit = lengths - 1
        if params is None:
            # each packed row's argmax (and, with log-probabilities, its own
            # log-probability) in one pass over the logits
            if self.logprobs:
                row_tokens, row_logprobs = greedy_logprob(logits)
            else:
                row_tokens = torch.argmax(logits, dim=-1)
            tokens = row_tokens[src].reshape(width, vw)
            accepted, bonus = greedy_accept(draft, tokens, limit)
        else:  # the greedy lanes and the log-sum-exps from the sampled pass
            uniform_logits = logits[src]
            accepted, tokens, *raw_lse = self._sampled_accept(
                uniform_logits, draft, proposals, seq_lens, params, limit, self.logprobs
            )
            bonus = tokens.gather(1, accepted.long()[:, None])[:, 0]
        self.commit_gdn(accepted, lanes.vslots, lanes.state_slots)
        keep = packed.valid & (packed.offset <= accepted.long()[packed.lane])
        self.drafts.write_context(fwd.captured, meta, keep)
        commit(bonus, tokens, accepted, ())
        logprobs = None
        if self.logprobs and params is None:
            # log p(t) = logits[t] - lse = (logits[t] - logits[argmax]) + log p(argmax): a
            # gather per row (exactly the row's own log-probability where t is its argmax)
            chosen = logits[src, tokens.reshape(-1)]
            top = logits[src, row_tokens[src]]
            logprobs = ((chosen - top) + row_logprobs[src]).float().reshape(width, vw)
        elif self.logprobs:
            chosen = uniform_logits.gather(1, tokens.reshape(-1, 1))[:, 0]
            logprobs = (chosen - raw_lse[0]).float().reshape(width, vw)
        top = self._top(logits[src], tokens, logprobs, top_k) if top_k else None
        return VerifyResult(lengths, logprobs, top)

    def _sampled_accept(
        self,
        logits: torch.Tensor,
        draft: torch.Tensor,
        proposals: spec_sampling.Proposals,
        seq_lens: torch.Tensor,
        params: SamplingRows,
        limit: torch.Tensor | None = None,
        raw_lse: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Speculative sampling (:func:`unimem.speculative.spec_sampling.chain_accept_rows`)
        for the lanes with temperature > 0 over the uniform ``logits [bs * (gamma + 1), V]``,
        each row's token at position ``seq_len + 1 + j``: one pass over the logits
        (:func:`~unimem.models.sampler.filtered_token_stats`) gives every drafted token's
        probability under the target's filtered row that predicts it, each row's
        normaliser, cut-off and first argmax; one more draws each lane's last token from the
        row its chain stopped at (:func:`unimem_kernel.residual_draw.residual_draw`) — never
        a ``[bs, V]`` distribution, let alone ``[bs, gamma + 1, V]``. Under block verification
        (``chain.sampled_verify``,
        :func:`~unimem.speculative.spec_sampling.chain_accept_block_rows`) one more pass over
        the logits gives the residual masses
        (:func:`~unimem.speculative.spec_sampling.compact_residual_mass`). Greedy lanes take
        their rows' argmax (the first pass's first maximum of a temperature-0 row) and the
        greedy accept. ``limit [bs]``: a ragged verify's chain lengths. Returns ``(accepted
        [bs] int32, tokens [bs, gamma + 1])``, with ``raw_lse`` also each row's untempered
        log-sum-exp ``[bs * (gamma + 1)]`` float32 from the same first pass (what the
        committed tokens' log-probabilities subtract)."""
        width, gamma = draft.shape
        vw = gamma + 1

        def rows(x: torch.Tensor) -> torch.Tensor:  # a lane's parameter for each of its rows
            return x[:, None].expand(width, vw).reshape(-1)

        t, k, top_p, min_p = params.temperature, params.top_k, params.top_p, params.min_p
        # row j of a lane predicts its draft j; the last row's token is a placeholder
        asked = torch.cat([draft.long(), draft.new_zeros(width, 1)], dim=1).reshape(-1)
        px, lse, first, cut, *raw = filtered_token_stats(
            logits, rows(t), rows(k), rows(top_p), rows(min_p), asked, params.rule, raw_lse
        )
        px = px.reshape(width, vw)[:, :gamma]
        target = first.reshape(width, vw)
        greedy = (greedy_accept(draft, target, limit).accepted, target)

        def last_draw(
            col: torch.Tensor,
            end: torch.Tensor,
            keys: torch.Tensor,
            weight: torch.Tensor | None = None,
        ) -> torch.Tensor:
            # block verification's norm(max(0, w p - q)): the kernel divides q by w
            return residual_draw(
                logits, vw, col, end, t.float(), cut, lse, proposals.q_draft, proposals.t2d,
                proposals.point, proposals.tokens, keys,
                None if weight is None else weight.float(),
            )  # fmt: skip

        positions = seq_lens.long()[:, None] + 1 + self._arange[:vw][None, :]
        if self.chain.sampled_verify == "block":

            def residual_mass(w: torch.Tensor) -> torch.Tensor:
                return spec_sampling.compact_residual_mass(
                    logits, vw, t, cut, lse, proposals, px, w
                )

            s = spec_sampling.chain_accept_block_rows(
                draft, proposals.qx, px, residual_mass, last_draw, params.seeds, positions, limit
            )
        else:
            s = spec_sampling.chain_accept_rows(
                draft, proposals.qx, px, last_draw, params.seeds, positions, limit
            )
        live = params.temperature > 0
        accepted = torch.where(live, s.accepted, greedy[0])
        return (accepted, torch.where(live[:, None], s.tokens, greedy[1]), *raw)
