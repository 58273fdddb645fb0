"""``RemoteFactualityReward``: the served reward with the in-process call shape.

    reward = RemoteFactualityReward("http://reward-node:5555")
    batch = reward(prompts, completions, ground_truth=[...])     # -> RewardBatch

Errors name the URL, the model and the config key to change. A server that refuses, drops or times out a
request is waited for and sent the same request again, with jittered exponential backoff, for at most
``Backoff.max_wait_s`` (the training stages' ``remote_rm.retry``); every wait is logged with the URL. Past the
window ``RewardServerUnavailable`` (a ``ServerUnavailableError``: exit 75 at the command boundary) ends the
call. An error the server itself answered (a reward that raised, ``fail_fast``) is not retried.

    reward = RemoteFactualityReward(url, retry=Backoff(max_wait_s=600))
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import types
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from nemo_factuality.types import FactualityInputError, RewardBatch, ServerUnavailableError, Span

log = logging.getLogger(__name__)
T = TypeVar("T")


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or refused the request."""


class RewardServerUnavailable(RemoteRewardError, ServerUnavailableError):
    """The reward server stayed unreachable past ``remote_rm.retry.max_wait_s``."""


# ---------------------------------------------------------------------------------------------- retry
@dataclass(frozen=True)
class Backoff:
    """How long a client keeps retrying a server that is down, and how it spaces its tries.

    Wait ``k`` (from 0) is ``min(max_s, initial_s · 2^k)`` scaled by a uniform factor in ``[1 − jitter, 1]``
    (many ranks or clients do not come back in lock-step); the waits stop once ``max_wait_s`` have passed
    since the first failure. ``max_wait_s = 0``: no retry. The training stages' defaults are in
    ``trainers/config.py`` (``RetryConfig``)."""

    max_wait_s: float = 0.0
    initial_s: float = 1.0
    max_s: float = 30.0
    jitter: float = 0.5

    def delay(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_s, self.initial_s * 2.0 ** min(attempt, 62))
        return base * (1.0 - self.jitter * rng.random())


# Triton's own answers while a model is (re)loading or going away; an error the model itself raised ("Model execute
# error", with the server's traceback, e.g. a reward's fail_fast) is final, whatever words its traceback holds.
_NOT_SERVING = ("unknown model", "not ready", "not healthy", "unavailable", "shutting down")


def server_went_away(err: BaseException) -> bool:
    """True for a refused or dropped connection, a timeout or a model that is not (yet) loaded: worth waiting for.
    False for an error the server answered (the reward raised, ``fail_fast``, a bad request)."""
    import http.client

    # OSError: refused/reset; HTTPException: the HTTP layer lost the connection mid-response (geventhttpclient's
    # ``HTTPConnectionClosed`` when the server dies with the request in flight)
    if isinstance(err, (OSError, TimeoutError, http.client.HTTPException)):
        return True
    try:
        from pytriton.client.exceptions import (
            PyTritonClientInferenceServerError,
            PyTritonClientModelUnavailableError,
            PyTritonClientTimeoutError,
        )
    except ImportError:  # pragma: no cover - the clients import PyTriton before they can fail
        return False
    if isinstance(err, (PyTritonClientTimeoutError, PyTritonClientModelUnavailableError)):
        return True
    if isinstance(err, PyTritonClientInferenceServerError):
        text = str(err).lower()
        answered = "model execute error" in text or "traceback" in text
        return not answered and any(words in text for words in _NOT_SERVING)
    return False


def call_with_retry(request: Callable[[], T], *, what: str, url: str, backoff: Backoff, key: str,
                    unavailable: Callable[[str], Exception], went_away: Callable[[BaseException], bool] = server_went_away,
                    before_retry: Callable[[], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> T:
    """``request()``, sent again after each jittered wait while ``went_away(error)``, for at most
    ``backoff.max_wait_s`` from the first failure; then ``unavailable(message)`` is raised from the last error.

    Any other error propagates at once. ``before_retry()`` runs before each resend (a caller that must check
    the server's state first). Jitter comes from a private ``random.Random``: the global streams that
    sampling draws from are untouched, so a retried step equals an undisturbed one."""
    rng = random.Random()
    first_failure: float | None = None
    attempt = 0
    while True:
        try:
            return request()
        except Exception as err:
            if not went_away(err):
                raise
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            waited = now - first_failure
            reason = f"{type(err).__name__}: {_first_line(err)}"
            if waited >= backoff.max_wait_s:
                raise unavailable(f"{what} {url} did not come back within {key}={backoff.max_wait_s:g} s "
                                  f"({attempt + 1} tries; last: {reason})") from err
            delay = min(backoff.delay(attempt, rng), backoff.max_wait_s - waited)
            log.warning("%s %s %s (%s); retrying the same request in %.1f s (%.0f of %g s waited, %s)",
                        what, url, failure_kind(err), reason, delay, waited, backoff.max_wait_s, key)
            sleep(delay)
            attempt += 1
            if before_retry is not None:
                before_retry()


def failure_kind(err: BaseException) -> str:
    """How a request failed, as the retry log says it: a timeout (the server may still be working on it, so a resend
    must be one it can recognise) apart from a refused or dropped connection (the request did not run, or died)."""
    chain = [err, *filter(None, [err.__cause__, err.__context__])]
    for e in chain:
        name, text = type(e).__name__.lower(), str(e).lower()
        if isinstance(e, TimeoutError) or "timeout" in name or "timed out" in text or "timeout" in text:
            return "timed out (the request may still be running there)"
    return "refused the connection or lost it"


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300] or type(err).__name__


#: How long gevent keeps an idle thread of its default pool (PyTriton's HTTP client resolves names there), in seconds.
#: gevent's own default, 5 s, retires them soon after each reward call, and a thread exiting at the instant Megatron-Core
#: forks its checkpoint writer (every dist-checkpoint save forks) leaves the child deadlocked in CPython's after-fork
#: cleanup: the writer never starts and its rank waits forever (seen on the aligner backend's final export, two ranks
#: stuck in one save). 10⁶ s (~12 days): gevent refuses -1 and "inf". A value the user set wins.
GEVENT_THREAD_IDLE_S = "1000000"


def pytriton_client() -> types.ModuleType:
    """``pytriton.client``: the one place the toolkit imports it, after keeping gevent's pool threads (above). gevent
    reads the setting when its pool starts, which is a client's first call, so every client the toolkit makes gets it;
    the processes it spawns inherit it."""
    os.environ.setdefault("GEVENT_THREADPOOL_IDLE_TASK_TIMEOUT", GEVENT_THREAD_IDLE_S)
    import pytriton.client

    return pytriton.client


@contextlib.contextmanager
def quiet_pytriton_timeouts() -> Iterator[None]:
    """PyTriton warns on every client whose connect wait is shorter than its request timeout, which is how
    these clients are set up on purpose (a bounded wait for the server, a long one for a judged batch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Client network and/or connection timeout")
        yield


class RemoteFactualityReward:
    def __init__(self, url: str, *, model_name: str = "factuality_reward", timeout_s: float = 120.0,
                 init_timeout_s: float = 30.0, retry: Backoff = Backoff()) -> None:
        self.url, self.model_name, self.timeout_s, self.init_timeout_s = url, model_name, timeout_s, init_timeout_s
        self.retry = retry

    def _client(self) -> Any:
        ModelClient = pytriton_client().ModelClient

        return ModelClient(self.url, self.model_name, init_timeout_s=self.init_timeout_s, inference_timeout_s=self.timeout_s)

    @property
    def health_wait_s(self) -> float:
        """How long ``health()`` waits to connect, then again for the model to be ready."""
        return min(self.init_timeout_s, 5.0)

    def health(self) -> dict[str, str | None]:
        ModelClient = pytriton_client().ModelClient

        try:
            with quiet_pytriton_timeouts(), ModelClient(self.url, self.model_name,
                                                        init_timeout_s=self.health_wait_s) as client:
                client.wait_for_model(timeout_s=self.health_wait_s)
            return {f"reward_server:{self.model_name}": None}
        except Exception as err:
            return {f"reward_server:{self.model_name}": f"{self.url} model {self.model_name!r} not ready: {err}"}

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        n = len(completions)
        if len(prompts) != n:
            raise FactualityInputError(f"remote reward: {len(prompts)} prompts but {n} completions")
        if n == 0:
            return RewardBatch(np.zeros(0))
        rows = [{k: v[i] for k, v in columns.items() if v is not None} for i in range(n)]
        call = uuid.uuid4().hex  # never the global random streams: a retried step must equal an undisturbed one
        payload = {
            "prompts": np.array([[p.encode("utf-8")] for p in prompts], dtype=object),
            "completions": np.array([[c.encode("utf-8")] for c in completions], dtype=object),
            "columns": np.array([[json.dumps(r, default=_jsonable).encode("utf-8")] for r in rows], dtype=object),
            # the same ids on every resend of this call: a server still scoring the first answers the rest from it
            "request_ids": np.array([[f"{call}:{i}".encode()] for i in range(n)], dtype=object),
        }
        def request() -> dict[str, np.ndarray]:
            with quiet_pytriton_timeouts(), self._client() as client:
                return client.infer_batch(**payload)

        hint = (f"Check that 'nemo-factuality serve' is running there and its judges are ready (GET /health/ready), "
                f"or raise reward.timeout_s (now {self.timeout_s:g} s)")
        try:
            out = call_with_retry(request, what="reward server", url=f"{self.url} (model {self.model_name!r})",
                                  backoff=self.retry, key="remote_rm.retry.max_wait_s",
                                  unavailable=lambda msg: RewardServerUnavailable(f"{msg}. {hint}"))
        except RemoteRewardError:
            raise
        except Exception as err:
            raise RemoteRewardError(f"reward server {self.url} (model {self.model_name!r}) failed: "
                                    f"{type(err).__name__}: {err}. {hint}") from err
        return _to_batch(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)


def _to_batch(out: dict[str, np.ndarray]) -> RewardBatch:
    details = [json.loads(d[0]) for d in out["details"]]
    lengths = [d["n_response_tokens"] for d in details]
    comps = sorted({k for d in details for k in d["components"]})
    components = {k: np.array([np.nan if d["components"].get(k) is None else d["components"][k] for d in details]) for k in comps}
    offsets = [d["response_offset"] for d in details]
    token_rewards = [out["token_rewards"][i, o : o + n] for i, (o, n) in enumerate(zip(offsets, lengths, strict=False))]
    token_signs = [out["token_signs"][i, o : o + n] for i, (o, n) in enumerate(zip(offsets, lengths, strict=False))]
    present = details[0].get("token_outputs") if details else None
    if present is not None:  # the reward has no such output: the zeros on the wire are padding, not values
        token_rewards = token_rewards if "token_rewards" in present else None
        token_signs = token_signs if "token_signs" in present else None
    sentence_labels = sentence_spans = None
    if details and all("sentence_labels" in d and "sentence_spans" in d for d in details):  # a labeller (FactAlign)
        sentence_labels = [[bool(x) for x in d["sentence_labels"]] for d in details]
        sentence_spans = [[Span(int(a), int(b)) for a, b in d["sentence_spans"]] for d in details]
    return RewardBatch(out["rewards"].reshape(-1).astype(np.float64), components, token_rewards=token_rewards,
                       token_signs=token_signs, details=[d.get("details", {}) for d in details],
                       sentence_labels=sentence_labels, sentence_spans=sentence_spans)
