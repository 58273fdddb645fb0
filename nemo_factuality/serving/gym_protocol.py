"""A method reward as a NeMo-Gym resources server: the protocol's logic, shared by the project's server and NeMo-Gym's.

NeMo-Gym (0.4.0) asks a resources server three things, each a ``POST`` with a JSON body:

* ``/seed_session`` — the dataset row, before the rollout; this server keeps no session state (``{}``).
* ``/verify`` — ``BaseVerifyRequest``: the row (``responses_create_params``, the Responses-API prompt, plus the row's
  own fields) and ``response``, the policy's Responses-API output. The reply is the request plus ``reward: float``
  and ``factuality`` (why: the score, its components, the claims and their verdicts, FSPO's per-sentence signs,
  FactAlign's sentence labels).
* ``/aggregate_metrics`` — ``{"verify_responses": [...]}`` (the replies, ``response`` stripped) → the factuality metrics
  over the batch (``AggregateMetrics``: ``agent_metrics``, ``key_metrics``, ``group_level_metrics`` per task).

Request → reward input: the prompt is the last user turn of ``responses_create_params.input``; the completion is the
text of the response's last assistant message, reasoning items put back in front as ``<think>…</think>`` (the
policy wrote them so; a reasoning parser split them off), and every other field of the row is a column
(``ground_truth``, ``knowledge``, ``checklist``, ``topic``, ...), NeMo-Gym's own ``_ng_*``/``agent_ref`` keys aside.

Failures are never a reward that looks real: a sample whose judge failed or whose replies could not be read is an
HTTP 503 naming the reason (NeMo-Gym's way: a ``/verify`` that does not return 2xx fails that rollout — its agents
raise, NeMo-RL counts a 5xx as an infrastructure failure and retries the prompt); bad input is a 422 with one line;
an abstention (a blank response: the reward's NaN without an error) is ``nan_reward``, marked ``abstained``.

Concurrency as the PyTriton server's: NeMo-Gym sends one ``/verify`` per rollout, many at once; ``RewardBatcher``
gathers them (``gym.max_batch_size``, ``gym.max_queue_delay_ms``) into one batched reward call at a time, and holds at
most ``gym.max_pending`` requests (one more is a 503 "busy", never an unbounded queue).

This module imports neither FastAPI nor NeMo-Gym: ``serving.gym_server`` (FastAPI, ``nemo-factuality serve
protocol=nemo_gym``) and the adapter NeMo-Gym's runner starts (``conf/gym/resources_servers/nemo_factuality/app.py``,
a ``SimpleResourcesServer`` in NeMo-Gym's venv) both call ``GymRewardService``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from nemo_factuality.serving.config import GymServeConfig, ServeConfig
from nemo_factuality.types import FactualityInputError, Label, RewardBatch

log = logging.getLogger(__name__)

#: Row keys that are NeMo-Gym's, not the dataset's: never handed to the reward as columns.
GYM_KEYS = frozenset({"responses_create_params", "response", "agent_ref", "skills_ref", "reward", "factuality"})
#: The label a verdict of each kind counts as in ``claims/precision`` (FActScore's: supported / the checked claims).
CHECKED = (Label.SUPPORTED.value, Label.NOT_SUPPORTED.value, Label.NOT_ENOUGH_INFO.value)
TASK_INDEX = "_ng_task_index"  # NeMo-Gym's row index in the verify responses aggregate_metrics gets
#: The headline metrics of ``factuality_metrics`` (its ``key_metrics``).
KEY_METRICS = ("mean/reward", "abstain_rate", "claims/precision", "claims/per_response")


class GymRequestError(Exception):
    """A request this server answers with an HTTP error: ``status`` (422 bad input, 503 no reward, 500 a bug)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class VerifySample:
    """What the reward is called with for one ``/verify`` request."""

    prompt: str
    completion: str
    columns: dict[str, Any]


# ---------------------------------------------------------------------------------------------- request → sample
def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of parts (``input_text`` / ``output_text`` / ``summary_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping)
                       and isinstance(part.get("text", ""), str))
    raise GymRequestError(422, f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def prompt_of(params: Any) -> str:
    """The last user turn of ``responses_create_params.input`` (a string input is that turn)."""
    if not isinstance(params, Mapping):
        raise GymRequestError(422, "responses_create_params must be an object with `input` (the prompt's messages)")
    turns = params.get("input")
    if isinstance(turns, str):
        return turns
    if not isinstance(turns, list):
        raise GymRequestError(422, "responses_create_params.input must be a string or a list of messages")
    users = [i for i, m in enumerate(turns) if isinstance(m, Mapping) and m.get("role") == "user"]
    return _text(turns[users[-1]].get("content", ""), f"responses_create_params.input[{users[-1]}].content") if users else ""


def completion_of(response: Any) -> str:
    """The text of the response's last assistant message, its reasoning items in front as ``<think>…</think>``."""
    if not isinstance(response, Mapping) or not isinstance(response.get("output"), list):
        raise GymRequestError(422, "response must be a Responses-API response object with an `output` list")
    output = [item for item in response["output"] if isinstance(item, Mapping)]
    messages = [i for i, item in enumerate(output) if item.get("type") == "message" and item.get("role") == "assistant"]
    if not messages:
        raise GymRequestError(422, "response.output has no assistant message to score (only "
                              f"{sorted({str(item.get('type')) for item in output}) or 'nothing'})")
    last = messages[-1]
    text = _text(output[last].get("content", ""), f"response.output[{last}].content")
    earlier = messages[-2] if len(messages) > 1 else -1  # the reasoning of this turn: after the previous message
    reasoning = "".join(_text(item.get("summary") or item.get("content") or "", f"response.output[{i}]")
                        for i, item in enumerate(output[earlier + 1 : last], start=earlier + 1)
                        if item.get("type") == "reasoning")
    return f"<think>{reasoning}</think>{text}" if reasoning else text


def parse_verify(body: Any) -> VerifySample:
    """A ``/verify`` body → the reward's prompt, completion and this row's columns; bad input: one-line 422."""
    if not isinstance(body, Mapping):
        raise GymRequestError(422, "the /verify body must be a JSON object (NeMo-Gym's BaseVerifyRequest)")
    for key in ("responses_create_params", "response"):
        if key not in body:
            raise GymRequestError(422, f"the /verify body has no `{key}` (BaseVerifyRequest carries "
                                  "responses_create_params and response)")
    columns = {k: v for k, v in body.items() if k not in GYM_KEYS and not k.startswith("_ng_")}
    return VerifySample(prompt_of(body["responses_create_params"]), completion_of(body["response"]), columns)


# ---------------------------------------------------------------------------------------------- reward → reply
def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def reward_of(row: RewardBatch, nan_reward: float) -> tuple[float, dict[str, Any]]:
    """(the scalar reward, why) for one sample's ``RewardBatch``; a failed sample raises a 503 naming the reason.

    Abstaining (NaN without an error: a blank response) is ``nan_reward`` with ``abstained: true``: NeMo-Gym's
    reward is a float, and NaN is not JSON."""
    details = dict((row.details or [{}])[0] or {})
    error = details.pop("error", None)
    score = float(row.scores[0])
    if error:
        raise GymRequestError(503, f"the reward could not be computed for this response: {error}")
    why: dict[str, Any] = {"score": _number(score), "abstained": math.isnan(score),
                           "components": {k: _number(float(v[0])) for k, v in row.components.items()}, **details}
    if row.sentence_labels is not None:
        why["sentence_labels"] = row.sentence_labels[0]
    if row.sentence_spans is not None:
        why["sentence_spans"] = [[s.start, s.end] for s in row.sentence_spans[0]]
    return (nan_reward if math.isnan(score) else score), why


# ---------------------------------------------------------------------------------------------- batching
def _column_batch(samples: Sequence[VerifySample]) -> dict[str, list[Any]]:
    keys = sorted({k for s in samples for k in s.columns})
    return {k: [s.columns.get(k) for s in samples] for k in keys}


class RewardBatcher:
    """Scores ``VerifySample``s in batches on one thread: one reward call at a time, at most ``max_pending`` held.

    Requests whose rows carry different fields are scored in separate calls, so a row that lacks a column the reward
    needs (FSPO's ``ground_truth``) fails alone with the reward's own message instead of being scored against a
    ``None``; a bad-input error of a mixed call is attributed by scoring its rows one by one."""

    def __init__(self, reward: Any, cfg: GymServeConfig, metrics: Any = None, model: str = "nemo_gym") -> None:
        self.reward, self.cfg, self.metrics, self.model = reward, cfg, metrics, model
        self._queue: deque[tuple[VerifySample, Future]] = deque()
        self._held = 0  # queued + being scored
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="factuality-gym-batcher", daemon=True)
        self._thread.start()

    def submit(self, sample: VerifySample) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise GymRequestError(503, "the reward server is stopping")
            if self._held >= self.cfg.max_pending:
                raise GymRequestError(503, f"busy: {self._held} requests are waiting or being scored "
                                      f"(gym.max_pending={self.cfg.max_pending}); retry, or send fewer at once")
            self._held += 1
            self._queue.append((sample, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Stop taking requests; the ones still queued fail with a 503, the batch being scored finishes."""
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for _, future in left:
            future.set_exception(GymRequestError(503, "the reward server stopped before scoring this request"))
        self._thread.join(timeout=60)

    def _next_batch(self) -> list[tuple[VerifySample, Future]]:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return []
            deadline = time.monotonic() + self.cfg.max_queue_delay_ms / 1000
            while len(self._queue) < self.cfg.max_batch_size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return [self._queue.popleft() for _ in range(min(len(self._queue), self.cfg.max_batch_size))]

    def _run(self) -> None:
        while batch := self._next_batch():
            groups: dict[tuple[str, ...], list[int]] = {}
            for i, (sample, _) in enumerate(batch):
                groups.setdefault(tuple(sorted(sample.columns)), []).append(i)
            for rows in groups.values():
                outcomes = self._score([batch[i][0] for i in rows])
                for i, outcome in zip(rows, outcomes, strict=True):
                    future = batch[i][1]
                    (future.set_exception if isinstance(outcome, Exception) else future.set_result)(outcome)
            with self._cond:
                self._held -= len(batch)

    def _score(self, samples: list[VerifySample]) -> list[RewardBatch | GymRequestError]:
        """One outcome per sample: its one-row ``RewardBatch``, or the error its request gets."""
        start = time.perf_counter()
        try:
            result = self.reward([s.prompt for s in samples], [s.completion for s in samples], **_column_batch(samples))
            if len(result) != len(samples):
                raise RuntimeError(f"the reward returned {len(result)} scores for {len(samples)} completions")
        except FactualityInputError as err:
            if len(samples) > 1:  # which row was bad: each alone
                return [outcome for s in samples for outcome in self._score([s])]
            self._count("errors")
            return [GymRequestError(422, str(err))]
        except Exception as err:  # the reward's own failure: every request of the call is told, the server keeps serving
            log.exception("the reward failed on a batch of %d /verify requests", len(samples))
            self._count("errors")
            return [GymRequestError(500, f"the reward raised {type(err).__name__}: {err}")] * len(samples)
        self._observe(result, time.perf_counter() - start)
        return [result.take([i]) for i in range(len(samples))]

    def _count(self, name: str, amount: float = 1, *labels: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).labels(self.model, *labels).inc(amount)

    def _observe(self, result: RewardBatch, seconds: float) -> None:
        failed = sum(1 for d in result.details or [] if d and d.get("error"))
        abstained = int(np.isnan(result.scores).sum()) - failed
        self._count("requests")
        self._count("samples", len(result))
        if failed:
            self._count("sample_errors", failed)
        if abstained:
            self._count("nan_rewards", abstained, "abstain")
        if self.metrics is not None:
            self.metrics.latency.labels(self.model).observe(seconds)
        log.info("scored %d /verify requests in %.3f s (%d failed, %d abstained)", len(result), seconds, failed, abstained)


# ---------------------------------------------------------------------------------------------- metrics over a batch
def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def factuality_metrics(verify_responses: Any) -> dict[str, Any]:
    """The factuality metrics over a batch of ``/verify`` replies (NeMo-Gym's ``AggregateMetrics`` shape).

    ``agent_metrics``: ``n``, ``mean/reward``, ``abstain_rate``, ``mean/<component>`` (over the replies that have
    it), ``claims/total``, ``claims/per_response``, ``claims/<verdict>`` (counts), ``claims/precision`` (supported
    over supported + not supported + not enough info); ``key_metrics``: the headline four; ``group_level_metrics``:
    ``n`` and ``mean/reward`` per task (``_ng_task_index``). Replies of another server (no ``factuality``) count in
    ``n`` and ``mean/reward`` only."""
    if not isinstance(verify_responses, list) or not all(isinstance(r, Mapping) for r in verify_responses):
        raise GymRequestError(422, "/aggregate_metrics: verify_responses must be a list of verify replies (objects)")
    for i, r in enumerate(verify_responses):
        if not isinstance(r.get("reward"), (int, float)) or isinstance(r.get("reward"), bool):
            raise GymRequestError(422, f"/aggregate_metrics: verify_responses[{i}] has no numeric `reward`")
    whys = [r["factuality"] for r in verify_responses if isinstance(r.get("factuality"), Mapping)]
    components: dict[str, list[float]] = {}
    verdicts: dict[str, int] = {}
    for why in whys:
        for name, value in (why.get("components") or {}).items():
            if isinstance(value, (int, float)):
                components.setdefault(name, []).append(float(value))
        for verdict in why.get("verdicts") or []:
            verdicts[str(verdict)] = verdicts.get(str(verdict), 0) + 1
    checked = sum(verdicts.get(v, 0) for v in CHECKED)
    total = sum(verdicts.values())
    agent: dict[str, Any] = {"n": len(verify_responses),
                             "mean/reward": _mean([float(r["reward"]) for r in verify_responses]),
                             "abstain_rate": _mean([float(bool(w.get("abstained"))) for w in whys]),
                             **{f"mean/{name}": _mean(values) for name, values in sorted(components.items())},
                             "claims/total": total, "claims/per_response": total / len(whys) if whys else None,
                             **{f"claims/{name}": count for name, count in sorted(verdicts.items())},
                             "claims/precision": verdicts.get(Label.SUPPORTED.value, 0) / checked if checked else None}
    tasks: dict[Any, list[float]] = {}
    for r in verify_responses:
        tasks.setdefault(r.get(TASK_INDEX, 0), []).append(float(r["reward"]))
    groups = [{TASK_INDEX: t, "n": len(v), "mean/reward": _mean(v)} for t, v in sorted(tasks.items(), key=lambda kv: str(kv[0]))]
    key = {k: agent[k] for k in KEY_METRICS}
    return {"group_level_metrics": groups, "agent_metrics": agent, "key_metrics": key}


# ---------------------------------------------------------------------------------------------- the service
class GymRewardService:
    """The three routes' logic around one reward; both HTTP front ends (FastAPI here, NeMo-Gym's adapter) call it."""

    def __init__(self, reward: Any, cfg: ServeConfig, metrics: Any = None) -> None:
        self.reward, self.cfg = reward, cfg
        self.batcher = RewardBatcher(reward, cfg.gym, metrics)

    async def verify(self, body: Any) -> dict[str, Any]:
        """The ``/verify`` reply: the request, ``reward`` and ``factuality``; errors raise ``GymRequestError``."""
        sample = parse_verify(body)
        row = await asyncio.wrap_future(self.batcher.submit(sample))
        reward, why = reward_of(row, self.cfg.nan_reward)
        return {**body, "reward": reward, "factuality": why}

    def seed_session(self, body: Any) -> dict[str, Any]:
        """Nothing to seed: a factuality reward reads everything it needs from the ``/verify`` request."""
        if not isinstance(body, Mapping):
            raise GymRequestError(422, "the /seed_session body must be a JSON object (the dataset row)")
        return {}

    def aggregate_metrics(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping) or "verify_responses" not in body:
            raise GymRequestError(422, "the /aggregate_metrics body must be {\"verify_responses\": [...]}")
        return factuality_metrics(body["verify_responses"])

    def health(self) -> dict[str, str | None]:
        from nemo_factuality.serving.server import reward_health

        return reward_health(self.reward)

    def close(self) -> None:
        self.batcher.close()
