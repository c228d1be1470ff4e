"""Training text for a DSPARK drafter, written by the target through unimem's own Engine.

* :func:`bos_prompts`: prompts sampled from the target itself, starting at ``<bos>`` at
  temperature 1 (the target's own distribution of text: prose, code, lists, dialogue in
  the proportions it learned), ``length`` tokens each, ``<bos>`` kept as their first token.
* :func:`continuations`: each prompt continued by the target — request ``i`` at
  ``temperatures[i % len(temperatures)]`` (0: greedy), ``gen_len`` new tokens at most
  (``<eos>`` ends one early), all in one batched ``Engine.generate`` (continuous batching
  over the engine's ``max_running_requests``). Returns whole sequences (prompt +
  continuation) and their prompt lengths, ready for
  :func:`unimem.training.teacher_forcing.teacher_forced_states`.
* :func:`encode_prompts`: text prompts encoded by the engine's tokenizer, cut to a length.
* :func:`text_continuations`: text prompts encoded and continued a fixed number of tokens
  (EOS ignored): the held-out sequences a drafter is scored on.

Every request is seeded (``seed + i``), so the same engine and arguments give the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from unimem.engine.api import Engine

__all__ = ["bos_id", "bos_prompts", "continuations", "encode_prompts", "text_continuations"]


def bos_id(engine: Engine) -> int:
    """The ``<bos>`` id of the engine's model: the tokenizer's, else the HF config's.
    ``ValueError`` if neither names one."""
    tok = engine.tokenizer
    for source in (tok, getattr(engine.checkpoint, "hf_config", None)):
        value = getattr(source, "bos_token_id", None)
        if isinstance(value, int):
            return value
    raise ValueError("the model names no <bos> token id (tokenizer and config have none)")


def bos_prompts(
    engine: Engine,
    n: int,
    length: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    bos: int | None = None,
) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens after ``<bos>`` (``<bos>`` included; ``bos``
    overrides :func:`bos_id`), sampled from the target at ``temperature`` with ``<eos>``
    ignored; request ``i`` seeded ``seed + i``."""
    if n < 1 or length < 1:
        raise ValueError(f"bos_prompts: need n >= 1 and length >= 1, got {n}, {length}")
    if bos is None:
        bos = bos_id(engine)
    params = [
        {
            "max_new_tokens": length,
            "temperature": temperature,
            "seed": seed + i,
            "ignore_eos": True,
        }
        for i in range(n)
    ]
    outs = engine.generate(input_ids=[[bos]] * n, sampling_params=params)
    return [[bos, *o["output_ids"]] for o in outs]


def encode_prompts(engine: Engine, texts: Sequence[str], max_len: int) -> list[list[int]]:
    """``texts`` encoded by the engine's tokenizer (with its ``<bos>`` if it adds one), each
    cut to its first ``max_len`` tokens; empty encodings dropped."""
    if engine.tokenizer is None:
        raise ValueError("text prompts need the model's tokenizer")
    out = [engine.tokenizer.encode(t)[:max_len] for t in texts]
    return [ids for ids in out if ids]


def continuations(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    gen_len: int,
    *,
    temperatures: Sequence[float] = (0.0, 0.7, 1.0),
    seed: int = 0,
    min_new_tokens: int = 2,
) -> tuple[list[list[int]], list[int]]:
    """``(sequences, prompt_lens)``: each prompt and the target's continuation (module
    docstring); continuations shorter than ``min_new_tokens`` are dropped."""
    if not prompts or gen_len < 1 or not temperatures:
        raise ValueError("continuations: need prompts, gen_len >= 1 and a temperature")
    params = [
        {
            "max_new_tokens": gen_len,
            "temperature": float(temperatures[i % len(temperatures)]),
            "seed": seed + i,
        }
        for i in range(len(prompts))
    ]
    outs = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)
    seqs, lens = [], []
    for p, o in zip(prompts, outs, strict=True):
        if len(o["output_ids"]) >= min_new_tokens:
            seqs.append([*p, *o["output_ids"]])
            lens.append(len(p))
    return seqs, lens


def text_continuations(
    engine: Engine,
    texts: Sequence[str],
    max_prompt_len: int,
    tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """``(sequences, prompt_lens)``: each of ``texts`` encoded (:func:`encode_prompts`, cut
    to ``max_prompt_len``) and continued by exactly ``tokens`` tokens (EOS ignored) at
    ``temperature``, request ``i`` seeded ``seed + i``, in one batched generation."""
    prompts = encode_prompts(engine, texts, max_prompt_len)
    params = [
        {"max_new_tokens": tokens, "temperature": temperature, "seed": seed + i,
         "ignore_eos": True}
        for i in range(len(prompts))
    ]  # fmt: skip
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seqs = [p + o["output_ids"] for p, o in zip(prompts, outs, strict=True)]
    return seqs, [len(p) for p in prompts]
