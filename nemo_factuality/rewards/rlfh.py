"""RLFH (arXiv 2406.12221): token-level dense rewards from verified atomic statements.

For sentence ``s`` with statements ``a`` (verification label ``v_a``, informativeness ``i_a``):

    r_truth(a) = truth_weight · VERIF[v_a] · |INFO[i_a]|          placed on the token holding a's last character
    r_info(s)  = info_weight · ln(max(ε, Σ_a INFO[i_a]) + μ)      placed on the sentence's last token

with ε = −0.9, μ = 1. A sentence without statements gets ``default_for_none`` at its end; refusal
sentences and questions are dropped (released post-filter). A response that did not end with EOS
gets ``eos_penalty`` on its last token; token rewards are clipped to ``reward_clip``. The scalar
is the sum of the token rewards. Maps default to the README's values (train.sh's are in the docs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import GuardConfig, RewardParts, TokenPlacer, load_tokenizer, nan_array, placer_for, validate_batch
from nemo_factuality.rewards.common import guarded_check, judge_from, pipeline_from
from nemo_factuality.types import Claim, FactualityInputError, Label, RewardBatch, Sentence, Span, Verdict

_REFUSAL = re.compile(
    r"i'm sorry|(?:don't|do not|does not|doesn't) have any information|may be able to provide more|"
    r"have any additional information|need more context to|requests? for more context|it is not possible to",
    re.IGNORECASE,
)


@dataclass
class RLFHConfig:
    verif_map: dict[str, float] = field(default_factory=lambda: {
        "Correct": 0.45, "Hedged correct": 0.35, "Vague": -1.0, "Hedged wrong": -1.5, "Wrong": -1.7})
    info_map: dict[str, float] = field(default_factory=lambda: {"5": 1.25, "4": 1.0, "3": 0.75, "2": 0.1, "1": -0.2})
    truth_weight: float = 1.0
    info_weight: float = 1.2
    epsilon: float = -0.9
    mu: float = 1.0
    default_for_none: float = 0.0
    eos_penalty: float = -1.0
    reward_clip: tuple[float, float] = (-10.0, 10.0)
    # Statements whose verification or informativeness reply was unreadable: "skip" them (default),
    # or treat them as these labels (the released code falls back to Vague and '1'/'3').
    unparseable_verdict: str = "skip"
    unparseable_info: str = "skip"
    guards: GuardConfig = field(default_factory=GuardConfig)


def _verif_key(v: Verdict) -> str | None:
    if v.label is Label.SUPPORTED:
        return "Hedged correct" if v.hedged else "Correct"
    if v.label is Label.NOT_SUPPORTED:
        return "Hedged wrong" if v.hedged else "Wrong"
    if v.label is Label.NOT_ENOUGH_INFO:
        return "Vague"
    return None


class RLFHReward(RewardParts):
    """Dense statement-level rewards; needs the policy tokenizer for token placement."""

    def __init__(self, pipeline: Any, informativeness: Any, cfg: RLFHConfig | None = None, tokenizer: Any = None) -> None:
        self.pipeline, self.info_scorer, self.cfg = pipeline, informativeness, cfg or RLFHConfig()
        self.tokenizer = load_tokenizer(tokenizer)
        self.errors = {"unparseable_verdicts": 0, "unparseable_info": 0}

    def _parts(self) -> list[Any]:
        return [self.pipeline, self.info_scorer]

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **{k: float(v) for k, v in self.errors.items()}}

    def _statement_values(self, verdict: Verdict, info: int | None) -> tuple[float, float] | None:
        """(r_truth, INFO) of one statement, or None to skip it."""
        cfg = self.cfg
        key = _verif_key(verdict)
        if key is None:
            self.errors["unparseable_verdicts"] += 1
            if cfg.unparseable_verdict == "skip":
                return None
            key = cfg.unparseable_verdict
        info_key = str(info) if info is not None else None
        if info_key is None:
            self.errors["unparseable_info"] += 1
            if cfg.unparseable_info == "skip":
                return None
            info_key = cfg.unparseable_info
        if key not in cfg.verif_map or info_key not in cfg.info_map:
            raise FactualityInputError(f"rlfh: label {key!r} / informativeness {info_key!r} not in verif_map "
                                       f"{sorted(cfg.verif_map)} / info_map {sorted(cfg.info_map)}")
        info_value = cfg.info_map[info_key]
        return cfg.truth_weight * cfg.verif_map[key] * abs(info_value), info_value

    def _sentence_rewards(self, sentences: Sequence[Sentence], claims: Sequence[Claim], verdicts: Sequence[Verdict],
                          infos: Sequence[int | None], text: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """(character position, reward) pairs: r_truth at each statement's last char; r_info at each sentence end."""
        cfg = self.cfg
        kept = [s for s in sentences if not _REFUSAL.search(s.text) and not s.text.rstrip().endswith("?")]
        kept_ids = {s.id for s in kept}
        by_sentence: dict[int, list[float]] = {s.id: [] for s in kept}
        truth_events: list[tuple[int, float]] = []
        info_events: list[tuple[int, float]] = []
        for claim, verdict, info in zip(claims, verdicts, infos):
            if claim.sentence_id is not None and claim.sentence_id not in kept_ids:
                continue  # statement of a filtered sentence: no reward
            values = self._statement_values(verdict, info)
            if values is None:
                continue
            r_truth, info_value = values
            owner = next((s for s in kept if s.id == claim.sentence_id), None)
            span = claim.span or (owner.span if owner else Span(len(text.rstrip()) - 1, len(text.rstrip())))
            truth_events.append((span.end - 1, r_truth))
            if owner is not None:
                by_sentence[owner.id].append(info_value)
        for s in kept:
            infos_s = by_sentence[s.id]
            r = cfg.info_weight * math.log(max(cfg.epsilon, sum(infos_s)) + cfg.mu) if infos_s else cfg.default_for_none
            info_events.append((s.span.end - 1, r))
        return truth_events, info_events

    def _score_infos(self, prompt: str, completion: str, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        items = [VerifyItem(c, prompt=prompt, response=completion) for c in claims]
        return [score for score, _ in self.info_scorer.score_batch(items)]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="rlfh")
        cfg, n = self.cfg, len(completions)
        materials = columns.get("materials")
        checks, hits = guarded_check(self.pipeline, cfg.guards, prompts, completions,
                                     materials=[tuple(m or ()) for m in materials] if materials is not None else None,
                                     topics=columns.get("topic"))
        scores, truth, info, eos = nan_array(n), np.zeros(n), np.zeros(n), np.zeros(n)
        token_rewards: list[np.ndarray] | None = [] if self.tokenizer is not None else None
        is_end = columns.get("is_end")
        for i, check in enumerate(checks):
            placer = placer_for(self.tokenizer, completions[i], columns, i)
            events: list[tuple[int, float]] = []
            if check is not None:
                infos = self._score_infos(prompts[i], completions[i], check.claims)
                truth_events, info_events = self._sentence_rewards(check.sentences, check.claims, check.verdicts, infos,
                                                                   completions[i])
                truth[i] = sum(r for _, r in truth_events)
                info[i] = sum(r for _, r in info_events)
                events = truth_events + info_events
            ended = True if is_end is None else bool(is_end[i])
            eos[i] = 0.0 if ended else cfg.eos_penalty
            tokens = self._place(placer, events, eos[i]) if placer is not None else None
            if token_rewards is not None:
                token_rewards.append(tokens if tokens is not None else np.zeros(0, np.float32))
            if check is None:
                continue  # blank completion: abstain
            total = float(tokens.sum()) if tokens is not None else float(np.clip(sum(r for _, r in events) + eos[i], *cfg.reward_clip))
            scores[i] = total - (cfg.guards.injection_penalty if hits[i] else 0.0)
        return RewardBatch(scores, {"truth": truth, "info": info, "eos_penalty": eos}, token_rewards=token_rewards)

    def _place(self, placer: TokenPlacer, events: list[tuple[int, float]], eos_penalty: float) -> np.ndarray:
        out = np.zeros(placer.n_tokens, dtype=np.float32)
        if placer.n_tokens == 0:
            return out
        for pos, r in events:
            out[placer.last_token(Span(pos, pos + 1))] += r
        out[-1] += eos_penalty
        return np.clip(out, *self.cfg.reward_clip)


@REWARDS.register("rlfh")
def build_rlfh(pipeline: dict, judge: Any = None, tokenizer: str | None = None, **cfg: Any) -> RLFHReward:
    """RLFH from config: ``pipeline`` (rlfh extractor, bm25_sections evidence, llm_judge style rlfh) and a judge."""
    from nemo_factuality.verify.llm_judge import InformativenessScorer

    client = judge_from(judge)
    guards = GuardConfig(**cfg.pop("guards", {}))
    if "reward_clip" in cfg:
        cfg["reward_clip"] = tuple(cfg["reward_clip"])
    return RLFHReward(pipeline_from(pipeline, client), InformativenessScorer(client) if client else None,
                      RLFHConfig(guards=guards, **cfg), tokenizer)
