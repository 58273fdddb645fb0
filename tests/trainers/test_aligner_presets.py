"""The 7B–32B aligner presets: the memory numbers written next to them are what the arithmetic gives, they fit
an H100-80GB with headroom, and the layouts are ones Megatron accepts (heads, batches, nodes divide)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_factuality.trainers.backends.aligner_memory import GIB, Arch, Layout, rollout_bytes, training_bytes

PRESETS = sorted((Path(__file__).resolve().parents[2] / "conf" / "train" / "aligner").glob("*.yaml"))
BUDGET_GIB = 0.85 * 79  # an H100 80GB shows ~79 GiB; keep 15% for allocator spikes
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
    grpo = preset["grpo"]["overrides"]["grpo"]
    rollouts = grpo["num_prompts_per_step"] * grpo["num_rollouts_per_prompt"]
    assert rollouts % (dp * preset["grpo"]["layout"]["rollout_micro_batch"]) == 0
    assert rollouts % preset["grpo"]["overrides"]["model"]["global_batch_size"] == 0


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
