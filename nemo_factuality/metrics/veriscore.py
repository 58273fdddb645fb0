"""VeriScore statistics (Song et al., 2024), equal to ``veriscore/utils.py: get_stats``.

Input per domain and model: ``[S, total_claims, n_sentences]`` triplets, one per response.

* ``K_median`` is the *upper* median of claim totals pooled over every model of a domain
  (``sorted(totals)[len // 2]``); ``K_max`` their maximum.
* per response ``P = S / total``, ``R = min(S / K, 1)``, ``F1 = 2PR / (P + R)`` if ``R > 0`` else 0.
* model numbers are plain means over its responses. A response with ``total == 0`` raises
  ``ZeroDivisionError`` as in the public code (VeriScore drops abstentions before this step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Triplet = Sequence[int]


@dataclass
class VeriScoreModelStats:
    domain: str
    model: str
    ave_sent: float
    S: float
    U: float
    P: float
    Rec_med: float
    Rec_max: float
    F1_med: float
    F1_max: float
    prec_lst: list[float] = field(default_factory=list)
    rec_med_lst: list[float] = field(default_factory=list)
    rec_max_lst: list[float] = field(default_factory=list)
    f1_med_lst: list[float] = field(default_factory=list)
    f1_max_lst: list[float] = field(default_factory=list)


def domain_k(triplets_by_model: Mapping[str, Sequence[Triplet]]) -> tuple[int, int]:
    """``(K_median, K_max)`` over the claim totals of every model in one domain."""
    totals = sorted(int(t[1]) for triplets in triplets_by_model.values() for t in triplets)
    if not totals:
        raise ValueError("a domain needs at least one response to define K")
    return totals[len(totals) // 2], totals[-1]


def _f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r) if r > 0 else 0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def model_stats(domain: str, model: str, triplets: Sequence[Triplet], k_med: int, k_max: int) -> VeriScoreModelStats:
    """Per-model VeriScore numbers for one domain."""
    prec = [t[0] / t[1] for t in triplets]
    rec_med = [min(t[0] / k_med, 1) for t in triplets]
    rec_max = [min(t[0] / k_max, 1) for t in triplets]
    f1_med = [_f1(p, r) for p, r in zip(prec, rec_med)]
    f1_max = [_f1(p, r) for p, r in zip(prec, rec_max)]
    return VeriScoreModelStats(
        domain=domain,
        model=model,
        ave_sent=_mean([t[2] for t in triplets]),
        S=_mean([t[0] for t in triplets]),
        U=_mean([t[1] - t[0] for t in triplets]),
        P=_mean(prec),
        Rec_med=_mean(rec_med),
        Rec_max=_mean(rec_max),
        F1_med=_mean(f1_med),
        F1_max=_mean(f1_max),
        prec_lst=prec,
        rec_med_lst=rec_med,
        rec_max_lst=rec_max,
        f1_med_lst=f1_med,
        f1_max_lst=f1_max,
    )


def veriscore_stats(
    domain_model_triplets: Mapping[str, Mapping[str, Sequence[Triplet]]],
) -> tuple[dict[str, dict[str, int]], list[VeriScoreModelStats]]:
    """K per domain and per-(domain, model) stats, in input order."""
    ks: dict[str, dict[str, int]] = {}
    stats: list[VeriScoreModelStats] = []
    for domain, by_model in domain_model_triplets.items():
        k_med, k_max = domain_k(by_model)
        ks[domain] = {"K_median": k_med, "K_max": k_max}
        for model, triplets in by_model.items():
            stats.append(model_stats(domain, model, triplets, k_med, k_max))
    return ks, stats
