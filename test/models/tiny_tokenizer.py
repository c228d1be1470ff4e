"""The word-level tokenizer saved beside a test checkpoint: ``unimem.models.word_tokenizer``
(ids: 0 ``<pad>``, 1 ``<eos>``, 2 ``<bos>``, 3 ``<unk>``, then words)."""

from __future__ import annotations

from unimem.models.word_tokenizer import CHAT_TEMPLATE, SPECIAL, save_word_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL", "save"]


def save(path, vocab_size: int):
    """Write the tokenizer files into ``path``; the wrapped tokenizer."""
    return save_word_tokenizer(path, vocab_size)
