"""SAFE / LongFact F1@K (Wei et al., 2024), numerically equal to the public ``calculate_metrics``.

Conventions (google-deepmind/long-form-factuality ``eval/metric_utils.py``):

* Irrelevant claims are not an input: precision and recall use Supported (S) and Not Supported (NS).
* ``P = S / (S + NS)``, ``R = min(1, S / K)``, ``F1 = 2PR / (P + R)``; ``F1 = 0`` when ``S == 0``.
* ``K <= 0`` or negative counts raise ``ValueError`` (checked in that order).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_K = 100


@dataclass(frozen=True)
class SafeScore:
    """F1@K of one response; ``precision``/``recall`` are ``None`` when S == 0 (the public code returns early)."""

    f1: float
    precision: float | None
    recall: float | None


def f1_at_k(supported: int, not_supported: int, k: int = DEFAULT_K) -> SafeScore:
    """F1@K for one response from its Supported / Not Supported claim counts."""
    if k <= 0:
        raise ValueError("max_claims must be positive.")
    if supported < 0 or not_supported < 0:
        raise ValueError("Cannot have negative numbers of claims.")
    if supported == 0:
        return SafeScore(f1=0, precision=None, recall=None)
    precision = float(supported / (supported + not_supported))
    recall = min(1, float(supported / k))
    return SafeScore(f1=2 * precision * recall / (precision + recall), precision=precision, recall=recall)


def aggregate_f1_at_k(counts: Iterable[tuple[int, int]], ks: Sequence[int] = (DEFAULT_K,)) -> dict[str, float]:
    """Mean over responses of F1@K for each K, plus mean precision and recall@K.

    ``counts``: one ``(S, NS)`` per annotated response that has at least one claim of any label, as
    SAFE's evaluation averages: a response whose claims are all irrelevant (S == NS == 0) is an item
    with F1 = 0 (``f1_at_k`` returns 0 when S == 0), not a dropped one. Its precision is undefined;
    it counts as 0 here, like every response with S == 0. Responses without claims (abstentions)
    are the caller's to leave out. ``n_items`` is how many responses were averaged.
    """
    items = list(counts)
    out: dict[str, float] = {"n_items": len(items)}
    if not items:
        for k in ks:
            out[f"f1@{k}"] = float("nan")
            out[f"recall@{k}"] = float("nan")
        out["precision"] = float("nan")
        return out
    precisions = [s / (s + ns) if (s + ns) else 0.0 for s, ns in items]
    out["precision"] = sum(precisions) / len(items)
    for k in ks:
        out[f"f1@{k}"] = sum(float(f1_at_k(s, ns, k).f1) for s, ns in items) / len(items)
        out[f"recall@{k}"] = sum(min(1.0, s / k) for s, _ in items) / len(items)
    return out
