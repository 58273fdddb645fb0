"""KLCF (arXiv 2509.23765): dual-fact alignment — checklist recall + truthfulness precision (+ general RM, format).

``R = w_ck·r_ck + w_tf·r_tf + w_rm·σ(s_RM) + r_fmt`` (methods.md §1.4 DECISION; every weight in config):

* ``r_ck``: fraction of the prompt's checklist items (column ``checklist``) the coverage judge finds
  in the response; skipped (0 weight, component NaN) when a prompt has no checklist.
* ``r_tf``: mean p(true) of the response's unique claims from the truthfulness verifier (no
  retrieval online). A non-empty response with no claims gets 0 — silence is not precision 1.0.
* ``s_RM``: a general reward model's score (callable ``(prompts, completions) -> list[float]``; from
  config ``general_rm: {kind: hf | remote, ...}``, see ``rewards.general_rm``).

* ``r_fmt``: 0 when ``<think>…</think><answer>…</answer>`` is well formed, else ``format_penalty``
  (only when ``require_format``, the zero-RL setting).

Failures: a failed extraction/verification, an unjudged checklist item or a failed general RM
makes the sample NaN with ``details[i]["error"]``; it is never scored as 0 or "not covered".
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import (
    GuardConfig,
    RewardParts,
    check_errors,
    mark_failures,
    nan_array,
    validate_batch,
)
from nemo_factuality.rewards.common import check_details, guarded_check, judge_from, pipeline_from, role_judge
from nemo_factuality.types import FactualityInputError, Label, RewardBatch

log = logging.getLogger(__name__)
_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


@dataclass
class KLCFConfig:
    w_checklist: float = 1.0  # weight of checklist recall
    w_truthfulness: float = 1.0  # weight of claim truthfulness (precision)
    w_rm: float = 1.0  # weight of σ(general RM score / rm_temperature); 0 = no general RM
    require_format: bool = False  # score <think>…</think><answer>…</answer> (the zero-RL setting)
    format_penalty: float = -1.0  # added when require_format and the format is broken
    rm_temperature: float = 1.0  # σ(s / T) squashing of the general RM score
    guards: GuardConfig = field(default_factory=GuardConfig)


class KLCFReward(RewardParts):
    def __init__(self, truth_pipeline: Any, coverage_judge: Any, cfg: KLCFConfig | None = None,
                 general_rm: Callable[[Sequence[str], Sequence[str]], Sequence[float]] | None = None) -> None:
        self.pipeline, self.coverage, self.cfg, self.general_rm = truth_pipeline, coverage_judge, cfg or KLCFConfig(), general_rm
        if self.cfg.w_rm and general_rm is None:
            log.warning("klcf: w_rm=%g but no general reward model is configured; the RM term is left out", self.cfg.w_rm)

    def _parts(self) -> list[Any]:
        return [self.pipeline, self.coverage, self.general_rm]

    def _recall(self, completions: Sequence[str], checklists: Sequence[Sequence[str]] | None, live: list[int],
                errors: list[str | None]) -> np.ndarray:
        out = nan_array(len(completions))
        if checklists is None or self.coverage is None:
            return out
        pairs = [(i, item) for i in live for item in (checklists[i] or [])]
        judged = self.coverage.check_batch([completions[i] for i, _ in pairs], [it for _, it in pairs]) if pairs else []
        for i in live:
            flags = [c for (j, _), c in zip(pairs, judged) if j == i]
            failed = [err for covered, err in flags if covered is None]
            if failed:  # an unreadable coverage verdict is not "not covered": the sample fails
                errors[i] = errors[i] or f"{len(failed)} of {len(flags)} checklist items unjudged: {failed[0]}"
            elif flags:
                out[i] = sum(1.0 for covered, _ in flags if covered) / len(flags)
        return out

    def _general_rm(self, prompts: Sequence[str], completions: Sequence[str], live: list[int],
                    errors: list[str | None]) -> np.ndarray:
        out = nan_array(len(completions))
        if self.general_rm is None or not live or not self.cfg.w_rm:
            return out
        try:
            raw = list(self.general_rm([prompts[i] for i in live], [completions[i] for i in live]))
        except Exception as err:  # a down RM fails its samples, it does not drop the term silently
            for i in live:
                errors[i] = errors[i] or f"general reward model failed: {type(err).__name__}: {err}"
            return out
        if len(raw) != len(live):
            raise FactualityInputError(f"klcf: general RM returned {len(raw)} scores for {len(live)} completions")
        for i, s in zip(live, raw):
            if s is None or not math.isfinite(float(s)):
                errors[i] = errors[i] or f"general reward model returned {s!r}"
            else:
                out[i] = 1 / (1 + math.exp(-float(s) / self.cfg.rm_temperature))
        return out

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="klcf")
        cfg, n = self.cfg, len(completions)
        checks, hits = guarded_check(self.pipeline, cfg.guards, prompts, completions)
        errors = check_errors(checks)
        live = [i for i, c in enumerate(checks) if c is not None]
        r_ck = self._recall(completions, columns.get("checklist"), live, errors)
        r_tf, n_claims = nan_array(n), np.zeros(n)
        for i in live:
            scores = [v.score if v.score is not None else float(v.label is Label.SUPPORTED)
                      for v in checks[i].verdicts if v.label is not Label.UNPARSEABLE]
            n_claims[i] = len(scores)
            if errors[i] is None:
                r_tf[i] = float(np.mean(scores)) if scores else 0.0
        r_rm = self._general_rm(prompts, completions, live, errors)
        r_fmt = np.zeros(n)
        if cfg.require_format:
            r_fmt = np.array([0.0 if re.match(_FORMAT, c, re.DOTALL) else cfg.format_penalty for c in completions])
        scores = nan_array(n)
        for i in live:
            total = cfg.w_truthfulness * r_tf[i] + r_fmt[i] - (cfg.guards.injection_penalty if hits[i] else 0.0)
            total += cfg.w_checklist * r_ck[i] if not math.isnan(r_ck[i]) else 0.0
            total += cfg.w_rm * r_rm[i] if not math.isnan(r_rm[i]) else 0.0
            scores[i] = total
        details = [{**check_details(c), "injection_hits": h} for c, h in zip(checks, hits, strict=True)]
        details = mark_failures(scores, errors, details, who="klcf")
        return RewardBatch(scores, {"checklist_recall": r_ck, "truthfulness_precision": r_tf, "general_rm": r_rm,
                                    "format": r_fmt, "n_claims": n_claims}, details=details)


@REWARDS.register("klcf", options=KLCFConfig)
def build_klcf(pipeline: dict, judge: Any = None, checklist_judge: Any = None, general_rm: Any = None, **cfg: Any) -> KLCFReward:
    """KLCF from config: ``pipeline`` (claim extractor + truthfulness verifier, no evidence), judges, general RM.

    ``judge`` is the shared endpoint; ``pipeline.extractor.judge`` / ``pipeline.verifier.judge`` and
    ``checklist_judge`` override it per role (each key over the shared block). ``general_rm`` is a
    ``rewards.general_rm`` spec (``{kind: hf, model_path: ...}`` or ``{kind: remote, url: ...}``).
    """
    from nemo_factuality.rewards.general_rm import build_general_rm
    from nemo_factuality.verify.llm_judge import CoverageJudge

    if float(cfg.get("w_rm", KLCFConfig.w_rm)) > 0 and not general_rm:
        raise FactualityInputError("klcf: w_rm > 0 needs a general reward model: set reward.general_rm "
                                   "({kind: hf, model_path: DIR} or {kind: remote, url: ...}), or reward.w_rm=0")
    judge_client = judge_from(judge)
    coverage_client = role_judge(checklist_judge, judge) or judge_client
    shared = judge if isinstance(judge, Mapping) else None
    return KLCFReward(pipeline_from(pipeline, judge_client, shared), CoverageJudge(coverage_client) if coverage_client else None,
                      _klcf_config(cfg), build_general_rm(general_rm) if general_rm else None)


def _klcf_config(cfg: dict) -> KLCFConfig:
    guards = GuardConfig(**cfg.pop("guards", {}))
    return KLCFConfig(guards=guards, **cfg)
