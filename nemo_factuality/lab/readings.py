"""A sentence read as a claim about one attribute of an entity, and how a reading is judged against the stored
values: what both worlds (``lab/world.py``, ``lab/countries.py``), the world interface (``lab/worlds.py``) and the
rewards share, so it sits below all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ABSTAIN_VALUE = "unknown"
GOLD_SEP = "|"  # the ground_truth column joins an attribute's accepted values with it


@dataclass(frozen=True)
class Reading:
    """One sentence read as a claim about one attribute of a subject.

    ``values``: per value the sentence names, the canonical values that name may mean (one, unless the name is
    ambiguous: "dollar"); empty when it names none (an invented value). ``abstains``: it declines the attribute.
    """

    subject: str | None  # None: no subject named (a pronoun)
    attribute: str | None  # None only for an abstention about no attribute
    values: tuple[frozenset[str], ...]
    abstains: bool = False

    @property
    def value(self) -> str:
        """``unknown`` for an abstention, else the named values (alternatives by ``/``) joined by ``|``."""
        if self.abstains:
            return ABSTAIN_VALUE
        return "|".join("/".join(sorted(v)) for v in self.values)


def is_correct(reading: Reading, gold: str) -> bool:
    """Whether a (non-abstaining) reading states the subject's value: it names at least one value, and each name
    may mean one of the accepted values (``gold``: the ground_truth column's ``a|b``)."""
    accepted = set(gold.split(GOLD_SEP))
    return bool(reading.values) and all(v & accepted for v in reading.values)


def named_values(reading: Reading, gold: str) -> list[str]:
    """The values a reading names, each as its accepted meaning when it has one (else its first): FSPO's answer."""
    accepted = set(gold.split(GOLD_SEP))
    return [sorted(v & accepted or v)[0] for v in reading.values]


def covers(item: Reading, sentence: Reading) -> bool:
    """KLCF's coverage: ``sentence`` states the checklist item's fact (same attribute, each of the item's values)."""
    if item.abstains or sentence.abstains or item.attribute != sentence.attribute:
        return False
    if item.subject and sentence.subject and item.subject != sentence.subject:
        return False
    return all(any(v & w for w in sentence.values) for v in item.values)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences_of(text: str) -> list[str]:
    """A response's sentences as the decode-time threshold and the per-sentence confidences split it."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]
