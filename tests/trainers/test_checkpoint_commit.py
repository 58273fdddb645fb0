"""A checkpoint is one commit (issue: a re-save deleted the step it replaced first; the critic's own pointer moved
before the actor's rename; a dead critic server was asked to save and the run ended with no checkpoint).

* A re-save of the same step killed between its two renames leaves the old one, which the next ``latest()`` finds.
* A (re)started critic server resumes from the critic step the run's committed checkpoint names, not its own newest
  save, and pruning never removes that step (a kill between the critic's save and the actor's rename leaves the pair
  at their previous shared step).
* Saving with the critic server gone takes one short probe, not a second retry window, and pairs the actor with
  the critic's last committed step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_factuality.trainers.config import RetryConfig
from nemo_factuality.trainers.runtime import Checkpointer
from nemo_factuality.types import FactualityInputError


class _Actor:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def save(self, path: Path) -> None:
        (Path(path) / "weights.txt").write_text(self.tag)


def test_a_resave_killed_between_its_renames_leaves_the_old_step(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(1, _Actor("first"), None, {"step": 1})
    real_replace = os.replace

    def killed_after_moving_aside(src, dst):
        if str(src).endswith(".step_000001.partial"):
            raise KeyboardInterrupt("killed")  # the process dies here: the new one never moved in
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        ck.save(1, _Actor("second"), None, {"step": 1}, force=True)
    monkeypatch.setattr(os, "replace", real_replace)
    latest = Checkpointer(tmp_path, keep=2).latest()  # a new process resuming
    assert latest is not None and (latest / "weights.txt").read_text() == "first"


def _run_checkpoint(log_dir: Path, name: str, server_step: int | None) -> None:
    ckpt = log_dir / "checkpoints" / name
    ckpt.mkdir(parents=True)
    (ckpt / "critic.json").write_text(json.dumps({"url": "http://c:1", "server_step": server_step}))
    (log_dir / "checkpoints" / "latest").write_text(name)


def test_the_critic_resumes_from_the_step_the_committed_checkpoint_names(tmp_path):
    from nemo_factuality.trainers.critic_server import _latest, _prune

    critic = tmp_path / "critic" / "checkpoints"
    for step in (3, 4, 5):
        (critic / f"server_step_{step:08d}" / "state").mkdir(parents=True)
    (critic / "latest.json").write_text(json.dumps({"dir": "server_step_00000005", "server_step": 5}))
    assert _latest(critic) is None  # the run has no checkpoint: a fresh critic, as the actor starts fresh
    # the critic saved step 5, then the job died before the actor's step_000005 was renamed in: the run's latest is 4
    _run_checkpoint(tmp_path, "step_000004", 4)
    assert _latest(critic) == (critic / "server_step_00000004" / "state", 4)
    _prune(critic, keep=1)  # keep the newest and the committed one
    assert sorted(p.name for p in critic.glob("server_step_*")) == ["server_step_00000004", "server_step_00000005"]
    _run_checkpoint(tmp_path, "step_000006", None)  # saved while the critic had no checkpoint: fresh
    assert _latest(critic) is None
    _run_checkpoint(tmp_path, "step_000007", 3)  # pruned above: one line, not a silent fresh critic
    with pytest.raises(FactualityInputError, match="server step 3"):
        _latest(critic)


def test_saving_with_the_critic_server_gone_keeps_the_committed_pairing_without_a_second_window(tmp_path):
    pytest.importorskip("pytriton")
    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.trainers.backends.aligner_critic import RemoteCritic

    cfg = SimpleNamespace(url=f"http://127.0.0.1:{free_ports(1)[0]}", timeout_s=600, init_timeout_s=2,
                          micro_batch_size=4, retry=RetryConfig(max_wait_s=600))
    critic = RemoteCritic(cfg, check=False)
    critic.committed_step = critic.expected_step = 12
    start = time.monotonic()
    critic.save(tmp_path)
    assert time.monotonic() - start < 30  # the retry window is 600 s
    assert json.loads((tmp_path / "critic.json").read_text())["server_step"] == 12
