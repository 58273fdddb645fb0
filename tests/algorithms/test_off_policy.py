"""The engine-gap math (``algorithms.off_policy``) against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_factuality.algorithms.off_policy import importance_weight_stats, logprob_gap, truncated_importance_weights


def test_the_gap_is_the_mean_absolute_difference_over_the_masked_tokens():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    engine = torch.tensor([[-1.5, -2.0, -1.0], [-0.25, -0.75, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert logprob_gap(trainer, engine, mask) == pytest.approx((0.5 + 0 + 0.25 + 0.25) / 4)
    assert logprob_gap(trainer, engine, torch.zeros_like(mask)) == 0.0


def test_weights_are_the_ratio_truncated_at_the_cap_and_zero_off_the_mask():
    trainer = torch.tensor([[math.log(0.3), math.log(0.9), math.log(0.5)]])
    engine = torch.tensor([[math.log(0.6), math.log(0.1), math.log(0.5)]])
    w = truncated_importance_weights(trainer, engine, torch.tensor([[1.0, 1.0, 0.0]]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 2.0, 0.0]]))  # 0.3/0.6; 0.9/0.1 = 9 → 2; masked
    trainer.requires_grad_(True)
    assert not truncated_importance_weights(trainer, engine, torch.ones(1, 3), cap=2.0).requires_grad
    with pytest.raises(ValueError, match="cap >= 1"):
        truncated_importance_weights(trainer, engine, torch.ones(1, 3), cap=0.5)


def test_the_weight_statistics_are_the_untruncated_ratios_extremes_and_the_share_the_cap_cut():
    """Async GRPO's logged spread of π_trainer / π_engine: ratios 0.3/0.6 = 0.5, 0.9/0.1 = 9, 0.4/0.2 = 2 on the mask
    (the third column's 0.5/0.5 is off it); the cap 1.5 cuts 9 and 2: 2 of 3."""
    trainer = torch.tensor([[math.log(0.3), math.log(0.9), math.log(0.5)], [math.log(0.4), 0.0, 0.0]])
    engine = torch.tensor([[math.log(0.6), math.log(0.1), math.log(0.5)], [math.log(0.2), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    stats = importance_weight_stats(trainer, engine, mask, cap=1.5)
    assert stats["rollout/tis_ratio_min"] == pytest.approx(0.5)
    assert stats["rollout/tis_ratio_max"] == pytest.approx(9.0)
    assert stats["rollout/tis_clipped_frac"] == pytest.approx(2 / 3)
    assert all(math.isnan(v) for v in importance_weight_stats(trainer, engine, torch.zeros_like(mask), cap=1.5).values())
