"""Records with labelled claims → the evaluation report (pure functions, no I/O).

A record is ``{"id", "prompt", "response", "claims": null | [{"text", "label"}], ...}`` where
``claims: null`` means the response abstained and labels are ``supported``, ``not_supported``
or ``irrelevant``. Each metric keeps its public tool's convention:

* SAFE F1@K: irrelevant claims excluded from P and R; averaged, as SAFE's evaluation does, over every
  response with at least one claim of any label (all irrelevant: F1 = 0, precision 0).
* FActScore: irrelevant counted as not supported; ``null`` or zero claims = abstained.
* VeriScore: the group is the domain; K = upper median / max of claim totals; irrelevant
  claims count in the total (VeriScore has no irrelevant class); items without claims skipped.
* HalluLens LongWiki: one row per claim, irrelevant = not supported; abstentions excluded.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_factuality.metrics import aggregate_f1_at_k, factscore, longwiki_scores
from nemo_factuality.metrics.veriscore import domain_k, model_stats
from nemo_factuality.types import FactualityInputError

LABELS = ("supported", "not_supported", "irrelevant")


@dataclass(frozen=True)
class EvalRecord:
    """One response with its labelled claims (``claims is None`` = abstained)."""

    id: str
    prompt: str
    response: str
    claims: tuple[tuple[str, str], ...] | None  # (text, label)
    group: str = "all"
    unparseable: int = 0  # claims whose verdict could not be read (excluded, reported)

    def count(self, label: str) -> int:
        return sum(1 for _, lab in (self.claims or ()) if lab == label)


@dataclass
class EvalOptions:
    ks: tuple[int, ...] = (64, 100, 178)
    gammas: tuple[float, ...] = (0, 10)
    hallulens_k: int = 32
    extra: dict[str, Any] = field(default_factory=dict)


def parse_record(raw: Mapping[str, Any], *, where: str, group_by: str | None = None) -> EvalRecord:
    """Validate one JSON record; errors name ``where`` (file:line) and the field."""
    rid, prompt, response = check_core_fields(raw, where=where)
    claims_raw = raw.get("claims")
    claims: tuple[tuple[str, str], ...] | None = None
    if claims_raw is not None:
        if not isinstance(claims_raw, list):
            raise FactualityInputError(f"{where}: field 'claims' must be null or a list")
        claims = tuple(_parse_claim(c, j, where) for j, c in enumerate(claims_raw))
    group = group_of(raw, group_by, where=where) if group_by else "all"
    return EvalRecord(rid, prompt, response, claims, group, _count(raw, "unparseable", where))


def check_core_fields(raw: Mapping[str, Any], *, where: str) -> tuple[str, str, str]:
    """``(id, prompt, response)`` of a record: id a string or integer (as text), prompt and response strings. Every
    missing one is named at once (a record with the wrong field names would otherwise take one rerun per field)."""
    missing = [key for key in ("id", "prompt", "response") if key not in raw]
    if missing:
        keys = sorted(map(str, raw))
        also = f" (it has {', '.join(repr(k) for k in keys[:10])}{', …' if len(keys) > 10 else ''})" if keys else ""
        raise FactualityInputError(f"{where}: missing field{'s' if len(missing) > 1 else ''} "
                                   f"{', '.join(repr(k) for k in missing)}{also}")
    rid = raw["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise FactualityInputError(f"{where}: field 'id' must be a string or an integer, got {type(rid).__name__}")
    for key in ("prompt", "response"):
        if not isinstance(raw[key], str):
            raise FactualityInputError(f"{where}: field {key!r} must be a string, got {type(raw[key]).__name__}")
    return str(rid), raw["prompt"], raw["response"]


def check_unique_ids(rows: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
    """Raise if two records share an id (compared as text: HalluLens scores per id, so 1 and "1" would merge).

    ``rows`` are ``(file:line, record)`` with valid ids (see ``check_core_fields``).
    """
    first_seen: dict[str, str] = {}
    for where, raw in rows:
        rid = str(raw["id"])
        if rid in first_seen:
            raise FactualityInputError(
                f"{where}: id {_short(raw['id'])} repeats the id on {first_seen[rid]} (ids are compared as text, so 1 and "
                '"1" are the same); give every record its own id')
        first_seen[rid] = where


def group_of(raw: Mapping[str, Any], group_by: str, *, where: str) -> str:
    """The record's ``--group-by`` value as text; it must be present and a JSON scalar."""
    if group_by not in raw:
        raise FactualityInputError(f"{where}: --group-by field {group_by!r} is missing from this record")
    value = raw[group_by]
    if isinstance(value, (list, dict)):
        raise FactualityInputError(f"{where}: --group-by field {group_by!r} must be a string or a number, "
                                   f"got {type(value).__name__}")
    return str(value)


def _parse_claim(c: Any, j: int, where: str) -> tuple[str, str]:
    if not isinstance(c, Mapping) or "text" not in c or "label" not in c:
        raise FactualityInputError(f"{where}: claims[{j}] needs 'text' and 'label'")
    if not isinstance(c["text"], str):
        raise FactualityInputError(f"{where}: claims[{j}].text must be a string, got {type(c['text']).__name__}")
    label = c["label"].strip().lower() if isinstance(c["label"], str) else None
    if label not in LABELS:
        raise FactualityInputError(f"{where}: claims[{j}].label {_short(c['label'])} is not one of {LABELS}")
    return c["text"], label


def _count(raw: Mapping[str, Any], key: str, where: str) -> int:
    """A non-negative integer field (0 when absent)."""
    value = raw.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FactualityInputError(f"{where}: field {key!r} must be a non-negative integer (a count of claims), "
                                   f"got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """A bounded repr for error messages (values may be huge or deeply nested)."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__}>"
    if isinstance(value, int) and value.bit_length() > 256:
        return f"<integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _safe_block(records: Sequence[EvalRecord], ks: Sequence[int]) -> dict[str, float]:
    """SAFE's aggregate over responses with >= 1 claim; ``n_all_irrelevant`` of them had no S/NS claim (F1 0)."""
    counts = [(r.count("supported"), r.count("not_supported")) for r in records if r.claims]
    return {**aggregate_f1_at_k(counts, ks), "n_all_irrelevant": sum(1 for s, ns in counts if s + ns == 0)}


def _factscore_block(records: Sequence[EvalRecord], gammas: Sequence[float]) -> dict[str, Any]:
    decisions = [None if not r.claims else [lab == "supported" for _, lab in r.claims] for r in records]
    out = {}
    for gamma in gammas:
        res = factscore(decisions, gamma=gamma)
        block = {"score": res.score, "respond_ratio": res.respond_ratio, "num_facts_per_response": res.num_facts_per_response}
        if res.init_score is not None:
            block["init_score"] = res.init_score
        out[f"gamma{_fmt_num(gamma)}"] = block
    return out


def _veriscore_block(records: Sequence[EvalRecord]) -> dict[str, float]:
    triplets = [[r.count("supported"), len(r.claims), 1] for r in records if r.claims]
    if not triplets:
        return {"K_median": float("nan"), "K_max": float("nan"), "precision": float("nan"),
                "f1@K_median": float("nan"), "f1@K_max": float("nan"), "n_items": 0}
    k_med, k_max = domain_k({"model": triplets})
    stats = model_stats("group", "model", triplets, k_med, k_max)
    return {"K_median": k_med, "K_max": k_max, "precision": stats.P, "recall@K_median": stats.Rec_med,
            "f1@K_median": stats.F1_med, "f1@K_max": stats.F1_max, "n_items": len(triplets)}


def _hallulens_block(records: Sequence[EvalRecord], k: int) -> dict[str, float]:
    rows = [(r.id, lab == "supported") for r in records if r.claims for _, lab in r.claims]
    if not rows:
        return {"precision": float("nan"), f"recall@{k}": float("nan"), f"f1@{k}": float("nan"), "med_n_claims": float("nan")}
    res = longwiki_scores(rows, k=k)
    return {"precision": res.overall_precision, f"recall@{k}": res.overall_recall, f"f1@{k}": res.overall_f1,
            "med_n_claims": res.med_n_claims}


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def group_report(records: Sequence[EvalRecord], opts: EvalOptions) -> dict[str, Any]:
    """Every metric block for one group of records."""
    n_claims = [len(r.claims) for r in records if r.claims]
    return {
        "n_records": len(records),
        "n_abstained": sum(1 for r in records if not r.claims),
        "n_empty": sum(1 for r in records if not r.response.strip()),  # blank responses (among the abstained)
        "n_claims": sum(n_claims),
        "n_unparseable_verdicts": sum(r.unparseable for r in records),
        "claims_per_response": statistics.fmean(n_claims) if n_claims else float("nan"),
        "label_counts": {lab: sum(r.count(lab) for r in records) for lab in LABELS},
        "safe": _safe_block(records, opts.ks),
        "factscore": _factscore_block(records, opts.gammas),
        "veriscore": _veriscore_block(records),
        "hallulens": _hallulens_block(records, opts.hallulens_k),
    }


def build_report(records: Iterable[EvalRecord], opts: EvalOptions) -> dict[str, Any]:
    """``{"options": ..., "groups": {"all": {...}, <group>: {...}}}`` (groups in first-seen order)."""
    recs = list(records)
    if not recs:
        raise FactualityInputError("no records to evaluate: the input is empty")
    groups: dict[str, list[EvalRecord]] = {}
    for r in recs:
        groups.setdefault(r.group, []).append(r)
    report: dict[str, Any] = {
        "options": {"k": list(opts.ks), "gamma": list(opts.gammas), "hallulens_k": opts.hallulens_k, **opts.extra},
        "groups": {"all": group_report(recs, opts)},
    }
    if set(groups) != {"all"}:
        for name, members in groups.items():
            report["groups"][name] = group_report(members, opts)
    return report


def precision_points(records: Iterable[EvalRecord]) -> list[tuple[int, float]]:
    """(claims per response, SAFE precision) for each responding record with S+NS > 0 (for the plot)."""
    pts = []
    for r in records:
        s, ns = r.count("supported"), r.count("not_supported")
        if s + ns:
            pts.append((len(r.claims or ()), s / (s + ns)))
    return pts


def to_json_safe(obj: Any) -> Any:
    """Replace NaN/inf by None so the report is strict JSON."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v) for v in obj]
    return obj
