"""Every record of NeMo-Aligner 0.7.0's ppo_utils goldens (aligner_ppo_utils.json)."""

import torch

from nemo_factuality.algorithms import (
    gae,
    group_ids_from_prompts,
    kl_penalty,
    response_mask,
    rloo_baseline,
    scalar_rewards_with_kl,
)
from nemo_factuality.testing.paths import load_parity

GOLD = load_parity("aligner_ppo_utils.json")["records"]


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def test_create_mask():
    for rec in GOLD["create_mask"]:
        inp = rec["input"]
        got = response_mask(_t(inp["prompt_lengths"], torch.long), _t(inp["response_lengths"], torch.long), inp["shape"][1])
        assert got.tolist() == rec["expected"]


def test_gae_advantages_and_returns():
    for rec in GOLD["calculate_advantages_and_returns"]:
        inp, exp = rec["input"], rec["expected"]
        adv, ret = gae(_t(inp["rewards"]), _t(inp["values"]), _t(inp["mask"]), inp["discount_factor"], inp["gae_lambda"])
        torch.testing.assert_close(adv, _t(exp["advantages"]), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, _t(exp["returns"]), rtol=0, atol=1e-12)


def test_kl_penalty():
    for rec in GOLD["calculate_kl_penalty"]:
        inp = rec["input"]
        kind = "abs" if inp["use_absolute_kl"] else "k1"
        torch.testing.assert_close(kl_penalty(_t(inp["log_probs_a"]), _t(inp["log_probs_b"]), kind), _t(rec["expected"]),
                                   rtol=0, atol=1e-12)


def test_ppo_rewards_scalar_at_last_action():
    for rec in GOLD["calculate_ppo_rewards"]:
        inp = rec["input"]
        got = scalar_rewards_with_kl(_t(inp["rewards"]), _t(inp["response_lengths"], torch.long), _t(inp["init_policy_kl"]),
                                     inp["penalty_factor"])
        torch.testing.assert_close(got, _t(rec["expected"]), rtol=0, atol=1e-12)


def test_rloo_baseline_groups_by_identical_prompt():
    for rec in GOLD["calculate_rloo_baseline"]:
        inp = rec["input"]
        groups = group_ids_from_prompts(_t(inp["prompts"], torch.long))
        got = rloo_baseline(_t(inp["reward"], torch.float32), groups, _t(inp["mask"], torch.float32))
        torch.testing.assert_close(got, _t(rec["expected"], torch.float32), rtol=0, atol=1e-6)
