"""The lab's GRPO stage wiring: presets load and validate, and the calibration scope cannot learn facts."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_factuality.config import ConfigError
from nemo_factuality.lab import world as W
from nemo_factuality.lab.policy import PolicyConfig, build_policy, train_tokenizer
from nemo_factuality.lab.run import rl_prompt_pool
from nemo_factuality.lab.train import load_grpo_config, restrict_to_calibration


def test_presets_load_over_the_grpo_schema():
    spec = {"name": "lab_slots", "store_path": "kb.sqlite", "mode": "dual"}
    full = load_grpo_config("grpo", ["model.path=/m", "+reward=" + json.dumps(spec)])
    quick = load_grpo_config("grpo_quick", ["model.path=/m", "remote_rm.url=http://127.0.0.1:1"])
    assert full.reward == spec and full.trainer.early_stopping.monitor == "val/lab_reward"
    assert quick.trainer.max_steps < full.trainer.max_steps and quick.model.optim.lr == full.model.optim.lr
    assert full.model.global_batch_size == full.grpo.num_prompts_per_step * full.grpo.num_rollouts_per_prompt
    with pytest.raises(ConfigError, match="no reward"):
        load_grpo_config("grpo", ["model.path=/m"])


def test_calibration_scope_moves_only_the_norm_and_the_abstention_row():
    cfg = W.WorldConfig(n_people=(2, 2, 2), bios_per_person=(1, 1, 1))
    bios = W.make_bios(W.make_people(cfg), cfg)
    tok = train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios])
    model = build_policy(len(tok), PolicyConfig(hidden=32, layers=1, heads=2, intermediate=64), 0, tok)
    abstain = tok.convert_tokens_to_ids(W.ABSTAIN_VALUE)
    restrict_to_calibration(model, abstain)
    ids = tok([b["prompt"] + " " + b["response"] for b in bios[:2]], return_tensors="pt")["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"model.norm.weight", "lm_head.weight"}
    head_grad = model.get_output_embeddings().weight.grad
    assert head_grad[abstain].abs().sum() > 0
    others = torch.ones(head_grad.shape[0], dtype=torch.bool)
    others[abstain] = False
    assert head_grad[others].abs().sum() == 0  # no value token's logit row can move: no facts learnt
    assert model.get_decoder().norm.weight.grad.abs().sum() > 0


def test_balanced_prompt_pool_repeats_small_tiers():
    tiers = {"a": "popular", "b": "medium", "c": "medium", "d": "rare", "e": "rare", "f": "rare", "g": "rare"}
    pool = rl_prompt_pool(list(tiers), tiers, balanced=True)
    assert sorted(pool.count(x) for x in tiers) == [1, 1, 1, 1, 2, 2, 4]
    assert [tiers[x] for x in pool].count("popular") == 4 == [tiers[x] for x in pool].count("rare")
    assert rl_prompt_pool(list(tiers), tiers, balanced=False) == list(tiers)
