"""FSPO (arXiv 2505.24630): answer-correctness reward + per-token signs from step-level verification.

* **answer**: token F1 (SQuAD normalisation, yes/no/noanswer special case) between the last
  ``<answer>`` and ``ground_truth``, or exact match when ``answer_metric="em"`` (math data).
* **format**: ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` each exactly once, in order
  (``prompt_opens_think``: the prompt ends inside ``<think>``, as FSPO's templates do). A failure
  logs ``format = -2`` and zeroes the answer reward and the sign mask; it is not added to the score.
* **steps**: sentences of the think section, verified against the sample's ``knowledge`` column
  (HHEM-style verifier: supported → +1, otherwise −1).
* **signs**: per response token; step tokens get their step's ±1; every other token gets
  ``outside_mask`` (released code: 1; recommended: 0 = plain GRPO outside verified steps); samples
  without knowledge (math) get all 0. The trainer applies ``fspo_flip`` with these signs.
* **score** = answer + ``fact_weight`` · mean(step scores) (released code: fact_weight 0; paper: 1),
  minus ``guards.injection_penalty`` when the completion addressed a judge/verifier.
* A failed step verification makes the sample NaN (``details[i]["error"]``) with all-zero signs.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import (
    GuardConfig,
    RewardParts,
    TokenPlacer,
    is_blank,
    load_tokenizer,
    mark_failures,
    nan_array,
    neutralize_injection,
    placer_for,
    validate_batch,
)
from nemo_factuality.rewards.common import check_details, extract_answer, guarded_check, pipeline_from
from nemo_factuality.types import FactualityInputError, Label, RewardBatch, Span


@dataclass
class FSPOConfig:
    answer_metric: str = "f1"  # "f1" (HotpotQA/2Wiki) or "em" (math)
    fact_weight: float = 0.0  # 0 = released code, 1 = paper
    outside_mask: int = 1  # 1 = released code, 0 = recommended
    prompt_opens_think: bool = True  # the prompt ends inside <think>, as FSPO's templates do
    format_failure: float = -2.0  # the score of a response without the <think>/<answer> format
    guards: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.answer_metric not in ("f1", "em"):
            raise FactualityInputError(f"fspo.answer_metric must be 'f1' or 'em', got {self.answer_metric!r}")
        if self.outside_mask not in (-1, 0, 1):
            raise FactualityInputError(f"fspo.outside_mask must be -1, 0 or 1, got {self.outside_mask!r}")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """HotpotQA token F1 with the yes/no/noanswer rule (a mismatch among those is 0)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    special = {"yes", "no", "noanswer"}
    if (pred in special or ref in special) and pred != ref:
        return 0.0
    p_toks, r_toks = pred.split(), ref.split()
    common = sum((Counter(p_toks) & Counter(r_toks)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p_toks), common / len(r_toks)
    return 2 * precision * recall / (precision + recall)


def format_ok(completion: str, prompt_opens_think: bool) -> bool:
    text = completion if not prompt_opens_think or completion.lstrip().startswith("<think>") else "<think>" + completion
    tags = ["<think>", "</think>", "<answer>", "</answer>"]
    if any(text.count(t) != 1 for t in tags):
        return False
    positions = [text.index(t) for t in tags]
    return positions == sorted(positions)


class FSPOReward(RewardParts):
    def __init__(self, step_pipeline: Any, cfg: FSPOConfig | None = None, tokenizer: Any = None) -> None:
        self.pipeline, self.cfg, self.tokenizer = step_pipeline, cfg or FSPOConfig(), load_tokenizer(tokenizer)

    def _parts(self) -> list[Any]:
        return [self.pipeline]

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="fspo", required=("ground_truth",))
        cfg, n = self.cfg, len(completions)
        knowledge = columns.get("knowledge") or [None] * n
        fmt = np.array([0.0 if format_ok(c, cfg.prompt_opens_think) else cfg.format_failure for c in completions])
        # The think section of a completion that starts inside <think> (the prompt opened it).
        texts = [c if c.lstrip().startswith("<think>") or not cfg.prompt_opens_think else "<think>" + c for c in completions]
        grounded = [i for i in range(n) if knowledge[i] and fmt[i] == 0 and not is_blank(completions[i])]
        checks, hits = guarded_check(self.pipeline, cfg.guards, [prompts[i] for i in grounded], [texts[i] for i in grounded],
                                     materials=[(knowledge[i],) for i in grounded])
        step_scores: dict[int, list[tuple[Any, float]]] = {}
        errors: list[str | None] = [None] * n
        injected = [neutralize_injection(c)[1] > 0 for c in completions]
        for i, check in zip(grounded, checks):
            if check is None:
                continue
            if check.error is not None:
                errors[i] = check.error
                continue
            by_id = {v.claim_id: v for v in check.verdicts}
            step_scores[i] = [(c.span, 1.0 if by_id[c.id].label is Label.SUPPORTED else -1.0) for c in check.claims]
        scores, answer, reasoning = nan_array(n), np.zeros(n), nan_array(n)
        signs_out: list[np.ndarray] | None = [] if self.tokenizer is not None else None
        for i, completion in enumerate(completions):
            if fmt[i] == 0:
                pred = extract_answer(texts[i])
                if pred is not None:
                    gold = str(columns["ground_truth"][i])
                    answer[i] = token_f1(pred, gold) if cfg.answer_metric == "f1" else float(normalize_answer(pred) == normalize_answer(gold))
            steps = step_scores.get(i, [])
            if steps:
                reasoning[i] = float(np.mean([s for _, s in steps]))
            if signs_out is not None:
                placer = placer_for(self.tokenizer, completion, columns, i)
                errors[i] = errors[i] or placer.error  # ids that do not align to the text: this sample alone fails
                signs = self._signs(placer, texts[i], completion, steps, i in step_scores) if errors[i] is None \
                    else np.zeros(placer.n_tokens, dtype=np.int8)
                signs_out.append(signs)
            if not is_blank(completion):
                scores[i] = answer[i] + (cfg.fact_weight * reasoning[i] if steps else 0.0)
                scores[i] -= cfg.guards.injection_penalty if injected[i] else 0.0
        why = [{} for _ in range(n)]
        for i, check in zip(grounded, checks, strict=True):  # the think section's sentences, their verdicts and each step's sign
            why[i] = {**check_details(check), "sentence_signs": [int(s) for _, s in step_scores.get(i, [])]}
        details = mark_failures(scores, errors, [{**w, "injection_hits": int(h)} for w, h in zip(why, injected, strict=True)], who="fspo")
        return RewardBatch(scores, {"answer": answer, "format": fmt, "reasoning": reasoning}, token_signs=signs_out,
                           details=details)

    def _signs(self, placer: TokenPlacer, text: str, completion: str, steps: list, grounded: bool) -> np.ndarray:
        signs = np.full(placer.n_tokens, self.cfg.outside_mask if grounded else 0, dtype=np.int8)
        offset = len(text) - len(completion)  # "<think>" we prepended for the prompt's opening tag
        for span, score in steps:
            if span is None or span.end - offset <= 0:
                continue
            first, end = placer.token_range(Span(max(span.start - offset, 0), span.end - offset))
            signs[first:end] = int(score)
        return signs


@REWARDS.register("fspo", options=FSPOConfig)
def build_fspo(verifier: dict, tokenizer: str | None = None, segmenter: dict | None = None, **cfg: Any) -> FSPOReward:
    """FSPO from config: a step verifier (e.g. ``{name: nli, model_path: .../HHEM, threshold: 0.5}``)."""
    guards = GuardConfig(**cfg.pop("guards", {}))
    pipeline = pipeline_from({"segmenter": segmenter or {"name": "regex"}, "extractor": {"name": "identity", "segments": ["think"]},
                              "evidence": {"name": "given"}, "verifier": verifier, "abstain_detection": None}, None)
    return FSPOReward(pipeline, FSPOConfig(guards=guards, **cfg), tokenizer)
