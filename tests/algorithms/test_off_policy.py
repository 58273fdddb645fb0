"""The engine-gap math (``algorithms.off_policy``) against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_factuality.algorithms.off_policy import logprob_gap, truncated_importance_weights


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
