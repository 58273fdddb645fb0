"""FactAlign (arXiv 2410.01691): response and sentence labels for KTO + fKTO from SAFE-style checking.

* response label ``f1@K > t`` (K=100, t=0.75), with SAFE's F1@K (P = S/(S+NS), R = min(1, S/K),
  irrelevant claims excluded); a response repeating any ``rep_ngram``-gram more than 5 times is False.
* sentence label: the fraction of a sentence's facts that are Supported ≥ ``t_s`` (1.0: every fact;
  irrelevant facts count as unsupported); a repeated sentence, or one repeating an n-gram more than
  3 times, is False. Sentences with no facts get no label (they are left out of fKTO).
  Claim dedup does not hide a repeat: a repeat of a fact-bearing sentence is still a False label.
* ``precision: safe`` (S/(S+NS), default) or ``notebook`` (S/num_claims, irrelevant included).
* the scalar is f1@K (for logging / filtering); training uses ``label`` and ``sentence_labels``.
  ``guards.injection_penalty`` is subtracted from it and makes the response label False.
* a response that could not be fact-checked gets no label: score and ``label`` NaN, no sentence
  labels, the reason in ``details[i]["error"]`` (never an "undesirable" KTO example).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.metrics.safe import f1_at_k
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import (
    GuardConfig,
    RewardParts,
    check_errors,
    mark_failures,
    nan_array,
    validate_batch,
)
from nemo_factuality.rewards.common import check_details, guarded_check, judge_from, pipeline_from
from nemo_factuality.types import FactualityInputError, Label, RewardBatch, Span


@dataclass
class FactAlignConfig:
    k: int = 100  # K of f1@K (the response label's score)
    t: float = 0.75  # a response is desirable when f1@K > t
    t_s: float = 1.0  # a sentence is true when this share of its claims is supported
    rep_ngram: int = 10  # n of the repetition filter's n-grams
    max_response_repeats: int = 5  # a response repeating an n-gram more often is undesirable
    max_sentence_repeats: int = 3  # a sentence repeating an n-gram more often is false
    # "safe": P = S/(S+NS) (SAFE's metric_utils, the default); "notebook": P = S/num_claims with
    # irrelevant claims counted (FactAlign's training notebook, Untitled.ipynb cell 30).
    precision: str = "safe"
    guards: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.precision not in ("safe", "notebook"):
            raise FactualityInputError(f"factalign.precision must be 'safe' or 'notebook', got {self.precision!r}")


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

    def _f1(self, verdicts: Sequence[Any]) -> tuple[float, float]:
        """(f1@K, precision) with SAFE's precision S/(S+NS) or the notebook's S/num_claims (irrelevant included)."""
        cfg = self.cfg
        s = sum(v.label is Label.SUPPORTED for v in verdicts)
        ns = sum(v.label in (Label.NOT_SUPPORTED, Label.NOT_ENOUGH_INFO) for v in verdicts)
        if cfg.precision == "safe":
            score = f1_at_k(s, ns, cfg.k)
            return float(score.f1), (score.precision if score.precision is not None else 0.0)
        precision = s / len(verdicts) if verdicts else 0.0
        recall = min(1.0, s / cfg.k)
        return (2 * precision * recall / (precision + recall) if s else 0.0), precision

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="factalign")
        cfg, n = self.cfg, len(completions)
        checks, hits = guarded_check(self.pipeline, cfg.guards, prompts, completions, topics=columns.get("topic"))
        errors = check_errors(checks)
        f1, precision, label, n_claims = nan_array(n), nan_array(n), np.zeros(n), np.zeros(n)
        sent_labels: list[list[bool]] = []
        sent_spans: list[list[Span]] = []
        for i, check in enumerate(checks):
            labels, spans = [], []
            if check is not None and errors[i] is not None:
                label[i] = np.nan  # no KTO label for a response that could not be checked
            elif check is not None:
                by_id = {v.claim_id: v for v in check.verdicts}
                verdicts = [by_id[c.id] for c in check.claims if by_id[c.id].label is not Label.UNPARSEABLE]
                n_claims[i] = len(verdicts)
                f1[i], precision[i] = self._f1(verdicts)
                repetitive = max_ngram_repeats(completions[i], cfg.rep_ngram) > cfg.max_response_repeats
                penalised = bool(hits[i]) and cfg.guards.injection_penalty > 0
                f1[i] -= cfg.guards.injection_penalty if hits[i] else 0.0
                label[i] = float(f1[i] > cfg.t and not repetitive and not penalised)
                labels, spans = self._sentence_labels(check, by_id)
            sent_labels.append(labels)
            sent_spans.append(spans)
        scores = f1.copy()
        details = mark_failures(scores, errors, [{**check_details(c), "injection_hits": h} for c, h in zip(checks, hits, strict=True)],
                                who="factalign")
        return RewardBatch(scores, {"f1": scores.copy(), "precision": precision, "label": label, "n_claims": n_claims},
                           sentence_labels=sent_labels, sentence_spans=sent_spans, details=details)

    def _sentence_labels(self, check: Any, by_id: dict) -> tuple[list[bool], list[Span]]:
        """One label per sentence with facts; a repeat of an earlier fact-bearing sentence is False even
        when claim dedup left it no facts of its own."""
        cfg = self.cfg
        had_facts: dict[str, bool] = {}  # normalised sentence text seen so far -> did it carry facts
        labels, spans = [], []
        for sent in check.sentences:
            key = " ".join(sent.text.split())
            seen_before, repeat_of_factual = key in had_facts, had_facts.get(key, False)
            facts = [by_id[c.id] for c in check.claims if c.sentence_id == sent.id and by_id[c.id].label is not Label.UNPARSEABLE]
            had_facts[key] = had_facts.get(key, False) or bool(facts)
            if not facts and not repeat_of_factual:
                continue
            frac = sum(v.label is Label.SUPPORTED for v in facts) / len(facts) if facts else 0.0
            repeated = seen_before or max_ngram_repeats(sent.text, cfg.rep_ngram) > cfg.max_sentence_repeats
            labels.append(frac >= cfg.t_s and not repeated)
            spans.append(sent.span)
        return labels, spans


@REWARDS.register("factalign", options=FactAlignConfig)
def build_factalign(pipeline: dict, judge: Any = None, **cfg: Any) -> FactAlignLabeler:
    guards = GuardConfig(**cfg.pop("guards", {}))
    shared = judge if isinstance(judge, Mapping) else None
    return FactAlignLabeler(pipeline_from(pipeline, judge_from(judge), shared), FactAlignConfig(guards=guards, **cfg))
