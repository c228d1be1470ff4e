"""The shape of a hybrid model as the engine and the memory see it: ``HybridConfig``, and the
``MemorySpec`` it asks of the memory.

Every model — the seeded synthetic one (:mod:`unimem.models.synthetic`) and every
architecture loaded from a checkpoint (:mod:`unimem.models.registry`) — exposes its shape as a
``HybridConfig`` (``model.config``): a stack of layers, each with one of three mixers:

* ``"full"``: causal multi-head attention with GQA (``n_q_heads`` query heads share
  ``n_kv_heads`` K/V heads), RoPE over the K head dim;
* ``"swa"``: the same attention restricted to a sliding window: a query at position ``p``
  attends keys at positions ``j`` with ``p - window < j <= p`` (``window`` keys, itself
  included);
* ``"gdn"``: a Gated DeltaNet layer (Qwen3-Next style) with a causal depthwise conv of
  ``conv_kernel`` taps and a ``[gdn_heads, gdn_head_dim_k, gdn_head_dim_v]`` recurrent state;
  q and k may have fewer heads (``gdn_k_heads``) than v, each shared by a group of value heads.

Attention K and V head dims may differ (asymmetric rows). What lies around the mixers (MLP or
experts, norms, rotary variant) is the architecture's own business; ``ffn_dim``,
``rope_theta`` and ``rms_eps`` describe the synthetic model and size the default drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unimem.memory.spec import (
    AttentionLayerSpec,
    DraftLane,
    LayerKind,
    MemorySpec,
    StateLayerSpec,
)

LAYER_KINDS = ("full", "swa", "gdn")
"""Valid entries of ``HybridConfig.layer_pattern``."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class HybridConfig:
    """Every dimension of a hybrid FULL/SWA/GDN model. Immutable; validated at construction
    (``ValueError`` whose message starts with ``HybridConfig.<field>``).

    ``dtype`` is the dtype of weights, activations, K/V and conv state. The recurrent (SSM)
    state and the GDN gates are computed in :attr:`state_dtype`: float32, or float64 when the
    model computes in float64 (the CPU presets, for exactness). ``max_context`` bounds the
    tokens of one request (prompt + generated); nothing in the model depends on it, but
    schedulers and capture buffers size by it.
    """

    vocab_size: int
    d_model: int
    n_q_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    ffn_dim: int
    layer_pattern: tuple[str, ...]
    window: int | None
    gdn_heads: int
    gdn_head_dim_k: int
    gdn_head_dim_v: int
    conv_kernel: int = 4
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float64
    max_context: int = 4096
    gdn_k_heads: int | None = None
    attn_scale: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layer_pattern, list):
            object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
        for name in (
            "vocab_size",
            "d_model",
            "n_q_heads",
            "n_kv_heads",
            "head_dim_k",
            "head_dim_v",
            "ffn_dim",
            "max_context",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"HybridConfig.{name} must be a positive int, got {value!r}")
        pattern = self.layer_pattern
        if not isinstance(pattern, tuple) or not pattern:
            raise ValueError(
                f"HybridConfig.layer_pattern must be a non-empty tuple, got {pattern!r}"
            )
        for i, kind in enumerate(pattern):
            if kind not in LAYER_KINDS:
                raise ValueError(
                    f"HybridConfig.layer_pattern[{i}] must be one of {LAYER_KINDS}, got {kind!r}"
                )
        # fields of a kind the model has must be positive; others are unused
        used = {"window": "swa" in pattern}
        for name in ("gdn_heads", "gdn_head_dim_k", "gdn_head_dim_v"):
            used[name] = "gdn" in pattern
        for name, needed in used.items():
            value = getattr(self, name)
            if needed and (not _is_int(value) or value <= 0):
                raise ValueError(f"HybridConfig.{name} must be a positive int, got {value!r}")
        if self.gdn_k_heads is not None and (
            not _is_int(self.gdn_k_heads)
            or self.gdn_k_heads <= 0
            or self.gdn_heads % self.gdn_k_heads
        ):
            raise ValueError(
                f"HybridConfig.gdn_k_heads must be a positive int dividing gdn_heads "
                f"({self.gdn_heads}), got {self.gdn_k_heads!r}"
            )
        if self.attn_scale is not None and not (
            isinstance(self.attn_scale, (int, float)) and self.attn_scale > 0
        ):
            raise ValueError(f"HybridConfig.attn_scale must be > 0, got {self.attn_scale!r}")
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(
                f"HybridConfig.n_kv_heads ({self.n_kv_heads}) must divide "
                f"n_q_heads ({self.n_q_heads}) (GQA)"
            )
        if self.head_dim_k % 2:
            raise ValueError(
                f"HybridConfig.head_dim_k must be even (RoPE rotates pairs), got {self.head_dim_k}"
            )
        if not _is_int(self.conv_kernel) or self.conv_kernel < 2:
            raise ValueError(
                f"HybridConfig.conv_kernel must be an int >= 2, got {self.conv_kernel!r}"
            )
        if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 1:
            raise ValueError(f"HybridConfig.rope_theta must be > 1, got {self.rope_theta!r}")
        if not isinstance(self.rms_eps, (int, float)) or not self.rms_eps > 0:
            raise ValueError(f"HybridConfig.rms_eps must be > 0, got {self.rms_eps!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(
                f"HybridConfig.dtype must be a floating torch.dtype, got {self.dtype!r}"
            )

    # ------------------------------------------------------------------ derived

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    def layer_window(self, layer_idx: int) -> int | None:
        """The SWA window of attention layer ``layer_idx``; None for a FULL layer."""
        kind = self.layer_pattern[layer_idx]
        if kind == "gdn":
            raise ValueError(f"layer {layer_idx} is a gdn layer, not attention")
        return self.window if kind == "swa" else None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the FULL and SWA layers, in model order."""
        return tuple(i for i, k in enumerate(self.layer_pattern) if k != "gdn")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Indices of the GDN layers, in model order."""
        return tuple(i for i, k in enumerate(self.layer_pattern) if k == "gdn")

    @property
    def attention_scale(self) -> float:
        """Softmax scale of every attention layer: ``attn_scale``, else ``head_dim_k ** -0.5``."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim_k**-0.5

    @property
    def gdn_key_heads(self) -> int:
        """Heads of the GDN q and k: ``gdn_k_heads``, else ``gdn_heads``. Value head ``h`` reads
        key head ``h // (gdn_heads // gdn_key_heads)``."""
        return self.gdn_k_heads if self.gdn_k_heads is not None else self.gdn_heads

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the GDN causal conv, ``[q | k | v]``: ``2 * Hk * dk + H * dv``."""
        key = self.gdn_key_heads * self.gdn_head_dim_k
        return 2 * key + self.gdn_heads * self.gdn_head_dim_v

    @property
    def state_dtype(self) -> torch.dtype:
        """Dtype of the SSM state and GDN gates: float64 for float64 models, else float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """Per-request conv state of one GDN layer: ``(conv_dim, conv_kernel - 1)``."""
        return (self.gdn_conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """Per-request recurrent state of one GDN layer: ``(gdn_heads, dk, dv)``."""
        return (self.gdn_heads, self.gdn_head_dim_k, self.gdn_head_dim_v)


# ---------------------------------------------------------------------- memory spec


def memory_spec(
    config: HybridConfig, page_size: int, draft_lanes: tuple[DraftLane, ...] = ()
) -> MemorySpec:
    """The :class:`unimem.memory.spec.MemorySpec` of ``config``'s layers, in model order:
    FULL/SWA attention layers with their K/V dims and window, GDN layers as STATE layers with
    conv state ``(conv_dim, conv_kernel - 1)`` in ``config.dtype`` and SSM state
    ``(gdn_heads, dk, dv)`` in ``config.state_dtype``. ``draft_lanes`` are passed through as
    they are."""
    layers = []
    for i, kind in enumerate(config.layer_pattern):
        if kind == "gdn":
            layers.append(
                StateLayerSpec(
                    conv_shape=config.conv_state_shape,
                    conv_dtype=config.dtype,
                    ssm_shape=config.ssm_state_shape,
                    ssm_dtype=config.state_dtype,
                )
            )
        else:
            layers.append(
                AttentionLayerSpec(
                    kind=LayerKind.FULL if kind == "full" else LayerKind.SWA,
                    num_kv_heads=config.n_kv_heads,
                    k_head_dim=config.head_dim_k,
                    v_head_dim=config.head_dim_v,
                    dtype=config.dtype,
                    window=config.layer_window(i),
                )
            )
    return MemorySpec(page_size=page_size, layers=tuple(layers), draft_lanes=tuple(draft_lanes))
