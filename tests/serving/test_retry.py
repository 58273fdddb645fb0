"""The clients' one retry loop (``serving.client.call_with_retry``): which errors it waits out, how long, how it
spaces the tries, and that it leaves the global random streams alone (a retried step equals an undisturbed one)."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from nemo_factuality.serving.client import Backoff, RewardServerUnavailable, call_with_retry, server_went_away
from nemo_factuality.types import ServerUnavailableError


class _Flaky:
    """Fails ``failures`` times with ``error`` and then answers."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answer"


def _retry(request, backoff, sleeps):
    return call_with_retry(request, what="reward server", url="http://rm:5555", backoff=backoff,
                           key="remote_rm.retry.max_wait_s", unavailable=RewardServerUnavailable, sleep=sleeps.append)


def test_a_refused_connection_is_retried_with_capped_jittered_backoff_and_each_wait_logged(caplog):
    sleeps: list[float] = []
    flaky = _Flaky(6, ConnectionRefusedError(111, "Connection refused"))
    backoff = Backoff(max_wait_s=1e6, initial_s=1.0, max_s=8.0, jitter=0.5)
    with caplog.at_level(logging.WARNING, logger="nemo_factuality.serving.client"):
        assert _retry(flaky, backoff, sleeps) == "answer"
    assert flaky.calls == 7 and len(sleeps) == 6
    caps = [min(8.0, 2.0**k) for k in range(6)]  # 1, 2, 4, 8, 8, 8
    assert all(cap * 0.5 <= s <= cap for s, cap in zip(sleeps, caps, strict=True)), sleeps
    assert len(set(sleeps)) == 6  # jittered, not lock-step
    waits = [r.getMessage() for r in caplog.records if "retrying the same request" in r.getMessage()]
    assert len(waits) == 6 and all("http://rm:5555" in w and "remote_rm.retry.max_wait_s" in w for w in waits)


def test_the_window_ends_in_a_server_unavailable_error_naming_the_url_and_key(monkeypatch):
    clock = {"t": 100.0}
    monkeypatch.setattr("nemo_factuality.serving.client.time.monotonic", lambda: clock["t"])
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock["t"] += s

    flaky = _Flaky(10**6, TimeoutError("timed out"))
    with pytest.raises(RewardServerUnavailable) as err:
        call_with_retry(flaky, what="reward server", url="http://rm:5555", backoff=Backoff(max_wait_s=20, initial_s=1, max_s=4),
                        key="remote_rm.retry.max_wait_s", unavailable=RewardServerUnavailable, sleep=sleep)
    assert isinstance(err.value, ServerUnavailableError) and err.value.EXIT_CODE == 75
    assert "http://rm:5555" in str(err.value) and "remote_rm.retry.max_wait_s=20" in str(err.value)
    assert sum(sleeps) == pytest.approx(20)  # waited exactly the window (the last wait is cut to it), then gave up


def test_no_window_fails_at_once_and_an_error_the_server_answered_is_never_retried():
    sleeps: list[float] = []
    with pytest.raises(RewardServerUnavailable):
        _retry(_Flaky(1, ConnectionResetError("reset")), Backoff(max_wait_s=0), sleeps)
    answered = _Flaky(1, ValueError("the reward raised: fail_fast"))
    with pytest.raises(ValueError, match="fail_fast"):
        _retry(answered, Backoff(max_wait_s=600), sleeps)
    assert answered.calls == 1 and sleeps == []


def test_which_pytriton_errors_mean_the_server_went_away():
    pytest.importorskip("pytriton")
    from geventhttpclient.response import HTTPConnectionClosed
    from pytriton.client.exceptions import (
        PyTritonClientInferenceServerError,
        PyTritonClientModelUnavailableError,
        PyTritonClientTimeoutError,
        PyTritonClientValueError,
    )

    assert server_went_away(HTTPConnectionClosed("connection closed."))  # the server died with the request in flight
    assert server_went_away(PyTritonClientTimeoutError("Waiting for server to be ready timed out."))
    assert server_went_away(PyTritonClientModelUnavailableError("model not ready"))
    assert server_went_away(PyTritonClientInferenceServerError("Error occurred during inference request. Message: "
                                                               "Request for unknown model: 'factuality_reward' is not found"))
    # the model raised (Triton relays its traceback): final, even when the traceback mentions an unavailable judge
    assert not server_went_away(PyTritonClientInferenceServerError(
        "Error occurred during inference request. Message: Failed to process the request(s) for model "
        "'factuality_reward_0_0', message: TritonModelException: Model execute error: Traceback (most recent call "
        "last): ... ValueError: fail_fast: 3 samples failed (judge HTTP 503: upstream unavailable)"))
    assert not server_went_away(PyTritonClientValueError("Provide input data"))


def test_waiting_leaves_the_global_random_streams_untouched():
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    _retry(_Flaky(3, OSError("refused")), Backoff(max_wait_s=1e6), [])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_timeout_is_logged_apart_from_a_refused_or_lost_connection(caplog):
    """A timed-out request may still be running on the server (a resend must be one it recognises); a refused or
    dropped connection did not run. The retry log says which, so an operator reading it knows."""
    failures = [TimeoutError("timed out after 600 s"), ConnectionRefusedError("[Errno 111] Connection refused"),
                ConnectionResetError("Connection reset by peer")]

    def request():
        if failures:
            raise failures.pop(0)
        return "ok"

    with caplog.at_level(logging.WARNING, logger="nemo_factuality.serving.client"):
        out = call_with_retry(request, what="critic server", url="http://c:1", backoff=Backoff(max_wait_s=60),
                              key="critic.retry.max_wait_s", unavailable=RuntimeError, went_away=lambda e: True,
                              sleep=lambda s: None)
    assert out == "ok"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "timed out (the request may still be running there)" in lines[0]
    assert all("refused the connection or lost it" in line and "timed out" not in line for line in lines[1:])
