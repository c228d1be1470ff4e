"""Train a DSPARK drafter for a model in one command: ``python -m unimem.training.train_drafter``.

1. **Data** (:mod:`unimem.training.draft_data`): prompts sampled from the target itself from
   ``<bos>`` at temperature 1 (``--bos-prompts`` of ``--prompt-len`` tokens), plus the
   prompts of ``--train-prompts`` (its ``--train-split``, never the held-out one); each
   continued by the target through unimem's Engine, batched, greedy and sampled
   (``--temperatures``, default 0, 0.7 and 1.0 in turn), ``--gen-len`` tokens, in rounds of
   ``--gen-chunk`` prompts until all are done or ``--gen-time-budget`` is spent; the engine
   admits new prompts in batches (its prefill delayer, ``--gen-delay-passes``), since
   continuations end at ``<eos>`` a few at a time. The held-out
   prompts (``--eval-prompts``, ``--eval-split``) get greedy continuations of ``--eval-len``
   tokens, longer than the training text: the yardstick, never trained on.
2. **States**: the target's residual streams at the drafter's ``--target-layers``,
   recomputed by batched teacher-forced passes over the finished sequences
   (:mod:`unimem.training.teacher_forcing`) — all at once and stored (``--states stored``),
   or for each training batch as it is drawn (``--states per-batch``: the text kept as
   tokens, no limit from device memory on how much of it there is); ``auto`` stores them
   when they take at most a quarter of the device's memory.
3. **Vocabulary**: with ``--draft-vocab K`` the drafter scores only the ``K`` target tokens
   most frequent in the training continuations (``d2t``, EAGLE-3's reduced vocabulary).
4. **Training** (:mod:`unimem.training.trainer`): bf16 autocast on CUDA, warm-up and
   cosine, held-out accept length during training, resumable (``--checkpoint-dir``),
   ``--time-budget`` seconds at most; then the confidence head on sequences held out of
   the drafter's own data. With ``--soft-top-k K`` each block row also learns the target's
   own next-token distribution (its ``K`` most probable tokens, from the teacher-forced
   pass) with ``--soft-weight`` of the loss: on greedy text that is the verifier's
   distribution at every row, far more signal per position than its one token.
5. **Output**: the drafter checkpoint directory ``--out`` (``config.json``,
   ``model.safetensors``) and ``training.json`` beside them (the command line, the data
   sizes, the phases' seconds — the generating engine's start-up apart — and the
   continuations' tokens per second, accept lengths before/after, the head's calibration).

``--text-cache FILE``: the training text of step 1 is written to ``FILE`` (token ids, prompt
lengths, the command and counts that made it) when ``FILE`` does not exist, and read from it
instead of generated when it does — generation is the costly step, so recipe variants
(draft layers, target layers, Markov rank, vocabulary, gamma) train on the same text, each
run a few seconds of teacher forcing instead of minutes of generation. The held-out
continuations are always generated (a few dozen). A cache made for another model (another
vocabulary or model path) is refused.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unimem.engine.api import Engine, startup_line
from unimem.engine.args import DEFAULT_CUDA_MAX_RUNNING
from unimem.engine.prefill_delay import DEFAULT_MAX_DELAY_PASSES
from unimem.models.base import CausalLM
from unimem.speculative.checkpoint import read_config, save_drafter
from unimem.speculative.drafter import (
    DsparkDrafter,
    draft_config_for,
    with_context_window,
    with_extra_layers,
)
from unimem.training.draft_data import bos_prompts, continuations, encode_prompts
from unimem.training.prompt_sets import read_prompts
from unimem.training.teacher_forcing import states_of, teacher_forced_states, tokens_only
from unimem.training.train_forward import SOFT_LOSSES
from unimem.training.trainer import TrainConfig, frequent_tokens, train_drafter

__all__ = [
    "TargetText",
    "generate",
    "load_text",
    "main",
    "parser",
    "run",
    "save_text",
    "train_on",
]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers, comma-separated: {text!r}") from None


DEFAULT_GEN_GRAPH_BS = "1,8,64,256"
"""``--gen-graph-bs``: the generating engine's CUDA-graph batch sizes (with its batch limit).
Its batches are full most of the time; the default buckets (67 sizes up to 512 lanes, five
step kinds each) took 81 s of its start on an H100 (2026-12-07)."""

DEFAULT_CONTEXT_WINDOW = 128
"""The draft layers' window by default (``--context-window``): within the training sequences
of the defaults (``--prompt-len`` 32 + ``--gen-len`` 160) and of the shipped Gemma 3 drafter
(24 + 128), and measured on that drafter (``with_context_window``'s docstring)."""


def context_window(args: argparse.Namespace) -> int | None:
    """The draft layers' context window of this run (``--context-window``; None: ``0``, the
    alternating FULL/SWA layout with unbounded FULL layers). ``ValueError`` for a negative
    window."""
    w = args.context_window
    if w is None:
        return DEFAULT_CONTEXT_WINDOW
    if w < 0:
        raise ValueError(f"--context-window must be >= 0, got {w}")
    return w or None


def parser() -> argparse.ArgumentParser:
    t = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m unimem.training.train_drafter", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model-path", required=True, help="the target (as Engine's model_path)")
    p.add_argument("--out", required=True, help="the drafter checkpoint directory to write")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--bos-prompts", type=int, default=4096, help="prompts sampled from <bos>")
    g.add_argument("--prompt-len", type=int, default=32, help="tokens of a <bos> prompt")
    g.add_argument("--bos-id", type=int, default=None, help="default: the tokenizer's")
    g.add_argument("--train-prompts", help="a prompt file (training.prompt_sets) to add")
    g.add_argument("--train-split", help="its split to use (a file with splits)")
    g.add_argument("--max-prompt-len", type=int, default=256, help="file prompts cut to this")
    g.add_argument("--eval-prompts", help="the held-out prompt file (never trained on)")
    g.add_argument("--eval-split", help="its held-out split (a file with splits)")
    g.add_argument("--eval-sequences", type=int, default=64, help="held-out prompts used")
    g.add_argument("--gen-len", type=int, default=160, help="continuation tokens")
    g.add_argument(
        "--eval-len",
        type=int,
        default=512,
        help="greedy tokens of each held-out continuation (at most the model's context "
        "after the prompt): longer than the training text, so the yardstick meets what long "
        "outputs meet",
    )
    g.add_argument("--temperatures", type=_floats, default=(0.0, 0.7, 1.0))
    g.add_argument(
        "--gen-mem-fraction",
        type=float,
        default=0.4,
        help="the generating engine's mem_fraction_static (the rest stays for training)",
    )
    g.add_argument("--max-running", type=int, default=None, help="the engine's batch limit")
    g.add_argument(
        "--gen-graph-bs",
        default=DEFAULT_GEN_GRAPH_BS,
        help="the generating engine's CUDA-graph batch sizes, comma-separated (its batch "
        "limit is added; a batch pads up to the next): full batches most of the time, so "
        "a few sizes start in seconds where the default buckets take a minute; 'all': the "
        "engine's default buckets",
    )
    g.add_argument("--gen-chunk", type=int, default=1024, help="prompts per generation round")
    g.add_argument(
        "--gen-delay-passes",
        type=int,
        default=DEFAULT_MAX_DELAY_PASSES,
        help="the generating engine's prefill delayer: admissions wait at most this many "
        "passes for a batch of free lanes (0: admit whenever one is free)",
    )
    g.add_argument(
        "--text-cache",
        help="the training text's file: written after generating when missing, read "
        "instead of generating when present (module docstring)",
    )
    g.add_argument(
        "--gen-time-budget",
        type=float,
        default=None,
        help="seconds of generation at most, engine start-up excluded (whole rounds, checked "
        "between them; the first round always runs)",
    )
    d = p.add_argument_group("drafter")
    d.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="draft layers (default 2; with --init, the init's: more than it has grows it, "
        "new layers appended with zero output projections)",
    )
    d.add_argument("--target-layers", type=_ints, default=None, help="e.g. 1,9,17")
    d.add_argument("--markov-rank", type=int, default=16)
    d.add_argument("--draft-ffn-dim", type=int, default=None, help="default: the target's")
    d.add_argument(
        "--draft-vocab", type=int, default=32768, help="reduced draft vocabulary (0: full)"
    )
    d.add_argument(
        "--context-window",
        type=int,
        default=None,
        help=f"every draft layer attends the last N positions (default {DEFAULT_CONTEXT_WINDOW}; "
        "SWA-hosted where the target's SWA layers reach that far, else FULL-hosted with a "
        "window; 0: FULL and SWA layers in turn, the FULL ones with unbounded context). Keep "
        "it within the training sequences' length: a drafter meets only contexts it trained "
        "on at any output length",
    )
    d.add_argument("--init", help="start from this drafter checkpoint (re-windowed as above)")
    d.add_argument(
        "--fp8-weights",
        action="store_true",
        help="store the drafter's projection matrices in float8 with per-row scales (half "
        "their bf16 bytes; unimem.speculative.checkpoint)",
    )
    r = p.add_argument_group("training")
    r.add_argument("--gamma", type=int, default=t.gamma)
    r.add_argument("--steps", type=int, default=t.steps)
    r.add_argument("--batch", type=int, default=t.batch)
    r.add_argument("--anchors-per-step", type=int, default=t.anchors_per_step)
    r.add_argument("--lr", type=float, default=t.lr)
    r.add_argument("--warmup", type=int, default=t.warmup)
    r.add_argument("--eval-every", type=int, default=t.eval_every)
    r.add_argument("--save-every", type=int, default=t.save_every)
    r.add_argument("--checkpoint-dir", help="resumable training state (continued if present)")
    r.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="training seconds at most, counted over the whole run: a run resumed from "
        "--checkpoint-dir goes on with what its earlier processes left (its cosine too)",
    )
    r.add_argument(
        "--soft-top-k",
        type=int,
        default=0,
        help="train also on the target's own next-token distribution, its K most probable "
        "tokens at every position (0: the tokens alone)",
    )
    r.add_argument(
        "--soft-weight",
        type=float,
        default=0.5,
        help="the soft targets' share of the loss (with --soft-top-k)",
    )
    r.add_argument(
        "--soft-temperature",
        type=float,
        default=t.soft_temperature,
        help="compare the soft targets at this temperature (the one users sample at)",
    )
    r.add_argument(
        "--soft-loss",
        choices=list(SOFT_LOSSES),
        default=t.soft_loss,
        help="the soft term: cross-entropy or total variation (speculative sampling's "
        "rejection probability)",
    )
    r.add_argument(
        "--position-decay",
        type=float,
        default=t.position_decay,
        help="block column i's loss weighs this to the power i (1: every column alike)",
    )
    r.add_argument(
        "--states",
        choices=["auto", "stored", "per-batch"],
        default="auto",
        help="the training text's hidden states: computed once and stored, or per training "
        "batch (auto: stored when they fit a quarter of the device's memory)",
    )
    r.add_argument("--head-steps", type=int, default=t.head_steps)
    r.add_argument("--no-bf16", action="store_true", help="train in float32 on CUDA too")
    r.add_argument("--no-progress", action="store_true")
    return p


@dataclass
class TargetText:
    """What :func:`generate` returns: the target ``model`` (its engine shut down), the
    training ``sequences`` (prompt + continuation) and ``prompt_lens``, the held-out ones
    (empty without ``--eval-prompts``), and ``info`` (counts and seconds)."""

    model: CausalLM
    sequences: list[list[int]]
    prompt_lens: list[int]
    held_sequences: list[list[int]] = field(default_factory=list)
    held_prompt_lens: list[int] = field(default_factory=list)
    info: dict = field(default_factory=dict)


def drafter_shape(args: argparse.Namespace) -> tuple[int, tuple[int, ...] | None]:
    """``(layers, target_layers)`` of the drafter to train: ``--draft-layers`` (default 2)
    and ``--target-layers`` (None: the target's default); with ``--init``, the init's layer
    count unless ``--draft-layers`` asks for more (it then grows) and always the init's
    target layers (its context reads them). ``ValueError`` for fewer layers than the init
    has, fewer than 1, or other target layers than the init's."""
    if args.init:
        init = read_config(args.init)
        have = init.num_layers
        if args.draft_layers is not None and args.draft_layers < have:
            raise ValueError(
                f"--draft-layers {args.draft_layers}: the --init drafter has {have} layers "
                "(a drafter grows, it is not cut)"
            )
        if args.target_layers is not None and tuple(args.target_layers) != init.target_layers:
            raise ValueError(
                f"--target-layers {list(args.target_layers)}: the --init drafter reads "
                f"{list(init.target_layers)}"
            )
        layers = have if args.draft_layers is None else args.draft_layers
        return layers, init.target_layers
    n = 2 if args.draft_layers is None else args.draft_layers
    if n < 1:
        raise ValueError(f"--draft-layers must be >= 1, got {n}")
    return n, args.target_layers


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of ``args`` (``ValueError`` naming a bad setting)."""
    return TrainConfig(
        steps=args.steps,
        batch=args.batch,
        anchors_per_step=args.anchors_per_step,
        gamma=args.gamma,
        lr=args.lr,
        warmup=args.warmup,
        bf16=not args.no_bf16,
        eval_every=args.eval_every,
        save_every=args.save_every,
        checkpoint_dir=args.checkpoint_dir,
        time_budget_s=args.time_budget,
        head_steps=args.head_steps,
        seed=args.seed,
        progress=not args.no_progress,
        soft_weight=args.soft_weight if args.soft_top_k else 0.0,
        position_decay=args.position_decay,
        soft_temperature=args.soft_temperature,
        soft_loss=args.soft_loss,
    )


def gen_graph_bs(args: argparse.Namespace) -> list[int] | None:
    """The generating engine's ``cuda_graph_bs`` from ``--gen-graph-bs`` (None: the
    engine's default buckets): the sizes given, and ``--max-running`` (the engine's default
    limit on CUDA without it), so that the sizes never cap the batch."""
    if args.gen_graph_bs == "all":
        return None
    try:
        sizes = [int(v) for v in args.gen_graph_bs.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(
            f"--gen-graph-bs must be positive batch sizes, comma-separated, or 'all', got "
            f"{args.gen_graph_bs!r}"
        )
    limit = args.max_running or DEFAULT_CUDA_MAX_RUNNING
    return sorted({s for s in sizes if s < limit} | {limit})


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first setting of ``args`` that cannot train a drafter, before
    any text is generated (the device, the model and the text are not checked here)."""
    if args.bos_prompts < 0:
        raise ValueError(f"--bos-prompts must be >= 0, got {args.bos_prompts}")
    if args.eval_len < 1:
        raise ValueError(f"--eval-len must be >= 1, got {args.eval_len}")
    context_window(args)  # a negative window fails before the generation
    drafter_shape(args)  # and so does a shape the init cannot give
    for name, least in (("markov_rank", 1), ("draft_ffn_dim", 1), ("draft_vocab", 0)):
        v = getattr(args, name)
        if v is not None and v < least:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= {least}, got {v}")
    if args.soft_top_k < 0:
        raise ValueError(f"--soft-top-k must be >= 0, got {args.soft_top_k}")
    gen_graph_bs(args)
    train_config(args)  # and the training settings


def run(args: argparse.Namespace, log=print) -> dict:
    """The pipeline of the module docstring; returns the summary written to
    ``training.json``."""
    return train_on(generate(args, log), args, log)


def generate(args: argparse.Namespace, log=print) -> TargetText:
    """Steps 1 of the module docstring: the target's text through its Engine."""
    t0 = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda given but no CUDA device is available")
    check_args(args)
    kwargs = dict(model_path=args.model_path, device=args.device, dtype=args.dtype)
    kwargs["random_seed"] = args.seed
    # every prompt is new text: a prefix cache would only insert and evict
    kwargs["disable_radix_cache"] = True
    if args.device == "cuda":
        kwargs["mem_fraction_static"] = args.gen_mem_fraction
    if args.max_running:
        kwargs["max_running_requests"] = args.max_running
    if args.gen_delay_passes < 0:
        raise ValueError(f"--gen-delay-passes must be >= 0, got {args.gen_delay_passes}")
    if args.gen_delay_passes:
        # continuations end at <eos> a few at a time: admit them in batches (one extend
        # step each) rather than one eager extend step per finished request
        kwargs["enable_prefill_delayer"] = True
        kwargs["prefill_delayer_max_delay_passes"] = args.gen_delay_passes
    cache = Path(args.text_cache) if getattr(args, "text_cache", None) else None
    cached = cache is not None and cache.exists()
    if cached and args.device == "cuda":
        # only the held-out prompts are generated: no CUDA graphs to capture for them
        kwargs["disable_cuda_graph"] = True
    elif args.device == "cuda":
        kwargs["cuda_graph_bs"] = gen_graph_bs(args)
    engine = Engine(**kwargs)
    t_start = time.perf_counter() - t0  # loading, kernel compilation, graph capture
    log(f"data: generating engine {startup_line(engine.startup_seconds)} ({t_start:.1f} s in all)")
    phases = dict(engine.startup_seconds)  # where the engine's start went
    model = engine.model
    if cached:
        seqs, lens, made = load_text(cache, args.model_path, model.config.vocab_size)
        log(f"data: {len(seqs)} sequences from {cache} (made by: {made['command']})")
        held_seqs, held_lens = _held_out(engine, args)
        engine.shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        info = dict(
            made["counts"],
            sequences=len(seqs),
            heldout_sequences=len(held_seqs),
            text_cache={"path": str(cache), "made_by": made["command"]},
            seconds={
                "engine_start": t_start,
                "bos_prompts": 0.0,
                "generation": time.perf_counter() - t0,
            },
            engine_startup_seconds=phases,
        )
        return TargetText(model, seqs, lens, held_seqs, held_lens, info)
    file_p: list[list[int]] = []
    if args.train_prompts:
        texts = read_prompts(args.train_prompts, args.train_split)
        file_p = encode_prompts(engine, texts, args.max_prompt_len)
    if not args.bos_prompts and not file_p:
        raise ValueError("no training prompts: give --bos-prompts > 0 or --train-prompts")
    # rounds of --gen-chunk prompts (file prompts first), until done or --gen-time-budget;
    # the budget counts generation only (not the engine's start-up, which on a GPU includes
    # kernel compilation and graph capture) and the first round always runs
    prompts: list[list[int]] = []
    seqs: list[list[int]] = []
    lens: list[int] = []
    made_bos = 0
    t_prompts = 0.0
    t_cont = 0.0  # seconds of continuation rounds (their <bos> prompts excluded)
    t_rounds = time.perf_counter()
    while len(prompts) < len(file_p) + args.bos_prompts:
        spent = time.perf_counter() - t_rounds
        if prompts and args.gen_time_budget and spent > args.gen_time_budget:
            log(f"data: --gen-time-budget reached after {len(prompts)} prompts ({spent:.1f} s)")
            break
        t_round = time.perf_counter()
        t_before = t_prompts
        chunk = file_p[len(prompts) : len(prompts) + args.gen_chunk]
        if len(chunk) < args.gen_chunk and made_bos < args.bos_prompts:
            k = min(args.gen_chunk - len(chunk), args.bos_prompts - made_bos)
            chunk += bos_prompts(
                engine, k, args.prompt_len, seed=args.seed + made_bos, bos=args.bos_id
            )
            made_bos += k
        t_prompts += time.perf_counter() - t_round
        s_, l_ = continuations(
            engine,
            chunk,
            args.gen_len,
            temperatures=args.temperatures,
            seed=args.seed + 10**6 + len(prompts),
        )
        t_cont += time.perf_counter() - t_round - (t_prompts - t_before)
        prompts += chunk
        seqs += s_
        lens += l_
    if not seqs:
        raise ValueError(
            f"no training text: all {len(prompts)} continuations ended within 2 tokens "
            "(raise --gen-len, or check the prompts and the model's EOS)"
        )
    file_prompts = min(len(file_p), len(prompts))
    held_seqs, held_lens = _held_out(engine, args)
    t_gen = time.perf_counter()
    generated = sum(len(s) - p for s, p in zip(seqs, lens, strict=True))
    log(
        f"data: {len(prompts)} prompts ({made_bos} from <bos>, {file_prompts} from "
        f"file), {len(seqs)} continuations, {generated} generated tokens in "
        f"{t_gen - t0:.1f} s"
    )
    engine.shutdown()  # the pool's memory goes back; the model stays (held here)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    info = dict(
        prompts=len(prompts),
        bos_prompts=made_bos,
        file_prompts=file_prompts,
        sequences=len(seqs),
        generated_tokens=generated,
        heldout_sequences=len(held_seqs),
        seconds={"engine_start": t_start, "bos_prompts": t_prompts, "generation": t_gen - t0},
        engine_startup_seconds=phases,
        continuation_tok_s=round(generated / t_cont) if t_cont > 0 else None,
    )
    if cache is not None:
        counts = {
            k: info[k] for k in ("prompts", "bos_prompts", "file_prompts", "generated_tokens")
        }
        save_text(cache, seqs, lens, args, model.config.vocab_size, counts)
        log(f"data: training text written to {cache}")
    return TargetText(model, seqs, lens, held_seqs, held_lens, info)


def _held_out(engine: Engine, args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The held-out prompts' greedy continuations (empty without ``--eval-prompts``)."""
    if not args.eval_prompts:
        return [], []
    texts = read_prompts(args.eval_prompts, args.eval_split)[: args.eval_sequences]
    held_p = encode_prompts(engine, texts, args.max_prompt_len)
    room = engine.model.config.max_context - max((len(p) for p in held_p), default=0)
    return continuations(
        engine,
        held_p,
        max(1, min(args.eval_len, room)),
        temperatures=(0.0,),
        seed=args.seed + 2 * 10**6,
    )


TEXT_FORMAT = "unimem-drafter-text"


def save_text(
    path: Path,
    seqs: list[list[int]],
    lens: list[int],
    args: argparse.Namespace,
    vocab: int,
    counts: dict,
) -> None:
    """The training text in ``path`` (``torch.save``: flat int32 tokens, per-sequence lengths
    and prompt lengths, the model path, its vocabulary, the command and counts)."""
    flat = torch.tensor([t for s_ in seqs for t in s_], dtype=torch.int32)
    data = {
        "format": TEXT_FORMAT,
        "version": 1,
        "model_path": str(args.model_path),
        "vocab_size": vocab,
        "tokens": flat,
        "lengths": torch.tensor([len(s_) for s_ in seqs], dtype=torch.int64),
        "prompt_lens": torch.tensor(lens, dtype=torch.int64),
        "command": "python -m unimem.training.train_drafter "
        + (shlex.join(args.argv) if hasattr(args, "argv") else "(called from Python)"),
        "counts": counts,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(data, tmp)
    tmp.replace(path)


def load_text(path: Path, model_path: str, vocab: int) -> tuple[list[list[int]], list[int], dict]:
    """``(sequences, prompt lengths, {"command", "counts"})`` from a :func:`save_text` file;
    ``ValueError`` for another kind of file or text made for another model (path or
    vocabulary)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and why
        raise ValueError(f"--text-cache {path}: not a readable training text ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TEXT_FORMAT:
        raise ValueError(f"--text-cache {path}: not a training text written by train_drafter")
    if data["vocab_size"] != vocab or data["model_path"] != str(model_path):
        raise ValueError(
            f"--text-cache {path}: made for {data['model_path']} (vocabulary "
            f"{data['vocab_size']}), not {model_path} (vocabulary {vocab})"
        )
    flat = data["tokens"].tolist()
    seqs, at = [], 0
    for n in data["lengths"].tolist():
        seqs.append(flat[at : at + n])
        at += n
    return (
        seqs,
        data["prompt_lens"].tolist(),
        {"command": data["command"], "counts": data["counts"]},
    )


def train_on(text: TargetText, args: argparse.Namespace, log=print) -> dict:
    """Steps 2-5 of the module docstring on ``text``; returns the summary written to
    ``training.json`` in ``args.out``."""
    t_gen = time.perf_counter()
    summary: dict = {"command": "python -m unimem.training.train_drafter " + shlex.join(args.argv)}
    model, seqs, lens = text.model, text.sequences, text.prompt_lens
    held_seqs, held_lens = text.held_sequences, text.held_prompt_lens
    c = model.config
    window = context_window(args)
    num_layers, target_layers = drafter_shape(args)
    dc = draft_config_for(
        c,
        num_layers=num_layers,
        markov_rank=args.markov_rank,
        target_layers=target_layers,
        ffn_dim=args.draft_ffn_dim,
        draft_vocab_size=args.draft_vocab or None,
        context_window=window,
    )
    log(f"drafter: layers hosted {dc.layer_hosts}, windows {dc.window} / {dc.context_window}")
    # the last sixteenth of the training sequences calibrates the confidence head only
    cut = max(1, len(seqs) // 16) if len(seqs) > 1 and args.head_steps else 0
    train_seqs, train_lens = seqs[: len(seqs) - cut], lens[: len(seqs) - cut]
    if args.soft_top_k < 0 or not 0.0 <= args.soft_weight <= 1.0:
        raise ValueError(
            f"--soft-top-k must be >= 0 and --soft-weight in [0, 1], got "
            f"{args.soft_top_k} and {args.soft_weight}"
        )
    stored = _store_states(model, train_seqs, len(dc.target_layers), args)
    if stored:
        train = teacher_forced_states(
            model, train_seqs, train_lens, dc.target_layers, soft_top_k=args.soft_top_k
        )
        states = None
    else:
        train = tokens_only(train_seqs, train_lens, dc.target_layers, model.device)

        def states(part):
            return states_of(model, part, soft_top_k=args.soft_top_k)

    calib = None
    if cut and stored:
        calib = teacher_forced_states(model, seqs[-cut:], lens[-cut:], dc.target_layers)
    elif cut:  # the confidence head's batches get their states as the drafter's do
        calib = tokens_only(seqs[-cut:], lens[-cut:], dc.target_layers, model.device)
    held = None
    if held_seqs:
        held = teacher_forced_states(model, held_seqs, held_lens, dc.target_layers)
    t_states = time.perf_counter()
    log(
        f"states: {len(train)} + {cut} + {len(held or [])} sequences in {t_states - t_gen:.1f} s"
        + ("" if stored else " (the training text's per batch)")
    )
    if args.init:
        from unimem.speculative.checkpoint import load_drafter

        drafter = load_drafter(args.init, model)
        if window is not None:
            drafter.config = with_context_window(drafter.config, window, c)
        if dc.num_layers > drafter.config.num_layers:
            log(f"drafter: {drafter.config.num_layers} layers grown to {dc.num_layers}")
            drafter = with_extra_layers(drafter, dc.num_layers, seed=args.seed + 17)
    else:
        d2t = frequent_tokens(train, dc.draft_vocab_size, c.vocab_size) if dc.reduced else None
        drafter = DsparkDrafter(
            dc, model.embed_weight, model.lm_head_weight, seed=args.seed + 17, d2t=d2t
        )
    cfg = train_config(args)
    result = train_drafter(drafter, train, held, cfg, calibration=calib, states=states, log=log)
    out = Path(args.out)
    save_drafter(result.drafter, out, fp8_weights=args.fp8_weights)
    weights = (out / "model.safetensors").stat().st_size
    rc = result.drafter.config
    seconds = dict(text.info["seconds"])
    seconds.update(states=t_states - t_gen, training=result.seconds)
    seconds["total"] = seconds["generation"] + time.perf_counter() - t_gen
    summary.update(
        {k: v for k, v in text.info.items() if k != "seconds"},
        seconds=seconds,
        states="stored" if stored else "per-batch",
        steps=result.steps_done,
        stopped_by=result.stopped_by,
        accept_before=result.accept_before,
        accept_after=result.accept_after,
        calibration=None if result.calibration is None else vars(result.calibration),
        draft_config={
            "layers": rc.num_layers,
            "target_layers": list(rc.target_layers),
            "markov_rank": rc.markov_rank,
            "ffn_dim": rc.ffn_dim,
            "draft_vocab_size": rc.draft_vocab_size,
            "fp8_weights": args.fp8_weights,
            "gamma": args.gamma,
            "soft_top_k": args.soft_top_k,
            "soft_weight": args.soft_weight if args.soft_top_k else 0.0,
            "position_decay": args.position_decay,
            "soft_temperature": args.soft_temperature if args.soft_top_k else 1.0,
            "soft_loss": args.soft_loss if args.soft_top_k else "ce",
            "layer_hosts": list(result.drafter.config.layer_hosts),
            "window": result.drafter.config.window,
            "context_window": result.drafter.config.context_window,
        },
        weights_bytes=weights,
        # every evaluation and every 50th step: the file ships beside the drafter
        history=[h for h in result.history if "accept_length" in h or h["step"] % 50 == 0],
    )
    with open(out / "training.json", "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    log(f"wrote {out} ({weights / 2**20:.1f} MiB weights) in {summary['seconds']['total']:.1f} s")
    return summary


def _store_states(
    model: CausalLM, seqs: list[list[int]], layers: int, args: argparse.Namespace
) -> bool:
    """Whether the training text's states are computed once and stored (``--states``)."""
    if args.states != "auto":
        return args.states == "stored"
    c = model.config
    longest = max(len(s) for s in seqs)
    per_position = layers * c.d_model * c.dtype.itemsize + args.soft_top_k * 6
    need = len(seqs) * longest * per_position
    dev = torch.device(model.device)
    if dev.type == "cuda":
        budget = torch.cuda.get_device_properties(dev).total_memory // 4
    else:  # the host's physical memory
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    return need <= budget


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
