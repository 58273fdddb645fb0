"""PPO (RLFH, with the backend's critic) and iterated KTO (FactAlign) on ``trainer.backend=megatron``, each check a
program in the megatron venv under torchrun on gloo:

* the critic (``megatron_critic_driver.py``), against the hf backend's ``HFCritic`` on the same tiny HF checkpoint at
  TP=1, TP=2, PP=2 (a tied-embedding copy of the checkpoint: the head must not be the embedding) and DP=2: values, then
  two SGD steps of the stage's value loss — loss, gradient norm and values after each. The first step moves only the
  zero head; the second the backbone too. Tolerances: values 1e-5 on the response tokens (observed ≤ 2.1e-7), loss
  and gradient norm 1e-6 relative (observed ≤ 8e-8), while the steps move the values by 0.38 and 0.22: a doubled
  gradient (values off by 0.38, norm ×2), a head summed over the TP ranks (the same) or counted on each TP rank in the
  norm (1.43 → 2.02) each fail (run by hand with the driver's ``--bug``). The head is the same on both TP ranks. An
  AdamW critic: save → load → step exact; TP=2's checkpoint resumes at PP=2 with the values it had and the step TP=2
  took next.
* the stages (``megatron_stages_driver.py``) at TP=2 and at DP=2: PPO 3 steps and KTO 2 iterations (4 steps), a
  checkpoint every step; a run interrupted after step 2 (KTO: and again after step 3) and rerun ends bit-identical to
  the straight run (policy, critic, every logged metric but the timings); ``final/`` reloads in transformers with the
  trained logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nemo_factuality.testing.megatron_env import run_batch_in_megatron_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3300)]
CRITIC = "tests/trainers/megatron_critic_driver.py"
STAGES = "tests/trainers/megatron_stages_driver.py"
VALUE_TOLERANCE = 1e-5  # fp32 on CPU: observed ≤ 2.1e-7 at every layout; the steps move the values by 0.38 and 0.22
# an AdamW step after a resume at another layout: Adam's first update lr·g/(|g|+ε) turns the ~1e-7 rounding differences
# of near-zero gradient entries into ~1e-4 of the lr (megatron_driver's actor, the same optimiser); the gradient norm
# (rel 1e-5) is what a scale error cannot slip through
STEP_TOLERANCE = 5e-4


# tag: (processes, driver arguments); pp2_tied_from_tp2 resumes tp2's AdamW checkpoint
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp=2"]),
           "pp2_tied_from_tp2": (2, ["--pp=2", "--hf={root}/hf_tied", "--resume={root}/tp2_ckpt"]),
           "dp2_distopt": (2, ["--distributed-optimizer"]),
           # the head's input is split along the sequence: gathered, and its gradient kept per rank, not summed over TP
           "tp2_sp": (2, ["--tp=2", "--sequence-parallel"])}


STAGE_LAYOUTS = {"tp2": ["--tp=2"], "dp2": []}


@pytest.fixture(scope="module")
def runs(megatron_venv, tmp_path_factory) -> tuple[Path, dict]:
    """The tiny models, every critic layout (in order: the PP=2 run reads TP=2's checkpoint) and both stage layouts,
    in one launch (Megatron imported once for all of them): (the run folder, program name → ``ProgramRun``)."""
    root = tmp_path_factory.mktemp("megatron_ppo_kto")
    programs = {"make-models": (1, [CRITIC, "make-models", f"--out={root}"])}
    for tag, (nproc, args) in LAYOUTS.items():
        args = [a.format(root=root) for a in args]
        hf = [] if any(a.startswith("--hf=") for a in args) else [f"--hf={root / 'hf'}"]
        programs[f"critic_{tag}"] = (nproc, [CRITIC, "parity", *hf, f"--out={root}", f"--tag={tag}", *args])
    for name, args in STAGE_LAYOUTS.items():
        (root / f"stages_{name}").mkdir()
        programs[f"stages_{name}"] = (2, [STAGES, f"--hf={root / 'hf'}", f"--out={root / f'stages_{name}'}", *args])
    results = run_batch_in_megatron_venv(megatron_venv, programs, logs=root / "logs", timeout=3000)
    results["make-models"].check("make-models")
    return root, results


@pytest.fixture(scope="module")
def critics(runs) -> dict[str, list[dict]]:
    root, results = runs
    out = {}
    for tag, (nproc, _) in LAYOUTS.items():
        results[f"critic_{tag}"].check(f"critic_{tag}")
        out[tag] = [json.loads((root / f"{tag}.rank{r}.json").read_text()) for r in range(nproc)]
    return out


def _response_mask() -> torch.Tensor:
    """``[8, 10]``: the response tokens of ``megatron_driver.fixed_batch`` (prompt 3, its lengths)."""
    lengths = torch.tensor([6, 11, 9, 7, 11, 10, 6, 8])
    pos = torch.arange(10).unsqueeze(0)
    return (pos >= 2) & (pos < lengths.unsqueeze(1) - 1)


def _diff(a: list, b: list) -> float:
    return float((torch.tensor(a) - torch.tensor(b))[_response_mask()].abs().max())


@pytest.mark.parametrize("tag", list(LAYOUTS))
def test_values_and_the_first_updates_equal_the_hf_critics(critics, tag):
    for rank in critics[tag]:
        hf = rank["hf"]
        assert _diff(rank["values0"], hf["values0"]) == 0.0  # both heads start at zero
        for step in (1, 2):
            ours, theirs = rank[f"metrics{step}"], hf[f"metrics{step}"]
            assert set(ours) == {"loss/value", "grad_norm"}  # HFCritic's keys: the actor's loss and lr stay the actor's
            assert ours["loss/value"] == pytest.approx(theirs["loss/value"], rel=1e-6)
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)
            assert _diff(rank[f"values{step}"], hf[f"values{step}"]) <= VALUE_TOLERANCE
        # each step moved the values by far more than the tolerance: a wrong gradient scale shows
        assert _diff(rank["values1"], rank["values0"]) > 0.1 and _diff(rank["values2"], rank["values1"]) > 0.1
        assert not rank["embedding_is_the_head"]


@pytest.mark.parametrize("tag", ["tp2", "tp2_sp"])
def test_the_head_is_the_same_on_every_tensor_parallel_rank(critics, tag):
    heads = [r["head"] for r in critics[tag]]
    assert heads[0] is not None and heads[0] == heads[1]
    assert any(abs(w) > 1e-3 for w in heads[0][0])  # trained away from its zero start


@pytest.mark.parametrize("tag", list(LAYOUTS))
def test_an_adamw_critic_saves_loads_and_steps_exactly(critics, tag):
    for rank in critics[tag]:
        assert rank["adam_loaded_values1"] == rank["adam_values1"]
        assert rank["adam_metrics2_after_load"] == rank["adam_metrics2"]
        assert rank["adam_values2_after_load"] == rank["adam_values2"]
    assert "critic" in critics[tag][0]["adam_files"]


def test_the_critic_resumes_at_another_layout(critics):
    """TP=2 saved after its first AdamW step; PP=2 (a tied checkpoint's build: every weight then comes from the
    saved critic) loads it with the values TP=2 had, and its next step is the step TP=2 took next."""
    saved, resumed = critics["tp2"][0], critics["pp2_tied_from_tp2"][0]
    assert _diff(resumed["resumed_values"], saved["adam_values1"]) <= VALUE_TOLERANCE
    assert _diff(resumed["adam_values1"], saved["adam_values2"]) <= STEP_TOLERANCE
    assert _diff(saved["adam_values2"], saved["adam_values1"]) > 10 * STEP_TOLERANCE
    assert resumed["adam_metrics1"]["grad_norm"] == pytest.approx(saved["adam_metrics2"]["grad_norm"], rel=1e-5)


@pytest.fixture(scope="module", params=list(STAGE_LAYOUTS))
def stages(request, runs) -> list[dict]:
    root, results = runs
    results[f"stages_{request.param}"].check(f"stages_{request.param}")
    return [json.loads((root / f"stages_{request.param}" / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_layout(stages, request):
    tp2 = "tp2" in request.node.callspec.id
    runs = [r["ppo"]["straight"] for r in stages]
    assert [r["dp"] for r in runs] == ([1, 1] if tp2 else [2, 2])
    assert sorted(r["dp_rank"] for r in runs) == ([0, 0] if tp2 else [0, 1])


def test_ppo_trains_three_steps_with_the_critic_in_each_checkpoint(stages):
    for r in stages:
        run = r["ppo"]["straight"]
        assert run["exit"] == 0 and run["checkpoints"][-1] == "step_000003"
        assert {"megatron", "critic", "reference.json", "trainer_state.json"} <= set(run["latest_files"])
        assert [m["step"] for m in run["metrics"]] == [1, 2, 3]
        assert run["metrics"][0]["values/mean"] == 0.0  # the zero head
        for m in run["metrics"]:
            assert math.isfinite(m["reward/score"]) and math.isfinite(m["loss/value"])
            assert m["grad_norm"] > 0 and m["critic/grad_norm"] > 0 and m["actor_trained"] == 1.0
        assert any(m["values/mean"] != 0.0 for m in run["metrics"][1:])  # the critic learnt


def test_kto_trains_two_iterations_each_from_its_own_reference(stages):
    for r in stages:
        run = r["kto"]["straight"]
        assert run["exit"] == 0 and run["checkpoints"][-1] == "step_000004"
        assert {"megatron", "reference", "reference.json"} <= set(run["latest_files"])  # the reset reference, stored
        assert [(m["step"], m["iteration"]) for m in run["metrics"]] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]
        for m in (run["metrics"][0], run["metrics"][2]):  # each iteration: 4 prompts × 2 samples, one unlabelled
            assert m["kto/labelled"] == 7 and m["kto/dropped_unlabelled"] == 1
            assert m["loss/kto"] == pytest.approx(0.5)  # the policy is the iteration's reference: log-ratios 0
        for m in run["metrics"]:
            assert math.isfinite(m["loss/fkto"]) and m["grad_norm"] > 0


@pytest.mark.parametrize("stage", ["ppo", "kto"])
def test_the_rerun_of_an_interrupted_run_ends_where_the_straight_run_ends(stages, stage):
    untimed = lambda run: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in run["metrics"]]  # noqa: E731
    for r in stages:
        straight, rerun = r[stage]["straight"], r[stage]["interrupted"]
        assert rerun["exit"] == 0 and rerun["checkpoints"] == straight["checkpoints"]
        assert rerun["logprobs"] == straight["logprobs"]  # the same policy, exactly
        assert rerun["values"] == straight["values"]  # the same critic (PPO; None for KTO)
        assert untimed(rerun) == untimed(straight)  # the same rollouts, rewards, labels, losses


@pytest.mark.parametrize("stage", ["ppo", "kto"])
def test_final_is_an_hf_folder_with_the_trained_logits(stages, stage):
    writer = stages[0][stage]
    assert writer["final_logits_max_diff"] <= 1e-5
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(writer["final_files"])
