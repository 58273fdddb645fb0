"""Segmentation keeps exact spans; token alignment maps spans to the policy's own tokens."""

import random

import pytest

from nemo_factuality.text.alignment import align_tokens
from nemo_factuality.text.segment import RegexSegmenter, find_sections
from nemo_factuality.types import FactualityInputError, Span

SEG = RegexSegmenter()


@pytest.mark.parametrize("text,expected", [
    ("Dr. Smith met Mr. Jones. They talked.", ["Dr. Smith met Mr. Jones.", "They talked."]),
    ("J. K. Rowling wrote books. Pi is 3.14 roughly!", ["J. K. Rowling wrote books.", "Pi is 3.14 roughly!"]),
    ("Facts:\n- first one\n- second one", ["Facts:", "- first one", "- second one"]),
    ('He said "Stop." Then left.', ['He said "Stop."', "Then left."]),
    ("東京は首都です。大阪は都市です。", ["東京は首都です。", "大阪は都市です。"]),
    ("The U.S. economy grew. It was big.", ["The U.S. economy grew.", "It was big."]),
    ("", []), ("   \n ", []),
])
def test_sentences(text, expected):
    assert [s.text for s in SEG.split(text)] == expected


def test_sections_and_unclosed_tags():
    r = "<think>Step one. Step two.</think>\n<answer>Paris.</answer> trailing note."
    assert [(s.segment, s.text) for s in SEG.split(r)] == [("think", "Step one."), ("think", "Step two."),
                                                          ("answer", "Paris."), ("response", "trailing note.")]
    truncated = "<think>Unfinished reasoning. More"
    assert [s.segment for s in SEG.split(truncated)] == ["think", "think"]
    assert find_sections("plain text")[0].name == "response"


def test_span_invariant_fuzz():
    rng = random.Random(0)
    alphabet = list("abc XYZ.!?\n\t。🙂é\u0301\"')<>/thinkanswer") + ["<think>", "</think>", "<answer>", "</answer>", "Dr. "]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        for s in SEG.split(text):
            assert s.span.slice(text) == s.text and s.text.strip() == s.text and s.text


def test_huge_and_wrong_type():
    with pytest.raises(FactualityInputError, match="max_chars"):
        RegexSegmenter(max_chars=10).split("x" * 11)
    with pytest.raises(FactualityInputError, match="must be str"):
        SEG.split(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["Hello world.", "Emoji 🙂🚀 here", "東京 and 北京", "Cafe\u0301 na\u0308ive", "trailing  ", " lead"])
def test_offsets_path_equals_incremental_decode_path(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    fast = align_tokens(tiny_tokenizer, text)
    with_eos = align_tokens(tiny_tokenizer, text, ids + [tiny_tokenizer.eos_token_id])  # fast path + empty EOS range
    from nemo_factuality.text.alignment import _offsets_by_incremental_decode

    slow_offsets = _offsets_by_incremental_decode(tiny_tokenizer, ids + [tiny_tokenizer.eos_token_id], text)
    assert list(with_eos.offsets) == slow_offsets  # both paths agree
    slow = with_eos
    assert list(fast.token_ids) == ids
    assert slow.offsets[: len(ids)] == fast.offsets
    assert slow.offsets[-1] == (len(text), len(text))  # EOS covers no characters
    # every character lies in at least one token (a character split across tokens lies in each of them)
    assert {c for a, b in fast.offsets for c in range(a, b)} == set(range(len(text)))


def test_span_to_tokens(tiny_tokenizer):
    text = "Paris is big. Rome 🙂 too."
    al = align_tokens(tiny_tokenizer, text)
    second = Span(14, len(text))
    first_tok, end_tok = al.token_range(second)
    decoded = tiny_tokenizer.decode(list(al.token_ids[first_tok:end_tok]))
    assert decoded.strip() == "Rome 🙂 too."
    emoji = Span(text.index("🙂"), text.index("🙂") + 1)
    last = al.last_token(emoji)
    assert al.offsets[last][1] == emoji.end  # the token that completes the emoji's bytes


def test_alignment_errors(tiny_tokenizer):
    ids = tiny_tokenizer("Hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(FactualityInputError, match="do not decode to the response"):
        align_tokens(tiny_tokenizer, "Goodbye", ids + [tiny_tokenizer.eos_token_id])
    al = align_tokens(tiny_tokenizer, "Hello")
    with pytest.raises(FactualityInputError, match="outside response"):
        al.token_of_char(99)
    with pytest.raises(FactualityInputError, match="empty span"):
        al.last_token(Span(2, 2))


def test_a_token_ending_inside_a_character_still_holds_the_characters_before(tiny_tokenizer):
    # "aÃ" is one token of the tiny tokenizer: "a" plus the first byte of "Æ" (issue 17: it got an empty range).
    al = align_tokens(tiny_tokenizer, "aÆ")
    assert al.offsets == ((0, 2), (1, 2))
    assert al.token_range(Span(0, 1)) == (0, 1) and al.token_range(Span(1, 2)) == (0, 2) and al.last_token(Span(1, 2)) == 1
    word = align_tokens(tiny_tokenizer, "naïve")
    a_tokens = range(*word.token_range(Span(1, 2)))
    assert a_tokens and all(word.offsets[t][0] <= 1 < word.offsets[t][1] for t in a_tokens)  # "a" is in a token


@pytest.mark.parametrize("ids,needle", [([-1], r"token_ids\[0\] is -1"), ([5, 2**32], r"token_ids\[1\] is 4294967296"),
                                        ([1.5], "must be integers"), (["7"], "must be integers"), ([True], "must be integers"),
                                        ([10**5000], "an integer of 16610 bits"), (7, "must be a sequence of integers")])
def test_ids_that_are_not_token_ids_are_a_clear_error(tiny_tokenizer, ids, needle):
    with pytest.raises(FactualityInputError, match=needle):
        align_tokens(tiny_tokenizer, "a", ids)


def test_lone_surrogate_and_unfinished_character_are_clear_errors(tiny_tokenizer):
    with pytest.raises(FactualityInputError, match=r"lone surrogate '\\ud800' at character 1"):
        align_tokens(tiny_tokenizer, "a\ud800b")
    ids = tiny_tokenizer("ok 🙂", add_special_tokens=False)["input_ids"]
    with pytest.raises(FactualityInputError, match="end inside a character"):
        align_tokens(tiny_tokenizer, "ok 🙂", ids[:-1])
