"""A tiny word-level tokenizer saved beside a test checkpoint, built with the ``tokenizers``
library and wrapped as a ``PreTrainedTokenizerFast`` (so ``AutoTokenizer`` loads it from the
directory, chat template included). Ids: 0 ``<pad>``, 1 ``<eos>``, 2 ``<bos>``, 3 ``<unk>``,
then ``w4``, ``w5``, ... up to the vocabulary size; text is whitespace-separated words."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant {% endif %}"
)


def save(path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Write the tokenizer files into ``path``; the wrapped tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    # roles reuse the last three word ids so that the vocabulary size is unchanged
    for j, role in enumerate(("user", "assistant", "system")):
        word = f"w{vocab_size - 1 - j}"
        vocab[role] = vocab.pop(word)
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
