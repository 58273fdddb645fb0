"""Cluster-scale steps on the hf backend: rewards overlap generation and log-probs, KTO's reference once per
iteration, and no redundant log-prob pass on-policy.

Every comparison runs the same seed twice, once each way, and compares what the stage computed: per-sample
rewards, advantages, logged losses and the trained weights.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from nemo_factuality.testing.training import good_fraction, good_tokens_dense, half_good_labeller, prompts, set_dotted
from nemo_factuality.trainers import kto as kto_module
from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic
from nemo_factuality.trainers.config import GRPOConfig, KTOConfig, PPOConfig
from nemo_factuality.trainers.grpo import GRPOTrainer
from nemo_factuality.trainers.interfaces import Rollout, RolloutChunk, assemble_rollout
from nemo_factuality.trainers.kto import KTOTrainer
from nemo_factuality.trainers.ppo import PPOTrainer
from nemo_factuality.types import RewardBatch


class SlowReward:
    """A toy reward behind a judge's latency: records each call's size and the thread it ran on."""

    def __init__(self, reward, delay_s: float = 0.15) -> None:
        self.reward, self.delay_s, self.calls = reward, delay_s, []

    def __call__(self, prompts_, completions, **columns):
        self.calls.append((threading.current_thread().name, len(completions)))
        time.sleep(self.delay_s)
        return self.reward(prompts_, completions, **columns)


def failing_question_1(prompts_, completions, completion_ids, **columns):
    """``good_fraction``, except that the judge 'fails' on question 1: NaN with the reason in ``details``."""
    batch = good_fraction(prompts_, completions, completion_ids, **columns)
    failed = np.array([p == "question 1" for p in prompts_])
    batch.scores[failed] = np.nan
    batch.details = [{"error": "judge timed out"} if f else {} for f in failed]
    return batch


def _configure(cfg, policy, run_dir, **over):
    cfg.model.path, cfg.model.optim.lr = str(policy), 3e-3
    cfg.model.length_params.max_length = 6
    cfg.trainer.progress_bar, cfg.trainer.save_interval = False, 0
    cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(run_dir), False
    cfg.reward = {"name": "toy"}
    set_dotted(cfg, over)
    return cfg


def grpo_cfg(policy, run_dir, **over) -> GRPOConfig:
    base = {"model.global_batch_size": 8, "model.micro_batch_size": 4, "model.rollout_micro_batch_size": 8,
            "grpo.num_prompts_per_step": 4, "grpo.num_rollouts_per_prompt": 4, "grpo.truncated": "keep",
            "trainer.max_steps": 2}
    return _configure(GRPOConfig(), policy, run_dir, **{**base, **over})


class Recording:
    """Mixin: keeps each step's rewards and experience (what the advantages were computed from, and they)."""

    def _experience(self, rollout, rewards, logprobs):
        exp, metrics = super()._experience(rollout, rewards, logprobs)
        self.seen = getattr(self, "seen", [])
        records = [self.data[i] for i in self.step_prompts for _ in range(self._samples_per_prompt())]
        self.seen.append({"rollout": rollout, "rewards": rewards, "exp": exp, "records": records})
        return exp, metrics


class RecordingGRPO(Recording, GRPOTrainer):
    pass


class RecordingPPO(Recording, PPOTrainer):
    pass


def _grpo(cfg, reward, seed=0, cls=RecordingGRPO):
    torch.manual_seed(seed)
    actor = HFActor(cfg.model, max_steps=10)
    trainer = cls(cfg, actor, reward, prompts(8), run_dir=cfg.exp_manager.explicit_log_dir)
    return trainer, trainer.fit()


def _no_times(history):
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]


def _assert_same_steps(a, b):
    """Same rollouts, rewards (NaN where failed, with the reason), advantages and the same trained weights."""
    for x, y in zip(a.seen, b.seen, strict=True):
        assert torch.equal(x["rollout"].tokens, y["rollout"].tokens)
        assert np.array_equal(x["rewards"].scores, y["rewards"].scores, equal_nan=True)
        assert x["rewards"].details == y["rewards"].details
        for key in set(x["exp"]) | set(y["exp"]):
            assert torch.equal(x["exp"][key], y["exp"][key]), key
    for p, q in zip(a.actor.model.parameters(), b.actor.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_grpo_overlapped_step_equals_the_sequential_one(tiny_policy, tmp_path):
    """Two micro batches per step: the overlapped step scores each in the worker while the next is generated and
    the reference log-probs are computed; failed samples stay NaN with their reason in the same rows."""
    runs = {}
    for overlap in (False, True):
        reward = SlowReward(failing_question_1)
        cfg = grpo_cfg(tiny_policy, tmp_path / str(overlap), **{"grpo.overlap_reward": overlap})
        runs[overlap] = (*_grpo(cfg, reward), reward)
    (seq, seq_hist, seq_reward), (ovl, ovl_hist, ovl_reward) = runs[False], runs[True]
    assert _no_times(seq_hist) == _no_times(ovl_hist)
    _assert_same_steps(seq, ovl)
    # sequential: one call per step after generation, in the step's thread; overlapped: one per micro batch, in the worker
    assert seq_reward.calls == [("MainThread", 16)] * 2
    assert [n for _, n in ovl_reward.calls] == [8, 8] * 2 and all(t.startswith("reward") for t, _ in ovl_reward.calls)
    # the steps draw all 8 prompts: question 1's 4 samples failed, in their rows, with the reason
    failed = [(s, i) for s, seen in enumerate(ovl.seen) for i, d in enumerate(seen["rewards"].details) if d]
    assert len(failed) == 4 and len({s for s, _ in failed}) == 1
    step = ovl.seen[failed[0][0]]
    rows = [i for _, i in failed]
    assert all(step["records"][i].prompt == "question 1" for i in rows)
    assert all(math.isnan(step["rewards"].scores[i]) and step["rewards"].details[i] == {"error": "judge timed out"} for i in rows)
    assert not np.isnan(np.delete(step["rewards"].scores, rows)).any()
    for m in ovl_hist:  # time/reward: the calls' wall time; time/reward_exposed: what the step waited for
        assert m["time/reward"] >= 2 * 0.15 and m["time/reward_exposed"] < m["time/reward"]
    for m in seq_hist:
        assert m["time/reward_exposed"] >= m["time/reward"] >= 0.15


def test_ppo_overlapped_step_equals_the_sequential_one(tiny_policy, tmp_path):
    runs = {}
    for overlap in (False, True):
        cfg = _configure(PPOConfig(), tiny_policy, tmp_path / str(overlap), **{
            "model.global_batch_size": 8, "model.micro_batch_size": 4, "model.rollout_micro_batch_size": 4,
            "ppo.num_prompts_per_step": 8, "critic.micro_batch_size": 4, "trainer.max_steps": 2,
            "ppo.overlap_reward": overlap})
        torch.manual_seed(0)
        actor, critic = HFActor(cfg.model, max_steps=10), HFCritic(cfg.critic, cfg.model.path, max_steps=10)
        reward = SlowReward(good_tokens_dense)
        trainer = RecordingPPO(cfg, actor, critic, reward, prompts(8), run_dir=tmp_path / str(overlap))
        runs[overlap] = (trainer, trainer.fit(), reward)
    (seq, seq_hist, _), (ovl, ovl_hist, reward) = runs[False], runs[True]
    assert _no_times(seq_hist) == _no_times(ovl_hist)
    _assert_same_steps(seq, ovl)
    for x, y in zip(seq.seen, ovl.seen, strict=True):  # the dense token rewards, placed per token
        assert all(np.array_equal(u, v) for u, v in zip(x["rewards"].token_rewards, y["rewards"].token_rewards, strict=True))
    for p, q in zip(seq.critic.model.parameters(), ovl.critic.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [n for _, n in reward.calls] == [4, 4] * 2


def test_kto_overlapped_labelling_equals_the_sequential_one(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setattr(kto_module, "_GEN_CHUNK", 8)  # two labeller calls per iteration
    runs = {}
    for overlap in (False, True):
        cfg = _configure(KTOConfig(), tiny_policy, tmp_path / str(overlap), **{
            "model.global_batch_size": 8, "model.micro_batch_size": 4, "kto.num_iterations": 1,
            "kto.prompts_per_iteration": 4, "kto.samples_per_prompt": 4, "trainer.max_steps": 100,
            "kto.overlap_reward": overlap})
        torch.manual_seed(0)
        labeller = SlowReward(half_good_labeller)
        trainer = KTOTrainer(cfg, HFActor(cfg.model, max_steps=10), labeller, prompts(4), run_dir=tmp_path / str(overlap))
        logged = []
        log = trainer.logger.log
        trainer.logger.log = lambda step, m, log=log, logged=logged: (logged.append(dict(m)), log(step, m))[-1]
        trainer.fit()
        runs[overlap] = (trainer, logged, labeller)
    (seq, seq_log, seq_labeller), (ovl, ovl_log, ovl_labeller) = runs[False], runs[True]
    assert _no_times(seq_log) == _no_times(ovl_log) and ovl_log[0]["kto/dropped_unlabelled"] >= 1
    for key in seq.last_data:
        assert torch.equal(seq.last_data[key], ovl.last_data[key]), key
    for p, q in zip(seq.actor.model.parameters(), ovl.actor.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [n for _, n in seq_labeller.calls] == [n for _, n in ovl_labeller.calls] == [8, 8]
    assert all(t == "MainThread" for t, _ in seq_labeller.calls) and all(t.startswith("reward") for t, _ in ovl_labeller.calls)
    assert ovl_log[0]["time/reward_exposed"] < ovl_log[0]["time/reward"]


class JudgeDown(RuntimeError):
    pass


def test_an_exception_in_the_reward_worker_reaches_the_step_unchanged(tiny_policy, tmp_path):
    """The second of three micro batches fails: the step raises that very exception (what a stage's error handling
    sees, e.g. a reward server that stayed down), the third is never scored, and no worker thread is left."""
    calls = []

    def reward(prompts_, completions, **columns):
        calls.append(len(completions))
        if len(calls) == 2:
            reward.raised = JudgeDown("reward server stayed down")
            raise reward.raised
        return good_fraction(prompts_, completions, **columns)

    cfg = grpo_cfg(tiny_policy, tmp_path / "down", **{"grpo.num_prompts_per_step": 6, "model.rollout_micro_batch_size": 8,
                                                     "model.global_batch_size": 24, "model.micro_batch_size": 8})
    torch.manual_seed(0)
    trainer = GRPOTrainer(cfg, HFActor(cfg.model, max_steps=10), reward, prompts(8), run_dir=tmp_path / "down")
    with pytest.raises(JudgeDown) as err:
        trainer.train_one_step()
    assert err.value is reward.raised and calls == [8, 8]
    deadline = time.monotonic() + 10
    while any(t.name.startswith("reward") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("reward")]


def test_chunks_assemble_in_prompt_order():
    def chunk(rows, lengths):
        n = len(rows)
        tokens = torch.tensor([[r] * w + [9] * (max(lengths) - w) for r, w in zip(rows, lengths, strict=True)])
        return RolloutChunk(rows, Rollout(tokens, torch.ones(n, dtype=torch.long), torch.tensor(lengths),
                                          torch.tensor([r % 2 == 0 for r in rows])))

    rollout = assemble_rollout([chunk([2, 0], [3, 2]), chunk([1], [5])], pad_id=9)
    assert rollout.tokens.tolist() == [[0, 0, 9, 9, 9], [1, 1, 1, 1, 1], [2, 2, 2, 9, 9]]
    assert rollout.response_lengths.tolist() == [2, 5, 3] and rollout.is_end.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="not each of"):
        assemble_rollout([chunk([0, 0], [1, 1])], pad_id=9)
    batch = RewardBatch(np.array([1.0, np.nan, 3.0]), {"c": np.array([4.0, 5.0, 6.0])}, details=[{"a": 1}, {}, {}])
    taken = batch.take([2, 0])
    assert taken.scores.tolist() == [3.0, 1.0] and taken.components["c"].tolist() == [6.0, 4.0]
    assert taken.details == [{}, {"a": 1}]


# ------------------------------------------------------------------------------------------ no redundant pass
class OldPathGRPO(RecordingGRPO):
    def reuses_training_logprobs(self) -> bool:
        return False  # the old path: a no-grad pass for the old log-probs before the update


def _count_calls(actor, name):
    counter = {"n": 0}
    original = getattr(actor, name)

    def counted(*args, **kwargs):
        counter["n"] += 1
        return original(*args, **kwargs)

    setattr(actor, name, counted)
    return counter


def test_on_policy_grpo_uses_the_training_forward_as_old_logprobs(tiny_policy, tmp_path):
    """One epoch, one minibatch: no log-prob pass before the update, ratio exactly 1, and the loss, KL, gradients
    and weights of the old path (which computed old log-probs with an extra no-grad pass)."""
    results = {}
    for cls in (OldPathGRPO, RecordingGRPO):
        cfg = grpo_cfg(tiny_policy, tmp_path / cls.__name__, **{"model.global_batch_size": 16, "trainer.max_steps": 1})
        torch.manual_seed(0)
        actor = HFActor(cfg.model, max_steps=10)
        passes = _count_calls(actor, "logprobs")
        trainer = cls(cfg, actor, good_fraction, prompts(8), run_dir=tmp_path / cls.__name__)
        results[cls] = (trainer, trainer.fit()[0], passes["n"])
    (old, old_m, old_passes), (new, new_m, new_passes) = results[OldPathGRPO], results[RecordingGRPO]
    assert new.reuses_training_logprobs() and (old_passes, new_passes) == (1, 0)
    assert "old_logprobs" not in new.seen[0]["exp"] and torch.equal(old.seen[0]["rollout"].tokens, new.seen[0]["rollout"].tokens)
    assert new_m["clipfrac"] == 0.0 and new_m["approx_kl"] == 0.0 and new_m["optimizer_steps"] == 1
    for key in ("loss/policy", "loss/kl", "kl", "grad_norm"):
        assert new_m[key] == pytest.approx(old_m[key], rel=1e-5, abs=1e-7), key
    assert new_m["kl"] == 0.0 or new_m["kl"] > 0  # a real estimate: the first step's policy is its reference
    for p, q in zip(old.actor.model.parameters(), new.actor.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_the_extra_pass_stays_where_it_is_needed(tiny_policy, tmp_path):
    def reuses(**over) -> bool:
        cfg = grpo_cfg(tiny_policy, tmp_path / "probe", **{"model.global_batch_size": 16, **over})
        return GRPOTrainer(cfg, HFActor(cfg.model, max_steps=1), good_fraction, prompts(8),
                           run_dir=tmp_path / "probe").reuses_training_logprobs()

    assert reuses()
    assert not reuses(**{"model.global_batch_size": 8})  # two minibatches: the second is off-policy
    assert not reuses(**{"grpo.num_epochs": 2})
    assert not reuses(**{"grpo.kl_in": "reward"})  # Aligner's REINFORCE: the KL shapes the reward before the update


# ------------------------------------------------------------------------------------------ KTO's reference
def _kto(policy, run_dir, precompute: bool):
    cfg = _configure(KTOConfig(), policy, run_dir, **{
        "model.global_batch_size": 8, "model.micro_batch_size": 4, "model.optim.lr": 2e-3, "kto.num_iterations": 2,
        "kto.prompts_per_iteration": 6, "kto.samples_per_prompt": 4, "kto.epochs_per_iteration": 2,
        "trainer.max_steps": 100, "kto.precompute_reference": precompute})
    torch.manual_seed(0)
    actor = HFActor(cfg.model, max_steps=100)
    counts = {name: _count_calls(actor, name) for name in ("reference_logprobs", "logprobs")}
    trainer = KTOTrainer(cfg, actor, half_good_labeller, prompts(6), run_dir=run_dir)
    logged = []
    log = trainer.logger.log
    trainer.logger.log = lambda step, m: (logged.append(dict(m)), log(step, m))[-1]
    trainer.fit()
    return trainer, logged, {k: v["n"] for k, v in counts.items()}


def test_kto_reference_logprobs_once_per_iteration_equal_the_per_step_ones(tiny_policy, tmp_path):
    """2 iterations × 2 epochs of 3 minibatches (23 examples, the last minibatch of 7): the old path runs the
    reference at collection and again for z0's pairs at every optimiser step; the new one once per iteration, and
    every logged loss and z0 and the trained weights are the old path's."""
    old, old_log, old_calls = _kto(tiny_policy, tmp_path / "old", precompute=False)
    new, new_log, new_calls = _kto(tiny_policy, tmp_path / "new", precompute=True)
    steps = len(new_log)
    assert steps == len(old_log) == 2 * 2 * 3
    assert new_calls == {"reference_logprobs": 2, "logprobs": steps}
    assert old_calls == {"reference_logprobs": 2 + steps, "logprobs": steps}
    for a, b in zip(old_log, new_log, strict=True):
        for key in ("loss/kto", "loss/fkto", "kto/z0", "kto/z0_f", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert any(m["kto/z0"] > 0 for m in new_log)  # z0 is not trivially 0 after the first steps
    assert torch.allclose(old.last_data["ref_logprobs"], new.last_data["ref_logprobs"], atol=1e-5)
    for p, q in zip(old.actor.model.parameters(), new.actor.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)
