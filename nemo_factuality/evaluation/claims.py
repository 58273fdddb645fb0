"""``claims.jsonl``: every claim an evaluation judged, one JSON record per claim, for a person to audit.

Each record::

    {"response_id": "7", "claim_index": 0, "claim": "The capital of Ukraine is Kyiv.", "span": [0, 31],
     "label": "supported", "evidence": ["capital of Ukraine: Kyiv (also Kiev)"]}

* ``span``: the claim's half-open character offsets in the response: the pipeline's own alignment, or the
  claim's first occurrence in the response (after the previous claim's) when the record came labelled; null
  when the claim's text is not in the response (a paraphrasing extractor).
* ``label``: the claim's label as the metrics counted it (``supported``, ``not_supported``, ``irrelevant``),
  or ``abstained`` for a claim that declines to state a value (a record's ``abstentions``, e.g. the lab's
  "I don't know the currency of Tuvalu.") and for a response with no claims at all, which gets one record with
  ``claim_index`` and ``claim`` null and ``empty_response`` saying whether the response was blank: a file of
  blank generations would otherwise read as a model that always abstains.
* ``evidence``: what the claim was checked against (the verifier's evidence: passages, or the stored fact);
  null when the record came labelled without it.

Records whose fact-check failed have no claims to list (the report's ``failures`` names them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

ABSTAINED = "abstained"
ABSTENTIONS_FIELD = "abstentions"  # optional record field: claims that decline to state a value (not scored)


def is_empty(response: str) -> bool:
    return not response.strip()


def locate(text: str, response: str, start: int = 0) -> list[int] | None:
    """``[start, end]`` of ``text``'s first occurrence in ``response`` at or after ``start`` (then anywhere), or None."""
    if not text:
        return None
    at = response.find(text, start)
    if at < 0:
        at = response.find(text)
    return None if at < 0 else [at, at + len(text)]


def _claim_line(rid: str, index: int, claim: Mapping[str, Any], label: str, response: str, after: int) -> dict[str, Any]:
    span = claim.get("span")
    span = list(span) if isinstance(span, (list, tuple)) and len(span) == 2 else locate(claim["text"], response, after)
    evidence = claim.get("evidence")
    return {"response_id": rid, "claim_index": index, "claim": claim["text"], "span": span, "label": label,
            "evidence": list(evidence) if evidence is not None else None}


def claim_records(rows: Sequence[tuple[str, Mapping[str, Any]]], failed: Mapping[str, str]) -> Iterator[dict[str, Any]]:
    """``claims.jsonl``'s records for ``(file:line, record)`` rows (records labelled, as ``eval`` scores them),
    in input order; rows named in ``failed`` are left out."""
    for where, raw in rows:
        if where in failed:
            continue
        rid, response = str(raw["id"]), raw["response"]
        claims = raw.get("claims") or []
        abstentions = raw.get(ABSTENTIONS_FIELD) or []
        after = 0
        for j, claim in enumerate(claims):
            line = _claim_line(rid, j, claim, str(claim["label"]).strip().lower(), response, after)
            after = line["span"][1] if line["span"] else after
            yield line
        for j, claim in enumerate(abstentions, start=len(claims)):
            yield _claim_line(rid, j, claim, ABSTAINED, response, 0)
        if not claims and not abstentions:
            yield {"response_id": rid, "claim_index": None, "claim": None, "span": None, "label": ABSTAINED,
                   "evidence": None, "empty_response": is_empty(response)}


def empty_count(rows: Sequence[tuple[str, Mapping[str, Any]]]) -> int:
    """How many records' responses are blank (empty or whitespace)."""
    return sum(1 for _, raw in rows if is_empty(raw["response"]))
