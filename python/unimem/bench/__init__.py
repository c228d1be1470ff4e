"""Measurements a user runs: ``python -m unimem bench [SUITE] [FLAGS]`` (``--help`` per suite).

Every suite is one module here with a ``main(argv) -> int`` (exit status: 0 done, 1 a check
failed, 2 a usage error or a missing device); every timing goes through :mod:`.timing`. The
suite ``e2e`` (the default when no suite is named) is the validation protocol at serving
sizes, whose flags ``python -m unimem validate`` shares, so ``unimem.__main__`` parses it.
GPU-only suites end with one line and status 2 on a machine without CUDA, or run their CPU
variant where they have one (named in their help). Kernel micro-benchmarks live beside the
kernels (``sgl-kernel/benchmark/``), device drivers in ``tools/device/``.

This package sits above ``unimem.serve`` in the layering: a suite may use any layer below.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

__all__ = ["DEFAULT_SUITE", "SUITES", "run_suite"]

DEFAULT_SUITE = "e2e"

SUITES: dict[str, tuple[str | None, str]] = {
    # name: (module under unimem.bench, or None for the e2e suite that __main__ parses; help)
    "e2e": (None, "static vs unified throughput of the validation protocol (the default)"),
    "serving": ("serving", "the HTTP server under a load generator (GuideLLM), static vs unified"),
    "capacity": ("capacity", "requests resident at once in one byte budget, static vs unified"),
    "prefix": ("prefix", "prefix cache on a shared-prefix workload: hit rate and throughput"),
    "router": ("router", "prefix-cache locality of two servers behind SGLang's router"),
    "step-profile": (
        "step_profile",
        "where a step's time goes: the small preset or --model-path (GPU; --host-only on CPU)",
    ),
    "prefill": ("prefill", "time to first token of long prompts: recurrent GDN vs fla (GPU)"),
    "allocator": ("allocator", "launches, device and host time of the allocator's operations"),
    "decode-floor": ("decode_floor", "a decode step against its floor and llama.cpp (GPU)"),
    "sampler": ("sampler", "the sampler's filters with a bounded top-k vs the whole-row sort"),
}


def run_suite(name: str, argv: Sequence[str]) -> int:
    """Run suite ``name`` (not ``e2e``) on its command-line flags ``argv``; its exit status."""
    module, _ = SUITES[name]
    if module is None:
        raise ValueError(f"suite {name!r} is parsed by python -m unimem itself")
    main = importlib.import_module(f"unimem.bench.{module}").main
    status = main(list(argv))
    return 0 if status is None else int(status)
