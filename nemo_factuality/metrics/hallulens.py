"""HalluLens LongWiki precision / recall@k / F1 (Bang et al., 2025), equal to ``calculate_all_metrics``.

Rows are claims ``(prompt, is_supported ∈ {True, False, None})``; a sentence without claims
contributes one ``None`` row. Per prompt: precision = mean over non-null rows, recall =
``min(#supported / k, 1)``, F1 = ``2PR/(P+R)`` or 0 when ``P + R == 0`` (NaN when P is NaN).
Overall numbers are means over prompts that skip NaN (as pandas does), and ``med_n_claims`` is
the pandas median (mean of the two middle values for an even count).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_K = 32


@dataclass(frozen=True)
class PromptScore:
    prompt: str
    precision: float
    recall: float
    f1: float
    n_claims: int


@dataclass(frozen=True)
class LongWikiResult:
    overall_precision: float
    overall_recall: float
    overall_f1: float
    med_n_claims: float
    per_prompt: list[PromptScore]


def _skipna_mean(xs: list[float]) -> float:
    vals = [x for x in xs if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else float("nan")


def _median(xs: list[float]) -> float:
    vals = sorted(x for x in xs if not math.isnan(x))
    if not vals:
        return float("nan")
    mid = len(vals) // 2
    return float(vals[mid]) if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def longwiki_scores(rows: Iterable[tuple[str, bool | None]], k: int = DEFAULT_K) -> LongWikiResult:
    """Score claim rows ``(prompt, is_supported)``; prompts keep first-appearance order."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    by_prompt: dict[str, list[bool]] = {}
    for prompt, supported in rows:
        labels = by_prompt.setdefault(prompt, [])
        if supported is not None:
            labels.append(bool(supported))
    per_prompt = []
    for prompt, labels in by_prompt.items():
        n = len(labels)
        precision = sum(labels) / n if n else float("nan")
        recall = min(sum(labels) / k, 1)
        if math.isnan(precision):
            f1 = float("nan")
        else:
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_prompt.append(PromptScore(prompt, precision, recall, f1, n))
    return LongWikiResult(
        overall_precision=_skipna_mean([p.precision for p in per_prompt]),
        overall_recall=_skipna_mean([p.recall for p in per_prompt]),
        overall_f1=_skipna_mean([p.f1 for p in per_prompt]),
        med_n_claims=_median([float(p.n_claims) for p in per_prompt]),
        per_prompt=per_prompt,
    )
