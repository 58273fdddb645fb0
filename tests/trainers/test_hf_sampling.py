"""Exact on-policy sampling on the hf backend: rollouts come from softmax(logits / T) with the stage's sampling params
only — not the checkpoint's generation_config.json — and the log-probs are of that same distribution."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from nemo_factuality.trainers.backends.hf.actor import HFActor
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


# ---- top-k / top-p: the log-probs are of the truncated distribution generate samples from ----
PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])  # softmax of LOGITS at T = 1
LOGITS = PROBS.log()


def _dist(**kw):
    from nemo_factuality.trainers.backends.hf.actor import SampledDistribution

    return SampledDistribution(**kw)


@pytest.mark.parametrize("kw, kept, expected", [
    # top-k 3 keeps 0.5, 0.2, 0.15 (mass 0.85)
    ({"top_k": 3}, [0, 1, 2], [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85]),
    # top-p 0.6: the smallest set with mass >= 0.6 is {0.5, 0.2} (0.7)
    ({"top_p": 0.6}, [0, 1], [0.5 / 0.7, 0.2 / 0.7]),
    # top-k 3 then top-p 0.6 of the renormalised three (0.588, 0.235, 0.176): again {0.5, 0.2}
    ({"top_k": 3, "top_p": 0.6}, [0, 1], [0.5 / 0.7, 0.2 / 0.7]),
    # T = 2 first (p ∝ sqrt(p)), then top-k 2
    ({"temperature": 2.0, "top_k": 2}, [0, 1], [0.5 ** 0.5 / (0.5 ** 0.5 + 0.2 ** 0.5), 0.2 ** 0.5 / (0.5 ** 0.5 + 0.2 ** 0.5)]),
])
def test_truncated_logprobs_hand_computed(kw, kept, expected):
    dist = _dist(**kw)
    logp = dist.log_softmax(LOGITS.unsqueeze(0))[0]
    torch.testing.assert_close(logp[kept], torch.tensor(expected).log(), atol=1e-6, rtol=1e-6)
    # a cut token keeps its log-prob under the temperature-scaled distribution: finite, never -inf
    scaled = torch.log_softmax(LOGITS / kw.get("temperature", 1.0), -1)
    cut = [i for i in range(5) if i not in kept]
    torch.testing.assert_close(logp[cut], scaled[cut], atol=1e-6, rtol=1e-6)
    # the entropy is of the truncated distribution (cut tokens have probability 0)
    p = torch.tensor(expected)
    torch.testing.assert_close(dist.entropy(LOGITS.unsqueeze(0))[0], -(p * p.log()).sum(), atol=1e-6, rtol=1e-6)


def test_token_logprobs_gather_the_truncated_distribution_at_every_position():
    from nemo_factuality.trainers.backends.hf.actor import token_logprobs

    logits = LOGITS.repeat(1, 3, 1)  # [1, 3, 5]: the same next-token distribution at each position
    tokens = torch.tensor([[4, 0, 3]])  # next tokens 0 (kept) and 3 (cut by top-k 3)
    got = token_logprobs(logits, tokens, _dist(top_k=3))
    torch.testing.assert_close(got, torch.tensor([[math.log(0.5 / 0.85), math.log(0.1)]]), atol=1e-6, rtol=1e-6)
    untruncated = token_logprobs(logits, tokens)  # the default: the full distribution, as before
    torch.testing.assert_close(untruncated, torch.tensor([[math.log(0.5), math.log(0.1)]]), atol=1e-6, rtol=1e-6)


def test_generate_and_the_logprobs_use_the_same_processors(hostile_checkpoint, monkeypatch):
    """generate gets exactly the distribution's warpers (its config sets its own to no-ops, so none is doubled);
    N samples of the first token fall in the top 3 only, with the truncated frequencies; their log-probs are
    log(p / mass of the top 3) from a plain forward pass; a generate asking for other truncation is refused."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    probs, prompt = hostile_checkpoint["probs"], hostile_checkpoint["prompt"]
    actor = _actor(hostile_checkpoint["path"], temperature=T, top_k=3, top_p=0.99)
    seen = {}
    generate = actor.model.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(actor.model, "generate", spy)
    torch.manual_seed(2)
    sampling = SamplingParams(max_new_tokens=1, temperature=T, top_k=3, top_p=0.99)
    rollout = actor.generate([prompt] * N, sampling)
    procs = seen["logits_processor"]
    assert [type(p) for p in procs] == [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    assert (procs[0].temperature, procs[1].top_k, procs[2].top_p) == (T, 3, 0.99)
    config = seen["generation_config"]
    assert (config.temperature, config.top_k, config.top_p) == (1.0, 0, 1.0)
    top3 = torch.topk(probs, 3).indices
    assert probs[top3].sum() < 0.99  # top-p 0.99 cuts nothing more: the top 3 carry less
    truncated = torch.zeros_like(probs)
    truncated[top3] = probs[top3] / probs[top3].sum()
    first = rollout.tokens[:, len(prompt)]
    assert set(first.tolist()) <= set(top3.tolist())  # nothing outside the top 3 is ever sampled
    counts = torch.bincount(first, minlength=probs.numel()).double()
    chi2 = sum(float((counts[i] - N * truncated[i]) ** 2 / (N * truncated[i])) for i in top3)
    assert chi2 < 18.4, chi2  # df 2: p > 1e-4
    lp = actor.logprobs(rollout)
    torch.testing.assert_close(lp[:, len(prompt) - 1], truncated.log()[first], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lp).all()  # prompt positions (cut tokens) too: no 0 · -inf in a masked sum
    with pytest.raises(ValueError, match="top_k"):
        actor.generate([prompt], SamplingParams(max_new_tokens=1, temperature=T, top_k=5, top_p=0.99))
    # a training step through the truncated log-probs (and entropy) has finite gradients: the cut tokens' -inf
    # scores never reach a sum or a backward pass
    batch = {"tokens": rollout.tokens[:4], "response_lengths": rollout.response_lengths[:4]}

    def loss_fn(out, mb):
        return -(out["logprobs"].sum() + out["entropy"].sum()), {}

    metrics = actor.train_step(batch, loss_fn, micro_batch_size=2, need_entropy=True)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
