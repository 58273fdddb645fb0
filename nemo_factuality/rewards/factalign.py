"""FactAlign (arXiv 2410.01691): response and sentence labels for KTO + fKTO from SAFE-style checking.

* response label ``f1@K > t`` (K=100, t=0.75), with SAFE's F1@K (P = S/(S+NS), R = min(1, S/K),
  irrelevant claims excluded); a response repeating any ``rep_ngram``-gram more than 5 times is False.
* sentence label: the fraction of a sentence's facts that are Supported ≥ ``t_s`` (1.0: every fact;
  irrelevant facts count as unsupported); a repeated sentence, or one repeating an n-gram more than
  3 times, is False. Sentences with no facts get no label (they are left out of fKTO).
* the scalar is f1@K (for logging / filtering); training uses ``label`` and ``sentence_labels``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from nemo_factuality.metrics.safe import f1_at_k
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import GuardConfig, RewardParts, nan_array, validate_batch
from nemo_factuality.rewards.common import guarded_check, judge_from, pipeline_from
from nemo_factuality.types import Label, RewardBatch, Span


@dataclass
class FactAlignConfig:
    k: int = 100
    t: float = 0.75
    t_s: float = 1.0
    rep_ngram: int = 10
    max_response_repeats: int = 5
    max_sentence_repeats: int = 3
    guards: GuardConfig = field(default_factory=GuardConfig)


def max_ngram_repeats(text: str, n: int) -> int:
    words = text.split()
    if len(words) < n:
        return 0
    return max(Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1)).values())


class FactAlignLabeler(RewardParts):
    def __init__(self, pipeline: Any, cfg: FactAlignConfig | None = None) -> None:
        self.pipeline, self.cfg = pipeline, cfg or FactAlignConfig()

    def _parts(self) -> list[Any]:
        return [self.pipeline]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="factalign")
        cfg, n = self.cfg, len(completions)
        checks, _ = guarded_check(self.pipeline, cfg.guards, prompts, completions, topics=columns.get("topic"))
        f1, precision, label, n_claims = nan_array(n), nan_array(n), np.zeros(n), np.zeros(n)
        sent_labels: list[list[bool]] = []
        sent_spans: list[list[Span]] = []
        for i, check in enumerate(checks):
            labels, spans = [], []
            if check is not None:
                by_id = {v.claim_id: v for v in check.verdicts}
                verdicts = [by_id[c.id] for c in check.claims if by_id[c.id].label is not Label.UNPARSEABLE]
                s = sum(v.label is Label.SUPPORTED for v in verdicts)
                ns = sum(v.label in (Label.NOT_SUPPORTED, Label.NOT_ENOUGH_INFO) for v in verdicts)
                n_claims[i] = len(verdicts)
                score = f1_at_k(s, ns, cfg.k)
                f1[i] = float(score.f1)
                precision[i] = score.precision if score.precision is not None else 0.0
                repetitive = max_ngram_repeats(completions[i], cfg.rep_ngram) > cfg.max_response_repeats
                label[i] = float(f1[i] > cfg.t and not repetitive)
                labels, spans = self._sentence_labels(check, by_id)
            sent_labels.append(labels)
            sent_spans.append(spans)
        return RewardBatch(f1, {"f1": f1, "precision": precision, "label": label, "n_claims": n_claims},
                           sentence_labels=sent_labels, sentence_spans=sent_spans)

    def _sentence_labels(self, check: Any, by_id: dict) -> tuple[list[bool], list[Span]]:
        cfg = self.cfg
        seen: Counter[str] = Counter()
        labels, spans = [], []
        for sent in check.sentences:
            seen[" ".join(sent.text.split())] += 1
            facts = [by_id[c.id] for c in check.claims if c.sentence_id == sent.id and by_id[c.id].label is not Label.UNPARSEABLE]
            if not facts:
                continue
            frac = sum(v.label is Label.SUPPORTED for v in facts) / len(facts)
            repeated = seen[" ".join(sent.text.split())] > 1 or max_ngram_repeats(sent.text, cfg.rep_ngram) > cfg.max_sentence_repeats
            labels.append(frac >= cfg.t_s and not repeated)
            spans.append(sent.span)
        return labels, spans


@REWARDS.register("factalign")
def build_factalign(pipeline: dict, judge: Any = None, **cfg: Any) -> FactAlignLabeler:
    guards = GuardConfig(**cfg.pop("guards", {}))
    return FactAlignLabeler(pipeline_from(pipeline, judge_from(judge)), FactAlignConfig(guards=guards, **cfg))
