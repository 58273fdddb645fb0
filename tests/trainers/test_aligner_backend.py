"""The aligner backend on NeMo-Aligner's real Megatron actor, on CPU/gloo, in the Aligner venv.

A tiny Qwen2 is converted with our converter, restored by Aligner, and driven through the
``PolicyActor`` calls (``aligner_driver.py``) at world 1, TP=2, PP=2 and DP=2 (torchrun, 2 processes):
rollouts and log-probs agree with Hugging Face on the same weights, training moves the policy in the
direction of the advantages while the reference (``cpu_weight_swap``) stays put, TP=2, PP=2 and DP=2 give
what world 1 gives, and save → load → step equals the uninterrupted step. Skips with the reason when
the venv is absent (``tools/setup_stack_env.sh aligner`` builds it; ``.ci/run`` does).

Every driver run of the module is one program of a single batch (``runs``): NeMo is imported once for all eleven,
each program still runs in new processes at its own world size, and each test reads its own programs' outcome.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_factuality.testing.aligner_env import run_batch_in_aligner_venv
from nemo_factuality.testing.servers import convert_checkpoint
from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

DRIVER = "tests/trainers/aligner_driver.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(HF dir, extracted .nemo written by our converter)."""
    root = tmp_path_factory.mktemp("aligner_policy")
    hf = root / "hf"
    build_tiny_causal_lm("qwen2", vocab_size=400, out_dir=hf)
    build_tiny_tokenizer(hf)
    convert_checkpoint("hf-to-nemo", "--hf", str(hf), "--out", str(root / "policy"), "--extracted")
    return hf, root / "policy"


#: The module's driver runs: name → (ranks, policy ("policy" or "stage_policy"), the driver's flags)
PROGRAMS: dict[str, tuple[int, str, dict]] = {
    "world1": (1, "policy", {}),
    "tp2": (2, "policy", {"tp": 2}),
    "pp2": (2, "policy", {"pp": 2}),
    "dp2": (2, "policy", {}),
    "resume": (1, "policy", {"scenario": "resume", "momentum": 0.9}),
    "stage": (1, "policy", {"scenario": "stage"}),
    "learn": (1, "stage_policy", {"scenario": "learn", "optim": "adamw", "lr": 3e-3}),
    "adamw": (1, "policy", {"scenario": "resume", "optim": "adamw", "lr": 1e-3}),
    "stage_dp": (2, "policy", {"scenario": "stage_dp"}),
    "kto_dp2": (2, "policy", {"scenario": "kto_dp"}),
    "kto_world1": (1, "policy", {"scenario": "kto_dp"}),
}


@pytest.fixture(scope="module")
def runs(venv, policy, stage_policy, tmp_path_factory) -> dict[str, tuple[Path, int, object]]:
    """Every program of ``PROGRAMS`` in one launch: name → (its output folder, its ranks, its ``ProgramRun``)."""
    root = tmp_path_factory.mktemp("aligner_runs")
    nemo = {"policy": policy[1], "stage_policy": stage_policy}
    programs, outs = {}, {}
    for name, (nproc, which, args) in PROGRAMS.items():
        outs[name] = root / name
        outs[name].mkdir()
        flags = [f"--{k}={v}" for k, v in args.items()]
        programs[name] = (nproc, [DRIVER, f"--nemo={nemo[which]}", f"--out={outs[name]}", *flags])
    results = run_batch_in_aligner_venv(venv, programs, logs=root / "logs", timeout=2400)
    return {name: (outs[name], PROGRAMS[name][0], results[name]) for name in PROGRAMS}


def ranks_of(runs: dict, name: str) -> list[dict]:
    """Program ``name``'s JSON per rank, ordered by rank; fails with its output when it did not exit 0."""
    out, nproc, result = runs[name]
    result.check(name)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def action_values(result: dict, key: str) -> list[list[float]]:
    """Per row, ``result[key]`` at the response's action positions ``[prompt_len-1, response_len-1)``."""
    return [row[p - 1 : r - 1] for row, p, r in zip(result[key], result["prompt_lengths"], result["response_lengths"], strict=True)]


def assert_close(a: list[list[float]], b: list[list[float]], atol: float) -> None:
    assert [len(x) for x in a] == [len(y) for y in b]
    worst = max(max(abs(x - y) for x, y in zip(ra, rb, strict=True)) for ra, rb in zip(a, b, strict=True))
    assert worst <= atol, f"max |Δ| {worst:.3g} > {atol}"


@pytest.fixture(scope="module")
def world1(runs):
    return ranks_of(runs, "world1")[0]


def _hf_logprobs(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_rollouts_and_logprobs_agree_with_hugging_face(world1, policy):
    from transformers import AutoModelForCausalLM

    hf = policy[0]
    tokens = torch.tensor(world1["tokens"])
    for i, prompt in enumerate(world1["prompts"]):
        p, r = world1["prompt_lengths"][i], world1["response_lengths"][i]
        assert p == len(prompt) and world1["tokens"][i][:p] == prompt and p < r
        assert all(t == world1["pad_id"] for t in world1["tokens"][i][r:])
    model = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    for i, prompt in enumerate(world1["prompts"]):  # greedy: HF continues the prompt with the same tokens
        r = world1["response_lengths"][i]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=r - len(prompt), do_sample=False,
                                 eos_token_id=world1["eos_id"], pad_token_id=world1["pad_id"])[0].tolist()
        assert world1["tokens"][i][:r] == ref[:r]
    ours = action_values(world1, "lp0")
    theirs = action_values({**world1, "hf": _hf_logprobs(hf, tokens).tolist()}, "hf")
    assert_close(ours, theirs, atol=2e-5)
    assert_close(action_values(world1, "ref0"), ours, atol=0.0)  # before training the reference is the policy


def test_training_follows_the_advantages_and_the_reference_stays(world1):
    before, after = action_values(world1, "lp0"), action_values(world1, "lp1")
    advantages = [1.0, -1.0, 0.5, -0.5]
    # the surrogate objective Σ_i A_i Σ_t Δlog π rises, and the second step starts from a lower loss
    gain = sum(adv * (sum(a) - sum(b)) for adv, a, b in zip(advantages, after, before, strict=True))
    assert gain > 0.1, gain
    first, second = world1["metrics"]
    assert second["loss"] < first["loss"] and first["approx_kl"] == 0.0 < second["approx_kl"]
    assert_close(action_values(world1, "ref1"), before, atol=1e-6)  # cpu_weight_swap restores the initial weights
    assert_close(action_values(world1, "ref2"), after, atol=1e-6)  # reset_reference adopts the current weights
    entropy = world1["entropy_step"]  # need_entropy: a loss on the entropy trains like any other
    assert entropy["loss"] < 0 and entropy["grad_norm"] > 0
    for m in world1["metrics"]:
        assert m["grad_norm"] > 0 and m["lr"] == pytest.approx(0.05) and {"clipfrac", "approx_kl"} <= set(m)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_tensor_or_pipeline_parallel_2_equals_world_1(runs, world1, layout):
    ranks = ranks_of(runs, "tp2" if "tp" in layout else "pp2")
    for result in ranks:  # every rank holds the broadcast rollouts, log-probs and metrics
        assert result["dp_size"] == 1 and result["tokens"] == world1["tokens"]
        for key in ("lp0", "lp1", "ref1"):
            assert_close(action_values(result, key), action_values(world1, key), atol=2e-5)
        # entropies from TP-sharded logits (gathered) equal world 1's; summed over micro batches and ranks
        assert result["entropy_step"]["loss"] == pytest.approx(world1["entropy_step"]["loss"], abs=1e-5)


def test_data_parallel_2_equals_world_1(runs, world1):
    ranks = ranks_of(runs, "dp2")
    assert sorted(r["dp_rank"] for r in ranks) == [0, 1] and all(r["dp_size"] == 2 for r in ranks)
    for result in ranks:
        rows = slice(result["start"], result["start"] + len(result["prompts"]))
        sliced = {k: world1[k][rows] for k in ("lp0", "lp1", "prompt_lengths", "response_lengths")}
        for key in ("lp0", "lp1"):  # one optimiser step over both ranks' halves = the step over the whole batch
            assert_close(action_values(result, key), action_values(sliced, key), atol=2e-5)


def test_save_load_resumes_exactly_and_the_trained_policy_converts_back_to_hugging_face(runs, policy, tmp_path):
    """SGD with momentum (optimiser state to restore): step, save, step → A; load, step → B == A (AdamW: the
    test below). Then HF → .nemo → train →
    .nemo (``export``) → HF (``convert nemo-to-hf``): HF's log-probs equal the trained actor's."""
    result = ranks_of(runs, "resume")[0]
    assert result["metrics_a"] == result["metrics_b"]
    assert_close(action_values(result, "lp_b"), action_values(result, "lp_a"), atol=0.0)
    back = tmp_path / "hf_back"
    convert_checkpoint("nemo-to-hf", "--nemo", str(runs["resume"][0] / "trained.nemo"), "--out", str(back))
    hf = _hf_logprobs(back, torch.tensor(result["tokens"])).tolist()
    assert_close(action_values({**result, "hf": hf}, "hf"), action_values(result, "lp_a"), atol=2e-5)
    before = _hf_logprobs(policy[0], torch.tensor(result["tokens"])).tolist()
    assert action_values({**result, "hf": before}, "hf") != action_values(result, "lp_a")  # it did train
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(back)).encode("Paris") == AutoTokenizer.from_pretrained(str(policy[0])).encode("Paris")


def test_the_grpo_stage_runs_on_the_aligner_actor_checkpoints_and_resumes(runs):
    """``GRPOTrainer`` (the stage itself, toy reward) for 2 steps, then a rerun to 3 resumes from step 2's
    NeMo checkpoint and equals 3 uninterrupted steps from the same weights and seed; the run ends with an
    exported ``.nemo``."""
    import tarfile

    result = ranks_of(runs, "stage")[0]
    assert result["first_run_steps"] == 2 and [m["step"] for m in result["metrics"]] == [1, 2, 3]
    assert {"step_000002", "step_000003", "latest"} <= set(result["checkpoints"])
    for m in result["metrics"]:
        assert m["grad_norm"] > 0 and m["optimizer_steps"] >= 1 and 0.0 <= m["reward/score"] <= 1.0
    assert result["metrics"][1]["kl"] > 0  # the policy moved away from the reference after step 1
    # resumed = uninterrupted: the same samples, rewards, losses and gradients at every step
    keys = ("reward/score", "loss/policy", "kl", "grad_norm", "response_length/mean")
    assert [{k: m[k] for k in keys} for m in result["metrics"]] == [{k: m[k] for k in keys} for m in result["uninterrupted"]]
    names = tarfile.open(runs["stage"][0] / "run" / "final").getnames()
    assert "./model_config.yaml" in names and "./tokenizer/tokenizer_config.json" in names


def test_grpo_on_the_aligner_actor_raises_a_known_reward_well_outside_noise(runs):
    """The hf backend's learning check (tests/trainers/test_grpo.py) on this backend: same policy, reward,
    batch shapes, optimiser (AdamW, lr 3e-3) and criterion; the stage checkpoints at the end."""
    import math

    import numpy as np

    history = ranks_of(runs, "learn")[0]["metrics"]
    rewards = [h["reward/score"] for h in history]
    start, end = np.mean(rewards[:3]), np.mean(rewards[-3:])
    noise = np.std(rewards[:3]) + 1e-3
    assert len(rewards) == 20 and end - start > 0.25 and end - start > 5 * noise, rewards
    assert all(math.isfinite(h["loss/policy"]) and math.isfinite(h["loss/kl"]) for h in history)


def test_adamw_state_goes_into_nemos_sharded_checkpoint_and_resumes_exactly(runs):
    """torch AdamW (the stages' default optimiser): its per-parameter 0-dim ``step`` is kept in the parameter
    group for NeMo's sharded checkpoint; step, save, step → A equals load, step → B, moments and step included."""
    result = ranks_of(runs, "adamw")[0]
    assert result["metrics_a"] == result["metrics_b"] and result["metrics_a"]["grad_norm"] > 0
    assert_close(action_values(result, "lp_b"), action_values(result, "lp_a"), atol=0.0)


def test_the_grpo_stage_shards_prompts_over_data_parallel_ranks_and_rank_0_writes(runs):
    """``GRPOTrainer`` at DP=2 (torchrun, TP=1): 4 prompts per step, 2 per rank; 2 steps, then a rerun to 3
    resumes from step 2's checkpoint. Each rank trains on its contiguous half of the step's global draw,
    both ranks return the same (all-reduced) metrics and ``metrics.jsonl`` holds them once, the checkpoints
    are complete (every rank's files, no leftovers) and the two replicas end with identical weights."""
    from nemo_factuality.trainers.data import PromptSampler

    ranks = ranks_of(runs, "stage_dp")
    r0, r1 = sorted(ranks, key=lambda r: r["dp_rank"])
    assert (r0["dp_size"], r1["dp_size"]) == (2, 2)
    sampler = PromptSampler(8, r0["seed"])
    for step, (mine0, mine1) in enumerate(zip(r0["shards"], r1["shards"], strict=True)):
        drawn = sampler.take(4)  # the step's global draw, the same on every rank
        assert (mine0, mine1) == (drawn[:2], drawn[2:]), step
    assert len(r0["shards"]) == 3  # steps 1, 2 and (after the resume) 3
    lines = r0["metrics"]
    assert r0["first_run_lines"] == 2 and [m["step"] for m in lines] == [1, 2, 3]  # written once, not per rank
    assert r0["history"] == r1["history"] == lines
    for m in lines:
        assert m["grad_norm"] > 0 and m["optimizer_steps"] == 1 and 0.0 <= m["reward/score"] <= 1.0
        # the loss terms are the global step's (summed over micro batches and ranks), as the backend's total
        assert m["loss"] == pytest.approx(m["loss/policy"] + 0.001 * m["loss/kl"], rel=1e-4, abs=1e-6)
    assert not [n for n in r0["checkpoints"] if n.startswith(".")] and {"step_000003", "latest"} <= set(r0["checkpoints"])
    # the GRPO reference is the initial .nemo: recorded (reference.json), not copied by every rank
    assert {"trainer_state.json", "rng.pt", "rng.rank1.pt", "reference.json", "state"} <= set(r0["step3_files"])
    assert not [f for f in r0["step3_files"] if f.startswith("reference.rank")]
    assert r0["weight_sum"] == r1["weight_sum"]
    assert r0["fixed_logprobs"] == r1["fixed_logprobs"]
    assert (runs["stage_dp"][0] / "run" / "final").is_file()
    # validation: 5 prompts split 2 + 3 over the ranks, each scored once; the gathered metrics are the whole set's
    v0, v1 = r0["validation"], r1["validation"]
    assert v0["scored_here"] == ["question 0", "question 1"] and v1["scored_here"] == [f"question {i}" for i in (2, 3, 4)]
    assert v0["split"] == v1["split"] and v0["split"]["val/reward"] == pytest.approx(v0["whole"]["reward/score"], abs=1e-12)
    assert v0["whole"] == v1["whole"]


def test_the_kto_stage_labels_per_data_parallel_rank_and_trains_on_the_gathered_examples(runs):
    """``KTOTrainer`` at DP=2: each rank samples and labels its half of the iteration's prompts (one sample
    left unlabelled: 4 + 3 examples), every rank then holds the same 7 gathered examples, 2 optimiser steps
    (minibatches of 4 and 3, the second padded for the split) with the same reduced metrics on both ranks,
    logged once, and identical weights on both replicas. Sampling is greedy, so world 1 collects the same
    7 examples: its trained policy, losses and z0 must equal DP=2's."""
    from nemo_factuality.trainers.data import PromptSampler

    r0, r1 = sorted(ranks_of(runs, "kto_dp2"), key=lambda r: r["dp_rank"])
    drawn = [f"question {i}" for i in PromptSampler(4, r0["seed"]).take(4)]
    assert sorted(set(r0["labelled"])) == sorted(drawn[:2]) and sorted(set(r1["labelled"])) == sorted(drawn[2:])
    assert r0["data_tokens"] == r1["data_tokens"] and len(r0["data_tokens"]) == 7
    assert r0["logged"] == r1["logged"] == r0["metrics"] and [m["step"] for m in r0["metrics"]] == [1, 2]
    first = r0["metrics"][0]
    assert first["kto/labelled"] == 7 and first["kto/dropped_unlabelled"] == 1
    for m in r0["metrics"]:
        assert m["grad_norm"] > 0 and m["loss/kto"] is not None and m["kto/z0"] is not None
    assert r0["weight_sum"] == r1["weight_sum"] and r0["lp"] == r1["lp"]
    # the reference log-probs once per iteration, split over the ranks: 7 examples + the z0 pairs of the minibatches
    # of 4 and 3 = 14 sequences, 7 per rank in one forward each (was: every rank 7, then its pairs at every step)
    assert r0["reference_rows"] == r1["reference_rows"] == [7]
    world1 = ranks_of(runs, "kto_world1")[0]
    assert world1["data_tokens"] == r0["data_tokens"] and world1["reference_rows"] == [14]
    for ours, theirs in zip(r0["metrics"], world1["metrics"], strict=True):
        for key in ("loss/kto", "loss/fkto", "kto/z0", "kto/z0_f", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert_close(action_values(r0, "lp"), action_values(world1, "lp"), atol=2e-5)
    # the old path (the pairs' reference at every optimiser step) at world 1 gives the same steps
    assert world1["old_reference_rows"] == [7, 4, 3]
    for new, old in zip(world1["metrics"], world1["old_metrics"], strict=True):
        for key in ("loss/kto", "loss/fkto", "kto/z0", "kto/z0_f", "grad_norm"):
            assert new[key] == pytest.approx(old[key], rel=1e-5, abs=1e-7), key
