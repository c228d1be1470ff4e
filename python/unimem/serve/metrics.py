"""``GET /metrics``: Prometheus metrics (``prometheus-client``), named ``unimem:*`` as SGLang
names its ``sglang:*``.

Gauges and totals come from the engine thread's snapshot at scrape time
(:meth:`~unimem.serve.engine_loop.EngineLoop.snapshot`): running and queued requests, tokens
in use per kind (FULL / SWA pages as tokens, STATE as slots), arena occupancy and bytes,
compactions, retractions, prefix-cache hit rate (and, with the cache on, the tokens and
checkpoints it holds and its evictions), with ``--enable-prefill-delayer`` its held passes
and ended episodes by outcome, speculative accept length, prompt and
generation tokens (totals and throughput over the last seconds). Histograms are observed by
the engine thread as tokens come out: time to first token (from the HTTP request's arrival),
inter-token latency (per token: the gap between two deliveries over the tokens delivered),
end-to-end request latency. Finished requests are counted by the finish reason their
responses report (a stop string is "stop", not the abort that ends it in the engine).

The histograms are :class:`StepHistogram`: plain counters the engine thread adds to (every
step observes every streaming request; ``prometheus_client.Histogram`` took ~2.5 µs an
observation under its lock, ~160 µs of the engine thread a step at 64 streams on a 2-core
CPU), exposed at scrape time in the same text format.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["CONTENT_TYPE", "ServerMetrics", "StepHistogram"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class StepHistogram:
    """A Prometheus histogram for one writer thread: :meth:`observe` adds to plain counters
    (no lock: one thread writes; a scrape may read an observation half-added, which the next
    scrape shows whole — every count only grows), :meth:`collect` yields it in the text
    format of ``prometheus_client.Histogram`` (``_bucket`` with ``le`` cumulative, ``_sum``,
    ``_count``). ``buckets``: increasing upper bounds; ``+Inf`` is added."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: Sequence[float],
    ) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"{name}: buckets must be non-empty and increasing, got {buckets}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self.label_names = list(labels)
        self.label_values = list(labels.values())
        self.bounds = bounds
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value`` (in O(1), whatever ``n``)."""
        self._counts[bisect.bisect_left(self.bounds, value)] += n
        self._sum += value * n

    def collect(self):
        counts, total = list(self._counts), self._sum  # each read whole (the GIL)
        cumulative, acc = [], 0
        for bound, n in zip(self.bounds, counts, strict=True):
            acc += n
            cumulative.append((_le(bound), acc))
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        family.add_metric(self.label_values, cumulative, total)
        yield family


def _le(bound: float) -> str:
    """An ``le`` label as prometheus_client writes it ("0.005", "1.0", "+Inf")."""
    return "+Inf" if bound == math.inf else repr(float(bound))


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict], labels: dict[str, str]) -> None:
        self.snapshot = snapshot
        self.label_names = list(labels)
        self.label_values = list(labels.values())

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.label_names)
        g.add_metric(self.label_values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.label_names)
        c.add_metric(self.label_values, value)
        return c

    def collect(self):
        s = self.snapshot()
        g, c = self._gauge, self._counter
        yield g("unimem:num_running_reqs", "Requests running.", s["running_requests"])
        yield g("unimem:num_queue_reqs", "Requests waiting for admission.", s["queued_requests"])
        tokens = GaugeMetricFamily(
            "unimem:tokens_in_use",
            "Memory in use per kind: FULL and SWA pages (as tokens), STATE slots.",
            labels=[*self.label_names, "kind"],
        )
        for kind, n in s["tokens_in_use"].items():
            tokens.add_metric([*self.label_values, kind], n)
        yield tokens
        cap = s["capacity_bytes"]
        yield g("unimem:memory_used_bytes", "Bytes of KV pages and state in use.", s["used_bytes"])
        yield g("unimem:memory_capacity_bytes", "Bytes of the arena / static pools.", cap)
        yield g(
            "unimem:arena_occupancy",
            "Used over capacity bytes.",
            s["used_bytes"] / cap if cap else 0.0,
        )
        yield c("unimem:compactions", "Arena compactions.", s["compactions"])
        yield c("unimem:retractions", "Running requests retracted for memory.", s["retractions"])
        prompt = s["prompt_tokens_total"]
        yield c("unimem:prompt_tokens", "Prompt tokens admitted.", prompt)
        yield c(
            "unimem:generation_tokens", "Output tokens generated.", s["generation_tokens_total"]
        )
        yield c(
            "unimem:cached_tokens",
            "Prompt tokens served from the prefix cache.",
            s["cached_tokens_total"],
        )
        yield g(
            "unimem:cache_hit_rate",
            "Cached over prompt tokens of finished requests.",
            s["cached_tokens_total"] / prompt if prompt else 0.0,
        )
        cache = s.get("prefix_cache")
        if cache is not None:
            yield g(
                "unimem:prefix_cache_tokens",
                "Tokens whose pages the prefix cache holds.",
                cache["cached_tokens"],
            )
            yield g(
                "unimem:prefix_cache_checkpoints",
                "Recurrent-state checkpoints the prefix cache holds.",
                cache["checkpoints"],
            )
            yield c(
                "unimem:prefix_cache_evictions",
                "Prefix-cache entries evicted for memory.",
                cache["evictions"],
            )
        delayer = s.get("prefill_delayer")
        if delayer is not None:
            yield c(
                "unimem:prefill_delayer_held_passes",
                "Forward passes that admitted nothing while a saturated batch decoded.",
                delayer["held_passes"],
            )
            episodes = CounterMetricFamily(
                "unimem:prefill_delayer_episodes",
                "Ended runs of held passes, by what ended them.",
                labels=[*self.label_names, "outcome"],
            )
            for outcome, n in delayer["outcomes"].items():
                episodes.add_metric([*self.label_values, outcome], n)
            yield episodes
        finished = CounterMetricFamily(
            "unimem:requests_finished",
            "Finished requests by the finish reason their responses report.",
            labels=[*self.label_names, "finish_reason"],
        )
        for reason, n in sorted(s["requests_finished"].items()):
            finished.add_metric([*self.label_values, reason], n)
        yield finished
        t = s["engine_time"]
        yield c(
            "unimem:engine_iterations",
            "Working iterations of the engine thread (inbox, one step, its deltas).",
            t["iterations"],
        )
        yield c(
            "unimem:engine_iteration_seconds",
            "Wall time of the engine thread's working iterations.",
            t["iteration_seconds"],
        )
        yield c(
            "unimem:engine_step_seconds",
            "Wall time inside the engine's steps (GPU waits and GIL waits included).",
            t["step_seconds"],
        )
        yield c(
            "unimem:engine_step_cpu_seconds",
            "CPU time of the engine thread inside its steps.",
            t["step_cpu_seconds"],
        )
        steps = s["spec_verify_steps_total"]
        yield g(
            "unimem:spec_accept_length",
            "Tokens committed per verify step (DSPARK).",
            s["spec_verified_tokens_total"] / steps if steps else 0.0,
        )
        yield g(
            "unimem:prompt_throughput", "Prompt tokens per second (recent).", s["prompt_throughput"]
        )
        yield g(
            "unimem:gen_throughput",
            "Generated tokens per second (recent).",
            s["generation_throughput"],
        )


class ServerMetrics:
    """A private registry (several servers may live in one process, in tests) with the
    histograms the engine thread observes (module docstring) and the snapshot gauges.
    ``labels``: constant labels on every metric (``model_name``)."""

    def __init__(self, snapshot: Callable[[], dict], labels: dict[str, str]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._ttft = StepHistogram(
            "unimem:time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            labels,
            TTFT_BUCKETS,
        )
        self._itl = StepHistogram(
            "unimem:inter_token_latency_seconds",
            "Time between output tokens, per token.",
            labels,
            ITL_BUCKETS,
        )
        self._e2e = StepHistogram(
            "unimem:e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            labels,
            E2E_BUCKETS,
        )
        for h in (self._ttft, self._itl, self._e2e):
            r.register(h)
        r.register(_SnapshotCollector(snapshot, labels))

    # called by the engine thread only (StepHistogram: one writer)
    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, seconds: float, n: int) -> None:
        self._itl.observe(seconds, n)

    def finished(self, reason: str, seconds: float) -> None:
        self._e2e.observe(seconds)  # by reason: the snapshot's counts

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
