"""Strategies, budgets and oracles shared by the fuzz suite (imported by its test modules)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

# FUZZ_SCALE multiplies every example budget (1 in CI; e.g. 20 for a local soak).
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))


def budget(n: int) -> int:
    """Examples for a property: ``n`` in CI, scaled by ``FUZZ_SCALE``."""
    return max(1, round(n * SCALE))


def elapsed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds one call takes (for the stall checks: bounds are generous, sized against quadratic cost)."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


# Pieces that stress segmentation and token alignment: terminators, abbreviations, quotes, brackets,
# think/answer tags, accents (precomposed and combining), CJK, emoji (ZWJ sequences, skin tones),
# U+FFFD itself, whitespace of several kinds.
PIECES = [
    "a", "Z", " ", "  ", "\n", "\t", ".", "!", "?", ". ", "Dr. ", "e.g. ", "J. K. ", "3.14", '"', "'", ")", "]",
    "[", "<think>", "</think>", "<answer>", "</answer>", "aÆ", "naïve", "é", "e\u0301", "a\u0308\u0323", "ß", "Ω",
    "東京", "。", "！", "한국", "🙂", "🚀", "👩‍💻", "👍🏿", "🏳️‍🌈", "\ufffd", "\u00a0", "\u2028", "\u200b", "\U0010fffd",
]
# Any Unicode scalar value (no lone surrogates: those are an input error, tested on their own).
ANY_CHAR = st.characters(exclude_categories=("Cs",))
texts = st.lists(st.sampled_from(PIECES) | ANY_CHAR, max_size=60).map("".join)

# JSON values as a judge or a JSONL file may hold them, odd ones included.
json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


_BYTE_SYMBOLS = set(_bytes_to_unicode().values())


def byte_level_oracle(tokenizer: Any, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Each token's character range computed from its own bytes: ``[char of its first byte, char of its last byte + 1)``.

    For byte-level BPE every symbol of a token's string is one byte, so byte positions follow by
    counting; special tokens hold no bytes (an empty range where they stand, at a character boundary).
    """
    char_of_byte = [i for i, ch in enumerate(text) for _ in ch.encode("utf-8")] + [len(text)]
    specials = set(tokenizer.all_special_ids)
    pos, out = 0, []
    for tid in ids:
        if tid in specials:
            out.append((char_of_byte[pos], char_of_byte[pos]))
            continue
        symbols = tokenizer.convert_ids_to_tokens(tid)
        assert set(symbols) <= _BYTE_SYMBOLS, symbols
        out.append((char_of_byte[pos], char_of_byte[pos + len(symbols) - 1] + 1))
        pos += len(symbols)
    assert pos == len(char_of_byte) - 1, "the ids hold other bytes than the text"
    return out


def build_byte_fallback_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (Llama-2/Mistral kind): "▁" for spaces, one prepended, byte-fallback
    tokens ``<0xNN>`` for characters outside the vocabulary, and a decoder that strips the leading space
    and decodes each run of byte tokens as a whole — unlike byte-level BPE on every count."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer
    corpus = ["The Eiffel Tower is in Paris. Café naïve résumé.", "東京は日本の首都です。", "plain words, and more words here!"]
    base.train_from_iterator(corpus * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                             show_progress=False))
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(base.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
