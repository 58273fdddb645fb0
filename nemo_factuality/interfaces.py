"""One contract per role in the factuality pipeline (NeMo-RL style ``interfaces``).

Every stage is *batched*: LLM-backed implementations need the whole batch at once to keep many
judge calls in flight, and pure-code implementations lose nothing by looping. Implementations
register themselves under a short name in the registries of ``nemo_factuality.registry`` and
are chosen by config (``extractor: {name: rlfh, ...}``), never by if/elif over strings.

Data flow: ``Segmenter`` → ``ClaimExtractor`` → ``EvidenceProvider`` → ``Verifier`` → reward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from nemo_factuality.types import Claim, RewardBatch, Sentence, Verdict


@runtime_checkable
class Segmenter(Protocol):
    """Split a response into sentences with exact character spans (and think/answer segments)."""

    def split(self, response: str) -> list[Sentence]:
        """Return sentences whose ``span.slice(response) == sentence.text``."""
        ...


@runtime_checkable
class ClaimExtractor(Protocol):
    """Turn responses into atomic claims."""

    def extract_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        sentences: Sequence[Sequence[Sentence]],
    ) -> list[list[Claim]]:
        """Return one list of claims per response (an empty list when nothing is checkable)."""
        ...


@dataclass(frozen=True)
class EvidenceQuery:
    """What an evidence provider is asked: one claim in the context of its sample."""

    claim: Claim
    prompt: str = ""
    topic: str | None = None  # title scoping (FActScore / KnowRL style)
    materials: tuple[str, ...] = ()  # per-sample given evidence (FSPO ``knowledge``, RLFH materials)


@runtime_checkable
class EvidenceProvider(Protocol):
    """Find passages that bear on each claim."""

    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        """Return the evidence passages for each query (possibly empty), in query order."""
        ...


@dataclass(frozen=True)
class VerifyItem:
    """One claim to verify, with its evidence and the sample it came from."""

    claim: Claim
    evidence: tuple[str, ...] = ()
    prompt: str = ""
    response: str = ""
    topic: str | None = None


@runtime_checkable
class Verifier(Protocol):
    """Decide whether each claim is supported by its evidence (or by the verifier's own knowledge)."""

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        """Return one ``Verdict`` per item, in order, with ``claim_id == item.claim.id``.

        Failures (judge timeout, unparseable reply) give ``Label.UNPARSEABLE`` with ``error`` set;
        they are never silently mapped to a default label.
        """
        ...


@dataclass(frozen=True)
class ChatRequest:
    """One OpenAI-compatible chat completion request."""

    messages: tuple[Mapping[str, str], ...]
    model: str | None = None  # None = the client's default model
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    extra: Mapping[str, Any] = field(default_factory=dict)  # passed through to the endpoint


@dataclass(frozen=True)
class JudgeReply:
    """What came back for one request: text, or an error saying why not."""

    text: str | None
    error: str | None = None
    cached: bool = False
    latency_s: float = 0.0
    attempts: int = 1
    finish_reason: str | None = None  # "length" means the judge hit max_tokens
    logprobs: tuple[Mapping[str, Any], ...] | None = None  # chat logprobs ``content`` entries, when requested

    @property
    def ok(self) -> bool:
        return self.error is None and self.text is not None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@runtime_checkable
class JudgeClient(Protocol):
    """An LLM judge behind an OpenAI-compatible endpoint (vLLM in production)."""

    def complete_batch(self, requests: Sequence[ChatRequest]) -> list[JudgeReply]:
        """Run all requests concurrently (bounded), return replies in order; never raises per item."""
        ...


@runtime_checkable
class FactualityReward(Protocol):
    """The one batched reward call shape shared by every method, server client and adapter.

    ``columns`` are extra dataset columns by name (TRL style), each a sequence of length ``B``,
    e.g. ``ground_truth``, ``checklist``, ``knowledge``, ``topic``, ``completion_ids``.
    """

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        ...
