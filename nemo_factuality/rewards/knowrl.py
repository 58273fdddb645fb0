"""KnowRL (arXiv 2506.19807): format + correctness + knowledge-base fact rewards for slow-thinking models.

* ``r_format``: the completion (``<think>`` prefixed if missing) must match
  ``<think> … </think> <answer> … </answer>`` with non-empty parts: +1, else −1.
* ``r_correct``: a SimpleQA-style grader against ``ground_truth``: CORRECT +2, NOT_ATTEMPTED +1
  (refusal), INCORRECT −1; no or empty ``<answer>`` −1. A grade that failed or could not be read
  makes the sample NaN with the reason in ``details`` (``grade_failure: 0`` restores the released
  code's silent 0); counted in ``stats()``.
* ``r_fact``: FActScore over the think part's atomic facts against the knowledge base, scoped to
  the sample's ``topic``: a ``;``-joined topic searches every title (``MultiTitleEvidence``), NLI
  entailment ≥ 0.3 over k=5 passages, length penalty γ=10; no facts → 0; a failed fact-check → NaN.
* ``combine="gated"`` (released): ``r_combined = -1 + r_fact`` if the answer is wrong and not a
  refusal, else ``r_correct``; ``"additive"`` (paper): ``r_correct + r_fact``. Score = ``r_format + r_combined``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.interfaces import EvidenceQuery
from nemo_factuality.metrics.factscore import length_penalty
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import (
    GuardConfig,
    RewardParts,
    is_blank,
    mark_failures,
    nan_array,
    neutralize_injection,
    validate_batch,
)
from nemo_factuality.rewards.common import (
    check_details,
    extract_answer,
    extract_think,
    guarded_check,
    judge_from,
    pipeline_from,
    role_judge,
)
from nemo_factuality.types import FactualityInputError, Label, RewardBatch

_FORMAT = re.compile(r"^<think>\s*(\S(?:(?!<think>|<answer>)[\s\S])*?)\s*</think>\s*<answer>\s*"
                     r"(\S(?:(?!<think>|<answer>)[\s\S])*?)\s*</answer>$")
GRADE_REWARD = {"CORRECT": 2.0, "NOT_ATTEMPTED": 1.0, "INCORRECT": -1.0}


@dataclass
class KnowRLConfig:
    combine: str = "gated"  # "gated" (released code) or "additive" (paper)
    gamma: float = 10.0  # FActScore length penalty γ of the fact reward
    grade_failure: float | None = None  # None: a failed grade fails the sample (NaN); released code: 0.0
    guards: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.combine not in ("gated", "additive"):
            raise FactualityInputError(f"knowrl.combine must be 'gated' or 'additive', got {self.combine!r}")


def format_reward(completion: str) -> float:
    text = completion if completion.startswith("<think>") else "<think>" + completion
    return 1.0 if _FORMAT.match(text.strip()) else -1.0


def combine(r_correct: float, refusal: bool, r_fact: float, mode: str) -> float:
    if mode == "additive":
        return r_correct + r_fact
    return -1.0 + r_fact if (r_correct == -1.0 and not refusal) else r_correct


class MultiTitleEvidence:
    """Evidence for ``;``-joined topics (KnowRL's KB titles): the inner provider is asked once per title
    (all in one batch) and the passages are interleaved, deduplicated and capped at the provider's ``k``
    (the longest single answer when it has none), so every title is searched, not only the first."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # health(), stats of the wrapped provider
        return getattr(self.inner, name)

    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        expanded, owner = [], []
        for j, q in enumerate(queries):
            titles = [t.strip() for t in q.topic.split(";") if t.strip()] if q.topic and ";" in q.topic else [q.topic]
            for title in titles or [None]:
                expanded.append(dataclasses.replace(q, topic=title))
                owner.append(j)
        found = self.inner.get_batch(expanded) if expanded else []
        per_query: list[list[list[str]]] = [[] for _ in queries]
        for j, passages in zip(owner, found):
            per_query[j].append(list(passages))
        out = []
        for lists in per_query:
            cap = getattr(self.inner, "k", None) or max((len(x) for x in lists), default=0)
            merged, seen = [], set()
            for passage in (p for group in itertools.zip_longest(*lists) for p in group if p is not None):
                if passage not in seen:
                    seen.add(passage)
                    merged.append(passage)
            out.append(merged[:cap])
        return out


class KnowRLReward(RewardParts):
    def __init__(self, fact_pipeline: Any, grader: Any, cfg: KnowRLConfig | None = None) -> None:
        if not isinstance(getattr(fact_pipeline, "evidence", None), (MultiTitleEvidence, type(None))):
            fact_pipeline = copy.copy(fact_pipeline)  # never mutate the caller's pipeline
            fact_pipeline.evidence = MultiTitleEvidence(fact_pipeline.evidence)
        self.pipeline, self.grader, self.cfg = fact_pipeline, grader, cfg or KnowRLConfig()
        self.errors = {"grade_failures": 0}

    def _parts(self) -> list[Any]:
        return [self.pipeline, getattr(self.grader, "client", None)]

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **{k: float(v) for k, v in self.errors.items()}}

    def _correctness(self, prompts, completions, golds, errors: list[str | None]) -> tuple[np.ndarray, list[bool]]:
        n = len(completions)
        answers = [extract_answer(c if c.startswith("<think>") else "<think>" + c) for c in completions]
        r = np.full(n, -1.0)
        refusal = [False] * n
        ask = [i for i in range(n) if answers[i]]
        grades = self.grader.grade_batch([prompts[i] for i in ask], [str(golds[i]) for i in ask], [answers[i] for i in ask]) if ask else []
        for i, (grade, err) in zip(ask, grades):
            if grade is None:
                self.errors["grade_failures"] += 1
                if self.cfg.grade_failure is None:
                    r[i], errors[i] = np.nan, f"answer grading failed: {err}"
                else:
                    r[i] = self.cfg.grade_failure
            else:
                r[i] = GRADE_REWARD[grade]
                refusal[i] = grade == "NOT_ATTEMPTED"
        return r, refusal

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="knowrl", required=("ground_truth",))
        cfg, n = self.cfg, len(completions)
        errors: list[str | None] = [None] * n
        fmt = np.array([format_reward(c) for c in completions])
        r_correct, refusal = self._correctness(prompts, completions, columns["ground_truth"], errors)
        thinks = [extract_think(c if c.startswith("<think>") else "<think>" + c) or c for c in completions]
        topics = columns.get("topic") or [None] * n
        titles = [t.strip() if isinstance(t, str) and t.strip() else None for t in topics]
        checks, _ = guarded_check(self.pipeline, cfg.guards, prompts, thinks, topics=titles)
        hits = [neutralize_injection(c)[1] for c in completions]  # the answer part is judged too
        r_fact = np.zeros(n)
        for i, check in enumerate(checks):
            if check is not None and check.error is not None:
                errors[i] = errors[i] or check.error
                continue
            decisions = [v.label is Label.SUPPORTED for v in (check.verdicts if check else []) if v.label is not Label.UNPARSEABLE]
            if decisions:
                r_fact[i] = float(np.mean(decisions)) * length_penalty(len(decisions), cfg.gamma)
        scores = nan_array(n)
        for i in range(n):
            if not is_blank(completions[i]):
                scores[i] = fmt[i] + combine(r_correct[i], refusal[i], r_fact[i], cfg.combine)
                scores[i] -= cfg.guards.injection_penalty if hits[i] else 0.0
        details = mark_failures(scores, errors, [{**check_details(c), "injection_hits": h} for c, h in zip(checks, hits, strict=True)],
                                who="knowrl")
        return RewardBatch(scores, {"format": fmt, "correct": r_correct, "fact": r_fact,
                                    "refusal": np.array(refusal, dtype=np.float64)}, details=details)


@REWARDS.register("knowrl", options=KnowRLConfig)
def build_knowrl(pipeline: dict, judge: Any = None, grader_judge: Any = None, **cfg: Any) -> KnowRLReward:
    """KnowRL from config: ``pipeline`` (factscore extractor, kb evidence, nli ≥ 0.3) and a grading judge."""
    from nemo_factuality.verify.llm_judge import AnswerGrader

    client = judge_from(judge)
    grader_client = role_judge(grader_judge, judge) or client
    if grader_client is None:
        raise FactualityInputError("knowrl needs a grading judge: set reward.judge (or reward.grader_judge)")
    guards = GuardConfig(**cfg.pop("guards", {}))
    shared = judge if isinstance(judge, Mapping) else None
    return KnowRLReward(pipeline_from(pipeline, client, shared), AnswerGrader(grader_client), KnowRLConfig(guards=guards, **cfg))
