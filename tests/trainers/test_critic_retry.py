"""The PPO critic client (``RemoteCritic``) against a critic server that goes away: a real PyTriton server speaking
NeMo-Aligner's critic protocol with scripted arithmetic for weights (``testing/scripted_critic.py``), killed and
restarted. The client waits and resends; a server back at the run's step continues the step, one whose update went
through before the connection dropped is not trained twice, one back at an older step stops the run without a
checkpoint, and one that stays away past ``critic.retry.max_wait_s`` ends it with exit 75."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from nemo_factuality.testing.ports import free_ports
from nemo_factuality.testing.servers import kill_group, subprocess_env
from nemo_factuality.trainers.backends.aligner.critic import (
    CriticServerRestarted,
    CriticServerUnavailable,
    RemoteCritic,
)
from nemo_factuality.trainers.config import RetryConfig
from nemo_factuality.trainers.interfaces import Rollout

pytest.importorskip("pytriton")
# waits: mostly on critic servers starting and on retry windows (tests/conftest.py gives it the waiting lane)
pytestmark = [pytest.mark.slow, pytest.mark.waits,
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]


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
        deadline = time.monotonic() + 120  # Triton answers 400 until the models are bound: wait for 200
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/v2/models/critic_state/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.3)

    def kill(self) -> None:
        if self.proc is not None:
            assert not kill_group(self.proc)  # the server and Triton in its group (and their shared memory), nothing else

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


def test_a_critic_that_comes_back_continues_the_step_unless_it_lost_steps_and_one_that_stays_away_ends_the_run(
        critic_server):
    """One server, four outages (each a kill and, but for the last, a restart from its checkpoint's step)."""
    critic_server.state.write_text("3")
    critic_server.start()
    critic = _client(critic_server.port, 120)
    before = critic.values(ROLLOUT)
    assert critic.expected_step == 3
    # 1. back at the same step (a deploy, a node drain): the same values request is sent again and answered
    critic_server.kill()
    back = critic_server.restart_later(1.0)
    assert torch.equal(before, critic.values(ROLLOUT))
    back.join(timeout=120)  # its readiness poll done before the next kill (the client may be answered first)
    # 2. a train request: sent again once the server is back, applied once
    critic_server.kill()
    back = critic_server.restart_later(1.0)
    loss = critic.train_step(BATCH, lambda *a: None, micro_batch_size=2)["critic/server_loss"]
    back.join(timeout=120)
    assert loss == pytest.approx(6.0 / 4)  # the mask-weighted mean of the returns: one step, once
    assert critic.server_step() == 4 == int(critic_server.state.read_text())
    # 3. back at an older step (its latest checkpoint is behind the run): no checkpoint may pair them, stop
    critic_server.kill()
    critic_server.state.write_text("2")
    back = critic_server.restart_later(1.0)
    with pytest.raises(CriticServerRestarted) as err:
        critic.values(ROLLOUT)
    back.join(timeout=120)
    assert err.value.checkpoint_safe is False and err.value.EXIT_CODE == 75
    assert "step 2" in str(err.value) and "at step 4" in str(err.value)
    # 4. gone past critic.retry.max_wait_s: a temporary failure (exit 75 after the stage's checkpoint)
    short = _client(critic_server.port, 2)  # (the server is up again, at step 2)
    short.server_step()
    critic_server.kill()
    t0 = time.monotonic()
    with pytest.raises(CriticServerUnavailable) as err:
        short.values(ROLLOUT)
    assert time.monotonic() - t0 < 30
    assert f"127.0.0.1:{critic_server.port}" in str(err.value) and "critic.retry.max_wait_s=2" in str(err.value)
    assert getattr(err.value, "checkpoint_safe", True) and err.value.EXIT_CODE == 75


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


@pytest.mark.parametrize("ids", [True, False], ids=["request-ids", "server-ignoring-ids"])
def test_a_slow_update_resent_after_a_timeout_is_applied_once(critic_server, ids):
    """The server is slow, not down: the client times out while the update is still running, the state query says
    the step has not moved, and the client resends. The resend carries the same request id, so the server answers it
    from the update it applied; a server that ignored ids would apply a second optimiser step for one minibatch."""
    critic_server.state.write_text("4")
    critic_server.start("--train-delay=4", *([] if ids else ["--ignore-request-id"]))
    retry = RetryConfig(max_wait_s=60, initial_s=0.2, max_s=0.5)
    critic = RemoteCritic(SimpleNamespace(url=f"http://127.0.0.1:{critic_server.port}", timeout_s=1.0, init_timeout_s=1,
                                          micro_batch_size=4, retry=retry))
    assert critic.server_step() == 4
    critic.train_step(BATCH, lambda *a: None, micro_batch_size=2)
    applied_log = Path(f"{critic_server.state}.applied")
    deadline = time.monotonic() + 30  # a queued resend finishes within two delays
    while time.monotonic() < deadline and (not ids and len(applied_log.read_text().split()) < 2):
        time.sleep(0.2)
    time.sleep(4.5)  # one more update's time: anything still queued has run
    applied = applied_log.read_text().split()
    if ids:
        assert applied == ["4"], applied  # one update, though the client sent it more than once
        assert critic.expected_step == 5 == critic.server_step() == int(critic_server.state.read_text())
    else:  # what the ids prevent: the resend applied as a second step, and the run would not know
        # (each resend after a timeout is another update: two or more, as the load decides the timing)
        assert len(applied) >= 2 and int(critic_server.state.read_text()) == 4 + len(applied)
