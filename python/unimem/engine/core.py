"""The reference engine: submit requests, step the scheduler, run the model, pick tokens
(greedy or sampled) — one token per step, or, with a
:class:`~unimem.speculative.chain.DsparkChain`, a verified chain of up to ``gamma + 1`` tokens
per step (greedy accept, or exact speculative sampling for temperature > 0).

The step loop never waits for the step it just launched: sampled tokens and
accepted lengths stay on the device, where the next step reads them, and reach the host
through non-blocking copies into pinned memory. The host reads step ``k``'s results after it
has launched step ``k + 1`` (the GPU is busy meanwhile) and plans with upper bounds until
then (see :mod:`unimem.engine.scheduler`; with a prefix cache over STATE layers, the
state checkpoints are snapshots taken at launch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from unimem.attention.backend import AttentionBackend
from unimem.cache import PrefixCache
from unimem.engine.adjustments import check_options as check_adjustments
from unimem.engine.adjustments import check_penalties, needs_exact_history
from unimem.engine.batch import Batch
from unimem.engine.grammar import GrammarBackend, GrammarSpec, GrammarState
from unimem.engine.prefill_delay import PrefillDelayer
from unimem.engine.prompt_logprobs import check_options, check_top_logprobs
from unimem.engine.request import Request, RequestStatus
from unimem.engine.runner import ModelRunner
from unimem.engine.sampling import GREEDY, SamplingOptions, default_seed, seed_to_int64
from unimem.engine.scheduler import Scheduler
from unimem.engine.step_io import ResultRing, StagedResult
from unimem.memory.pool import MemoryPool, pages_for
from unimem.models.base import CausalLM
from unimem.models.forward_context import ForwardMode
from unimem.speculative.chain import DsparkChain


class EngineCore:
    """Continuous-batching generation over one memory pool.

    ``submit`` validates a request against the model and the pool and raises ``ValueError``
    naming the problem; a rejected request never enters the queue, so it cannot disturb the
    others.

    ``chain``: decode by chain speculation. The pool must have been built with the drafter's
    draft lanes (``memory_spec(config, page_size, draft_lanes=drafter.config.lanes())``), and
    every request needs ``gamma`` tokens of context beyond its last for the write window.

    ``cache``: a :class:`~unimem.cache.PrefixCache` over ``pool``: requests resume at cached
    prefixes, prefixes are inserted at anchor points and on finish, and the cache is evicted
    before a running request is retracted (see :mod:`unimem.engine.scheduler`).

    ``cuda_graphs`` (CUDA pool, FA4 backend): decode / verify steps are replayed CUDA graphs,
    one per batch-size bucket (``graph_buckets``), recorded at construction.

    ``logprobs``: every output token comes with its log-probability
    (``Request.output_logprobs``) under the model's raw distribution (before temperature and
    sampling filters).

    ``random_seed``: requests submitted without a seed get one drawn from it and their
    request id (:func:`~unimem.engine.sampling.default_seed`), so a run is reproducible.

    ``prefill_delayer``: hold admissions back while a saturated batch decodes
    (:mod:`unimem.engine.prefill_delay`); None: admit whenever something fits.

    ``grammar_backend``: compiles and matches the grammars of structured-output requests
    (:mod:`unimem.engine.grammar`); None: such requests are refused.

    With results read one step late, a speculative request may run one verify step past its
    end (its in-flight step finished it): every request reserves ``lookahead`` (``gamma + 1``)
    tokens of context and memory beyond its write window for that step.
    """

    def __init__(
        self,
        model: CausalLM,
        pool: MemoryPool,
        backend: AttentionBackend,
        max_running: int,
        chunk_size: int,
        chain: DsparkChain | None = None,
        cache: PrefixCache | None = None,
        *,
        cuda_graphs: bool = False,
        graph_buckets: Sequence[int] | None = None,
        logprobs: bool = False,
        random_seed: int = 0,
        prefill_delayer: PrefillDelayer | None = None,
        grammar_backend: GrammarBackend | None = None,
    ) -> None:
        self.model = model
        self.grammar_backend = grammar_backend
        self.random_seed = random_seed
        self.pool = pool
        self.chain = chain
        self.cache = cache
        self.lookahead = chain.verify_width if chain is not None else 0
        if chain is not None:
            c = model.config
            window = c.window if "swa" in c.layer_pattern else None
            chain.drafter.config.check_target(c.vocab_size, c.d_model, c.num_layers, window)
        self.scheduler = Scheduler(
            pool,
            max_running,
            chunk_size,
            gamma=chain.gamma if chain is not None else None,
            cache=cache,
            delayer=prefill_delayer,
        )
        self.runner = ModelRunner(
            model,
            pool,
            backend,
            max_bs=max_running,
            max_tokens=max(chunk_size, max_running),
            chain=chain,
            cuda_graphs=cuda_graphs,
            graph_buckets=graph_buckets,
            logprobs=logprobs,
        )
        self.results = ResultRing(max_running, self.runner.width, pool.device, logprobs=logprobs)
        self._pending: tuple[Batch, StagedResult] | None = None
        self._extras: list[Request] = []  # unfinished requests with Request.has_extras
        self.runner.extras_live = False
        self._next_rid = 0
        self.steps = 0

    def check_request(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """``ValueError`` naming the problem if a request of ``prompt`` for
        ``max_new_tokens`` tokens cannot run here (empty, token outside the vocabulary, past
        the context with the write window and look-ahead, larger than the memory alone)."""
        c = self.model.config
        if len(prompt) == 0:
            raise ValueError("request rejected: the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"request rejected: output length must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt if not 0 <= int(t) < c.vocab_size]
        if bad:
            raise ValueError(
                f"request rejected: token id {bad[0]} outside the vocabulary [0, {c.vocab_size})"
            )
        # With a chain, the last verify's write window reaches gamma tokens past the end, and
        # one more verify step may run before the host learns that the request finished.
        reach = (self.chain.gamma if self.chain else 0) + self.lookahead
        total = len(prompt) + max_new_tokens - 1 + reach
        if total > self.pool.max_context:
            window = f" + write window and look-ahead {reach}" if self.chain else ""
            raise ValueError(
                f"request rejected: prompt {len(prompt)} + output {max_new_tokens} tokens"
                f"{window} exceed the context of {self.pool.max_context}"
            )
        if not self.pool.fits_alone(total, self._swa_peak_tokens(total)):
            raise ValueError(
                f"request rejected: {total} tokens do not fit in the memory even alone"
            )

    def max_request_tokens(self) -> int:
        """The longest request (prompt + output tokens) that :meth:`check_request` accepts:
        within the pool's context with the write window and look-ahead, and holdable in the
        memory alone. A request up to it is admitted once its prompt's first chunk fits; its
        growth past what the memory holds beside the others is handled by retraction (see
        :mod:`unimem.engine.scheduler`). Computed once (the pool's geometry is fixed)."""
        cached = getattr(self, "_max_request_tokens", None)
        if cached is not None:
            return cached
        reach = (self.chain.gamma if self.chain else 0) + self.lookahead
        pool = self.pool

        def fits(n: int) -> bool:  # n = prompt + output tokens
            total = max(1, n - 1 + reach)
            return total <= pool.max_context and pool.fits_alone(
                total, self._swa_peak_tokens(total)
            )

        lo, hi = 0, pool.max_context + 1  # fits(lo) (vacuously for 0), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        self._max_request_tokens = lo
        return lo

    def check_sampling(self, sampling: SamplingOptions) -> None:
        """``ValueError`` if ``sampling`` is not a :class:`SamplingOptions`. Every option runs
        with or without a chain (with one, temperature > 0 is exact speculative sampling)."""
        if not isinstance(sampling, SamplingOptions):
            raise ValueError(f"sampling must be a SamplingOptions or None, got {sampling!r}")

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingOptions | None = None,
        *,
        prompt_logprobs_from: int | None = None,
        prompt_top_logprobs: int = 0,
        top_logprobs: int = 0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        grammar: GrammarSpec | None = None,
    ) -> Request:
        """Queue a request of ``prompt`` token ids for up to ``max_new_tokens`` output tokens,
        ending early at any of ``stop_token_ids`` (kept as its last output token), picked by
        ``sampling`` (None: greedy; a seedless one gets a seed from the engine's
        ``random_seed`` and the request id). ``prompt_logprobs_from``: also score the prompt
        from that position, with the ``prompt_top_logprobs`` most likely tokens at each
        (:mod:`unimem.engine.prompt_logprobs`); ``top_logprobs``: each output token's that
        many most likely tokens too (``Request.output_top_logprobs``; needs an engine built
        with ``logprobs``; a step with such a request runs eagerly). The penalties,
        ``logit_bias`` (token id -> bias) and ``min_tokens`` (stop tokens suppressed until the
        output has that many): :mod:`unimem.engine.adjustments`. ``grammar``: the output must
        follow it (:mod:`unimem.engine.grammar`; the request stops once it is complete).
        ``ValueError`` naming the problem (:meth:`check_request`, :meth:`check_sampling`,
        :func:`~unimem.engine.prompt_logprobs.check_options`, a grammar that does not
        compile or an engine without a grammar backend), before anything is queued."""
        self.check_request(prompt, max_new_tokens)
        sampling = GREEDY if sampling is None else sampling
        self.check_sampling(sampling)
        check_options(len(prompt), prompt_logprobs_from, prompt_top_logprobs)
        check_top_logprobs(top_logprobs, self.runner.logprobs)
        vocab = self.model.config.vocab_size
        bias = check_adjustments(logit_bias, min_tokens, max_new_tokens, vocab)
        penalties = check_penalties(presence_penalty, frequency_penalty, repetition_penalty)
        stops = frozenset(int(t) for t in stop_token_ids)
        state = None
        if grammar is not None:
            state = self.grammar_state(grammar, stops)
        rid = self._next_rid
        seed = default_seed(self.random_seed, rid) if sampling.seed is None else sampling.seed
        req = Request(
            rid,
            [int(t) for t in prompt],
            max_new_tokens,
            stop_token_ids=stops,
            sampling=sampling,
            seed=seed_to_int64(seed),
        )
        if prompt_logprobs_from is not None:
            req.prompt_logprobs_from = prompt_logprobs_from
            req.prompt_top_logprobs_k = prompt_top_logprobs
            req.prompt_logprobs = [None] * len(req.prompt)
            if prompt_top_logprobs:
                req.prompt_top_logprobs = [None] * len(req.prompt)
        req.top_logprobs_k = top_logprobs
        req.logit_bias, req.min_tokens, req.penalties = bias, min_tokens, penalties
        req.grammar = state
        if req.has_extras:
            self._extras.append(req)
            self.runner.extras_live = True
        self._next_rid += 1
        self.scheduler.add(req)
        return req

    def grammar_state(self, spec: GrammarSpec, stop_token_ids: Iterable[int] = ()) -> GrammarState:
        """A fresh matcher of ``spec`` for a request ending at ``stop_token_ids``;
        ``ValueError`` naming the problem if it does not compile or this engine has no grammar
        backend (callers may use it to check a grammar before submitting)."""
        if not isinstance(spec, GrammarSpec):
            raise ValueError(f"request rejected: grammar must be a GrammarSpec, got {spec!r}")
        if self.grammar_backend is None:
            raise ValueError(
                f"request rejected: {spec.kind} needs a grammar backend (this engine has none: "
                "no tokenizer, or grammar_backend 'none')"
            )
        try:
            return self.grammar_backend.state(spec, stop_token_ids)
        except ValueError as e:
            raise ValueError(f"request rejected: {e}") from None

    def restart_request_ids(self) -> None:
        """Number the next request 0 again, as in a fresh engine (after a warm-up: seedless
        requests then draw the seeds they would have drawn without it). ``ValueError``
        while any request is queued or running."""
        if not self.scheduler.idle:
            raise ValueError("request ids restart only while no request is queued or running")
        self._next_rid = 0

    def abort(self, req: Request) -> bool:
        """Stop ``req`` between steps, whatever its state: its memory comes back and any of
        its results still in flight are dropped (``Scheduler.abort``). False if it had
        already finished."""
        return self.scheduler.abort(req)

    def _swa_peak_tokens(self, total: int) -> int:
        """Most SWA tokens a request holds at once: its window behind the oldest query of a
        step plus the step's chunk, page-rounded."""
        window = self.pool.swa_window or 0
        p = self.pool.page_size
        step = self.scheduler.chunk_size
        if self.chain is not None:
            step = max(step, self.chain.verify_width + self.lookahead)
        return min(total, (pages_for(window, p) + pages_for(step, p) + 1) * p)

    def step(self) -> bool:
        """Launch one batch and read the previous one's results; False when there is
        nothing left to do (every result read). With a constrained request running, the step
        in flight is read first: its grammar needs its whole output
        (:func:`~unimem.engine.adjustments.needs_exact_history`); penalties read what the
        step in flight committed on the device (the runner's ``in_flight``)."""
        if self._extras:  # the runner looks for extras only while a request has some
            self._extras = [r for r in self._extras if r.status is not RequestStatus.FINISHED]
            self.runner.extras_live = bool(self._extras)
        if self._pending is not None and any(
            r.status is RequestStatus.RUNNING and needs_exact_history(r) for r in self._extras
        ):
            self.drain()
        batch = self.scheduler.next_batch(drain=self.drain)
        if batch is None:  # next_batch drained the pipeline before giving up
            return False
        in_flight = self._pending[0] if self._pending is not None else None
        bs = self.runner.launch(batch, in_flight)
        self.scheduler.launched(batch)
        staged = self.results.stage(self.runner.out, bs)
        previous, self._pending = self._pending, (batch, staged)
        if previous is not None:
            self._account(*previous)
        self.steps += 1
        return True

    def drain(self) -> bool:
        """Read the in-flight step's results, if any (waits for that step); whether there
        were any. ``step`` does this itself when it must; callers that drive the scheduler
        directly use it to account the last launched step."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        self._account(*pending)
        return True

    def _account(self, batch: Batch, staged: StagedResult) -> None:
        tokens, counts, logprobs = staged.read()
        if batch.prompt_logprobs is not None:  # before complete(): it may finish requests
            batch.prompt_logprobs.apply(batch.reqs, batch.epochs)
        tops = batch.top_logprobs.read() if batch.top_logprobs is not None else None
        if batch.mode is ForwardMode.VERIFY:
            committed = [row[:c] for row, c in zip(tokens, counts, strict=True)]
            lps = None
            if logprobs is not None:
                lps = [row[:c] for row, c in zip(logprobs, counts, strict=True)]
            lens = staged.verify_lens.tolist() if staged.verify_lens is not None else None
            self.scheduler.complete_verify(batch, committed, lps, lens, tops)
        else:
            lps = None if logprobs is None else [row[0] for row in logprobs]
            self.scheduler.complete(batch, [row[0] for row in tokens], lps, tops)

    def run(self, on_step: Callable[[EngineCore], None] | None = None) -> list[Request]:
        """Step until every submitted request finished; returns them in finishing order."""
        while self.step():
            if on_step is not None:
                on_step(self)
        return self.scheduler.finished
