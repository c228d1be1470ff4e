"""The synthetic hybrid model: FULL / SWA attention and Gated DeltaNet layers built from a
seed (the presets of :mod:`unimem.models.presets`), for memory stress tests and benchmarks.

``HybridModel(config, seed)`` is a :class:`~unimem.models.base.CausalLM`, memory-agnostic:
:meth:`HybridModel.forward` takes the
batch's token ids and a :class:`~unimem.models.forward_context.ForwardContext`, and every
access to K/V or recurrent state goes through that context.

Architecture (pre-norm residual stack)::

    x = embed[ids]
    for each layer i:   x = x + mixer_i(rmsnorm(x));  x = x + swiglu_mlp(rmsnorm(x))
    logits = lm_head(rmsnorm(x[logits_indices]))          # untied LM head

* attention mixer (``full`` / ``swa``): fused q/k/v projection, RoPE (rotate-half, over the
  whole K head dim) on q and k, ``ctx.attention``, output projection from
  ``n_q_heads * head_dim_v``.
* GDN mixer (Qwen3-Next style): ``in_proj`` to ``[mixed_qkv | z | b | a]``;
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (both in
  ``config.state_dtype``); ``ctx.gdn`` (conv, SiLU, L2-norm, delta rule); gated RMSNorm
  ``rmsnorm(o) * w * silu(z)`` per head; ``out_proj``.

Weights are drawn from per-tensor ``torch.Generator``\\ s seeded by ``(seed, tensor name)``, in
float32 on the CPU, then cast to ``config.dtype`` and moved: the same seed gives the same
weights on every device and regardless of construction order. Scales keep activations O(1)
and give logits of standard deviation ~1, so greedy top-2 gaps are typically ~0.1-1, far
above float64 rounding.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from unimem.models import fp8_linear
from unimem.models.base import CausalLM, ModelOutput
from unimem.models.config import HybridConfig
from unimem.models.forward_context import ForwardContext
from unimem.models.nn_ops import frozen_param, rms_norm, small_step
from unimem.models.tensor_parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    gdn_qkv_ranges,
    heads,
    local_config,
    parallel_embedding,
    shard,
    vocab_shard,
)
from unimem_kernel import add_rms_norm, envs, gated_rms_norm, gdn_gates, norm_linear, silu_mul
from unimem_kernel.rope_angles import rope_cos_sin


class AttentionMixer(nn.Module):
    """FULL or SWA attention of one layer (the window is applied by the context); ``c`` is
    the rank's config (its heads), ``o_proj`` row-parallel."""

    def __init__(self, c: HybridConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.c = c
        self.tp = tp
        self.q_dim = c.n_q_heads * c.head_dim_k
        self.k_dim = c.n_kv_heads * c.head_dim_k
        self.v_dim = c.n_kv_heads * c.head_dim_v
        self.qkv_proj = frozen_param(self.q_dim + self.k_dim + self.v_dim, c.d_model)
        self.o_proj = frozen_param(c.d_model, c.n_q_heads * c.head_dim_v)

    def forward(
        self,
        layer_idx: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        c, t = self.c, h.shape[0]
        qkv = fp8_linear.linear(h, self, "qkv_proj")
        q, k, v = qkv.split([self.q_dim, self.k_dim, self.v_dim], dim=-1)
        q = q.reshape(t, c.n_q_heads, c.head_dim_k)
        k = k.reshape(t, c.n_kv_heads, c.head_dim_k)
        v = v.reshape(t, c.n_kv_heads, c.head_dim_v)  # strided views of the projection
        o = ctx.rope_attention(layer_idx, q, k, v, *rope)  # RoPE + K/V store in one pass
        o = o.reshape(t, c.n_q_heads * c.head_dim_v)
        return fp8_linear.row_parallel(o, self, None, self.tp, "o_proj")


class GdnMixer(nn.Module):
    """Gated DeltaNet mixer of one layer (Qwen3-Next style, one head count for q, k, v);
    ``c`` is the rank's config (its heads), ``out_proj`` row-parallel."""

    def __init__(self, c: HybridConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.c = c
        self.tp = tp
        h, dv = c.gdn_heads, c.gdn_head_dim_v
        self.split = [c.gdn_conv_dim, h * dv, h, h]  # mixed_qkv | z | b | a
        self.in_proj = frozen_param(sum(self.split), c.d_model)
        self.conv_weight = frozen_param(c.gdn_conv_dim, c.conv_kernel)
        self.A_log = frozen_param(h)
        self.dt_bias = frozen_param(h)
        self.norm = frozen_param(dv)
        self.out_proj = frozen_param(c.d_model, h * dv)

    def forward(self, layer_idx: int, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c, t = self.c, h.shape[0]
        sdt = c.state_dtype
        mixed_qkv, z, b, a = fp8_linear.linear(h, self, "in_proj").split(self.split, dim=-1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias, sdt)
        # a column view of the projection: the GDN kernels read rows through its stride
        o = ctx.gdn(layer_idx, mixed_qkv, g, beta, conv_weight=self.conv_weight)
        z = z.reshape(t, c.gdn_heads, c.gdn_head_dim_v)
        if o.dtype == h.dtype == z.dtype:  # one fused pass (rms_norm(o, w) * silu(z))
            gated = gated_rms_norm(o, self.norm, z, c.rms_eps)
        else:
            acc = torch.float64 if o.dtype == torch.float64 else torch.float32
            gated = rms_norm(o, self.norm, c.rms_eps).to(acc) * F.silu(z.to(acc))
            gated = gated.to(h.dtype).reshape(t, -1)
        return fp8_linear.row_parallel(gated, self, None, self.tp, "out_proj")


class Mlp(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with a fused gate/up projection (the rank's
    ``c.ffn_dim`` columns; ``down`` row-parallel)."""

    def __init__(self, c: HybridConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.ffn_dim = c.ffn_dim
        self.gate_up = frozen_param(2 * c.ffn_dim, c.d_model)
        self.down = frozen_param(c.d_model, c.ffn_dim)
        # routes the down projection through cuBLASLt (row_parallel_linear_lt); not a weight
        self.register_buffer("down_zero", torch.zeros(c.d_model, dtype=c.dtype), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up over the fused [gate | up] projection, one pass
        act = silu_mul(fp8_linear.linear(h, self, "gate_up"))
        return fp8_linear.row_parallel(act, self, self.down_zero, self.tp, "down")

    def forward_small(
        self, x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A small step (:meth:`takes_norm_linear`): the residual add ``x + delta``, the
        pre-norm, gate/up and SwiGLU in one :func:`unimem_kernel.norm_linear` launch, down in
        another; returns ``(x + delta, mlp output)``, rounded as ``add_rms_norm`` then
        :meth:`forward` round them."""
        x, act = norm_linear(x, self.gate_up, norm_weight, eps, delta=delta, act="silu")
        if envs.get("UNIMEM_NORM_LINEAR_PLAIN"):
            return x, norm_linear(act, self.down, None, eps)[1]
        return x, fp8_linear.row_parallel(act, self, self.down_zero, self.tp, "down")

    def takes_norm_linear(self, h: torch.Tensor) -> bool:
        """Whether a step of ``h [T, d]`` runs :meth:`forward_small` (the add, the norm, the
        projection and SwiGLU in one :func:`unimem_kernel.norm_linear` launch; the down
        projection plain with ``UNIMEM_NORM_LINEAR_PLAIN``): at most
        ``UNIMEM_NORM_LINEAR_ROWS`` rows, the fused kernels on, 16/32-bit weights (not FP8),
        one rank, not batch-invariant mode (whose GEMMs round as the larger batches do). The
        roundings are those of the chain it replaces (``add_rms_norm``, the projection,
        ``silu_mul``); the summation order differs."""
        return (
            small_step(h, self.tp.size)
            and not fp8_linear.is_fp8(self, "gate_up")
            and not fp8_linear.is_fp8(self, "down")
        )


class HybridLayer(nn.Module):
    """One pre-norm block: mixer (attention or GDN) then SwiGLU MLP, each with a residual.

    Each residual add is fused with the RMS norm that follows it (:func:`add_rms_norm`): the
    layer takes the residual stream ``x`` with its mixer input ``h = rmsnorm(x, mixer_norm)``
    already computed (by the previous layer's last add, or the model for layer 0) and returns
    the new stream with the next layer's normed input (``next_norm``; None for the last layer,
    whose output goes to the final norm of the logits rows only)."""

    def __init__(self, c: HybridConfig, kind: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.c = c
        self.kind = kind
        self.mixer_norm = frozen_param(c.d_model)
        self.mlp_norm = frozen_param(c.d_model)
        self.mixer = GdnMixer(c, tp) if kind == "gdn" else AttentionMixer(c, tp)
        self.mlp = Mlp(c, tp)

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
        next_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        eps = self.c.rms_eps
        if self.kind == "gdn":
            mixed = self.mixer(layer_idx, h, ctx)
        else:
            mixed = self.mixer(layer_idx, h, rope, ctx)
        if self.mlp.takes_norm_linear(x):
            x, y = self.mlp.forward_small(x, mixed, self.mlp_norm, eps)
        else:
            x, h = add_rms_norm(x, mixed, self.mlp_norm, eps)
            y = self.mlp(h)
        if next_norm is None:
            return x + y, None
        return add_rms_norm(x, y, next_norm, eps)


class HybridModel(CausalLM):
    """A hybrid FULL/SWA/GDN language model with deterministic weights from ``seed``.

    Inference only (no gradients). All run-time math is deterministic.

    ``tp``: this rank's shard of the model (:mod:`unimem.models.tensor_parallel`): every
    weight is drawn at its full shape, exactly as unsharded, and sliced; ``self.config`` is
    the rank's config (its heads), ``config`` the full one.
    """

    def __init__(
        self,
        config: HybridConfig,
        seed: int = 0,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.full_config = config
        c = local_config(config, tp)
        self.config = c
        self.tp = tp
        self.seed = seed
        vocab_rows = tp.vocab_part(c.vocab_size)[2]
        self.embed = frozen_param(vocab_rows, c.d_model)
        self.layers = nn.ModuleList(HybridLayer(c, kind, tp) for kind in c.layer_pattern)
        self.final_norm = frozen_param(c.d_model)
        self.lm_head = frozen_param(vocab_rows, c.d_model)
        self._init_weights(seed)
        self.to(device=device)
        self.rope_dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        exps = torch.arange(0, c.head_dim_k, 2, dtype=torch.float64) / c.head_dim_k
        inv_freq = (c.rope_theta**-exps).to(self.rope_dtype)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    # ------------------------------------------------------------------ weights

    def _shard(self, name: str) -> tuple[Shard, int] | None:
        """``(shard, full length along its dim)`` of parameter ``name`` on this rank; None
        for a replicated one (norms)."""
        tp, c = self.tp, self.full_config
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("embed", "lm_head"):
            return vocab_shard(tp, c.vocab_size), c.vocab_size
        hq, hkv, dk, dv = c.n_q_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v
        if leaf == "qkv_proj":
            q = heads(tp, hq, dk, "n_q_heads")
            k = heads(tp, hkv, dk, "n_kv_heads", hq * dk)
            v = heads(tp, hkv, dv, "n_kv_heads", (hq + hkv) * dk)
            return shard(0, q, k, v), (hq + hkv) * dk + hkv * dv
        if leaf == "o_proj":
            return shard(1, heads(tp, hq, dv, "n_q_heads")), hq * dv
        h, gdv, conv = c.gdn_heads, c.gdn_head_dim_v, c.gdn_conv_dim
        if leaf == "in_proj":  # [q | k | v | z | b | a]
            z = heads(tp, h, gdv, "gdn_heads", conv)
            b = heads(tp, h, 1, "gdn_heads", conv + h * gdv)
            a = heads(tp, h, 1, "gdn_heads", conv + h * gdv + h)
            return shard(0, *gdn_qkv_ranges(tp, c), z, b, a), conv + h * gdv + 2 * h
        if leaf == "conv_weight":
            return shard(0, *gdn_qkv_ranges(tp, c)), conv
        if leaf in ("A_log", "dt_bias"):
            return shard(0, heads(tp, h, 1, "gdn_heads")), h
        if leaf == "out_proj":
            return shard(1, heads(tp, h, gdv, "gdn_heads")), h * gdv
        f = c.ffn_dim
        if leaf == "gate_up":
            return shard(0, heads(tp, f, 1, "ffn_dim"), heads(tp, f, 1, "ffn_dim", f)), 2 * f
        if leaf == "down":
            return shard(1, heads(tp, f, 1, "ffn_dim")), f
        return None

    def _init_weights(self, seed: int) -> None:
        c = self.config
        out_scale = 1.0 / math.sqrt(2 * c.num_layers)  # residual-branch outputs
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            leaf = name.rsplit(".", 1)[-1]
            rule = self._shard(name) if self.tp.size > 1 else None
            shape = list(p.shape)
            if rule is not None:
                shape[rule[0].dim] = rule[1]
            if leaf in ("mixer_norm", "mlp_norm", "final_norm", "norm"):
                w = torch.ones(shape)
            elif leaf == "embed":
                w = torch.randn(shape, generator=gen)
            elif leaf == "conv_weight":
                w = torch.randn(shape, generator=gen) / math.sqrt(c.conv_kernel)
            elif leaf == "A_log":  # decay rate A in [1, 16]
                w = (1 + 15 * torch.rand(shape, generator=gen)).log()
            elif leaf == "dt_bias":  # softplus(dt_bias) = dt, log-uniform in [1e-3, 1e-1]
                dt = torch.exp(math.log(1e-3) + math.log(100) * torch.rand(shape, generator=gen))
                w = dt + torch.log(-torch.expm1(-dt))
            else:  # a [out, in] projection
                w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
                if leaf in ("o_proj", "out_proj", "down"):
                    w = w * out_scale
            if rule is not None:
                w = rule[0].take(w)
            dtype = c.state_dtype if leaf in ("A_log", "dt_bias") else c.dtype
            p.data = w.to(dtype)

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)

    @torch.no_grad()
    def forward_with_hidden(self, input_ids: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """Run one batch: ``input_ids [T]`` (int, rows laid out as ``ctx`` says) through every
        layer, calling ``ctx`` for all memory access. Returns logits and final-normed hidden
        states of the rows ``ctx.logits_indices``, in that order."""
        c = self.config
        rope = self._rope(ctx.positions)
        x = parallel_embedding(input_ids, self.embed, self.tp, c.vocab_size)
        n = len(self.layers)
        h = rms_norm(x, self.layers[0].mixer_norm, c.rms_eps) if n else None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].mixer_norm if i + 1 < n else None
            x, h = layer(i, x, h, rope, ctx, next_norm)
            ctx.capture_hidden(i, x)
        hidden = rms_norm(ctx.logits_rows(x), self.final_norm, c.rms_eps)
        return self.output(hidden, ctx)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head
