"""Structured output: requests whose tokens must follow a grammar — a JSON schema, any JSON
value (OpenAI's ``json_object``), a regular expression or an EBNF grammar (SGLang's
``json_schema`` / ``regex`` / ``ebnf``).

The grammars are compiled and matched by `xgrammar <https://github.com/mlc-ai/xgrammar>`_, the
grammar backend SGLang uses by default: a :class:`GrammarBackend` holds its tokenizer
description and compiler (compiled grammars are cached by the compiler); each constrained
request holds a :class:`GrammarState` (its matcher), advanced by every output token the host
reads (:meth:`GrammarState.accept`).

Before a step, the host fills one bitmask of allowed tokens per row the step picks from
(:class:`StepMasks`), and the step sets every other token's logit to ``-inf`` after the other
adjustments (:func:`unimem.models.logit_adjustments.apply`), so argmax, sampling and the
chain's acceptance all pick from the grammar's tokens (speculative sampling stays exact
against the constrained target distribution). A matcher must have read its request's whole
output first: a batch with a constrained request reads the step in flight before it is
planned (:func:`unimem.engine.adjustments.needs_exact_history`), and its steps apply the
masks eagerly after the recorded forward half.

In a DSPARK verify step row ``j`` of a lane follows the drafts ``d_1 .. d_j``, which the step
itself drafts on the device: the step reads the drafts back (one host sync, in batches with a
constrained request only), the matcher walks them (row ``j``'s mask is its state after
``d_j``; past a draft the grammar refuses, the rows are left unconstrained — that draft is
rejected, since its row gives it probability 0, and no later row is used) and rolls back.

The request ends when its matcher terminates: on one of its stop tokens once the grammar is
complete (those of the request, else the model's EOS), even with ``ignore_eos``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "GRAMMAR_KINDS",
    "GrammarBackend",
    "GrammarFieldError",
    "GrammarSpec",
    "GrammarState",
    "StepMasks",
    "grammar_available",
    "grammar_of_fields",
]

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")
"""What a :class:`GrammarSpec` may be: a JSON schema (its text), any JSON value (no text), a
regular expression, an EBNF grammar (xgrammar's GBNF dialect, root rule ``root``)."""


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def grammar_available() -> bool:
    """Whether xgrammar can be imported."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` one of :data:`GRAMMAR_KINDS`, ``text``
    the schema (JSON text), regex or EBNF (empty for ``json_object``). Hashable and
    picklable (tensor-parallel ranks each compile it)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"{self.kind} must be a string, got {type(self.text).__name__}")
        if self.kind != "json_object" and not self.text.strip():
            raise ValueError(f"{self.kind} is empty")


class GrammarFieldError(ValueError):
    """A request field that sets a grammar is wrong; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def grammar_of_fields(
    fields: Mapping[str, GrammarSpec | str | None], where: str = ""
) -> tuple[GrammarSpec | None, str]:
    """The grammar that a request's ``fields`` ask for, and the field that set it (``where``
    prefixes the names, e.g. ``sampling_params``); ``(None, "")`` when none does. A value is
    None (unset), a :class:`GrammarSpec` (a field already parsed, e.g. OpenAI's
    ``response_format``) or the text of a grammar of the key's kind (``json_schema``,
    ``regex``, ``ebnf``). :class:`GrammarFieldError` naming the field for a value that is not
    a string or is empty, or for two fields at once (the second)."""
    found: list[tuple[GrammarSpec, str]] = []
    for key, value in fields.items():
        name = f"{where}.{key}" if where else key
        if value is None:
            continue
        if isinstance(value, GrammarSpec):
            found.append((value, name))
            continue
        if not isinstance(value, str):
            msg = f"{name}: must be a string, got {type(value).__name__}"
            raise GrammarFieldError(name, msg)
        try:
            found.append((GrammarSpec(key, value), name))
        except ValueError as e:
            raise GrammarFieldError(name, f"{name}: {e}") from None
    if len(found) > 1:
        names = " and ".join(f for _, f in found)
        raise GrammarFieldError(found[1][1], f"{names} both constrain the output: set one")
    return found[0] if found else (None, "")


class GrammarBackend:
    """xgrammar's tokenizer description and compiler for one model (module docstring).

    ``tokenizer``: a HuggingFace tokenizer, or ``vocab``: each token id's string (for
    synthetic vocabularies; ids past it up to ``vocab_size`` are never allowed);
    ``vocab_size``: the model's (its LM head's rows, which may exceed the tokenizer's);
    ``eos_token_ids``: where a completed grammar may stop when a request has no stop tokens.
    ``ImportError`` naming the package without xgrammar."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        tokenizer=None,
        vocab: Sequence[str] | None = None,
        max_threads: int = 4,
    ) -> None:
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise ImportError(
                "structured output needs xgrammar (a dependency of unimem): pip install xgrammar"
            ) from e
        if (tokenizer is None) == (vocab is None):
            raise ValueError("GrammarBackend takes exactly one of tokenizer and vocab")
        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        stops = list(self.eos_token_ids) or None
        if tokenizer is not None:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=stops
            )
        else:
            info = xgr.TokenizerInfo(list(vocab), vocab_size=self.vocab_size, stop_token_ids=stops)
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self.words = (self.vocab_size + 31) // 32
        """int32 words of one row's bitmask."""

    def compile(self, spec: GrammarSpec):
        """xgrammar's compiled grammar of ``spec`` (cached by the compiler); ``ValueError``
        naming the field (``json_schema``, ``regex``, ``ebnf``) if it does not compile."""
        c = self.compiler
        try:
            if spec.kind == "json_object":
                return c.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                try:
                    json.loads(spec.text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not JSON: {e}") from None
                return c.compile_json_schema(spec.text)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            return c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _LOG_PREFIX.sub("", first)  # xgrammar's "[time] file.cc:line: "
            raise ValueError(f"{spec.kind} does not compile: {first}") from None

    def state(self, spec: GrammarSpec, stop_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher of ``spec`` for one request: a completed grammar ends on one of
        ``stop_token_ids`` (the request's; the backend's EOS ids when empty)."""
        compiled = self.compile(spec)
        stops = sorted(int(t) for t in stop_token_ids) or list(self.eos_token_ids)
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        first = torch.zeros(1, self.words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(first, 0)
        if not bool(first.any()):
            raise ValueError(
                f"no token of the model's vocabulary can begin what the {spec.kind} requires"
            )
        return GrammarState(spec, matcher, self.words)


class GrammarState:
    """One request's matcher: where its output stands in its grammar."""

    def __init__(self, spec: GrammarSpec, matcher, words: int) -> None:
        self.spec = spec
        self.matcher = matcher
        self.words = words
        self.stuck = False
        """A mask came out empty: the grammar allows a continuation no token spells (the
        row was left unconstrained; the request ends with an error on its next token)."""

    def accept(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """Advance over ``tokens`` (output the host just read); returns ``(n, ended)``: the
        first ``n`` were accepted, and ``ended`` whether the matcher terminated on the
        ``n``-th. ``n < len(tokens)`` without ``ended`` means token ``n`` broke the grammar
        (an engine fault: the masks allow no such token)."""
        for i, tok in enumerate(tokens):
            if self.matcher.is_terminated():
                return i, True
            if not self.matcher.accept_token(int(tok)):
                return i, False
            if self.matcher.is_terminated():
                return i + 1, True
        return len(tokens), False

    def fill(self, out: np.ndarray, drafts: Sequence[int] = ()) -> None:
        """Write ``out [len(drafts) + 1, words]`` (int32): row 0 the tokens allowed next, row
        ``j`` those allowed after ``drafts[:j]`` — all tokens from the first row after a draft
        the grammar refuses (module docstring), and in a row no token could fill (then
        :attr:`stuck`). The matcher ends where it started."""
        out[:] = -1  # every bit set: unconstrained
        if self.matcher.is_terminated():
            return
        t = torch.from_numpy(out)
        self.matcher.fill_next_token_bitmask(t, 0)
        if not out[0].any():
            out[0] = -1
            self.stuck = True
            return
        walked = 0
        for j, tok in enumerate(drafts, start=1):
            tok = int(tok)
            if not _allows(out[j - 1], tok):
                break  # refused by the row before it (no matcher call: it would log a warning)
            if not self.matcher.accept_token(tok):
                break
            walked += 1
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(t, j)
            if not out[j].any():
                out[j] = -1
                self.stuck = True
        if walked:
            self.matcher.rollback(walked)


def _allows(row: np.ndarray, token: int) -> bool:
    """Whether bitmask ``row [words]`` (int32) allows ``token``."""
    return 0 <= token < row.shape[0] * 32 and bool((int(row[token >> 5]) >> (token & 31)) & 1)


class StepMasks:
    """The host side of one step's grammar masks: ``states[lane]`` is the lane's
    :class:`GrammarState` or None (unconstrained). Called by the step with its drafts ``[W,
    g]`` on the device (a verify step; None otherwise) and the device of its logits, it
    returns ``(slots [W] int64, masks [G, g + 1, words] int32)`` there: lane ``b``'s masks
    are ``masks[slots[b]]`` (``-1``: unconstrained), one per constrained lane. Reading the
    drafts waits for the step's draft phase (module docstring)."""

    def __init__(self, states: Sequence[GrammarState | None], words: int) -> None:
        self.states = list(states)
        self.words = words

    def __call__(
        self, drafts: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        host_drafts = None if drafts is None else drafts.to("cpu", torch.int64).numpy()
        cols = 1 if host_drafts is None else host_drafts.shape[1] + 1
        lanes = [b for b, st in enumerate(self.states) if st is not None]
        slots = np.full(len(self.states), -1, dtype=np.int64)
        masks = np.empty((len(lanes), cols, self.words), dtype=np.int32)
        for slot, lane in enumerate(lanes):
            slots[lane] = slot
            ds = () if host_drafts is None else host_drafts[lane].tolist()
            self.states[lane].fill(masks[slot], ds)
        # plain copies: the step has waited for its drafts already, and mask_rows reads the
        # constrained rows on the host anyway
        return torch.from_numpy(slots).to(device), torch.from_numpy(masks).to(device)
