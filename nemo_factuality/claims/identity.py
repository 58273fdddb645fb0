"""The identity extractor: every sentence is one claim (FSPO's sentence-level verification)."""

from __future__ import annotations

from collections.abc import Sequence

from nemo_factuality.registry import EXTRACTORS
from nemo_factuality.types import Claim, FactualityInputError, Sentence


@EXTRACTORS.register("identity")
class IdentityExtractor:
    """Claim = sentence, keeping the sentence's span and id.

    Args:
        segments: which sections' sentences become claims (FSPO checks only ``think``).
    """

    def __init__(self, segments: Sequence[str] = ("think", "answer", "response")) -> None:
        bad = set(segments) - {"think", "answer", "response"}
        if bad:
            raise FactualityInputError(f"identity extractor: unknown segments {sorted(bad)}; use think/answer/response")
        self.segments = tuple(segments)

    def extract_batch(self, prompts: Sequence[str], responses: Sequence[str],
                      sentences: Sequence[Sequence[Sentence]]) -> list[list[Claim]]:
        out = []
        for sents in sentences:
            kept = [s for s in sents if s.segment in self.segments and s.text.strip()]
            out.append([Claim(id=i, text=s.text, sentence_id=s.id, span=s.span) for i, s in enumerate(kept)])
        return out
