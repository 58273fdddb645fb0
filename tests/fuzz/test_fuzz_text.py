"""Properties of segmentation and token alignment on generated text (accents, CJK, emoji, combining marks).

Alignment runs on two byte-level BPE tokenizers with different merges and vocabulary sizes, through
both paths: the offsets mapping (ids = the tokenizer's own) and incremental decoding (ids from
tokenising random pieces, so they differ from a re-tokenisation, with EOS between pieces). Ranges
are checked against an oracle that reads each token's bytes.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from fuzz_support import budget, byte_level_oracle, json_values, texts
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_factuality.text.alignment import TokenAlignment, _offsets_by_incremental_decode, align_tokens
from nemo_factuality.text.segment import RegexSegmenter
from nemo_factuality.types import FactualityInputError, Span

SEG = RegexSegmenter()


@settings(max_examples=budget(400))
@given(texts)
def test_sentence_spans_are_exact(text):
    sentences = SEG.split(text)
    prev_end = 0
    for k, s in enumerate(sentences):
        assert s.id == k and s.span.slice(text) == s.text and s.text == s.text.strip() and s.text
        assert s.span.start >= prev_end  # in order, never overlapping
        prev_end = s.span.end


def _check_invariants(al: TokenAlignment, tokenizer, spans: list[tuple[int, int]]) -> None:
    text = al.text
    holders = {c for a, b in al.offsets for c in range(a, b)}
    assert holders == set(range(len(text))), "a character lies in no token"
    for a, b in spans:
        first, end = al.token_range(Span(a, b))
        in_range = {c for s, e in al.offsets[first:end] for c in range(s, e)}
        assert set(range(a, b)) <= in_range, "a span's token range misses one of its characters"
        assert text[a:b] in tokenizer.decode(list(al.token_ids[first:end]), skip_special_tokens=True)
        last = al.last_token(Span(a, b))
        assert al.offsets[last][0] <= b - 1 < al.offsets[last][1]  # the last token holds the last character ...
        assert all(s > b - 1 or e <= b - 1 for s, e in al.offsets[last + 1:])  # ... and no later token does


@st.composite
def text_and_spans(draw):
    text = draw(texts.filter(bool))
    cuts = draw(st.lists(st.integers(0, len(text)), min_size=2, max_size=8))
    spans = [(a, b) for a, b in pairwise(sorted(cuts)) if a < b]
    return text, spans


@pytest.mark.parametrize("which", ["tiny_tokenizer", "second_tokenizer"])
def test_offsets_path_matches_byte_oracle(which, request):
    tokenizer = request.getfixturevalue(which)

    @settings(max_examples=budget(200))
    @given(text_and_spans())
    def prop(case):
        text, spans = case
        al = align_tokens(tokenizer, text)
        assert list(al.offsets) == byte_level_oracle(tokenizer, text, list(al.token_ids))
        _check_invariants(al, tokenizer, spans)

    prop()


@pytest.mark.parametrize("which", ["tiny_tokenizer", "second_tokenizer"])
def test_decode_path_matches_byte_oracle(which, request):
    tokenizer = request.getfixturevalue(which)
    eos = tokenizer.eos_token_id

    @settings(max_examples=budget(200))
    @given(text_and_spans(), st.data())
    def prop(case, data):
        text, spans = case
        cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))) | {0, len(text)})
        ids: list[int] = []
        for a, b in pairwise(cuts):
            ids += tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
            if data.draw(st.booleans()):
                ids.append(eos)
        al = align_tokens(tokenizer, text, ids)
        assert list(al.offsets) == byte_level_oracle(tokenizer, text, ids)
        _check_invariants(al, tokenizer, spans)

    prop()


def test_byte_fallback_tokenizer_both_paths_keep_the_invariants(byte_fallback_tokenizer):
    """A SentencePiece-style tokenizer: no byte oracle, but both paths must hold every character and span."""
    tokenizer = byte_fallback_tokenizer
    eos = tokenizer.eos_token_id

    @settings(max_examples=budget(200))
    @given(text_and_spans(), st.data())
    def prop(case, data):
        text, spans = case
        if "▁" in text or "\ufffd" in text:
            return  # "▁" decodes to a space; U+FFFD may be an error here (next test)
        fast = align_tokens(tokenizer, text)
        ids = list(fast.token_ids)
        for at in sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=3)), reverse=True):
            ids.insert(at, eos)
        decoded = TokenAlignment(text, fast.token_ids, tuple(_offsets_by_incremental_decode(tokenizer, list(fast.token_ids), text)))
        with_eos = align_tokens(tokenizer, text, ids)  # EOS inside the ids: the decoding path
        for al in (fast, decoded, with_eos):
            holders = {c for a, b in al.offsets for c in range(a, b)}
            assert holders == set(range(len(text)))
            for a, b in spans:
                first, end = al.token_range(Span(a, b))
                assert set(range(a, b)) <= {c for s, e in al.offsets[first:end] for c in range(s, e)}

    prop()


@settings(max_examples=budget(200))
@given(st.lists(st.sampled_from(["\ufffd", "a", " ", "é", "🙂", "東"]), min_size=1, max_size=12).map("".join), st.data())
def test_replacement_characters_give_an_alignment_or_a_clear_error(byte_fallback_tokenizer, text, data):
    """U+FFFD in the text is ambiguous for the decoding path (an unfinished character decodes to it too)."""
    ids = list(byte_fallback_tokenizer(text, add_special_tokens=False)["input_ids"])
    at = data.draw(st.integers(0, len(ids)))
    try:
        al = align_tokens(byte_fallback_tokenizer, text, ids[:at] + [byte_fallback_tokenizer.eos_token_id] + ids[at:])
    except FactualityInputError:
        return
    assert {c for a, b in al.offsets for c in range(a, b)} == set(range(len(text)))


# Text holding U+FFFD is left out: ids cut inside a U+FFFD decode to exactly that text.
@settings(max_examples=budget(200))
@given(texts.filter(lambda t: t and "\ufffd" not in t), st.data())
def test_ids_ending_inside_a_character_are_an_error(tiny_tokenizer, text, data):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = data.draw(st.integers(0, len(ids) - 1))
    head = tiny_tokenizer.decode(ids[:cut], skip_special_tokens=True)
    # ids for a prefix: an error either way; ending inside a character says so
    match = "end inside a character" if head.endswith("\ufffd") else "decode to .* characters but the response has"
    with pytest.raises(FactualityInputError, match=match):
        align_tokens(tiny_tokenizer, text, ids[:cut])


@pytest.mark.parametrize("which", ["tiny_tokenizer", "byte_fallback_tokenizer"])
def test_any_ids_give_an_alignment_or_a_clear_error(which, request):
    tokenizer = request.getfixturevalue(which)
    ids_of_text = st.builds(lambda t: tokenizer(t, add_special_tokens=False)["input_ids"], texts)

    @settings(max_examples=budget(150))
    @given(texts, st.lists(st.integers(-(2**40), 2**40) | st.integers(0, 600) | st.just(10**5000) | json_values, max_size=12)
           | ids_of_text.map(lambda ids: ids[::2] + ids[1::2]))
    def prop(text, ids):
        try:
            al = align_tokens(tokenizer, text, ids)
        except FactualityInputError:
            return
        assert {c for a, b in al.offsets for c in range(a, b)} == set(range(len(text)))

    prop()


@settings(max_examples=budget(100))
@given(texts, st.integers(0, 60), st.sampled_from(["\ud800", "\udfff", "\udc80"]))
def test_lone_surrogate_is_a_clear_error(tiny_tokenizer, text, at, surrogate):
    bad = text[:at] + surrogate + text[at:]
    with pytest.raises(FactualityInputError, match="lone surrogate"):
        align_tokens(tiny_tokenizer, bad)
    with pytest.raises(FactualityInputError, match="lone surrogate"):
        align_tokens(tiny_tokenizer, bad, [1, 2, 3])
