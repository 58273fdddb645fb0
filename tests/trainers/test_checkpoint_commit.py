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
    from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic

    cfg = SimpleNamespace(url=f"http://127.0.0.1:{free_ports(1)[0]}", timeout_s=600, init_timeout_s=2,
                          micro_batch_size=4, retry=RetryConfig(max_wait_s=600))
    critic = RemoteCritic(cfg, check=False)
    critic.committed_step = critic.expected_step = 12
    start = time.monotonic()
    critic.save(tmp_path)
    assert time.monotonic() - start < 30  # the retry window is 600 s
    assert json.loads((tmp_path / "critic.json").read_text())["server_step"] == 12


class _NonWriterRank:
    """Rank 1 of a job: ``on_writer`` hands back what the writer rank decided (``decided``), never running ``fn``."""

    global_rank, data_parallel_rank, data_parallel_size = 1, 1, 2

    def __init__(self, decided) -> None:
        self.decided, self.asked = decided, 0

    def on_writer(self, fn):
        self.asked += 1
        return self.decided

    def barrier(self) -> None:
        pass


def test_latest_is_the_writers_decision_and_only_the_writer_moves_a_replaced_step_back(tmp_path):
    """Issue 39: ``latest()`` renamed ``.replaced`` back on every rank (two ranks racing over one shared directory).
    A non-writer rank now takes the writer's answer and touches nothing, whatever its own view shows."""
    from nemo_factuality.trainers.parallel import DataParallel

    ck = Checkpointer(tmp_path, keep=2)
    ck.save(1, _Actor("first"), None, {"step": 1})
    root = tmp_path / "checkpoints"
    os.replace(root / "step_000001", root / ".step_000001.replaced")  # killed mid re-save
    rank1 = _NonWriterRank(("step_000001", None))
    assert Checkpointer(tmp_path, keep=2, parallel=DataParallel(rank1)).latest() == root / "step_000001"
    assert rank1.asked == 1 and (root / ".step_000001.replaced").is_dir() and not (root / "step_000001").exists()
    # the writer (world 1 here) decides and moves it back
    assert Checkpointer(tmp_path, keep=2).latest() == root / "step_000001"
    assert (root / "step_000001" / "weights.txt").read_text() == "first"
    # the writer's "incomplete" is the same one-line error on every rank
    with pytest.raises(FactualityInputError, match="which is incomplete"):
        Checkpointer(tmp_path, keep=2, parallel=DataParallel(_NonWriterRank((None, "latest names step_9, which is "
                                                                                  "incomplete")))).latest()


def test_skipping_a_resave_is_the_writers_decision(tmp_path):
    """``save()``'s early return (the same step and state already written) rested on each rank's ``is_dir()``; a rank
    whose view differed skipped the save's barriers that the others entered. Now the writer's view decides."""
    from nemo_factuality.trainers.parallel import DataParallel

    rank1 = _NonWriterRank(False)  # the writer does not see step_000001: everyone saves again
    ck = Checkpointer(tmp_path, keep=2, parallel=DataParallel(rank1))
    ck._written = (1, json.dumps({"step": 1}, sort_keys=True, default=str))
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)  # this rank's own (stale) view says it exists
    (tmp_path / "checkpoints" / ".step_000001.partial").mkdir()  # the writer made the temporary directory
    ck.save(1, _Actor("again"), None, {"step": 1})
    assert rank1.asked == 1
    assert (tmp_path / "checkpoints" / ".step_000001.partial" / "weights.txt").read_text() == "again"
