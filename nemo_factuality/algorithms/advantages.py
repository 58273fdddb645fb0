"""Advantage estimators and reward shaping: pure torch functions, shapes in docstrings.

Conventions follow NeMo-Aligner 0.7.0 (``nemo_aligner/utils/ppo_utils.py``) where it has the
function, checked against its outputs in ``tests/algorithms``; GRPO, Dr.GRPO and the FSPO flip
follow the papers (Shao et al. 2024; Liu et al. 2025; FSPO, arXiv 2505.24630).

Token tensors are ``[B, T]`` over the positions that *predict* the next token (one fewer than the
sequence, as in Aligner); masks are float ``{0, 1}`` of the same shape.
"""

from __future__ import annotations

from typing import Literal

import torch

from nemo_factuality.algorithms.checks import check_same_shape, check_shape

KLKind = Literal["k1", "abs", "k3"]


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Mask of action positions: ``mask[i, prompt_len-1 : response_len-1] = 1`` (keeps one EOS).

    Example:
        >>> response_mask(torch.tensor([2, 3]), torch.tensor([5, 4]), 5)
        tensor([[0., 1., 1., 1., 0.],
                [0., 0., 1., 0., 0.]])

    Args:
        prompt_lengths: ``[B]`` int, tokens in each prompt.
        response_lengths: ``[B]`` int, prompt + response tokens (Aligner's ``response_lengths``).
        seq_len: ``T``, the number of action positions (sequence length - 1).

    Returns:
        ``[B, T]`` float mask.
    """
    check_shape("prompt_lengths", prompt_lengths, (None,))
    check_same_shape(("prompt_lengths", prompt_lengths), ("response_lengths", response_lengths))
    pos = torch.arange(seq_len, device=prompt_lengths.device).unsqueeze(0)
    start = (prompt_lengths - 1).unsqueeze(1)
    end = (response_lengths - 1).unsqueeze(1)
    return ((pos >= start) & (pos < end)).to(torch.get_default_dtype())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "abs") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    ``k1 = logp - logp_ref``; ``abs = |k1|`` (NeMo-Aligner's ``use_absolute_kl=True`` default);
    ``k3 = exp(-k1) - 1 + k1`` (Schulman's low-variance, non-negative estimator).

    Args:
        logprobs, ref_logprobs: ``[B, T]``.

    Returns:
        ``[B, T]``.
    """
    check_same_shape(("logprobs", logprobs), ("ref_logprobs", ref_logprobs))
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k3":
        return torch.exp(-diff) - 1 + diff
    raise ValueError(f"kl kind must be 'k1', 'abs' or 'k3', got {kind!r}")


def scalar_rewards_with_kl(rewards: torch.Tensor, response_lengths: torch.Tensor, kl: torch.Tensor,
                           coef: float) -> torch.Tensor:
    """Aligner's PPO reward: ``-coef * kl`` per token plus the scalar reward at index ``response_length - 2``, clamped
    at 0 as Aligner's ``calculate_ppo_rewards`` does (a response without tokens gets its reward on position 0, a
    prompt position; the PPO stage's ``token_reward_tensor`` handles that case explicitly instead).

    Args:
        rewards: ``[B]`` sequence rewards.
        response_lengths: ``[B]`` prompt + response tokens.
        kl: ``[B, T]`` per-token KL.

    Returns:
        ``[B, T]`` token rewards.
    """
    check_shape("rewards", rewards, (kl.shape[0],))
    out = -coef * kl
    rows = torch.arange(kl.shape[0], device=kl.device)
    out[rows, (response_lengths - 2).clamp(min=0)] += rewards.to(out.dtype)
    return out


def dense_rewards_with_kl(token_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Token-level (RLFH) rewards with the KL penalty in the reward: ``(r_t - coef * kl_t) * mask``.

    Args:
        token_rewards, kl, mask: ``[B, T]``.

    Returns:
        ``[B, T]``.
    """
    check_same_shape(("token_rewards", token_rewards), ("kl", kl), ("mask", mask))
    return (token_rewards - coef * kl) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token rewards (Schulman et al. 2016, eq. 16).

    Rewards and values are masked first; the value after the last position is 0; returns are
    ``advantages + values`` (NeMo-Aligner's ``calculate_advantages_and_returns``).

    Args:
        rewards, values, mask: ``[B, T]``.

    Returns:
        ``(advantages, returns)``, each ``[B, T]``.
    """
    check_same_shape(("rewards", rewards), ("values", values), ("mask", mask))
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    steps = rewards.shape[1]
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def group_ids_from_prompts(prompts: torch.Tensor) -> torch.Tensor:
    """Group index per row: rows with identical prompt tokens share a group (``[B, P]`` → ``[B]``)."""
    check_shape("prompts", prompts, (None, None))
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    return inverse


def rloo_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline (NeMo-Aligner RLOO): mean reward of the *other* valid rows of the group.

    Groups with at most one valid row get ``baseline = reward`` (zero advantage). Rows that did not
    end keep Aligner's arithmetic: ``sum(valid rewards) / (n_valid - 1)``.

    Args:
        rewards: ``[B]``.
        group_ids: ``[B]`` int (see ``group_ids_from_prompts``).
        valid: ``[B]`` float {0, 1} (Aligner: ``is_end``).

    Returns:
        ``[B]`` baselines.
    """
    check_same_shape(("rewards", rewards), ("group_ids", group_ids), ("valid", valid))
    baseline = torch.empty_like(rewards)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero(as_tuple=True)[0]
        r, m = rewards[idx], valid[idx].to(rewards.dtype)
        n_valid = m.sum()
        if n_valid <= 1:
            baseline[idx] = r
        else:
            # Aligner divides by n_valid - 1 for every row, so a row that did not end (m=0) gets the
            # sum of all valid rewards over n_valid - 1 (slightly larger in magnitude than their mean).
            baseline[idx] = ((r * m).sum() - r * m) / (n_valid - 1)
    return baseline


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: Literal["std", "none"] = "std",
                    eps: float = 1e-6, singleton: Literal["zero", "raw"] = "zero",
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """Group-normalised outcome advantages: ``(r - mean_g) / (std_g + eps)``; Dr.GRPO uses ``scale="none"``.

    ``std`` is the unbiased sample std of the group (DeepSeekMath's reference, verl). Only ``valid``
    rows enter a group's statistics; invalid rows (abstentions, truncated samples the trainer masks)
    get advantage 0.

    A group with one valid sample has no baseline. ``singleton="zero"`` (default) gives it advantage
    0: no learning signal from a prompt sampled once. ``singleton="raw"`` is verl's convention
    (mean 0, std 1), i.e. the raw reward is the advantage.

    Example: two groups of two; the second has no spread, so no signal.
        >>> grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]))
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])

    Args:
        rewards: ``[B]`` sequence rewards (NaN only where ``valid`` is 0).
        group_ids: ``[B]`` int group index (one group per prompt).
        valid: optional ``[B]`` bool/float {0, 1}; default all rows.

    Returns:
        ``[B]`` advantages (broadcast over tokens with ``expand_to_tokens``).
    """
    check_same_shape(("rewards", rewards), ("group_ids", group_ids))
    valid_mask = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    check_same_shape(("rewards", rewards), ("valid", valid_mask))
    nan_rows = torch.isnan(rewards) & valid_mask
    if nan_rows.any():
        bad = nan_rows.nonzero(as_tuple=True)[0].tolist()
        raise ValueError(f"grpo_advantages: NaN rewards at samples {bad}; mark abstentions invalid (valid=0) before GRPO")
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if singleton not in ("zero", "raw"):
        raise ValueError(f"singleton must be 'zero' or 'raw', got {singleton!r}")
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = ((group_ids == g) & valid_mask).nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            continue
        r = rewards[idx]
        if idx.numel() == 1:
            adv[idx] = r if singleton == "raw" else 0.0
            continue
        centred = r - r.mean()
        adv[idx] = centred / (r.std(unbiased=True) + eps) if scale == "std" else centred
    return adv


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``reward - rloo_baseline`` (``[B]``)."""
    valid = torch.ones_like(rewards) if valid is None else valid
    return rewards - rloo_baseline(rewards, group_ids, valid)


def expand_to_tokens(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[B]`` sequence advantages over ``[B, T]`` action tokens (zero outside the mask)."""
    check_shape("seq_advantages", seq_advantages, (mask.shape[0],))
    return seq_advantages.unsqueeze(1) * mask


def fspo_flip(advantages: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """FSPO's factuality-aware flip: ``A' = where(sign * A >= 0, A, -A)``.

    A token in a sentence verified as supported (sign +1) never gets a negative advantage, one in an
    unsupported sentence (sign -1) never gets a positive one, and sign 0 leaves ``A`` unchanged.
    Apply after group normalisation.

    Example:
        >>> fspo_flip(torch.tensor([[0.5, 0.5, -0.5]]), torch.tensor([[1, -1, 1]]))
        tensor([[ 0.5000, -0.5000,  0.5000]])

    Args:
        advantages: ``[B, T]`` token advantages.
        signs: ``[B, T]`` in {-1, 0, +1}.

    Returns:
        ``[B, T]``.
    """
    check_same_shape(("advantages", advantages), ("signs", signs))
    if not torch.isin(signs, torch.tensor([-1, 0, 1], device=signs.device, dtype=signs.dtype)).all():
        raise ValueError("fspo_flip: signs must be -1, 0 or +1")
    return torch.where(signs.to(advantages.dtype) * advantages >= 0, advantages, -advantages)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (over ``dim`` or everything); 0 where the mask is empty."""
    check_same_shape(("values", values), ("mask", mask))
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, *, unbiased: bool = False,
                  shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps)`` over masked entries (PPO's ``normalize_advantages``), masked entries only.

    ``unbiased=True`` uses the sample variance ``var · n / (n - 1)`` over the ``n`` masked entries, as
    verl's ``masked_whiten`` does; the default (biased) matches NeMo-Aligner's ``normalize_tensor``.
    ``shift_mean=False`` rescales without centring.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    centred = values - mean if shift_mean else values
    return centred * torch.rsqrt(var + eps) * mask
