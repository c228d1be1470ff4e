"""What the engine asks of a model: :class:`CausalLM`.

A model is an ``nn.Module`` that never sees pages. For each batch it gets token ids and a
:class:`~unimem.models.forward_context.ForwardContext` (positions, rows that need logits, and
the two memory-touching operations: paged attention and the GDN conv + delta rule), and
returns logits and the final hidden states of the rows the context asks for. Its shape, as far
as the memory, the scheduler and the drafter care, is a :class:`~unimem.models.config.
HybridConfig` (``model.config``), from which :func:`~unimem.models.config.memory_spec` derives
the memory layout: the memory layer stays model-agnostic.

Contract every implementation keeps:

* inference only: parameters do not require grad and ``forward_with_hidden`` runs under
  ``torch.no_grad``;
* attention layers call ``ctx.rope_attention(i, q, k, v, cos, sin, sinks=...)`` (RoPE
  applied by the context, in the K/V store's pass where it pages K/V) or
  ``ctx.attention(i, q, k, v, sinks=...)`` with RoPE already applied; GDN layers call
  ``ctx.gdn(i, mixed_qkv, g, beta, conv_weight=...)``; each exactly once per layer in layer
  order, then ``ctx.capture_hidden(i, x)`` with the residual stream;
* logits are float32 (float64 for a float64 model); ``hidden`` is what the LM head reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from unimem.models.config import HybridConfig
from unimem.models.forward_context import ForwardContext, WholeSequenceContext
from unimem.models.tensor_parallel import SINGLE, Shard, TensorParallel, parallel_logits


class ModelOutput(NamedTuple):
    """Result of :meth:`CausalLM.forward_with_hidden`: ``hidden [N, d_model]``, the
    final-normed hidden states the LM head reads (``config.dtype``), of the rows
    ``ctx.logits_indices``, and ``logits [M, vocab]`` (float32, or float64 for float64
    models) of those of them that ``ctx.head_indices`` picks (all: ``M == N``); None where
    ``ctx.run_head`` is False."""

    logits: torch.Tensor | None
    hidden: torch.Tensor


class CausalLM(nn.Module, ABC):
    """A causal language model over a :class:`ForwardContext` (module docstring).

    ``config``: the model's shape for the engine. ``embed_weight`` / ``lm_head_weight``
    (``[vocab, d_model]``) are shared with a DSPARK drafter, which embeds its anchor with the
    former and computes its base logits with the latter.

    ``tp``: the model's tensor-parallel rank (:mod:`unimem.models.tensor_parallel`). On a
    rank of a group of more than one, ``config`` is the rank's (its heads),
    ``embed_weight`` / ``lm_head_weight`` are its vocabulary rows
    (``tp.vocab_part(vocab)``), and logits are still full rows.
    """

    config: HybridConfig
    tp: TensorParallel = SINGLE

    ignored_checkpoint_prefixes: tuple[str, ...] = ()
    """Checkpoint tensor-name prefixes the loader skips (e.g. multi-token-prediction heads)."""

    @classmethod
    def from_hf_config(
        cls,
        hf_config,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_context: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> CausalLM:
        """The architecture for a ``transformers`` config, with uninitialised parameters of
        ``dtype`` on ``device`` (``max_context`` overrides the config's context length),
        holding rank ``tp``'s shard. ``ValueError`` naming the field for a configuration it
        does not implement (or a head count ``tp.size`` does not divide)."""
        raise TypeError(f"{cls.__name__} is not built from HuggingFace configs")

    def checkpoint_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """The part of checkpoint tensor ``name`` (full ``shape``) this rank loads, None for
        the whole tensor (replicated, or an unsharded model). The loader reads only that
        part (``safe_open(...).get_slice``) and hands it to :meth:`load_weights`."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors ``(name, tensor)`` into the parameters (re-laying out
        those the architecture stores differently) and return the names of the parameters
        filled. ``ValueError`` naming the tensor for an unknown name or a wrong shape."""
        raise TypeError(f"{type(self).__name__} does not load HuggingFace checkpoints")

    @abstractmethod
    def forward_with_hidden(self, input_ids: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """Run one batch: ``input_ids [T]`` (int, rows laid out as ``ctx`` says) through every
        layer, calling ``ctx`` for all memory access. Returns the final-normed hidden states
        of the rows ``ctx.logits_indices`` and the logits (:meth:`head_logits`) of
        ``ctx.head_rows`` of them, in that order."""

    @property
    @abstractmethod
    def embed_weight(self) -> torch.Tensor:
        """The input embedding table ``[vocab, d_model]`` (before any scaling the model
        applies)."""

    @property
    @abstractmethod
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head ``[vocab, d_model]`` (the embedding table when tied)."""

    def output(self, hidden: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """What :meth:`forward_with_hidden` returns for the final-normed ``hidden`` rows:
        their logits (those ``ctx.head_indices`` picks) unless ``ctx.run_head`` is False."""
        logits = self.head_logits(ctx.head_rows(hidden)) if ctx.run_head else None
        return ModelOutput(logits, hidden)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: ``logits [N, vocab]`` (float32, or float64 for a float64 model) of
        final-normed ``hidden [N, d_model]`` — full vocabulary rows on every tensor-parallel
        rank. A model whose head does more (Gemma's logit soft-capping) overrides it."""
        c = self.config
        return parallel_logits(
            hidden, self.lm_head_weight, self.tp, c.vocab_size, logits_dtype(c.dtype)
        )

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``logits [len(ctx.logits_indices), vocab]``; see :meth:`forward_with_hidden`."""
        return self.forward_with_hidden(input_ids, ctx).logits

    @torch.no_grad()
    def reference_forward(self, input_ids_per_request: list[torch.Tensor]) -> list[torch.Tensor]:
        """The dense oracle: each request's whole sequence run alone from an empty cache
        (:class:`WholeSequenceContext`: one masked softmax per attention layer, an unfolded
        conv and the token-by-token delta rule per GDN layer). Returns ``logits [L_i,
        vocab]`` for every position."""
        out = []
        for ids in input_ids_per_request:
            ctx = WholeSequenceContext(self.config, int(ids.shape[0]), self.device)
            out.append(self.forward(ids.to(self.device), ctx))
        return out


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits are returned in for a model computing in ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32
