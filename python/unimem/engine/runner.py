"""Runs one scheduled batch through the model with paged memory: eager, or as a replayed
CUDA graph.

The runner owns a :class:`MetadataBuilder` (capture-stable buffers), an attention backend and
the step buffers of :mod:`unimem.engine.step_io`; the pool owns the memory and its tables. For
each batch it builds the step's attention metadata from the request table and the pool's live
``v2p`` tables, wraps pool views in a :class:`PagedContext` and calls the model. The model
never sees pages or slots.

Steps (:meth:`ModelRunner.launch`), none of which reads the device on the host:

- *extend* (eager): the chunk's tokens come from the host; the requests' sampling parameters
  go to :class:`~unimem.engine.step_io.DeviceSamplingState`, the sampled token and the new
  length to :class:`~unimem.engine.step_io.DeviceRequestState`;
- *decode*: each lane feeds its row's next token at its row's length (both on the device),
  samples (:func:`unimem.engine.sampling.sample` with its row's parameters, or plain argmax
  when no lane of the batch samples) and advances the row;
- *verify* (with a :class:`~unimem.speculative.chain.DsparkChain`, DESIGN §6): write window, draft,
  target verify, accept (greedy, or speculative sampling for lanes with temperature > 0:
  :mod:`unimem.speculative.spec_sampling`), commit of GDN states and draft context K/V — all
  on the device, the row advanced by ``accepted + 1`` and its next anchor set to the last
  committed token. With an adaptive chain (:attr:`DsparkChain.adaptive`) the verify is
  *ragged*: each lane's length ``1 .. gamma + 1`` is chosen on the device from the drafter's
  confidence head under the step's row budget, and the lanes' windows are packed back to back
  in a fixed number of rows per batch bucket (:meth:`ModelRunner._ragged_verify_step`).

Every step writes ``StepOutputs`` (tokens and counts per lane) for the caller to copy to the
host and read one step late. Decode and verify read only device buffers, so with
``cuda_graphs`` they are recorded per batch-size bucket (:class:`StepGraphs`) and replayed.
Decode and verify are each recorded twice: a greedy variant (argmax and greedy accept
only: a greedy batch pays nothing for sampling) and a sampling variant; the host picks one per
batch from the requests' options, which it knows. A lane's sample depends only on its logits,
its row's parameters and the position of the sampled token (see :mod:`unimem.engine.sampling`;
in verify, :mod:`unimem.speculative.spec_sampling`), never on its batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import AttentionMetadata, MetadataBuilder
from unimem.engine.cuda_graphs import StepGraphs, default_buckets
from unimem.engine.draft_runner import DraftRunner
from unimem.engine.sampling import filtered_probs, sample
from unimem.engine.scheduler import Batch
from unimem.engine.step_io import (
    DeviceRequestState,
    DeviceSamplingState,
    SamplingRows,
    StepLanes,
    StepOutputs,
)
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.memory.staging import upload_int32
from unimem.models import batch_invariant, gdn_prefill
from unimem.models.base import CausalLM
from unimem.models.batch_invariant import gdn_batch_invariant
from unimem.models.forward_context import ForwardContext, ForwardMode
from unimem.speculative import spec_sampling
from unimem.speculative.accept import greedy_accept
from unimem.speculative.chain import DsparkChain
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
from unimem_kernel.state_commit import StateCommitPlan, commit_states_multi

GDN_REPLAY_COMMIT = True
"""Default of :class:`ModelRunner`'s ``gdn_replay_commit``: a verify keeps per GDN layer only
the step's inputs (a :class:`~unimem_kernel.gdn_reference.VerifyRecord`: conv input and
output rows, gates), no state, and the commit rebuilds each lane's conv window and re-runs
the recurrence over its accepted tokens from its slot (:func:`unimem_kernel.gdn.
gdn_replay_commit`, the verify's own kernel: the committed state is bitwise the verify's
state after the last accepted token). False: the states after every position go to scratch
and the commit copies the accepted ones (:func:`~unimem_kernel.state_commit.
commit_states_multi`; on a GPU that verify is a separately compiled kernel, so its states
agree with the replay's to a few ulps)."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[i, tokens[i]]`` per row (float32): ``logits [N, V]``,
    ``tokens [N]`` int64."""
    chosen = logits.gather(1, tokens[:, None].long())[:, 0]
    return (chosen - torch.logsumexp(logits, dim=-1)).float()


class PagedContext(ForwardContext):
    """A ``ForwardContext`` over a pool: attention through paged K/V views and the step's
    metadata, GDN through the requests' state slots — updated in place (extend, decode) or,
    in verify, left alone while the layer's record of the step's inputs (or, without
    ``gdn_replay_commit``, the state after every position) goes to the runner's buffers.
    ``capture``: target layers whose hidden states are kept in :attr:`hidden`.
    ``cu_seqlens_host``: an extend's ``cu_seqlens_q`` as host ints (fla's chunked GDN
    prefill plans its chunks from them without reading the device).

    ``packed`` (a ragged verify): the step's rows are packed lanes of uneven lengths. Attention
    runs on the packed rows (the metadata's ``cu_seqlens_q``) and zeroes the padding rows'
    outputs (a varlen kernel leaves them unwritten); GDN scatters the packed rows into the
    uniform ``[bs, gamma + 1]`` layout (rows past a lane's length are zeros: no decay, no
    update), runs the fixed-width verify form into the layer's record (or scratch), and
    gathers its output back to the packed rows."""

    def __init__(
        self,
        runner: ModelRunner,
        mode: ForwardMode,
        meta: AttentionMetadata,
        state_slots: torch.Tensor | None,
        logits_indices: torch.Tensor,
        capture: tuple[int, ...] = (),
        packed: PackedRows | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> None:
        super().__init__(mode, meta.positions, meta.cu_seqlens_q, logits_indices)
        self.cu_seqlens_host = cu_seqlens_host
        self._fla_varlen: gdn_prefill.FlaVarlen | None = None  # built by the first fla layer
        self.runner = runner
        self.meta = meta
        self.state_slots = state_slots
        self.capture = capture
        self.packed = packed
        self.hidden: dict[int, torch.Tensor] = {}

    def attention(self, layer_idx, q, k, v, *, sinks=None):
        caches, swa = self._caches(layer_idx)
        self.runner.backend.store_kv(k, v, *caches, self.meta, swa=swa)
        return self._attend(layer_idx, q, caches, swa, sinks)

    def rope_attention(self, layer_idx, q, k, v, cos, sin, *, sinks=None, qk_norm=None):
        # (the q/k norms,) RoPE and the K/V store in one launch: the rotated K is written
        # only into the cache
        caches, swa = self._caches(layer_idx)
        q = self.runner.backend.rope_store_kv(
            q, k, v, cos, sin, *caches, self.meta, swa=swa, qk_norm=qk_norm
        )
        return self._attend(layer_idx, q, caches, swa, sinks)

    def _caches(self, layer_idx: int) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
        """The layer's ``(k_cache, v_cache)`` views and whether it is an SWA layer."""
        r = self.runner
        kind = r.layer_kinds[layer_idx]
        return r.pool.kv_cache(kind, r.spec.lane_of_layer(layer_idx)), kind is LayerKind.SWA

    def _attend(self, layer_idx, q, caches, swa, sinks):
        """The backend's attention of ``q`` over the layer's caches (K/V already stored)."""
        config = self.runner.model.config
        out = self.runner.backend.attend(
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
        n = self.state_slots.shape[0] * self.runner.width

        def uniform(x: torch.Tensor) -> torch.Tensor:  # packed rows -> [bs * (gamma + 1)]
            buf = x.new_zeros(n + 1, *x.shape[1:])
            buf[idx] = x  # padding rows land on the dump row n
            return buf[:n]

        o = self._gdn(layer_idx, uniform(mixed_qkv), uniform(g), uniform(beta), conv_weight)
        return torch.cat([o, o.new_zeros(1, *o.shape[1:])])[idx]

    def _gdn(self, layer_idx, mixed_qkv, g, beta, conv_weight):
        r = self.runner
        conv, ssm = r.pool.state_cache(r.spec.lane_of_layer(layer_idx))
        scratch = {}
        if self.mode is ForwardMode.VERIFY:
            bs = self.state_slots.shape[0]
            if r.gdn_replay_commit:
                scratch = {"record": r.verify_records[layer_idx].lanes(bs)}
            else:
                conv_scratch, ssm_scratch = r.verify_scratch[layer_idx]
                scratch = {"conv_scratch": conv_scratch[:bs], "ssm_scratch": ssm_scratch[:bs]}
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
                varlen=self._fla_varlen, num_k_heads=r.model.config.gdn_key_heads,
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
            num_k_heads=r.model.config.gdn_key_heads,
            batch_invariant=bi,
            chunked_prefill=kernel == "triton",  # our own chunked kernel (opt-in)
            **scratch,
        )

    def capture_hidden(self, layer_idx, hidden):
        if layer_idx in self.capture:
            self.hidden[layer_idx] = hidden


class ModelRunner:
    """Forward of scheduled batches over ``pool`` with ``backend``; with ``chain``, also the
    draft and commit halves of chain speculative decoding (module docstring).

    ``max_bs`` lanes per step, ``max_tokens`` tokens per extend. ``cuda_graphs``: record the
    decode step (or, with a chain, the verify step) for every bucket of ``graph_buckets``
    (default :func:`default_buckets`) at construction; needs a CUDA pool and a backend that
    can be captured (FA4), and a GDN path that skips padded lanes (the Triton kernels).
    ``gdn_replay_commit`` (default :data:`GDN_REPLAY_COMMIT`): how a verify's GDN states
    are committed, replayed from the step's recorded inputs (True) or copied from
    per-position state scratch (False); the record is ~40x smaller than the scratch.
    ``logprobs``: every step also writes the log-probability of each output token
    (``out.logprobs``; one log-sum-exp over the vocabulary per logits row) under the model's
    raw distribution — before temperature and filters, as SGLang reports it.

    Sampling (temperature > 0) runs in extend, decode and verify steps (speculative sampling:
    :meth:`_verify_step`).

    Adaptive verify lengths (``chain.adaptive``): :meth:`_ragged_verify_step`. Two test hooks
    feed it lengths instead of the confidence allocation: :attr:`verify_lens_override` (a
    ``[max_bs]`` int32 device tensor, read by the step on the device like any other state)
    and :attr:`planned_lengths` (host ints for the next eager step, which then builds its
    metadata by the eager ``extend`` builder with exactly ``sum(lengths)`` rows — the
    host-planned oracle the device-planned, fixed-row step is compared with).
    """

    def __init__(
        self,
        model: CausalLM,
        pool: MemoryPool,
        backend: AttentionBackend,
        max_bs: int,
        max_tokens: int,
        chain: DsparkChain | None = None,
        *,
        cuda_graphs: bool = False,
        graph_buckets: Sequence[int] | None = None,
        logprobs: bool = False,
        gdn_replay_commit: bool | None = None,
    ) -> None:
        self.model = model
        self.logprobs = logprobs
        if gdn_replay_commit is None:
            gdn_replay_commit = GDN_REPLAY_COMMIT
        self.gdn_replay_commit = gdn_replay_commit
        self.pool = pool
        self.backend = backend
        self.spec = pool.spec
        self.device = pool.device
        self.layer_kinds = [layer.kind for layer in pool.spec.layers]
        if pool.spec.has(LayerKind.STATE):
            gdn_prefill.prefill_mode(self.device)  # a bad UNIMEM_GDN_CHUNKED_PREFILL fails here
        self.max_bs = max_bs
        self.chain = chain
        self.width = chain.verify_width if chain is not None else 1
        max_tokens = max(max_tokens, max_bs * self.width)
        self.fla_warm_up_tokens = self._warm_up_fla(max_tokens)
        self.builder = MetadataBuilder(
            max_bs=max_bs,
            max_pages_per_req=pool.max_pages_per_request,
            max_tokens=max_tokens,
            page_size=pool.page_size,
            swa=pool.spec.has(LayerKind.SWA),
            device=pool.device,
        )
        self.state = DeviceRequestState(pool.req_to_token.shape[0], self.device)
        self.sampling = DeviceSamplingState(pool.req_to_token.shape[0], self.device)
        self.lanes = StepLanes(max_bs, self.device)
        self.out = StepOutputs.allocate(max_bs, self.width, self.device)
        self._arange = torch.arange(max_tokens, device=self.device)
        self.verify_lens_override: torch.Tensor | None = None
        self.planned_lengths: list[int] | None = None
        self.drafts: DraftRunner | None = None
        self.verify_scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.verify_records: dict[int, gdn_reference.VerifyRecord] = {}
        self._commit_plan: StateCommitPlan | None = None
        self._replay_plan: gdn_ops.ReplayCommitPlan | None = None
        if chain is not None:
            self.drafts = DraftRunner(chain, pool, backend, max_bs)
            self._init_verify_scratch(chain.verify_width)
        self.graphs: StepGraphs | None = None
        self.sample_graphs: StepGraphs | None = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("cuda_graphs needs a pool on a CUDA device")
            buckets = tuple(graph_buckets) if graph_buckets else default_buckets(max_bs)
            if max(buckets) > max_bs:
                raise ValueError(f"graph bucket {max(buckets)} exceeds max_bs {max_bs}")
            with torch.inference_mode():  # as launch() runs the eager steps
                self.graphs = StepGraphs(self._uniform_step, self.lanes.pad, buckets, self.device)
                self.sample_graphs = StepGraphs(
                    self._sampling_step, self.lanes.pad, buckets, self.device
                )

    def _warm_up_fla(self, max_tokens: int) -> list[int]:
        """Compile and autotune fla's chunked GDN prefill for every GDN layer layout of the
        model before the first request, when an extend of up to ``max_tokens`` tokens can
        take it (:func:`unimem.models.gdn_prefill.warm_up_fla`; never in batch-invariant
        mode). Returns the token counts run (empty when nothing was warmed)."""
        layouts = {}
        for i, kind in enumerate(self.layer_kinds):
            if kind is LayerKind.STATE:
                conv, ssm = self.pool.state_cache(self.spec.lane_of_layer(i))
                layouts.setdefault((tuple(conv.shape[1:]), tuple(ssm.shape[1:])), (conv, ssm))
        ran: list[int] = []
        with torch.inference_mode():
            for conv, ssm in layouts.values():
                if gdn_batch_invariant(ssm):
                    continue
                ran += gdn_prefill.warm_up_fla(
                    conv, ssm, max_tokens=max_tokens,
                    num_k_heads=self.model.config.gdn_key_heads, dtype=self.model.config.dtype,
                )  # fmt: skip
        return ran

    def _init_verify_scratch(self, width: int) -> None:
        """Per GDN layer, for ``max_bs`` lanes of ``width`` positions: with
        ``gdn_replay_commit`` a :class:`~unimem_kernel.gdn_reference.VerifyRecord` (conv
        inputs and outputs in the conv state's dtype, gates in the rule's dtype); without it
        the conv window and the SSM state after every position (the states' dtypes) and one
        commit plan moving the kept entries into the pool's state views."""
        scratches, dests = [], []
        for i, kind in enumerate(self.layer_kinds):
            if kind is not LayerKind.STATE:
                continue
            conv, ssm = self.pool.state_cache(self.spec.lane_of_layer(i))
            if self.gdn_replay_commit:
                self.verify_records[i] = gdn_reference.VerifyRecord.empty(
                    self.max_bs, width, conv.shape[1], ssm.shape[1], conv.dtype, ssm.dtype,
                    self.device,
                )  # fmt: skip
                continue

            def zeros(*shape, dtype):
                return torch.zeros(self.max_bs, width, *shape, dtype=dtype, device=self.device)

            conv_scratch = zeros(*conv.shape[1:], dtype=conv.dtype)
            ssm_scratch = zeros(*ssm.shape[1:], dtype=ssm.dtype)
            self.verify_scratch[i] = (conv_scratch, ssm_scratch)
            scratches += [conv_scratch, ssm_scratch]
            dests += [conv, ssm]
        if scratches:
            self._commit_plan = StateCommitPlan(scratches, dests)
        if self.verify_records:
            layers = sorted(self.verify_records)
            caches = [self.pool.state_cache(self.spec.lane_of_layer(i)) for i in layers]
            self._replay_plan = gdn_ops.ReplayCommitPlan(
                [self.verify_records[i] for i in layers],
                [conv for conv, _ in caches],
                [ssm for _, ssm in caches],
            )

    def _commit_gdn(
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

    # ----------------------------------------------------------------------------- launch

    @torch.inference_mode()
    def launch(self, batch: Batch) -> int:
        """Run ``batch`` (queued on the current stream; nothing is read back). Its results
        are in ``self.out`` lanes ``:len(batch.reqs)`` (valid until the next launch):
        extend/decode lane ``i`` sampled ``out.tokens[i, 0]`` (meaningful where
        ``batch.samples[i]``), verify lane ``i`` committed ``out.tokens[i, :out.counts[i]]``.
        Returns the number of lanes."""
        if batch.mode == "extend":
            self._extend(batch)
            return len(batch.reqs)
        if batch.mode != ("verify" if self.chain is not None else "decode"):
            raise ValueError(
                f"this runner runs extend and {'verify' if self.chain else 'decode'} steps, "
                f"not {batch.mode!r}"
            )
        bs = len(batch.reqs)
        width = self.graphs.bucket(bs) if self.graphs is not None else bs
        self.lanes.stage(
            [r.mem.row for r in batch.reqs],
            [r.mem.state_slot for r in batch.reqs],
            [r.rid for r in batch.reqs],
            width,
        )
        draw = any(not r.sampling.greedy for r in batch.reqs)
        graphs = self.sample_graphs if draw else self.graphs
        if graphs is not None:
            graphs.replay(width)
        elif draw:
            self._sampling_step(width)
        else:
            self._uniform_step(width)
        return bs

    def _uniform_step(self, width: int) -> None:
        if self.chain is not None:
            self._verify_step(width)
        else:
            self._decode_step(width)

    def _sampling_step(self, width: int) -> None:
        if self.chain is not None:
            self._verify_step(width, draw=True)
        else:
            self._decode_step(width, draw=True)

    @staticmethod
    def _pick(
        logits: torch.Tensor, params: SamplingRows | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """argmax (``params`` None: no lane samples; ``positions`` unused) or :func:`sample`
        per lane."""
        if params is None:
            return torch.argmax(logits, dim=-1)
        p = params
        return sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.seeds, positions)

    # ----------------------------------------------------------------------------- extend

    def _extend(self, batch: Batch) -> None:
        """A ragged chunk per request from host-known tokens; the sample of each lane and
        the request's next token (the sample where the chunk reaches the end of the known
        tokens, else the next known token) and length go to the device state. With a
        chain, also stores the drafter's context K/V for every token consumed."""
        reqs, lens, starts = batch.reqs, batch.lens, batch.starts
        bs = len(reqs)
        ids = [t for r, s, n in zip(reqs, starts, lens, strict=True) for t in r.tokens[s : s + n]]
        if len(ids) != sum(lens):
            raise ValueError("an extend chunk reaches past the tokens the host knows")
        known_next = [
            -1 if sampled else r.tokens[s + n]
            for r, s, n, sampled in zip(reqs, starts, lens, batch.samples, strict=True)
        ]
        packed = upload_int32(
            [r.mem.row for r in reqs]
            + starts
            + lens
            + [r.mem.state_slot for r in reqs]
            + known_next
            + ids,
            self.device,
        )
        rows, prefix, ext = packed[:bs], packed[bs : 2 * bs], packed[2 * bs : 3 * bs]
        vslots, nxt, input_ids = packed[3 * bs : 4 * bs], packed[4 * bs : 5 * bs], packed[5 * bs :]
        params = None
        floats, ints = self.sampling.upload([r.sampling_row for r in reqs])
        self.sampling.write(rows, floats, ints)
        if any(not r.sampling.greedy for r in reqs):
            params = DeviceSamplingState.lanes(floats, ints)
        pool = self.pool
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
        last = meta.cu_seqlens_q[1:].long() - 1  # each request's last row (device, no upload)
        capture = self.drafts.target_layers if self.drafts is not None else ()
        cu_host = [0, *itertools.accumulate(lens)]
        ctx = PagedContext(
            self, ForwardMode.EXTEND, meta, self._state_slots(vslots), last, capture,
            cu_seqlens_host=cu_host,
        )  # fmt: skip
        logits = self.model.forward(input_ids.long(), ctx)
        if self.drafts is not None:
            self.drafts.write_context(ctx.hidden, meta)
        # the sampled token's index in prompt + output is the number of tokens consumed
        sampled = self._pick(logits, params, (prefix + ext).long())
        self.state.write(rows, prefix + ext, torch.where(nxt >= 0, nxt.long(), sampled))
        self.out.tokens[:bs, 0] = sampled
        self.out.counts[:bs] = 1
        if self.logprobs:
            self.out.logprobs[:bs, 0] = token_logprobs(logits, sampled)

    # ----------------------------------------------------------------------------- decode

    def _decode_step(self, width: int, draw: bool = False) -> None:
        """One token per lane: each lane feeds its row's next token at its row's length and
        picks the next by argmax, or with ``draw`` by its row's sampling parameters.
        Device inputs only (capturable)."""
        rows, vslots = self.lanes.rows(width), self.lanes.vslots(width)
        seq_lens, input_ids = self.state.read(rows)
        pool = self.pool
        meta = self.builder.decode(pool.req_to_token, rows, seq_lens, pool.full_v2p, pool.swa_v2p)
        ctx = PagedContext(
            self, ForwardMode.DECODE, meta, self._state_slots(vslots), self._arange[:width]
        )
        logits = self.model.forward(input_ids, ctx)
        if not draw and self.logprobs and logits.dtype == torch.float32:
            # argmax and its log-probability in one pass, written into the step's outputs
            sampled, _ = greedy_logprob(logits, self.out.logprobs[:width, 0])
            self.state.commit(rows, seq_lens, sampled, sampled[:, None], self.out)
            return
        params = self.sampling.read(rows) if draw else None
        # the input token sits at index seq_lens; the sampled one at seq_lens + 1 (a sampling
        # lane's position; greedy picks need none)
        positions = seq_lens.long() + 1 if params is not None else None
        sampled = self._pick(logits, params, positions)
        self.state.commit(rows, seq_lens, sampled, sampled[:, None], self.out)
        if self.logprobs:
            self.out.logprobs[:width, 0] = token_logprobs(logits, sampled)

    def _state_slots(self, vslots: torch.Tensor) -> torch.Tensor | None:
        if not self.spec.has(LayerKind.STATE):
            return None
        return self.pool.physical_state_slots(vslots)

    # ----------------------------------------------------------------------------- verify

    def _verify_step(self, width: int, draw: bool = False) -> None:
        """One chain step for every lane (each lane's anchor is its row's next token, its
        committed length its row's length, its pages cover ``length + gamma + 1`` tokens —
        the scheduler reserved them). Device inputs only (capturable):

        1. write window: the verify metadata gathers and translates the ``gamma + 1`` write
           slots per request (one launch);
        2. draft: ``gamma`` tokens per request (block K/V into the draft lanes); with
           ``draw``, lanes with temperature > 0 sample them and keep their distributions;
        3. target verify of ``[anchor, d_1 .. d_gamma]``: K/V into the write window, GDN
           states after every position into scratch (slots untouched), hidden states of the
           drafter's target layers captured;
        4. accept: greedy, and with ``draw`` speculative sampling for the sampled lanes
           (:meth:`_sampled_accept`); greedy lanes stay bit-identical to a greedy batch;
        5. commit: every GDN layer's conv and SSM state at row ``accepted`` into the request's
           slot (one launch translating virtual slots), the drafter's context K/V for the
           committed rows only, and the row's length and anchor (the last committed token).

        Nothing is freed (rejected rows are overwritten next step). With an adaptive chain
        the step is :meth:`_ragged_verify_step`; the fixed step below is unchanged by it.
        """
        if self.chain.adaptive:
            self._ragged_verify_step(width, draw)
            return
        gamma, vw = self.chain.gamma, self.chain.verify_width
        rows, vslots, rids = (
            self.lanes.rows(width),
            self.lanes.vslots(width),
            self.lanes.rids(width),
        )
        seq_lens, anchors = self.state.read(rows)
        pool = self.pool
        meta = self.builder.verify(
            pool.req_to_token, rows, seq_lens, pool.full_v2p, pool.swa_v2p, gamma=gamma
        )
        params = self.sampling.read(rows) if draw else None
        q = None
        if params is None:
            draft = self.drafts.propose(rows, seq_lens, anchors, rids)
        else:
            draft, q = self.drafts.propose_sampled(rows, seq_lens, anchors, rids, params)
        input_ids = torch.cat([anchors[:, None], draft], dim=1).reshape(-1)
        ctx = PagedContext(
            self,
            ForwardMode.VERIFY,
            meta,
            self._state_slots(vslots),
            self._arange[: width * vw],
            self.drafts.target_layers,
        )
        logits = self.model.forward(input_ids, ctx)
        # the rows' argmax, the accepted prefix and the bonus token in two launches
        tokens, accepted, bonus = greedy_verify_accept(logits, draft)
        if params is not None:
            accepted, tokens = self._sampled_accept(
                logits, draft, q, tokens, accepted, seq_lens, params
            )
            bonus = tokens.gather(1, accepted.long()[:, None])[:, 0]
        self._commit_gdn(accepted, vslots, ctx.state_slots)
        swa_slots = meta.swa_write_slots
        slots = (meta.full_write_slots,) + (() if swa_slots is None else (swa_slots,))
        full, *swa = self.state.commit(rows, seq_lens, bonus, tokens, self.out, accepted, slots)
        # the drafter's context K/V of the committed rows only (the others write the sink)
        committed = dataclasses.replace(
            meta, full_write_slots=full, swa_write_slots=swa[0] if swa else None
        )
        self.drafts.write_context(ctx.hidden, committed)
        if self.logprobs:
            lp = token_logprobs(logits, tokens.reshape(-1))
            self.out.logprobs[:width] = lp.reshape(width, vw)

    def _ragged_verify_step(self, width: int, draw: bool = False) -> None:
        """The verify step with per-lane lengths ``L_b`` in ``1 .. gamma + 1``, packed
        (``docs/spec_decoding.md``, "Adaptive verify lengths"). Device inputs only
        (capturable); every shape depends on ``width`` alone:

        1. draft ``gamma`` tokens per lane as the fixed step, with the confidence head's
           survival of each;
        2. lengths: :func:`allocate_lengths` of the survivals under :func:`packed_rows`
           ``(width, gamma + 1, budget)`` rows (padded lanes: 1 row); the packed layout
           (``cu_seqlens_q`` etc.) on the device;
        3. metadata: :meth:`MetadataBuilder.verify_ragged` from the live FULL/SWA tables (the
           extend metadata kernel and a ragged write window; padding rows write the sink);
        4. target forward of the packed rows (attention varlen, GDN into the uniform
           record, :class:`PagedContext`);
        5. accept on the uniform ``[width, gamma + 1]`` view of the logits, at most ``L_b -
           1`` drafts (greedy; with ``draw`` speculative sampling on the truncated chains);
        6. commit as the fixed step (GDN states after row ``accepted`` of the uniform
           record; drafter context for the committed packed rows), and ``out.verify_lens``.
        """
        vw = self.chain.verify_width
        rows, vslots, rids = (
            self.lanes.rows(width),
            self.lanes.vslots(width),
            self.lanes.rids(width),
        )
        seq_lens, anchors = self.state.read(rows)
        pool = self.pool
        params = self.sampling.read(rows) if draw else None
        q = None
        if params is None:
            draft, surv = self.drafts.propose(rows, seq_lens, anchors, rids, survival=True)
        else:
            draft, q, surv = self.drafts.propose_sampled(
                rows, seq_lens, anchors, rids, params, survival=True
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
            if self.verify_lens_override is not None:
                lengths = torch.where(live, self.verify_lens_override[:width], 1)
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
        ctx = PagedContext(
            self,
            ForwardMode.VERIFY,
            meta,
            self._state_slots(vslots),
            self._arange[:n_rows],
            self.drafts.target_layers,
            packed,
        )
        logits = self.model.forward(input_ids, ctx)
        # the packed row of (lane b, column j): cu[b] + min(j, L_b - 1) (columns past a lane's
        # length repeat its last row; the accept never reads them)
        cols = torch.minimum(self._arange[:vw][None, :], lengths.long()[:, None] - 1)
        src = (packed.cu_seqlens[:-1].long()[:, None] + cols).reshape(-1)
        tokens = torch.argmax(logits, dim=-1)[src].reshape(width, vw)
        limit = lengths - 1
        accepted, bonus = greedy_accept(draft, tokens, limit)
        uniform_logits = None
        if params is not None or self.logprobs:
            uniform_logits = logits[src]
        if params is not None:
            accepted, tokens = self._sampled_accept(
                uniform_logits, draft, q, tokens, accepted, seq_lens, params, limit
            )
            bonus = tokens.gather(1, accepted.long()[:, None])[:, 0]
        self._commit_gdn(accepted, vslots, ctx.state_slots)
        keep = packed.valid & (packed.offset <= accepted.long()[packed.lane])
        self.drafts.write_context(ctx.hidden, meta, keep)
        self.state.commit(rows, seq_lens, bonus, tokens, self.out, accepted)
        self.out.verify_lens[:width] = lengths
        if self.logprobs:
            lp = token_logprobs(uniform_logits, tokens.reshape(-1))
            self.out.logprobs[:width] = lp.reshape(width, vw)

    def _sampled_accept(
        self,
        logits: torch.Tensor,
        draft: torch.Tensor,
        q: torch.Tensor,
        target: torch.Tensor,
        greedy_accepted: torch.Tensor,
        seq_lens: torch.Tensor,
        params: SamplingRows,
        limit: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative sampling (:func:`unimem.speculative.spec_sampling.chain_accept`) for
        the lanes with temperature > 0: the target's filtered distributions ``p`` over the
        ``gamma + 1`` rows (``[bs, gamma + 1, V]``, materialised), each row's token at
        position ``seq_len + 1 + j``. Greedy lanes keep ``greedy_accepted`` and ``target``.
        ``limit [bs]``: a ragged verify's chain lengths (:func:`spec_sampling.chain_accept`).
        Returns ``(accepted [bs] int32, tokens [bs, gamma + 1])``."""
        width, vw = target.shape

        def rows(x: torch.Tensor) -> torch.Tensor:  # a lane's parameter for each of its rows
            return x[:, None].expand(width, vw).reshape(-1)

        p = filtered_probs(
            logits,
            rows(params.temperature),
            rows(params.top_k),
            rows(params.top_p),
            rows(params.min_p),
        ).reshape(width, vw, -1)
        positions = seq_lens.long()[:, None] + 1 + self._arange[:vw][None, :]
        s = spec_sampling.chain_accept(draft, q, p, params.seeds, positions, limit)
        live = params.temperature > 0
        accepted = torch.where(live, s.accepted, greedy_accepted)
        return accepted, torch.where(live[:, None], s.tokens, target)
