"""Exact verification of claims against the knowledge store's structured facts (offline default).

A claim is SUPPORTED when it states a stored fact, NOT_SUPPORTED when it states a different value
for a (subject, relation) the store knows, and NOT_ENOUGH_INFO otherwise. Claim shapes are learnt
from the facts' own sentences: ``"Ada Byron was born in 1815."`` for (Ada Byron, born_year, 1815)
yields the template ``{subject} was born in {value}`` for ``born_year``, which then reads any claim
of that shape. Matching ignores case, whitespace and punctuation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.knowledge.store import KnowledgeStore, normalize
from nemo_factuality.registry import VERIFIERS
from nemo_factuality.types import Label, Verdict

UNKNOWN_VALUES = frozenset({"unknown", "not known", "i don t know"})


def _template_of(subject: str, value: str, text: str) -> str | None:
    """Normalised sentence with the subject and value replaced by placeholders (None if absent)."""
    norm, s, v = normalize(text), normalize(subject), normalize(value)
    if not s or not v or s not in norm or v not in norm:
        return None
    return norm.replace(s, "\x00S\x00", 1).replace(v, "\x00V\x00", 1)


def _compile(template: str) -> re.Pattern[str]:
    parts = re.split("(\x00S\x00|\x00V\x00)", template)
    pattern = "".join("(?P<subject>.+?)" if p == "\x00S\x00" else "(?P<value>.+?)" if p == "\x00V\x00" else re.escape(p)
                      for p in parts)
    return re.compile(f"^{pattern}$")


@VERIFIERS.register("kb_exact")
class KBExactVerifier:
    """Verify claims against (subject, relation, value) facts in a ``KnowledgeStore``.

    Args:
        store_path: the SQLite store built by ``nemo-factuality kb build --facts``.
        abstain_values: values that mean "I don't know" (a claim stating one is IRRELEVANT:
            it asserts nothing checkable, and rewards treat it as an abstention).
    """

    def __init__(self, store_path: str, abstain_values: Sequence[str] = tuple(UNKNOWN_VALUES)) -> None:
        self.store = KnowledgeStore(store_path)
        self.abstain_values = {normalize(v) for v in abstain_values}
        self._facts: dict[str, dict[str, set[str]]] = {}
        self._exact: set[str] = set()
        templates: dict[str, str] = {}
        for fact in self.store.all_facts():
            subj, rel, val = normalize(fact.subject), normalize(fact.relation), normalize(fact.value)
            self._facts.setdefault(subj, {}).setdefault(rel, set()).add(val)
            if fact.text:
                self._exact.add(normalize(fact.text))
                tpl = _template_of(fact.subject, fact.value, fact.text)
                if tpl is not None:
                    templates.setdefault(tpl, rel)
        # Longer templates first, so the most specific shape wins.
        self._templates = [(_compile(t), rel) for t, rel in sorted(templates.items(), key=lambda x: -len(x[0]))]

    def health(self) -> dict[str, str | None]:
        return {"knowledge_store": self.store.health()}

    def _judge(self, text: str) -> tuple[Label, str]:
        norm = normalize(text)
        if norm in self._exact:
            return Label.SUPPORTED, "exact fact sentence"
        for pattern, rel in self._templates:
            m = pattern.match(norm)
            if not m:
                continue
            subj, val = m.group("subject"), m.group("value")
            known = self._facts.get(subj, {}).get(rel)
            if val in self.abstain_values:
                return Label.IRRELEVANT, f"abstains on ({subj}, {rel})"
            if known is None:
                continue  # shape matched but subject unknown: try other shapes
            if val in known:
                return Label.SUPPORTED, f"({subj}, {rel}, {val})"
            return Label.NOT_SUPPORTED, f"({subj}, {rel}) is {sorted(known)}, not {val!r}"
        return Label.NOT_ENOUGH_INFO, "no stored fact about this claim"

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        out = []
        for item in items:
            label, why = self._judge(item.claim.text)
            out.append(Verdict(claim_id=item.claim.id, label=label, score=1.0 if label is Label.SUPPORTED else 0.0,
                               evidence=(why,)))
        return out
