"""GRPO for KLCF, FSPO and KnowRL: the whole reward → advantage → loss recipe in one file.

    nemo-factuality train grpo --config-name klcf model.path=/models/qwen7b data.train=klcf.jsonl
    python -m nemo_factuality.trainers.grpo --config-name fspo remote_rm.url=http://reward:5555   # what Slurm runs

One step:

1. **rollout** — ``grpo.num_prompts_per_step`` prompts, ``grpo.num_rollouts_per_prompt`` samples each, streamed
   in micro batches by the actor.
2. **reward** — ``reward(prompts, completions, completion_ids=..., is_end=..., **columns)``; a NaN score
   (abstention, failed judge) takes the sample out of its group and out of the loss. With
   ``grpo.overlap_reward`` each micro batch is scored in a worker as soon as it is generated, and the
   old/reference log-probs are computed while the rewards are in flight (``trainers/scoring.py``).
3. **advantage** — ``(r - mean_g) / (std_g + ε)`` per group (``grpo.advantage_scale=none``: Dr.GRPO),
   ``r - β·mean_t KL_t`` first when ``grpo.kl_in=reward`` (Aligner's REINFORCE), broadcast to the
   response tokens; FSPO's flip ``A' = where(sign·A ≥ 0, A, -A)`` when the reward returns token signs.
   Truncated responses (no EOS) are masked (``grpo.truncated=mask``: NeMo-Aligner's PPO actor masks its loss with
   ``is_end``; its REINFORCE loss keeps them and only leaves them out of the RLOO baseline).
4. **loss** — PPO clip (ε, ``ratio_eps_high`` for clip-higher, ``clip_ratio_c`` for the dual clip)
   + ``β·KL(π‖π_ref)`` (k3 = verl's low_var_kl) when ``grpo.kl_in=loss``, − entropy bonus; aggregated
   over the optimiser step's global token/sequence counts; ``grpo.num_epochs`` passes over the rollout
   in minibatches of ``model.global_batch_size`` sequences. Exactly on-policy (one epoch, one minibatch)
   the old log-probs are the training forward's own, detached (``reuses_training_logprobs``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from nemo_factuality.algorithms import (
    expand_to_tokens,
    fspo_flip,
    grpo_advantages,
    kl_loss,
    kl_penalty,
    masked_mean,
    ppo_policy_loss,
    response_mask,
)
from nemo_factuality.algorithms.off_policy import importance_weight_stats, logprob_gap, truncated_importance_weights
from nemo_factuality.config import ConfigError
from nemo_factuality.trainers.config import GRPOConfig
from nemo_factuality.trainers.data import PromptRecord, PromptSampler
from nemo_factuality.trainers.interfaces import PolicyActor, Rollout, RolloutChunk, SamplingParams, assemble_rollout
from nemo_factuality.trainers.parallel import DataParallel, data_parallel_problems
from nemo_factuality.trainers.resume import model_identity
from nemo_factuality.trainers.rollouts_ahead import PENDING_FILE, RolloutsAhead, write_pending
from nemo_factuality.trainers.runtime import (
    Checkpointer,
    EarlyStopping,
    InvalidSteps,
    PhaseTimer,
    PreemptionFlag,
    RunLogger,
    StepStart,
    checkpoint_if_server_gone,
    encode_prompts,
    place_on_tokens,
    records_for_rows,
    response_stats,
    score_rollout,
)
from nemo_factuality.trainers.scoring import RolloutScorer, rollout_rows
from nemo_factuality.types import RewardBatch

Validate = Callable[[int], Mapping[str, float]]


def kl_share(logprobs: torch.Tensor, mb: Mapping[str, torch.Tensor], kind: str, tokens: float) -> float:
    """The micro batch's share of a response-token mean of ``kl_penalty(logprobs, mb["ref_logprobs"], kind)``:
    its sum over the micro batch's response tokens (``[b, S-1]`` inputs, no gradient) divided by ``tokens``."""
    mask = response_mask(mb["prompt_lengths"], mb["response_lengths"], logprobs.shape[1]).to(logprobs.dtype)
    return float((kl_penalty(logprobs.detach(), mb["ref_logprobs"], kind) * mask).sum()) / tokens


class GRPOTrainer:
    """Runs GRPO steps on any ``PolicyActor`` (``hf`` or ``aligner`` backend) with any method reward."""

    stage = "grpo"
    critic: Any = None  # PPO sets one; checkpoints save and restore it with the actor

    @property
    def log(self) -> logging.Logger:
        """The stage's own logger: ``nemo_factuality.trainers.ppo`` for PPO, which runs this loop too."""
        return logging.getLogger(f"nemo_factuality.trainers.{self.stage}")

    def __init__(self, cfg: GRPOConfig, actor: PolicyActor, reward: Any, train_data: Sequence[PromptRecord], *,
                 run_dir: Path, validate: Validate | None = None, val_data: Sequence[PromptRecord] | None = None) -> None:
        self.cfg, self.actor, self.reward, self.data = cfg, actor, reward, list(train_data)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.prompt_ids = encode_prompts(self.data, actor.tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_tokens)
        self.val_data = list(val_data or [])
        self.validate = validate or (self._validate_reward if self.val_data else None)
        self.sampler = PromptSampler(len(self.data), cfg.trainer.seed)  # the same global draw on every rank
        self.parallel = DataParallel(actor)
        problems = data_parallel_problems(self.parallel.size, f"{self.stage}.num_prompts_per_step", self._prompts_per_step(),
                                          self._samples_per_prompt(), cfg.model.global_batch_size, cfg.model.micro_batch_size,
                                          other_micro_batch_sizes=self._other_micro_batch_sizes())
        if problems:
            raise ConfigError("invalid training config for data parallelism: " + "; ".join(problems))
        self.checkpointer = Checkpointer(self.run_dir, cfg.exp_manager.save_top_k, self.parallel,
                                         identity=model_identity(cfg))
        self.early = EarlyStopping(cfg.trainer.early_stopping)
        self.logger = RunLogger(self.run_dir, cfg.exp_manager, cfg, enabled=self.parallel.is_writer)
        self.step = 0
        self.step_prompts: list[int] = []  # this rank's prompt indices in the last step (its slice of the draw)
        m = cfg.model
        self.sampling = SamplingParams(m.length_params.max_length, m.sampling_params.temperature, m.sampling_params.top_p,
                                       m.sampling_params.top_k, m.sampling_params.use_greedy)
        # <stage>.max_staleness >= 1: the next step's rollouts generate while this one trains (trainers/rollouts_ahead.py)
        self.ahead = RolloutsAhead(self) if self._algo().max_staleness else None

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, float]]:
        """Train until ``trainer.max_steps``, early stopping, or SIGUSR1 (checkpoint + return). A reward/critic
        server gone past its retry window: checkpoint + ``RunStopped`` (exit 75; the rerun redoes the step)."""
        self._maybe_resume()
        history: list[dict[str, float]] = []
        bar = tqdm(total=self.cfg.trainer.max_steps, initial=self.step, desc=self.stage, unit="step",
                   disable=not (self.cfg.trainer.progress_bar and self.parallel.is_writer))
        stop_reason = "max_steps"
        invalid = InvalidSteps(self.cfg.trainer.max_invalid_steps)
        with PreemptionFlag() as preempted, self._rollouts_stopped():
            while self.step < self.cfg.trainer.max_steps:
                with checkpoint_if_server_gone(self._save, step=self.step, start=self._step_start()):
                    metrics = self.train_one_step()
                self.step += 1
                stalled = invalid.update(metrics.get("valid_frac", 1.0) > 0)
                done = partial(self.logger.log, self.step, metrics)  # a finished step is logged before its checkpoint
                with checkpoint_if_server_gone(self._save, step=self.step, before_save=done):
                    stop = self._after_step(metrics)  # validation scores with the reward too
                self.logger.log(self.step, metrics)
                history.append(metrics)
                self.log.info("step %d: reward %.4f kl %.5f loss %.4f (%.2f s)", self.step, metrics.get("reward/score", math.nan),
                         metrics.get("kl", math.nan), metrics.get("loss/policy", math.nan), metrics.get("time/step", math.nan))
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/score', math.nan):.3f}", kl=f"{metrics.get('kl', math.nan):.4f}")
                if self.parallel.any_rank(bool(preempted)):  # the signal reaches the ranks at different moments
                    self._save()
                    self.log.warning("stopped by %s at step %d; checkpoint written, rerun to resume",
                                preempted.signal or "a signal to another rank", self.step)
                    stop_reason = preempted.signal or "preempted"
                    break
                if stalled:
                    bar.close()
                    self.logger.close()
                    raise invalid.error(self.step, self._save(), self._invalid_reason(metrics))
                if stop:
                    stop_reason = "early_stopping"
                    break
        bar.close()
        if stop_reason in ("max_steps", "early_stopping"):
            self._finish(stop_reason)
        self.logger.close()
        return history

    def train_one_step(self) -> dict[str, float]:
        """rollout → reward → experience → update, each phase timed; the algorithm lives in the hooks below.

        With ``<stage>.overlap_reward`` each rollout micro batch is scored in a worker as soon as it is generated
        and the log-probs are computed while the rewards are in flight (``trainers/scoring.py``); the step waits
        for them only for the advantages (``time/reward_exposed`` of ``time/reward``). Under data parallelism
        each rank runs this on its slice of the step's prompts and returns the step's global metrics (reduced
        over ranks, the same on every rank). With ``<stage>.max_staleness`` >= 1: ``train_one_step_ahead``."""
        if self.ahead is not None:
            return self.train_one_step_ahead()
        timer = PhaseTimer()
        with timer("step"):
            picked = self.parallel.shard(self.sampler.take(self._prompts_per_step()))
            self.step_prompts = picked
            n = self._samples_per_prompt()
            records = records_for_rows([self.data[i] for i in picked], n)
            with RolloutScorer(self.reward, records, self.actor.tokenizer, self.actor.eos_id, self.parallel,
                               overlap=self._algo().overlap_reward) as scorer:
                with timer("generate"):  # a replica's engine gone past its restarts stops every rank alike
                    chunks = self.parallel.agreed(lambda: self._generate([self.prompt_ids[i] for i in picked
                                                                          for _ in range(n)], scorer))
                rollout = assemble_rollout(chunks, self.actor.pad_id)
                metrics, rewards = self._score_and_train(rollout, scorer, timer)
        return self._step_metrics(metrics, rewards, rollout, timer, scorer)

    def _score_and_train(self, rollout: Rollout, scorer: RolloutScorer, timer: PhaseTimer) -> tuple[dict[str, float], Any]:
        """The step after its rollouts: log-probs while the rewards are in flight, then advantages and the update;
        (the metrics so far, the rewards)."""
        if not scorer.overlap:
            scorer.submit(rollout_rows(rollout))  # generate → reward → log-probs, one after the other
        with timer("logprobs"):  # PPO's critic values too: a server call that can fail on one replica
            logprobs = self.parallel.agreed(lambda: self._logprobs(rollout))
        rewards = scorer.result()
        with timer("advantages"):
            experience, metrics = self._experience(rollout, rewards, logprobs)
        with timer("train"):
            metrics.update(self._update(experience))
        return metrics, rewards

    def _step_metrics(self, metrics: dict[str, float], rewards: Any, rollout: Rollout, timer: PhaseTimer,
                      scorer: RolloutScorer, ahead: Mapping[str, float] | None = None) -> dict[str, float]:
        """The step's global metrics (reduced over ranks): the update's, the rewards', the rollout's, the phases'
        times, the rollouts generated ahead (``ahead``) and the engine's refit."""
        metrics.update(rewards.log_dict("reward"))
        metrics.update(response_stats(rollout))
        metrics.update(timer.times)
        metrics.update({"time/reward": scorer.reward_s, "time/reward_exposed": scorer.exposed_s})
        metrics.update(ahead or {})
        if self.engine_sampled():
            metrics.update(self.actor.engine_metrics())  # the refit before this (async: the next) step's generation
        return self.parallel.reduce_metrics(metrics)

    def train_one_step_ahead(self) -> dict[str, float]:
        """The async step (``<stage>.max_staleness`` >= 1, ``trainers/rollouts_ahead.py``): take this step's rollouts
        (generated, and mostly scored, while the last step trained), refit the engine when due and launch the next
        step's, then log-probs → rewards → advantages (the truncated importance weights correct for the older
        weights that sampled them) → update, while the engine generates. Every rank, the same collectives in the
        same order as ``train_one_step``'s, plus the agreements of the take and the launch."""
        ahead, timer = self.ahead, PhaseTimer()
        with timer("step"):
            with timer("generate_exposed"):  # how long the step waited for its rollouts
                current, chunks = ahead.take()
            self.step_prompts = current.picked
            with timer("launch"):
                ahead.launch_next()
            rollout = assemble_rollout([c.chunk for c in chunks], self.actor.pad_id)
            metrics, rewards = self._score_and_train(rollout, current.scorer, timer)
            self.actor.policy_version = self.step + 1  # the weights the next refit names
        return self._step_metrics(metrics, rewards, rollout, timer, current.scorer, ahead.metrics(current, chunks, rollout))

    def _step_start(self) -> StepStart:
        """What an abandoned step puts back (``checkpoint_if_server_gone``): the sampler and RNG, and with rollouts
        generated ahead, the step's own (``rollouts_ahead.AheadStepStart``)."""
        return self.ahead.step_start() if self.ahead is not None else StepStart(self.sampler, self.critic)

    @contextmanager
    def _rollouts_stopped(self) -> Iterator[None]:
        """No rollout flight outlives ``fit`` (the command closes the engine next)."""
        try:
            yield
        finally:
            if self.ahead is not None:
                self.ahead.close()

    def _generate(self, prompt_ids: list[list[int]], scorer: RolloutScorer) -> list[RolloutChunk]:
        """The step's rollouts in micro batches, each handed to the scorer as it comes when overlapping."""
        chunks = []
        for chunk in self.actor.generate_chunks(prompt_ids, self.sampling):
            chunks.append(chunk)
            if scorer.overlap:
                scorer.submit(chunk)  # scored while the next micro batch is generated
        return chunks

    # The stage's hooks (PPO overrides them): batch shape, log-probs, reward → advantage, and the update.
    def _algo(self) -> Any:
        return self.cfg.grpo

    def _prompts_per_step(self) -> int:
        return self.cfg.grpo.num_prompts_per_step

    def _other_micro_batch_sizes(self) -> dict[str, int]:
        """Other models trained on the actor's minibatches, by config key (none here; PPO's critic)."""
        return {}

    def _samples_per_prompt(self) -> int:
        return self.cfg.grpo.num_rollouts_per_prompt

    def _logprobs(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """What the advantages and losses need besides the rewards (computed while the rewards are in flight):
        ``old_logprobs`` unless the training forward provides them (``reuses_training_logprobs``) and
        ``ref_logprobs`` when there is a KL term; ``[B, S-1]`` each."""
        out = {}
        if not self.reuses_training_logprobs():
            out["old_logprobs"] = self.actor.logprobs(rollout)
        if self._algo().initial_policy_kl_penalty > 0:
            out["ref_logprobs"] = self.actor.reference_logprobs(rollout)
        return out

    def reuses_training_logprobs(self) -> bool:
        """A rollout trained exactly on-policy (one epoch, one minibatch: ``global_batch_size`` = the step's
        sequences) uses the training forward's own detached log-probs as the old ones (ratio 1), as TRL and verl
        do, and skips the extra forward pass. Not with ``grpo.kl_in=reward``: its KL must be known before the update."""
        g, m = self.cfg.grpo, self.cfg.model
        rows = self._prompts_per_step() * self._samples_per_prompt()
        kl_in_reward = g.initial_policy_kl_penalty > 0 and g.kl_in == "reward"
        return g.num_epochs == 1 and rows == m.global_batch_size and not kl_in_reward and not self.engine_sampled()

    def engine_sampled(self) -> bool:
        """Whether another engine samples the rollouts (``rollout.engine=vllm``): the trainer then recomputes the old
        log-probs, so the PPO ratio starts from its own and the gap to the engine's is measured."""
        return self.cfg.rollout.engine == "vllm"

    def correct_for_engine(self, rollout: Rollout, old_logprobs: torch.Tensor | None, mask: torch.Tensor,
                           advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """``advantages`` and the engine-gap metrics for a rollout another engine sampled (unchanged otherwise):
        ``rollout/logprob_diff`` (mean |log π_trainer − log π_engine| over the response tokens) and, with
        ``rollout.vllm.tis_cap``, the advantages × the truncated importance weights."""
        if rollout.logprobs is None or old_logprobs is None:
            return advantages, {}
        metrics = {"rollout/logprob_diff": logprob_gap(old_logprobs, rollout.logprobs, mask)}
        cap = self.cfg.rollout.vllm.tis_cap
        if cap is not None:
            weights = truncated_importance_weights(old_logprobs, rollout.logprobs, mask, cap)
            metrics["rollout/tis_weight_mean"] = masked_mean(weights, mask).item() if mask.any() else 1.0
            if self.ahead is not None:  # off-policy by design: how far the weights went
                metrics.update(importance_weight_stats(old_logprobs, rollout.logprobs, mask, cap))
            advantages = advantages * weights
        return advantages, metrics

    def _experience(self, rollout: Rollout, rewards: Any,
                    logprobs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return self.make_experience(rollout, rewards.scores, rewards.token_signs, logprobs)

    def _update(self, experience: Mapping[str, torch.Tensor]) -> dict[str, float]:
        return self.update(experience)

    # ------------------------------------------------------------------ reward → advantage
    def make_experience(self, rollout: Rollout, scores: np.ndarray, token_signs: Sequence[np.ndarray] | None,
                        logprobs: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Mask and token advantages for one rollout (``[B, S-1]`` tensors) from its rewards and ``logprobs``
        (``_logprobs``'s, computed here when not given). Without old log-probs the KL is logged by the loss."""
        g = self.cfg.grpo
        b, s1 = rollout.tokens.shape[0], rollout.tokens.shape[1] - 1
        mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, s1)
        logprobs = self._logprobs(rollout) if logprobs is None else logprobs
        old_logprobs, ref = logprobs.get("old_logprobs"), logprobs.get("ref_logprobs")
        rewards = torch.as_tensor(scores, dtype=torch.float32)
        valid = ~torch.isnan(rewards)
        if g.truncated == "mask":
            valid &= rollout.is_end
        exp = {"tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths,
               "response_lengths": rollout.response_lengths}
        metrics: dict[str, float] = {}
        if old_logprobs is not None:
            exp["old_logprobs"] = old_logprobs
            metrics["kl"] = 0.0
        if ref is not None:
            exp["ref_logprobs"] = ref
        if ref is not None and old_logprobs is not None:
            kl_tok = kl_penalty(old_logprobs, ref, g.kl_estimator)
            metrics["kl"] = masked_mean(kl_tok, mask).item()
            if g.kl_in == "reward":
                rewards = rewards - g.initial_policy_kl_penalty * masked_mean(kl_tok, mask, dim=-1)
        elif ref is None:
            metrics["kl"] = 0.0
        group_ids = torch.arange(b) // g.num_rollouts_per_prompt
        seq_adv = grpo_advantages(torch.where(valid, rewards, torch.zeros_like(rewards)), group_ids,
                                  scale=g.advantage_scale, singleton=g.singleton_groups, valid=valid)
        advantages = expand_to_tokens(seq_adv, mask)
        signs = place_on_tokens(token_signs, rollout, torch.int8)
        if signs is not None and g.fspo_flip:
            advantages = fspo_flip(advantages, signs)
        exp["mask"] = mask * valid.unsqueeze(1).to(mask.dtype)
        advantages, engine_metrics = self.correct_for_engine(rollout, old_logprobs, exp["mask"], advantages)
        metrics.update(engine_metrics)
        exp["advantages"] = advantages * exp["mask"]
        metrics.update({"valid_frac": valid.float().mean().item(),
                        "advantage/abs_mean": masked_mean(advantages.abs(), exp["mask"]).item() if exp["mask"].any() else 0.0})
        if signs is not None:
            flipped = (signs.to(advantages.dtype) * expand_to_tokens(seq_adv, mask) < 0) & (exp["mask"] > 0)
            metrics["fspo/flip_frac"] = flipped.float().sum().item() / max(exp["mask"].sum().item(), 1.0)
        return exp, metrics

    # ------------------------------------------------------------------ loss
    def loss_fn(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], *, global_tokens: float,
                global_seqs: float, kl_tokens: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO-clip + KL-in-loss − entropy for one micro batch, normalised by the step's global counts.

        Without old log-probs (``reuses_training_logprobs``) the ratio is 1 and the logged ``kl`` comes from this
        forward: the micro batch's share of the rank's response-token mean (``kl_tokens`` = its tokens × DP)."""
        m, g = self.cfg.model, self.cfg.grpo
        norm = {"global_tokens": global_tokens, "global_seqs": global_seqs}
        logprobs = out["logprobs"]
        old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()  # exactly on-policy: ratio 1
        loss, metrics = ppo_policy_loss(logprobs, old, mb["advantages"], mb["mask"], eps=m.ratio_eps,
                                        eps_high=m.ratio_eps_high, clip_ratio_c=m.clip_ratio_c, agg=m.loss_agg,
                                        entropy=out.get("entropy"), entropy_coef=m.entropy_bonus, **norm)
        metrics = {"loss/policy": loss.item(), **metrics}
        if "old_logprobs" not in mb and "ref_logprobs" in mb:
            metrics["kl"] = kl_share(old, mb, g.kl_estimator, kl_tokens)
        if g.initial_policy_kl_penalty > 0 and g.kl_in == "loss":
            kl = kl_loss(logprobs, mb["ref_logprobs"], mb["mask"], g.kl_estimator, m.loss_agg, **norm)  # the logged estimator
            loss = loss + g.initial_policy_kl_penalty * kl
            metrics["loss/kl"] = kl.item()
        # Each micro batch returns its share of the step's loss; `update` sums the shares back per step.
        return loss, metrics

    def update(self, exp: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """``grpo.num_epochs`` passes over the rollout in minibatches of ``model.global_batch_size`` sequences
        (over all data-parallel ranks: each rank contributes ``global_batch_size / dp`` of its rows)."""
        m = self.cfg.model
        b, size = exp["tokens"].shape[0], m.global_batch_size // self.parallel.size
        totals: dict[str, float] = {}
        steps = skipped = 0
        all_tokens = response_mask(exp["prompt_lengths"], exp["response_lengths"], exp["tokens"].shape[1] - 1).sum()
        kl_tokens = max(float(all_tokens), 1.0) * self.parallel.size
        for _ in range(self.cfg.grpo.num_epochs):
            order = torch.randperm(b)
            for start in range(0, b, size):
                idx = order[start : start + size]
                mb = {k: v[idx] for k, v in exp.items()}
                global_tokens = self.parallel.global_sum(float(mb["mask"].sum()))
                global_seqs = self.parallel.global_sum(float((mb["mask"].sum(-1) > 0).sum()))
                if global_tokens == 0:
                    skipped += 1  # every sample abstained/truncated: nothing to learn, no optimiser step
                    continue
                fn = partial(self.loss_fn, global_tokens=global_tokens, global_seqs=global_seqs, kl_tokens=kl_tokens)
                result = self.actor.train_step(mb, fn, micro_batch_size=m.micro_batch_size,
                                               need_entropy=m.entropy_bonus > 0)
                steps += 1
                n_micro = math.ceil(len(idx) / m.micro_batch_size) * self.parallel.size
                for k, v in result.items():
                    # loss (and kl) shares were averaged over micro batches (and data-parallel ranks) by the backend;
                    # undo that to get the step's values
                    scale = n_micro if k.startswith("loss/") or k == "kl" else 1
                    totals[k] = totals.get(k, 0.0) + v * scale
        out = {k: v / max(steps, 1) for k, v in totals.items()}
        if self.reuses_training_logprobs() and "kl" not in out:
            # no optimiser step (every sample abstained/truncated): no forward gave the policy's log-probs
            out["kl"] = 0.0 if self.cfg.grpo.initial_policy_kl_penalty == 0 else math.nan
        out["optimizer_steps"] = float(steps)
        out["skipped_minibatches"] = float(skipped)
        return out

    # ------------------------------------------------------------------ validation, checkpoints
    def _validate_reward(self, step: int) -> dict[str, float]:
        """Greedy responses to the validation prompts, scored by the training reward. Each data-parallel rank
        generates and scores its contiguous part of the prompts; the scores are gathered, so every rank logs
        the whole set's metrics (those of world 1)."""
        ids = encode_prompts(self.val_data, self.actor.tokenizer, self.cfg.data.apply_chat_template,
                             self.cfg.data.max_prompt_tokens)
        mine = self.parallel.split(range(len(ids)))

        def score_mine() -> list[RewardBatch]:
            if not mine:
                return []
            greedy = SamplingParams(self.sampling.max_new_tokens, use_greedy=True)
            # in the rollouts' chunks (model.rollout_micro_batch_size): one batch of every validation prompt would need
            # its own KV cache and, with hf_generation=compiled, its own compiled graph and static cache
            rollout = assemble_rollout(list(self.actor.generate_chunks([ids[i] for i in mine], greedy)),
                                       self.actor.pad_id)
            records = [self.val_data[i] for i in mine]
            return [self.parallel.on_model_parallel_source(
                lambda: score_rollout(self.reward, rollout, records, self.actor.tokenizer, self.actor.eos_id))[0]]

        parts = self.parallel.agreed(score_mine)  # every rank reaches the gather, or every rank stops
        batch = RewardBatch.concat([b for rank_parts in self.parallel.gather(parts) for b in rank_parts])
        logged = batch.log_dict("reward")
        return {k.replace("reward/", "val/reward/"): v for k, v in logged.items()} | {"val/reward": logged["reward/score"]}

    def _after_step(self, metrics: dict[str, float]) -> bool:
        t = self.cfg.trainer
        stop = False
        if self.validate is not None and t.val_check_interval and self.step % t.val_check_interval == 0:
            if self.ahead is not None:
                self.ahead.settle()  # the validation's rollouts use the engine too
            val = self.parallel.reduce_metrics(self.validate(self.step))  # one early-stopping decision on every rank
            metrics.update(val)
            improved, stop = self.early.update(self.step, val)
            if improved:  # named before the save, so the checkpoint's own state names it too
                self.checkpointer.best = f"step_{self.step:06d}"
                self._save()
        if t.save_interval and self.step % t.save_interval == 0:
            self._save()  # not written twice when it is also the best
        return stop

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "early_stopping": self.early.state_dict(),
                "best": self.checkpointer.best}

    def _save(self, force: bool = False) -> Path:
        extra = None
        if self.ahead is not None:  # the rollouts generated for the next step are part of the checkpoint
            self.ahead.settle()
            extra = partial(write_pending, self.parallel.gather(self.ahead.state()), self.ahead.k)
        return self.checkpointer.save(self.step, self.actor, self.critic, self._state(), extra, force=force)

    def _maybe_resume(self) -> None:
        latest = self.checkpointer.latest() if self.cfg.exp_manager.resume_if_exists else None
        if latest is None:
            return
        state = self.checkpointer.load(latest, self.actor, self.critic)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.early.load_state_dict(state["early_stopping"])
        self.checkpointer.best = state.get("best")
        if self.ahead is not None:
            self.ahead.load(latest)
        elif (latest / PENDING_FILE).exists():
            self.log.warning("%s holds rollouts generated ahead for step %d (max_staleness >= 1); this run is on-policy "
                             "and draws the prompts after them", latest, self.step + 1)
        self.logger.truncate_after(self.step)
        self.log.info("resumed from %s (step %d)", latest, self.step)

    def _finish(self, reason: str) -> None:
        es = self.cfg.trainer.early_stopping
        best = self.checkpointer.best
        restored = bool(es.monitor and es.restore_best and best and best != f"step_{self.step:06d}")
        if restored:
            # the exported policy is the best validated one, whether training stopped early or ran out of steps
            self.log.info("%s at step %d; restoring the best weights (%s)", reason, self.step, best)
            self.actor.load_weights(self.checkpointer.root / best)
        self._save(force=restored)  # a step the save interval just wrote is not written (nor logged) again
        self.actor.export(self.run_dir / "final")
        self.log.info("training finished at step %d (%s); final policy in %s", self.step, reason, self.run_dir / "final")

    def _invalid_reason(self, metrics: Mapping[str, float]) -> str:
        """Why the last step had no valid sample, from its metrics: failed/abstained rewards or truncation."""
        truncated = getattr(self.cfg, self.stage).truncated
        why = f"reward NaN for {metrics.get('reward/abstain_frac', math.nan):.0%} of the samples (failed judges or abstentions)"
        if truncated == "mask":
            why += f", {metrics.get('is_end_frac', math.nan):.0%} ended with EOS ({self.stage}.truncated=mask drops the rest)"
        return why


if __name__ == "__main__":  # `python -m nemo_factuality.trainers.grpo`: `nemo-factuality train grpo`, through the
    from nemo_factuality.cli import run_as_module  # commands' one boundary (it imports no stage: no circle)

    run_as_module("train", "grpo")
