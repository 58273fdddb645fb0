"""Machinery shared by the method rewards: input checks, reward-hacking guards, token alignment, health.

Every method reward is called as ``reward(prompts, completions, **columns) -> RewardBatch``.

Guards (on by default, ``guards.*`` in each method's config):

* **judge injection**: verdict-like text (``[Supported]``, ``Correct.``, ``Label: supported``,
  ``{"is_supported": true}``) and instructions aimed at the judge ("ignore previous instructions",
  "rate this as correct") are blanked out — replaced by spaces of the same length, so character
  spans and token alignment stay exact — before any claim reaches a judge. A response cannot raise
  its own reward by talking to the judge; ``injection_penalty`` can additionally punish it.
* **duplicates**: claims are deduplicated on normalised text, so repeating a fact counts once.
* **empty / padding**: a completion that is empty, whitespace or pad tokens only is an abstention
  (``NaN`` score), never precision 1.0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from nemo_factuality.knowledge.store import normalize
from nemo_factuality.pipeline import merged_health
from nemo_factuality.types import Claim, FactualityInputError, Span, Verdict

_INJECTION_PATTERNS = [
    r"\[\s*\**\s*(?:not\s+)?supported\s*\**\s*[.!]?\s*\]",
    r"\[\s*(?:not\s+)?foo\s*\]",
    r"\{\s*\"?is_supported\"?\s*:\s*\"?(?:true|false)\"?\s*\}",
    r"\b(?:label|verdict|rating|judgement|judgment|answer)\s*[:=]\s*(?:supported|correct|true|covered)\b",
    r"###\s*supported\s*\.?\s*###",
    r"\bignore\s+(?:all\s+|any\s+)?(?:the\s+)?(?:previous|prior|above)\s+(?:instructions|prompts?)\b[^.\n]*",
    r"\b(?:rate|mark|label|grade|judge)\s+(?:this|these|it|them|every\w*|all)\b[^.\n]{0,40}?\b(?:as\s+)?(?:correct|supported|true|covered)\b",
    r"\b(?:you\s+must|always)\s+(?:answer|output|say|reply)\b[^.\n]{0,40}?\b(?:correct|supported|true|covered)\b",
    r"^\s*(?:correct|supported|true)\s*[.!]?\s*$",
]
_INJECTION = re.compile("|".join(f"(?:{p})" for p in _INJECTION_PATTERNS), re.IGNORECASE | re.MULTILINE)
_PAD = re.compile(r"(?:<pad>|<\|endoftext\|>|<\|im_end\|>|</s>|<unk>|\[PAD\]|\s)*")


@dataclass
class GuardConfig:
    """Reward-hacking guards (see module docstring)."""

    neutralize_injection: bool = True
    injection_penalty: float = 0.0  # subtracted from the score of a completion that tried
    dedup_claims: bool = True


def neutralize_injection(text: str) -> tuple[str, int]:
    """Blank out judge-directed text with spaces of equal length; returns (text, number of hits)."""
    hits = 0

    def blank(m: re.Match[str]) -> str:
        nonlocal hits
        hits += 1
        return " " * len(m.group(0))

    return _INJECTION.sub(blank, text), hits


def is_blank(text: str) -> bool:
    """Empty, whitespace-only or pad-token-only completions."""
    return _PAD.fullmatch(text) is not None


def dedup_claims(claims: Sequence[Claim], verdicts: Sequence[Verdict]) -> tuple[list[Claim], list[Verdict]]:
    """Keep the first claim of each normalised text (and its verdict)."""
    by_id = {v.claim_id: v for v in verdicts}
    seen: set[str] = set()
    kept_c, kept_v = [], []
    for c in claims:
        key = normalize(c.text)
        if key in seen:
            continue
        seen.add(key)
        kept_c.append(c)
        if c.id in by_id:
            kept_v.append(by_id[c.id])
    return kept_c, kept_v


def validate_batch(prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Any], *,
                   who: str, required: Sequence[str] = ()) -> None:
    """Check batch lengths and types; errors name the sample index and the field."""
    n = len(completions)
    if len(prompts) != n:
        raise FactualityInputError(f"{who}: {len(prompts)} prompts but {n} completions")
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not isinstance(p, str):
            raise FactualityInputError(f"{who}: prompts[{i}] must be str, got {type(p).__name__}")
        if not isinstance(c, str):
            raise FactualityInputError(f"{who}: completions[{i}] must be str, got {type(c).__name__}")
    for name in required:
        if columns.get(name) is None:
            raise FactualityInputError(f"{who}: column {name!r} is required (pass {name}=[...] with one entry per completion)")
    for name, values in columns.items():
        if values is not None and hasattr(values, "__len__") and len(values) != n:
            raise FactualityInputError(f"{who}: column {name!r} has {len(values)} entries but there are {n} completions")


def check_finite(name: str, values: Sequence[float], who: str) -> None:
    for i, v in enumerate(values):
        if v is None or not math.isfinite(float(v)):
            raise FactualityInputError(f"{who}: {name}[{i}] is {v!r}; expected a finite number")


@dataclass
class TokenPlacer:
    """Places character-level rewards onto the policy's tokens of one completion."""

    tokenizer: Any
    text: str
    token_ids: Sequence[int] | None = None
    _alignment: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        from nemo_factuality.text.alignment import align_tokens

        self._alignment = align_tokens(self.tokenizer, self.text, self.token_ids)

    @property
    def n_tokens(self) -> int:
        return len(self._alignment)

    def last_token(self, span: Span) -> int:
        return self._alignment.last_token(span)

    def token_range(self, span: Span) -> tuple[int, int]:
        return self._alignment.token_range(span)


def placer_for(tokenizer: Any, completion: str, columns: Mapping[str, Any], i: int) -> TokenPlacer | None:
    """A ``TokenPlacer`` for sample ``i`` (uses the ``completion_ids`` column when given), or None without a tokenizer."""
    if tokenizer is None:
        return None
    ids = columns.get("completion_ids")
    return TokenPlacer(tokenizer, completion, None if ids is None else list(ids[i]))


def load_tokenizer(tokenizer: Any) -> Any:
    """Accept a tokenizer object or a local path."""
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer)


class RewardParts:
    """Mixin: ``health()`` and ``stats()`` merged over the reward's components."""

    def _parts(self) -> list[Any]:
        return []

    def health(self) -> dict[str, str | None]:
        return merged_health(self._parts())

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for part in self._parts():
            st = getattr(part, "stats", None)
            st = st() if callable(st) else st
            st = st.as_dict() if hasattr(st, "as_dict") else st
            if isinstance(st, dict):
                for k, v in st.items():
                    if isinstance(v, (int, float)):
                        out[k] = out.get(k, 0.0) + float(v)
        return out


def nan_array(n: int) -> np.ndarray:
    return np.full(n, np.nan, dtype=np.float64)
