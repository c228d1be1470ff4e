"""A word-level tokenizer for synthetic checkpoints (tests, benchmarks): built with the
``tokenizers`` library and wrapped as a ``PreTrainedTokenizerFast`` so that ``AutoTokenizer``
loads it from the checkpoint directory, chat template included. Ids: 0 ``<pad>``, 1 ``<eos>``,
2 ``<bos>``, 3 ``<unk>``, then ``w4``, ``w5``, ... up to the vocabulary size (the last three
word ids are the chat roles ``system``, ``assistant``, ``user``); text is whitespace-separated
words, so any id sequence decodes to text that encodes back to the same ids."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL", "save_word_tokenizer"]

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant {% endif %}"
)


def save_word_tokenizer(path: str | Path, vocab_size: int):
    """Write the tokenizer files into ``path``; returns the wrapped tokenizer.
    ``vocab_size`` must be at least 8 (the specials, the roles and one word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL) + 4:
        raise ValueError(f"save_word_tokenizer: vocab_size must be >= 8, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    # roles reuse the last three word ids so that the vocabulary size is unchanged
    for j, role in enumerate(("user", "assistant", "system")):
        vocab[role] = vocab.pop(f"w{vocab_size - 1 - j}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast
