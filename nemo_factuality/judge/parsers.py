"""Judge-reply parsers: strict ones for training rewards, and per-tool compatibility modes for parity.

Strict parsers return ``Parsed(value, error)``; a reply they cannot read gives ``value=None`` and
an ``error`` naming the reply, so verifiers emit ``Label.UNPARSEABLE`` — never a silent default.

``parse_verdict_compat(tool, text)`` reproduces what each public tool makes of a raw reply,
quirks included (checked against every record of ``../shared/parity/verdict_parsing.json``):
FActScore's true/false rule, SAFE's bracket rules, VeriScore's first-sentence rule and
HalluLens' JSON rule.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_factuality.types import Label


def _bracket_contents(text: str) -> list[str]:
    """Contents of each ``[...]`` from left to right, as ``re.findall(r"\\[(.*?)\\]", text, re.DOTALL)``.

    Each match runs from the leftmost ``[`` to the next ``]`` (inner ``[`` kept). Done with
    ``str.find`` because that regex retries from every unclosed ``[`` (quadratic on "[[[[...").
    """
    out, pos = [], 0
    while (open_at := text.find("[", pos)) >= 0:
        close_at = text.find("]", open_at + 1)
        if close_at < 0:
            break  # no "]" left: no later "[" can close either
        out.append(text[open_at + 1 : close_at])
        pos = close_at + 1
    return out


def _first_bracket(text: str) -> str | None:
    """Content of the first ``[...]`` (as ``re.search`` with the pattern above), or None."""
    open_at = text.find("[")
    close_at = text.find("]", open_at + 1) if open_at >= 0 else -1
    return text[open_at + 1 : close_at] if close_at >= 0 else None


@dataclass(frozen=True)
class Parsed:
    value: Any
    error: str | None = None
    hedged: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def _fail(kind: str, text: str | None) -> Parsed:
    excerpt = (text or "")[:120]
    return Parsed(None, f"unparseable {kind} reply: {excerpt!r}")


# ----------------------------------------------------------------------------- strict parsers
_RLFH = re.compile(r"\b(hedged\s+correct|hedged\s+wrong|incorrect|correct|vague|wrong)\b", re.IGNORECASE)


def parse_rlfh_verify(text: str | None) -> Parsed:
    """RLFH verify reply → SUPPORTED (Correct) / NOT_ENOUGH_INFO (Vague) / NOT_SUPPORTED (Wrong), first mention wins."""
    m = _RLFH.search(text or "")
    if not m:
        return _fail("RLFH verify", text)
    word = " ".join(m.group(1).lower().split())
    label = {"correct": Label.SUPPORTED, "hedged correct": Label.SUPPORTED, "vague": Label.NOT_ENOUGH_INFO,
             "wrong": Label.NOT_SUPPORTED, "hedged wrong": Label.NOT_SUPPORTED, "incorrect": Label.NOT_SUPPORTED}[word]
    return Parsed(label, hedged=word.startswith("hedged"))


def parse_rlfh_assess(text: str | None) -> Parsed:
    """RLFH informativeness (1..5): the first standalone digit 1-5."""
    m = re.search(r"(?<!\d)([1-5])(?!\d)", text or "")
    return Parsed(int(m.group(1))) if m else _fail("RLFH assess", text)


def parse_safe_rating(text: str | None) -> Parsed:
    """SAFE rating: the last bracketed ``[Supported]`` / ``[Not Supported]`` (case/punctuation tolerant)."""
    for content in reversed(_bracket_contents(text or "")):
        norm = " ".join(re.sub(r"[^\w\s]", "", content).lower().split())
        if norm == "supported":
            return Parsed(Label.SUPPORTED)
        if norm in ("not supported", "unsupported"):
            return Parsed(Label.NOT_SUPPORTED)
    return _fail("SAFE rating", text)


def parse_safe_relevance(text: str | None, symbol: str = "Foo") -> Parsed:
    """SAFE relevance: ``[Foo]`` relevant / ``[Not Foo]`` irrelevant (last matching bracket)."""
    for content in reversed(_bracket_contents(text or "")):
        norm = " ".join(content.strip(" *.`").lower().split())
        if norm == symbol.lower():
            return Parsed(True)
        if norm == f"not {symbol.lower()}":
            return Parsed(False)
    return _fail("SAFE relevance", text)


def parse_true_false(text: str | None) -> Parsed:
    """A True/False (or Yes/No) verdict: the first such word decides."""
    m = re.search(r"\b(true|false|yes|no)\b", text or "", re.IGNORECASE)
    if not m:
        return _fail("true/false", text)
    return Parsed(m.group(1).lower() in ("true", "yes"))


def parse_covered(text: str | None) -> Parsed:
    """KLCF checklist coverage: covered / not covered (yes/no accepted)."""
    m = re.search(r"\b(not\s+covered|uncovered|covered|yes|no)\b", text or "", re.IGNORECASE)
    if not m:
        return _fail("coverage", text)
    return Parsed(" ".join(m.group(1).lower().split()) in ("covered", "yes"))


_TRUE_TOKENS, _FALSE_TOKENS = ("true", "yes"), ("false", "no")


def parse_p_true(logprobs: Any) -> Parsed:
    """p(True) from the first generated token's top logprobs (True/Yes mass over True/Yes + False/No mass).

    ``logprobs`` is the OpenAI ``choices[0].logprobs.content`` list: one object per generated token,
    ``{"token": str, "logprob": float, "top_logprobs": [{"token", "logprob"}, ...]}``. Never raises:

    * ``Parsed(p)`` with ``0 <= p <= 1`` when a top candidate of the first token is True/False/Yes/No;
    * ``Parsed(None)`` (no error) when there are no logprobs or no such candidate: nothing to read;
    * ``Parsed(None, error)`` when the logprobs are malformed (not a list of objects, a candidate
      without a string ``token`` or without a numeric ``logprob`` that is ≤ 0 and not NaN).
    """
    if logprobs is None or (isinstance(logprobs, (list, tuple)) and not logprobs):
        return Parsed(None)
    if not isinstance(logprobs, (list, tuple)) or not isinstance(logprobs[0], Mapping):
        return _bad_logprobs("expected a list of token objects", logprobs)
    first = logprobs[0]
    candidates = first.get("top_logprobs") or [first]
    if not isinstance(candidates, (list, tuple)):
        return _bad_logprobs("top_logprobs is not a list", candidates)
    mass = {True: 0.0, False: 0.0}
    for cand in candidates:
        token = cand.get("token") if isinstance(cand, Mapping) else None
        logprob = _as_logprob(cand.get("logprob")) if isinstance(cand, Mapping) else None
        if not isinstance(token, str) or logprob is None:
            return _bad_logprobs("a candidate needs a string 'token' and a numeric 'logprob' <= 0", cand)
        word = token.strip().lower()
        if word in _TRUE_TOKENS or word in _FALSE_TOKENS:
            mass[word in _TRUE_TOKENS] += math.exp(logprob)
    total = mass[True] + mass[False]
    return Parsed(mass[True] / total) if total > 0 else Parsed(None)


def _as_logprob(x: Any) -> float | None:
    """``x`` as a log-probability (a number <= 0, -inf allowed), or None if it is not one."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return None
    try:
        value = float(x)
    except OverflowError:  # an integer beyond float range
        value = -math.inf if x < 0 else math.inf
    # Tiny positive values are rounding noise of log(1); anything larger is not a log-probability.
    return min(value, 0.0) if value <= 1e-6 else None  # NaN fails the comparison too


def _bad_logprobs(why: str, value: Any) -> Parsed:
    return Parsed(None, f"unparseable logprobs ({why}): {_excerpt(value)}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _excerpt(value: Any) -> str:
    """A short repr that stays cheap on huge or deeply nested values."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an integer over Python's digit limit
        return f"<{type(value).__name__}>"


def p_true_from_logprobs(logprobs: Any) -> float | None:
    """p(True) as in ``parse_p_true``; None when absent, without a True/False candidate, or malformed. Never raises."""
    return parse_p_true(logprobs).value


SIMPLEQA_GRADES = {"A": "CORRECT", "B": "INCORRECT", "C": "NOT_ATTEMPTED"}


def parse_simpleqa_grade(text: str | None) -> Parsed:
    """SimpleQA-style grade: a letter A/B/C or the words CORRECT / INCORRECT / NOT_ATTEMPTED."""
    t = (text or "").strip()
    m = re.search(r"\b(NOT[_ ]ATTEMPTED|INCORRECT|CORRECT)\b", t, re.IGNORECASE)
    if m:
        return Parsed(m.group(1).upper().replace(" ", "_"))
    m = re.match(r"^\(?([ABC])\)?(?:\W|$)", t)
    return Parsed(SIMPLEQA_GRADES[m.group(1)]) if m else _fail("answer grade", text)


# ------------------------------------------------------------------------ compatibility modes
def _factscore_compat(text: str) -> dict[str, Any]:
    answer = text.lower()
    if "true" in answer or "false" in answer:
        if "true" in answer and "false" not in answer:
            return {"is_supported": True}
        if "false" in answer and "true" not in answer:
            return {"is_supported": False}
        return {"is_supported": answer.index("true") > answer.index("false")}
    words = answer.translate(str.maketrans("", "", string.punctuation)).split()
    return {"is_supported": all(w not in ("not", "cannot", "unknown", "information") for w in words)}


def _safe_rating_compat(text: str) -> dict[str, Any]:
    content = _first_bracket(text) or ""
    cleaned = re.sub(r"[^\w\s]", "", content).strip()
    answer = cleaned if cleaned in ("Supported", "Not Supported") else None
    return {"bracket_content": content, "answer": answer, "counted_as": answer or "dropped"}


def _safe_relevance_compat(text: str, max_retries: int = 10) -> dict[str, Any]:
    content = _first_bracket(text) or ""
    if content in ("Foo", "Not Foo"):
        return {"bracket_content": content, "is_relevant": content == "Foo", "model_calls": 1}
    # SAFE re-asks the same question max_retries times, then assumes the fact is relevant.
    return {"bracket_content": content, "is_relevant": True, "model_calls": max_retries + 1}


def _veriscore_compat(text: str | None) -> dict[str, Any]:
    if text is None:
        return {"verification_result": None, "counted_supported": False}
    result = text.replace("#", "").split(".")[0].lower()
    return {"verification_result": result, "counted_supported": result == "supported"}


def _hallulens_compat(text: str) -> dict[str, Any]:
    lowered = text.lower()
    if '{"is_supported":false}' in lowered:
        parsed: Any = {"is_supported": False}
    elif '{"is_supported":true}' in lowered:
        parsed = {"is_supported": True}
    else:
        try:
            parsed = json.loads(text.split("\n")[0])
        except json.JSONDecodeError:
            return {"raises": "AttributeError", "meaning": "unparseable: HalluLens would re-query the LLM"}
        except (RecursionError, ValueError) as err:  # nested too deep; an integer over Python's digit limit
            return {"raises": type(err).__name__, "meaning": "unparseable: json.loads cannot read this reply"}
    out: dict[str, Any] = {"raises": None, "parsed": parsed}
    if isinstance(parsed, dict) and "is_supported" in parsed:
        out["is_supported"] = parsed["is_supported"]
    else:
        out["is_supported_lookup_error"] = "parsed value has no 'is_supported' key (facthalu.py would raise)"
    return out


_COMPAT = {
    "factscore": _factscore_compat,
    "safe_rating": _safe_rating_compat,
    "safe_relevance": _safe_relevance_compat,
    "veriscore": _veriscore_compat,
    "hallulens": _hallulens_compat,
}


def parse_verdict_compat(tool: str, text: str | None) -> dict[str, Any]:
    """What ``tool`` (factscore, safe_rating, safe_relevance, veriscore, hallulens) makes of ``text``."""
    try:
        fn = _COMPAT[tool]
    except KeyError:
        raise ValueError(f"unknown tool {tool!r}; choose one of {sorted(_COMPAT)}") from None
    if text is None and tool != "veriscore":
        raise ValueError(f"{tool}: text is None (only VeriScore models a None LLM reply)")
    return fn(text)


def compat_label(tool: str, text: str | None) -> Label:
    """The label a tool's compatibility mode assigns (for running our pipeline in that tool's mode)."""
    out = parse_verdict_compat(tool, text)
    if tool == "factscore":
        return Label.SUPPORTED if out["is_supported"] else Label.NOT_SUPPORTED
    if tool == "safe_rating":
        return {"Supported": Label.SUPPORTED, "Not Supported": Label.NOT_SUPPORTED}.get(out["answer"], Label.UNPARSEABLE)
    if tool == "veriscore":
        return Label.SUPPORTED if out["counted_supported"] else Label.NOT_SUPPORTED
    if tool == "hallulens":
        value = out.get("is_supported")
        return Label.SUPPORTED if value is True else Label.NOT_SUPPORTED if value is False else Label.UNPARSEABLE
    return Label.IRRELEVANT if not out["is_relevant"] else Label.SUPPORTED
