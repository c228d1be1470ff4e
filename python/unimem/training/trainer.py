"""Drafter training at GPU scale, on sequences the target wrote (:mod:`.teacher_forcing`).

:func:`train_drafter` trains a :class:`~unimem.speculative.drafter.DsparkDrafter` with the
distillation objective of :mod:`unimem.training.train_forward` (the block of every
sampled anchor predicts the target's next ``gamma`` tokens; the Markov bias of the
teacher-forced previous token; the confidence head by binary cross-entropy, detached):

* float32 master weights, the forward under bf16 autocast on CUDA (``bf16``);
* ``batch`` sequences and ``anchors_per_step`` anchors per step, AdamW, gradient clipping
  (the confidence head on its own), learning rate: linear warm-up over ``warmup`` steps,
  then a cosine to zero over the run — the run's progress being the larger of
  ``step / steps`` and ``elapsed / time_budget_s`` (seconds of the training loop, from
  after the first evaluation, summed over the processes of a resumed run), so a
  time-budgeted run still anneals — and a resumed one goes on down its cosine instead of
  warming back up;
* evaluation on held-out sequences every ``eval_every`` steps and at the end:
  :func:`offline_accept_lengths` (the engine's greedy chain schedule replayed offline, no
  acceptance control);
* resumable: with ``checkpoint_dir`` the student, the optimiser, the step, the training
  loop's seconds so far, the batch generator and the history are saved every
  ``save_every`` steps (atomically) and a run with the same directory continues from
  there: both budgets (``steps``, ``time_budget_s``) count the whole run, so a resumed run
  whose budget is spent trains no further (raise a budget to train on);
* a progress line (``\\r``-updated on a terminal, a line every ~2 % otherwise);
* afterwards ``head_steps`` steps of the confidence head alone on ``calibration``
  sequences held out of the drafter's own data (the head must learn the final drafter's
  out-of-sample survival), then its calibration on the held-out set.

:func:`frequent_tokens` picks a reduced draft vocabulary (``d2t``): the ``k`` target
tokens most frequent in the continuations, most frequent first.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unimem.speculative.drafter import DsparkDrafter
from unimem.training import distill
from unimem.training.distill import (
    Calibration,
    Rollouts,
    confidence_calibration,
    copy_drafter,
)
from unimem.training.train_forward import SOFT_LOSSES, block_logits_dense, distill_losses

__all__ = [
    "TrainConfig",
    "TrainResult",
    "frequent_tokens",
    "offline_accept_by_position",
    "offline_accept_lengths",
    "train_drafter",
]

STATE_NAME = "train_state.pt"


@dataclass
class TrainConfig:
    """Settings of :func:`train_drafter` (module docstring)."""

    steps: int = 2000
    batch: int = 64
    anchors_per_step: int | None = 64
    gamma: int = 7
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.0
    bf16: bool = True
    eval_every: int = 250
    save_every: int = 250
    checkpoint_dir: str | None = None
    time_budget_s: float | None = None
    head_steps: int = 200
    head_lr: float = 3e-3
    seed: int = 0
    progress: bool = True
    soft_weight: float = 0.0
    """Weight of the soft-target cross-entropy (needs the data's ``soft_ids``/``soft_probs``;
    :func:`~unimem.training.train_forward.distill_losses`); 0: the tokens alone."""
    position_decay: float = 1.0
    """Block column ``i``'s cross-entropy weighs ``position_decay ** i``
    (:func:`~unimem.training.train_forward.distill_losses`); 1: every column alike."""
    soft_temperature: float = 1.0
    """The temperature the soft term compares the distributions at (1: as the target wrote
    them; the temperature users sample at to train for speculative sampling)."""
    soft_loss: str = "ce"
    """The soft term: ``"ce"`` (cross-entropy) or ``"tv"`` (total variation, the rejection
    probability of speculative sampling)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "gamma", "eval_every", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("warmup", "head_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {v!r}")
        if self.anchors_per_step is not None and self.anchors_per_step < 1:
            raise ValueError("TrainConfig.anchors_per_step must be None or >= 1")
        if not self.lr > 0 or not self.head_lr > 0:
            raise ValueError("TrainConfig.lr and head_lr must be > 0")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"TrainConfig.soft_weight must be in [0, 1], got {self.soft_weight}")
        d = self.position_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
            raise ValueError(f"TrainConfig.position_decay must be in (0, 1], got {d!r}")
        if self.soft_loss not in SOFT_LOSSES:
            raise ValueError(f"TrainConfig.soft_loss must be one of {SOFT_LOSSES}")
        t = self.soft_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"TrainConfig.soft_temperature must be > 0, got {t!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"TrainConfig.time_budget_s must be > 0, got {self.time_budget_s}")


@dataclass
class TrainResult:
    """``drafter``: the trained drafter in the target's dtype, ``config.gamma`` set;
    ``history``: one dict per logged step (``step``, ``loss``, ``bce``, ``lr``, and at
    evaluations ``accept_length``); ``accept_before`` / ``accept_after``: held-out offline
    accept lengths; ``calibration``: the confidence head on the held-out set (None without
    one); ``steps_done``; ``stopped_by``: ``"steps"`` or ``"time"``; ``seconds``."""

    drafter: DsparkDrafter
    history: list[dict] = field(default_factory=list)
    accept_before: float | None = None
    accept_after: float | None = None
    calibration: Calibration | None = None
    steps_done: int = 0
    stopped_by: str = "steps"
    seconds: float = 0.0


def frequent_tokens(data: Rollouts, k: int, vocab: int) -> torch.Tensor:
    """``[k]`` int64: the ``k`` target tokens most frequent in the continuations of ``data``
    (positions ``prompt_lens .. lengths``), most frequent first (ties: lower id first);
    tokens never seen fill the rest in id order. ``ValueError`` unless ``1 <= k <= vocab``."""
    if not 1 <= k <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}], got {k}")
    s = data.tokens.shape[1]
    pos = torch.arange(s)[None, :]
    mask = (pos >= data.prompt_lens[:, None]) & (pos < data.lengths[:, None])
    counts = torch.bincount(data.tokens.cpu()[mask], minlength=vocab)[:vocab].double()
    # a stable descending sort keeps lower ids first among equal counts
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:k].clone()


@torch.no_grad()
def _replay(
    drafter: DsparkDrafter, data: Rollouts, gamma: int, rows_per_pass: int
) -> list[tuple[int, int]]:
    """``(output position, accepted drafts)`` of every verify step of greedy chain
    speculation replayed on ``data`` (:func:`offline_accept_lengths`)."""
    out: list[tuple[int, int]] = []
    n = len(data)
    vocab = drafter.config.out_vocab
    for start in range(0, n, rows_per_pass):
        part = data.select(torch.arange(start, min(n, start + rows_per_pass)))
        first = int(part.prompt_lens.min())
        last = int(part.lengths.max()) - 1
        if last <= first:
            continue
        s = last + gamma + 1
        tokens = part.tokens[:, : min(s, part.tokens.shape[1])]
        hidden = [h[:, : tokens.shape[1]] for h in part.hidden]
        b = tokens.shape[0]
        chunks = []
        for anchors in distill.anchor_chunks(first, last, b, gamma, vocab, tokens.device):
            base = block_logits_dense(drafter, tokens, hidden, anchors, gamma)
            a = base.shape[1]
            picks = drafter.pick(base.reshape(b * a, gamma, -1), tokens[:, anchors].reshape(-1))
            chunks.append(picks.reshape(b, a, gamma).cpu())
        picks = torch.cat(chunks, dim=1)
        toks = part.tokens.cpu()
        for i in range(b):
            p, end = int(part.prompt_lens[i]), int(part.lengths[i])
            pos = p
            while pos < end - 1:
                truth = toks[i, pos + 1 : min(end, pos + 1 + gamma)]
                drafts = picks[i, pos - first, : truth.shape[0]]
                accepted = int((drafts == truth).long().cumprod(0).sum())
                out.append((pos - p, accepted))
                pos += accepted + 1
    return out


def offline_accept_lengths(
    drafter: DsparkDrafter, data: Rollouts, gamma: int, rows_per_pass: int = 16
) -> float:
    """Committed tokens per verify step of greedy chain speculation on ``data`` (as
    :func:`unimem.training.distill.offline_accept_length`: the first anchor at each
    prompt's end, accept the longest matching prefix, advance by accepted + 1), with the
    drafts of every anchor computed in batched passes of ``rows_per_pass`` sequences (and
    anchor chunks, :func:`~unimem.training.distill.anchor_chunks`) and the replay on the
    host."""
    steps = _replay(drafter, data, gamma, rows_per_pass)
    return _committed_per_step([a for _, a in steps])


def _committed_per_step(accepted: list[int]) -> float:
    """Tokens committed per verify step (accepted drafts + 1), 0 for no step."""
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0


def offline_accept_by_position(
    drafter: DsparkDrafter,
    data: Rollouts,
    gamma: int,
    edges: tuple[int, ...] = (0, 64, 128, 256, 512, 1024),
    rows_per_pass: int = 16,
) -> dict[str, dict]:
    """:func:`offline_accept_lengths` by where the verify step starts in the output: for each
    bucket ``[edges[k], edges[k + 1])`` (the last one open) its accept length and verify
    steps, keyed ``"lo-hi"`` (``"lo-"`` for the last); ``"all"`` over every step. Empty
    buckets are left out. A drafter that only met short contexts in training shows it here
    (its accept length falls in the late buckets)."""
    if not edges or edges[0] != 0 or list(edges) != sorted(set(edges)):
        raise ValueError(f"edges must start at 0 and increase, got {edges}")
    steps = _replay(drafter, data, gamma, rows_per_pass)
    out: dict[str, dict] = {}
    if steps:
        out["all"] = {"accept": _committed_per_step([a for _, a in steps]), "steps": len(steps)}
    for k, lo in enumerate(edges):
        hi = edges[k + 1] if k + 1 < len(edges) else None
        got = [a for pos, a in steps if pos >= lo and (hi is None or pos < hi)]
        if got:
            key = f"{lo}-{'' if hi is None else hi - 1}"
            out[key] = {"accept": _committed_per_step(got), "steps": len(got)}
    return out


class _Progress:
    """A one-line progress report on stderr (module docstring)."""

    def __init__(self, total: int, on: bool) -> None:
        self.total, self.on = total, on
        self.tty = on and sys.stderr.isatty()
        self.every = max(1, total // 50)
        self.start = time.perf_counter()

    def update(self, step: int, text: str) -> None:
        if not self.on:
            return
        if not self.tty and step % self.every and step != self.total:
            return
        el = time.perf_counter() - self.start
        frac = step / self.total
        bar = "#" * int(30 * frac)
        line = f"[{bar:<30}] {step}/{self.total} {el:6.1f}s {text}"
        if self.tty:
            sys.stderr.write("\r" + line)
            if step == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _batch(data: Rollouts, idx: torch.Tensor, gamma: int) -> Rollouts:
    """Rows ``idx`` of ``data``, trimmed to the longest of them (plus the block)."""
    part = data.select(idx)
    width = min(part.tokens.shape[1], int(part.lengths.max()) + gamma)
    return Rollouts(
        part.tokens[:, :width],
        [h[:, :width] for h in part.hidden],
        part.prompt_lens,
        part.lengths,
        part.layers,
        None if part.soft_ids is None else part.soft_ids[:, :width],
        None if part.soft_probs is None else part.soft_probs[:, :width],
    )


def _with_states(part: Rollouts, states: Callable[[Rollouts], Rollouts] | None) -> Rollouts:
    """``part`` itself when it carries its states, else ``states(part)``."""
    if part.hidden:
        return part
    if states is None:
        raise ValueError("a batch without hidden states and no states function")
    return states(part)


def _anchors(part: Rollouts, count: int | None, g: torch.Generator) -> torch.Tensor:
    first, last = int(part.prompt_lens.min()), int(part.lengths.max()) - 1
    all_anchors = torch.arange(first, max(first + 1, last))
    if count is not None and count < len(all_anchors):
        pick = torch.randperm(len(all_anchors), generator=g)[:count]
        all_anchors = all_anchors[pick.sort().values]
    return all_anchors


def _lr_factor(cfg: TrainConfig, step: int, elapsed: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else 1.0
    progress = step / cfg.steps
    if cfg.time_budget_s is not None:
        progress = max(progress, elapsed / cfg.time_budget_s)
    return warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _save_state(path: Path, state: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (STATE_NAME + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path / STATE_NAME)


def train_drafter(
    drafter: DsparkDrafter,
    train: Rollouts,
    held: Rollouts | None,
    cfg: TrainConfig,
    *,
    calibration: Rollouts | None = None,
    states: Callable[[Rollouts], Rollouts] | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train a copy of ``drafter`` on ``train`` (module docstring); ``held`` held-out
    sequences for the accept length and the head's calibration; ``calibration`` the head's
    own sequences (default: ``train``). The given drafter is not modified. The sequences'
    hidden states must be of ``drafter.config.target_layers``: stored in ``train``, or, for
    text kept as tokens alone (``train.hidden`` empty:
    :func:`~unimem.training.teacher_forcing.tokens_only`), computed for each drawn batch by
    ``states`` (e.g. :func:`~unimem.training.teacher_forcing.states_of` of the target; it
    returns the batch with its states, and its soft targets when ``cfg.soft_weight > 0``)."""
    t0 = time.perf_counter()
    if tuple(train.layers) != tuple(drafter.config.target_layers):
        raise ValueError(
            f"training data has the states of layers {train.layers}, the drafter reads "
            f"{drafter.config.target_layers}"
        )
    if not train.hidden and states is None:
        raise ValueError("training data without hidden states needs a states function")
    if cfg.soft_weight > 0 and train.soft_ids is None and states is None:
        raise ValueError("TrainConfig.soft_weight > 0 needs soft targets in the training data")

    def soft(part: Rollouts) -> tuple[torch.Tensor, torch.Tensor] | None:
        if cfg.soft_weight <= 0 or part.soft_ids is None:
            return None
        return part.soft_ids, part.soft_probs

    dev = train.tokens.device
    dtype = drafter.config.dtype
    master = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    student = copy_drafter(drafter, dtype=master)
    autocast = cfg.bf16 and dev.type == "cuda"
    result = TrainResult(student)
    g = torch.Generator().manual_seed(cfg.seed + 3000)
    named = list(student.named_parameters())
    head = [p for n, p in named if n.startswith("conf_")]
    body = [p for n, p in named if not n.startswith("conf_")]
    opt = torch.optim.AdamW(
        [{"params": body}, {"params": head}], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    step = 0
    trained_s = 0.0  # training-loop seconds of the processes before this one (resume)
    ckpt = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if ckpt is not None and (ckpt / STATE_NAME).is_file():
        # loaded on the CPU: the generator's state must stay a CPU ByteTensor (mapped onto
        # a GPU, set_state refuses it); the module and the optimizer copy their tensors onto
        # their parameters' device
        state = torch.load(ckpt / STATE_NAME, map_location="cpu", weights_only=False)
        student.load_state_dict(state["student"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step = state["step"]
        trained_s = float(state.get("trained_s", 0.0))
        result.history = state["history"]
        result.accept_before = state.get("accept_before")
        _log(log, f"resumed from {ckpt / STATE_NAME} at step {step} ({trained_s:.0f} s trained)")

    def evaluate() -> float | None:
        if held is None:
            return None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            return offline_accept_lengths(student, held, cfg.gamma)

    if result.accept_before is None:
        result.accept_before = evaluate()
        if result.accept_before is not None:
            _log(log, f"held-out accept length before: {result.accept_before:.3f}")
    t_loop = time.perf_counter()  # the time budget counts from here (after the first eval)
    bar = _Progress(cfg.steps, cfg.progress)
    for p in student.parameters():
        p.requires_grad_(True)
    last_eval = None
    try:
        while step < cfg.steps:
            elapsed = trained_s + time.perf_counter() - t_loop
            if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
                result.stopped_by = "time"
                break
            lr = cfg.lr * _lr_factor(cfg, step, elapsed)
            for group in opt.param_groups:
                group["lr"] = lr
            idx = torch.randperm(len(train), generator=g)[: cfg.batch]
            part = _with_states(_batch(train, idx, cfg.gamma), states)
            anchors = _anchors(part, cfg.anchors_per_step, g).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                out = distill_losses(
                    student, part.tokens, part.hidden, anchors, cfg.gamma,
                    part.prompt_lens, part.lengths, soft=soft(part),
                    soft_weight=cfg.soft_weight, position_decay=cfg.position_decay,
                    soft_temperature=cfg.soft_temperature, soft_loss=cfg.soft_loss,
                )  # fmt: skip
            opt.zero_grad(set_to_none=True)
            (out.ce + out.bce).backward()
            torch.nn.utils.clip_grad_norm_(body, 1.0)
            if head:
                torch.nn.utils.clip_grad_norm_(head, 1.0)
            opt.step()
            step += 1
            entry = {
                "step": step,
                "loss": out.ce.detach().item(),
                "bce": out.bce.detach().item(),
                "lr": lr,
            }
            if step % cfg.eval_every == 0 or step == cfg.steps:
                last_eval = evaluate()
                entry["accept_length"] = last_eval
            result.history.append(entry)
            acc = "" if last_eval is None else f" accept {last_eval:.3f}"
            bar.update(step, f"loss {entry['loss']:.4f} lr {lr:.2e}{acc}")
            if ckpt is not None and (step % cfg.save_every == 0 or step == cfg.steps):
                _save_state(
                    ckpt,
                    {
                        "step": step,
                        "trained_s": trained_s + time.perf_counter() - t_loop,
                        "student": student.state_dict(),
                        "optimizer": opt.state_dict(),
                        "generator": g.get_state(),
                        "history": result.history,
                        "accept_before": result.accept_before,
                    },
                )
        bar.close()
        if head and cfg.head_steps:
            _train_head(student, calibration or train, cfg, g, autocast, states, log)
    finally:
        for p in student.parameters():
            p.requires_grad_(False)
    result.steps_done = step
    result.accept_after = evaluate()
    if result.accept_after is not None:
        _log(log, f"held-out accept length after {step} steps: {result.accept_after:.3f}")
    if held is not None and student.config.confidence:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            result.calibration = confidence_calibration(student, held, cfg.gamma)
    result.drafter = copy_drafter(student, dtype=dtype, gamma=cfg.gamma)
    result.seconds = time.perf_counter() - t0
    return result


def _train_head(
    student: DsparkDrafter,
    data: Rollouts,
    cfg: TrainConfig,
    g: torch.Generator,
    autocast: bool,
    states: Callable[[Rollouts], Rollouts] | None,
    log: Callable[[str], None] | None,
) -> None:
    """``cfg.head_steps`` Adam steps of the confidence head alone (the body frozen) on the
    final drafter's survival targets over ``data``."""
    head = [p for n, p in student.named_parameters() if n.startswith("conf_")]
    for n, p in student.named_parameters():
        p.requires_grad_(n.startswith("conf_"))
    opt = torch.optim.Adam(head, lr=cfg.head_lr)
    dev = data.tokens.device
    bce = float("nan")
    for _ in range(cfg.head_steps):
        idx = torch.randperm(len(data), generator=g)[: cfg.batch]
        part = _with_states(_batch(data, idx, cfg.gamma), states)
        anchors = _anchors(part, cfg.anchors_per_step, g).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            out = distill_losses(
                student, part.tokens, part.hidden, anchors, cfg.gamma,
                part.prompt_lens, part.lengths,
            )  # fmt: skip
        opt.zero_grad(set_to_none=True)
        out.bce.backward()
        torch.nn.utils.clip_grad_norm_(head, 1.0)
        opt.step()
        bce = out.bce.detach().item()
    _log(log, f"confidence head: {cfg.head_steps} steps, last bce {bce:.4f}")


def _log(log: Callable[[str], None] | None, msg: str) -> None:
    if log is not None:
        log(msg)
