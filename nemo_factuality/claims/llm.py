"""LLM claim extractors in the prompt styles of RLFH, FActScore/KnowRL, SAFE and KLCF.

Prompts are our own wording of each method's published structure. Every reply goes through a
pure parser; a reply that cannot be parsed is retried (RLFH raises the temperature each time)
and, if it still fails (or the judge never answered), the sample gets ``ClaimsFailed(error)`` — an
empty list that carries the reason, so "the judge is down" is never mistaken for "no claims". The
failure is also counted in ``stats["parse_failures"]``. Every prompt is rendered by
``judge.guard.judge_request`` (the response and its sentences are untrusted text).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from nemo_factuality.interfaces import ChatRequest, JudgeClient
from nemo_factuality.judge.guard import judge_request
from nemo_factuality.registry import EXTRACTORS
from nemo_factuality.types import Claim, ClaimsFailed, Sentence, Span

log = logging.getLogger(__name__)

RLFH_PROMPT = """Below is a question and a response. Find every sentence of the response that states objective facts, \
and break each such sentence into atomic statements (one fact each, understandable on its own). Skip sentences \
without factual statements. If no sentence states a fact, output "No statements".

Format:
>> Sentence 1: <the sentence, copied exactly>
* <atomic statement>
* <atomic statement>
>> Sentence 2: ...

Question: {prompt}
Response: {response}"""

FACTSCORE_PROMPT = """Break the following passage into independent atomic facts. Write one fact per line, each \
starting with "- ". Each fact must be a short, self-contained statement. If the passage states no facts, write \
"- NON_FACTUAL".

Passage: {response}"""

SAFE_PROMPT = """Instructions: break the sentence below into a list of atomic facts, one per line, each starting \
with "- ". Resolve pronouns using the context so each fact stands alone.

Context: {response}
Sentence: {sentence}"""

KLCF_PROMPT = """Extract every verifiable factual claim from the response to the question. Output one claim per \
line, each starting with "- ". Output nothing else.

Question: {prompt}
Response: {response}"""

_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+(.*\S)\s*$")
_RLFH_SENT = re.compile(r"^\s*>>\s*Sentence\s*\d+\s*:\s*(.*?)\s*$", re.IGNORECASE)


class ExtractionParseError(ValueError):
    """An extractor reply did not have the expected shape."""


def parse_bullets(text: str, *, sentinel: str | None = None) -> list[str]:
    """Lines starting with ``-``, ``*``, ``•`` or ``1.``; ``sentinel`` (e.g. NON_FACTUAL) means none.

    Raises ``ExtractionParseError`` if the reply has content but no bullet lines.
    """
    items = []
    for line in text.splitlines():
        m = _BULLET.match(line)
        if m and m.group(1).strip("*` ").strip():
            items.append(m.group(1).strip("*` ").strip())
    if sentinel is not None:
        items = [i for i in items if sentinel.lower() not in i.lower()]
        if not items and sentinel.lower() in text.lower():
            return []
    if not items and text.strip():
        raise ExtractionParseError(f"no bullet lines in reply: {text[:120]!r}")
    return items


def parse_rlfh(text: str) -> dict[str, list[str]]:
    """RLFH's ``>> Sentence k: ...`` blocks followed by ``* statement`` lines → {sentence: [statements]}."""
    if text.strip().lower().startswith("no statements"):
        return {}
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = _RLFH_SENT.match(line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
            continue
        b = _BULLET.match(line)
        if b and current is not None and not re.match(r"^\s*\d", line):
            out[current].append(b.group(1).strip())
    if not out:
        raise ExtractionParseError(f"no '>> Sentence k:' blocks in reply: {text[:120]!r}")
    return out


def _locate(text: str, response: str, sentences: Sequence[Sentence]) -> tuple[int | None, Span | None]:
    """(sentence id, span) of a claim that appears verbatim in the response; (None, None) otherwise."""
    needle = text.rstrip(".").strip()
    pos = response.find(needle) if needle else -1
    if pos < 0:
        return None, None
    span = Span(pos, pos + len(needle))
    owner = next((s.id for s in sentences if s.span.start <= pos < s.span.end), None)
    return owner, span


def _owner_of_sentence(sentence_text: str, sentences: Sequence[Sentence], min_ratio: float = 80.0) -> Sentence | None:
    """The response sentence an extractor echoed, by normalised edit similarity (RLFH's echo may change a comma).

    Cost: one ``fuzz.ratio`` per sentence (rapidfuzz, C), so linear in the response per echo.
    """
    from rapidfuzz import fuzz, process

    norm = " ".join(sentence_text.split()).rstrip(".").lower()
    if not norm or not sentences:
        return None
    choices = [" ".join(s.text.split()).rstrip(".").lower() for s in sentences]
    best = process.extractOne(norm, choices, scorer=fuzz.ratio, score_cutoff=min_ratio)
    return sentences[best[2]] if best is not None else None


def lcs_span(statement: str, sentence: Sentence) -> Span | None:
    """Where a statement sits in its sentence (methods.md §2.4): LCS of the statement (trailing '.' stripped)
    against the sentence; the span runs from the first to the last matched sentence character."""
    from rapidfuzz.distance import LCSseq

    needle = statement.strip().rstrip(".")
    blocks = [b for b in LCSseq.editops(needle, sentence.text).as_matching_blocks() if b.size > 0]
    if not needle or not blocks:
        return None
    return Span(sentence.span.start + blocks[0].b, sentence.span.start + blocks[-1].b + blocks[-1].size)


class _LLMExtractor:
    """Shared batching and retry logic; subclasses build prompts and parse replies."""

    style = "base"

    def __init__(self, client: JudgeClient, *, temperature: float = 0.0, max_tokens: int = 2048, retries: int = 2) -> None:
        self.client, self.temperature, self.max_tokens, self.retries = client, temperature, max_tokens, retries
        self.stats = {"parse_failures": 0, "requests": 0}

    def _requests(self, prompt: str, response: str, sentences: Sequence[Sentence], temperature: float) -> list[ChatRequest]:
        raise NotImplementedError

    def _claims(self, replies: list[str], response: str, sentences: Sequence[Sentence]) -> list[Claim]:
        raise NotImplementedError

    def extract_batch(self, prompts: Sequence[str], responses: Sequence[str],
                      sentences: Sequence[Sequence[Sentence]]) -> list[list[Claim]]:
        results: list[list[Claim] | None] = [None] * len(responses)
        last_error: dict[int, str] = {}
        pending = [i for i, r in enumerate(responses) if r.strip()]
        for i in range(len(responses)):
            if i not in pending:
                results[i] = []
        for attempt in range(self.retries + 1):
            if not pending:
                break
            temperature = self.temperature + attempt / max(self.retries, 1)  # RLFH: hotter on each retry
            per_sample = [self._requests(prompts[i], responses[i], sentences[i], temperature) for i in pending]
            flat = [r for reqs in per_sample for r in reqs]
            self.stats["requests"] += len(flat)
            replies = self.client.complete_batch(flat)
            cursor, still = 0, []
            for i, reqs in zip(pending, per_sample):
                chunk = replies[cursor : cursor + len(reqs)]
                cursor += len(reqs)
                errors = [r.error for r in chunk if not r.ok]
                try:
                    if errors:
                        raise ExtractionParseError(errors[0])
                    results[i] = self._claims([r.text or "" for r in chunk], responses[i], sentences[i])
                except ExtractionParseError as err:
                    last_error[i] = str(err)
                    log.warning("%s extraction failed for sample %d (attempt %d): %s", self.style, i, attempt + 1, err)
                    still.append(i)
            pending = still
        for i in pending:
            self.stats["parse_failures"] += 1
            results[i] = ClaimsFailed(f"{self.style} claim extraction failed after {self.retries + 1} attempt(s): "
                                      f"{last_error.get(i, 'no reply')}")
        return [r if r is not None else [] for r in results]

    def health(self) -> dict[str, str | None]:
        fn = getattr(self.client, "health", None)
        return fn() if callable(fn) else {}


@EXTRACTORS.register("rlfh")
class RLFHExtractor(_LLMExtractor):
    """One request per response; statements keep their owning sentence (RLFH token placement needs it)."""

    style = "rlfh"

    def __init__(self, client: JudgeClient, *, temperature: float = 1.0, max_tokens: int = 4096, retries: int = 3) -> None:
        super().__init__(client, temperature=temperature, max_tokens=max_tokens, retries=retries)

    def _requests(self, prompt, response, sentences, temperature):
        return [judge_request(RLFH_PROMPT, untrusted={"response": response}, trusted={"prompt": prompt},
                              temperature=min(temperature, 2.0), top_p=1.0, max_tokens=self.max_tokens)]

    def _claims(self, replies, response, sentences):
        claims: list[Claim] = []
        for sent_text, statements in parse_rlfh(replies[0]).items():
            owner = _owner_of_sentence(sent_text, sentences)
            for st in statements:
                if owner is not None:  # the statement's last matched character in its sentence (spec §2.4)
                    claims.append(Claim(len(claims), st, owner.id, lcs_span(st, owner)))
                else:
                    sid, span = _locate(st, response, sentences)
                    claims.append(Claim(len(claims), st, sid, span))
        return claims


@EXTRACTORS.register("factscore")
class FactScoreExtractor(_LLMExtractor):
    """FActScore/KnowRL: one request per response (the passage), ``- fact`` lines, NON_FACTUAL sentinel."""

    style = "factscore"

    def _requests(self, prompt, response, sentences, temperature):
        return [judge_request(FACTSCORE_PROMPT, untrusted={"response": response}, temperature=temperature,
                              max_tokens=self.max_tokens)]

    def _claims(self, replies, response, sentences):
        out = []
        for text in parse_bullets(replies[0], sentinel="NON_FACTUAL"):
            sid, span = _locate(text, response, sentences)
            out.append(Claim(len(out), text, sid, span))
        return out


@EXTRACTORS.register("safe")
class SAFEExtractor(_LLMExtractor):
    """SAFE: one request per sentence (with the response as context); facts keep their sentence id."""

    style = "safe"

    def _requests(self, prompt, response, sentences, temperature):
        return [judge_request(SAFE_PROMPT, untrusted={"response": response, "sentence": s.text}, temperature=temperature,
                              max_tokens=self.max_tokens) for s in sentences]

    def _claims(self, replies, response, sentences):
        out = []
        for sent, reply in zip(sentences, replies):
            for text in parse_bullets(reply):
                _, span = _locate(text, response, sentences)
                out.append(Claim(len(out), text, sent.id, span))
        return out


@EXTRACTORS.register("klcf")
class KLCFExtractor(FactScoreExtractor):
    """KLCF's claim extractor served by vLLM: question + response in, one claim per line out."""

    style = "klcf"

    def _requests(self, prompt, response, sentences, temperature):
        return [judge_request(KLCF_PROMPT, untrusted={"response": response}, trusted={"prompt": prompt},
                              temperature=temperature, max_tokens=self.max_tokens)]
