"""RLFH's dense-reward PPO on the aligner backend: NeMo-Aligner's Megatron actor + Aligner's critic server.

The critic server (``nemo_factuality.trainers.critic_server``, Aligner's ``CriticServerTrainer`` on a
``MegatronGPTCriticModel`` initialised from the policy .nemo with a zero value head) runs in the Aligner
venv on loopback; the PPO stage (``PPOTrainer``) drives the actor in a second process and reaches the
critic through ``RemoteCritic``. Checked: the first critic step's loss is Aligner's clipped value loss for
values that are all 0, the critic learns, the stage checkpoints and resumes with the server at the saved
step (and refuses a checkpoint from another step), and a restarted server resumes its own latest
checkpoint with the same weights. Skips with the reason when the venv is absent.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_factuality.testing.aligner_env import run_in_aligner_venv
from nemo_factuality.testing.ports import free_ports
from nemo_factuality.testing.servers import critic_server, ppo_overrides
from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic, RemoteCriticError
from nemo_factuality.trainers.interfaces import Rollout

pytestmark = pytest.mark.slow


def run_ppo(venv: Path, nemo: Path, tmp_path: Path, port: int, *, nproc: int = 1,
            critic_optimizer: str | None = None) -> list[dict]:
    """The critic server, then the PPO scenario (2 steps + a resumed 3rd) on ``nproc`` data-parallel ranks;
    every rank's result, after the checks of the scenario itself (loss, learning, checkpoints, the stale refusal)."""
    run_dir = tmp_path / "run"
    overrides = ppo_overrides(nemo, run_dir, port, critic_optimizer=critic_optimizer)
    (tmp_path / "overrides.json").write_text(json.dumps(overrides))
    log = tmp_path / "critic_server.log"
    with critic_server(venv, overrides, port, log):
        res = run_in_aligner_venv(venv, ["tests/trainers/aligner_driver.py", f"--nemo={nemo}", f"--out={tmp_path}",
                                         "--scenario=ppo", f"--overrides={tmp_path / 'overrides.json'}"], nproc=nproc,
                                  timeout=420, preload=True)
        assert res.returncode == 0, res.stdout[-6000:] + "\n--- critic server ---\n" + log.read_text()[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    metrics = ranks[0]["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for result in ranks:  # one minibatch per step and 1 epoch: one critic_train request (one server step) per step
        assert result["metrics"] == metrics and len(result["critic_calls"]) == 3 and result["server_step"] == 3
    # step 1: the value head is zero, so Aligner's clipped loss is 0.5·Σ mask·R² / Σ mask over the whole minibatch
    first = [r["critic_calls"][0] for r in ranks]
    assert all(c["old_values_absmax"] == 0.0 for c in first) and metrics[0]["values/mean"] == 0.0
    expected = 0.5 * sum(c["sum_mask_r2"] for c in first) / sum(c["sum_mask"] for c in first)
    assert first[0]["server_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics[2]["values/mean"] != 0.0 and ranks[0]["critic_calls"][2]["old_values_absmax"] > 0  # it trained
    for m in metrics:
        assert m["grad_norm"] > 0 and m["actor_trained"] == 1.0
    assert {"step_000002", "step_000003"} <= set(ranks[0]["checkpoints"])
    assert "restart the critic server" in ranks[0]["stale_error"]
    critic_rows = (run_dir / "critic" / "metrics.jsonl").read_text().splitlines()
    assert len(critic_rows) == 3 and all("train/loss" in json.loads(r) for r in critic_rows)
    return ranks


def test_rlfh_ppo_at_data_parallel_2_with_aligners_critic_server_and_a_restarted_server(venv, stage_policy, tmp_path):
    """Two data-parallel ranks, each with half of a minibatch: the critic sees the whole minibatch once per step. The
    critic server runs on the presets' optimizer (Megatron-Core's distributed optimizer): its sharded state goes into
    the server's checkpoints and a restarted server resumes from them. (The default optimizer's critic server is
    trained at TP=2, PP=2 and DP=2 by test_aligner_methods.py; a world-1 actor sends the same gather of one shard.)"""
    port = free_ports(1)[0]
    ranks = run_ppo(venv, stage_policy, tmp_path, port, nproc=2, critic_optimizer="mcore_distributed_optim")
    assert sorted(r["dp_rank"] for r in ranks) == [0, 1] and all(r["dp_size"] == 2 for r in ranks)
    assert all(r["critic_calls"][0]["sum_mask"] > 0 for r in ranks)  # both halves carried tokens into the step
    # a requeued job: the restarted server resumes its latest checkpoint, weights and step included. It listens on a
    # new port: the old one, free since the first server stopped, may be another connection's ephemeral port by now
    port = free_ports(1)[0]
    run_dir, log = tmp_path / "run", tmp_path / "critic_server.log"
    overrides = ppo_overrides(stage_policy, run_dir, port, critic_optimizer="mcore_distributed_optim")
    with critic_server(venv, overrides, port, log):
        critic = RemoteCritic(SimpleNamespace(url=f"http://127.0.0.1:{port}", timeout_s=60, init_timeout_s=10,
                                              micro_batch_size=4))
        assert critic.server_step() == 3
        probe = ranks[0]["probe"]
        rollout = Rollout(torch.tensor(probe["tokens"]), torch.tensor(probe["prompt_lengths"]),
                          torch.tensor(probe["response_lengths"]), torch.ones(len(probe["tokens"]), dtype=torch.bool))
        assert torch.allclose(critic.values(rollout), torch.tensor(probe["values"]), atol=1e-6)
        critic.load(run_dir / "checkpoints" / "step_000003")  # the stage's latest checkpoint matches the server


def test_a_critic_server_that_is_not_there_fails_at_start_naming_the_url():
    port = free_ports(1)[0]
    t0 = time.monotonic()
    with pytest.raises(RemoteCriticError) as err:
        RemoteCritic(SimpleNamespace(url=f"http://127.0.0.1:{port}", timeout_s=5, init_timeout_s=1.5, micro_batch_size=4))
    assert time.monotonic() - t0 < 6
    assert f"http://127.0.0.1:{port}" in str(err.value) and "critic_server" in str(err.value)
