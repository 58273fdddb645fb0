"""The PPO critic client (``RemoteCritic``) against a critic server that goes away: a real PyTriton server speaking
NeMo-Aligner's critic protocol with scripted arithmetic for weights (``testing/scripted_critic.py``), killed and
restarted. The client waits and resends; a server back at the run's step continues the step, one whose update went
through before the connection dropped is not trained twice, one back at an older step stops the run without a
checkpoint, and one that stays away past ``critic.retry.max_wait_s`` ends it with exit 75."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_factuality.testing.ports import free_ports
from nemo_factuality.testing.servers import subprocess_env
from nemo_factuality.trainers.backends.aligner_critic import (
    CriticServerRestarted,
    CriticServerUnavailable,
    RemoteCritic,
)
from nemo_factuality.trainers.backends.aligner_reward import check_reward_server
from nemo_factuality.trainers.config import RetryConfig
from nemo_factuality.trainers.interfaces import Rollout

pytest.importorskip("pytriton")
pytestmark = pytest.mark.slow


class _Critic:
    """The scripted critic in its own process group on ``port``, resuming from the step in ``state``."""

    def __init__(self, port: int, state: Path, log: Path) -> None:
        self.port, self.state, self.log, self.proc = port, state, log, None
        self.home = tempfile.mkdtemp(prefix="pyt_")  # short: Triton's Unix sockets (108-byte path limit)

    def start(self, *flags: str) -> None:
        with self.log.open("a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "nemo_factuality.testing.scripted_critic",
                                          f"--port={self.port}", f"--state={self.state}", *flags],
                                         env=subprocess_env(PYTRITON_HOME=self.home), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        check_reward_server(f"http://127.0.0.1:{self.port}", "critic_infer", timeout_s=120)

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and Triton in its group, nothing else
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            time.sleep(0.5)

    def restart_later(self, delay_s: float, *flags: str) -> threading.Thread:
        def go() -> None:
            time.sleep(delay_s)
            self.start(*flags)

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        return thread


@pytest.fixture()
def critic_server(tmp_path):
    server = _Critic(free_ports(1)[0], tmp_path / "state", tmp_path / "critic.log")
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(server.home, ignore_errors=True)


def _client(port: int, max_wait_s: float) -> RemoteCritic:
    retry = RetryConfig(max_wait_s=max_wait_s, initial_s=0.3, max_s=1.0)
    return RemoteCritic(SimpleNamespace(url=f"http://127.0.0.1:{port}", timeout_s=20, init_timeout_s=1, micro_batch_size=4,
                                        retry=retry))


ROLLOUT = Rollout(torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]), torch.tensor([2, 2]), torch.tensor([5, 3]),
                  torch.tensor([True, True]))
BATCH = {"tokens": ROLLOUT.tokens, "returns": torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 3.0, 0.0, 0.0]]),
         "old_values": torch.zeros(2, 4), "mask": torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])}


def test_a_critic_back_at_the_runs_step_continues_the_same_requests(critic_server):
    critic_server.state.write_text("3")
    critic_server.start()
    critic = _client(critic_server.port, 120)
    before = critic.values(ROLLOUT)
    assert critic.expected_step == 3
    critic_server.kill()
    back = critic_server.restart_later(1.0)  # a restart (deploy, node drain) from its checkpoint at the same step
    again = critic.values(ROLLOUT)  # waits, then resends the same request
    back.join(timeout=120)
    assert torch.equal(before, again)
    critic_server.kill()
    critic_server.restart_later(1.0)
    loss = critic.train_step(BATCH, lambda *a: None, micro_batch_size=2)["critic/server_loss"]
    assert loss == pytest.approx(5.0 / 4)  # the mask-weighted mean of the returns: one step, once
    assert critic.server_step() == 4 == int(critic_server.state.read_text())


def test_an_update_that_went_through_before_the_connection_dropped_is_not_applied_twice(critic_server):
    critic_server.state.write_text("7")
    critic_server.start("--exit-after-train")  # applies the step, dies before answering
    critic = _client(critic_server.port, 120)
    critic.server_step()
    watcher = threading.Thread(target=lambda: (critic_server.proc.wait(), critic_server.kill(), critic_server.start()),
                               daemon=True)
    watcher.start()
    out = critic.train_step(BATCH, lambda *a: None, micro_batch_size=2)
    watcher.join(timeout=120)
    assert math.isnan(out["critic/server_loss"])  # the loss was lost with the connection, and is said to be
    assert critic.expected_step == 8 == critic.server_step() == int(critic_server.state.read_text())


def test_a_critic_back_at_an_older_step_stops_the_run_without_a_checkpoint(critic_server):
    critic_server.state.write_text("5")
    critic_server.start()
    critic = _client(critic_server.port, 120)
    critic.server_step()
    critic_server.kill()
    critic_server.state.write_text("2")  # its latest checkpoint is older than the run
    critic_server.restart_later(1.0)
    with pytest.raises(CriticServerRestarted) as err:
        critic.values(ROLLOUT)
    assert err.value.checkpoint_safe is False and err.value.EXIT_CODE == 75
    assert "step 2" in str(err.value) and "at step 5" in str(err.value)


def test_a_critic_gone_past_the_window_is_a_temporary_failure_naming_the_url_and_key(critic_server):
    critic_server.start()
    critic = _client(critic_server.port, 2)
    critic.server_step()
    critic_server.kill()
    t0 = time.monotonic()
    with pytest.raises(CriticServerUnavailable) as err:
        critic.values(ROLLOUT)
    assert time.monotonic() - t0 < 30
    assert f"127.0.0.1:{critic_server.port}" in str(err.value) and "critic.retry.max_wait_s=2" in str(err.value)
    assert getattr(err.value, "checkpoint_safe", True) and err.value.EXIT_CODE == 75
