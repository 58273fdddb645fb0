"""FActScore aggregation with the length penalty gamma (Min et al., 2023).

Equal to ``FactScorer.get_score(..., gamma, atomic_facts=...)`` of shmsw25/FActScore:

* per response ``s_i = mean(is_supported)``; with a truthy gamma, ``score_i = s_i * exp(1 - gamma/n)``
  when ``n < gamma`` (``n == gamma`` gives 1.0, ``n > gamma`` no penalty);
* ``score`` and ``init_score`` (un-penalised, present only when gamma is truthy) average over
  *responding* items; ``respond_ratio`` averages over all items; ``num_facts_per_response`` over
  responding items. All-abstained batches give NaN.

Deliberate difference: an empty fact list (``[]``) is treated as an abstention (``None``), as
FActScore's own pipeline does when it extracts zero facts; the public aggregate would raise
``ZeroDivisionError`` for it with gamma > 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FactScoreResult:
    score: float
    init_score: float | None  # None when gamma is 0 (the public code omits the key)
    respond_ratio: float
    num_facts_per_response: float
    decisions: list[list[bool] | None]


def length_penalty(n_facts: int, gamma: float) -> float:
    """``exp(1 - gamma / n)`` for ``n < gamma`` else 1.0 (gamma 0 disables it)."""
    if not gamma or n_facts > gamma:
        return 1.0
    return math.exp(1 - gamma / n_facts)


def _nanmean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def factscore(decisions: Sequence[Sequence[bool] | None], gamma: float = 10) -> FactScoreResult:
    """Aggregate per-response fact decisions (``None`` or ``[]`` = abstained) into FActScore numbers."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    normalised: list[list[bool] | None] = [None if (d is None or len(d) == 0) else [bool(x) for x in d] for d in decisions]
    responding = [d for d in normalised if d is not None]
    init_scores = [sum(d) / len(d) for d in responding]
    scores = [s * length_penalty(len(d), gamma) for s, d in zip(init_scores, responding)]
    return FactScoreResult(
        score=_nanmean(scores),
        init_score=_nanmean(init_scores) if gamma else None,
        respond_ratio=len(responding) / len(normalised) if normalised else float("nan"),
        num_facts_per_response=_nanmean([float(len(d)) for d in responding]),
        decisions=normalised,
    )
