"""KLCF (arXiv 2509.23765): dual-fact alignment — checklist recall + truthfulness precision (+ general RM, format).

``R = w_ck·r_ck + w_tf·r_tf + w_rm·σ(s_RM) + r_fmt`` (methods.md §1.4 DECISION; every weight in config):

* ``r_ck``: fraction of the prompt's checklist items (column ``checklist``) the coverage judge finds
  in the response; skipped (0 weight, component NaN) when a prompt has no checklist.
* ``r_tf``: mean p(true) of the response's unique claims from the truthfulness verifier (no
  retrieval online). A non-empty response with no claims gets 0 — silence is not precision 1.0.
* ``s_RM``: a general reward model's score (callable ``(prompts, completions) -> list[float]``).
* ``r_fmt``: 0 when ``<think>…</think><answer>…</answer>`` is well formed, else ``format_penalty``
  (only when ``require_format``, the zero-RL setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import GuardConfig, RewardParts, nan_array, validate_batch
from nemo_factuality.rewards.common import guarded_check, judge_from, pipeline_from
from nemo_factuality.types import FactualityInputError, Label, RewardBatch

_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


@dataclass
class KLCFConfig:
    w_checklist: float = 1.0
    w_truthfulness: float = 1.0
    w_rm: float = 1.0
    require_format: bool = False
    format_penalty: float = -1.0
    rm_temperature: float = 1.0  # σ(s / T) squashing of the general RM score
    guards: GuardConfig = field(default_factory=GuardConfig)


class KLCFReward(RewardParts):
    def __init__(self, truth_pipeline: Any, coverage_judge: Any, cfg: KLCFConfig | None = None,
                 general_rm: Callable[[Sequence[str], Sequence[str]], Sequence[float]] | None = None) -> None:
        self.pipeline, self.coverage, self.cfg, self.general_rm = truth_pipeline, coverage_judge, cfg or KLCFConfig(), general_rm

    def _parts(self) -> list[Any]:
        return [self.pipeline, self.coverage, self.general_rm]

    def _recall(self, completions: Sequence[str], checklists: Sequence[Sequence[str]] | None, live: list[int]) -> np.ndarray:
        out = nan_array(len(completions))
        if checklists is None or self.coverage is None:
            return out
        pairs = [(i, item) for i in live for item in (checklists[i] or [])]
        covered = self.coverage.covered_batch([completions[i] for i, _ in pairs], [it for _, it in pairs]) if pairs else []
        for i in live:
            flags = [c for (j, _), c in zip(pairs, covered) if j == i]
            if flags:
                # An unreadable coverage verdict counts as not covered (and is logged by the judge).
                out[i] = sum(1.0 for c in flags if c) / len(flags)
        return out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="klcf")
        cfg, n = self.cfg, len(completions)
        checks, hits = guarded_check(self.pipeline, cfg.guards, prompts, completions)
        live = [i for i, c in enumerate(checks) if c is not None]
        r_ck = self._recall(completions, columns.get("checklist"), live)
        r_tf, n_claims = nan_array(n), np.zeros(n)
        for i in live:
            scores = [v.score if v.score is not None else float(v.label is Label.SUPPORTED)
                      for v in checks[i].verdicts if v.label is not Label.UNPARSEABLE]
            n_claims[i] = len(scores)
            r_tf[i] = float(np.mean(scores)) if scores else 0.0
        r_rm = nan_array(n)
        if self.general_rm is not None and live:
            raw = list(self.general_rm([prompts[i] for i in live], [completions[i] for i in live]))
            if len(raw) != len(live):
                raise FactualityInputError(f"klcf: general RM returned {len(raw)} scores for {len(live)} completions")
            for i, s in zip(live, raw):
                r_rm[i] = 1 / (1 + math.exp(-float(s) / cfg.rm_temperature))
        r_fmt = np.zeros(n)
        if cfg.require_format:
            import re

            r_fmt = np.array([0.0 if re.match(_FORMAT, c, re.DOTALL) else cfg.format_penalty for c in completions])
        scores = nan_array(n)
        for i in live:
            total = cfg.w_truthfulness * r_tf[i] + r_fmt[i] - (cfg.guards.injection_penalty if hits[i] else 0.0)
            total += cfg.w_checklist * r_ck[i] if not math.isnan(r_ck[i]) else 0.0
            total += cfg.w_rm * r_rm[i] if not math.isnan(r_rm[i]) else 0.0
            scores[i] = total
        details = [None if c is None else {"claims": [cl.text for cl in c.claims],
                                           "verdicts": [v.label.value for v in c.verdicts], "injection_hits": h}
                   for c, h in zip(checks, hits)]
        return RewardBatch(scores, {"checklist_recall": r_ck, "truthfulness_precision": r_tf, "general_rm": r_rm,
                                    "format": r_fmt, "n_claims": n_claims}, details=[d or {} for d in details])


@REWARDS.register("klcf")
def build_klcf(pipeline: dict, judge: Any = None, checklist_judge: Any = None, **cfg: Any) -> KLCFReward:
    """KLCF from config: ``pipeline`` (claim extractor + truthfulness verifier, no evidence), judges."""
    from nemo_factuality.verify.llm_judge import CoverageJudge

    judge_client = judge_from(judge)
    coverage_client = judge_from(checklist_judge) or judge_client
    return KLCFReward(pipeline_from(pipeline, judge_client), CoverageJudge(coverage_client) if coverage_client else None,
                      _klcf_config(cfg))


def _klcf_config(cfg: dict) -> KLCFConfig:
    guards = GuardConfig(**cfg.pop("guards", {}))
    return KLCFConfig(guards=guards, **cfg)
