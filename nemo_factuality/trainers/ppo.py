"""Dense-reward PPO for RLFH: actor + critic, token rewards from verified atomic statements, GAE.

    nemo-factuality train ppo --config-name rlfh model.path=/models/qwen7b data.train=hotpot_train.jsonl
    python -m nemo_factuality.trainers.ppo --config-name rlfh remote_rm.url=$FACTUALITY_REWARD_URL

One step:

1. **rollout** — one response per prompt (``ppo.num_prompts_per_step`` prompts).
2. **reward** — the RLFH reward's ``token_rewards`` (``r_truth`` at each statement's last token,
   ``r_info`` at each sentence end, the missing-EOS penalty on the last token); a reward without token
   rewards puts its scalar on the last action, as NeMo-Aligner does (index ``response_length − 2``); a response
   without any token has no action to carry it and leaves the loss (Aligner clamps the index onto the prompt).
3. **advantage** — ``r_t − β·KL_t`` (k3, in the reward: RLFH/OpenRLHF), GAE(γ, λ) against the critic's
   values, returns = advantages + values; advantages whitened over the batch (all data-parallel
   ranks' rows) with the unbiased variance (verl). A NaN score (abstention, failed judge) removes the sample from both losses.
4. **loss** — actor: PPO clip (+ dual clip) − entropy bonus; critic: clipped value loss
   ``0.5·max((clip(v, v_old ± c) − R)², (v − R)²)``. The first ``ppo.critic_warmup_steps`` steps train
   only the critic, so the actor does not follow the advantages of an untrained value model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.algorithms import (
    dense_rewards_with_kl,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    response_mask,
    value_loss,
)
from nemo_factuality.trainers.config import PPOConfig
from nemo_factuality.trainers.data import PromptRecord
from nemo_factuality.trainers.grpo import GRPOTrainer
from nemo_factuality.trainers.interfaces import Critic, PolicyActor, Rollout
from nemo_factuality.trainers.parallel import masked_whiten_global
from nemo_factuality.trainers.runtime import place_on_tokens
from nemo_factuality.types import RewardBatch

log = logging.getLogger(__name__)


def token_reward_tensor(rewards: RewardBatch, rollout: Rollout) -> torch.Tensor:
    """``[B, S-1]`` rewards: the reward's token rewards, or its scalar on the last action (``response_length − 2``).

    A response without a single token (``response_length == prompt_length``) has no action to carry a reward: its
    row stays 0 and the stage takes the sample out of the loss (``has_action``). NeMo-Aligner clamps the index
    at 0 instead, which puts such a reward on a prompt position the mask drops (and an unclamped ``-1`` would put
    it on the last column)."""
    dense = place_on_tokens(rewards.token_rewards, rollout)
    if dense is not None:
        return torch.nan_to_num(dense)
    out = torch.zeros(rollout.tokens.shape[0], rollout.tokens.shape[1] - 1)
    scores = torch.nan_to_num(torch.as_tensor(rewards.scores, dtype=torch.float32))
    rows = torch.nonzero(has_action(rollout)).squeeze(1)
    out[rows, rollout.response_lengths[rows] - 2] = scores[rows]
    return out


def has_action(rollout: Rollout) -> torch.Tensor:
    """``[B]`` bool: the response has at least one token (an action the reward and the loss can sit on)."""
    return rollout.response_lengths > rollout.prompt_lengths


class PPOTrainer(GRPOTrainer):
    """PPO with a critic; reuses the GRPO stage's loop, checkpoints, validation and logging."""

    stage = "ppo"

    def __init__(self, cfg: PPOConfig, actor: PolicyActor, critic: Critic, reward: Any, train_data: Sequence[PromptRecord],
                 *, run_dir: Path, validate: Any = None, val_data: Sequence[PromptRecord] | None = None) -> None:
        self.critic = critic  # saved and restored with the actor by the shared checkpoint code (set first: the
        # start-up checks ask it how it splits a minibatch)
        super().__init__(cfg, actor, reward, train_data, run_dir=run_dir, validate=validate, val_data=val_data)  # type: ignore[arg-type]

    def _prompts_per_step(self) -> int:
        return self.cfg.ppo.num_prompts_per_step

    def _samples_per_prompt(self) -> int:
        return 1  # RLFH: one response per prompt; the critic is the baseline

    def _algo(self) -> Any:
        return self.cfg.ppo

    def _logprobs(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """The critic's ``values`` and the policy's ``old_logprobs`` (unless the training forward provides them)
        and ``ref_logprobs`` (with a KL penalty), ``[B, S-1]`` each: computed while the reward is in flight."""
        values = self.critic.values(rollout)
        return {"values": values, **super()._logprobs(rollout)}

    def reuses_training_logprobs(self) -> bool:
        """Exactly on-policy (one epoch, one minibatch) without a KL penalty: the training forward's detached
        log-probs are the old ones. With the penalty the KL goes into the token rewards, before the update."""
        p = self.cfg.ppo
        return (p.num_epochs == 1 and p.num_prompts_per_step == self.cfg.model.global_batch_size
                and p.initial_policy_kl_penalty == 0 and not self.engine_sampled())

    def _experience(self, rollout: Rollout, rewards: RewardBatch,
                    logprobs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return self.make_ppo_experience(rollout, rewards, logprobs)

    def _update(self, experience: Mapping[str, torch.Tensor]) -> dict[str, float]:
        return self.update_ppo(experience)

    def make_ppo_experience(self, rollout: Rollout, rewards: RewardBatch, logprobs: Mapping[str, torch.Tensor] | None = None
                            ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """GAE advantages and returns from the token rewards − β·KL_t and the critic's values (``logprobs``:
        ``_logprobs``'s, computed here when not given)."""
        p = self.cfg.ppo
        s1 = rollout.tokens.shape[1] - 1
        mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, s1)
        valid = ~torch.isnan(torch.as_tensor(rewards.scores, dtype=torch.float32)) & has_action(rollout)
        if p.truncated == "mask":
            valid &= rollout.is_end
        mask = mask * valid.unsqueeze(1).to(mask.dtype)
        logprobs = self._logprobs(rollout) if logprobs is None else logprobs
        old_logprobs, values = logprobs.get("old_logprobs"), logprobs["values"]
        token_rewards = token_reward_tensor(rewards, rollout)
        kl = torch.zeros_like(values)
        if p.initial_policy_kl_penalty > 0:
            kl = kl_penalty(old_logprobs, logprobs["ref_logprobs"], p.kl_estimator)
        shaped = dense_rewards_with_kl(token_rewards, kl, mask, p.initial_policy_kl_penalty)
        advantages, returns = gae(shaped, values, mask, p.discount_factor, p.gae_lambda)
        if p.normalize_advantages and self.parallel.size > 1:  # the batch's statistics span every rank's rows
            advantages = masked_whiten_global(advantages, mask, self.parallel.sum_tensor, unbiased=True)
        elif p.normalize_advantages and mask.sum() > 1:
            advantages = masked_whiten(advantages, mask, unbiased=True)
        advantages, engine_metrics = self.correct_for_engine(rollout, old_logprobs, mask, advantages)
        exp = {"tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths, "response_lengths": rollout.response_lengths,
               "old_values": values * mask, "returns": returns * mask, "advantages": advantages * mask, "mask": mask}
        if old_logprobs is not None:
            exp["old_logprobs"] = old_logprobs
        any_tok = mask.sum() > 0
        metrics = {"kl": masked_mean(kl, mask).item() if any_tok else 0.0, "valid_frac": valid.float().mean().item(),
                   "reward/token_sum": (token_rewards * mask).sum(-1)[valid].mean().item() if valid.any() else math.nan,
                   "values/mean": masked_mean(values, mask).item() if any_tok else 0.0,
                   "returns/mean": masked_mean(returns, mask).item() if any_tok else 0.0, **engine_metrics}
        return exp, metrics

    def actor_loss(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], *, global_tokens: float,
                   global_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        m = self.cfg.model
        old = mb["old_logprobs"] if "old_logprobs" in mb else out["logprobs"].detach()  # exactly on-policy: ratio 1
        loss, metrics = ppo_policy_loss(out["logprobs"], old, mb["advantages"], mb["mask"], eps=m.ratio_eps,
                                        eps_high=m.ratio_eps_high, clip_ratio_c=m.clip_ratio_c, agg=m.loss_agg,
                                        global_tokens=global_tokens, global_seqs=global_seqs,
                                        entropy=out.get("entropy"), entropy_coef=m.entropy_bonus)
        return loss, {"loss/policy": loss.item(), **metrics}

    def critic_loss(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], *,
                    global_tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
        loss = value_loss(out["values"], mb["old_values"], mb["returns"], mb["mask"], self.cfg.critic.loss_clip_val,
                          global_tokens=global_tokens)
        return loss, {"loss/value": loss.item()}

    def _other_micro_batch_sizes(self) -> dict[str, int]:
        # each rank's minibatch share trains an in-process critic (hf, megatron) too, in micro batches of its own size;
        # the aligner backend's critic server trains on the minibatch gathered from every rank (config.py checks that)
        if getattr(self.critic, "trains_on_gathered_minibatch", False):
            return {}
        return {"critic.micro_batch_size": self.cfg.critic.micro_batch_size}

    def update_ppo(self, exp: Mapping[str, torch.Tensor]) -> dict[str, float]:
        m = self.cfg.model
        b, size = exp["tokens"].shape[0], m.global_batch_size // self.parallel.size  # this rank's share of a minibatch
        train_actor = self.step >= self.cfg.ppo.critic_warmup_steps
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.ppo.num_epochs):
            order = torch.randperm(b)
            for start in range(0, b, size):
                idx = order[start : start + size]
                mb = {k: v[idx] for k, v in exp.items()}
                global_tokens = self.parallel.global_sum(float(mb["mask"].sum()))
                if global_tokens == 0:
                    continue
                global_seqs = self.parallel.global_sum(float((mb["mask"].sum(-1) > 0).sum()))
                # the backends average loss shares over micro batches and data-parallel ranks: sum them back
                n_micro = math.ceil(len(idx) / self.cfg.critic.micro_batch_size) * self.parallel.size
                result = self.critic.train_step(mb, partial(self.critic_loss, global_tokens=global_tokens),
                                                micro_batch_size=self.cfg.critic.micro_batch_size)
                _accumulate(totals, {f"critic/{k}" if k == "grad_norm" else k: v for k, v in result.items()}, n_micro)
                if train_actor:
                    fn = partial(self.actor_loss, global_tokens=global_tokens, global_seqs=global_seqs)
                    result = self.actor.train_step(mb, fn, micro_batch_size=m.micro_batch_size,
                                                   need_entropy=m.entropy_bonus > 0)
                    _accumulate(totals, result, math.ceil(len(idx) / m.micro_batch_size) * self.parallel.size)
                steps += 1
        out = {k: v / max(steps, 1) for k, v in totals.items()}
        out["actor_trained"] = float(train_actor)
        return out


def _accumulate(totals: dict[str, float], result: Mapping[str, float], n_micro: int) -> None:
    for k, v in result.items():
        totals[k] = totals.get(k, 0.0) + v * (n_micro if k.startswith("loss/") else 1)


if __name__ == "__main__":  # `python -m nemo_factuality.trainers.ppo`: `nemo-factuality train ppo`, through the
    from nemo_factuality.cli import run_as_module  # commands' one boundary (it imports no stage: no circle)

    run_as_module("train", "ppo")
