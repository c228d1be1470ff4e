"""Distil a DSPARK drafter from its target: ``python -m unimem.training.distill``.

Data: the target's own greedy continuations (``gen_len`` tokens) of prompts — random token
ids drawn from the seed, or text lines encoded by the checkpoint's tokenizer — generated with
the dense reference context (:class:`~unimem.models.forward_context.DenseContext`: per-request
K/V and state in plain tensors, no paged memory), capturing the residual streams of the
drafter's ``target_layers`` at every position the target runs.

Objective: for every anchor ``n`` of a continuation (the prompt's last position excluded:
from the first generated token on, as at inference, where the first verify's anchor is the
prefill's token), the drafter's block from ``n`` must predict ``tokens[n + 1 .. n + gamma]``:
cross-entropy of the base logits plus the Markov bias of the teacher-forced previous token,
computed by :mod:`unimem.training.train_forward` (the inference function, dense). Only the
drafter's own weights train (AdamW); the target, its embedding and LM head stay frozen. The
drafter's parameters require grad only inside :func:`distill`'s loop.

Confidence head (a drafter with ``DraftConfig.confidence``, the default shape's): trained in
the same steps by binary cross-entropy — the target of block row ``i`` is whether the
drafter's teacher-forced greedy pick there equals the target's token, i.e. whether draft
``i`` survives given that every earlier one did. The head reads the block's hidden state
detached and its gradients are clipped on their own, so it does not change how the drafter
itself trains. :func:`confidence_calibration` measures it on held-out continuations (mean
BCE and expected calibration error).

A drafter for a 16-bit target trains in float32 (master weights) and is saved in the
target's dtype. Measurement: :func:`offline_accept_length` replays the engine's greedy chain
schedule (anchor at the prompt's end, advance by accepted + 1) on held-out continuations;
the engine's own number comes from ``python -m unimem validate --spec dspark --accept-rate 0
--speculative-draft-model-path DIR``.

For a real model, ``python -m unimem.training.train_drafter`` trains on text the target writes
(prompts it samples from ``<bos>``, continuations through the Engine, batched teacher-forced
states, a reduced draft vocabulary, GPU-scale training): random-token prompts teach a drafter
the target's continuations of noise, not of text.

Devices: the ``tiny`` preset trains on one CPU core in minutes (defaults: ~4.5 min).
``--device cuda`` runs the same code (e.g. the ``small`` preset, float32 master weights);
that path has not been run on a GPU yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from unimem.models.base import CausalLM
from unimem.models.forward_context import DenseCache, DenseContext, ForwardMode
from unimem.speculative.checkpoint import load_drafter, save_drafter
from unimem.speculative.drafter import DsparkDrafter, draft_config_for
from unimem.training.train_forward import block_logits_dense, distill_losses

__all__ = [
    "DistillConfig",
    "DistillResult",
    "Calibration",
    "Rollouts",
    "confidence_calibration",
    "distill",
    "greedy_rollouts",
    "offline_accept_length",
    "copy_drafter",
    "random_prompts",
]


@dataclass
class DistillConfig:
    """Distillation settings (module docstring). ``batch`` continuations per step;
    ``anchors_per_step`` anchors sampled per step from the generated region (None: all).
    The defaults take ~4.5 min on one CPU core for ``tiny`` (few prompts, many steps
    overfit: 64 prompts reach a loss of 0.04 and generalise worse than 512);
    ``eval_prompts`` held-out random prompts for the before/after accept length (0: none);
    ``head_steps``: steps that train only the confidence head after the drafter's own
    (the head must be calibrated to the *final* drafter, whose acceptance grew while it
    trained; the body's forward only, no backward through it), on continuations the drafter
    did not train on — ``head_prompts`` random prompts of their own, or with given prompts
    the last eighth of them, held out of the drafter's data — so that it learns out-of-sample
    survival, not the drafter's (higher) acceptance on its own training data."""

    steps: int = 300
    prompts: int = 512
    prompt_len: int = 32
    gen_len: int = 64
    gamma: int = 7
    lr: float = 3e-3
    batch: int = 8
    anchors_per_step: int | None = 32
    seed: int = 0
    eval_prompts: int = 8
    log_every: int = 25
    draft_layers: int = 2
    head_steps: int = 100
    head_prompts: int = 64

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "prompt_len", "gen_len", "gamma", "batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DistillConfig.{name} must be an int >= 1, got {v!r}")
        if self.gen_len < 2:
            raise ValueError(f"DistillConfig.gen_len must be >= 2, got {self.gen_len}")
        if not self.lr > 0:
            raise ValueError(f"DistillConfig.lr must be > 0, got {self.lr!r}")
        if self.anchors_per_step is not None and self.anchors_per_step < 1:
            raise ValueError(
                f"DistillConfig.anchors_per_step must be None or >= 1, got {self.anchors_per_step}"
            )
        if not isinstance(self.head_prompts, int) or self.head_prompts < 1:
            raise ValueError(
                f"DistillConfig.head_prompts must be an int >= 1, got {self.head_prompts!r}"
            )
        if not isinstance(self.head_steps, int) or self.head_steps < 0:
            raise ValueError(
                f"DistillConfig.head_steps must be an int >= 0, got {self.head_steps!r}"
            )
        if self.eval_prompts < 0:
            raise ValueError(f"DistillConfig.eval_prompts must be >= 0, got {self.eval_prompts}")


LOGITS_PER_PASS = 1 << 26
"""Draft logits (rows x anchors x gamma x vocabulary) one pass of an offline evaluation holds
at most (:func:`confidence_calibration`, ``trainer.offline_accept_lengths``): long held-out
sequences are split into anchor chunks under this bound (256 MiB of float32)."""


def anchor_chunks(first: int, last: int, rows: int, gamma: int, vocab: int, device):
    """``arange(first, last)`` (anchors of ``rows`` sequences) in chunks of at most
    :data:`LOGITS_PER_PASS` logits."""
    step = max(1, LOGITS_PER_PASS // max(1, rows * gamma * vocab))
    for a0 in range(first, last, step):
        yield torch.arange(a0, min(last, a0 + step), device=device)


@dataclass
class Rollouts:
    """Target greedy continuations, padded to ``S``: ``tokens [N, S]`` (prompt + output),
    ``hidden[i] [N, S, d_model]`` the residual stream after ``layers[i]`` at every position
    the target ran (all but the last token; zeros past it), ``prompt_lens [N]``,
    ``lengths [N]`` (tokens of each sequence). Optionally the target's own next-token
    distribution at every position, its ``k`` most probable tokens: ``soft_ids [N, S, k]``
    (target ids, most probable first) and ``soft_probs [N, S, k]`` (their probabilities;
    zeros past each sequence) — the soft targets of :func:`~unimem.training.train_forward.
    distill_losses`."""

    tokens: torch.Tensor
    hidden: list[torch.Tensor]
    prompt_lens: torch.Tensor
    lengths: torch.Tensor
    layers: tuple[int, ...]
    soft_ids: torch.Tensor | None = None
    soft_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, idx: torch.Tensor) -> Rollouts:
        """The rows ``idx`` (any device: each tensor is indexed on its own device; the
        per-row lengths stay on the host, the tokens and streams on the target's device)."""

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[idx.to(t.device)]

        return Rollouts(
            take(self.tokens),
            [take(h) for h in self.hidden],
            take(self.prompt_lens),
            take(self.lengths),
            self.layers,
            None if self.soft_ids is None else take(self.soft_ids),
            None if self.soft_probs is None else take(self.soft_probs),
        )


@dataclass(frozen=True)
class Calibration:
    """The confidence head on held-out data: ``bce`` its mean binary cross-entropy, ``ece``
    the expected calibration error over 10 equal-width probability bins, ``base_rate`` the
    fraction of drafts that survive, ``mean_survival`` the head's mean estimate, ``n`` the
    entries (block rows of every anchor)."""

    bce: float
    ece: float
    base_rate: float
    mean_survival: float
    n: int


@dataclass
class DistillResult:
    drafter: DsparkDrafter
    losses: list[float] = field(default_factory=list)
    bce_losses: list[float] = field(default_factory=list)
    accept_before: float | None = None
    accept_after: float | None = None
    calibration_before: Calibration | None = None
    calibration_after: Calibration | None = None
    seconds: float = 0.0


class _CapturingContext(DenseContext):
    """A dense context that keeps the residual streams of ``layers``."""

    def __init__(self, cache, slots, num_tokens, mode, layers):
        super().__init__(cache, slots, num_tokens, mode)
        self.layers = layers
        self.captured: dict[int, torch.Tensor] = {}

    def capture_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        if layer_idx in self.layers:
            self.captured[layer_idx] = hidden.clone()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids below ``vocab`` from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


@torch.no_grad()
def greedy_rollouts(
    model: CausalLM,
    prompts: list[list[int]],
    gen_len: int,
    layers: tuple[int, ...],
    chunk: int | None = None,
) -> Rollouts:
    """The target's greedy continuation of ``gen_len`` tokens after each prompt, with the
    residual streams of ``layers`` (module docstring), ``chunk`` prompts at a time (default:
    16 on the CPU, 256 on a GPU, where a decode step of 16 rows is all launch overhead)."""
    c, dev = model.config, model.device
    if chunk is None:
        chunk = 16 if torch.device(dev).type == "cpu" else 256
    if not prompts or any(not p for p in prompts):
        raise ValueError("greedy_rollouts: need non-empty prompts")
    longest = max(len(p) for p in prompts) + gen_len
    if longest > c.max_context:
        raise ValueError(f"prompt + gen_len = {longest} exceeds the target's max_context")
    n = len(prompts)
    tokens = torch.zeros(n, longest, dtype=torch.long, device=dev)
    hidden = [torch.zeros(n, longest, c.d_model, dtype=c.dtype, device=dev) for _ in layers]
    for start in range(0, n, chunk):
        part = prompts[start : start + chunk]
        rows = list(range(start, start + len(part)))
        cache = DenseCache(c, len(part), dev)
        slots = [cache.alloc() for _ in part]
        lens = [len(p) for p in part]
        ids = torch.tensor([t for p in part for t in p], dtype=torch.long, device=dev)
        ctx = _CapturingContext(cache, slots, lens, ForwardMode.EXTEND, layers)
        logits = model.forward_with_hidden(ids, ctx).logits
        offset = 0
        for r, p in zip(rows, part, strict=True):
            tokens[r, : len(p)] = torch.tensor(p, device=dev)
            for h, i in zip(hidden, layers, strict=True):
                h[r, : len(p)] = ctx.captured[i][offset : offset + len(p)]
            offset += len(p)
        nxt = logits.argmax(-1)
        pos = torch.tensor(lens, device=dev)
        r_idx = torch.tensor(rows, device=dev)
        for t in range(gen_len):
            tokens[r_idx, pos + t] = nxt
            if t == gen_len - 1:
                break
            ctx = _CapturingContext(cache, slots, [1] * len(part), ForwardMode.DECODE, layers)
            logits = model.forward_with_hidden(nxt, ctx).logits
            for h, i in zip(hidden, layers, strict=True):
                h[r_idx, pos + t] = ctx.captured[i]
            nxt = logits.argmax(-1)
    lens_t = torch.tensor([len(p) for p in prompts])
    return Rollouts(tokens, hidden, lens_t, lens_t + gen_len, tuple(layers))


@torch.no_grad()
def offline_accept_length(drafter: DsparkDrafter, data: Rollouts, gamma: int) -> float:
    """Committed tokens per verify step of greedy chain speculation (no acceptance control)
    replayed on ``data``: the first anchor at each prompt's end, drafts picked as at inference,
    accepted = the longest prefix equal to the continuation, advance by accepted + 1, while
    the continuation has a token past the anchor."""
    steps = tokens = 0
    for b in range(len(data)):
        p, s = int(data.prompt_lens[b]), int(data.lengths[b])
        anchors = torch.arange(p, s - 1, device=data.tokens.device)
        one = data.select(torch.tensor([b]))
        base = block_logits_dense(drafter, one.tokens, one.hidden, anchors, gamma)[0]
        seq = data.tokens[b]
        n = p
        while n < s - 1:
            drafts = drafter.pick(base[n - p][None], seq[n : n + 1])[0]
            truth = seq[n + 1 : n + 1 + gamma]
            ok = (drafts[: truth.shape[0]] == truth).long()
            accepted = int(ok.cumprod(0).sum())
            steps += 1
            tokens += accepted + 1
            n += accepted + 1
    return tokens / steps if steps else 0.0


@torch.no_grad()
def confidence_calibration(drafter: DsparkDrafter, data: Rollouts, gamma: int) -> Calibration:
    """The confidence head of ``drafter`` on ``data``: every anchor from each prompt's end,
    every block row whose target exists (module docstring). ``ValueError`` without a head."""
    if not drafter.config.confidence:
        raise ValueError("confidence_calibration: the drafter has no confidence head")
    # passes of a few sequences and a bounded number of anchors: long held-out sequences
    # would otherwise hold every anchor's block logits at once
    rows = 8
    vocab = drafter.config.out_vocab
    surv, acc = [], []
    bce_sum = 0.0
    n = 0
    for start in range(0, len(data), rows):
        part = data.select(torch.arange(start, min(len(data), start + rows)))
        first, last = int(part.prompt_lens.min()), int(part.lengths.max()) - 1
        for anchors in anchor_chunks(first, last, rows, gamma, vocab, part.tokens.device):
            out = distill_losses(
                drafter, part.tokens, part.hidden, anchors, gamma, part.prompt_lens, part.lengths
            )
            if not out.n:
                continue
            surv.append(out.survival[out.valid].double().cpu())
            acc.append(out.accepted[out.valid].double().cpu())
            bce_sum += float(out.bce) * out.n
            n += out.n
    if not n:
        raise ValueError("confidence_calibration: no block row of data has a target")
    s, y = torch.cat(surv), torch.cat(acc)
    bins = torch.clamp((s * 10).long(), max=9)
    ece = 0.0
    for k in range(10):
        m = bins == k
        if m.any():
            ece += float(m.sum()) / len(s) * abs(float(s[m].mean() - y[m].mean()))
    return Calibration(bce_sum / n, ece, float(y.mean()), float(s.mean()), n)


def _set_trainable(drafter: DsparkDrafter, on: bool) -> None:
    for p in drafter.parameters():
        p.requires_grad_(on)


def copy_drafter(drafter: DsparkDrafter, **changes) -> DsparkDrafter:
    """A copy of ``drafter`` (same shared embedding and LM head) whose config has
    ``changes`` (e.g. ``dtype``, ``gamma``); weights are cast to the new config's dtype."""
    config = dataclasses.replace(drafter.config, **changes)
    d2t = drafter.d2t if drafter.config.reduced else None
    out = DsparkDrafter(config, drafter.embed, drafter.lm_head, seed=drafter.seed, d2t=d2t)
    for p, q in zip(out.parameters(), drafter.parameters(), strict=True):
        p.data = q.detach().to(config.dtype).clone()
    return out


def distill(
    target: CausalLM,
    cfg: DistillConfig,
    *,
    drafter: DsparkDrafter | None = None,
    prompts: list[list[int]] | None = None,
    log: Callable[[str], None] | None = None,
) -> DistillResult:
    """Train ``drafter`` (default: :func:`draft_config_for` the target, seeded from
    ``cfg.seed + 17`` as the untrained drafter of ``validate``) on the target's greedy
    continuations of ``prompts`` (default: ``cfg.prompts`` random ones of ``cfg.prompt_len``
    tokens). Returns a new drafter in the target's dtype with ``config.gamma = cfg.gamma``;
    the given drafter is not modified."""
    start = time.perf_counter()
    c = target.config
    sixteen = c.dtype in (torch.bfloat16, torch.float16)
    train_dtype = torch.float32 if sixteen else c.dtype
    if drafter is None:
        dc = draft_config_for(c, num_layers=cfg.draft_layers)
        drafter = DsparkDrafter(dc, target.embed_weight, target.lm_head_weight, seed=cfg.seed + 17)
    student = copy_drafter(drafter, dtype=train_dtype)
    layers = student.config.target_layers
    vocab = c.vocab_size
    head = student.config.confidence and cfg.head_steps > 0
    head_p = None
    if prompts is None:
        prompts = random_prompts(cfg.prompts, cfg.prompt_len, vocab, cfg.seed + 1000)
        if head:
            head_p = random_prompts(cfg.head_prompts, cfg.prompt_len, vocab, cfg.seed + 4000)
    elif head:  # given prompts: the last eighth calibrates the head
        cut = max(1, len(prompts) // 8) if len(prompts) > 1 else 0
        if cut:
            prompts, head_p = prompts[:-cut], prompts[-cut:]
        else:
            head_p = prompts
    data = greedy_rollouts(target, prompts, cfg.gen_len, layers)
    head_data = greedy_rollouts(target, head_p, cfg.gen_len, layers) if head else None
    held = None
    if cfg.eval_prompts:
        eval_p = random_prompts(cfg.eval_prompts, cfg.prompt_len, vocab, cfg.seed + 2000)
        held = greedy_rollouts(target, eval_p, cfg.gen_len, layers)
    result = DistillResult(student)
    if held is not None:
        result.accept_before = offline_accept_length(student, held, cfg.gamma)
        _log(log, f"held-out accept length before: {result.accept_before:.3f}")
        if student.config.confidence:
            result.calibration_before = confidence_calibration(student, held, cfg.gamma)
            _log(log, f"held-out confidence before: {_calib(result.calibration_before)}")
    dev = target.device
    g = torch.Generator().manual_seed(cfg.seed + 3000)
    first = int(data.prompt_lens.min())
    last = int(data.lengths.max()) - 1  # anchors < last: one target at least
    all_anchors = torch.arange(first, last)
    _set_trainable(student, True)
    try:
        opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
        named = list(student.named_parameters())
        head_params = [p for n, p in named if n.startswith("conf_")]
        body = [p for n, p in named if not n.startswith("conf_")]
        warm = max(1, cfg.steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: (
                min(1.0, (s + 1) / warm)
                * 0.5
                * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
            ),
        )
        for step in range(cfg.steps):
            idx = torch.randperm(len(data), generator=g)[: cfg.batch]
            batch = data.select(idx.to(data.tokens.device))
            anchors = all_anchors
            if cfg.anchors_per_step is not None and cfg.anchors_per_step < len(all_anchors):
                pick = torch.randperm(len(all_anchors), generator=g)[: cfg.anchors_per_step]
                anchors = all_anchors[pick.sort().values]
            out = distill_losses(
                student,
                batch.tokens,
                batch.hidden,
                anchors.to(dev),
                cfg.gamma,
                batch.prompt_lens,
                batch.lengths,
            )
            opt.zero_grad(set_to_none=True)
            (out.ce + out.bce).backward()
            # the head clipped on its own: the drafter trains as it would without it
            torch.nn.utils.clip_grad_norm_(body, 1.0)
            if head_params:
                torch.nn.utils.clip_grad_norm_(head_params, 1.0)
            opt.step()
            sched.step()
            result.losses.append(float(out.ce.detach()))
            if student.config.confidence:
                result.bce_losses.append(float(out.bce.detach()))
            if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                bce = ""
                if student.config.confidence:
                    bce = f"  confidence bce {result.bce_losses[-1]:.4f}"
                _log(log, f"step {step:5d}  loss {result.losses[-1]:.4f}{bce}")
        if head_data is not None:
            _train_head(student, head_data, cfg, g, result, log)
    finally:
        _set_trainable(student, False)
    if held is not None:
        result.accept_after = offline_accept_length(student, held, cfg.gamma)
        _log(log, f"held-out accept length after:  {result.accept_after:.3f}")
        if student.config.confidence:
            result.calibration_after = confidence_calibration(student, held, cfg.gamma)
            _log(log, f"held-out confidence after:  {_calib(result.calibration_after)}")
    result.drafter = copy_drafter(student, dtype=c.dtype, gamma=cfg.gamma)
    result.seconds = time.perf_counter() - start
    return result


def _train_head(
    student: DsparkDrafter,
    data: Rollouts,
    cfg: DistillConfig,
    g: torch.Generator,
    result: DistillResult,
    log: Callable[[str], None] | None,
) -> None:
    """``cfg.head_steps`` Adam steps of the confidence head alone on the final drafter's
    survival targets over ``data`` (held out of the drafter's training; batches drawn as in
    the main loop; the body frozen)."""
    all_anchors = torch.arange(int(data.prompt_lens.min()), int(data.lengths.max()) - 1)
    head = [p for n, p in student.named_parameters() if n.startswith("conf_")]
    for n, p in student.named_parameters():
        p.requires_grad_(n.startswith("conf_"))
    opt = torch.optim.Adam(head, lr=cfg.lr)
    dev = data.tokens.device
    for step in range(cfg.head_steps):
        idx = torch.randperm(len(data), generator=g)[: cfg.batch]
        batch = data.select(idx.to(dev))
        anchors = all_anchors
        if cfg.anchors_per_step is not None and cfg.anchors_per_step < len(all_anchors):
            pick = torch.randperm(len(all_anchors), generator=g)[: cfg.anchors_per_step]
            anchors = all_anchors[pick.sort().values]
        out = distill_losses(
            student, batch.tokens, batch.hidden, anchors.to(dev), cfg.gamma,
            batch.prompt_lens, batch.lengths,
        )  # fmt: skip
        opt.zero_grad(set_to_none=True)
        out.bce.backward()
        torch.nn.utils.clip_grad_norm_(head, 1.0)
        opt.step()
        result.bce_losses.append(float(out.bce.detach()))
        if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.head_steps - 1):
            _log(log, f"head step {step:4d}  confidence bce {result.bce_losses[-1]:.4f}")


def _calib(c: Calibration) -> str:
    return (
        f"bce {c.bce:.4f}, ece {c.ece:.4f}, mean survival {c.mean_survival:.3f} vs "
        f"base rate {c.base_rate:.3f} ({c.n} drafts)"
    )


def _log(log: Callable[[str], None] | None, msg: str) -> None:
    if log is not None:
        log(msg)


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    d = DistillConfig()
    p = argparse.ArgumentParser(
        prog="python -m unimem.training.distill",
        description="train a DSPARK drafter on the target's own greedy continuations and "
        "write it as a drafter checkpoint directory",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model-path",
        help="the target: a HuggingFace checkpoint directory, a .gguf file or gemma-3-270m",
    )
    src.add_argument("--preset", help="the target: a synthetic preset (tiny, small), seeded")
    p.add_argument("--out", required=True, help="the drafter checkpoint directory to write")
    p.add_argument(
        "--init",
        metavar="DIR",
        help="start from this drafter checkpoint (default: a fresh seeded drafter)",
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument(
        "--prompts",
        default=str(d.prompts),
        help="N random prompts, or FILE: one text prompt per line (needs --model-path, "
        "encoded by its tokenizer)",
    )
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--gen-len", type=int, default=d.gen_len, help="continuation tokens")
    p.add_argument("--gamma", type=int, default=d.gamma, help="drafted tokens per block")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch", type=int, default=d.batch, help="continuations per step")
    p.add_argument("--anchors-per-step", type=int, default=d.anchors_per_step)
    p.add_argument("--draft-layers", type=int, default=d.draft_layers)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument(
        "--head-steps",
        type=int,
        default=d.head_steps,
        help="steps training only the confidence head after the drafter's (0: none)",
    )
    p.add_argument(
        "--head-prompts",
        type=int,
        default=d.head_prompts,
        help="random prompts held out of the drafter's training to calibrate the head",
    )
    p.add_argument("--log-every", type=int, default=d.log_every, help="0: no progress lines")
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="the preset's weights (as validate --seed), the prompts and the drafter's init",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="auto", help="with --model-path: the target's dtype")
    p.add_argument("--cpu-threads", type=int, default=1)
    return p


def _load_target(args: argparse.Namespace):
    device = torch.device(args.device)
    if args.model_path is None:
        from unimem.models.presets import preset
        from unimem.models.synthetic import HybridModel

        return HybridModel(preset(args.preset), seed=args.seed, device=device), None
    from unimem.models.loader import load_checkpoint

    ckpt = load_checkpoint(args.model_path, dtype=args.dtype, device=device)
    return ckpt.model, ckpt.tokenizer


def _prompts(args: argparse.Namespace, tokenizer) -> tuple[int, list[list[int]] | None]:
    if args.prompts.isdigit():
        return int(args.prompts), None
    if tokenizer is None:
        raise ValueError(f"--prompts {args.prompts}: text prompts need a --model-path tokenizer")
    try:
        with open(args.prompts) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"--prompts {args.prompts}: {e.strerror}") from e
    if not lines:
        raise ValueError(f"--prompts {args.prompts}: no prompts")
    return len(lines), [tokenizer.encode(t) for t in lines]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "cpu" and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda given but no CUDA device is available")
        target, tokenizer = _load_target(args)
        n, prompts = _prompts(args, tokenizer)
        cfg = DistillConfig(
            steps=args.steps,
            prompts=n,
            prompt_len=args.prompt_len,
            gen_len=args.gen_len,
            gamma=args.gamma,
            lr=args.lr,
            batch=args.batch,
            anchors_per_step=args.anchors_per_step,
            seed=args.seed,
            eval_prompts=args.eval_prompts,
            draft_layers=args.draft_layers,
            log_every=args.log_every,
            head_steps=args.head_steps,
            head_prompts=args.head_prompts,
        )
        init = load_drafter(args.init, target) if args.init else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = distill(target, cfg, drafter=init, prompts=prompts, log=print)
    save_drafter(result.drafter, args.out)
    print(
        f"wrote {args.out} ({result.seconds:.1f} s; loss {result.losses[0]:.4f} -> "
        f"{result.losses[-1]:.4f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
