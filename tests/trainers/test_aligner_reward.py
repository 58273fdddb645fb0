"""Reward-server hygiene for the aligner backend: a server that is down or still loading its models is waited
for within the window, then fails naming the URL and the model; Aligner's own client (in its venv) fails a request
within our timeout and leaves no thread behind when the block raises."""

from __future__ import annotations

import contextlib
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


def _triton_like(ready_after_s: dict[str, float]):
    """A loopback server with Triton's readiness answers: ``/v2/models/<m>/ready`` is 200 from ``ready_after_s[m]``
    seconds after the start and 400 before (and for any other model), as Triton answers a model it is still
    loading or does not serve; any other route is 404."""
    start = time.monotonic()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            parts = self.path.strip("/").split("/")
            if len(parts) != 4 or parts[:2] != ["v2", "models"] or parts[3] != "ready":
                self.send_response(404)
            else:
                after = ready_after_s.get(parts[2])
                self.send_response(200 if after is not None and time.monotonic() - start >= after else 400)
            self.end_headers()

        def log_message(self, *args):
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@contextlib.contextmanager
def serving(ready_after_s: dict[str, float]):
    server = _triton_like(ready_after_s)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_model_still_loading_is_waited_for_and_one_never_served_fails_after_the_window_naming_it():
    with serving({"factuality_reward": 1.0}) as url:
        t0 = time.monotonic()
        check_reward_server(url, "factuality_reward", timeout_s=20)  # Triton's 400 while loading: wait, not fail
        assert 1.0 <= time.monotonic() - t0 < 10
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError, match="HTTP 400 for /v2/models/reward_model/ready: still loading"):
            check_reward_server(url, "reward_model", timeout_s=1.5)
        assert 1.5 <= time.monotonic() - t0 < 6


def test_a_port_that_is_not_triton_fails_at_once():
    with serving({}) as url:
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError, match="HTTP 404"):
            check_reward_server(url + "/elsewhere", "factuality_reward", timeout_s=30)
        assert time.monotonic() - t0 < 5


def test_the_critic_client_starts_once_every_model_a_step_uses_is_ready():
    """Triton readies a server's models one by one: critic_infer answering says nothing of critic_state (a loaded
    CI node took over 10 s between them, and the first critic_state request timed out)."""
    from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic, RemoteCriticError

    ready = {"critic_infer": 0.2, "critic_train": 0.6, "critic_state": 1.5}
    with serving(ready) as url:
        t0 = time.monotonic()
        RemoteCritic(SimpleNamespace(url=url, timeout_s=5, init_timeout_s=20, micro_batch_size=4))
        assert time.monotonic() - t0 >= 1.5  # it returned only once critic_state was ready
    with serving({"critic_infer": 0.0, "critic_train": 0.0}) as url, pytest.raises(RemoteCriticError, match="critic_state"):
        RemoteCritic(SimpleNamespace(url=url, timeout_s=5, init_timeout_s=1.0, micro_batch_size=4))


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
