"""Reward-server hygiene for the aligner backend: a server that is down or lacks the model fails fast and
names the URL; Aligner's own client (in its venv) fails a request within our timeout and leaves no
thread behind when the block raises."""

from __future__ import annotations

import http.server
import threading
import time
from types import SimpleNamespace

import pytest

from nemo_factuality.serving.client import RemoteRewardError
from nemo_factuality.testing.aligner_env import aligner_venv, run_in_aligner_venv, skip_reason
from nemo_factuality.testing.ports import free_ports
from nemo_factuality.trainers.backends.aligner.reward import _endpoint, check_reward_server


def test_a_closed_port_fails_within_the_timeout_naming_the_url():
    port = free_ports(1)[0]
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        check_reward_server(f"http://127.0.0.1:{port}", "factuality_reward", timeout_s=1.5)
    assert time.monotonic() - t0 < 6
    message = str(err.value)
    assert f"http://127.0.0.1:{port}" in message and "factuality_reward" in message and "remote_rm" in message


class _Triton(http.server.BaseHTTPRequestHandler):
    """Answers Triton's readiness route: ready for ``factuality_reward`` only."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/v2/models/factuality_reward/ready" else 400)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def triton_like():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Triton)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_server_without_the_model_fails_at_once_and_a_ready_one_passes(triton_like):
    check_reward_server(triton_like, "factuality_reward", timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError, match="HTTP 400 for /v2/models/reward_model/ready"):
        check_reward_server(triton_like, "reward_model", timeout_s=30)
    assert time.monotonic() - t0 < 5  # no point waiting: the server is up, the model is not there


def test_endpoint_from_url_or_ip_port_and_a_clear_error_without_either():
    rm = SimpleNamespace(url="http://reward-node:5555", reward_model=SimpleNamespace(name="factuality_reward", ip=None, port=1))
    assert _endpoint(rm) == ("reward-node", 5555, "factuality_reward")
    rm = SimpleNamespace(url=None, reward_model=SimpleNamespace(name="reward_model", ip="10.0.0.2", port=5556))
    assert _endpoint(rm) == ("10.0.0.2", 5556, "reward_model")
    with pytest.raises(RemoteRewardError, match="remote_rm"):
        _endpoint(SimpleNamespace(url=None, reward_model=SimpleNamespace(name="r", ip=None, port=5555)))


@pytest.mark.slow
def test_aligners_client_fails_a_request_in_bounded_time_and_closes_its_threads():
    venv = aligner_venv()
    if venv is None:
        pytest.skip(skip_reason())
    port = free_ports(1)[0]
    t0 = time.monotonic()
    res = run_in_aligner_venv(venv, ["tests/trainers/aligner_reward_driver.py", str(port)], timeout=120)
    assert res.returncode == 0, res.stdout[-4000:]
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("OK "), res.stdout[-3000:]
    assert f"http://127.0.0.1:{port}" in last
    assert time.monotonic() - t0 < 100
