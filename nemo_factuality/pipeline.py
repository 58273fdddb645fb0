"""The fact-checking pipeline: segment → extract claims → find evidence → verify, batched.

Parts are chosen by registry name from config::

    pipeline:
      segmenter: {name: regex}
      extractor: {name: rlfh}            # LLM extractors get the judge client
      evidence:  {name: kb, store_path: kb.sqlite, k: 5}
      verifier:  {name: llm_judge, style: safe}
      judge: {base_url: http://judge:8000/v1, model: Qwen2.5-72B-Instruct, concurrency: 64, timeout_s: 60}

Each stage runs once per batch (one ``extract_batch``, one ``get_batch``, one ``verify_batch``) so an
LLM judge sees the whole batch at once and keeps ``concurrency`` requests in flight.

**One judge per role.** ``judge`` is the shared endpoint; a stage's own ``judge:`` block (e.g.
``verifier: {name: llm_judge, style: truthfulness, judge: {base_url: ..., model: KLCF-...-Truthfulness-Verifier}}``)
overrides it key by key, so KLCF's truthfulness check goes to the truthfulness model, not the extractor.

**Failures are values.** A response whose extraction failed (``ClaimsFailed``), whose verifier's
judge never answered for some claim, or none of whose claims could be verified gets
``FactCheck.error`` with the reason; it is never reported as "no claims" or "not supported".
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from nemo_factuality.interfaces import ClaimExtractor, EvidenceProvider, EvidenceQuery, Segmenter, Verifier, VerifyItem
from nemo_factuality.registry import EVIDENCE, EXTRACTORS, SEGMENTERS, VERIFIERS, Registry
from nemo_factuality.types import FactCheck, FactualityInputError, Label, Verdict, check_batch_columns

log = logging.getLogger(__name__)


@dataclass
class JudgeConfig:
    """An OpenAI-compatible judge endpoint (vLLM ``serve`` in production)."""

    base_url: str = "http://127.0.0.1:8000/v1"  # the OpenAI-compatible API root, e.g. http://judge-node:8000/v1
    model: str = "judge"  # the model name the server serves (vLLM's --served-model-name)
    api_key: str | None = None  # bearer token, if the server wants one
    concurrency: int = 32  # requests in flight at once
    timeout_s: float = 60.0  # one request
    max_retries: int = 3  # retries on 5xx, 429, timeouts, dropped connections, malformed bodies
    backoff_s: float = 0.5  # the first retry's wait (jittered, doubling)
    cache_path: str | None = None  # SQLite cache of successful replies, keyed by model + messages + params (None: no cache)


@dataclass
class PipelineConfig:
    segmenter: dict[str, Any] = field(default_factory=lambda: {"name": "regex"})  # sentence segmenter: {name: regex}
    extractor: dict[str, Any] = field(default_factory=lambda: {"name": "identity"})  # claim extractor: identity | rlfh | factscore | safe | klcf
    evidence: dict[str, Any] = field(default_factory=lambda: {"name": "none"})  # evidence provider: none | given | bm25_sections | kb | kb_hybrid
    verifier: dict[str, Any] = field(default_factory=lambda: {"name": "kb_exact"})  # needs store_path
    judge: JudgeConfig | None = None  # the judge the LLM stages use when their block names none
    # FActScore abstention rule applied to whole responses before extraction ("generic",
    # "perplexity_ai" or None); an abstained response gets no claims.
    abstain_detection: str | None = "generic"


def merged_health(parts: Sequence[Any]) -> dict[str, str | None]:
    """One ``{component: None or failure}`` map from every part that has a ``health()``."""
    out: dict[str, str | None] = {}
    for part in parts:
        fn = getattr(part, "health", None)
        if callable(fn):
            for name, failure in fn().items():
                # two parts may report the same name (one judge model behind two URLs): keep every failure
                known = out.get(name)
                out[name] = failure if not known or known == failure else (f"{known}; {failure}" if failure else known)
    return out


class FactualityPipeline:
    """Composes the four stages; ``check`` returns one ``FactCheck`` per response."""

    def __init__(self, segmenter: Segmenter, extractor: ClaimExtractor, evidence: EvidenceProvider,
                 verifier: Verifier, abstain_detection: str | None = "generic") -> None:
        self.segmenter, self.extractor, self.evidence, self.verifier = segmenter, extractor, evidence, verifier
        self.abstain_detection = abstain_detection

    def __repr__(self) -> str:
        parts = (self.segmenter, self.extractor, self.evidence, self.verifier)
        return "FactualityPipeline(" + " → ".join(type(p).__name__ for p in parts) + ")"

    def health(self) -> dict[str, str | None]:
        """Merged ``health()`` of the parts that report one (component → None or the failure)."""
        return merged_health((self.segmenter, self.extractor, self.evidence, self.verifier))

    def stats(self) -> dict[str, float]:
        """Counters of the parts and of their judge clients (each client counted once), prefixed ``judge_``."""
        out: dict[str, float] = {}
        clients: dict[int, Any] = {}
        for part in (self.segmenter, self.extractor, self.evidence, self.verifier):
            st = getattr(part, "stats", None)
            if isinstance(st, dict):
                for k, v in st.items():
                    out[k] = out.get(k, 0.0) + float(v)
            client = getattr(part, "client", None)
            if client is not None and hasattr(client, "stats"):
                clients[id(client)] = client
        for client in clients.values():
            for k, v in client.stats.as_dict().items():
                out[f"judge_{k}"] = out.get(f"judge_{k}", 0.0) + float(v)
        return out

    def check(self, prompts: Sequence[str], responses: Sequence[str], *, topics: Sequence[str | None] | None = None,
              materials: Sequence[Sequence[str]] | None = None) -> list[FactCheck]:
        """Fact-check a batch. Empty or whitespace-only responses are abstentions with no claims."""
        n = len(responses)
        check_batch_columns(n, {"prompts": prompts, "topics": topics, "materials": materials}, who="pipeline.check")
        for i, r in enumerate(responses):
            if not isinstance(r, str):
                raise FactualityInputError(f"pipeline.check: responses[{i}] must be str, got {type(r).__name__}")
        from nemo_factuality.metrics.abstain import is_response_abstained

        live = [i for i, r in enumerate(responses) if r.strip() and not is_response_abstained(r, self.abstain_detection)]
        sentences: list[list] = [[] for _ in responses]
        for i in live:
            sentences[i] = self.segmenter.split(responses[i])
        # Abstained and empty responses never reach the extractor (no judge calls, no claims).
        extracted = self.extractor.extract_batch([prompts[i] for i in live], [responses[i] for i in live],
                                                 [sentences[i] for i in live]) if live else []
        if len(extracted) != len(live):
            raise FactualityInputError(f"extractor {type(self.extractor).__name__} returned {len(extracted)} lists for {len(live)} responses")
        claims: list[list] = [[] for _ in responses]
        for i, cs in zip(live, extracted):
            claims[i] = cs
        index: list[tuple[int, int]] = []
        queries: list[EvidenceQuery] = []
        for i, cs in enumerate(claims):
            for j, c in enumerate(cs):
                index.append((i, j))
                queries.append(EvidenceQuery(c, prompts[i], topics[i] if topics else None,
                                             tuple(materials[i]) if materials else ()))
        evidence = self.evidence.get_batch(queries) if queries else []
        items = [VerifyItem(q.claim, tuple(ev), q.prompt, responses[i], q.topic)
                 for (i, _), q, ev in zip(index, queries, evidence)]
        verdicts = self.verifier.verify_batch(items) if items else []
        if len(verdicts) != len(items):
            raise FactualityInputError(f"verifier {type(self.verifier).__name__} returned {len(verdicts)} verdicts for {len(items)} claims")
        out = [FactCheck(response=r, sentences=s, claims=list(c), abstained=not c and getattr(c, "error", None) is None,
                         error=getattr(c, "error", None))
               for r, s, c in zip(responses, sentences, claims)]
        for (i, _), v in zip(index, verdicts):
            out[i].verdicts.append(v)
        for check in out:
            check.error = check.error or verification_error(check.verdicts)
        return out


def verification_error(verdicts: Sequence[Verdict]) -> str | None:
    """Why a response's verification failed, or None.

    Failed: the judge never answered for at least one claim (an outage is not a verdict), or every
    claim's reply was unreadable (nothing was verified). Some unreadable replies among readable ones
    are left to the reward's own policy (RLFH ``unparseable_verdict``; counted everywhere).
    """
    unanswered = [v for v in verdicts if v.judge_failed]
    if unanswered:
        return f"verification failed for {len(unanswered)} of {len(verdicts)} claims: {unanswered[0].error}"
    if verdicts and all(v.label is Label.UNPARSEABLE for v in verdicts):
        return f"no claim could be verified: all {len(verdicts)} verdicts unreadable ({verdicts[0].error})"
    return None


def _build(registry: Registry, spec: Mapping[str, Any], judge: Any, shared_judge_cfg: Mapping[str, Any] | None = None) -> Any:
    spec = dict(spec)
    role_judge = spec.pop("judge", None)
    if role_judge:  # this role's own endpoint, key by key over the shared judge block
        judge = role_judge if hasattr(role_judge, "complete_batch") else build_judge({**dict(shared_judge_cfg or {}), **dict(role_judge)})
    extra = {"client": judge} if judge is not None and _takes_client(registry.get(spec["name"])) else {}
    return registry.build(spec, **extra)


def _takes_client(factory: Any) -> bool:
    try:
        return "client" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _check_stage(registry: Registry, spec: Mapping[str, Any], has_judge: bool) -> None:
    """What building one stage from ``spec`` would reject, without building it (no store opened, no model loaded)."""
    spec = dict(spec)
    role_judge = spec.pop("judge", None)
    if isinstance(role_judge, Mapping):
        _check_judge_keys(role_judge)
    has_judge = has_judge or role_judge is not None
    if "name" not in spec:
        registry.check(spec)  # raises: the stage needs a name
    factory = registry.get(spec["name"])
    if "client" in _required(factory) and not has_judge:
        raise FactualityInputError(f"{registry.kind} {spec['name']!r} needs an LLM judge: set pipeline.judge.base_url/model")
    for key, value in spec.items():
        if value == "???":
            raise FactualityInputError(f"{registry.kind} {spec['name']!r}: option {key!r} must be set (e.g. {key}=...)")
    registry.check(spec, **({"client": None} if has_judge and _takes_client(factory) else {}))


def _required(factory: Any) -> set[str]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if p.default is inspect.Parameter.empty and n != "self"}


def _check_judge_keys(cfg: Mapping[str, Any]) -> None:
    unknown = set(dict(cfg)) - {f.name for f in fields(JudgeConfig)}
    if unknown:
        raise FactualityInputError(f"judge config: unknown key(s) {sorted(unknown)}; expected some of "
                                   f"{sorted(f.name for f in fields(JudgeConfig))}")


def build_judge(cfg: JudgeConfig | Mapping[str, Any]) -> Any:
    """An ``OpenAIJudgeClient`` from a judge config block."""
    from nemo_factuality.judge.client import OpenAIJudgeClient

    if not isinstance(cfg, JudgeConfig):
        _check_judge_keys(cfg)
    c = cfg if isinstance(cfg, JudgeConfig) else JudgeConfig(**dict(cfg))
    return OpenAIJudgeClient(c.base_url, c.model, api_key=c.api_key, concurrency=c.concurrency, timeout_s=c.timeout_s,
                             max_retries=c.max_retries, backoff_s=c.backoff_s, cache=c.cache_path)


_STAGES = (("segmenter", SEGMENTERS), ("extractor", EXTRACTORS), ("evidence", EVIDENCE), ("verifier", VERIFIERS))


def check_pipeline_config(cfg: PipelineConfig | Mapping[str, Any], *, has_judge: bool = False) -> dict[str, Any]:
    """The config with defaults filled in, after every check ``build_pipeline`` makes on the config itself
    (keys, stage names, their options, judge blocks) — without building a part: a command calls it before
    any work. ``has_judge``: the caller supplies a judge client or shared judge block."""
    raw = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
    defaults = asdict(PipelineConfig())
    unknown = set(raw) - set(defaults)
    if unknown:
        raise FactualityInputError(f"pipeline config: unknown key(s) {sorted(unknown)}; expected {sorted(defaults)}")
    merged = {**defaults, **raw}
    shared = merged.get("judge")
    if isinstance(shared, Mapping):
        _check_judge_keys(shared)
    for role, registry in _STAGES:
        _check_stage(registry, merged[role], has_judge or shared is not None)
    return merged


def build_pipeline(cfg: PipelineConfig | Mapping[str, Any], judge_client: Any = None,
                   judge_defaults: Mapping[str, Any] | None = None) -> FactualityPipeline:
    """Build the four stages by registry name; LLM-backed parts get ``client=judge_client``.

    A stage's own ``judge:`` block is laid over ``cfg.judge`` (or ``judge_defaults``, the caller's
    shared judge block) and gets its own client.
    """
    merged = check_pipeline_config(cfg, has_judge=judge_client is not None or bool(judge_defaults))
    judge = judge_client
    shared = merged.get("judge") or judge_defaults
    shared = asdict(shared) if is_dataclass(shared) else shared
    if judge is None and shared:
        judge = build_judge(shared)
    return FactualityPipeline(
        _build(SEGMENTERS, merged["segmenter"], judge, shared),
        _build(EXTRACTORS, merged["extractor"], judge, shared),
        _build(EVIDENCE, merged["evidence"], judge, shared),
        _build(VERIFIERS, merged["verifier"], judge, shared),
        abstain_detection=merged.get("abstain_detection"),
    )
