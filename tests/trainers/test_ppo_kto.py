"""Dense-reward PPO and iterated KTO + fKTO on the hf backend: learning, log-ratio direction, resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nemo_factuality.algorithms import response_mask
from nemo_factuality.testing.training import GOOD, good_tokens_dense, prompts, read_metrics
from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic
from nemo_factuality.trainers.config import KTOConfig, PPOConfig
from nemo_factuality.trainers.data import PreferencePair
from nemo_factuality.trainers.interfaces import Rollout
from nemo_factuality.trainers.kto import KTOTrainer, sentence_sums
from nemo_factuality.trainers.ppo import PPOTrainer, token_reward_tensor
from nemo_factuality.types import RewardBatch, Span


def ppo_cfg(policy, run_dir, steps=16) -> PPOConfig:
    cfg = PPOConfig()
    cfg.model.path, cfg.model.optim.lr = str(policy), 3e-3
    cfg.model.length_params.max_length = 6
    cfg.model.global_batch_size, cfg.model.micro_batch_size = 16, 8
    cfg.ppo.num_prompts_per_step = 16
    cfg.critic.optim.lr, cfg.critic.micro_batch_size = 1e-2, 8
    cfg.trainer.max_steps, cfg.trainer.progress_bar, cfg.trainer.save_interval = steps, False, 0
    cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(run_dir), False
    cfg.reward = {"name": "toy"}
    return cfg


def run_ppo(cfg, seed=0):
    torch.manual_seed(seed)
    actor = HFActor(cfg.model, max_steps=100)
    critic = HFCritic(cfg.critic, cfg.model.path, max_steps=100)
    return PPOTrainer(cfg, actor, critic, good_tokens_dense, prompts(16), run_dir=cfg.exp_manager.explicit_log_dir).fit()


def test_ppo_raises_a_dense_reward_and_trains_the_critic(tiny_policy, tmp_path):
    history = run_ppo(ppo_cfg(tiny_policy, tmp_path / "ppo"))
    rewards = [h["reward/score"] for h in history]
    start, end = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert end - start > 0.6 and end - start > 5 * (np.std(rewards[:3]) + 1e-3), rewards
    assert all(math.isfinite(h["loss/value"]) and math.isfinite(h["loss/policy"]) for h in history)
    assert history[-1]["values/mean"] > 0.3  # the zero-initialised value head learnt that good tokens pay


def test_ppo_resume_restores_the_critic_too(tiny_policy, tmp_path):
    full = run_ppo(ppo_cfg(tiny_policy, tmp_path / "full", steps=3))
    run_ppo(ppo_cfg(tiny_policy, tmp_path / "split", steps=2))
    resumed = run_ppo(ppo_cfg(tiny_policy, tmp_path / "split", steps=3), seed=99)
    keys = ("reward/score", "loss/policy", "loss/value", "values/mean", "grad_norm", "critic/grad_norm")
    assert {k: full[2][k] for k in keys} == {k: resumed[0][k] for k in keys}


def test_scalar_reward_goes_on_the_last_action_like_aligner():
    rollout = Rollout(torch.zeros(2, 6, dtype=torch.long), torch.tensor([2, 2]), torch.tensor([6, 4]),
                      torch.tensor([True, True]))
    t = token_reward_tensor(RewardBatch(np.array([1.5, -2.0])), rollout)
    assert t[0, 4] == 1.5 and t[1, 2] == -2.0 and t.abs().sum() == 3.5  # index response_length - 2


def test_a_response_without_tokens_gets_no_reward_position_and_leaves_the_loss(tiny_policy, tmp_path):
    """Row 0 is empty (response_length == prompt_length): Aligner's clamped index would put its reward on a prompt
    position (and the old unclamped ``- 2`` on the last column, here position 5 of row 0); it gets none and its
    sample is out of the loss. Row 1 is only an EOS (one action): the reward sits on it, inside the mask."""
    rollout = Rollout(torch.tensor([[3, 4, 0, 0, 0, 0, 0], [3, 4, 2, 0, 0, 0, 0]]), torch.tensor([2, 2]),
                      torch.tensor([2, 3]), torch.tensor([False, True]))
    t = token_reward_tensor(RewardBatch(np.array([5.0, 1.0])), rollout)
    mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, 6)
    assert t[0].abs().sum() == 0 and t[1, 1] == 1.0 and t.abs().sum() == 1.0
    assert mask[0].sum() == 0 and mask[1, 1] == 1  # no action in row 0; row 1's one action carries the reward
    cfg = ppo_cfg(tiny_policy, tmp_path / "empty", steps=1)
    cfg.ppo.initial_policy_kl_penalty, cfg.ppo.normalize_advantages = 0.0, False
    torch.manual_seed(0)
    trainer = PPOTrainer(cfg, HFActor(cfg.model, max_steps=1), HFCritic(cfg.critic, cfg.model.path, max_steps=1),
                         good_tokens_dense, prompts(2), run_dir=tmp_path / "empty")
    exp, metrics = trainer.make_ppo_experience(rollout, RewardBatch(np.array([5.0, 1.0])))
    assert exp["mask"][0].sum() == 0 and exp["mask"][1].sum() == 1 and metrics["valid_frac"] == 0.5
    assert metrics["reward/token_sum"] == 1.0  # the empty sample's 5.0 went nowhere


def test_critic_warmup_freezes_the_actor(tiny_policy, tmp_path):
    cfg = ppo_cfg(tiny_policy, tmp_path / "warm", steps=2)
    cfg.ppo.critic_warmup_steps = 2
    torch.manual_seed(0)
    actor = HFActor(cfg.model, max_steps=10)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    critic = HFCritic(cfg.critic, cfg.model.path, max_steps=10)
    history = PPOTrainer(cfg, actor, critic, good_tokens_dense, prompts(16), run_dir=tmp_path / "warm").fit()
    assert [h["actor_trained"] for h in history] == [0.0, 0.0]
    assert all(torch.equal(before[k], v) for k, v in actor.model.state_dict().items())


# ------------------------------------------------------------------------------------------------ KTO
def half_good_labeller(prompts, completions, completion_ids, **_):
    """FactAlign-shaped labels: desirable when most tokens are GOOD; one sentence = the whole completion."""
    label = np.array([float(sum(t in GOOD for t in ids) * 3 >= len(ids)) for ids in completion_ids])
    spans = [[Span(0, len(c))] if c.strip() else [] for c in completions]
    return RewardBatch(label, {"label": label}, sentence_labels=[[bool(x)] for x in label], sentence_spans=spans)


def kto_cfg(policy, run_dir, iterations=1) -> KTOConfig:
    cfg = KTOConfig()
    cfg.model.path, cfg.model.optim.lr = str(policy), 2e-3
    cfg.model.length_params.max_length = 6
    cfg.model.global_batch_size, cfg.model.micro_batch_size = 8, 4
    cfg.kto.num_iterations, cfg.kto.prompts_per_iteration, cfg.kto.samples_per_prompt = iterations, 8, 4
    cfg.kto.epochs_per_iteration = 3
    cfg.trainer.max_steps, cfg.trainer.progress_bar, cfg.trainer.save_interval = 1000, False, 0
    cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(run_dir), False
    cfg.reward = {"name": "toy"}
    return cfg


def test_kto_moves_log_ratios_the_expected_way(tiny_policy, tmp_path):
    torch.manual_seed(0)
    cfg = kto_cfg(tiny_policy, tmp_path / "kto")
    actor = HFActor(cfg.model, max_steps=100)
    pairs = [PreferencePair("hi", "The Moon orbits the Earth.", "Unknown facts should be avoided.")]
    trainer = KTOTrainer(cfg, actor, half_good_labeller, prompts(8), general_pairs=pairs, run_dir=tmp_path / "kto")
    trainer.fit()
    data = trainer.last_data
    rollout = Rollout(data["tokens"], data["prompt_lengths"], data["response_lengths"], torch.ones(len(data["tokens"]), dtype=torch.bool))
    diff = actor.logprobs(rollout) - actor.reference_logprobs(rollout)
    mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, diff.shape[1])
    resp = (diff * mask).sum(-1)
    good, bad = data["desirable"], ~data["desirable"]
    assert good.any() and bad.any()
    assert resp[good].mean() > 0 > resp[bad].mean(), (resp[good], resp[bad])
    sent = sentence_sums(diff, data["sent_start"], data["sent_end"])[data["sent_valid"]]
    labels = data["sent_label"][data["sent_valid"]]
    assert sent[labels].mean() > sent[~labels].mean()
    logged = read_metrics(tmp_path / "kto")
    assert logged[0]["kto/labelled"] == 32 and logged[0]["kto/general_pairs"] == 1
    assert all(math.isfinite(m["loss/kto"]) and math.isfinite(m["loss/fkto"]) for m in logged)


def split_labeller(prompts, completions, completion_ids, **_):
    """Every response desirable, but its second half a false sentence: the sentence labels disagree with the response
    label, so only fKTO (λ > 0) can tell the halves apart."""
    label = np.ones(len(completions))
    spans = [[Span(0, len(c) // 2), Span(len(c) // 2, len(c))] if len(c) >= 4 else [] for c in completions]
    return RewardBatch(label, {"label": label}, sentence_labels=[[True, False] if sp else [] for sp in spans],
                       sentence_spans=spans)


def test_fkto_weight_lambda_pushes_false_sentences_of_a_desirable_response_down(tiny_policy, tmp_path):
    def sentence_ratios(lam: float) -> tuple[float, float]:
        torch.manual_seed(0)
        cfg = kto_cfg(tiny_policy, tmp_path / f"lam{lam}")
        cfg.model.length_params.max_length = 8
        cfg.kto.lam, cfg.kto.prompts_per_iteration, cfg.kto.samples_per_prompt = lam, 4, 4
        actor = HFActor(cfg.model, max_steps=100)
        trainer = KTOTrainer(cfg, actor, split_labeller, prompts(4), run_dir=tmp_path / f"lam{lam}")
        trainer.fit()
        data = trainer.last_data
        rollout = Rollout(data["tokens"], data["prompt_lengths"], data["response_lengths"],
                          torch.ones(len(data["tokens"]), dtype=torch.bool))
        diff = actor.logprobs(rollout) - actor.reference_logprobs(rollout)
        sent = sentence_sums(diff, data["sent_start"], data["sent_end"])[data["sent_valid"]]
        labels = data["sent_label"][data["sent_valid"]]
        assert labels.any() and (~labels).any()
        return sent[labels].mean().item(), sent[~labels].mean().item()

    true0, false0 = sentence_ratios(0.0)  # KTO alone: the whole desirable response goes up, both halves
    true4, false4 = sentence_ratios(4.0)  # + fKTO: the false half goes down although its response is desirable
    assert false0 > 0 and false4 < 0 < true4, (true0, false0, true4, false4)
    assert false4 < false0 - 0.5


@pytest.mark.parametrize("stop", [2, 4])
def test_kto_resumes_mid_iteration(tiny_policy, tmp_path, stop):
    """Stopped inside iteration 0 (step 2 of its 4 minibatches) or at its end (step 4: iteration 1 already sampled and
    labelled, its statistics not yet logged), the rerun logs what the straight run logs. Before the trainer state kept
    those statistics, the stop at step 4 lost kto/labelled and the rest of iteration 1's from step 5."""
    def go(run_dir, max_steps, seed):
        torch.manual_seed(seed)
        cfg = kto_cfg(tiny_policy, run_dir, iterations=2)
        cfg.kto.epochs_per_iteration, cfg.trainer.max_steps = 1, max_steps
        KTOTrainer(cfg, HFActor(cfg.model, max_steps=100), half_good_labeller, prompts(8), run_dir=run_dir).fit()
        return read_metrics(run_dir)

    full = go(tmp_path / "full", 1000, 0)
    go(tmp_path / "split", stop, 0)
    resumed = go(tmp_path / "split", 1000, 7)
    untimed = lambda run: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in run]  # noqa: E731
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    assert untimed(resumed) == untimed(full)
    assert "kto/labelled" in full[4] and "kto/labelled" in resumed[4]  # iteration 1's statistics, at step 5


def test_a_kto_sample_whose_sentences_cannot_be_placed_is_dropped_alone(tiny_policy, tmp_path, monkeypatch, caplog):
    """A sample whose ids do not align to its text (tests/rewards/test_failures.py builds one) has no sentence
    positions: KTO drops it from the labelled set, counts it, and trains on the rest."""
    from nemo_factuality.trainers import kto as kto_module
    from nemo_factuality.types import FactualityInputError

    placed = kto_module.sentence_token_ranges
    calls = []

    def first_fails(tokenizer, completion, ids, spans, prompt_len):
        calls.append(completion)
        if len(calls) == 1:
            raise FactualityInputError("token alignment: offsets out of order")
        return placed(tokenizer, completion, ids, spans, prompt_len)

    monkeypatch.setattr(kto_module, "sentence_token_ranges", first_fails)
    torch.manual_seed(0)
    cfg = kto_cfg(tiny_policy, tmp_path / "kto")
    actor = HFActor(cfg.model, max_steps=100)
    with caplog.at_level("WARNING", logger="nemo_factuality.trainers.kto"):
        KTOTrainer(cfg, actor, half_good_labeller, prompts(8), run_dir=tmp_path / "kto").fit()
    logged = read_metrics(tmp_path / "kto")
    assert len(calls) == 32
    assert logged[0]["kto/labelled"] == 31 and logged[0]["kto/dropped_unlabelled"] == 1
    assert all(math.isfinite(m["loss/kto"]) for m in logged)
    assert any("sample 0 dropped" in r.getMessage() and "offsets out of order" in r.getMessage() for r in caplog.records)


def test_trimming_a_kto_batch_keeps_every_sentence_when_there_are_s_minus_1_of_them():
    """The actors cut a batch to its longest sequence (tokens to W, per-token ``[B, S-1]`` tensors to W-1). FactAlign's
    sentence tensors are ``[B, K]``: with K == S-1 sentences, a cut by shape alone dropped the last S-W sentences
    (here 4 of 6) without a word. They are per example and stay whole."""
    from nemo_factuality.trainers.interfaces import trim_to_longest
    from nemo_factuality.trainers.kto import pack_examples

    # two rows padded to S = 7 (a third, longer row left the batch in an earlier micro batch), 6 one-token sentences
    sentences = [[(j, j + 1, j % 2 == 0) for j in range(6)], [(0, 1, True)]]
    batch = pack_examples([[5, 6, 7], [5, 6]], [1, 1], [True, False], sentences, pad_id=0)
    batch = {k: (torch.nn.functional.pad(v, (0, 4)) if k == "tokens" else v) for k, v in batch.items()}
    batch["mask"] = torch.ones(2, 6)  # a per-token [B, S-1] tensor, which is cut
    assert batch["tokens"].shape == (2, 7) and batch["sent_start"].shape == (2, 6)
    out = trim_to_longest(batch)
    assert out["tokens"].shape == (2, 3) and out["mask"].shape == (2, 2)
    for key in ("sent_start", "sent_end", "sent_label", "sent_valid"):
        assert torch.equal(out[key], batch[key]), key
    assert int(out["sent_valid"].sum()) == 7
