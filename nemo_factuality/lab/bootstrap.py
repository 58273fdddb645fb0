"""The lab report's margins judged by a paired bootstrap over the held-out people (pure functions, numpy).

A margin is a method's FActScore minus a baseline's, in points, on the same held-out people. Each person's
scores are kept as ``PerPerson = {name: {"score_sum", "responding"}}``: the sum of FActScore's per-response
score (fraction of supported claims, γ = 0) over the person's responding responses, and how many responded.
FActScore over any set of people is then ``Σ score_sum / Σ responding``: a ratio, not a mean of per-person
scores, because FActScore averages over responding *responses* and people differ in how many respond.

One resample draws ``P`` of a seed's ``P`` held-out people with replacement and recomputes both FActScores on
them. **Paired**: the method and the baseline get the same drawn people, so what the people have in common (a
hard person is hard for both) cancels, as it does in the margin itself; drawing them independently would count
how hard the drawn people are as noise on each side. **Pooled over seeds by stratifying**: each seed is its own
world, with its own invented people (``WorldConfig.seed``), so no person appears in two seeds and there is no
per-person mean over seeds to take; each resample draws every seed's people from that seed and averages the
per-seed margins, as the report's margin (the mean over seeds) does.

What the interval measures: the noise from *which* people were held out (and from the responses sampled for
them), not how much another training run would move the margin; only more seeds measure that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# The bounds' own resampling error at this size is ~0.06 standard errors of the margin (measured: 0.13 points for
# 120 people with a per-person margin sd of 25 points), about the 0.1 points the report prints; ~8 ms a seed.
RESAMPLES = 2000
LEVEL = 0.95
RNG_SEED = 43  # fixed: the same report from the same scores
# bounds this close to 0 are float rounding in a sum (displayed to 0.1 points): no evidence either way
_ZERO_POINTS = 1e-9

PerPerson = Mapping[str, Mapping[str, float]]


def paired_people(after: PerPerson, before: PerPerson) -> np.ndarray:
    """``[4, P]`` float: ``after``'s score sums and responding counts, then ``before``'s, one column per person
    (sorted by name). Both must be scored on the same people: a margin over different people is not paired."""
    if set(after) != set(before):
        raise ValueError(f"a paired margin needs the same people on both sides: {len(set(after) ^ set(before))} "
                         "people are scored on one side only")
    names = sorted(after)
    return np.array([[side[n][key] for n in names] for side in (after, before) for key in ("score_sum", "responding")],
                    dtype=float)


def resampled_margins(people: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``[R]`` FActScore points of after over before on each resample. ``people``: ``[4, P]`` (``paired_people``);
    ``index``: ``[R, P]`` drawn column numbers, one row per resample, used for both sides (the pairing). A
    resample on which a side has no responding response has no FActScore: NaN."""
    sums = people[:, index].sum(axis=2)  # [4, R]: each side's score sum and responding count per resample
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100 * (sums[0] / sums[1] - sums[2] / sums[3])


def paired_bootstrap(seeds: Sequence[np.ndarray], *, resamples: int = RESAMPLES, level: float = LEVEL,
                     rng_seed: int = RNG_SEED) -> tuple[float, float] | None:
    """The ``level`` percentile interval of the margin (points, mean over seeds) over ``resamples`` paired
    resamples of each seed's people. ``seeds``: one ``[4, P_s]`` array per seed (``paired_people``). Cost:
    ``resamples × Σ P_s`` (time and memory). Resamples on which a side has no FActScore (none of the drawn people
    responded) are left out; None when that is every resample."""
    rng = np.random.default_rng(rng_seed)  # a fresh generator per margin: its interval does not depend on call order
    total = np.zeros(resamples)
    for people in seeds:
        n = people.shape[1]
        total += resampled_margins(people, rng.integers(0, n, size=(resamples, n)))
    margins = total[np.isfinite(total)] / len(seeds)
    if margins.size == 0:
        return None
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(margins, [tail, 100 - tail])
    return float(low), float(high)


def margin_interval(after: Sequence[PerPerson | None], before: Sequence[PerPerson | None]) -> tuple[float, float] | None:
    """``paired_bootstrap`` of after over before, one per-person table per seed on each side; None when a seed
    has no per-person scores (results that predate them), since the interval would then leave that seed out."""
    if any(a is None for a in after) or any(b is None for b in before):
        return None
    return paired_bootstrap([paired_people(a, b) for a, b in zip(after, before, strict=True)])


def verdict(interval: Sequence[float] | None) -> str:
    """"beats" when the whole interval is above 0, "falls behind" when it is below, else "within noise"."""
    if interval is None:
        return "within noise"
    low, high = interval
    if low > _ZERO_POINTS:
        return "beats"
    return "falls behind" if high < -_ZERO_POINTS else "within noise"

