"""RLFH (arXiv 2406.12221): token-level dense rewards from verified atomic statements.

For sentence ``s`` with statements ``a`` (verification label ``v_a``, informativeness ``i_a``)::

    r_truth(a) = truth_weight · VERIF[v_a] · |INFO[i_a]|          placed on the token holding a's last character
    r_info(s)  = info_weight · ln(max(ε, Σ_a INFO[i_a]) + μ)      placed on the sentence's last token

with ε = −0.9, μ = 1. A sentence without statements gets ``default_for_none`` at its end; refusal
sentences and questions are dropped (released post-filter). A response that did not end with EOS
gets ``eos_penalty`` on its last token; token rewards are clipped to ``reward_clip``; an injection
attempt gets ``guards.injection_penalty`` on the last token. The scalar is exactly the sum of the
token rewards (without a tokenizer: of the same rewards placed per character). Statements are placed
as methods.md §2.4 says: the echoed sentence is matched to the response's sentence by edit
similarity, the statement by LCS inside it (``claims.llm.lcs_span``). A failed extraction,
verification or informativeness judge makes the sample NaN (``details[i]["error"]``) with zero
token rewards. Maps default to the README's values (train.sh's are in the docs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import (
    GuardConfig,
    RewardParts,
    TokenPlacer,
    check_errors,
    load_tokenizer,
    mark_failures,
    nan_array,
    placer_for,
    validate_batch,
)
from nemo_factuality.rewards.common import check_details, guarded_check, judge_from, pipeline_from, role_judge
from nemo_factuality.types import Claim, FactualityInputError, Label, RewardBatch, Sentence, Span, Verdict

_REFUSAL = re.compile(
    r"i'm sorry|(?:don't|do not|does not|doesn't) have any information|may be able to provide more|"
    r"have any additional information|need more context to|requests? for more context|it is not possible to",
    re.IGNORECASE,
)


@dataclass
class RLFHConfig:
    verif_map: dict[str, float] = field(default_factory=lambda: {  # verification label → truthfulness value (README's values; train.sh's differ)
        "Correct": 0.45, "Hedged correct": 0.35, "Vague": -1.0, "Hedged wrong": -1.5, "Wrong": -1.7})
    info_map: dict[str, float] = field(default_factory=lambda: {"5": 1.25, "4": 1.0, "3": 0.75, "2": 0.1, "1": -0.2})  # informativeness grade 1–5 → value
    truth_weight: float = 1.0  # scale of r_truth
    info_weight: float = 1.2  # scale of r_info
    epsilon: float = -0.9  # ε in r_info = info_weight · ln(max(ε, Σ INFO) + μ)
    mu: float = 1.0  # μ in r_info
    default_for_none: float = 0.0  # reward of a sentence without statements
    eos_penalty: float = -1.0  # on the last token of a response that did not end (no EOS)
    reward_clip: tuple[float, float] = (-10.0, 10.0)  # token rewards are clipped to this range
    # Statements whose verification or informativeness reply was unreadable: "skip" them (default),
    # or treat them as these labels (the released code falls back to Vague and '1'/'3').
    unparseable_verdict: str = "skip"
    unparseable_info: str = "skip"  # as unparseable_verdict, for the informativeness replies
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

    def _score_infos(self, prompts: Sequence[str], completions: Sequence[str], checks: Sequence[Any],
                     errors: list[str | None]) -> list[list[int | None]]:
        """Informativeness per claim of every live sample, in one judge batch; outages fail their sample."""
        owners = [(i, c) for i, check in enumerate(checks) if check is not None and errors[i] is None for c in check.claims]
        if not owners:
            return [[] for _ in checks]
        if self.info_scorer is None:
            raise FactualityInputError("rlfh: an informativeness judge is needed (set reward.judge or reward.info_judge)")
        scored = self.info_scorer.score_batch([VerifyItem(c, prompt=prompts[i], response=completions[i]) for i, c in owners])
        out: list[list[int | None]] = [[] for _ in checks]
        unanswered: dict[int, list[str]] = {}
        for (i, _), res in zip(owners, scored):
            value, error = res[0], res[1]
            out[i].append(value)
            if len(res) > 2 and not res[2]:
                unanswered.setdefault(i, []).append(error or "no reply")
        for i, infos in enumerate(out):
            if i in unanswered:
                errors[i] = f"informativeness judge failed for {len(unanswered[i])} of {len(infos)} statements: {unanswered[i][0]}"
            elif infos and all(v is None for v in infos):
                errors[i] = f"no statement's informativeness could be read ({len(infos)} unreadable replies)"
        return out

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="rlfh")
        cfg, n = self.cfg, len(completions)
        materials = columns.get("materials")
        checks, hits = guarded_check(self.pipeline, cfg.guards, prompts, completions,
                                     materials=[tuple(m or ()) for m in materials] if materials is not None else None,
                                     topics=columns.get("topic"))
        errors = check_errors(checks)
        all_infos = self._score_infos(prompts, completions, checks, errors)
        scores, truth, info, eos = nan_array(n), np.zeros(n), np.zeros(n), np.zeros(n)
        token_rewards: list[np.ndarray] | None = [] if self.tokenizer is not None else None
        is_end = columns.get("is_end")
        for i, check in enumerate(checks):
            placer = placer_for(self.tokenizer, completions[i], columns, i)
            if placer is not None and placer.error and errors[i] is None:
                errors[i] = placer.error  # this sample's ids do not align to its text: it alone fails
            events: list[tuple[int, float]] = []
            if check is not None and errors[i] is None:
                truth_events, info_events = self._sentence_rewards(check.sentences, check.claims, check.verdicts, all_infos[i],
                                                                   completions[i])
                truth[i] = sum(r for _, r in truth_events)
                info[i] = sum(r for _, r in info_events)
                events = truth_events + info_events
            ended = True if is_end is None else bool(is_end[i])
            eos[i] = 0.0 if ended else cfg.eos_penalty
            penalty = cfg.guards.injection_penalty if hits[i] else 0.0
            if placer is not None:
                tokens = self._place(placer, events, eos[i], penalty) if errors[i] is None \
                    else np.zeros(placer.n_tokens, np.float32)  # a failed sample carries nothing
                token_rewards.append(tokens)
                total = float(tokens.sum(dtype=np.float64))
            else:
                total = float(self._place_chars(events, eos[i], penalty, len(completions[i])).sum())
            if check is not None:  # blank completion: abstain
                scores[i] = total
        details = mark_failures(scores, errors, [{**check_details(c), "injection_hits": h} for c, h in zip(checks, hits, strict=True)],
                                who="rlfh")
        return RewardBatch(scores, {"truth": truth, "info": info, "eos_penalty": eos}, token_rewards=token_rewards,
                           details=details)

    def _place(self, placer: TokenPlacer, events: list[tuple[int, float]], eos_penalty: float, penalty: float) -> np.ndarray:
        """Token rewards: events at their tokens, EOS penalty on the last, clipped; the injection penalty after
        clipping on the last token. The scalar reward is exactly ``tokens.sum()``."""
        out = np.zeros(placer.n_tokens, dtype=np.float32)
        if placer.n_tokens == 0:
            return out
        for pos, r in events:
            out[placer.last_token(Span(pos, pos + 1))] += r
        out[-1] += eos_penalty
        out = np.clip(out, *self.cfg.reward_clip)
        out[-1] -= penalty
        return out

    def _place_chars(self, events: list[tuple[int, float]], eos_penalty: float, penalty: float, n_chars: int) -> np.ndarray:
        """Without a tokenizer, the same placement at character granularity (the scalar is its sum)."""
        by_pos: dict[int, float] = {}
        for pos, r in events:
            by_pos[pos] = by_pos.get(pos, 0.0) + r
        last = max(n_chars - 1, max(by_pos, default=0))
        by_pos[last] = by_pos.get(last, 0.0) + eos_penalty
        values = np.clip(np.array([by_pos[k] for k in sorted(by_pos)], dtype=np.float64), *self.cfg.reward_clip)
        return np.append(values, -penalty)


@REWARDS.register("rlfh", options=RLFHConfig)
def build_rlfh(pipeline: dict, judge: Any = None, tokenizer: str | None = None, info_judge: Any = None, **cfg: Any) -> RLFHReward:
    """RLFH from config: ``pipeline`` (rlfh extractor, bm25_sections evidence, llm_judge style rlfh) and judges.

    ``judge`` is shared; ``info_judge`` (informativeness) and ``pipeline.{extractor,verifier}.judge`` override it.
    """
    from nemo_factuality.verify.llm_judge import InformativenessScorer

    client = judge_from(judge)
    info_client = role_judge(info_judge, judge) or client
    guards = GuardConfig(**cfg.pop("guards", {}))
    if "reward_clip" in cfg:
        cfg["reward_clip"] = tuple(cfg["reward_clip"])
    shared = judge if isinstance(judge, Mapping) else None
    return RLFHReward(pipeline_from(pipeline, client, shared), InformativenessScorer(info_client) if info_client else None,
                      RLFHConfig(guards=guards, **cfg), tokenizer)
