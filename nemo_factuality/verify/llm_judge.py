"""LLM-judge verifiers: claim verification, RLFH informativeness, KLCF checklist coverage, answer grading.

All of them send the whole batch through ``JudgeClient.complete_batch`` (bounded concurrency) and
turn failed or unreadable replies into explicit errors (``Label.UNPARSEABLE`` / ``None`` + reason).
Prompts are rendered by ``judge.guard.judge_request``: claims, responses and predicted answers are
untrusted (neutralised), questions, gold answers, checklist items and evidence are dataset text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from nemo_factuality.interfaces import ChatRequest, JudgeClient, JudgeReply, VerifyItem
from nemo_factuality.judge import parsers
from nemo_factuality.judge.guard import judge_request
from nemo_factuality.registry import VERIFIERS
from nemo_factuality.types import FactualityInputError, Label, Verdict

log = logging.getLogger(__name__)

_PROMPTS = {
    "rlfh": """Judge the statement against the materials. Choose from "Correct", "Vague" and "Wrong": \
"Correct" if the materials support it, "Wrong" if the materials contradict it, "Vague" if they do not let you decide.

Materials:
{evidence}

Question: {prompt}
Statement: {claim}
Answer with one word.""",
    "safe": """Decide whether the knowledge below supports the statement. Think step by step, then give the final \
answer as [Supported] or [Not Supported].

Knowledge:
{evidence}

Statement: {claim}""",
    "factscore": """Answer the question about {topic} based on the given context.

{evidence}

Input: {claim} True or False?
Output:""",
    "truthfulness": """Is the following claim true? Answer True or False.

Question: {prompt}
Claim: {claim}""",
}

_PARSERS: dict[str, Callable[[str | None], parsers.Parsed]] = {
    "rlfh": parsers.parse_rlfh_verify,
    "safe": parsers.parse_safe_rating,
    "factscore": parsers.parse_true_false,
    "truthfulness": parsers.parse_true_false,
}


def _format_evidence(evidence: Sequence[str]) -> str:
    return "\n".join(f"- {e}" for e in evidence) if evidence else "(no materials)"


@VERIFIERS.register("llm_judge")
class LLMJudgeVerifier:
    """Verify claims with an LLM judge in one method's prompt style.

    Args:
        client: the judge client.
        style: ``rlfh`` (Correct/Vague/Wrong), ``safe`` ([Supported]/[Not Supported]), ``factscore``
            (True/False), ``truthfulness`` (KLCF: True/False with p(true) from logprobs when the server
            returns them).
        temperature, top_p, max_tokens: sampling for the judge (RLFH: 0.3 / 0.3 / 32).
    """

    def __init__(self, client: JudgeClient, style: str = "safe", temperature: float = 0.0, top_p: float = 1.0,
                 max_tokens: int = 256) -> None:
        if style not in _PROMPTS:
            raise FactualityInputError(f"llm_judge verifier: unknown style {style!r}; choose one of {sorted(_PROMPTS)}")
        self.client, self.style = client, style
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.stats = {"claims_verified": 0, "judge_errors": 0, "unparseable": 0}

    def health(self) -> dict[str, str | None]:
        fn = getattr(self.client, "health", None)
        return fn() if callable(fn) else {}

    def _request(self, item: VerifyItem) -> ChatRequest:
        extra = {"logprobs": True, "top_logprobs": 5} if self.style == "truthfulness" else {}
        return judge_request(_PROMPTS[self.style], untrusted={"claim": item.claim.text},
                             trusted={"evidence": _format_evidence(item.evidence), "prompt": item.prompt,
                                      "topic": item.topic or "the subject"},
                             temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens, extra=extra)

    def _verdict(self, item: VerifyItem, reply: JudgeReply) -> Verdict:
        cid = item.claim.id
        if not reply.ok:
            self.stats["judge_errors"] += 1
            return Verdict(cid, Label.UNPARSEABLE, evidence=item.evidence, error=reply.error)
        parsed = _PARSERS[self.style](reply.text)
        if not parsed.ok:
            self.stats["unparseable"] += 1
            return Verdict(cid, Label.UNPARSEABLE, evidence=item.evidence, raw=reply.text, error=parsed.error)
        value = parsed.value
        if isinstance(value, bool):
            label = Label.SUPPORTED if value else Label.NOT_SUPPORTED
        else:
            label = value
        score = None
        if self.style == "truthfulness":
            p_true = parsers.parse_p_true(reply.logprobs)
            if p_true.error:  # malformed logprobs: an unreadable verdict, never a made-up probability
                self.stats["unparseable"] += 1
                return Verdict(cid, Label.UNPARSEABLE, evidence=item.evidence, raw=reply.text, error=p_true.error)
            score = p_true.value
        if score is None:
            score = 1.0 if label is Label.SUPPORTED else 0.0
        return Verdict(cid, label, score=score, evidence=item.evidence, raw=reply.text, hedged=parsed.hedged)

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        replies = self.client.complete_batch([self._request(i) for i in items])
        self.stats["claims_verified"] += len(items)
        return [self._verdict(i, r) for i, r in zip(items, replies)]


ASSESS_PROMPT = """Evaluate how helpful the statement is for answering the question, on a scale of 1 to 5:
5 answers the question; 4 gives crucial information; 3 gives relevant facts; 2 gives supplementary facts;
1 is useless or irrelevant. Reply with the number only.

Question: {prompt}
Response: {response}
Statement: {claim}"""


class InfoScore(NamedTuple):
    """Informativeness of one statement: ``value`` 1..5, or None with ``error``; ``answered`` is False
    when the judge never replied (an outage), True when it replied (possibly unreadably)."""

    value: int | None
    error: str | None
    answered: bool = True


class InformativenessScorer:
    """RLFH's assess task: informativeness 1..5 per statement (``None`` + error when failed or unreadable)."""

    def __init__(self, client: JudgeClient, temperature: float = 0.3, top_p: float = 0.3, max_tokens: int = 48) -> None:
        self.client, self.temperature, self.top_p, self.max_tokens = client, temperature, top_p, max_tokens

    def score_batch(self, items: Sequence[VerifyItem]) -> list[InfoScore]:
        reqs = [judge_request(ASSESS_PROMPT, untrusted={"response": i.response, "claim": i.claim.text},
                              trusted={"prompt": i.prompt}, temperature=self.temperature, top_p=self.top_p,
                              max_tokens=self.max_tokens) for i in items]
        out = []
        for reply in self.client.complete_batch(reqs):
            parsed = parsers.parse_rlfh_assess(reply.text) if reply.ok else parsers.Parsed(None, reply.error)
            out.append(InfoScore(parsed.value, parsed.error, reply.ok))
        return out


COVERAGE_PROMPT = """Does the response state the following fact (possibly in other words)? \
Answer "Covered" or "Not covered".

Fact: {item}
Response: {response}"""


class CoverageJudge:
    """KLCF's checklist verifier: is each checklist item covered by the response?"""

    def __init__(self, client: JudgeClient, max_tokens: int = 16) -> None:
        self.client, self.max_tokens = client, max_tokens
        self.errors = 0

    def health(self) -> dict[str, str | None]:
        fn = getattr(self.client, "health", None)
        return fn() if callable(fn) else {}

    def covered_batch(self, responses: Sequence[str], items: Sequence[str]) -> list[bool | None]:
        """Covered or not per (response, item); ``None`` when the reply failed or could not be read."""
        return [covered for covered, _ in self.check_batch(responses, items)]

    def check_batch(self, responses: Sequence[str], items: Sequence[str]) -> list[tuple[bool | None, str | None]]:
        """``(covered, None)`` per (response, item), or ``(None, why)`` — never a silent "not covered"."""
        if len(responses) != len(items):
            raise FactualityInputError(f"coverage judge: {len(responses)} responses but {len(items)} checklist items")
        reqs = [judge_request(COVERAGE_PROMPT, untrusted={"response": r}, trusted={"item": it}, max_tokens=self.max_tokens)
                for r, it in zip(responses, items)]
        out: list[tuple[bool | None, str | None]] = []
        for reply in self.client.complete_batch(reqs):
            parsed = parsers.parse_covered(reply.text) if reply.ok else parsers.Parsed(None, reply.error)
            if not parsed.ok:
                self.errors += 1
                log.warning("coverage judge: %s", parsed.error)
            out.append((parsed.value, None if parsed.ok else f"coverage judge: {parsed.error}"))
        return out


GRADER_PROMPT = """Grade the predicted answer against the gold answer. Reply with one letter:
A) CORRECT — it contains the gold answer without contradicting it;
B) INCORRECT — it contradicts or misses the gold answer;
C) NOT_ATTEMPTED — it declines to answer (e.g. "I don't know").

Question: {question}
Gold answer: {gold}
Predicted answer: {pred}"""


class AnswerGrader:
    """SimpleQA-style grading (KnowRL correctness): CORRECT / INCORRECT / NOT_ATTEMPTED, or ``None`` + error."""

    def __init__(self, client: JudgeClient, max_tokens: int = 8) -> None:
        self.client, self.max_tokens = client, max_tokens

    def health(self) -> dict[str, str | None]:
        fn = getattr(self.client, "health", None)
        return fn() if callable(fn) else {}

    def grade_batch(self, questions: Sequence[str], golds: Sequence[str], preds: Sequence[str]) -> list[tuple[str | None, str | None]]:
        reqs = [judge_request(GRADER_PROMPT, untrusted={"pred": p}, trusted={"question": q, "gold": g}, max_tokens=self.max_tokens)
                for q, g, p in zip(questions, golds, preds)]
        out = []
        for reply in self.client.complete_batch(reqs):
            parsed = parsers.parse_simpleqa_grade(reply.text) if reply.ok else parsers.Parsed(None, reply.error)
            out.append((parsed.value, parsed.error))
        return out
