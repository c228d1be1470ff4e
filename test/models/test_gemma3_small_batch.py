"""Gemma 3's small-batch layer body (``Gemma3DecoderLayer.forward_small``: norms, projections
and GeGLU in ``unimem_kernel.norm_linear`` launches) against the layer-by-layer body, both on
the Triton kernels (the CPU interpreter), on a tiny random checkpoint in float32.

The two bodies do the same math with the same roundings in other launches: logits agree to
1e-5 (relative, normwise), and the drafter's hidden capture sees every layer's stream once,
with the same values, though the small body materialises a layer's stream in the next
layer's first launch. Larger steps, deterministic mode and ``UNIMEM_NORM_LINEAR_ROWS=0`` keep
the layer-by-layer body.
"""

from __future__ import annotations

import copy

import pytest
import tiny_gemma3
import torch

import unimem_kernel.norm_gemv as norm_gemv
from unimem.models import batch_invariant
from unimem.models.forward_context import DenseCache, DenseContext
from unimem.models.loader import load_model


class Recording(DenseContext):
    """A dense context that keeps what ``capture_hidden`` is given, by layer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hidden: dict[int, torch.Tensor] = {}

    def capture_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        assert layer_idx not in self.hidden, f"layer {layer_idx} captured twice"
        self.hidden[layer_idx] = hidden.clone()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma_small")
    tiny_gemma3.build(path, num_hidden_layers=3, sliding_window_pattern=3, vocab_size=96)
    return load_model(path, dtype=torch.float32)


def _extend(model, prompts):
    """A cache holding ``prompts`` but their last tokens (one extend step: more rows than the
    small body takes, the layer-by-layer body whatever the limit) and its slots."""
    cache = DenseCache(model.config, max_requests=len(prompts))
    slots = [cache.alloc() for _ in prompts]
    ids = torch.cat([p[:-1] for p in prompts])
    model(ids, DenseContext(cache, slots, [len(p) - 1 for p in prompts], "extend"))
    return cache, slots


def _decode(model, extended, prompts, rows_limit, monkeypatch):
    """Decode one token each from a copy of the ``extended`` cache; the decode step's logits
    and capture."""
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", str(rows_limit))
    cache, slots = copy.deepcopy(extended)
    ctx = Recording(cache, slots, [1] * len(prompts), "decode")
    logits = model(torch.stack([p[-1] for p in prompts]), ctx)
    return logits, ctx.hidden


def test_small_body_equals_layer_body(model, monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=gen) for n in (6, 11, 9)]
    calls = []
    real = norm_gemv.norm_linear_triton

    def spy(*args, **kwargs):
        calls.append(kwargs.get("act"))
        return real(*args, **kwargs)

    monkeypatch.setattr(norm_gemv, "norm_linear_triton", spy)
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", "16")
    assert model.takes_norm_linear(torch.zeros(len(prompts), model.config.d_model))
    extended = _extend(model, prompts)  # both bodies decode from the same cache
    assert calls == []
    small, small_hidden = _decode(model, extended, prompts, 16, monkeypatch)
    n_layers = len(model.model.layers)
    # per layer: q/k/v with its norms, o_proj, gate/up with GeGLU, down
    assert len(calls) == 4 * n_layers and calls.count("gelu_tanh") == n_layers
    calls.clear()
    layered, layered_hidden = _decode(model, extended, prompts, 0, monkeypatch)
    assert calls == []
    err = ((small - layered).norm() / layered.norm()).item()
    assert err <= 1e-5, err
    assert sorted(small_hidden) == sorted(layered_hidden) == list(range(n_layers))
    for i in range(n_layers):
        h_err = ((small_hidden[i] - layered_hidden[i]).norm() / layered_hidden[i].norm()).item()
        assert h_err <= 1e-5, (i, h_err)


def test_when_the_small_body_runs(model, monkeypatch):
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    x = torch.zeros(16, model.config.d_model)
    assert model.takes_norm_linear(x[:1])  # by default: one-row steps only
    assert not model.takes_norm_linear(x[:2])
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", "16")
    assert model.takes_norm_linear(x)
    assert not model.takes_norm_linear(torch.zeros(17, model.config.d_model))
    monkeypatch.setenv("UNIMEM_NORM_LINEAR_ROWS", "0")
    assert not model.takes_norm_linear(x[:1])
    monkeypatch.delenv("UNIMEM_NORM_LINEAR_ROWS")
    with batch_invariant.use_batch_invariant(device_types=("CPU",)):
        assert not model.takes_norm_linear(x[:1])
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "reference")
    assert not model.takes_norm_linear(x[:1])
