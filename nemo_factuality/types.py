"""Core data types shared by every layer: text → claims → evidence → verdicts → rewards.

Everything here is plain data (dataclasses and enums) with validation in ``__post_init__``,
so a malformed object fails where it is built, with a message naming the field, rather than
three layers later inside a trainer.

Character offsets are always half-open ``[start, end)`` indices into the exact *response*
string the reward was asked about (never into a re-decoded or stripped copy), which is what
makes token alignment exact (see ``nemo_factuality.text.alignment``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from nemo_factuality import exit_codes

SegmentName = Literal["think", "answer", "response"]
SEGMENT_NAMES: tuple[str, ...] = ("think", "answer", "response")


class FactualityInputError(ValueError):
    """Bad input to a reward, metric or pipeline stage.

    The message always names the sample index and/or field that was wrong and what to change.
    """


class ServerUnavailableError(RuntimeError):
    """A server (reward, critic) stayed unreachable past its retry window.

    A temporary failure, not a bug or bad input: a rerun once the server is back may succeed. The command
    boundary (``nemo_factuality.cli``) prints it as one line and exits ``exit_code`` (75, sysexits'
    ``EX_TEMPFAIL``), which a launcher reads as "requeue".
    """

    EXIT_CODE = exit_codes.TEMPFAIL
    exit_code = EXIT_CODE  # the attribute the command boundary reads from any error that stops a run


@dataclass(frozen=True)
class Span:
    """Half-open character span ``[start, end)`` into the response text."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.end, int)):
            raise FactualityInputError(f"Span offsets must be ints, got start={self.start!r}, end={self.end!r}")
        if self.start < 0 or self.end < self.start:
            raise FactualityInputError(f"Span must satisfy 0 <= start <= end, got [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def slice(self, text: str) -> str:
        """Return ``text[start:end]``; raises if the span does not fit inside ``text``."""
        if self.end > len(text):
            raise FactualityInputError(f"Span [{self.start}, {self.end}) exceeds text length {len(text)}")
        return text[self.start : self.end]

    def shift(self, offset: int) -> Span:
        return Span(self.start + offset, self.end + offset)


@dataclass(frozen=True)
class Sentence:
    """One sentence of a response, with its exact character span and the section it sits in."""

    id: int
    text: str
    span: Span
    segment: SegmentName = "response"

    def __post_init__(self) -> None:
        if self.segment not in SEGMENT_NAMES:
            raise FactualityInputError(f"Sentence.segment must be one of {SEGMENT_NAMES}, got {self.segment!r}")


@dataclass(frozen=True)
class Claim:
    """An atomic, checkable statement extracted from a response.

    ``span`` is the best-effort alignment of the claim in the response (``None`` when the
    extractor paraphrased it beyond alignment); ``sentence_id`` names the owning sentence.
    """

    id: int
    text: str
    sentence_id: int | None = None
    span: Span | None = None
    self_contained: str | None = None  # SAFE's revised, decontextualised form

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise FactualityInputError(f"Claim {self.id} has empty text; extractors must drop empty claims")


class Label(str, enum.Enum):
    """Verification outcome of one claim.

    ``UNPARSEABLE`` is explicit: a judge reply that could not be read is never silently
    turned into a default label. Reward code decides (by config) how to treat it.
    """

    SUPPORTED = "supported"
    NOT_SUPPORTED = "not_supported"  # refuted / contradicted / wrong
    IRRELEVANT = "irrelevant"
    NOT_ENOUGH_INFO = "not_enough_info"  # vague / inconclusive
    UNPARSEABLE = "unparseable"

    @classmethod
    def parse(cls, value: str | Label) -> Label:
        """Parse a canonical label name; unknown names raise with the accepted set."""
        if isinstance(value, Label):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise FactualityInputError(f"Unknown label {value!r}; expected one of: {allowed}") from None


@dataclass(frozen=True)
class Verdict:
    """The verifier's decision about one claim."""

    claim_id: int
    label: Label
    score: float | None = None  # p(supported) for NLI / trained verifiers
    evidence: tuple[str, ...] = ()
    raw: str | None = None  # the judge's raw text, kept for logging and audits
    hedged: bool = False  # RLFH "Hedged correct / Hedged wrong"
    informativeness: int | None = None  # RLFH 1..5
    error: str | None = None  # why the label is UNPARSEABLE (timeout, garbage, ...)

    def __post_init__(self) -> None:
        if not isinstance(self.label, Label):
            object.__setattr__(self, "label", Label.parse(self.label))
        if self.score is not None and not (0.0 <= float(self.score) <= 1.0):
            raise FactualityInputError(f"Verdict for claim {self.claim_id}: score must be in [0, 1], got {self.score}")
        if self.informativeness is not None and self.informativeness not in (1, 2, 3, 4, 5):
            raise FactualityInputError(
                f"Verdict for claim {self.claim_id}: informativeness must be 1..5, got {self.informativeness}"
            )

    @property
    def supported(self) -> bool:
        return self.label is Label.SUPPORTED

    @property
    def judge_failed(self) -> bool:
        """The judge never answered (outage, timeout, refused request): no reply text, only an error."""
        return self.label is Label.UNPARSEABLE and self.raw is None and self.error is not None


class ClaimsFailed(list):
    """An empty claim list that says why extraction failed (judge down, reply unreadable after retries).

    Extractors return it in place of ``[]`` so the pipeline can tell "no claims" from "no answer":
    the sample's ``FactCheck.error`` is set and every reward scores it NaN.
    """

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


@dataclass
class FactCheck:
    """Everything the pipeline found out about one response (the unit rewards are built from)."""

    response: str
    sentences: list[Sentence] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    abstained: bool = False
    # Why this response could not be fact-checked (extraction or verification failed). A failed
    # check is never a score: rewards give NaN with this reason in ``details[i]["error"]``.
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def counts(self) -> dict[str, int]:
        """Number of verdicts per label value (every label present, zeros included)."""
        out = {label.value: 0 for label in Label}
        for verdict in self.verdicts:
            out[verdict.label.value] += 1
        return out


@dataclass
class RewardBatch:
    """Result of one batched reward call ``reward(prompts, completions, **columns)``.

    Shapes (``B`` = batch size, ``T_i`` = number of response tokens of sample ``i``):

    * ``scores``: float64 ``[B]``; ``NaN`` means abstain / not applicable for that sample.
    * ``components``: name → float64 ``[B]`` (the parts the score was built from, for logging).
    * ``token_rewards``: optional list of ``B`` float32 arrays, ``[T_i]`` each (RLFH dense rewards).
    * ``token_signs``: optional list of ``B`` int8 arrays in {-1, 0, +1}, ``[T_i]`` (FSPO flip mask).
    * ``sentence_labels``: optional list of ``B`` lists of bools, one per sentence (FactAlign fKTO).
    * ``sentence_spans``: optional list of ``B`` lists of ``Span`` (the sentences those labels are about).
    * ``details``: optional list of ``B`` JSON-serialisable dicts (claims, verdicts, errors) for logs.
    """

    scores: np.ndarray
    components: dict[str, np.ndarray] = field(default_factory=dict)
    token_rewards: list[np.ndarray] | None = None
    token_signs: list[np.ndarray] | None = None
    sentence_labels: list[list[bool]] | None = None
    sentence_spans: list[list[Span]] | None = None
    details: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
        batch = self.scores.shape[0]
        for name, values in list(self.components.items()):
            arr = np.asarray(values, dtype=np.float64).reshape(-1)
            if arr.shape[0] != batch:
                raise FactualityInputError(f"RewardBatch component {name!r} has {arr.shape[0]} values, expected {batch}")
            self.components[name] = arr
        for attr in ("token_rewards", "token_signs", "sentence_labels", "sentence_spans", "details"):
            value = getattr(self, attr)
            if value is not None and len(value) != batch:
                raise FactualityInputError(f"RewardBatch.{attr} has {len(value)} entries, expected {batch}")
        if self.token_rewards is not None:
            self.token_rewards = [np.asarray(t, dtype=np.float32).reshape(-1) for t in self.token_rewards]
        if self.token_signs is not None:
            signs = [np.asarray(t, dtype=np.int8).reshape(-1) for t in self.token_signs]
            for i, s in enumerate(signs):
                if s.size and not np.isin(s, (-1, 0, 1)).all():
                    raise FactualityInputError(f"RewardBatch.token_signs[{i}] must be in {{-1, 0, +1}}")
            self.token_signs = signs
        if self.token_rewards is not None and self.token_signs is not None:
            for i, (r, s) in enumerate(zip(self.token_rewards, self.token_signs, strict=False)):
                if r.shape != s.shape:
                    raise FactualityInputError(
                        f"RewardBatch sample {i}: token_rewards has {r.shape[0]} tokens but token_signs has {s.shape[0]}"
                    )

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def to_list(self) -> list[float | None]:
        """TRL-style ``list[float | None]`` (``None`` where the score is NaN)."""
        return [None if math.isnan(x) else float(x) for x in self.scores]

    def sample_dict(self, i: int) -> dict[str, Any]:
        """verl-style dict for sample ``i``: ``{"score": ..., **components}``."""
        out: dict[str, Any] = {"score": float(self.scores[i])}
        out.update({k: float(v[i]) for k, v in self.components.items()})
        return out

    @staticmethod
    def concat(batches: Sequence[RewardBatch]) -> RewardBatch:
        """Concatenate batches along the sample axis (components must have the same names)."""
        if not batches:
            raise FactualityInputError("RewardBatch.concat needs at least one batch")
        names = set(batches[0].components)
        for b in batches[1:]:
            if set(b.components) != names:
                raise FactualityInputError(f"RewardBatch.concat: component names differ: {sorted(names)} vs {sorted(b.components)}")

        def _join(attr: str) -> list | None:
            parts = [getattr(b, attr) for b in batches]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise FactualityInputError(f"RewardBatch.concat: {attr} is set on some batches but not all")
            return [x for p in parts for x in p]

        return RewardBatch(
            scores=np.concatenate([b.scores for b in batches]),
            components={k: np.concatenate([b.components[k] for b in batches]) for k in sorted(names)},
            token_rewards=_join("token_rewards"),
            token_signs=_join("token_signs"),
            sentence_labels=_join("sentence_labels"),
            sentence_spans=_join("sentence_spans"),
            details=_join("details"),
        )

    def take(self, indices: Sequence[int]) -> RewardBatch:
        """The samples at ``indices``, in that order (every per-sample field; a reordering or a subset)."""
        idx = [int(i) for i in indices]

        def _pick(values: list | None) -> list | None:
            return None if values is None else [values[i] for i in idx]

        return RewardBatch(scores=self.scores[idx], components={k: v[idx] for k, v in self.components.items()},
                           token_rewards=_pick(self.token_rewards), token_signs=_pick(self.token_signs),
                           sentence_labels=_pick(self.sentence_labels), sentence_spans=_pick(self.sentence_spans),
                           details=_pick(self.details))

    def log_dict(self, prefix: str = "reward") -> dict[str, float]:
        """Mean of the score and every component over non-NaN samples, keyed ``prefix/name``."""
        out = {f"{prefix}/score": _nanmean(self.scores), f"{prefix}/abstain_frac": float(np.isnan(self.scores).mean())}
        for name, values in self.components.items():
            out[f"{prefix}/{name}"] = _nanmean(values)
        return out


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else float("nan")


def check_batch_columns(n: int, columns: Mapping[str, Sequence[Any] | None], *, who: str) -> None:
    """Raise ``FactualityInputError`` if any provided column does not have ``n`` entries."""
    for name, values in columns.items():
        if values is None:
            continue
        if len(values) != n:
            raise FactualityInputError(f"{who}: column {name!r} has {len(values)} entries but there are {n} completions")
