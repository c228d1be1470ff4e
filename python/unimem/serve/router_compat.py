"""What SGLang's router (``sglang-router`` / ``smg``) asks of a worker, beyond the OpenAI and
native generation routes.

When it adds a worker the router calls ``GET /health``, then ``GET /server_info`` and
``GET /model_info`` (falling back to ``/get_server_info`` and ``/get_model_info``; every
field it reads is optional): from ``/server_info`` it reads ``model_path``,
``served_model_name``, ``dp_size`` (only with ``--dp-aware``), ``version``,
``max_total_tokens``, ``max_running_requests``; from ``/model_info`` ``model_path``,
``tokenizer_path``, ``is_generation``, ``model_type``, ``architectures``. It polls
``GET /health`` for its health check, fans ``POST /flush_cache`` and ``GET /metrics`` out to
every worker, and for the ``power_of_two`` policy (and its own ``/get_loads``) reads
``GET /get_load``: a list with one object per data-parallel rank, of which it sums
``num_tokens``.

This module builds the two info bodies (the native ``/get_*`` routes answer the same),
``/server_info``, ``/model_info``, ``/get_load``, ``/v1/loads`` (the same rank objects under
``loads``, with the pool's capacity) and the Prometheus gauges under SGLang's names
(``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``,
``sglang:token_usage``, ``sglang:cache_hit_rate``, ``sglang:gen_throughput``), which routers
and dashboards written for SGLang scrape.

Load, as SGLang counts it: ``num_reqs`` running plus queued requests, ``num_waiting_reqs``
queued ones, ``num_tokens`` the KV tokens in use (FULL-attention pages in use times the page
size: what the prefix cache holds included), ``token_usage`` that over
``max_total_num_tokens``.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib import metadata

from fastapi import APIRouter
from prometheus_client.core import GaugeMetricFamily

from unimem.models.fp8_linear import weight_bytes
from unimem.serve.generation import Serving

__all__ = ["SGLangGauges", "load_entry", "model_info", "router_compat_router", "server_info"]


def _version() -> str:
    try:
        return metadata.version("unimem")
    except metadata.PackageNotFoundError:
        return "unknown"


def server_info(serving: Serving) -> dict:
    """``/server_info`` (= ``/get_server_info``): the router's fields at the top level (as
    SGLang flattens its server arguments), the server arguments under ``server_args``, the
    capacity, and the engine thread's snapshot (memory, queues, the prefix cache)."""
    e = serving.engine
    opts = {k: v for k, v in asdict(serving.options).items() if k != "api_key"}
    return {
        "model_path": e.args.model_path,
        "served_model_name": serving.options.served_model_name,
        "tokenizer_path": e.args.tokenizer_path or e.args.model_path,
        "version": _version(),
        "tp_size": e.args.tp_size,
        "dp_size": 1,
        "max_total_tokens": e.max_total_num_tokens,
        "server_args": {**asdict(e.args), **opts},
        "max_total_num_tokens": e.max_total_num_tokens,
        "max_running_requests": e.max_running_requests,
        "context_length": e.context_length,
        "page_size": e.pool.page_size,
        "enable_unified_memory": e.args.enable_unified_memory,
        "attention_backend": e.backend_name,
        "cuda_graphs": e.cuda_graphs,
        "weight_bytes": weight_bytes(e.model),
        # the drafter checkpoint DSPARK runs (given or shipped); None: no speculation, or
        # the seeded untrained drafter
        "drafter_path": e.drafter_path,
        # seconds of each start-up phase (Engine.startup_seconds; the warm-up's included)
        "startup_seconds": dict(e.startup_seconds),
        **serving.loop.snapshot(),
    }


def model_info(serving: Serving) -> dict:
    """``/model_info`` (= ``/get_model_info``)."""
    args = serving.engine.args
    hf = getattr(getattr(serving.engine, "checkpoint", None), "hf_config", None)
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "served_model_name": serving.options.served_model_name,
        "is_generation": True,
        "model_type": getattr(hf, "model_type", None),
        "architectures": list(getattr(hf, "architectures", None) or []),
        "context_length": serving.context_length,
        "vocab_size": serving.vocab_size,
    }


def load_entry(serving: Serving) -> dict:
    """This server's load as one data-parallel rank (module docstring)."""
    snap = serving.loop.snapshot()
    running = snap.get("running_requests", 0)
    waiting = snap.get("queued_requests", 0)
    tokens = int(snap.get("tokens_in_use", {}).get("full", 0))
    total = serving.engine.max_total_num_tokens
    return {
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_tokens": tokens,
        "max_total_num_tokens": total,
        "token_usage": tokens / total if total else 0.0,
    }


def router_compat_router(serving: Serving) -> APIRouter:
    """``/server_info``, ``/model_info``, ``/get_load``, ``/v1/loads``."""
    router = APIRouter()

    @router.get("/server_info")
    async def get_server_info_new():
        return server_info(serving)

    @router.get("/model_info")
    async def get_model_info_new():
        return model_info(serving)

    @router.get("/get_load")
    async def get_load():
        return [load_entry(serving)]

    @router.get("/v1/loads")
    async def v1_loads():
        return {"object": "list", "dp_size": 1, "loads": [load_entry(serving)]}

    return router


class SGLangGauges:
    """A Prometheus collector of SGLang's load gauges over ``serving`` (module docstring),
    labelled like the ``unimem:*`` metrics."""

    def __init__(self, serving: Serving, labels: dict[str, str]) -> None:
        self.serving = serving
        self.labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), float(value))
        return g

    def collect(self):
        load = load_entry(self.serving)
        snap = self.serving.loop.snapshot()
        cache = snap.get("prefix_cache") or {}
        yield self._gauge("sglang:num_running_reqs", "Running requests", load["num_running_reqs"])
        yield self._gauge("sglang:num_queue_reqs", "Queued requests", load["num_waiting_reqs"])
        yield self._gauge("sglang:num_used_tokens", "KV tokens in use", load["num_tokens"])
        yield self._gauge("sglang:token_usage", "Share of KV tokens in use", load["token_usage"])
        yield self._gauge(
            "sglang:cache_hit_rate", "Prefix-cache hit rate", cache.get("hit_rate", 0.0) or 0.0
        )
        yield self._gauge(
            "sglang:gen_throughput",
            "Generation throughput (tokens/s)",
            snap.get("generation_throughput", 0.0),
        )
