"""The 7B–32B aligner presets: the memory numbers written next to them are what the arithmetic gives, they fit
an H100-80GB with headroom, and the layouts are ones Megatron accepts (heads, batches, nodes divide)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_factuality.trainers.backends.aligner_memory import (
    GIB,
    H100_BUDGET_GIB,
    Arch,
    Layout,
    budgeted_rollout_batch,
    max_rollout_batch,
    rollout_bytes,
    training_bytes,
)

PRESETS = sorted((Path(__file__).resolve().parents[2] / "conf" / "train" / "aligner").glob("*.yaml"))
BUDGET_GIB = H100_BUDGET_GIB  # an H100 80GB shows ~79 GiB; keep 15% for allocator spikes
# published parameter counts (billions) of the architectures the presets describe
PUBLISHED = {"7b": 7.62, "14b": 14.77, "32b": 32.76}


def test_all_six_models_have_a_preset():
    names = {p.stem for p in PRESETS}
    assert names == {f"{f}-{s}" for f in ("qwen2.5", "deepseek-r1-distill-qwen") for s in ("7b", "14b", "32b")}


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_memory_arithmetic_and_layout(path):
    preset = yaml.safe_load(path.read_text())
    arch = Arch(**preset["arch"])
    assert arch.parameters() / 1e9 == pytest.approx(PUBLISHED[path.stem.rsplit("-", 1)[1]], abs=0.01)
    model = preset["common"]["model"]
    tp, pp = model["tensor_model_parallel_size"], model["pipeline_model_parallel_size"]
    gpus = preset["nodes"] * preset["gpus_per_node"]
    assert gpus % (tp * pp) == 0 and arch.heads % tp == 0 and (arch.kv_heads % tp == 0 or tp % arch.kv_heads == 0)
    dp = gpus // (tp * pp)
    for method in ("grpo", "ppo", "kto"):
        section = preset[method]
        lay = Layout(tp=tp, pp=pp, dp=dp, **section["layout"])
        train, rollout = training_bytes(arch, lay)["total"] / GIB, rollout_bytes(arch, lay)["total"] / GIB
        assert section["memory_gib"]["train"] == pytest.approx(train, abs=0.06), method
        assert section["memory_gib"]["rollout"] == pytest.approx(rollout, abs=0.06), method
        assert max(train, rollout) <= BUDGET_GIB, (method, train, rollout)
        o = section["overrides"]
        assert o["model"]["micro_batch_size"] == lay.micro_batch
        assert o["model"]["global_batch_size"] % (lay.micro_batch * dp) == 0
        assert lay.seq_len == lay.prompt_len + o["model"]["length_params"]["max_length"]
        assert o["data"]["max_prompt_tokens"] == lay.prompt_len
        # the rollout batch is sized from the budget: a step's rollouts per rank, or as many as fit at once
        per_rank = _rollouts_per_step(method, o) // dp
        assert lay.rollout_micro_batch == budgeted_rollout_batch(arch, lay, per_rank), method
        assert o["aligner_runtime"]["rollout_micro_batch_size"] == lay.rollout_micro_batch
        assert (lay.rollout_micro_batch == per_rank or
                rollout_bytes(arch, Layout(**{**lay.__dict__, "rollout_micro_batch": lay.rollout_micro_batch + 1}))[
                    "total"] / GIB > BUDGET_GIB), method
    grpo = preset["grpo"]["overrides"]["grpo"]
    rollouts = grpo["num_prompts_per_step"] * grpo["num_rollouts_per_prompt"]
    assert rollouts % preset["grpo"]["overrides"]["model"]["global_batch_size"] == 0


def _rollouts_per_step(method: str, overrides: dict) -> int:
    if method == "grpo":
        return overrides["grpo"]["num_prompts_per_step"] * overrides["grpo"]["num_rollouts_per_prompt"]
    if method == "ppo":
        return overrides["ppo"]["num_prompts_per_step"]
    return overrides["kto"]["prompts_per_iteration"] * overrides["kto"]["samples_per_prompt"]


def test_max_rollout_batch_is_the_last_batch_within_the_budget():
    arch = Arch(hidden=5120, layers=64, heads=40, kv_heads=8, ffn=27648, vocab=152064)
    lay = Layout(tp=8, pp=1, dp=2, micro_batch=1, seq_len=9216, rollout_micro_batch=1, prompt_len=1024)
    n = max_rollout_batch(arch, lay)
    within = rollout_bytes(arch, Layout(**{**lay.__dict__, "rollout_micro_batch": n}))["total"] / GIB
    over = rollout_bytes(arch, Layout(**{**lay.__dict__, "rollout_micro_batch": n + 1}))["total"] / GIB
    assert within <= BUDGET_GIB < over
    # 32B at TP=8 with 9k-token sequences: KV cache 2·64·1·128·2 B = 32 KiB per token, ~0.36 GiB per sequence
    assert 100 < n < 120
    assert max_rollout_batch(arch, lay, budget_gib=10) == 0  # the resident states alone exceed 10 GiB
    assert budgeted_rollout_batch(arch, lay, 16) == 16


def test_32b_does_not_fit_one_node_which_is_why_it_takes_two():
    preset = yaml.safe_load((PRESETS[0].parent / "qwen2.5-32b.yaml").read_text())
    arch = Arch(**preset["arch"])
    one_node = Layout(tp=8, pp=1, dp=1, **preset["grpo"]["layout"])
    assert training_bytes(arch, one_node)["total"] / GIB > BUDGET_GIB
    assert preset["nodes"] == 2


STAGES = {"grpo": ("GRPOConfig", "klcf"), "ppo": ("PPOConfig", "rlfh"), "kto": ("KTOConfig", "factalign")}


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_overrides_validate_against_the_stage_schemas(path):
    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.backends.aligner import AlignerRuntime, load_preset

    for method, (schema, config_name) in STAGES.items():
        overrides, runtime = load_preset(path.stem, method)
        cfg = schemas.load_train_config(getattr(schemas, schema), config_name,
                                        [*overrides, "model.restore_from_path=/models/policy.nemo"])
        preset = yaml.safe_load(path.read_text())
        assert cfg.trainer.backend == "aligner" and cfg.model.dtype == "bfloat16"
        assert cfg.model.tensor_model_parallel_size == preset["common"]["model"]["tensor_model_parallel_size"]
        assert cfg.model.micro_batch_size == preset[method]["layout"]["micro_batch"]
        assert cfg.model.length_params.max_length == preset[method]["overrides"]["model"]["length_params"]["max_length"]
        rt = AlignerRuntime(**runtime)
        assert rt.num_nodes * rt.devices == preset["nodes"] * 8
        assert rt.model_overrides["optim"]["name"] == "mcore_distributed_optim"
        assert rt.model_overrides["activations_checkpoint_granularity"] == "full"


def test_the_aligner_backend_modules_import_light():
    """Importing the backend (as the stages' registry does) loads neither NeMo, Aligner, Megatron nor PyTriton."""
    import subprocess
    import sys

    code = ("import sys, nemo_factuality.trainers.backends.aligner, nemo_factuality.trainers.backends.aligner_reward, "
            "nemo_factuality.trainers.backends.aligner_memory; "
            "print([m for m in sys.modules if m.split('.')[0] in ('nemo', 'nemo_aligner', 'megatron', 'pytriton', 'lightning')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
