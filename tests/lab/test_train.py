"""The lab's training wiring: stage presets, equal sample budgets, trainable scopes, model selection, overrides."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_factuality.config import ConfigError
from nemo_factuality.lab import world as W
from nemo_factuality.lab.methods import (
    GROUPS,
    METHODS,
    check_overrides,
    load_stage_config,
    route_overrides,
    select_methods,
)
from nemo_factuality.lab.policy import PolicyConfig, build_policy, train_tokenizer
from nemo_factuality.lab.run import _budget_steps, _samples_per_step, rl_prompt_pool
from nemo_factuality.lab.train import Validator, restrict_trainable
from nemo_factuality.types import FactualityInputError

PRESETS = {"grpo": "grpo", "ppo": "ppo", "kto": "kto"}
QUICK = {"grpo": "grpo_quick", "ppo": "ppo_quick", "kto": "kto_quick"}
COUNTRIES = {stage: f"{stage}_countries" for stage in PRESETS}
COUNTRIES_QUICK = {stage: f"{stage}_countries_quick" for stage in PRESETS}


def test_presets_load_over_their_stage_schemas():
    spec = {"name": "lab_slots", "store_path": "kb.sqlite", "mode": "dual"}
    full = load_stage_config("grpo", "grpo", ["model.path=/m", "+reward=" + json.dumps(spec)])
    quick = load_stage_config("grpo", "grpo_quick", ["model.path=/m", "remote_rm.url=http://127.0.0.1:1"])
    assert full.reward == spec and full.trainer.early_stopping.monitor == "val/reward"
    assert quick.trainer.max_steps < full.trainer.max_steps and quick.model.optim.lr == full.model.optim.lr
    ppo = load_stage_config("ppo", "ppo", ["model.path=/m", "remote_rm.url=http://127.0.0.1:1"])
    assert ppo.critic.optim.lr == 1e-3 and ppo.trainer.early_stopping.monitor == "val/reward"
    with pytest.raises(ConfigError, match="no reward"):
        load_stage_config("grpo", "grpo", ["model.path=/m"])


@pytest.mark.parametrize("presets", [PRESETS, QUICK, COUNTRIES, COUNTRIES_QUICK])
def test_every_method_gets_the_same_policy_samples(presets):
    budgets = {}
    for name, m in METHODS.items():
        cfg = load_stage_config(m.stage, presets[m.stage], ["model.path=/m", "remote_rm.url=http://127.0.0.1:1"])
        budgets[name] = _samples_per_step(m.stage, cfg) * _budget_steps(m.stage, cfg)
        if m.stage == "kto":  # the optimiser-step cap fits all of the iterations' minibatches
            per_iteration = -(-cfg.kto.prompts_per_iteration * cfg.kto.samples_per_prompt // cfg.model.global_batch_size)
            assert cfg.trainer.max_steps >= cfg.kto.num_iterations * per_iteration
    assert len(set(budgets.values())) == 1, budgets


def _tiny_policy():
    cfg = W.WorldConfig(n_people=(2, 2, 2), bios_per_person=(1, 1, 1))
    bios = W.make_bios(W.make_people(cfg), cfg)
    tok = train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios])
    model = build_policy(len(tok), PolicyConfig(hidden=32, layers=1, heads=2, intermediate=64), 0, tok)
    return model, tok, bios


@pytest.mark.parametrize("scope, trainable", [("calibration", {"model.norm.weight", "lm_head.weight"}),
                                              ("abstention", {"lm_head.weight"})])
def test_narrow_scopes_move_only_the_norm_and_the_abstention_row(scope, trainable):
    model, tok, bios = _tiny_policy()
    abstain = tok.convert_tokens_to_ids(W.ABSTAIN_VALUE)
    restrict_trainable(model, scope, abstain)
    ids = tok([b["prompt"] + " " + b["response"] for b in bios[:2]], return_tensors="pt")["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    head_grad = model.get_output_embeddings().weight.grad
    assert head_grad[abstain].abs().sum() > 0
    others = torch.ones(head_grad.shape[0], dtype=torch.bool)
    others[abstain] = False
    assert head_grad[others].abs().sum() == 0  # no value token's logit row can move: no facts learnt
    with pytest.raises(FactualityInputError, match="trainable"):
        restrict_trainable(model, "head", abstain)


class _ScriptedReward:
    """Scores each validation call with the next value (a stand-in for a method reward's mean)."""

    def __init__(self, values):
        self.values = iter(values)

    def __call__(self, prompts, completions, **columns):
        from nemo_factuality.types import RewardBatch

        value = next(self.values)
        return RewardBatch([value] * len(completions))


def test_validator_keeps_the_best_weights_including_the_base():
    from nemo_factuality.lab.reward import LabSlotReward
    from nemo_factuality.trainers.data import PromptRecord

    model, tok, bios = _tiny_policy()
    slots = LabSlotReward(pipeline=_NoClaims())
    records = [PromptRecord(prompt=bios[0]["prompt"])]
    v = Validator(model, tok, _ScriptedReward([0.5, 0.7, 0.6, float("nan")]), records, 2, slots)
    weight = model.get_decoder().norm.weight
    for step in range(4):
        with torch.no_grad():
            weight.fill_(float(step + 1))
        v(step)
    assert v.best_step == 1 and [r["val/reward"] for r in v.log][:3] == [0.5, 0.7, 0.6]
    v.restore_best()
    assert torch.all(model.get_decoder().norm.weight == 2.0)
    base_wins = Validator(model, tok, _ScriptedReward([0.9, 0.1]), records, 1, slots)
    base_wins(0)
    base_wins(10)
    assert base_wins.best_step == 0


class _NoClaims:
    """A fact-check pipeline that finds no claims (the validator's precision/claims columns stay 0)."""

    def check(self, prompts, responses, **kw):
        from nemo_factuality.types import FactCheck

        return [FactCheck(response=r, sentences=[], claims=[], abstained=True) for r in responses]


def test_balanced_prompt_pool_repeats_small_tiers():
    tiers = {"a": "popular", "b": "medium", "c": "medium", "d": "rare", "e": "rare", "f": "rare", "g": "rare"}
    pool = rl_prompt_pool(list(tiers), tiers, balanced=True)
    assert sorted(pool.count(x) for x in tiers) == [1, 1, 1, 1, 2, 2, 4]
    assert [tiers[x] for x in pool].count("popular") == 4 == [tiers[x] for x in pool].count("rare")
    assert rl_prompt_pool(list(tiers), tiers, balanced=False) == list(tiers)


def test_methods_and_overrides_are_routed_and_checked():
    assert select_methods("all") == GROUPS["all"]
    assert select_methods("rlfh,fspo,rlfh") == ("fspo_code", "fspo_paper", "rlfh")
    with pytest.raises(FactualityInputError, match="unknown method 'klfc'"):
        select_methods("klfc")
    routed = route_overrides(["trainer.max_steps=3", "grpo.kl_estimator=k1", "rlfh:critic.optim.lr=3e-4",
                              "knowrl:reward.gamma=10", "reward.step_labels=three_way"], GROUPS["all"])
    assert routed["rlfh"] == (["trainer.max_steps=3", "critic.optim.lr=3e-4"], {})  # no grpo.* key in the PPO stage
    assert routed["factalign"] == (["trainer.max_steps=3"], {})
    assert routed["knowrl"] == (["trainer.max_steps=3", "grpo.kl_estimator=k1"], {"gamma": 10})
    assert routed["fspo_code"][1] == {"step_labels": "three_way"} and routed["klcf"][1] == {}
    some = ("klcf", "fspo_code", "rlfh", "factalign")
    for bad, error, methods in ((["trainer.max_stepz=3"], "max_stepz", some), (["ppo.num_epochs=2"], "ppo", ("klcf", "factalign")),
                                (["klcf:reward.gamma=3"], "gamma", some), (["rlfh:grpo.num_epochs=2"], "grpo", some),
                                (["reward.step_labels=four"], "step_labels", some),
                                (["factalign:trainer.max_steps=x"], "max_steps", some)):
        with pytest.raises((ConfigError, FactualityInputError), match=error):
            check_overrides(bad, methods, PRESETS)
    check_overrides(["ppo.num_epochs=2"], some, PRESETS)  # the PPO stage (rlfh) has the key: it goes there only
