"""The gap between the engine that sampled a rollout and the trainer that learns from it (vLLM rollouts).

An inference engine (other kernels, bf16, another attention) assigns the sampled tokens slightly different
log-probs than the trainer's forward does: the rollout is a little off-policy. ``logprob_gap`` measures it; the
truncated importance weight ``min(π_trainer / π_engine, cap)`` (per token, no gradient) corrects for it, as the
peers (verl, NeMo-RL) offer.
"""

from __future__ import annotations

import torch

from nemo_factuality.algorithms.checks import check_same_shape


def logprob_gap(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean ``|log π_trainer − log π_engine|`` over the masked tokens (0 without any). ``[B, T]`` each."""
    check_same_shape(("trainer_logprobs", trainer_logprobs), ("engine_logprobs", engine_logprobs), ("mask", mask))
    n = float(mask.sum())
    return float(((trainer_logprobs - engine_logprobs).abs() * mask).sum()) / n if n else 0.0


def truncated_importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """``[B, T]`` per-token ``min(exp(log π_trainer − log π_engine), cap)`` where ``mask``, else 0 (detached).

    Multiplying each token's advantage by it is the truncated-IS estimator: PPO-clip's ``min(r·A, clip(r)·A)`` times a
    weight ``w >= 0`` equals the same objective with ``w·A`` for ``A``."""
    check_same_shape(("trainer_logprobs", trainer_logprobs), ("engine_logprobs", engine_logprobs), ("mask", mask))
    if cap < 1.0:
        raise ValueError(f"truncated importance weights need cap >= 1, got {cap}")
    ratio = torch.exp((trainer_logprobs - engine_logprobs).detach().float())
    return torch.clamp(ratio, max=cap) * mask


def importance_weight_stats(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                            cap: float) -> dict[str, float]:
    """How far the sampling policy was from the trainer's over the masked tokens (``[B, T]`` each), for rollouts of
    older weights: the untruncated ratio ``π_trainer / π_engine``'s min and max, and the fraction of tokens whose
    weight the cap truncated (``ratio > cap``). NaN without a masked token."""
    check_same_shape(("trainer_logprobs", trainer_logprobs), ("engine_logprobs", engine_logprobs), ("mask", mask))
    on = mask > 0
    if not bool(on.any()):
        return {"rollout/tis_ratio_min": float("nan"), "rollout/tis_ratio_max": float("nan"),
                "rollout/tis_clipped_frac": float("nan")}
    ratio = torch.exp((trainer_logprobs - engine_logprobs).detach().double())[on]
    return {"rollout/tis_ratio_min": ratio.min().item(), "rollout/tis_ratio_max": ratio.max().item(),
            "rollout/tis_clipped_frac": (ratio > cap).double().mean().item()}
