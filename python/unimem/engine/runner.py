"""Runs one scheduled batch through the model with paged memory: eager, or as a replayed
CUDA graph.

The runner owns a :class:`MetadataBuilder` (capture-stable buffers), an attention backend and
the step buffers of :mod:`unimem.engine.step_io`; the pool owns the memory and its tables. For
each batch it builds the step's attention metadata from the request table and the pool's live
``v2p`` tables, wraps the pool's views in a
:class:`~unimem.models.paged_context.PagedContext` and calls the model. The model never sees
pages or slots.

Steps (:meth:`ModelRunner.launch`), none of which reads the device on the host:

- *extend* (eager): the chunk's tokens come from the host; the requests' sampling parameters
  go to :class:`~unimem.engine.step_io.DeviceSamplingState`, the sampled token and the new
  length to :class:`~unimem.engine.step_io.DeviceRequestState`. With ``padded_extend``, a
  short extend (at most :data:`EXTEND_LANES` ``[-1]`` requests and :data:`EXTEND_TOKENS`
  ``[-1]`` tokens) runs padded to a (requests, tokens) bucket from capture-stable inputs:
  lanes past the batch on row 0 with no tokens, one more lane on row 0 holding the padding
  tokens (its K/V go to the sink slots, its outputs are never read) — with ``cuda_graphs``
  recorded per bucket and replayed, otherwise run eagerly (the same function); one with
  extras (top log-probabilities, logit adjustments) replays the bucket's recorded forward
  half and picks eagerly after it (as decode and verify do, below). An extend in which a
  request scores its prompt (:mod:`unimem.engine.prompt_logprobs`) runs ragged: its
  forward returns every row of that request, which the LM head scores in bounded pieces;
- *decode*: each lane feeds its row's next token at its row's length (both on the device),
  samples (:func:`unimem.models.sampler.sample` with its row's parameters, or plain argmax
  when no lane of the batch samples) and advances the row;
- *verify* (with a :class:`~unimem.speculative.chain.DsparkChain`): the lanes' rows, slots,
  lengths and anchors go to :class:`~unimem.speculative.verify_step.VerifyStep` (draft,
  target verify, accept, commit of GDN states and draft context K/V — all on the device),
  which commits each row through :meth:`~unimem.engine.step_io.DeviceRequestState.commit`:
  the row advanced by ``accepted + 1`` and its next anchor set to the last committed token.

Every step writes ``StepOutputs`` (tokens and counts per lane) for the caller to copy to the
host and read one step late. Decode and verify read only device buffers, so with
``cuda_graphs`` they are recorded per batch-size bucket (:class:`StepGraphs`) and replayed.
Decode and verify are each recorded as a greedy variant (argmax and greedy accept only: a
greedy batch pays nothing for sampling) and a sampling variant per cut-off rule; the host
picks one per batch from the requests' options, which it knows. A batch with per-request
extras (logit adjustments — penalties, ``logit_bias``, ``min_tokens``, a grammar — or top
log-probabilities) replays the step's *forward half* instead — the draft and the target
forward, stopping before the LM head (:meth:`ModelRunner.forward_half`, recorded per bucket
and, for verify, per variant) — and runs the rest eagerly: the LM head, the adjustments
(a grammar's walk of the drafts on the host among them), the pick or the acceptance, the
commits (:meth:`ModelRunner.finish_half`). Its tokens are those of the whole step run
eagerly; the forward, most of a step's launches, stays a replay.

A lane's sample depends only on its logits, its row's parameters and the position of the
sampled token (see :mod:`unimem.models.sampler`; in verify,
:mod:`unimem.speculative.spec_sampling`), never on its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from unimem.attention.backend import AttentionBackend
from unimem.attention.metadata import MetadataBuilder
from unimem.engine import adjustments, prompt_logprobs
from unimem.engine.batch import Batch
from unimem.engine.cuda_graphs import StepGraphs, default_buckets
from unimem.engine.step_io import (
    DeviceRequestState,
    DeviceSamplingState,
    SamplingRows,
    StagedTopLogprobs,
    StepLanes,
    StepOutputs,
)
from unimem.memory.pool import MemoryPool
from unimem.memory.spec import LayerKind
from unimem.memory.staging import upload_int32, upload_int32_into
from unimem.models import gdn_prefill, logit_adjustments
from unimem.models.base import CausalLM
from unimem.models.batch_invariant import gdn_batch_invariant
from unimem.models.forward_context import ForwardMode
from unimem.models.logit_adjustments import LaneAdjustments
from unimem.models.paged_context import PagedContext, PagedLayers
from unimem.models.sampler import (
    CUT_RULES,
    SORTED,
    batch_cut_rule,
    sample,
    token_logprobs,
    top_logprobs,
)
from unimem.models.stable_outputs import StableOutputs
from unimem.speculative.chain import DsparkChain
from unimem.speculative.draft_runner import DraftRunner
from unimem.speculative.verify_step import VerifyForward, VerifyLanes, VerifyStep
from unimem_kernel import envs
from unimem_kernel.greedy_pick import greedy_logprob

__all__ = ["EXTEND_LANES", "EXTEND_TOKENS", "ModelRunner"]

log = logging.getLogger(__name__)

EXTEND_LANES = (1, 2, 4, 8)
"""Request buckets of padded extend steps (each step has one more lane for the padding)."""

EXTEND_TOKENS = (16, 32, 64, 128, 256)
"""Token buckets of padded extend steps."""


@dataclass(frozen=True)
class EagerExtras:
    """What an eager step does beyond a recorded one: ``top_k`` > 0 — return each output
    row's most likely tokens (:func:`~unimem.models.sampler.top_logprobs`); ``adjust`` —
    adjust the rows' logits before the pick (:mod:`unimem.engine.adjustments`, uploaded)."""

    top_k: int = 0
    adjust: LaneAdjustments | None = None


NO_EXTRAS = EagerExtras()
"""A recorded step's: nothing beyond it."""


class ModelRunner:
    """Forward of scheduled batches over ``pool`` with ``backend``; with ``chain``, also the
    verify step of chain speculative decoding (module docstring).

    ``max_bs`` lanes per step, ``max_tokens`` tokens per extend. ``cuda_graphs``: record the
    decode step (or, with a chain, the verify step) for every bucket of ``graph_buckets``
    (default :func:`default_buckets`) at construction; needs a CUDA pool and a backend that
    can be captured (FA4), and a GDN path that skips padded lanes (the Triton kernels).
    ``gdn_replay_commit``: how a verify's GDN states are committed
    (:class:`~unimem.speculative.verify_step.VerifyStep`). ``logprobs``: every step also
    writes the log-probability of each output token (``out.logprobs``; one log-sum-exp over
    the vocabulary per logits row) under the model's raw distribution — before temperature
    and filters, as SGLang reports it.

    ``padded_extend`` (default: ``UNIMEM_EXTEND_GRAPHS``, whose ``auto`` means "with
    ``cuda_graphs``"): short extends run padded to a bucket (module docstring), recorded with
    ``cuda_graphs`` (eager without: only the tests want that); not for models with recurrent
    state layers (their chunked prefill plans on host lengths). Batch-invariant mode pads
    too: a padded extend gives the ragged extend's bits there (a request's extend may land
    in a bucket or not, depending on who else is admitted) — ``test_deterministic_cpu.py``
    on the CPU, ``test_deterministic_gpu.py`` under FA4 and CUDA graphs.

    Sampling (temperature > 0) runs in extend, decode and verify steps (speculative sampling
    in verify). :attr:`verify_lens_override` and :attr:`planned_lengths` are the verify
    step's test hooks for adaptive lengths
    (:class:`~unimem.speculative.verify_step.VerifyStep`).
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
        padded_extend: bool | None = None,
    ) -> None:
        self.model = model
        self.logprobs = logprobs
        self.extras_live = True
        """Whether a batch may hold a request with per-request extras (top log-probabilities,
        prompt scoring, logit adjustments). The engine clears it while none is unfinished, so
        that the steps skip looking for them; True (look) for any other caller."""
        self.pool = pool
        self.backend = backend
        self.spec = pool.spec
        self.device = pool.device
        self.layers = PagedLayers.of(pool, model.config)
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
        self.verifier: VerifyStep | None = None
        self.drafts: DraftRunner | None = None
        if chain is not None:
            self.verifier = VerifyStep(
                chain, model, pool, backend, self.builder, self.layers, max_bs, max_tokens,
                gdn_replay_commit=gdn_replay_commit, logprobs=logprobs,
            )  # fmt: skip
            self.drafts = self.verifier.drafts
        if padded_extend is None:
            mode = envs.get("UNIMEM_EXTEND_GRAPHS")
            padded_extend = mode == "on" or (mode == "auto" and cuda_graphs)
        self.extend_lanes: tuple[int, ...] = ()
        self.extend_tokens: tuple[int, ...] = ()
        if padded_extend and not pool.spec.has(LayerKind.STATE):
            self.extend_lanes = tuple(b for b in EXTEND_LANES if b + 1 <= max_bs)
            self.extend_tokens = tuple(t for t in EXTEND_TOKENS if t <= max_tokens)
            if not self.extend_lanes or not self.extend_tokens:
                self.extend_lanes = self.extend_tokens = ()
        self._xlanes = (self.extend_lanes[-1] + 1) if self.extend_lanes else 0
        self._xin = torch.zeros(
            5 * self._xlanes + (self.extend_tokens[-1] if self.extend_tokens else 0),
            dtype=torch.int32,
            device=self.device,
        )
        """Capture-stable inputs of padded extends: rows, prefix lengths, chunk lengths,
        virtual state slots and known next tokens (``_xlanes`` entries each), then token ids."""
        self.extend_graphs: dict[tuple[int, str | None], StepGraphs] = {}
        """Recorded padded extends, per (request bucket, the step's rule: None where no lane
        samples, else the cut-off rule of :meth:`step_rule`), each over the token buckets."""
        self.extend_halves: dict[int, StepGraphs] = {}
        """Recorded forward halves of padded extends (:meth:`_extend_padded_half`), per
        request bucket over the token buckets: an extend with extras replays one."""
        self.capture_seconds: float | None = None
        """Seconds the start-up's CUDA-graph captures took (None: no graphs)."""
        self.graphs: StepGraphs | None = None
        self.sample_graphs: dict[str, StepGraphs] = {}
        """Graphs of the steps that sample, one set per cut-off rule (:data:`CUT_RULES`), in
        one memory pool."""
        self.forward_graphs: dict[str | None, StepGraphs] = {}
        """Recorded forward halves (:meth:`forward_half`) for the steps with extras: decode's
        under None (its forward does not sample), verify's per rule (None: greedy drafts,
        else the cut-off rule of the sampled drafts)."""
        self.kept = StableOutputs()
        """Where the recorded forward halves leave their hidden rows and draft
        distributions: one buffer each for every bucket."""
        self.eager_halves = False
        """Test hook: without graphs, a step with extras runs as its two halves
        (:meth:`forward_half` with fresh stable outputs, then :meth:`finish_half`) — the path
        a graph engine takes — instead of :meth:`eager_step`."""
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("cuda_graphs needs a pool on a CUDA device")
            buckets = tuple(graph_buckets) if graph_buckets else default_buckets(max_bs)
            if max(buckets) > max_bs:
                raise ValueError(f"graph bucket {max(buckets)} exceeds max_bs {max_bs}")
            t0 = time.perf_counter()
            with torch.inference_mode():  # as launch() runs the eager steps
                self.graphs = StepGraphs(self._uniform_step, self.lanes.pad, buckets, self.device)
                # SORTED serves any batch; BOUNDED skips the whole-row sort (every sampled lane
                # has a small top-k), UNFILTERED every filter (no sampled lane has one)
                pool = None
                for rule in CUT_RULES:
                    graphs = StepGraphs(
                        functools.partial(self._sampling_step, rule=rule),
                        self.lanes.pad, buckets, self.device, pool=pool,
                    )  # fmt: skip
                    self.sample_graphs[rule] = graphs
                    pool = graphs.pool
                for rule in (None, *CUT_RULES) if chain is not None else (None,):
                    self.forward_graphs[rule] = StepGraphs(
                        functools.partial(self.forward_half, rule=rule),
                        self.lanes.pad, buckets, self.device, pool=pool,
                    )  # fmt: skip
                for lanes in self.extend_lanes:
                    for rule in (None, *CUT_RULES):
                        graphs = StepGraphs(
                            functools.partial(self._extend_padded, lanes, rule=rule),
                            functools.partial(self._pad_extend, lanes),
                            self.extend_tokens, self.device, pool=pool,
                        )  # fmt: skip
                        self.extend_graphs[(lanes, rule)] = graphs
                    self.extend_halves[lanes] = StepGraphs(
                        functools.partial(self._extend_padded_half, lanes),
                        functools.partial(self._pad_extend, lanes),
                        self.extend_tokens, self.device, pool=pool,
                    )  # fmt: skip
            self.capture_seconds = time.perf_counter() - t0
            log.info(
                "captured %d CUDA graphs in %.1f s: %d batch sizes (1 .. %d) x %d step kinds"
                " and %d forward halves, and %d padded extends (and their forward halves)",
                len(buckets) * (1 + len(CUT_RULES) + len(self.forward_graphs)),
                self.capture_seconds, len(buckets), max(buckets), 1 + len(CUT_RULES),
                len(self.forward_graphs),
                (2 + len(CUT_RULES)) * len(self.extend_lanes) * len(self.extend_tokens),
            )  # fmt: skip

    @property
    def verify_lens_override(self) -> torch.Tensor | None:
        """The verify step's :attr:`~unimem.speculative.verify_step.VerifyStep.lens_override`."""
        return self.verifier.lens_override

    @verify_lens_override.setter
    def verify_lens_override(self, lengths: torch.Tensor | None) -> None:
        self.verifier.lens_override = lengths

    @property
    def planned_lengths(self) -> list[int] | None:
        """The verify step's
        :attr:`~unimem.speculative.verify_step.VerifyStep.planned_lengths`."""
        return self.verifier.planned_lengths

    @planned_lengths.setter
    def planned_lengths(self, lengths: list[int] | None) -> None:
        self.verifier.planned_lengths = lengths

    def _warm_up_fla(self, max_tokens: int) -> list[int]:
        """Compile and autotune fla's chunked GDN prefill for every GDN layer layout of the
        model before the first request, when an extend of up to ``max_tokens`` tokens can
        take it (:func:`unimem.models.gdn_prefill.warm_up_fla`; never in batch-invariant
        mode). Returns the token counts run (empty when nothing was warmed)."""
        layouts = {}
        for conv, ssm in self.layers.state.values():
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

    # ----------------------------------------------------------------------------- launch

    @torch.inference_mode()
    def launch(self, batch: Batch, in_flight: Batch | None = None) -> int:
        """Run ``batch`` (queued on the current stream; nothing is read back). Its results
        are in ``self.out`` lanes ``:len(batch.reqs)`` (valid until the next launch):
        extend/decode lane ``i`` sampled ``out.tokens[i, 0]`` (meaningful where
        ``batch.samples[i]``), verify lane ``i`` committed ``out.tokens[i, :out.counts[i]]``.
        Returns the number of lanes. A batch with a request asking for top log-probabilities
        (``Request.top_logprobs_k``) or adjusting its logits replays only the forward half of
        its step and runs the rest eagerly (module docstring; eagerly throughout without
        graphs), and leaves the top log-probabilities in ``batch.top_logprobs``.
        ``in_flight``: the batch launched before this one whose results the host has not read
        (None: all read); penalties add its committed tokens on the device
        (:func:`unimem.engine.adjustments.plan`)."""
        extras = self.extras_live and batch.reqs
        top_k = max(r.top_logprobs_k for r in batch.reqs) if extras else 0
        if top_k and not self.logprobs:
            raise ValueError("top log-probabilities need a runner built with logprobs=True")
        if batch.mode is ForwardMode.EXTEND:
            self._extend(batch, top_k, in_flight)
            return len(batch.reqs)
        step = ForwardMode.VERIFY if self.chain is not None else ForwardMode.DECODE
        if batch.mode is not step:
            raise ValueError(
                f"this runner runs extend and {step.value} steps, not {batch.mode.value!r}"
            )
        bs = len(batch.reqs)
        width = self.graphs.bucket(bs) if self.graphs is not None else bs
        self.lanes.stage(
            [r.mem.row for r in batch.reqs],
            [r.mem.state_slot for r in batch.reqs],
            [r.rid for r in batch.reqs],
            width,
        )
        rule = self.step_rule(batch.reqs)
        graphs = self.graphs if rule is None else self.sample_graphs.get(rule)
        adjust = adjustments.plan(batch.reqs, width, in_flight) if extras else None
        if graphs is not None and not top_k and adjust is None:
            graphs.replay(width)
        else:
            extras = self._extras(top_k, adjust)
            halves = self.forward_graphs.get(rule if self.chain is not None else None)
            if halves is not None:
                top = self.finish_half(width, halves.replay(width), rule, extras)
            elif self.eager_halves:
                half = self.forward_half(width, rule, StableOutputs())
                top = self.finish_half(width, half, rule, extras)
            else:
                top = self.eager_step(width, rule, extras)
            if top is not None:
                batch.top_logprobs = StagedTopLogprobs.stage(*top, bs)
        return bs

    def _extras(self, top_k: int, adjust: LaneAdjustments | None) -> EagerExtras:
        """A step's :class:`EagerExtras`: its adjustments uploaded, with penalties reading the
        step in flight's committed tokens from :attr:`out` (before this step writes it)."""
        if adjust is None:
            return EagerExtras(top_k)
        adjust = adjust.upload(self.device)
        if adjust.in_flight_lanes is not None:
            outputs = (self.out.tokens, self.out.counts)
            adjust = dataclasses.replace(adjust, in_flight_outputs=outputs)
        return EagerExtras(top_k, adjust)

    @staticmethod
    def step_rule(reqs) -> str | None:
        """The step ``reqs`` take: None for the greedy one (no request samples), else the
        cut-off rule of the sampled one (:func:`~unimem.models.sampler.batch_cut_rule`)."""
        if all(r.sampling.greedy for r in reqs):
            return None
        return batch_cut_rule(r.sampling.cut_rule for r in reqs)

    def eager_step(
        self, width: int, rule: str | None = None, extras: EagerExtras = NO_EXTRAS
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode (or verify) step of ``width`` staged lanes run eagerly: the greedy one
        (``rule`` None) or the sampled one of ``rule`` (:meth:`step_rule`), with ``extras``
        (:class:`EagerExtras`). Returns, with ``extras.top_k``, each output row's most
        likely tokens as ``(values [width, rows, k], ids)``
        (:func:`~unimem.models.sampler.top_logprobs`); else None."""
        if rule is None:
            return self._uniform_step(width, extras)
        return self._sampling_step(width, rule, extras)

    def forward_half(
        self, width: int, rule: str | None = None, kept: StableOutputs | None = None
    ) -> tuple:
        """The first half of the decode (or verify) step of ``width`` staged lanes: the
        forward up to the final-normed hidden states, before the LM head (a verify also drafts
        first, greedily or, with ``rule``, sampled under that cut-off rule). Its outputs that
        grow with the batch go to ``kept`` (default :attr:`kept`). Returns what
        :meth:`finish_half` takes: decode's ``(seq_lens [width] int32, final hidden [width,
        d_model])``, verify's ``(lanes, sampling rows or None,``
        :class:`~unimem.speculative.verify_step.VerifyForward` ``)``, the lanes and rows read
        once for both halves. Device inputs only (recorded per bucket); nothing is
        committed."""
        kept = self.kept if kept is None else kept
        if self.chain is not None:
            lanes, params = self._verify_lanes(width, rule)
            return lanes, params, self.verifier.forward(lanes, params, kept)
        seq_lens, _, final = self._decode_forward(width, head=False)
        return seq_lens, kept.keep("decode.final", final)

    def finish_half(
        self,
        width: int,
        half: tuple,
        rule: str | None = None,
        extras: EagerExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rest of the step whose :meth:`forward_half` (same ``width`` and ``rule``, just
        run or replayed) left ``half``: the LM head, ``extras``, the pick (or the chain's
        acceptance) and the commits; returns as :meth:`eager_step`."""
        if self.chain is not None:
            lanes, params, forward = half
            return self._verify_finish(width, lanes, params, forward, extras)
        seq_lens, final = half
        logits = self.model.head_logits(final)
        return self._decode_finish(width, seq_lens, logits, rule is not None, rule, extras)

    def _uniform_step(self, width: int, extras: EagerExtras = NO_EXTRAS):
        if self.chain is not None:
            return self._verify_step(width, extras=extras)
        return self._decode_step(width, extras=extras)

    def _sampling_step(self, width: int, rule: str = SORTED, extras: EagerExtras = NO_EXTRAS):
        if self.chain is not None:
            return self._verify_step(width, draw=True, rule=rule, extras=extras)
        return self._decode_step(width, draw=True, rule=rule, extras=extras)

    @staticmethod
    def _pick(
        logits: torch.Tensor, params: SamplingRows | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """argmax (``params`` None: no lane samples; ``positions`` unused) or :func:`sample`
        per lane."""
        if params is None:
            return torch.argmax(logits, dim=-1)
        p = params
        return sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.seeds, positions, p.rule)

    # ----------------------------------------------------------------------------- extend

    def _extend(self, batch: Batch, top_k: int = 0, in_flight: Batch | None = None) -> None:
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
        scored = prompt_logprobs.plan(reqs, starts, lens) if self.extras_live else None
        if (
            scored is None
            and self.extend_lanes
            and bs <= self.extend_lanes[-1]
            and len(ids) <= self.extend_tokens[-1]
        ):
            self._launch_padded_extend(batch, known_next, ids, top_k, in_flight)
            return
        adjust = adjustments.plan(reqs, bs, in_flight) if self.extras_live else None
        extra = []
        if scored is not None:
            extra = scored.hidden_rows + scored.head_rows + scored.picks + scored.targets
        packed = upload_int32(
            [r.mem.row for r in reqs]
            + starts
            + lens
            + [r.mem.state_slot for r in reqs]
            + known_next
            + ids
            + extra,
            self.device,
        )
        rows, prefix, ext = packed[:bs], packed[bs : 2 * bs], packed[2 * bs : 3 * bs]
        vslots, nxt = packed[3 * bs : 4 * bs], packed[4 * bs : 5 * bs]
        input_ids = packed[5 * bs : 5 * bs + len(ids)]
        hidden_rows = None
        if scored is not None:
            a = 5 * bs + len(ids)
            b = a + len(scored.hidden_rows)
            c = b + bs
            d = c + len(scored.picks)
            hidden_rows = (packed[a:b], packed[b:c])
            picks, targets = packed[c:d], packed[d : d + len(scored.targets)]
        params = None
        floats, ints = self.sampling.upload([r.sampling_row for r in reqs])
        self.sampling.write(rows, floats, ints)
        rule = self.step_rule(reqs)
        if rule is not None:  # the lanes sample under the batch's cut-off rule, as its steps
            params = DeviceSamplingState.lanes(floats, ints, rule)
        hidden, top = self._extend_forward(
            rows, prefix, ext, vslots, nxt, input_ids, params, bs,
            num_tokens=len(ids), max_seqlen_q=max(lens),
            cu_seqlens_host=[0, *itertools.accumulate(lens)], hidden_rows=hidden_rows,
            extras=self._extras(top_k, adjust),
        )  # fmt: skip
        if top is not None:
            batch.top_logprobs = StagedTopLogprobs.stage(*top, bs)
        if scored is not None:
            values, top_ids = prompt_logprobs.score_rows(
                self.model.head_logits, hidden, picks.long(), targets.long(), scored.top_k,
                self.model.config.vocab_size,
            )  # fmt: skip
            batch.prompt_logprobs = prompt_logprobs.StagedPromptLogprobs.stage(
                values, top_ids, scored.owners
            )

    def _extend_forward(
        self,
        rows: torch.Tensor,
        prefix: torch.Tensor,
        ext: torch.Tensor,
        vslots: torch.Tensor,
        nxt: torch.Tensor,
        input_ids: torch.Tensor,
        params: SamplingRows | None,
        lanes: int,
        *,
        num_tokens: int,
        max_seqlen_q: int,
        cu_seqlens_host: list[int] | None = None,
        hidden_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
        extras: EagerExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """An extend's body, ragged or padded: its metadata from the live tables, the
        forward, the drafter's context K/V for every token consumed, each lane's sample at
        its last row (its next token: ``nxt`` where known, else the sample) and new length
        into the device state, and the first ``lanes`` lanes' samples (and log-probabilities)
        into ``out``. ``hidden_rows``: the rows whose final hidden states the forward
        returns and each lane's last row among them (a
        :class:`~unimem.engine.prompt_logprobs.PromptRows`' ``hidden_rows`` and
        ``head_rows``); default each lane's last row. ``extras``: the ragged extend's
        (:class:`EagerExtras`): its adjustments apply to the lanes' last rows before the
        pick. Returns those hidden states and, with ``extras.top_k``, the lanes' samples' top
        log-probabilities (``[lanes, 1, k]`` values and ids; else None). Device work only."""
        logits, hidden = self._extend_body(
            rows, prefix, ext, vslots, input_ids, num_tokens=num_tokens,
            max_seqlen_q=max_seqlen_q, cu_seqlens_host=cu_seqlens_host, hidden_rows=hidden_rows,
        )  # fmt: skip
        return hidden, self._extend_pick(rows, prefix, ext, nxt, logits, params, lanes, extras)

    def _extend_body(
        self,
        rows: torch.Tensor,
        prefix: torch.Tensor,
        ext: torch.Tensor,
        vslots: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        num_tokens: int,
        max_seqlen_q: int,
        cu_seqlens_host: list[int] | None = None,
        hidden_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
        head: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """An extend's metadata, forward and drafter context K/V (:meth:`_extend_forward`):
        ``(logits of the returned rows, or None where not ``head``; their final-normed hidden
        states)``."""
        pool = self.pool
        meta = self.builder.extend(
            pool.req_to_token, rows, prefix, ext, pool.full_v2p, pool.swa_v2p,
            num_tokens=num_tokens, max_seqlen_q=max_seqlen_q,
        )  # fmt: skip
        if hidden_rows is None:
            returned = meta.cu_seqlens_q[1:].long() - 1  # each lane's last row (no upload)
        else:
            returned = hidden_rows[0].long()
        capture = self.drafts.target_layers if self.drafts is not None else ()
        ctx = PagedContext(
            ForwardMode.EXTEND, meta, self.layers, self.backend, self._state_slots(vslots),
            returned, capture=capture, cu_seqlens_host=cu_seqlens_host,
        )  # fmt: skip
        if hidden_rows is not None:
            ctx.head_indices = hidden_rows[1].long()
        ctx.run_head = head
        logits, hidden = self.model.forward_with_hidden(input_ids.long(), ctx)
        if self.drafts is not None:
            self.drafts.write_context(ctx.hidden, meta)
        return logits, hidden

    def _extend_pick(
        self,
        rows: torch.Tensor,
        prefix: torch.Tensor,
        ext: torch.Tensor,
        nxt: torch.Tensor,
        logits: torch.Tensor,
        params: SamplingRows | None,
        lanes: int,
        extras: EagerExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An extend's pick over its lanes' last-row ``logits`` (:meth:`_extend_forward`):
        ``extras`` applied, each lane's sample and next token and new length into the device
        state, the first ``lanes`` lanes' samples into ``out``; returns the top
        log-probabilities with ``extras.top_k``."""
        top_k, adjust = extras.top_k, extras.adjust
        if adjust is not None:  # the sampled token's index is the number of tokens consumed
            logit_adjustments.apply(logits, self._arange[: logits.shape[0]], prefix + ext, adjust)
        # the sampled token's index in prompt + output is the number of tokens consumed
        sampled = self._pick(logits, params, (prefix + ext).long())
        self.state.write(rows, prefix + ext, torch.where(nxt >= 0, nxt.long(), sampled))
        self.out.tokens[:lanes, 0] = sampled[:lanes]
        self.out.counts[:lanes] = 1
        if self.logprobs:
            self.out.logprobs[:lanes, 0] = token_logprobs(logits[:lanes], sampled[:lanes])
        if top_k:
            return self._top(logits[:lanes], sampled[:lanes], self.out.logprobs[:lanes, 0], top_k)
        return None

    @staticmethod
    def _top(
        logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~unimem.models.sampler.top_logprobs` of one output row per lane, shaped
        ``[lanes, 1, k]``."""
        values, ids = top_logprobs(logits, k, tokens, logprobs)
        return values[:, None], ids[:, None]

    def _launch_padded_extend(
        self,
        batch: Batch,
        known_next: list[int],
        ids: list[int],
        top_k: int = 0,
        in_flight: Batch | None = None,
    ) -> None:
        """Stage a short extend into the padded inputs (one non-blocking copy) and run its
        bucket: replay its graph, or run the padded step eagerly. With extras (``top_k``,
        logit adjustments) replay the bucket's forward half and pick eagerly after it
        (:meth:`_extend_padded_half`, :meth:`_extend_padded_finish`), leaving the top
        log-probabilities in ``batch.top_logprobs``."""
        reqs, starts, lens = batch.reqs, batch.starts, batch.lens
        bs, total = len(reqs), len(ids)
        lanes = next(b for b in self.extend_lanes if b >= bs)
        tokens = next(t for t in self.extend_tokens if t >= total)
        n = self._xlanes
        host = np.zeros(5 * n + tokens, dtype=np.int32)
        host[3 * n : 5 * n] = -1  # padding lanes: no state slot, no known next token
        host[0:bs] = [r.mem.row for r in reqs]
        host[n : n + bs] = starts
        host[2 * n : 2 * n + bs] = lens
        host[2 * n + lanes] = tokens - total  # the padding lane holds the rest of the bucket
        host[3 * n : 3 * n + bs] = [r.mem.state_slot for r in reqs]
        host[4 * n : 4 * n + bs] = known_next
        host[5 * n : 5 * n + total] = ids
        upload_int32_into(self._xin, host)
        floats, ints = self.sampling.upload([r.sampling_row for r in reqs])
        self.sampling.write(self._xin[:bs], floats, ints)
        rule = self.step_rule(reqs)
        adjust = adjustments.plan(reqs, lanes + 1, in_flight) if self.extras_live else None
        if not top_k and adjust is None:
            graphs = self.extend_graphs.get((lanes, rule))
            if graphs is not None:
                graphs.replay(tokens)
            else:
                self._extend_padded(lanes, tokens, rule=rule)
            return
        extras = self._extras(top_k, adjust)
        halves = self.extend_halves.get(lanes)
        if halves is not None:
            hidden = halves.replay(tokens)
        elif self.eager_halves:
            hidden = self._extend_padded_half(lanes, tokens, StableOutputs())
        else:
            hidden = None
        if hidden is None:
            top = self._extend_padded(lanes, tokens, rule=rule, extras=extras)
        else:
            top = self._extend_padded_finish(lanes, tokens, hidden, rule, extras)
        if top is not None:
            batch.top_logprobs = StagedTopLogprobs.stage(*top, bs)

    def _extend_views(self, lanes: int, tokens: int) -> tuple[torch.Tensor, ...]:
        """``(rows, prefix, ext, vslots, known_next, input_ids)`` of a padded extend of
        ``lanes`` requests (``lanes + 1`` lanes) and ``tokens`` tokens: views of ``_xin``."""
        n, x = self._xlanes, self._xin
        fields = tuple(x[i * n : i * n + lanes + 1] for i in range(5))
        return (*fields, x[5 * n : 5 * n + tokens])

    def _pad_extend(self, lanes: int, tokens: int) -> None:
        """Every lane of the bucket padded (before its warm-up run and its capture): row 0,
        no tokens, the padding lane all ``tokens``."""
        rows, prefix, ext, vslots, nxt, ids = self._extend_views(lanes, tokens)
        for t, value in ((rows, 0), (prefix, 0), (ext, 0), (vslots, -1), (nxt, -1), (ids, 0)):
            t.fill_(value)
        ext[lanes].fill_(tokens)

    def _extend_padded(
        self,
        lanes: int,
        tokens: int,
        rule: str | None = None,
        extras: EagerExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The extend of the staged padded inputs (:meth:`_extend_views`): device inputs
        only, so it can be recorded. Each real lane runs :meth:`_extend`'s body
        (:meth:`_extend_forward`); the padding lanes sit on row 0 (their K/V go to the sink
        slots; the request state's row 0 is never written) and their outputs are not
        stored. ``rule``: None where no lane samples, else the cut-off rule the sampled lanes
        promise (:meth:`step_rule`). ``extras`` (eager only): as :meth:`_extend_forward`'s,
        over the ``lanes + 1`` lanes; returns its top log-probabilities."""
        rows, prefix, ext, vslots, nxt, input_ids = self._extend_views(lanes, tokens)
        params = self.sampling.read(rows, rule) if rule is not None else None
        _, top = self._extend_forward(
            rows, prefix, ext, vslots, nxt, input_ids, params, lanes,
            num_tokens=tokens, max_seqlen_q=tokens, extras=extras,
        )  # fmt: skip
        return top

    def _extend_padded_half(
        self, lanes: int, tokens: int, kept: StableOutputs | None = None
    ) -> torch.Tensor:
        """The forward half of :meth:`_extend_padded` (recorded per bucket, for extends with
        extras): metadata, forward and drafter context K/V, stopping before the LM head.
        Returns the lanes' last-row final hidden states ``[lanes + 1, d_model]``, kept in
        ``kept`` (default :attr:`kept`; one buffer per request bucket)."""
        rows, prefix, ext, vslots, _, input_ids = self._extend_views(lanes, tokens)
        _, hidden = self._extend_body(
            rows, prefix, ext, vslots, input_ids, num_tokens=tokens, max_seqlen_q=tokens,
            head=False,
        )  # fmt: skip
        return (self.kept if kept is None else kept).keep(f"extend.final.{lanes}", hidden)

    def _extend_padded_finish(
        self,
        lanes: int,
        tokens: int,
        hidden: torch.Tensor,
        rule: str | None,
        extras: EagerExtras,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rest of :meth:`_extend_padded` after its forward half left ``hidden``: the LM
        head, ``extras``, the pick and the state (:meth:`_extend_pick`)."""
        rows, prefix, ext, _, nxt, _ = self._extend_views(lanes, tokens)
        params = self.sampling.read(rows, rule) if rule is not None else None
        logits = self.model.head_logits(hidden)
        return self._extend_pick(rows, prefix, ext, nxt, logits, params, lanes, extras)

    # ----------------------------------------------------------------------------- decode

    def _decode_step(
        self,
        width: int,
        draw: bool = False,
        rule: str = SORTED,
        extras: EagerExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One token per lane: each lane feeds its row's next token at its row's length and
        picks the next by argmax, or with ``draw`` by its row's sampling parameters
        (``rule``: the host's promise of :class:`SamplingRows`). ``extras`` (eager steps):
        adjust the rows' logits first, and return their top log-probabilities
        (:meth:`eager_step`). Device inputs only (capturable)."""
        seq_lens, logits, _ = self._decode_forward(width)
        return self._decode_finish(width, seq_lens, logits, draw, rule, extras)

    def _decode_forward(
        self, width: int, head: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The decode step's forward: ``(seq_lens [width] int32, logits [width, vocab] or
        None where not ``head``, final-normed hidden [width, d_model])``."""
        rows, vslots = self.lanes.rows(width), self.lanes.vslots(width)
        seq_lens, input_ids = self.state.read(rows)
        pool = self.pool
        meta = self.builder.decode(pool.req_to_token, rows, seq_lens, pool.full_v2p, pool.swa_v2p)
        ctx = PagedContext(
            ForwardMode.DECODE, meta, self.layers, self.backend, self._state_slots(vslots),
            self._arange[:width],
        )  # fmt: skip
        ctx.run_head = head
        out = self.model.forward_with_hidden(input_ids, ctx)
        return seq_lens, out.logits, out.hidden

    def _decode_finish(
        self,
        width: int,
        seq_lens: torch.Tensor,
        logits: torch.Tensor,
        draw: bool,
        rule: str | None,
        extras: EagerExtras,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode step's pick over its forward's ``logits`` and the commit."""
        rows = self.lanes.rows(width)
        top_k, adjust = extras.top_k, extras.adjust
        if adjust is not None:  # the input token sits at index seq_lens, the pick one past it
            logit_adjustments.apply(logits, self._arange[:width], seq_lens.long() + 1, adjust)
        if not draw and self.logprobs and logits.dtype == torch.float32:
            # argmax and its log-probability in one pass, written into the step's outputs
            sampled, _ = greedy_logprob(logits, self.out.logprobs[:width, 0])
            self.state.commit(rows, seq_lens, sampled, sampled[:, None], self.out)
            if top_k:
                return self._top(logits, sampled, self.out.logprobs[:width, 0], top_k)
            return None
        params = self.sampling.read(rows, rule) if draw else None
        # the input token sits at index seq_lens; the sampled one at seq_lens + 1 (a sampling
        # lane's position; greedy picks need none)
        positions = seq_lens.long() + 1 if params is not None else None
        sampled = self._pick(logits, params, positions)
        self.state.commit(rows, seq_lens, sampled, sampled[:, None], self.out)
        if self.logprobs:
            self.out.logprobs[:width, 0] = token_logprobs(logits, sampled)
        if top_k:
            return self._top(logits, sampled, self.out.logprobs[:width, 0], top_k)
        return None

    def _state_slots(self, vslots: torch.Tensor) -> torch.Tensor | None:
        if not self.spec.has(LayerKind.STATE):
            return None
        return self.pool.physical_state_slots(vslots)

    # ----------------------------------------------------------------------------- verify

    def _verify_step(
        self,
        width: int,
        draw: bool = False,
        rule: str = SORTED,
        extras: EagerExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One chain step for every lane
        (:meth:`~unimem.speculative.verify_step.VerifyStep.run`): the lanes' rows, slots,
        lengths and anchors from the device state, and with ``draw`` their sampling
        parameters (``rule``: the host's promise of :class:`SamplingRows`); each
        lane's row is committed into the device state and the step's outputs. Device inputs
        only (capturable)."""
        lanes, params = self._verify_lanes(width, rule if draw else None)
        half = self.verifier.forward(lanes, params)
        return self._verify_finish(width, lanes, params, half, extras)

    def _verify_lanes(
        self, width: int, rule: str | None
    ) -> tuple[VerifyLanes, SamplingRows | None]:
        """The verify step's lanes from the device state, and with ``rule`` (the host's
        promise of :class:`SamplingRows`) their sampling parameters."""
        rows, vslots = self.lanes.rows(width), self.lanes.vslots(width)
        seq_lens, anchors = self.state.read(rows)
        lanes = VerifyLanes(
            rows, vslots, self.lanes.rids(width), seq_lens, anchors, self._state_slots(vslots)
        )
        return lanes, (self.sampling.read(rows, rule) if rule is not None else None)

    def _verify_finish(
        self,
        width: int,
        lanes: VerifyLanes,
        params: SamplingRows | None,
        half: VerifyForward,
        extras: EagerExtras,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verify step's acceptance and commits over its forward ``half``."""
        rows, seq_lens = lanes.rows, lanes.seq_lens

        def commit(bonus, tokens, accepted, write_slots):
            return self.state.commit(rows, seq_lens, bonus, tokens, self.out, accepted, write_slots)

        result = self.verifier.finish(half, lanes, params, commit, extras.top_k, extras.adjust)
        if result.lengths is not None:
            self.out.verify_lens[:width] = result.lengths
        if result.logprobs is not None:
            self.out.logprobs[:width] = result.logprobs
        return result.top
