"""The lab's claim pipeline, one for every lab reward and the lab's evaluation: regex sentences → identity claims
(a sentence is a claim; the world's abstention sentences left out unless asked) → no evidence → the world's verifier
(``kb_exact`` on the synthetic world, ``CountryVerifier`` on the countries)."""

from __future__ import annotations

from collections.abc import Sequence

from nemo_factuality.claims.identity import IdentityExtractor
from nemo_factuality.lab.worlds import LabWorld, get_world
from nemo_factuality.pipeline import FactualityPipeline
from nemo_factuality.types import Claim, Sentence


class LabClaimExtractor(IdentityExtractor):
    """Claim = sentence, except the world's abstention sentences (``... unknown.``, "I don't know the currency of
    X."): they assert nothing checkable, so the lab's claim extractor leaves them out, as an LLM extractor would not
    extract "X's job is unknown" as a fact."""

    def __init__(self, world: LabWorld | None = None) -> None:
        super().__init__()
        self.world = world or get_world("synthetic")

    def extract_batch(self, prompts: Sequence[str], responses: Sequence[str],
                      sentences: Sequence[Sequence[Sentence]]) -> list[list[Claim]]:
        out = []
        for claims in super().extract_batch(prompts, responses, sentences):
            kept = [c for c in claims if not self.world.is_abstention(c.text)]
            out.append([Claim(id=i, text=c.text, sentence_id=c.sentence_id, span=c.span) for i, c in enumerate(kept)])
        return out


def lab_pipeline(store_path: str, *, abstentions_are_claims: bool = False, world: str = "synthetic") -> FactualityPipeline:
    """The pipeline of the module docstring on the store at ``store_path``."""
    from nemo_factuality.knowledge.evidence import NullEvidence
    from nemo_factuality.text.segment import RegexSegmenter

    w = get_world(world)
    extractor = IdentityExtractor() if abstentions_are_claims else LabClaimExtractor(w)
    return FactualityPipeline(RegexSegmenter(), extractor, NullEvidence(), w.verifier(store_path), abstain_detection=None)
