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

from unimem.models.base import CausalLM, ModelOutput
from unimem.models.config import HybridConfig
from unimem.models.forward_context import ForwardContext
from unimem.models.nn_ops import apply_rope, frozen_param, rms_norm


class AttentionMixer(nn.Module):
    """FULL or SWA attention of one layer (the window is applied by the context)."""

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.c = c
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
        qkv = F.linear(h, self.qkv_proj)
        q, k, v = qkv.split([self.q_dim, self.k_dim, self.v_dim], dim=-1)
        q = apply_rope(q.reshape(t, c.n_q_heads, c.head_dim_k), *rope)
        k = apply_rope(k.reshape(t, c.n_kv_heads, c.head_dim_k), *rope)
        v = v.reshape(t, c.n_kv_heads, c.head_dim_v).contiguous()
        o = ctx.attention(layer_idx, q, k, v)
        return F.linear(o.reshape(t, c.n_q_heads * c.head_dim_v), self.o_proj)


class GdnMixer(nn.Module):
    """Gated DeltaNet mixer of one layer (Qwen3-Next style, one head count for q, k, v)."""

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.c = c
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
        mixed_qkv, z, b, a = F.linear(h, self.in_proj).split(self.split, dim=-1)
        g = -self.A_log.to(sdt).exp() * F.softplus(a.to(sdt) + self.dt_bias.to(sdt))
        beta = torch.sigmoid(b.to(sdt))
        o = ctx.gdn(layer_idx, mixed_qkv.contiguous(), g, beta, conv_weight=self.conv_weight)
        z = z.reshape(t, c.gdn_heads, c.gdn_head_dim_v)
        acc = torch.float64 if o.dtype == torch.float64 else torch.float32
        gated = rms_norm(o, self.norm, c.rms_eps).to(acc) * F.silu(z.to(acc))
        return F.linear(gated.to(h.dtype).reshape(t, -1), self.out_proj)


class Mlp(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with a fused gate/up projection."""

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.ffn_dim = c.ffn_dim
        self.gate_up = frozen_param(2 * c.ffn_dim, c.d_model)
        self.down = frozen_param(c.d_model, c.ffn_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.gate_up).split(self.ffn_dim, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class HybridLayer(nn.Module):
    """One pre-norm block: mixer (attention or GDN) then SwiGLU MLP, each with a residual."""

    def __init__(self, c: HybridConfig, kind: str) -> None:
        super().__init__()
        self.c = c
        self.kind = kind
        self.mixer_norm = frozen_param(c.d_model)
        self.mlp_norm = frozen_param(c.d_model)
        self.mixer = GdnMixer(c) if kind == "gdn" else AttentionMixer(c)
        self.mlp = Mlp(c)

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        h = rms_norm(x, self.mixer_norm, self.c.rms_eps)
        if self.kind == "gdn":
            x = x + self.mixer(layer_idx, h, ctx)
        else:
            x = x + self.mixer(layer_idx, h, rope, ctx)
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.c.rms_eps))


class HybridModel(CausalLM):
    """A hybrid FULL/SWA/GDN language model with deterministic weights from ``seed``.

    Inference only (no gradients). All run-time math is deterministic.
    """

    def __init__(
        self, config: HybridConfig, seed: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.seed = seed
        self.embed = frozen_param(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(HybridLayer(c, kind) for kind in c.layer_pattern)
        self.final_norm = frozen_param(c.d_model)
        self.lm_head = frozen_param(c.vocab_size, c.d_model)
        self._init_weights(seed)
        self.to(device=device)
        self.rope_dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        exps = torch.arange(0, c.head_dim_k, 2, dtype=torch.float64) / c.head_dim_k
        inv_freq = (c.rope_theta**-exps).to(self.rope_dtype)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    # ------------------------------------------------------------------ weights

    def _init_weights(self, seed: int) -> None:
        c = self.config
        out_scale = 1.0 / math.sqrt(2 * c.num_layers)  # residual-branch outputs
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("mixer_norm", "mlp_norm", "final_norm", "norm"):
                w = torch.ones(p.shape)
            elif leaf == "embed":
                w = torch.randn(p.shape, generator=gen)
            elif leaf == "conv_weight":
                w = torch.randn(p.shape, generator=gen) / math.sqrt(c.conv_kernel)
            elif leaf == "A_log":  # decay rate A in [1, 16]
                w = (1 + 15 * torch.rand(p.shape, generator=gen)).log()
            elif leaf == "dt_bias":  # softplus(dt_bias) = dt, log-uniform in [1e-3, 1e-1]
                dt = torch.exp(math.log(1e-3) + math.log(100) * torch.rand(p.shape, generator=gen))
                w = dt + torch.log(-torch.expm1(-dt))
            else:  # a [out, in] projection
                w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
                if leaf in ("o_proj", "out_proj", "down"):
                    w = w * out_scale
            dtype = c.state_dtype if leaf in ("A_log", "dt_bias") else c.dtype
            p.data = w.to(dtype)

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.rope_dtype)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def forward_with_hidden(self, input_ids: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """Run one batch: ``input_ids [T]`` (int, rows laid out as ``ctx`` says) through every
        layer, calling ``ctx`` for all memory access. Returns logits and final-normed hidden
        states of the rows ``ctx.logits_indices``, in that order."""
        c = self.config
        rope = self._rope(ctx.positions)
        x = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            x = layer(i, x, rope, ctx)
            ctx.capture_hidden(i, x)
        hidden = rms_norm(x[ctx.logits_indices], self.final_norm, c.rms_eps)
        logits = F.linear(hidden, self.lm_head)
        if logits.dtype != torch.float64:
            logits = logits.float()
        return ModelOutput(logits, hidden)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head
