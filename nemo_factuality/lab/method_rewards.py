"""The five methods' rewards on the lab world: each method's own reward shape, with the lab's deterministic
checks in place of its LLM judges and learned verifiers.

The lab has no LLM judge, so every judged decision is made by code against the knowledge store:
a bio sentence *is* a claim (the identity extractor), ``kb_exact`` (the stored facts) decides whether it
is true, and abstention sentences (``... unknown.``) assert nothing. What stays each method's own is the
shape of its reward — which units it scores, how it weighs them, what it pays for abstaining — and,
where the method's class fits a bio, the class itself:

===========  ================================  =================================================================
method       reward                            lab components (in place of)
===========  ================================  =================================================================
klcf         ``rewards.klcf.KLCFReward``       truthfulness verifier → ``kb_exact``; checklist verifier →
                                               ``KBCoverageJudge`` (the item's sentence is in the response);
                                               checklist → ``klcf_checklist.checklist_for`` on base-model
                                               samples (KLCF's offline builder); no general RM (``w_rm: 0``)
rlfh         ``rewards.rlfh.RLFHReward``       verification judge → ``kb_exact`` (Correct / Wrong; NEI = Vague);
                                               informativeness judge → ``SlotInformativeness`` (every slot
                                               fact rates the same, 4 of 5)
factalign    ``rewards.factalign``             SAFE's rater → ``kb_exact``; ``K = 6`` (a bio has six slots, as
             ``.FactAlignLabeler``             LongFact's K=100 is a long answer's size)
fspo         ``LabFSPOReward``                 FSPO's shape on a bio (no think/answer tags in the lab): the
                                               steps are the bio's sentences (HHEM → ``kb_exact``), the answer
                                               is the stated values, scored by FSPO's own token F1 against the
                                               gold values
knowrl       ``LabKnowRLReward``               KnowRL's three terms on a bio: format = a well-formed bio;
                                               correctness = its SimpleQA grade per slot (+2 / +1 unknown / −1);
                                               fact = FActScore of the claims (``kb_exact``) with its length
                                               penalty at γ = 6 slots
===========  ================================  =================================================================

FSPO's and KnowRL's reward classes read ``<think>``/``<answer>`` sections that a bio does not have, so their
lab versions reuse those modules' functions (``fspo.token_f1``, ``knowrl.GRADE_REWARD``, ``knowrl.combine``,
FActScore's ``length_penalty``) on the bio's sentences instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.lab.pipeline import lab_pipeline
from nemo_factuality.lab.readings import covers, is_correct, named_values
from nemo_factuality.lab.reward import LabRewardConfig
from nemo_factuality.lab.worlds import LabWorld, check_gold, get_world
from nemo_factuality.metrics.factscore import length_penalty
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import (
    GuardConfig,
    RewardParts,
    check_errors,
    is_blank,
    load_tokenizer,
    mark_failures,
    nan_array,
    placer_for,
    validate_batch,
)
from nemo_factuality.rewards.common import guarded_check
from nemo_factuality.rewards.factalign import FactAlignConfig, FactAlignLabeler
from nemo_factuality.rewards.fspo import token_f1
from nemo_factuality.rewards.klcf import KLCFConfig, KLCFReward
from nemo_factuality.rewards.knowrl import GRADE_REWARD, combine
from nemo_factuality.rewards.rlfh import RLFHConfig, RLFHReward
from nemo_factuality.types import FactualityInputError, Label, RewardBatch
from nemo_factuality.verify.llm_judge import InfoScore


# ---------------------------------------------------------------------------------------------- lab components
class KBCoverageJudge:
    """KLCF's checklist verifier in the lab: an item is covered when one of the response's sentences states its
    fact (``worlds.covers``: the same attribute, each of the item's values; on the synthetic world, the item's
    sentence itself)."""

    def __init__(self, world: LabWorld | None = None) -> None:
        self.world = world or get_world("synthetic")

    def check_batch(self, responses: Sequence[str], items: Sequence[str]) -> list[tuple[bool | None, str | None]]:
        if len(responses) != len(items):
            raise FactualityInputError(f"coverage: {len(responses)} responses but {len(items)} checklist items")
        from nemo_factuality.text.segment import split_sentences

        said: dict[str, list[Any]] = {}
        out: list[tuple[bool | None, str | None]] = []
        for response, item in zip(responses, items, strict=True):
            if response not in said:
                said[response] = [r for r in (self.world.read(s.slice(response)) for s in split_sentences(response)) if r]
            wanted = self.world.read(item)
            out.append((wanted is not None and any(covers(wanted, r) for r in said[response]), None))
        return out


class SlotInformativeness:
    """RLFH's informativeness judge in the lab: every slot fact answers "tell me a bio" equally (``value`` of 1-5)."""

    def __init__(self, value: int = 4) -> None:
        if value not in (1, 2, 3, 4, 5):
            raise FactualityInputError(f"lab rlfh: informativeness must be 1..5, got {value}")
        self.value = value

    def score_batch(self, items: Sequence[Any]) -> list[InfoScore]:
        return [InfoScore(self.value, None, True) for _ in items]


def gold_values(world: LabWorld, columns: dict[str, Any], i: int, who: str) -> dict[str, str]:
    """The prompted entity's stored facts (``ground_truth`` column: attribute → accepted values, ``a|b``)."""
    return check_gold(world, columns["ground_truth"][i], f"{who}: ground_truth[{i}]")


# ---------------------------------------------------------------------------------------------- FSPO
STEP_LABELS = ("binary", "three_way")


@dataclass
class LabFSPOConfig:
    """FSPO on a bio. ``fact_weight`` / ``outside_mask``: released code 0 / 1, paper 1 / 0. ``step_labels``: the
    released code's binary step verdict (supported +1, anything else −1, so an abstention step is −1), or the
    paper's three-way one (an abstention neither entails nor contradicts the knowledge: 0)."""

    fact_weight: float = 0.0
    outside_mask: int = 1
    step_labels: str = "binary"
    guards: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.step_labels not in STEP_LABELS:
            raise FactualityInputError(f"lab fspo: step_labels must be one of {STEP_LABELS}, got {self.step_labels!r}")
        if self.outside_mask not in (-1, 0, 1):
            raise FactualityInputError(f"lab fspo: outside_mask must be -1, 0 or 1, got {self.outside_mask!r}")


class LabFSPOReward(RewardParts):
    """``score = answer + fact_weight · mean(step scores)``; token signs: each step's sign on all of its tokens
    (FSPO signs whole steps), ``outside_mask`` elsewhere. ``answer`` = ``fspo.token_f1`` of the values the bio
    states (abstentions are no answer) against the person's six values."""

    def __init__(self, pipeline: Any, cfg: LabFSPOConfig | None = None, tokenizer: Any = None,
                 world: LabWorld | None = None) -> None:
        self.pipeline, self.cfg, self.tokenizer = pipeline, cfg or LabFSPOConfig(), load_tokenizer(tokenizer)
        self.world = world or get_world("synthetic")

    def _parts(self) -> list[Any]:
        return [self.pipeline]

    def _step(self, label: Label) -> float:
        if label is Label.SUPPORTED:
            return 1.0
        return 0.0 if label is Label.IRRELEVANT and self.cfg.step_labels == "three_way" else -1.0

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="lab fspo", required=("ground_truth",))
        cfg, n = self.cfg, len(completions)
        checks, _ = guarded_check(self.pipeline, cfg.guards, prompts, completions)
        errors = check_errors(checks)
        scores, answer, reasoning = nan_array(n), np.zeros(n), nan_array(n)
        signs_out: list[np.ndarray] | None = [] if self.tokenizer is not None else None
        for i, check in enumerate(checks):
            steps: list[tuple[Any, float]] = []
            if check is not None and errors[i] is None:
                by_id = {v.claim_id: v for v in check.verdicts}
                steps = [(c.span, self._step(by_id[c.id].label)) for c in check.claims]
                gold = gold_values(self.world, columns, i, "lab fspo")
                stated = [v for r in map(self.world.read, (c.text for c in check.claims)) if r and not r.abstains
                          for v in named_values(r, gold.get(r.attribute, ""))]
                answer[i] = token_f1(" ".join(stated), " ".join(v.replace("|", " ") for v in gold.values())) if stated else 0.0
                if steps:
                    reasoning[i] = float(np.mean([s for _, s in steps]))
                scores[i] = answer[i] + (cfg.fact_weight * reasoning[i] if steps else 0.0)
            if signs_out is not None:
                signs_out.append(self._signs(completions[i], columns, i, steps if errors[i] is None else None))
        details = mark_failures(scores, errors, who="lab fspo")
        return RewardBatch(scores, {"answer": answer, "reasoning": reasoning}, token_signs=signs_out, details=details)

    def _signs(self, completion: str, columns: dict, i: int, steps: list | None) -> np.ndarray:
        placer = placer_for(self.tokenizer, completion, columns, i)
        if steps is None or is_blank(completion):  # a failed check carries no signs
            return np.zeros(placer.n_tokens, dtype=np.int8)
        signs = np.full(placer.n_tokens, self.cfg.outside_mask, dtype=np.int8)
        for span, value in steps:
            if span is not None:
                first, end = placer.token_range(span)
                signs[first:end] = int(np.sign(value))
        return signs


# ---------------------------------------------------------------------------------------------- KnowRL
@dataclass
class LabKnowRLConfig:
    combine: str = "additive"  # "additive" (paper) or "gated" (released code)
    gamma: float = 6.0  # FActScore length penalty: a full bio (six slots) is unpenalised
    guards: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.combine not in ("gated", "additive"):
            raise FactualityInputError(f"lab knowrl: combine must be 'gated' or 'additive', got {self.combine!r}")


def slot_grades(world: LabWorld, completion: str, name: str, gold: dict[str, str]) -> tuple[dict[str, str | None], bool]:
    """Each slot's SimpleQA grade (CORRECT / INCORRECT / NOT_ATTEMPTED, None = not answered) from the first
    sentence about it, and whether the answer is well formed (every sentence a slot of ``name``, or of no named
    subject, none twice)."""
    from nemo_factuality.text.segment import split_sentences

    grades: dict[str, str | None] = dict.fromkeys(gold)
    well_formed = True
    for span in split_sentences(completion):
        r = world.read(span.slice(completion))
        if r is None or r.attribute is None or r.subject not in (None, name) or grades[r.attribute] is not None:
            well_formed = False
            continue
        grades[r.attribute] = ("NOT_ATTEMPTED" if r.abstains else "CORRECT" if is_correct(r, gold[r.attribute])
                               else "INCORRECT")
    return grades, well_formed


class LabKnowRLReward(RewardParts):
    """``score = r_format + combine(r_correct, refusal, r_fact)`` (KnowRL's sum), on a bio:

    * ``r_format``: +1 for a well-formed bio that ended (every sentence a slot of the prompted person, none
      repeated), else −1;
    * ``r_correct``: the mean over the six slots of KnowRL's grade reward (CORRECT +2, NOT_ATTEMPTED +1,
      INCORRECT or unanswered −1); ``refusal``: every slot answered ``unknown``;
    * ``r_fact``: the claims' precision (``kb_exact``) times ``length_penalty(n_claims, gamma)``; 0 without claims.
    """

    def __init__(self, pipeline: Any, cfg: LabKnowRLConfig | None = None, world: LabWorld | None = None) -> None:
        self.pipeline, self.cfg, self.world = pipeline, cfg or LabKnowRLConfig(), world or get_world("synthetic")

    def _parts(self) -> list[Any]:
        return [self.pipeline]

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="lab knowrl", required=("ground_truth", "topic"))
        cfg, n = self.cfg, len(completions)
        checks, _ = guarded_check(self.pipeline, cfg.guards, prompts, completions)
        errors = check_errors(checks)
        is_end = columns.get("is_end") or [True] * n
        scores, fmt, correct, fact = nan_array(n), np.zeros(n), np.zeros(n), np.zeros(n)
        for i, check in enumerate(checks):
            if check is None or errors[i] is not None:
                continue  # blank (abstained) or failed: NaN
            grades, well_formed = slot_grades(self.world, completions[i], columns["topic"][i],
                                              gold_values(self.world, columns, i, "lab knowrl"))
            fmt[i] = 1.0 if well_formed and bool(is_end[i]) else -1.0
            correct[i] = float(np.mean([GRADE_REWARD[g] if g else -1.0 for g in grades.values()]))
            refusal = all(g == "NOT_ATTEMPTED" for g in grades.values())
            supported = [v.label is Label.SUPPORTED for v in check.verdicts if v.label is not Label.UNPARSEABLE]
            fact[i] = float(np.mean(supported)) * length_penalty(len(supported), cfg.gamma) if supported else 0.0
            scores[i] = fmt[i] + combine(correct[i], refusal, fact[i], cfg.combine)
        details = mark_failures(scores, errors, who="lab knowrl")
        return RewardBatch(scores, {"format": fmt, "correct": correct, "fact": fact}, details=details)


# ---------------------------------------------------------------------------------------------- registry
# Every lab reward takes ``world`` (``synthetic`` | ``countries``: whose sentences, facts and verifier it scores);
# the lab sets it, as it sets the store.
@REWARDS.register("lab_klcf")
def build_lab_klcf(store_path: str, w_checklist: float = 1.0, w_truthfulness: float = 1.0, world: str = "synthetic") -> KLCFReward:
    """KLCF (``checklist`` column: the prompt's checklist; see ``lab.run.klcf_checklists``)."""
    return KLCFReward(lab_pipeline(store_path, world=world), KBCoverageJudge(get_world(world)),
                      KLCFConfig(w_checklist=w_checklist, w_truthfulness=w_truthfulness, w_rm=0.0))


@REWARDS.register("lab_rlfh")
def build_lab_rlfh(store_path: str, tokenizer: Any = None, informativeness: int = 4, world: str = "synthetic") -> RLFHReward:
    """RLFH with the README's label maps; token rewards need the policy ``tokenizer``."""
    return RLFHReward(lab_pipeline(store_path, world=world), SlotInformativeness(informativeness), RLFHConfig(), tokenizer)


@REWARDS.register("lab_factalign")
def build_lab_factalign(store_path: str, k: int = 6, t: float = 0.75, t_s: float = 1.0, world: str = "synthetic") -> FactAlignLabeler:
    return FactAlignLabeler(lab_pipeline(store_path, world=world), FactAlignConfig(k=k, t=t, t_s=t_s))


@REWARDS.register("lab_fspo")
def build_lab_fspo(store_path: str, tokenizer: Any = None, fact_weight: float = 0.0, outside_mask: int = 1,
                   step_labels: str = "binary", world: str = "synthetic") -> LabFSPOReward:
    """FSPO (``ground_truth`` column); abstention sentences are steps, so the step verifier sees them."""
    return LabFSPOReward(lab_pipeline(store_path, abstentions_are_claims=True, world=world),
                         LabFSPOConfig(fact_weight=fact_weight, outside_mask=outside_mask, step_labels=step_labels), tokenizer,
                         get_world(world))


@REWARDS.register("lab_knowrl")
def build_lab_knowrl(store_path: str, combine: str = "additive", gamma: float = 6.0, world: str = "synthetic") -> LabKnowRLReward:
    """KnowRL (``ground_truth`` and ``topic`` columns)."""
    return LabKnowRLReward(lab_pipeline(store_path, world=world), LabKnowRLConfig(combine=combine, gamma=gamma),
                           get_world(world))


_OPTION_CHECKS: dict[str, Any] = {
    "lab_klcf": lambda **o: KLCFConfig(w_rm=0.0, **o),
    "lab_rlfh": lambda informativeness=4: SlotInformativeness(informativeness),
    "lab_factalign": lambda **o: FactAlignConfig(**o),
    "lab_fspo": lambda **o: LabFSPOConfig(**o),
    "lab_knowrl": lambda **o: LabKnowRLConfig(**o),
}


def check_reward_options(spec: dict[str, Any]) -> None:
    """Names and values of a lab reward spec's options, checked without building it (no knowledge store needed)."""
    from nemo_factuality.registry import RegistryError, _check_kwargs

    name = spec["name"]
    opts = {k: v for k, v in spec.items() if k not in ("name", "store_path", "tokenizer", "world")}
    _check_kwargs("reward", name, REWARDS.get(name), {**opts, "store_path": "-"})
    check = {**_OPTION_CHECKS, "lab_slots": lambda **o: LabRewardConfig(**o)}.get(name)
    if check is not None:
        try:
            check(**opts)
        except TypeError as err:  # an option the config dataclass does not have
            raise RegistryError(f"reward {name!r}: {err}") from None
