"""Exact on-policy sampling on the hf backend: rollouts come from softmax(logits / T) with the stage's sampling params
only — not the checkpoint's generation_config.json — and the log-probs are of that same distribution."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from nemo_factuality.trainers.backends.hf import HFActor
from nemo_factuality.trainers.config import GRPOConfig
from nemo_factuality.trainers.interfaces import SamplingParams

N, T = 4000, 0.7  # samples of one next token; a sampling temperature other than 1


@pytest.fixture(scope="module")
def hostile_checkpoint(tmp_path_factory, tiny_policy):
    """The tiny policy with a peaked next-token distribution (lm_head × 6) and a generation_config.json that would
    change every sample if merged: an extreme repetition penalty, the three likeliest tokens suppressed, top_k 1,
    temperature 0.05, no repeated unigrams, a minimum length."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("hostile_policy")
    for f in tiny_policy.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy))
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(str(out))
    probs, prompt = _next_token_probs(out, T)
    top3 = torch.topk(probs, 3).indices.tolist()
    (out / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "repetition_penalty": 1.0e4, "suppress_tokens": top3, "top_k": 1, "top_p": 0.05,
        "temperature": 0.05, "no_repeat_ngram_size": 1, "min_new_tokens": 4, "bad_words_ids": [[top3[0]]],
        "eos_token_id": model.config.eos_token_id, "pad_token_id": model.config.pad_token_id}))
    return {"path": out, "probs": probs, "prompt": prompt, "top3": top3}


def _next_token_probs(path, temperature):
    """softmax(logits / T) of the next token after a fixed prompt, from a plain forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    prompt = tok("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.softmax(logits / temperature, -1), prompt


def _actor(path, **sampling) -> HFActor:
    cfg = GRPOConfig()
    cfg.model.path = str(path)
    for k, v in sampling.items():
        setattr(cfg.model.sampling_params, k, v)
    return HFActor(cfg.model, max_steps=1)


def test_rollouts_follow_the_stage_sampling_not_the_checkpoints_generation_config(hostile_checkpoint):
    probs, prompt, top3 = hostile_checkpoint["probs"], hostile_checkpoint["prompt"], hostile_checkpoint["top3"]
    assert probs[top3].sum() > 0.1  # the suppressed tokens carry real mass: a leak would be plain to see
    actor = _actor(hostile_checkpoint["path"], temperature=T)
    torch.manual_seed(0)
    rollout = actor.generate([prompt] * N, SamplingParams(max_new_tokens=1, temperature=T, top_k=0, top_p=1.0))
    first = rollout.tokens[:, len(prompt)]
    counts = torch.bincount(first, minlength=probs.numel()).double()

    def within(mask: torch.Tensor) -> None:  # an observed share against its probability, 4.5 binomial sigmas
        p = float(probs[mask].sum())
        assert abs(float(counts[mask].sum()) / N - p) < 4.5 * math.sqrt(p * (1 - p) / N) + 1e-9, (p, counts[mask].sum() / N)

    suppressed = torch.zeros_like(probs, dtype=torch.bool)
    suppressed[top3] = True
    within(suppressed)  # suppress_tokens / bad_words would make this 0
    in_prompt = torch.zeros_like(probs, dtype=torch.bool)
    in_prompt[prompt] = True
    within(in_prompt)  # the repetition penalty / no_repeat_ngram would push these down
    assert (counts > 0).sum() > 10  # top_k 1 / top_p 0.05 / temperature 0.05 would leave one or two tokens
    # chi-square over the 12 likeliest tokens + the rest, against softmax(logits / T): p > 1e-4 (df 12: < 36.5)
    order = torch.argsort(probs, descending=True)
    buckets = [order[i : i + 1] for i in range(12)] + [order[12:]]
    chi2 = sum(float((counts[b].sum() - N * probs[b].sum()) ** 2 / (N * probs[b].sum())) for b in buckets)
    assert chi2 < 36.5, chi2


def test_logprobs_are_of_the_distribution_sampled_from(hostile_checkpoint):
    probs, prompt = hostile_checkpoint["probs"], hostile_checkpoint["prompt"]
    actor = _actor(hostile_checkpoint["path"], temperature=T)
    torch.manual_seed(1)
    rollout = actor.generate([prompt] * 8, SamplingParams(max_new_tokens=3, temperature=T))
    lp = actor.logprobs(rollout)
    first = rollout.tokens[:, len(prompt)]
    # the first response token's log-prob is log softmax(logits / T) of the plain forward pass
    torch.testing.assert_close(lp[:, len(prompt) - 1], probs.log()[first], atol=1e-5, rtol=1e-5)
    # and differs from the T = 1 log-prob (the old behaviour) by far more than rounding
    at_one, _ = _next_token_probs(hostile_checkpoint["path"], 1.0)
    assert (lp[:, len(prompt) - 1] - at_one.log()[first]).abs().max() > 0.05
    torch.testing.assert_close(actor.reference_logprobs(rollout), lp)  # the reference is at T too
    with pytest.raises(ValueError, match="temperature"):
        actor.generate([prompt], SamplingParams(max_new_tokens=1, temperature=1.0))


def test_a_temperature_other_than_1_is_refused_on_the_aligner_backend():
    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.config import load_train_config

    base = ["trainer.backend=aligner", "model.restore_from_path=/x.nemo", "remote_rm.url=http://rm:5555"]
    with pytest.raises(ConfigError, match="model.sampling_params.temperature=0.7: NeMo-Aligner's log-probs"):
        load_train_config(GRPOConfig, None, [*base, "model.sampling_params.temperature=0.7"])
    load_train_config(GRPOConfig, None, [*base, "model.sampling_params.temperature=1.0"])
