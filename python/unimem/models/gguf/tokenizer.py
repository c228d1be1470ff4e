"""Build a HuggingFace ``tokenizers`` tokenizer from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: it stores llama.cpp's description of the tokenizer —
``tokenizer.ggml.model`` (the kind), ``.tokens`` (the vocabulary in id order), ``.token_type``
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), ``.scores``, optionally
``.merges``, the special ids (``bos/eos/unknown/padding_token_id``), ``add_bos_token`` /
``add_eos_token``, and ``tokenizer.chat_template``.

Supported: Gemma's SentencePiece BPE (``tokenizer.ggml.model`` = ``llama`` in a ``gemma3``
file). Its tokenizer is a byte-fallback BPE over the vocabulary in which spaces are written
``▁`` (no prefix space, no pre-splitting), decoded by mapping ``▁`` back to a space, joining
byte tokens and concatenating. Two facts about how llama.cpp stores Gemma's vocabulary matter:

* tokens made only of spaces (runs of two or more) are stored with real spaces, while the
  tokenizer's normalised text spells them with ``▁``: they are respelled;
* the file has no merges and Gemma's scores do not follow its merge order; the vocabulary's
  order does. Merges are recovered from the vocabulary: every token that splits into two
  tokens of the vocabulary gives the merge of those two, ranked by the token's id (lower id,
  earlier merge), splits of one token by longer left part first.

Control tokens (type 3, e.g. ``<bos>``, ``<start_of_turn>``) are special added tokens, matched
whole and dropped by ``skip_special_tokens``; user-defined tokens (type 4) are added tokens
matched whole. ``<bos>`` is prepended when the file says ``add_bos_token`` (``<eos>`` appended
when ``add_eos_token``).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from unimem.models.gguf.reader import GGUFError, GGUFFile

__all__ = ["TokenizerFiles", "build_tokenizer"]

SPACE = "\u2581"  # SentencePiece's visible space
CONTROL, USER_DEFINED = 3, 4


class TokenizerFiles:
    """The tokenizer built from a GGUF: ``tokenizer`` (a ``tokenizers.Tokenizer``, the content
    of ``tokenizer.json``) and ``config`` (the content of ``tokenizer_config.json``: special
    tokens, ``add_bos_token``/``add_eos_token``, ``chat_template`` or None)."""

    def __init__(self, tokenizer: Tokenizer, config: dict) -> None:
        self.tokenizer = tokenizer
        self.config = config


def _respell(token: str) -> str:
    """A token of spaces only (llama.cpp's spelling) in the tokenizer's ``▁`` spelling."""
    return SPACE * len(token) if " " in token and not token.strip() else token


def recover_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary listed in merge order (module docstring)."""
    index = {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last id
    ranked = []
    for token, rank in index.items():
        for cut in range(len(token) - 1, 0, -1):  # longer left part first
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                ranked.append((rank, len(token) - cut, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def _special(f: GGUFFile, tokens: list[str], key: str) -> str | None:
    tid = f.get(f"tokenizer.ggml.{key}")
    if tid is None:
        return None
    if not 0 <= int(tid) < len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.{key} = {tid} is outside the vocabulary")
    return tokens[int(tid)]


def build_tokenizer(f: GGUFFile) -> TokenizerFiles:
    """The tokenizer a ``gemma3`` GGUF describes (module docstring); :class:`GGUFError` naming
    the tokenizer kind for any other."""
    arch = f.require("general.architecture")
    kind = f.require("tokenizer.ggml.model")
    if not (kind == "llama" and arch == "gemma3"):
        raise GGUFError(
            f"{f.path}: tokenizer {kind!r} of architecture {arch!r} is not supported "
            "(supported: Gemma's SentencePiece BPE, tokenizer.ggml.model 'llama' in a gemma3 file)"
        )
    original = list(f.require("tokenizer.ggml.tokens"))
    types = [int(t) for t in f.get("tokenizer.ggml.token_type", [1] * len(original))]
    if len(types) != len(original):
        raise GGUFError(f"{f.path}: tokenizer.ggml.token_type and .tokens differ in length")
    tokens = [_respell(t) for t in original]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in f.metadata:
        merges = [tuple(m.split(" ", 1)) for m in f.metadata["tokenizer.ggml.merges"]]
    else:
        merges = recover_merges(tokens)
    unk = _special(f, original, "unknown_token_id") or "<unk>"
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control = [t for t, ty in zip(original, types, strict=True) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(original, types, strict=True) if ty == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    bos = _special(f, original, "bos_token_id")
    eos = _special(f, original, "eos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's SPM default
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise GGUFError(f"{f.path}: add_bos/add_eos is set but the file names no such token")
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(bos, int(f.require("tokenizer.ggml.bos_token_id")))] if add_bos else []
    if add_eos and eos != bos:
        specials.append((eos, int(f.require("tokenizer.ggml.eos_token_id"))))
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": ty == CONTROL,
        }
        for i, (t, ty) in enumerate(zip(original, types, strict=True))
        if ty == CONTROL or (ty == USER_DEFINED and t in vocab)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # what transformers' save_pretrained writes; it spares readers parsing tokenizer.json
        "added_tokens_decoder": added,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": _special(f, original, "padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(f.get(f"{arch}.context_length", 1 << 30)),
        "chat_template": f.get("tokenizer.chat_template"),
    }
    return TokenizerFiles(tok, config)
