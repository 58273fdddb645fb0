"""The GRPO stage on ``trainer.backend=megatron``: the real ``GRPOTrainer`` (as the stage command runs it) from the
HF checkpoint to the exported HF folder, at TP=2 (one replica over two ranks) and at DP=2 (two replicas), in the
megatron venv under torchrun on gloo (``megatron_grpo_driver.py``), and at TP=2×DP=2 with the GPU presets' settings
(bf16 mixed precision, sequence parallelism, the distributed optimizer, full recompute; AdamW). A run interrupted after
step 2 and rerun with the same command resumes from its checkpoint and ends exactly where the uninterrupted run ends;
``final/`` reloads in transformers with the trained Megatron model's logits (in bf16 for the preset run: the two
compute in different orders, measured 0.025 on logits of size ~4). ``tp2dp2_dynamic``: the same at TP=2×DP=2 with
rollouts on Megatron's dynamic inference engine (``attention_kernels=torch``) and sequence parallelism on: the stage takes
its chunks as requests finish, each replica steps its own engine (2 of its 4 prompts in flight), and the rerun's
rollouts are the straight run's (the stage's sampling streams)."""

from __future__ import annotations

import json
import math

import pytest

from nemo_factuality.testing.megatron_env import PRELOAD, run_batch_in_megatron_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]
DRIVER = "tests/trainers/megatron_grpo_driver.py"


# layout: (processes, driver arguments, the largest difference of final/'s logits in transformers)
LAYOUTS = {"tp2": (2, ["--tp=2"], 1e-5), "dp2": (2, [], 1e-5), "tp2dp2_preset": (4, ["--tp=2", "--preset"], 0.1),
           "tp2dp2_dynamic": (4, ["--tp=2", "--dynamic"], 1e-5)}


@pytest.fixture(scope="module")
def runs(megatron_venv, tmp_path_factory) -> dict:
    """The tiny model, then every layout's driver run, in one launch (Megatron imported once for all of them):
    layout → (its output folder, its ``ProgramRun``)."""
    root = tmp_path_factory.mktemp("megatron_grpo")
    programs = {"make-model": (1, ["tests/trainers/megatron_driver.py", "make-model", f"--out={root / 'hf'}"])}
    for name, (nproc, args, _) in LAYOUTS.items():
        (root / name).mkdir()
        programs[name] = (nproc, [DRIVER, f"--hf={root / 'hf'}", f"--out={root / name}", *args])
    results = run_batch_in_megatron_venv(megatron_venv, programs, logs=root / "logs", timeout=2400,
                                         preload=PRELOAD)
    results["make-model"].check("make-model")
    return {name: (root / name, results[name]) for name in LAYOUTS}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request, runs) -> list[dict]:
    out, result = runs[request.param]
    result.check(request.param)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(LAYOUTS[request.param][0])]


def _layout(request) -> str:
    return request.node.callspec.params["ranks"]


def test_the_layout(ranks, request):
    want = {"tp2": [0, 0], "dp2": [0, 1], "tp2dp2_preset": [0, 0, 1, 1],
            "tp2dp2_dynamic": [0, 0, 1, 1]}[_layout(request)]
    assert [r["dp"] for r in ranks] == [max(want) + 1] * len(want)
    assert sorted(r["dp_rank"] for r in ranks) == want


def test_the_stage_trains_three_steps_with_a_checkpoint_each(ranks, request):
    for r in ranks:
        # the rollouts came from the engine the layout names: the dynamic engine's paged decode, or none of it
        assert (r["paged_decode_calls"] > 0) == (_layout(request) == "tp2dp2_dynamic"), r["paged_decode_calls"]
        # the dynamic engine (its context sized for data.max_prompt_tokens + the response) built once, reused by the 6
        # rollout steps of the three runs (straight 3, interrupted 2, resumed 1) and across the checkpoint loads between them
        assert r["dynamic_builds"] == (1 if _layout(request) == "tp2dp2_dynamic" else 0)
        run = r["runs"]["straight"]
        assert run["exit"] == 0 and run["checkpoints"][-1] == "step_000003" and "latest" in run["checkpoints"]
        assert [m["step"] for m in run["metrics"]] == [1, 2, 3]
        for m in run["metrics"]:
            assert math.isfinite(m["reward/score"]) and math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0


def test_the_rerun_of_an_interrupted_run_ends_where_the_straight_run_ends(ranks):
    for r in ranks:
        straight, rerun = r["runs"]["straight"], r["runs"]["interrupted"]
        assert rerun["exit"] == 0 and rerun["checkpoints"][-1] == "step_000003"
        assert rerun["logprobs"] == straight["logprobs"]  # the same weights, exactly
        # the same rollouts, rewards and losses (each rank's random streams resumed); only the timings differ
        untimed = lambda run: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in run["metrics"]]  # noqa: E731
        assert untimed(rerun) == untimed(straight)


def test_final_is_an_hf_folder_with_the_trained_logits(ranks, request):
    writer = ranks[0]["runs"]
    assert writer["final_logits_max_diff"] <= LAYOUTS[_layout(request)][2]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(writer["final_files"])
