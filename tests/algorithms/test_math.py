"""Hand-computed cases for GRPO/Dr.GRPO/RLOO, the FSPO flip, PPO/value losses and KTO/fKTO."""

import math

import pytest
import torch

from nemo_factuality.algorithms import (
    aggregate,
    dense_rewards_with_kl,
    expand_to_tokens,
    factalign_loss,
    fspo_flip,
    grpo_advantages,
    kl_loss,
    kl_penalty,
    kto_loss,
    masked_whiten,
    ppo_policy_loss,
    reference_point,
    rloo_advantages,
    sentence_logratios,
    sequence_logratios,
    value_loss,
)

T = torch.tensor


def test_grpo_and_dr_grpo():
    r = T([1.0, 0.0, 0.0, 3.0, 5.0])
    g = T([0, 0, 0, 1, 1])
    # group 0: mean 1/3, sample std sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3)
    std0 = math.sqrt(1 / 3)
    adv = grpo_advantages(r, g, eps=0.0)
    torch.testing.assert_close(adv[:3], T([2 / 3, -1 / 3, -1 / 3]) / std0)
    # group 1: mean 4, std sqrt(2): (-1, 1)/sqrt(2)
    torch.testing.assert_close(adv[3:], T([-1.0, 1.0]) / math.sqrt(2))
    torch.testing.assert_close(grpo_advantages(r, g, scale="none"), T([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]))
    assert grpo_advantages(T([2.0, 7.0]), T([0, 1])).tolist() == [0.0, 0.0]  # singleton groups: no signal
    with pytest.raises(ValueError, match=r"NaN rewards at samples \[1\]"):
        grpo_advantages(T([1.0, float("nan")]), T([0, 0]))


def test_rloo_leave_one_out_and_invalid_rows():
    r, g = T([1.0, 2.0, 6.0]), T([0, 0, 0])
    # baselines: (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5
    torch.testing.assert_close(rloo_advantages(r, g), T([-3.0, -1.5, 4.5]))
    # row 2 not ended: excluded from the others' baselines (2 and 1); its own baseline is Aligner's
    # sum(valid)/(n_valid-1) = 3/1 = 3
    torch.testing.assert_close(rloo_advantages(r, g, T([1.0, 1.0, 0.0])), T([-1.0, 1.0, 3.0]))


@pytest.mark.parametrize("sign,adv,expected", [(1, 0.5, 0.5), (1, -0.5, 0.5), (-1, 0.5, -0.5), (-1, -0.5, -0.5),
                                               (0, 0.5, 0.5), (0, -0.5, -0.5), (1, 0.0, 0.0)])
def test_fspo_flip_truth_table(sign, adv, expected):
    assert fspo_flip(T([[adv]]), T([[sign]])).item() == expected


def test_fspo_flip_rejects_bad_signs_and_shapes():
    with pytest.raises(ValueError, match="-1, 0 or \\+1"):
        fspo_flip(T([[1.0]]), T([[2]]))
    with pytest.raises(ValueError, match=r"advantages \[1, 2\] vs signs \[1, 3\]"):
        fspo_flip(torch.zeros(1, 2), torch.zeros(1, 3))


def test_kl_estimators_and_dense_rewards():
    lp, ref = T([[0.0, -1.0]]), T([[-0.5, -1.0]])
    assert kl_penalty(lp, ref, "k1").tolist() == [[0.5, 0.0]]
    # k3 = exp(-0.5) - 1 + 0.5
    assert kl_penalty(lp, ref, "k3")[0, 0].item() == pytest.approx(math.exp(-0.5) - 0.5)
    r = dense_rewards_with_kl(T([[1.0, 2.0]]), T([[0.5, 0.0]]), T([[1.0, 0.0]]), coef=0.1)
    assert r.tolist() == [[pytest.approx(0.95), 0.0]]


def test_ppo_clip_gradients_and_clipfrac():
    old = torch.zeros(1, 3)
    new = T([[0.5, -0.5, 0.0]], requires_grad=True)  # ratios e^0.5=1.65, e^-0.5=0.61, 1
    adv = T([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, m = ppo_policy_loss(new, old, adv, mask, eps=0.2)
    # token0: min(1.65, 1.2)*1 = 1.2 (clipped); token1: min(-0.61, -0.8) = -0.8 (clipped); token2: 1
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 1.0) / 3)
    assert m["clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] == 0  # clipped tokens give no gradient
    assert new.grad[0, 2] < 0  # positive advantage: descending the loss raises logp
    # clip-higher lets the positive-advantage token through up to 1 + 0.8
    loss_hi, _ = ppo_policy_loss(new.detach(), old, adv, mask, eps=0.2, eps_high=0.8)
    assert loss_hi.item() == pytest.approx(-(math.exp(0.5) - 0.8 + 1.0) / 3)


def test_aggregations():
    loss = T([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(8 / 5)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((4 + 4) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(loss, mask, "sum")  # type: ignore[arg-type]


def test_value_loss_clipping():
    # v=1.0, old=0.0, R=1.0, clip 0.2: clipped v=0.2 -> (0.8)^2=0.64; unclipped 0 -> max 0.64 -> 0.5*0.64
    assert value_loss(T([[1.0]]), T([[0.0]]), T([[1.0]]), T([[1.0]])).item() == pytest.approx(0.32)


def test_kl_loss_and_whiten_and_expand():
    assert kl_loss(T([[0.0]]), T([[0.0]]), T([[1.0]])).item() == 0.0
    w = masked_whiten(T([[1.0, 3.0, 100.0]]), T([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(w, T([[-1.0, 1.0, 0.0]]), atol=1e-4, rtol=0)
    assert expand_to_tokens(T([2.0]), T([[1.0, 0.0]])).tolist() == [[2.0, 0.0]]
    with pytest.raises(ValueError, match=r"seq_advantages has shape \[2\], expected \[1\]"):
        expand_to_tokens(T([1.0, 2.0]), T([[1.0]]))


def test_kto_and_fkto_by_hand():
    lp, ref = T([[0.5, 0.5, 1.0], [0.0, 0.0, 0.0]]), torch.zeros(2, 3)
    r = sequence_logratios(lp, ref, torch.ones(2, 3))
    assert r.tolist() == [2.0, 0.0]
    z0 = reference_point(T([-1.0, 0.4]))  # mean -0.3 -> clamped to 0
    assert z0.item() == 0.0 and not z0.requires_grad
    loss = kto_loss(r, T([True, False]), z0, beta=0.1, w_desirable=1.0, w_undesirable=2.0)
    # chosen: 1 - σ(0.2); rejected: 2 * (1 - σ(0)) = 1
    assert loss.item() == pytest.approx(((1 - 1 / (1 + math.exp(-0.2))) + 1.0) / 2)
    rs, owner = sentence_logratios(lp, ref, [[(0, 2), (2, 3)], []])
    assert rs.tolist() == [1.0, 1.0] and owner.tolist() == [0, 0]
    total, parts = factalign_loss(r, T([True, False]), T([0.4]), rs, T([True, False]), T([0.2]), beta=0.1, beta_f=0.5, lam=2.0)
    z0, z0f = 0.4, 0.2
    kto = ((1 - 1 / (1 + math.exp(-0.1 * (2 - z0)))) + (1 - 1 / (1 + math.exp(-0.1 * (z0 - 0))))) / 2
    fkto = ((1 - 1 / (1 + math.exp(-0.5 * (1 - z0f)))) + (1 - 1 / (1 + math.exp(-0.5 * (z0f - 1))))) / 2
    assert total.item() == pytest.approx(kto + 2.0 * fkto) and parts["z0_f"] == pytest.approx(0.2)
    # no labelled sentences (general data only): plain KTO
    total2, _ = factalign_loss(r, T([True, False]), T([0.4]), torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0))
    assert total2.item() == pytest.approx(kto)
    with pytest.raises(ValueError, match="outside"):
        sentence_logratios(lp, ref, [[(2, 9)], []])


def test_grpo_singletons_and_invalid_rows():
    r, g = T([2.0, 7.0, 1.0, 3.0]), T([0, 1, 2, 2])
    assert grpo_advantages(r, g).tolist()[:2] == [0.0, 0.0]
    # verl's convention (mean 0, std 1): the raw reward is the advantage
    assert grpo_advantages(r, g, singleton="raw").tolist()[:2] == [2.0, 7.0]
    # an invalid (abstained) row leaves its group's statistics and gets 0; here group 2 becomes a singleton
    adv = grpo_advantages(T([2.0, 7.0, 1.0, float("nan")]), g, valid=T([1, 1, 1, 0]))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    adv = grpo_advantages(T([1.0, 3.0, 5.0, float("nan")]), T([0, 0, 0, 0]), valid=T([1, 1, 1, 0]), eps=0.0)
    torch.testing.assert_close(adv, T([-1.0, 0.0, 1.0, 0.0]))  # mean 3, sample std 2: (±2)/2


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 ≈ 7.39 on a negative advantage: PPO's loss is -A·ρ = 7.39; dual clip caps it at -A·c = 3
    lp, old, mask = T([[2.0, 0.0]]), T([[0.0, 0.0]]), T([[1.0, 0.0]])
    loss, m = ppo_policy_loss(lp, old, T([[-1.0, 0.0]]), mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0) and m["dual_clipfrac"] == 1.0
    loss, _ = ppo_policy_loss(lp, old, T([[-1.0, 0.0]]), mask)
    assert loss.item() == pytest.approx(math.exp(2.0))
    # positive advantages are untouched by the dual clip: min(ρA, 1.2A) = 1.2 → loss -1.2
    loss, _ = ppo_policy_loss(lp, old, T([[1.0, 0.0]]), mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_policy_loss(lp, old, T([[1.0, 0.0]]), mask, clip_ratio_c=1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_global_normalisation_sums_micro_batches_to_the_full_batch(agg):
    torch.manual_seed(0)
    loss_mat = torch.randn(5, 7)
    mask = (torch.rand(5, 7) > 0.4).float()
    mask[0] = 0.0  # a row without tokens counts in no denominator
    full = aggregate(loss_mat, mask, agg)
    g_tokens, g_seqs = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    parts = [aggregate(loss_mat[s], mask[s], agg, global_tokens=g_tokens, global_seqs=g_seqs)
             for s in (slice(0, 2), slice(2, 3), slice(3, 5))]
    torch.testing.assert_close(sum(parts), full)
    # normalising each micro batch by its own counts (the old behaviour) drifts from the full batch
    local = sum(aggregate(loss_mat[s], mask[s], agg) for s in (slice(0, 2), slice(2, 3), slice(3, 5))) / 3
    assert not torch.allclose(local, full)


def test_whiten_unbiased_matches_sample_variance():
    x, m = T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, m, eps=0.0, unbiased=True)
    torch.testing.assert_close(w, T([[-1.0, 0.0, 1.0, 0.0]]))  # mean 2, sample var 1
    w = masked_whiten(x, m, eps=0.0)
    torch.testing.assert_close(w, T([[-1.0, 0.0, 1.0, 0.0]]) * math.sqrt(1.5))  # population var 2/3
