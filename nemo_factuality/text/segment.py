"""Sentence segmentation that keeps exact character spans, with ``<think>``/``<answer>`` sections.

Every returned ``Sentence`` satisfies ``sentence.span.slice(response) == sentence.text``: spans
point into the exact response string, so token alignment never re-tokenises a sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nemo_factuality.registry import SEGMENTERS
from nemo_factuality.types import FactualityInputError, Sentence, Span

# Common abbreviations after which a period does not end a sentence (lower-cased, without the dot).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e u.s u.k no fig al approx inc ltd co corp gen col lt sgt jan feb mar "
    "apr jun jul aug sep sept oct nov dec mt ft".split()
)
# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) and then whitespace,
# or at CJK full-width terminators (no whitespace needed), or at a line break.
_BOUNDARY = re.compile(r"(?<=[.!?])(?P<close>[\"'”’)\]]*)\s+|(?<=[。！？])|\n+")
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)


@dataclass(frozen=True)
class Section:
    """A region of the response: ``think``, ``answer`` or plain ``response`` text."""

    name: str
    span: Span


def find_sections(response: str) -> list[Section]:
    """Split a response into think / answer / response regions (tags themselves are excluded).

    Without any tags the whole response is one ``response`` section. An unclosed ``<think>`` or
    ``<answer>`` runs to the end of the text (truncated generations).
    """
    tagged: list[Section] = []
    for name, pattern in (("think", _THINK), ("answer", _ANSWER)):
        for m in pattern.finditer(response):
            tagged.append(Section(name, Span(m.start(1), m.end(1))))
    tagged.sort(key=lambda s: s.span.start)
    sections: list[Section] = []
    cursor = 0
    for sec in tagged:
        if sec.span.start < cursor:  # nested/overlapping tags: keep the first region
            continue
        gap = _strip_tags(response, cursor, sec.span.start)
        if gap is not None:
            sections.append(Section("response", gap))
        sections.append(sec)
        cursor = sec.span.end
    tail = _strip_tags(response, cursor, len(response))
    if tail is not None:
        sections.append(Section("response", tail))
    return sections


def _strip_tags(text: str, start: int, end: int) -> Span | None:
    """The part of ``text[start:end]`` that is not a tag or whitespace, or None if nothing is left."""
    chunk = re.sub(r"</?(think|answer)>", lambda m: " " * len(m.group(0)), text[start:end])
    left = len(chunk) - len(chunk.lstrip())
    right = len(chunk.rstrip())
    if right <= left:
        return None
    return Span(start + left, start + right)


# Longer than any abbreviation: a letters-and-dots run this long before a period is never one.
_ABBREVIATION_LOOKBACK = 1 + max(len(a) for a in _ABBREVIATIONS)


def _is_abbreviation(text: str, period_index: int) -> bool:
    """True if the period at ``period_index`` closes an abbreviation or an initial ("J. K.").

    The word is the run of ASCII letters and dots just before the period, starting at a letter.
    Only ``_ABBREVIATION_LOOKBACK`` characters are examined, so the cost per period is bounded
    (segmentation stays linear on "A. A. A. ..."): a longer run cannot be an abbreviation.
    """
    lo = max(0, period_index - _ABBREVIATION_LOOKBACK)
    start = period_index
    while start > lo and _is_word_char(text[start - 1]):
        start -= 1
    if start == lo and lo > 0 and _is_word_char(text[lo - 1]):
        return False  # the run goes on beyond the window: too long for an abbreviation
    while start < period_index and text[start] == ".":
        start += 1  # the word starts at a letter
    if start == period_index:
        return False
    word = text[start:period_index].lower()
    return word in _ABBREVIATIONS or (len(word) == 1 and text[start].isupper())


def _is_word_char(ch: str) -> bool:
    return ch == "." or ("a" <= ch <= "z") or ("A" <= ch <= "Z")


def split_sentences(text: str, start: int = 0, end: int | None = None) -> list[Span]:
    """Sentence spans (whitespace-trimmed) inside ``text[start:end]``.

    Example: an abbreviation does not end a sentence.
        >>> text = "Dr. Smith was born in 1950. He lived in Oslo."
        >>> [span.slice(text) for span in split_sentences(text)]
        ['Dr. Smith was born in 1950.', 'He lived in Oslo.']
    """
    end = len(text) if end is None else end
    spans: list[Span] = []
    sent_start = start
    for m in _BOUNDARY.finditer(text, start, end):
        stop = m.start()  # just after the terminator
        cut = m.end("close") if m.group("close") is not None else stop  # keep closing quotes/brackets
        if stop > 0 and text[stop - 1] == "." and "\n" not in m.group(0) and _is_abbreviation(text, stop - 1):
            continue
        _append_trimmed(text, sent_start, cut, spans)
        sent_start = m.end()
    _append_trimmed(text, sent_start, end, spans)
    return spans


def _append_trimmed(text: str, start: int, end: int, out: list[Span]) -> None:
    chunk = text[start:end]
    left = len(chunk) - len(chunk.lstrip())
    right = len(chunk.rstrip())
    if right > left:
        out.append(Span(start + left, start + right))


#: The regex segmenter's default ``max_chars``: a response longer than this is refused (``segmenter.max_chars`` raises it).
MAX_RESPONSE_CHARS = 200_000


@SEGMENTERS.register("regex")
class RegexSegmenter:
    """Rule-based sentence splitter (no model download), section-aware.

    Args:
        max_chars: responses longer than this raise ``FactualityInputError`` (guards rewards against
            pathological inputs; raise it in config for very long documents).
    """

    def __init__(self, max_chars: int = MAX_RESPONSE_CHARS) -> None:
        self.max_chars = max_chars

    def split(self, response: str) -> list[Sentence]:
        if not isinstance(response, str):
            raise FactualityInputError(f"response must be str, got {type(response).__name__}")
        if len(response) > self.max_chars:
            raise FactualityInputError(
                f"response has {len(response)} characters, more than segmenter.max_chars={self.max_chars}; "
                "raise that limit if such responses are expected"
            )
        sentences: list[Sentence] = []
        for section in find_sections(response):
            for span in split_sentences(response, section.span.start, section.span.end):
                sentences.append(Sentence(len(sentences), span.slice(response), span, section.name))  # type: ignore[arg-type]
        return sentences
