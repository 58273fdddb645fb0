"""The lab's factuality reward: slot scores from the real pipeline (identity claims → KB facts → ``kb_exact``).

Each sentence of a bio is one claim about one attribute slot. ``kb_exact`` labels it:

* SUPPORTED (states the stored value)            → slot reward ``+1``
* NOT_SUPPORTED / NOT_ENOUGH_INFO (a wrong value,
  a garbled sentence, another person's name)     → ``-wrong_penalty``
* IRRELEVANT (the abstention value ``unknown``)   → ``0``

Because bios are fixed rows of slots, an abstention *replaces* a claim: saying "unknown" instead of
a guess moves a slot from ``-wrong_penalty`` or ``+1`` to 0, and adding lines earns nothing
(duplicates count once, extra guesses cost). Answering a slot pays when p(correct) >
``wrong_penalty / (1 + wrong_penalty)``; that is the abstention threshold RL should learn.

``mode`` picks the response score (``nemo-factuality lab --methods slots slots:reward.mode=precision``):

* ``dual`` (default): ``(S - w·F) / n_slots``, pays for precision *and* recall (KLCF's point);
* ``precision``: ``S / (S + F)`` (0 when no claim is made), precision only (breeds over-abstention).

Dense outputs for the GRPO stage, aligned to ``completion_ids`` when given: ``token_signs`` for FSPO's
flip and ``token_rewards`` (RLFH-style: each sentence's slot reward on its last token). With
``sign_scope: value`` (default) only the sentence's *value* word carries the sign (+1 supported, -1
wrong; 0 for abstentions and everywhere else, where the group advantage applies unchanged): the value
is the decision a slot makes, and signing the whole sentence would also push down the person's name
and the template words of every wrong sentence, which garbles the format. ``sentence`` signs every token
of the sentence, as FSPO does for reasoning steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.lab.pipeline import lab_pipeline
from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import GuardConfig, RewardParts, is_blank, load_tokenizer, placer_for, validate_batch
from nemo_factuality.rewards.common import guarded_check
from nemo_factuality.types import FactualityInputError, Label, RewardBatch, Span

MODES = ("dual", "precision")
_VALUE_WORD = re.compile(r"(\S+?)\.\s*$")


@dataclass
class LabRewardConfig:
    wrong_penalty: float = 1.0
    n_slots: int = 6
    mode: str = "dual"
    sign_scope: str = "value"  # value | sentence
    guards: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FactualityInputError(f"lab reward: mode must be one of {MODES}, got {self.mode!r}")
        if self.sign_scope not in ("value", "sentence"):
            raise FactualityInputError(f"lab reward: sign_scope must be 'value' or 'sentence', got {self.sign_scope!r}")
        if self.wrong_penalty < 0 or self.n_slots < 1:
            raise FactualityInputError("lab reward: wrong_penalty must be >= 0 and n_slots >= 1")


def slot_value(label: Label, wrong_penalty: float) -> float | None:
    """Reward of one sentence's verdict; ``None`` for an unreadable verdict (left out)."""
    if label is Label.SUPPORTED:
        return 1.0
    if label is Label.IRRELEVANT:
        return 0.0
    if label in (Label.NOT_SUPPORTED, Label.NOT_ENOUGH_INFO):
        return -wrong_penalty
    return None


class LabSlotReward(RewardParts):
    """``reward(prompts, completions, completion_ids=None) -> RewardBatch`` (see module docstring)."""

    def __init__(self, pipeline: Any, cfg: LabRewardConfig | None = None, tokenizer: Any = None) -> None:
        self.pipeline, self.cfg, self.tokenizer = pipeline, cfg or LabRewardConfig(), load_tokenizer(tokenizer)

    def _parts(self) -> list[Any]:
        return [self.pipeline]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="lab reward")
        cfg, n = self.cfg, len(completions)
        checks, _ = guarded_check(self.pipeline, cfg.guards, prompts, completions)
        supported, wrong, abstained = np.zeros(n), np.zeros(n), np.zeros(n)
        scores = np.zeros(n)
        signs: list[np.ndarray] | None = [] if self.tokenizer is not None else None
        dense: list[np.ndarray] | None = [] if self.tokenizer is not None else None
        for i, check in enumerate(checks):
            slots = []  # (span, slot reward)
            if check is not None:
                by_id = {v.claim_id: v for v in check.verdicts}
                for claim in check.claims:
                    value = slot_value(by_id[claim.id].label, cfg.wrong_penalty)
                    if value is not None:
                        slots.append((self._signed_span(claim), value))
            supported[i] = sum(v > 0 for _, v in slots)
            wrong[i] = sum(v < 0 for _, v in slots)
            abstained[i] = sum(v == 0 for _, v in slots)
            scores[i] = self._score(supported[i], wrong[i])
            if signs is not None:
                s, d = self._token_outputs(completions[i], columns, i, slots)
                signs.append(s)
                dense.append(d)
        precision = np.where(supported + wrong > 0, supported / np.maximum(supported + wrong, 1), np.nan)
        components = {"supported": supported, "wrong": wrong, "abstained": abstained, "claims": supported + wrong,
                      "precision": precision}
        return RewardBatch(scores, components, token_rewards=dense, token_signs=signs)

    def _signed_span(self, claim: Any) -> Span | None:
        """The part of a claim that carries its sign: the value word before the final ``.`` (or the sentence)."""
        span = claim.span
        if span is None or self.cfg.sign_scope == "sentence":
            return span
        m = _VALUE_WORD.search(claim.text)
        return Span(span.start + m.start(1), span.start + m.end(1)) if m else span

    def _score(self, s: float, f: float) -> float:
        if self.cfg.mode == "precision":
            return s / (s + f) if s + f else 0.0
        return (s - self.cfg.wrong_penalty * f) / self.cfg.n_slots

    def _token_outputs(self, completion: str, columns: dict, i: int, slots: list) -> tuple[np.ndarray, np.ndarray]:
        placer = placer_for(self.tokenizer, completion, columns, i)
        signs = np.zeros(placer.n_tokens, dtype=np.int8)
        dense = np.zeros(placer.n_tokens, dtype=np.float32)
        if is_blank(completion):
            return signs, dense
        for span, value in slots:
            if span is None:
                continue
            first, end = placer.token_range(span)
            signs[first:end] = int(np.sign(value))
            if end > first:
                dense[end - 1] = value / self.cfg.n_slots
        return signs, dense


@REWARDS.register("lab_slots")
def build_lab_reward(store_path: str, tokenizer: str | None = None, world: str = "synthetic", **cfg: Any) -> LabSlotReward:
    """The lab reward from config: ``{name: lab_slots, store_path: kb.sqlite, tokenizer: DIR, wrong_penalty, mode}``;
    ``world`` picks the verifier (``kb_exact``, or the countries' ``CountryVerifier``)."""
    guards = GuardConfig(**cfg.pop("guards", {}))
    pipeline = lab_pipeline(store_path, abstentions_are_claims=True, world=world)  # an abstention is a 0 slot
    return LabSlotReward(pipeline, LabRewardConfig(guards=guards, **cfg), tokenizer)
