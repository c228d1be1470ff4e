"""The server's histograms (:class:`unimem.serve.metrics.StepHistogram`, one writer, plain
counters) expose what ``prometheus_client.Histogram`` does for the same observations: the
same bucket counts (values on a bound counted in it), sum and count, in the same text
format; ``n`` observations at once equal ``n`` single ones."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from unimem.serve.metrics import ITL_BUCKETS, StepHistogram

NAME = "unimem:inter_token_latency_seconds"


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_same_exposition_as_prometheus_client():
    rng = random.Random(7)
    values = [rng.choice(ITL_BUCKETS) for _ in range(50)]  # on the bounds
    values += [rng.uniform(0, 3.0) for _ in range(500)] + [7.5, 0.0]
    ref_reg, ours_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram(NAME, "doc", ["model_name"], registry=ref_reg, buckets=ITL_BUCKETS)
    ours = StepHistogram(NAME, "doc", {"model_name": "m"}, ITL_BUCKETS)
    ours_reg.register(ours)
    for v in values:
        n = rng.randint(1, 4)
        for _ in range(n):
            ref.labels("m").observe(v)
        ours.observe(v, n)
    want, got = _samples(ref_reg), _samples(ours_reg)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got[(NAME + "_count", (("model_name", "m"),))] > len(values)


def test_bad_buckets_are_refused():
    with pytest.raises(ValueError, match="increasing"):
        StepHistogram(NAME, "doc", {}, (0.1, 0.1))
    with pytest.raises(ValueError, match="non-empty"):
        StepHistogram(NAME, "doc", {}, ())
