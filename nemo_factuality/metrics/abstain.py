"""Abstention detection, equal to FActScore's ``is_response_abstained(generation, fn_type)``.

* ``generic``: starts with "I'm sorry" (case-sensitive) or contains "provide more" anywhere.
* ``perplexity_ai``: citations ``[n]`` removed, a leading "According to , " repaired, then abstain
  if the text starts with one of 11 phrases, or if the first ``\\n\\n`` paragraph is empty or
  contains a phrase (all case-insensitive substring matches).
* any other mode (``None``, ``"none"``): never abstained.
"""

from __future__ import annotations

import re

PERPLEXITY_PHRASES = (
    "I could not find any information",
    "The search results do not provide",
    "There is no information",
    "There are no search results",
    "there are no provided search results",
    "not provided in the search results",
    "is not mentioned in the provided search results",
    "There seems to be a mistake in the question",
    "Not sources found",
    "No sources found",
    "Try a more general question",
)
_CITATION = re.compile(r"\s*\[\d+\]\s*")


def _contains_phrase(text: str) -> bool:
    lowered = text.lower()
    return any(p.lower() in lowered for p in PERPLEXITY_PHRASES)


def _perplexity_abstained(generation: str) -> bool:
    text = _CITATION.sub("", generation)
    if text.startswith("According to , "):
        text = "According to the search results, " + text[len("According to , "):]
    lowered = text.lower()
    if any(lowered.startswith(p.lower()) for p in PERPLEXITY_PHRASES):
        return True
    first_paragraph = text.split("\n\n")[0]
    return not first_paragraph.strip() or _contains_phrase(first_paragraph)


def is_response_abstained(generation: str, mode: str | None = "generic") -> bool:
    """True if ``generation`` is an abstention under FActScore's rule ``mode``."""
    if mode == "generic":
        return generation.startswith("I'm sorry") or "provide more" in generation
    if mode == "perplexity_ai":
        return _perplexity_abstained(generation)
    return False
