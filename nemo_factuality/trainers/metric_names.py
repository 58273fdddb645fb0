"""Every metric name the training stages write to ``metrics.jsonl`` (and TensorBoard / wandb), with its meaning.

The docs' metric reference is generated from ``METRICS``; ``tests/docs`` runs each stage on a tiny model and checks
that every key it logs matches an entry here, and that every entry is logged by the stages it names. A name with
``<...>`` is a family: ``reward/<component>`` is one key per component the reward returns.

>>> find("reward/checklist_recall").name
'reward/<component>'
>>> find("time/generate").stages
('grpo', 'ppo')
>>> find("no/such/metric") is None
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GRPO, PPO, KTO = "grpo", "ppo", "kto"
ALL = (GRPO, PPO, KTO)
ASYNC = "rollout.engine=vllm, grpo.max_staleness (ppo.max_staleness) >= 1"


@dataclass(frozen=True)
class Metric:
    name: str
    stages: tuple[str, ...]
    meaning: str
    # logged only under a condition the docs test's tiny runs do not set up (e.g. the aligner backend)
    condition: str = ""

    def matches(self, key: str) -> bool:
        pattern = "^" + re.sub(r"<[^>]+>", "[^/]+", re.escape(self.name).replace(r"\<", "<").replace(r"\>", ">")) + "$"
        return re.match(pattern, key) is not None


METRICS: tuple[Metric, ...] = (
    Metric("step", ALL, "the optimiser-visible step this line belongs to (GRPO/PPO: rollout step; KTO: optimiser step)"),
    # reward
    Metric("reward/score", (GRPO, PPO), "mean reward over the step's valid samples (NaN samples left out)"),
    Metric("reward/<component>", (GRPO, PPO), "mean of one named component the reward returns (KLCF "
           "`checklist_recall`, `truthfulness_precision`, `general_rm`; KnowRL `format`, `correct`, `fact`; …)"),
    Metric("reward/abstain_frac", (GRPO, PPO), "share of samples whose score is NaN: abstained (blank) or failed"),
    Metric("reward/token_sum", (PPO,), "mean over valid samples of the summed token rewards (RLFH's dense reward)"),
    Metric("valid_frac", (GRPO, PPO), "share of samples that enter the loss (not NaN; under `truncated=mask`, "
           "also ended with EOS)"),
    # policy
    Metric("kl", (GRPO, PPO), "mean per-token KL of the policy to the reference, with the configured estimator"),
    Metric("loss/policy", (GRPO, PPO), "the PPO-clip policy loss (GRPO: with the entropy bonus), globally normalised"),
    Metric("loss/kl", (GRPO,), "β·KL term of the loss (`grpo.kl_in=loss` and a KL coefficient above 0)"),
    Metric("loss/value", (PPO,), "the critic's clipped value loss"),
    Metric("loss/kto", (KTO,), "the KTO loss of the minibatch"),
    Metric("loss/fkto", (KTO,), "FactAlign's sentence-level fKTO loss (before the λ weight)"),
    Metric("loss", (GRPO, PPO, KTO), "the sum of the micro batches' losses as NeMo-Aligner's actor reports it",
           condition="trainer.backend=aligner"),
    Metric("clipfrac", (GRPO, PPO), "share of response tokens whose ratio was clipped"),
    Metric("dual_clipfrac", (GRPO, PPO), "share of tokens capped by the dual clip (`model.clip_ratio_c`)"),
    Metric("approx_kl", (GRPO, PPO), "k3 estimate of KL(π_old ‖ π) over response tokens: how far the update moved from the rollout policy"),
    Metric("ratio_mean", (GRPO, PPO), "mean importance ratio π/π_old over response tokens (1 on-policy)"),
    Metric("advantage/abs_mean", (GRPO,), "mean |advantage| over the tokens in the loss (0: no group had signal)"),
    Metric("fspo/flip_frac", (GRPO,), "share of tokens whose advantage FSPO's flip reversed (the reward's token signs)"),
    Metric("optimizer_steps", (GRPO,), "optimiser steps taken this rollout step"),
    Metric("skipped_minibatches", (GRPO,), "minibatches with no valid token (every sample NaN or masked): no step"),
    Metric("grad_norm", ALL, "gradient norm before clipping (the actor's)"),
    Metric("lr", ALL, "the actor's learning rate at this step"),
    # critic
    Metric("values/mean", (PPO,), "mean critic value over response tokens"),
    Metric("returns/mean", (PPO,), "mean GAE return over response tokens"),
    Metric("critic/grad_norm", (PPO,), "the critic's gradient norm"),
    Metric("actor_trained", (PPO,), "1 when the actor was updated, 0 during `ppo.critic_warmup_steps`"),
    # KTO
    Metric("iteration", (KTO,), "the KTO iteration (sample → label → train) this step belongs to"),
    Metric("kto/labelled", (KTO,), "samples the labeller labelled this iteration"),
    Metric("kto/dropped_unlabelled", (KTO,), "samples it could not label (judge failed), dropped rather than guessed"),
    Metric("kto/desirable_frac", (KTO,), "share of labelled samples that are desirable"),
    Metric("kto/general_pairs", (KTO,), "general preference pairs mixed in (`kto.general_data_ratio`)"),
    Metric("kto/sentences", (KTO,), "sentence labels placed on tokens (fKTO's units)"),
    Metric("kto/z0", (KTO,), "KTO's reference point z0 from mismatched prompt/completion pairs"),
    Metric("kto/z0_f", (KTO,), "fKTO's sentence-level reference point"),
    # rollouts
    Metric("response_length/mean", (GRPO, PPO), "mean response length in tokens"),
    Metric("response_length/max", (GRPO, PPO), "longest response in tokens"),
    Metric("is_end_frac", (GRPO, PPO), "share of responses that ended with EOS within `model.length_params.max_length`"),
    # time
    Metric("time/generate", (GRPO, PPO), "seconds generating rollouts (at `max_staleness` >= 1: the engine's wall "
           "time on this step's rollouts, generated while the previous step trained; NaN for rollouts a checkpoint "
           "saved)"),
    Metric("time/reward", ALL, "wall seconds of the reward (labeller) calls, overlapped or not"),
    Metric("time/reward_exposed", ALL, "the part of `time/reward` the step waited for (0 when fully overlapped)"),
    Metric("time/logprobs", (GRPO, PPO), "seconds computing old/reference log-probs (and PPO's values)"),
    Metric("time/advantages", (GRPO, PPO), "seconds from rewards to advantages"),
    Metric("time/train", ALL, "seconds in optimiser steps"),
    Metric("time/step", (GRPO, PPO), "the whole step, wall seconds"),
    Metric("time/refit", (GRPO, PPO), "seconds pushing the trainer's weights into the rollout engine before this "
           "step's generation (export + reload; 0 when none was due)", condition="rollout.engine=vllm"),
    Metric("rollout/logprob_diff", (GRPO, PPO), "mean |log π_trainer − log π_engine| of the sampled response tokens: "
           "how far the engine that sampled is from the trainer", condition="rollout.engine=vllm"),
    Metric("rollout/tis_weight_mean", (GRPO, PPO), "mean truncated importance weight min(π_trainer / π_engine, "
           "rollout.vllm.tis_cap) the advantages were multiplied by", condition="rollout.engine=vllm, rollout.vllm.tis_cap set"),
    # async GRPO / PPO (<stage>.max_staleness >= 1: the next step's rollouts generate while this one trains)
    Metric("rollout/staleness", (GRPO, PPO), "mean over the step's rollouts of the trainer's step minus the weight "
           "version that generated them (0: on-policy; at most `max_staleness`)", condition=ASYNC),
    Metric("rollout/staleness_max", (GRPO, PPO), "the step's largest staleness", condition=ASYNC),
    Metric("rollout/tis_ratio_min", (GRPO, PPO), "smallest untruncated π_trainer / π_engine over the response tokens",
           condition=ASYNC),
    Metric("rollout/tis_ratio_max", (GRPO, PPO), "largest untruncated π_trainer / π_engine over the response tokens",
           condition=ASYNC),
    Metric("rollout/tis_clipped_frac", (GRPO, PPO), "share of response tokens whose importance ratio exceeded "
           "`rollout.vllm.tis_cap` (their weight truncated to it)", condition=ASYNC),
    Metric("time/generate_exposed", (GRPO, PPO), "seconds the step waited for its rollouts (the part of generation "
           "the previous step's training did not hide)", condition=ASYNC),
    Metric("time/launch", (GRPO, PPO), "seconds refitting the engine (when due) and launching the next step's "
           "rollouts", condition=ASYNC),
    Metric("time/engine_idle", (GRPO, PPO), "seconds the engine had nothing to generate: from its last answer for "
           "this step's rollouts to the next step's launch (NaN at the last step)", condition=ASYNC),
    Metric("time/collect", (KTO,), "seconds sampling and labelling an iteration's examples"),
    Metric("time/reference_points", (KTO,), "seconds computing the iteration's reference log-probs once"),
    # validation
    Metric("val/reward", (GRPO, PPO), "mean training reward on `data.validation` (greedy), every "
           "`trainer.val_check_interval` steps; `trainer.early_stopping.monitor` names a key like this"),
    Metric("val/reward/<component>", (GRPO, PPO), "`reward/<component>` on the validation prompts (also "
           "`val/reward/score`, `val/reward/abstain_frac`)"),
)


def find(key: str) -> Metric | None:
    """The catalogue entry a logged key belongs to (exact names before families), or None."""
    exact = [m for m in METRICS if m.name == key]
    if exact:
        return exact[0]
    return next((m for m in METRICS if "<" in m.name and m.matches(key)), None)
