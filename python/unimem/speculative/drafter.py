"""A DSPARK-style block drafter whose K/V live in draft lanes of the target's pages.

One draft forward proposes ``gamma`` tokens for a request whose committed length is ``n``
(its anchor — the last committed token, not yet run through the target — sits at position
``n``):

* input: ``[anchor, mask, .., mask]`` (``gamma`` rows: the anchor's embedding from the
  target's embedding table, then ``gamma - 1`` copies of a learned mask embedding) at
  positions ``n .. n + gamma - 1``;
* every draft layer attends causally over its **context** — positions ``< n``, whose K/V
  were injected from the target — and over the block itself. Block row ``i`` predicts the
  token at position ``n + i + 1``;
* base logits: the draft's final norm, then the target's LM head (shared) — or, with a
  reduced draft vocabulary (``DraftConfig.draft_vocab_size`` ``K``, as EAGLE-3), only its
  rows ``d2t[0 .. K)``: the drafter scores ``K`` target tokens (``d2t`` maps draft id to
  target id, e.g. the ``K`` most frequent tokens of the target's own text) and can never
  propose another;
* tokens are chosen left to right, each adding a low-rank Markov bias from the previous
  token: ``logits_i = base_i + V @ U[prev]`` with ``prev`` the anchor for ``i = 0`` —
  greedily (:meth:`DsparkDrafter.pick`), or by a column policy that samples over the
  drafter's own vocabulary and keeps the distribution it drew from
  (:meth:`DsparkDrafter.sample_pick`, speculative sampling).
  Under a reduced vocabulary the Markov tables are ``U [K + 1, R]`` (row ``K``: a previous
  token outside the draft vocabulary) and ``W [K, R]``; tokens leave :meth:`pick` and
  :meth:`sample_pick` as target ids.

Context injection. After the target has run a position (prefill, or a committed verify row),
the residual streams of the chosen ``target_layers`` at that position are concatenated,
fused (``fc``, then an RMSNorm) and fed to each draft layer's own K/V projection (with RoPE at
that position). That K/V is written into the layer's draft lane at that position; the block's
own K/V go to the same lane at the block's positions and are overwritten by context K/V once
those positions are committed.

Memory. Each draft layer is hosted by FULL or SWA pages: :meth:`DraftConfig.lanes` gives the
``DraftLane`` list that ``memory_spec`` puts into the target's units, so allocating a page
for the target allocates the drafter's rows too. The drafter itself holds no memory: its
attention is a callback (``attend(j, q, k, v)``) that stores the block's K/V in lane ``j`` and
attends through the step's metadata, and :meth:`DsparkDrafter.context_kv` returns K/V for the
caller to store.

Weights are drawn from per-tensor generators seeded by ``(seed, name)`` (as the target's), so
the same seed gives the same drafter on every device. Inference only: the parameters do not
require grad (distillation, :mod:`unimem.training.distill`, turns them on inside its loop).
A drafter is written as a directory by :func:`unimem.speculative.checkpoint.save_drafter`
and read back onto a target by :func:`unimem.speculative.checkpoint.load_drafter`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from unimem.memory.spec import AttentionLayerSpec, DraftLane, LayerKind
from unimem.models.config import HybridConfig
from unimem.models.nn_ops import frozen_param, rms_norm
from unimem.models.tensor_parallel import logits_matmul
from unimem_kernel import add_rms_norm, markov_pick, rope_qk, silu_mul
from unimem_kernel.draft_pick import markov_bias_reference
from unimem_kernel.rope_angles import rope_cos_sin

__all__ = [
    "DRAFT_HOSTS",
    "DraftAttention",
    "DraftConfig",
    "DsparkDrafter",
    "draft_config_for",
    "with_context_window",
    "with_extra_layers",
]

DRAFT_HOSTS = ("full", "swa")
"""Valid entries of ``DraftConfig.layer_hosts``."""

DraftAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(j, q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv]) -> o [T, Hq, Dv]``: store the
block's K/V in draft layer ``j``'s lane and attend causally (window: the layer's)."""

Choose = Callable[[int, torch.Tensor], tuple[torch.Tensor, object]]
"""``choose(i, logits [bs, K]) -> (tokens [bs], extra)``: the policy of block column ``i``
when sampling, over the drafter's own vocabulary — its proposed tokens (target ids) and
whatever it keeps of the draw (the proposal distribution: see
:mod:`unimem.speculative.spec_sampling`)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class DraftConfig:
    """Shape of a drafter. Immutable; validated at construction (``ValueError`` naming
    ``DraftConfig.<field>``).

    ``layer_hosts[j]``: the unit kind hosting draft layer ``j`` ("full" or "swa"; an "swa"
    layer attends a sliding ``window``). ``target_layers``: target layers (distinct indices,
    model order not required) whose residual streams make the context. ``vocab_size`` and
    ``d_model`` must be the target's (embedding and LM head are shared). ``gamma``: the block
    size the drafter was trained for (None: untrained; recorded, not enforced — any block
    size runs). ``confidence``: the drafter has a confidence head (:meth:`DsparkDrafter.survival`;
    False for checkpoints written before it existed: their verify lengths stay fixed).
    ``draft_vocab_size``: ``K`` for a reduced draft vocabulary (module docstring; None: the
    target's whole vocabulary). ``context_window``: the attention window of the FULL-hosted
    layers (None: their whole context) — a mask only, their K/V stay in FULL units
    (:func:`with_context_window` says why; SWA-hosted layers attend ``window``).
    """

    vocab_size: int
    d_model: int
    layer_hosts: tuple[str, ...]
    target_layers: tuple[int, ...]
    n_q_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    ffn_dim: int
    window: int | None = None
    markov_rank: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float64
    gamma: int | None = None
    confidence: bool = False
    draft_vocab_size: int | None = None
    context_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("layer_hosts", "target_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in (
            "vocab_size",
            "d_model",
            "n_q_heads",
            "n_kv_heads",
            "head_dim_k",
            "head_dim_v",
            "ffn_dim",
            "markov_rank",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"DraftConfig.{name} must be a positive int, got {value!r}")
        hosts = self.layer_hosts
        if not isinstance(hosts, tuple) or not hosts:
            raise ValueError(f"DraftConfig.layer_hosts must be a non-empty tuple, got {hosts!r}")
        for j, h in enumerate(hosts):
            if h not in DRAFT_HOSTS:
                raise ValueError(
                    f"DraftConfig.layer_hosts[{j}] must be one of {DRAFT_HOSTS}, got {h!r}"
                )
        layers = self.target_layers
        if (
            not isinstance(layers, tuple)
            or not layers
            or not all(_is_int(i) and i >= 0 for i in layers)
            or len(set(layers)) != len(layers)
        ):
            raise ValueError(
                f"DraftConfig.target_layers must be a non-empty tuple of distinct layer "
                f"indices, got {layers!r}"
            )
        if "swa" in hosts:
            if not _is_int(self.window) or self.window <= 0:
                raise ValueError(
                    f"DraftConfig.window must be > 0 with an swa layer, got {self.window!r}"
                )
        elif self.window is not None:
            raise ValueError("DraftConfig.window must be None without swa layers")
        cw = self.context_window
        if cw is not None and (not _is_int(cw) or cw < 1):
            raise ValueError(f"DraftConfig.context_window must be None or an int >= 1, got {cw!r}")
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(
                f"DraftConfig.n_kv_heads ({self.n_kv_heads}) must divide n_q_heads "
                f"({self.n_q_heads})"
            )
        if self.head_dim_k % 2:
            raise ValueError(f"DraftConfig.head_dim_k must be even (RoPE), got {self.head_dim_k}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"DraftConfig.dtype must be a floating torch.dtype, got {self.dtype}")
        if self.gamma is not None and (not _is_int(self.gamma) or self.gamma < 1):
            raise ValueError(f"DraftConfig.gamma must be None or an int >= 1, got {self.gamma!r}")
        if not isinstance(self.confidence, bool):
            raise ValueError(f"DraftConfig.confidence must be a bool, got {self.confidence!r}")
        k = self.draft_vocab_size
        if k is not None and (not _is_int(k) or not 1 <= k <= self.vocab_size):
            raise ValueError(
                f"DraftConfig.draft_vocab_size must be None or an int in [1, vocab_size = "
                f"{self.vocab_size}], got {k!r}"
            )

    @property
    def out_vocab(self) -> int:
        """Columns of the base logits: ``draft_vocab_size`` or the target's vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def reduced(self) -> bool:
        """Whether the drafter scores a reduced draft vocabulary."""
        return self.draft_vocab_size is not None

    @property
    def num_layers(self) -> int:
        return len(self.layer_hosts)

    def layer_window(self, j: int) -> int | None:
        """The sliding window draft layer ``j`` attends: ``window`` for an SWA-hosted layer,
        ``context_window`` for a FULL-hosted one (None: its whole context)."""
        return self.window if self.layer_hosts[j] == "swa" else self.context_window

    def lanes(self) -> tuple[DraftLane, ...]:
        """Draft lane ``j`` of the memory spec holds draft layer ``j``'s K/V rows."""
        out = []
        for host in self.layer_hosts:
            kind = LayerKind.FULL if host == "full" else LayerKind.SWA
            layer = AttentionLayerSpec(
                kind=kind,
                num_kv_heads=self.n_kv_heads,
                k_head_dim=self.head_dim_k,
                v_head_dim=self.head_dim_v,
                dtype=self.dtype,
                # the memory's window: a FULL lane keeps every position (a context window
                # is a mask only)
                window=self.window if host == "swa" else None,
            )
            out.append(DraftLane(kind, layer))
        return tuple(out)

    def check_target(
        self, vocab_size: int, d_model: int, num_layers: int, max_window: int | None
    ) -> None:
        """Raise ``ValueError`` unless this drafter fits a target with these dimensions: same
        vocabulary and width, ``target_layers`` inside the model, and the SWA window at most
        the target's largest (so SWA retirement, driven by the target's window, never frees
        a page a draft layer still reads)."""
        if vocab_size != self.vocab_size or d_model != self.d_model:
            raise ValueError(
                f"DraftConfig.vocab_size/d_model ({self.vocab_size}, {self.d_model}) must be "
                f"the target's ({vocab_size}, {d_model}): embedding and LM head are shared"
            )
        bad = [i for i in self.target_layers if i >= num_layers]
        if bad:
            raise ValueError(
                f"DraftConfig.target_layers {bad} out of range for {num_layers} target layers"
            )
        if "swa" in self.layer_hosts and (max_window is None or self.window > max_window):
            raise ValueError(
                f"DraftConfig.window {self.window} must be <= the target's largest SWA window "
                f"({max_window})"
            )


def draft_config_for(
    config: HybridConfig,
    num_layers: int = 2,
    markov_rank: int = 16,
    *,
    target_layers: Sequence[int] | None = None,
    ffn_dim: int | None = None,
    draft_vocab_size: int | None = None,
    context_window: int | None = None,
) -> DraftConfig:
    """A drafter for ``config``: ``num_layers`` layers alternating FULL and SWA hosts (only
    the kinds the target has), SWA window half the target's — or, with ``context_window``,
    every layer attending that window (:func:`with_context_window`'s hosts) — the target's
    head shapes and dtype, context from three target layers (low, middle, last) unless
    ``target_layers`` names them, the target's MLP width unless ``ffn_dim``, the whole
    vocabulary unless ``draft_vocab_size``, with a confidence head."""
    has = set(config.layer_pattern)
    kinds = [k for k in ("full", "swa") if k in has]
    if not kinds:
        raise ValueError("a DSPARK drafter needs a target with FULL or SWA layers to host it")
    swa_hosted = False
    if context_window is not None:
        kinds = [_context_window_host(context_window, config)]
        swa_hosted = kinds == ["swa"]
    hosts = tuple(kinds[j % len(kinds)] for j in range(num_layers))
    n = config.num_layers
    if target_layers is None:
        targets = tuple(sorted({min(1, n - 1), n // 2, n - 1}))
    else:
        targets = tuple(int(i) for i in target_layers)
        if any(not 0 <= i < n for i in targets):
            raise ValueError(f"target_layers {targets} out of range for a target of {n} layers")
    return DraftConfig(
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        layer_hosts=hosts,
        target_layers=targets,
        n_q_heads=config.n_q_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim_k=config.head_dim_k,
        head_dim_v=config.head_dim_v,
        ffn_dim=ffn_dim or config.ffn_dim,
        window=(context_window if swa_hosted else max(1, config.window // 2))
        if "swa" in hosts
        else None,
        markov_rank=markov_rank,
        rope_theta=config.rope_theta,
        rms_eps=config.rms_eps,
        dtype=config.dtype,
        confidence=True,
        draft_vocab_size=draft_vocab_size,
        context_window=None if swa_hosted else context_window,
    )


def _context_window_host(window: object, target: HybridConfig | None) -> str:
    """The host of draft layers attending ``window`` positions: ``"swa"`` where ``target``'s
    SWA layers reach that far (no target: assumed so), else ``"full"``. ``ValueError`` for
    an invalid window, or a target with neither (SWA layers too short, no FULL layers)."""
    if not _is_int(window) or window < 1:
        raise ValueError(f"context window must be an int >= 1, got {window!r}")
    if target is None:
        return "swa"
    if "swa" in target.layer_pattern and target.window is not None and window <= target.window:
        return "swa"
    if "full" in target.layer_pattern:
        return "full"
    raise ValueError(
        f"context window {window} exceeds the target's SWA window {target.window} and the "
        "target has no FULL layers to host a windowed draft layer"
    )


def with_context_window(
    config: DraftConfig, window: int, target: HybridConfig | None = None
) -> DraftConfig:
    """``config`` with every draft layer attending the last ``window`` positions only (the
    weights do not change: attention masks and lane hosts do). Where ``target`` has SWA
    layers of at least ``window`` (or no ``target`` is given) every layer is SWA-hosted, its
    K/V retired as the target's SWA layers retire theirs; otherwise the layers are
    FULL-hosted with ``context_window`` — the same attention, the K/V of the whole context
    kept (``ValueError`` for a target with neither).

    Why: a drafter attends its context with the positions it met in training. One trained on
    sequences of ``T`` tokens, given a FULL-hosted layer (unbounded context), meets contexts
    it never saw once outputs run past ``T``, and its drafts collapse: the shipped Gemma 3
    270M drafter, trained on ~150-token sequences, accepted 1.6-2.2 tokens a step past output
    128 (offline, four prompts x 1 024 greedy tokens); re-windowed to 128 positions, 5.1-5.5.
    With ``window <= T`` every context it meets at any length is one it trained on."""
    host = _context_window_host(window, target)
    w = int(window)
    if host == "swa":
        return replace(
            config, layer_hosts=("swa",) * config.num_layers, window=w, context_window=None
        )
    return replace(config, layer_hosts=("full",) * config.num_layers, window=None, context_window=w)


def with_extra_layers(drafter: DsparkDrafter, num_layers: int, seed: int) -> DsparkDrafter:
    """A drafter of ``num_layers`` layers that computes exactly what ``drafter`` does: its
    weights, then ``num_layers - drafter.config.num_layers`` new layers after its last one,
    hosted and windowed as that one, freshly drawn from ``seed`` except their output
    projections (``o_proj``, ``down``), which are zero — each new layer adds nothing to the
    residual stream until training moves them. How a trained drafter grows deeper without
    losing what it learned (the new layers' inputs still get gradients through the zeroed
    projections' own). Same device, dtype and draft vocabulary; ``ValueError`` unless
    ``num_layers`` exceeds the drafter's."""
    c = drafter.config
    extra = num_layers - c.num_layers
    if extra < 1:
        raise ValueError(
            f"with_extra_layers: num_layers {num_layers} must exceed the drafter's {c.num_layers}"
        )
    config = replace(c, layer_hosts=c.layer_hosts + (c.layer_hosts[-1],) * extra)
    d2t = drafter.d2t if c.reduced else None
    grown = DsparkDrafter(config, drafter.embed, drafter.lm_head, seed=seed, d2t=d2t)
    own = drafter.state_dict()
    with torch.no_grad():
        for name, t in grown.state_dict().items():
            if name in own:
                t.copy_(own[name])
        for layer in grown.layers[c.num_layers :]:
            layer.o_proj.zero_()
            layer.down.zero_()
    return grown


# ---------------------------------------------------------------------- modules


class DraftLayer(nn.Module):
    """One draft block: attention (its K/V projection also maps the injected context) and a
    SwiGLU MLP, pre-norm residual."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.q_dim = c.n_q_heads * c.head_dim_k
        self.k_dim = c.n_kv_heads * c.head_dim_k
        self.v_dim = c.n_kv_heads * c.head_dim_v
        self.ffn_dim = c.ffn_dim
        self.input_norm = frozen_param(c.d_model)
        self.qkv_proj = frozen_param(self.q_dim + self.k_dim + self.v_dim, c.d_model)
        self.o_proj = frozen_param(c.d_model, c.n_q_heads * c.head_dim_v)
        self.mlp_norm = frozen_param(c.d_model)
        self.gate_up = frozen_param(2 * c.ffn_dim, c.d_model)
        self.down = frozen_param(c.d_model, c.ffn_dim)

    def mlp(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """The MLP branch of residual ``x`` (its pre-norm included)."""
        return self.mlp_normed(rms_norm(x, self.mlp_norm, eps))

    def mlp_normed(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP branch of an already normed input ``h``: SwiGLU over the fused gate/up
        projection (one fused activation; its reference under autograd)."""
        return F.linear(silu_mul(F.linear(h, self.gate_up)), self.down)


class DsparkDrafter(nn.Module):
    """The DSPARK block drafter (see the module docstring).

    ``embed [vocab, d_model]`` and ``lm_head [vocab, d_model]`` are the target's tensors,
    shared (not copied, not registered as this module's parameters). With a reduced draft
    vocabulary, ``d2t [K]`` (distinct target ids; default ``0 .. K - 1``) is the map from
    draft id to target id, a persistent buffer (saved with the weights), and the drafter
    keeps its own gathered copy of the LM head's rows ``d2t`` (:attr:`head_weight`).
    """

    def __init__(
        self,
        config: DraftConfig,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        seed: int = 0,
        d2t: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        c = config
        if embed.shape != (c.vocab_size, c.d_model) or lm_head.shape != embed.shape:
            raise ValueError(
                f"embed {tuple(embed.shape)} and lm_head {tuple(lm_head.shape)} must both be "
                f"[vocab_size, d_model] = [{c.vocab_size}, {c.d_model}]"
            )
        self.config = c
        self.seed = seed
        self._shared = (embed, lm_head)  # a tuple: not registered as parameters
        self.mask_embed = frozen_param(c.d_model)
        self.fc = frozen_param(c.d_model, len(c.target_layers) * c.d_model)
        self.ctx_norm = frozen_param(c.d_model)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.final_norm = frozen_param(c.d_model)
        k = c.out_vocab
        self.markov_u = frozen_param(k + 1 if c.reduced else k, c.markov_rank)
        self.markov_v = frozen_param(k, c.markov_rank)
        if c.confidence:  # survival head over [draft hidden ; embedding of the previous token]
            self.conf_w = frozen_param(2 * c.d_model)
            self.conf_b = frozen_param(1)
        self._init_weights(seed)
        if c.reduced:
            self._set_vocab_map(c, d2t, embed.device)
        elif d2t is not None:
            raise ValueError("d2t given for a drafter without DraftConfig.draft_vocab_size")
        self.to(device=embed.device)
        self.rope_dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        exps = torch.arange(0, c.head_dim_k, 2, dtype=torch.float64) / c.head_dim_k
        inv_freq = (c.rope_theta**-exps).to(self.rope_dtype).to(embed.device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _set_vocab_map(self, c: DraftConfig, d2t: torch.Tensor | None, dev) -> None:
        """The reduced vocabulary's buffers: ``d2t [K]`` (persistent), ``t2d [vocab]`` (target
        id to draft id, ``K`` outside), ``d2t_ext [K + 1]`` (``d2t`` and a 0 for row ``K``)
        and ``head_rows [K, d_model]``, the LM head's rows ``d2t`` (not saved: the target's)."""
        k = c.draft_vocab_size
        if d2t is None:
            d2t = torch.arange(k)
        d2t = torch.as_tensor(d2t).to(device="cpu", dtype=torch.int64).reshape(-1)
        if d2t.shape != (k,):
            raise ValueError(f"d2t must have draft_vocab_size = {k} entries, got {d2t.numel()}")
        if k and (int(d2t.min()) < 0 or int(d2t.max()) >= c.vocab_size):
            raise ValueError(f"d2t holds ids outside the target vocabulary [0, {c.vocab_size})")
        if torch.unique(d2t).numel() != k:
            raise ValueError("d2t must hold distinct target ids")
        t2d = torch.full((c.vocab_size,), k, dtype=torch.int64)
        t2d[d2t] = torch.arange(k)
        self.register_buffer("d2t", d2t.to(dev))
        self.register_buffer("t2d", t2d.to(dev), persistent=False)
        ext = torch.cat([d2t, torch.zeros(1, dtype=torch.int64)])
        self.register_buffer("d2t_ext", ext.to(dev), persistent=False)
        rows = self.lm_head[d2t.to(self.lm_head.device)].to(dev)
        self.register_buffer("head_rows", rows, persistent=False)

    @property
    def embed(self) -> torch.Tensor:
        return self._shared[0]

    @property
    def lm_head(self) -> torch.Tensor:
        return self._shared[1]

    @property
    def head_weight(self) -> torch.Tensor:
        """``[out_vocab, d_model]``: the LM head rows the drafter scores (the shared LM head,
        or its rows ``d2t``, gathered once into a non-persistent buffer)."""
        return self.head_rows if self.config.reduced else self.lm_head

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ``tokens`` (``draft_vocab_size`` outside the draft
        vocabulary); the tokens themselves without a reduced vocabulary."""
        if not self.config.reduced:
            return tokens.long()
        return self.t2d[tokens.long()]

    def _init_weights(self, seed: int) -> None:
        c = self.config
        out_scale = 1.0 / math.sqrt(2 * c.num_layers)
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("norm"):
                w = torch.ones(p.shape)
            elif leaf in ("mask_embed", "markov_u"):
                w = torch.randn(p.shape, generator=gen)
            elif leaf == "markov_v":  # bias(prev) = V @ U[prev] of standard deviation ~1
                w = torch.randn(p.shape, generator=gen) / math.sqrt(c.markov_rank)
            elif leaf == "conf_w":  # a survival logit of standard deviation ~1
                w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[0])
            elif leaf == "conf_b":
                w = torch.zeros(p.shape)
            else:  # an [out, in] projection
                w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
                if leaf in ("o_proj", "down"):
                    w = w * out_scale
            p.data = w.to(c.dtype)

    # ------------------------------------------------------------------ pieces

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)

    def _qkv(
        self, j: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``j``'s rotated q, k and v of residual ``x [T, d_model]``."""
        h = rms_norm(x, self.layers[j].input_norm, self.config.rms_eps)
        return self._qkv_normed(j, h, rope)

    def _qkv_normed(
        self, j: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_qkv` of an already normed input ``h`` (RoPE on q and k in one launch)."""
        c, layer, t = self.config, self.layers[j], h.shape[0]
        q, k, v = F.linear(h, layer.qkv_proj).split([layer.q_dim, layer.k_dim, layer.v_dim], -1)
        q, k = rope_qk(
            q.reshape(t, c.n_q_heads, c.head_dim_k), k.reshape(t, c.n_kv_heads, c.head_dim_k), *rope
        )
        return q, k, v.reshape(t, c.n_kv_heads, c.head_dim_v)

    def _kv(
        self, j: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j``'s rotated k and v of ``x [T, d_model]`` without q (the context path:
        the K/V rows of the fused projection only)."""
        c, layer, t = self.config, self.layers[j], x.shape[0]
        h = rms_norm(x, layer.input_norm, c.rms_eps)
        k, v = F.linear(h, layer.qkv_proj[layer.q_dim :]).split([layer.k_dim, layer.v_dim], -1)
        k = k.reshape(t, c.n_kv_heads, c.head_dim_k)
        k, _ = rope_qk(k, k[:, :0], *rope)
        return k, v.reshape(t, c.n_kv_heads, c.head_dim_v)

    # ------------------------------------------------------------------ context

    @torch.no_grad()
    def context_kv(
        self, hidden: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context K/V of every draft layer for ``T`` target positions.

        ``hidden[i] [T, d_model]``: the target's residual stream after layer
        ``target_layers[i]`` at these positions; ``positions [T]``. Returns per draft layer
        ``(k [T, Hkv, Dk], v [T, Hkv, Dv])``, to be stored in its lane at those positions.
        """
        c = self.config
        if len(hidden) != len(c.target_layers):
            raise ValueError(f"need {len(c.target_layers)} hidden states, got {len(hidden)}")
        feats = torch.cat([h.to(c.dtype) for h in hidden], dim=-1)
        ctx = rms_norm(F.linear(feats, self.fc), self.ctx_norm, c.rms_eps)
        rope = self._rope_tables(positions)
        return [self._kv(j, ctx, rope) for j in range(c.num_layers)]

    # ------------------------------------------------------------------ block

    @torch.no_grad()
    def block_logits(
        self, anchors: torch.Tensor, positions: torch.Tensor, attend: DraftAttention
    ) -> torch.Tensor:
        """Base logits ``[bs, gamma, vocab]`` of one block forward.

        ``anchors [bs]`` token ids; ``positions [bs * gamma]`` (int64, request-major: request
        ``b``'s block sits at ``positions[b * gamma :]``, starting at its committed length).
        ``attend`` stores each layer's block K/V and attends (context + block, causal).
        """
        return self.block_forward(anchors, positions, attend)[0]

    @torch.no_grad()
    def block_forward(
        self, anchors: torch.Tensor, positions: torch.Tensor, attend: DraftAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`block_logits` and the block's final hidden states ``[bs, gamma, d_model]``
        (after the final norm: what the LM head and the confidence head read)."""
        c = self.config
        bs = anchors.shape[0]
        gamma = positions.shape[0] // bs
        x = self.mask_embed.expand(bs, gamma, c.d_model).clone()
        x[:, 0] = self.embed[anchors.long()].to(c.dtype)
        x = x.reshape(bs * gamma, c.d_model)
        rope = self._rope_tables(positions)
        # each residual add is fused with the next pre-norm (the last with the final norm)
        h = rms_norm(x, self.layers[0].input_norm, c.rms_eps)
        for j, layer in enumerate(self.layers):
            q, k, v = self._qkv_normed(j, h, rope)
            o = attend(j, q, k, v)
            attn = F.linear(o.reshape(x.shape[0], -1), layer.o_proj)
            x, h = add_rms_norm(x, attn, layer.mlp_norm, c.rms_eps)
            nxt = self.layers[j + 1].input_norm if j + 1 < len(self.layers) else self.final_norm
            x, h = add_rms_norm(x, layer.mlp_normed(h), nxt, c.rms_eps)
        out_dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        logits = logits_matmul(h, self.head_weight.to(c.dtype), out_dtype)
        return logits.reshape(bs, gamma, c.out_vocab), h.reshape(bs, gamma, c.d_model)

    def survival_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Confidence head, before the sigmoid: ``w . [hidden ; embed(prev)] + b`` per drafted
        position (``hidden [..., d_model]`` the block's final hidden state of the row that
        drafts the token, ``prev [...]`` the token before it: the anchor, then the previous
        proposal). Not under ``no_grad`` (distillation trains it). ``ValueError`` without a
        head (``DraftConfig.confidence`` False)."""
        if not self.config.confidence:
            raise ValueError("this drafter has no confidence head (DraftConfig.confidence)")
        c = self.config
        d = c.d_model
        emb = self.embed[prev.long()].to(c.dtype)
        w = self.conf_w
        return hidden.to(c.dtype) @ w[:d] + emb @ w[d:] + self.conf_b[0]

    @torch.no_grad()
    def survival(
        self, hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """``[bs, gamma]`` float32: the estimated probability that drafted token ``i`` is
        accepted given that every earlier one was — ``sigmoid`` of :meth:`survival_logits`
        with ``hidden [bs, gamma, d_model]`` (:meth:`block_forward`) and the previous tokens
        ``[anchor, tokens[:, :-1]]`` (``tokens [bs, gamma]`` the proposals)."""
        prev = torch.cat([anchors.long()[:, None], tokens.long()[:, :-1]], dim=1)
        return torch.sigmoid(self.survival_logits(hidden, prev)).float()

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """``[..., out_vocab]``: ``V @ U[prev]`` for each previous target token ``prev [...]``
        (its draft row under a reduced vocabulary; also the training forward's bias, so not
        under ``no_grad``)."""
        return markov_bias_reference(self.markov_u, self.markov_v, self.to_draft(prev))

    @torch.no_grad()
    def pick(
        self,
        base: torch.Tensor,
        anchors: torch.Tensor,
        ref: torch.Tensor | None = None,
        take: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Choose the block's tokens left to right: column ``i`` is
        ``argmax(base[:, i] + markov_bias(prev))`` with ``prev`` the anchor or column
        ``i - 1``; with an acceptance control's decisions (``ref``, ``take [bs, gamma]``),
        column ``i`` becomes ``ref[:, i]`` where ``take[:, i]`` before it conditions the next.
        On a GPU ``gamma + 1`` launches of one kernel (:func:`unimem_kernel.markov_pick`).
        ``base [bs, gamma, out_vocab]``; ``anchors``, ``ref`` and the result are target ids
        (``[bs, gamma]`` int64), mapped through ``t2d`` / ``d2t`` under a reduced vocabulary
        (a reference token outside it conditions the next column through row ``K``)."""
        if not self.config.reduced:
            return markov_pick(base, anchors, self.markov_u, self.markov_v, ref, take)
        ref_d = None
        if ref is not None:
            ref_d = torch.where(take, self.t2d[ref.long().clamp(min=0)], 0)
        out = markov_pick(base, self.to_draft(anchors), self.markov_u, self.markov_v, ref_d, take)
        tokens = self.d2t_ext[out]
        if ref is not None:
            tokens = torch.where(take, ref.long(), tokens)
        return tokens

    @torch.no_grad()
    def sample_pick(
        self, base: torch.Tensor, anchors: torch.Tensor, choose: Choose
    ) -> tuple[torch.Tensor, list]:
        """Choose the block's tokens left to right by a column policy (speculative
        sampling): column ``i``'s logits are ``base[:, i] + markov_bias(prev)`` (as in
        :meth:`pick`), over the drafter's own vocabulary (``K`` entries under a reduced one:
        entry ``j`` scores target id ``d2t[j]``); ``choose(i, logits)`` returns the proposed
        tokens as **target** ids and anything else it wants kept (the distribution it drew
        from, say), and the tokens condition the next column. Returns ``(tokens [bs, gamma]
        int64, [what choose returned beside the tokens, per column])``."""
        prev = anchors.long()
        cols, kept = [], []
        for i in range(base.shape[1]):
            logits = base[:, i] + self.markov_bias(prev).to(base.dtype)
            tok, extra = choose(i, logits)
            cols.append(tok)
            kept.append(extra)
            prev = tok
        return torch.stack(cols, dim=1), kept

    def propose(
        self,
        anchors: torch.Tensor,
        positions: torch.Tensor,
        attend: DraftAttention,
    ) -> torch.Tensor:
        """One draft step: :meth:`block_logits` then :meth:`pick`; ``[bs, gamma]`` int64."""
        return self.pick(self.block_logits(anchors, positions, attend), anchors)
