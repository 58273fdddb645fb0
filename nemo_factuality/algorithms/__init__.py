"""RL math on tensors only (no text, no I/O): advantages, KL, policy/value/preference losses."""

from nemo_factuality.algorithms.advantages import (
    dense_rewards_with_kl,
    expand_to_tokens,
    fspo_flip,
    gae,
    group_ids_from_prompts,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    response_mask,
    rloo_advantages,
    rloo_baseline,
    scalar_rewards_with_kl,
)
from nemo_factuality.algorithms.losses import (
    aggregate,
    factalign_loss,
    kl_loss,
    kto_loss,
    kto_losses,
    ppo_policy_loss,
    reference_point,
    sentence_logratios,
    sequence_logratios,
    value_loss,
)

__all__ = [
    "dense_rewards_with_kl", "expand_to_tokens", "fspo_flip", "gae", "group_ids_from_prompts", "grpo_advantages",
    "kl_penalty", "masked_mean", "masked_whiten", "response_mask", "rloo_advantages", "rloo_baseline",
    "scalar_rewards_with_kl", "aggregate", "factalign_loss", "kl_loss", "kto_loss", "ppo_policy_loss",
    "reference_point", "sentence_logratios", "sequence_logratios", "value_loss", "kto_losses",
]
