"""Machinery shared by the method rewards: input checks, reward-hacking guards, token alignment, health.

Every method reward is called as ``reward(prompts, completions, **columns) -> RewardBatch``.

Guards (on by default, ``guards.*`` in each method's config):

* **judge injection**: verdict-like text (``[Supported]``, ``Correct.``, ``Label: supported``,
  ``{"is_supported": true}``) and instructions aimed at the judge ("ignore previous instructions",
  "rate this as correct", "note to the grader") are blanked out — replaced by spaces of the same
  length, so character spans and token alignment stay exact — in the completion before fact-checking
  and, at the judge boundary (``judge.guard.judge_request``), in every untrusted field of every judge
  prompt (claims, responses, predicted answers). A response cannot raise its own reward by talking to
  a judge; ``injection_penalty`` additionally punishes the attempt in every method.
* **duplicates**: claims are deduplicated on normalised text, so repeating a fact counts once.
* **empty / padding**: a completion that is empty, whitespace or pad tokens only is an abstention
  (``NaN`` score), never precision 1.0.

Failures (``mark_failures``): a sample whose fact-check or judge failed is ``NaN`` with the reason in
``details[i]["error"]`` — never a default score.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_factuality.judge.guard import neutralize_injection  # noqa: F401  (re-exported: the one guard)
from nemo_factuality.knowledge.store import normalize
from nemo_factuality.pipeline import merged_health
from nemo_factuality.types import Claim, FactualityInputError, Span, Verdict

log = logging.getLogger(__name__)
_PAD = re.compile(r"(?:<pad>|<\|endoftext\|>|<\|im_end\|>|</s>|<unk>|\[PAD\]|\s)*")


@dataclass
class GuardConfig:
    """Reward-hacking guards (see module docstring)."""

    neutralize_injection: bool = True  # blank verdict-like text and instructions to the judge in responses before any judge sees them
    injection_penalty: float = 0.0  # subtracted from the score of a completion that tried
    dedup_claims: bool = True  # count repeated claims once


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
    """Places character-level rewards onto the policy's tokens of one completion.

    ``error`` is set when the completion's own token ids cannot be aligned to its text (e.g. a special token
    sampled inside a multi-byte character): that sample then fails alone — its reward is NaN with the reason and
    its ``n_tokens`` token outputs are zeros — instead of failing the whole batch."""

    tokenizer: Any
    text: str
    token_ids: Sequence[int] | None = None
    error: str | None = field(default=None, init=False)
    _alignment: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        from nemo_factuality.text.alignment import align_tokens

        try:
            self._alignment = align_tokens(self.tokenizer, self.text, self.token_ids)
        except FactualityInputError as err:
            if self.token_ids is None:  # no ids of its own: the text itself is bad input
                raise
            self.error = f"token alignment: {err}"

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) if self._alignment is None else len(self._alignment)

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
    """Accept a tokenizer object or a local directory (``local_models``: never the Hub)."""
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    from nemo_factuality.local_models import load_tokenizer

    return load_tokenizer(tokenizer, "tokenizer")


class RewardParts:
    """Mixin: the guarded call, ``health()`` and ``stats()`` merged over the reward's components.

    ``reward(prompts, completions, **columns)`` runs the subclass's ``_score`` with the judge-boundary
    guard set from ``self.cfg.guards.neutralize_injection`` (every judge the reward calls obeys it).
    """

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> Any:
        from nemo_factuality.judge.guard import guard_scope

        with guard_scope(self.cfg.guards.neutralize_injection):
            return self._score(prompts, completions, **columns)

    def _score(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> Any:
        raise NotImplementedError

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


def mark_failures(scores: np.ndarray, errors: Sequence[str | None], details: list[dict[str, Any]] | None = None,
                  *, who: str) -> list[dict[str, Any]]:
    """Set ``scores[i] = NaN`` where ``errors[i]`` is set and return per-sample details with ``"error"``.

    A failed sample is excluded (NaN = "do not train on this"), never scored with a default; the
    reason travels in ``details[i]["error"]`` to the trainer, the server's clients and the logs.
    """
    out = [dict(d or {}) for d in (details or [{} for _ in errors])]
    failed = 0
    for i, err in enumerate(errors):
        if err is not None:
            scores[i] = np.nan
            out[i]["error"] = err
            failed += 1
    if failed:
        first = next(e for e in errors if e is not None)
        log.warning("%s: %d of %d samples failed and are NaN (first: %s)", who, failed, len(errors), first)
    return out


def check_errors(checks: Sequence[Any]) -> list[str | None]:
    """``FactCheck.error`` per sample (None for blank completions and successful checks)."""
    return [getattr(c, "error", None) if c is not None else None for c in checks]
