"""The GRPO stage on the hf backend: learning on a toy reward, the advantage rules, checkpoint/resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nemo_factuality.testing.training import good_fraction, grpo_test_config, prompts, read_metrics
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import GRPOConfig
from nemo_factuality.trainers.grpo import GRPOTrainer
from nemo_factuality.trainers.interfaces import Rollout
from nemo_factuality.types import RewardBatch


def grpo_cfg(policy, run_dir, **over) -> GRPOConfig:
    cfg = grpo_test_config(policy, run_dir, **over)
    cfg.reward = {"name": "toy"}
    return cfg


def run(cfg, reward, n_prompts=8, seed=0):
    torch.manual_seed(seed)
    actor = HFActor(cfg.model, max_steps=100)
    trainer = GRPOTrainer(cfg, actor, reward, prompts(n_prompts), run_dir=cfg.exp_manager.explicit_log_dir)
    return trainer.fit(), actor


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_raises_a_known_reward_well_outside_noise(tiny_policy, tmp_path, seed):
    history, _ = run(grpo_cfg(tiny_policy, tmp_path / "run"), good_fraction, seed=seed)
    rewards = [h["reward/score"] for h in history]
    start, end = np.mean(rewards[:3]), np.mean(rewards[-3:])
    noise = np.std(rewards[:3]) + 1e-3  # step-to-step spread of the untrained policy
    assert end - start > 0.25 and end - start > 5 * noise, rewards
    assert all(math.isfinite(h["loss/policy"]) and math.isfinite(h["loss/kl"]) for h in history)


def _synthetic(trainer, scores, is_end, signs=None):
    """Two prompts × two samples of a fixed rollout through make_experience."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0]] * 4)
    rollout = Rollout(tokens, torch.tensor([2, 2, 2, 2]), torch.tensor([6, 6, 5, 6]), torch.tensor(is_end))
    return trainer.make_experience(rollout, np.array(scores, dtype=np.float64), signs)


@pytest.fixture()
def trainer(tiny_policy, tmp_path):
    cfg = grpo_cfg(tiny_policy, tmp_path / "unit", **{"grpo.num_prompts_per_step": 2, "grpo.num_rollouts_per_prompt": 2,
                                                      "grpo.truncated": "mask", "grpo.initial_policy_kl_penalty": 0.0})
    return GRPOTrainer(cfg, HFActor(cfg.model, max_steps=1), good_fraction, prompts(2), run_dir=tmp_path / "unit")


def test_nan_rewards_and_truncated_samples_leave_the_loss(trainer):
    exp, metrics = _synthetic(trainer, [1.0, 0.0, float("nan"), 2.0], [True, True, True, False])
    # group 0: (1, 0) → ±1/std; group 1: the NaN row and the truncated row are both out, no signal left
    assert exp["mask"][2].sum() == 0 and exp["mask"][3].sum() == 0
    assert exp["advantages"][2:].abs().sum() == 0
    adv0 = exp["advantages"][0][exp["mask"][0] > 0]
    assert torch.allclose(adv0, torch.full_like(adv0, 1 / math.sqrt(0.5) / 2 * 1), atol=1e-4)  # (1-0.5)/std(1,0)=0.707
    assert metrics["valid_frac"] == 0.5
    # the response mask keeps one EOS: positions [prompt_len-1, response_len-1) = [1, 5)
    assert exp["mask"][0].tolist() == [0, 1, 1, 1, 1]


def test_fspo_signs_flip_token_advantages(trainer):
    signs = [np.array([1, -1, 0, 1], dtype=np.int8), np.array([1, -1, 0, 1], dtype=np.int8),
             np.array([0, 0, 0], dtype=np.int8), np.array([0, 0, 0, 0], dtype=np.int8)]
    exp, metrics = _synthetic(trainer, [1.0, 0.0, 1.0, 0.0], [True] * 4, signs)
    a0, a1 = exp["advantages"][0, 1:5], exp["advantages"][1, 1:5]
    # row 0 has A > 0: the −1 token turns negative; row 1 has A < 0: the +1 tokens turn positive
    assert (a0 > 0).tolist() == [True, False, True, True]
    assert (a1 > 0).tolist() == [True, False, False, True]
    assert metrics["fspo/flip_frac"] > 0


def test_resume_gives_the_same_next_steps(tiny_policy, tmp_path):
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    full, _ = run(grpo_cfg(tiny_policy, full_dir, **{"trainer.max_steps": 4}), good_fraction)
    # the interrupted run: stop after 2 steps (checkpoint), then a fresh actor resumes to step 4
    run(grpo_cfg(tiny_policy, split_dir, **{"trainer.max_steps": 2}), good_fraction)
    torch.manual_seed(123)  # a different global RNG state: resume must restore the checkpoint's
    resumed, _ = run(grpo_cfg(tiny_policy, split_dir, **{"trainer.max_steps": 4}), good_fraction, seed=123)
    assert len(resumed) == 2
    keys = ("reward/score", "loss/policy", "loss/kl", "kl", "grad_norm", "response_length/mean")
    for a, b in zip(full[2:], resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert [m["step"] for m in read_metrics(split_dir)] == [1, 2, 3, 4]
    assert (split_dir / "final" / "config.json").exists()


def test_each_checkpoint_is_written_and_logged_once(tiny_policy, tmp_path, caplog):
    """A step that is a save-interval step, the best validated one and the last was written (and logged
    "checkpoint saved") up to three times; once now, its trainer state naming it the best."""
    import json
    import logging

    scores = iter([0.1, 0.2])  # validation at steps 2 and 4: each one the best so far
    cfg = grpo_cfg(tiny_policy, tmp_path / "run", **{"trainer.max_steps": 4, "trainer.save_interval": 2,
                                                     "trainer.val_check_interval": 2})
    cfg.trainer.early_stopping.monitor = "val/score"
    torch.manual_seed(0)
    trainer = GRPOTrainer(cfg, HFActor(cfg.model, max_steps=100), good_fraction, prompts(8), run_dir=tmp_path / "run",
                          validate=lambda step: {"val/score": next(scores)})
    with caplog.at_level(logging.INFO, logger="nemo_factuality.trainers.runtime"):
        trainer.fit()
    saved = [r.getMessage().rsplit("/", 1)[-1] for r in caplog.records if r.getMessage().startswith("checkpoint saved")]
    assert saved == ["step_000002", "step_000004"], saved
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["best"] == "step_000004" and state["step"] == 4


def test_early_stopping_restores_the_best_weights(tiny_policy, tmp_path):
    scores = iter([0.5, 0.9, 0.1, 0.2, 0.3, 0.4])
    cfg = grpo_cfg(tiny_policy, tmp_path / "es", **{"trainer.max_steps": 10, "trainer.val_check_interval": 1})
    cfg.trainer.early_stopping.monitor, cfg.trainer.early_stopping.patience = "val/score", 2
    torch.manual_seed(0)
    actor = HFActor(cfg.model, max_steps=100)
    trainer = GRPOTrainer(cfg, actor, good_fraction, prompts(8), run_dir=tmp_path / "es",
                          validate=lambda step: {"val/score": next(scores)})
    history = trainer.fit()
    assert len(history) == 4  # best at step 2, then two validations without improvement
    from safetensors.torch import load_file

    best = load_file(tmp_path / "es" / "checkpoints" / "step_000002" / "policy.safetensors")
    now = actor.model.state_dict()
    assert all(torch.equal(best[k], now[k]) for k in best)


def test_abstaining_reward_skips_the_update(tiny_policy, tmp_path):
    def abstain(prompts, completions, **_):
        return RewardBatch(np.full(len(completions), np.nan))

    history, actor = run(grpo_cfg(tiny_policy, tmp_path / "nan", **{"trainer.max_steps": 1}), abstain)
    assert history[0]["skipped_minibatches"] == 2 and history[0]["optimizer_steps"] == 0
    assert history[0]["reward/abstain_frac"] == 1.0


def test_cpu_weight_swap_reference_equals_a_frozen_copy(tiny_policy, tmp_path):
    cfgs = [grpo_cfg(tiny_policy, tmp_path / name, **{"model.reference": name}) for name in ("copy", "cpu_weight_swap")]
    actors = []
    for cfg in cfgs:
        torch.manual_seed(0)
        actors.append(HFActor(cfg.model, max_steps=10))
    rollout = Rollout(torch.tensor([[5, 6, 7, 8, 9, 10]] * 2), torch.tensor([2, 3]), torch.tensor([6, 5]),
                      torch.tensor([True, True]))
    batch = {"tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths, "response_lengths": rollout.response_lengths}
    for actor in actors:  # one identical update moves both policies away from their reference
        actor.train_step(batch, lambda out, mb: (-out["logprobs"].sum(), {}), micro_batch_size=2)
    ref_copy, ref_swap = (a.reference_logprobs(rollout) for a in actors)
    assert torch.equal(ref_copy, ref_swap)
    assert not torch.equal(actors[1].logprobs(rollout), ref_swap)  # the swap put the trained weights back
    assert torch.equal(actors[0].logprobs(rollout), actors[1].logprobs(rollout))


def test_kl_in_reward_subtracts_beta_times_mean_token_kl(trainer, monkeypatch):
    g = trainer.cfg.grpo
    g.initial_policy_kl_penalty, g.kl_in, g.kl_estimator, g.advantage_scale = 0.5, "reward", "k1", "none"
    offsets = torch.tensor([0.0, 2.0, 0.0, 0.0])  # row 1's policy is 2 nats per token above the reference
    monkeypatch.setattr(trainer.actor, "reference_logprobs",
                        lambda rollout: trainer.actor.logprobs(rollout) - offsets.unsqueeze(1))
    exp, _ = _synthetic(trainer, [1.0, 1.0, 0.0, 0.0], [True] * 4)
    # group 0: rewards 1 and 1 − 0.5·2 = 0 → Dr.GRPO advantages +0.5 / −0.5 on every response token
    assert exp["advantages"][0, 1].item() == pytest.approx(0.5) and exp["advantages"][1, 1].item() == pytest.approx(-0.5)


def test_served_token_arrays_are_placed_without_a_warning():
    """A served reward's token signs arrive as read-only views of the response buffer; placing them must not
    trip torch's non-writable-array UserWarning (the lab printed it once per run)."""
    import warnings

    from nemo_factuality.trainers.runtime import place_on_tokens

    signs = np.array([1, -1, 0], dtype=np.int8)
    signs.setflags(write=False)
    rollout = Rollout(torch.zeros(1, 6, dtype=torch.long), torch.tensor([2]), torch.tensor([5]), torch.tensor([True]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed = place_on_tokens([signs], rollout, torch.int8)
    assert placed.tolist() == [[0, 1, -1, 0, 0]]


def test_kl_estimator_abs_in_the_loss_is_the_logged_estimator(trainer, monkeypatch):
    """grpo.kl_estimator=abs with kl_in=loss: the loss term and the logged kl are both mean |logπ − logπ_ref| (before,
    the loss silently used k3 while the metric logged abs)."""
    from nemo_factuality.trainers.config import load_train_config

    load_train_config(GRPOConfig, None, ["model.path=/m", "remote_rm.url=http://rm:1", "grpo.kl_estimator=abs",
                                         "grpo.kl_in=loss"])  # accepted at start-up
    g = trainer.cfg.grpo
    g.initial_policy_kl_penalty, g.kl_in, g.kl_estimator = 0.5, "loss", "abs"
    offsets = torch.tensor([0.3, -0.2, 0.1, -0.4])  # per row: log π − log π_ref (both signs: abs ≠ k1, ≠ k3)
    monkeypatch.setattr(trainer.actor, "reference_logprobs",
                        lambda rollout: trainer.actor.logprobs(rollout) - offsets.unsqueeze(1))
    exp, metrics = _synthetic(trainer, [1.0, 0.0, 1.0, 0.0], [True] * 4)
    mask = exp["mask"]
    expected = float((offsets.abs().unsqueeze(1) * mask).sum() / mask.sum())
    assert metrics["kl"] == pytest.approx(expected, abs=1e-6)
    out = {"logprobs": exp["old_logprobs"]}  # the loss at the rollout's own log-probs
    _, loss_metrics = trainer.loss_fn(out, exp, global_tokens=float(mask.sum()), global_seqs=4.0)
    assert loss_metrics["loss/kl"] == pytest.approx(expected, abs=1e-6)
    k3 = float(((torch.exp(-offsets) - 1 + offsets).unsqueeze(1) * mask).sum() / mask.sum())
    assert abs(k3 - expected) > 0.05  # what the loss used to compute instead


def test_checkpoints_record_the_initial_reference_instead_of_copying_it(tiny_policy, tmp_path, caplog):
    """GRPO's reference is model.path: a checkpoint holds reference.json (path + fingerprint), no weights copy; the
    resumed run rebuilds it from the path, and refuses in one line when that checkpoint changed or is gone; the same
    files at another path (a container mounting them elsewhere) are found by fingerprint, with one log line."""
    import json
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    from nemo_factuality.trainers.reference import fingerprint
    from nemo_factuality.types import FactualityInputError

    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy, policy)
    cfg = grpo_cfg(policy, tmp_path / "run", **{"trainer.max_steps": 1})
    run(cfg, good_fraction)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert not (ckpt / "reference.safetensors").exists()
    record = json.loads((ckpt / "reference.json").read_text())
    assert record == {"kind": "initial", "path": str(policy.resolve()), "key": "model.path", "fingerprint": fingerprint(policy)}
    history, actor = run(grpo_cfg(policy, tmp_path / "run", **{"trainer.max_steps": 2}), good_fraction, seed=5)
    assert len(history) == 1 and history[0]["kl"] > 0  # resumed: a reference other than the trained policy
    weights = load_file(policy / "model.safetensors")
    ref = actor.reference_logprobs(Rollout(torch.tensor([[5, 6, 7, 8]]), torch.tensor([2]), torch.tensor([4]),
                                           torch.tensor([True])))
    fresh = HFActor(grpo_cfg(policy, tmp_path / "x").model, max_steps=1)
    assert torch.equal(ref, fresh.logprobs(Rollout(torch.tensor([[5, 6, 7, 8]]), torch.tensor([2]), torch.tensor([4]),
                                                   torch.tensor([True]))))  # the reference is model.path's weights
    key = next(iter(weights))
    save_file({**weights, key: weights[key] + 1e-3}, str(policy / "model.safetensors"))  # retrained in place
    with pytest.raises(FactualityInputError, match="changed since the run started") as err:
        run(grpo_cfg(policy, tmp_path / "run", **{"trainer.max_steps": 3}), good_fraction)
    assert "\n" not in str(err.value) and "model.path" in str(err.value)
    shutil.rmtree(policy)
    shutil.copytree(tiny_policy, tmp_path / "moved")  # the same files at another path (a container's mount)
    shutil.copytree(tiny_policy, tmp_path / "other")
    save_file({**weights, key: weights[key] + 1e-3}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(FactualityInputError, match=r"this run started from model.path=.*/policy .* now holds another "
                                                   r"checkpoint \(fingerprint differs\): resume with model.path="):
        run(grpo_cfg(tmp_path / "other", tmp_path / "run", **{"trainer.max_steps": 3}), good_fraction)
    caplog.set_level(logging.INFO, logger="nemo_factuality.trainers.reference")
    history, _ = run(grpo_cfg(tmp_path / "moved", tmp_path / "run", **{"trainer.max_steps": 3}), good_fraction)
    assert len(history) == 1  # resumed at step 3 from the moved copy, matched by its fingerprint
    moved = [r.getMessage() for r in caplog.records if "moved from" in r.getMessage()]
    assert len(moved) == 1 and f"moved from {policy.resolve()} to {(tmp_path / 'moved').resolve()}" in moved[0]
    record = json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "reference.json").read_text())
    assert record["path"] == str((tmp_path / "moved").resolve())  # later checkpoints name where it is now
