"""The megatron backend's parts that need no Megatron: its config rules, its registration, what importing it loads,
the rollout layout of Megatron's generations, and the test command's handling of its venv."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from nemo_factuality.config import REPO_ROOT, ConfigError
from nemo_factuality.trainers.config import GRPOConfig, KTOConfig, PPOConfig, load_train_config


def _megatron(schema, *extra: str):
    return load_train_config(schema, None, ["trainer.backend=megatron", "model.path=/models/policy",
                                            "remote_rm.url=http://127.0.0.1:9", *extra])


def test_every_stage_accepts_the_megatron_backend():
    cfg = _megatron(GRPOConfig, "model.tensor_model_parallel_size=2", "model.megatron.use_distributed_optimizer=true")
    assert cfg.trainer.backend == "megatron" and cfg.model.megatron.use_distributed_optimizer
    assert _megatron(KTOConfig).trainer.backend == "megatron"
    ppo = _megatron(PPOConfig, "model.tensor_model_parallel_size=2", "critic.tensor_model_parallel_size=2",
                    "model.global_batch_size=8")
    assert ppo.trainer.backend == "megatron" and ppo.critic.url is None


@pytest.mark.parametrize("extra, named", [
    (["model.path=null"], "model.path"),
    (["model.dtype=float16"], "model.dtype=float16"),
    (["rollout.engine=trtllm"], "rollout.engine=trtllm"),
    (["model.megatron.sequence_parallel=true"], "model.megatron.sequence_parallel=true needs model.tensor_model"),
    (["model.megatron.recompute=uniform"], "model.megatron.recompute='uniform' (choose one of none, full, selective)"),
    (["model.megatron.use_distributed_optimizer=true", "model.optim.name=sgd"], "model.optim.name=sgd"),
    (["model.megatron.use_distributed_optimizer=true", "model.megatron.optimizer_checkpoint=fully_reshardable",
      "model.megatron.use_gloo_process_groups=false"],
     "model.megatron.use_gloo_process_groups=false with model.megatron.optimizer_checkpoint=fully_reshardable"),
    (["model.megatron.inference_engine=paged"],
     "model.megatron.inference_engine='paged' (choose one of static, dynamic)"),
    (["model.megatron.inference_buffer_gb=0"], "model.megatron.inference_buffer_gb must be > 0"),
    (["model.megatron.inference_block_tokens=0"], "model.megatron.inference_block_tokens must be >= 1"),
    (["model.megatron.inference_max_step_tokens=100"],
     "model.megatron.inference_max_step_tokens must be null or a positive multiple of 64, got 100"),
    (["model.megatron.inference_engine=dynamic", "rollout.engine=vllm"],
     "model.megatron.inference_engine=dynamic with rollout.engine=vllm"),
    (["rollout.engine=vllm", "rollout.vllm.placement=nearby"],
     "rollout.vllm.placement='nearby' (choose one of colocated, separate)"),
    (["rollout.engine=vllm", "rollout.vllm.refit=scp"], "rollout.vllm.refit='scp' (choose one of file, broadcast)"),
    (["rollout.engine=vllm", "rollout.vllm.refit=broadcast", "trainer.device=cuda"],
     "rollout.vllm.refit=broadcast with rollout.vllm.placement=colocated on trainer.device=cuda: NCCL refuses"),
])
def test_what_the_megatron_backend_cannot_do_is_refused_naming_the_setting(extra, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        _megatron(GRPOConfig, *extra)


def test_the_gpu_settings_pass_the_stage_cli_and_become_the_backends_settings():
    """The presets' combination through the stage command's parser (``nemo-factuality train grpo``), then what the
    backend hands Megatron (``backends.megatron.build.Settings``; that they reach Megatron's configs is
    test_megatron_gpu_settings' job, in the megatron venv)."""
    from nemo_factuality.trainers.backends.megatron.build import Settings
    from nemo_factuality.trainers.cli import parse_stage_config

    cfg, _ = parse_stage_config("grpo", [
        "--config-name", "klcf", "trainer.backend=megatron", "model.path=/models/policy",
        "model.tensor_model_parallel_size=2", "model.dtype=bfloat16", "model.megatron.sequence_parallel=true",
        "model.megatron.recompute=full", "model.megatron.use_distributed_optimizer=true",
        "model.megatron.transformer_engine=true"])
    settings = Settings.of(cfg.model)
    assert settings == Settings(bf16=True, sequence_parallel=True, recompute="full", transformer_engine=True,
                                distributed_optimizer=True)
    assert settings.dtype == torch.bfloat16 and Settings.of(_megatron(GRPOConfig).model) == Settings()


@pytest.mark.parametrize("extra, built", [
    ([], False),
    (["model.megatron.use_distributed_optimizer=true"], False),  # the presets: dp_reshardable saves gather nothing
    (["model.megatron.optimizer_checkpoint=fully_reshardable"], False),  # no distributed optimizer: nothing to gather
    (["model.megatron.use_distributed_optimizer=true", "model.megatron.optimizer_checkpoint=fully_reshardable"], True),
    (["model.megatron.use_gloo_process_groups=true"], True),
    (["model.megatron.use_distributed_optimizer=true", "model.megatron.use_gloo_process_groups=false"], False),
])
def test_gloo_groups_are_asked_for_only_where_a_save_gathers_on_them(extra, built):
    """``model.megatron.use_gloo_process_groups`` null (the default) builds Megatron's gloo data-parallel groups only
    for the distributed optimizer saving fully_reshardable (issue 50 item 8); true / false decide it."""
    from nemo_factuality.trainers.backends.megatron.build import Settings

    cfg = _megatron(GRPOConfig, *extra)
    assert cfg.model.megatron.use_gloo_process_groups is {"true": True, "false": False}.get(
        next((e.split("=")[1] for e in extra if "use_gloo_process_groups" in e), None))
    assert Settings.of(cfg.model).gloo_process_groups is built


def test_megatron_settings_on_another_backend_are_refused_not_ignored():
    with pytest.raises(ConfigError, match=re.escape("model.megatron.recompute: settings of trainer.backend=megatron")):
        load_train_config(GRPOConfig, None, ["model.path=/models/policy", "remote_rm.url=http://127.0.0.1:9",
                                             "model.megatron.recompute=full"])


def test_the_schema_carries_the_gpu_settings_with_their_defaults():
    """``model.megatron.*`` as the presets name them, with their defaults (all off)."""
    cfg = _megatron(GRPOConfig, "rollout.engine=vllm", "rollout.vllm.placement=separate")
    m = cfg.model.megatron
    assert (m.use_distributed_optimizer, m.sequence_parallel, m.recompute, m.transformer_engine) == \
        (False, False, "none", False)
    assert (m.inference_engine, m.inference_buffer_gb) == ("static", 4.0)  # the static engine runs anywhere
    assert cfg.rollout.vllm.placement == "separate"


@pytest.mark.parametrize("extra, named", [
    (["model.tensor_model_parallel_size=2", "critic.tensor_model_parallel_size=4"], "critic.tensor_model_parallel_size=4"),
    (["critic.pipeline_model_parallel_size=2"], "critic.pipeline_model_parallel_size=2"),
    (["critic.url=http://127.0.0.1:5556"], "critic.url="),
])
def test_a_critic_apart_from_the_policy_is_refused_naming_the_setting(extra, named):
    """The megatron backend's critic shares the policy's process groups and trains in the PPO process: another layout
    or a critic server (the aligner backend's) is a setting to change, not one silently ignored."""
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        _megatron(PPOConfig, "model.global_batch_size=8", *extra)


def test_the_backend_is_registered_and_importing_it_loads_no_megatron():
    code = ("import sys; from nemo_factuality.trainers.backends import BACKENDS; "
            "import nemo_factuality.trainers.backends.megatron.actor as m; "
            "assert 'megatron' in BACKENDS.names(), BACKENDS.names(); "
            "loaded = [k for k in sys.modules if k.split('.')[0] == 'megatron']; assert not loaded, loaded")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]


def test_megatrons_generations_become_the_stages_rollout_layout():
    """Megatron's static engine returns each generation without its EOS, shorter than the budget when EOS ended it:
    the rollout holds the EOS in the response (is_end), as the hf backend's does, right-padded with the pad id."""
    from nemo_factuality.trainers.backends.megatron.generate import _rollout

    eos, pad = 3, 4
    rollout = _rollout([[7, 8, 9], [5]], [[11, 12], [13, 14, 15]], max_new_tokens=3, eos_id=eos, pad_id=pad)
    assert rollout.tokens.tolist() == [[7, 8, 9, 11, 12, eos], [5, 13, 14, 15, pad, pad]]
    assert rollout.prompt_lengths.tolist() == [3, 1] and rollout.response_lengths.tolist() == [6, 4]
    assert rollout.is_end.tolist() == [True, False]
    assert rollout.response_ids(0, eos_id=eos) == [11, 12] and rollout.response_ids(1, eos_id=eos) == [13, 14, 15]
    assert rollout.tokens.dtype == torch.long


def test_the_test_command_exports_the_megatron_venv_it_finds(tmp_path):
    """As for the aligner venv (tests/test_run_tests.py): a complete venv where the setup script puts it is exported
    to the tests that use it, and nothing is built."""
    root = tmp_path / "venvs"
    where = subprocess.run(["bash", str(REPO_ROOT / "tools" / "setup_stack_env.sh"), "megatron", "--path"], capture_output=True,
                           text=True, check=True, timeout=30, env={**os.environ, "NEMO_FACTUALITY_VENV_ROOT": str(root)})
    venv = root / where.stdout.strip().rsplit("/", 1)[-1]
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".complete").touch()
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text("import os\n\nfrom nemo_factuality.testing.megatron_env import megatron_venv\n\n\n"
                     "def test_probe():\n    print('RESOLVED', os.environ.get('NEMO_FACTUALITY_MEGATRON_VENV'), megatron_venv())\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_FACTUALITY_")}
    base["PATH"] = f"{os.path.dirname(sys.executable)}:{base['PATH']}"  # this interpreter, in a checkout without .venv
    res = subprocess.run(["bash", str(REPO_ROOT / "tools" / "run_tests.sh"), str(probe), "-s", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, timeout=180,
                         env={**base, "PYTHONPATH": str(REPO_ROOT), "NEMO_FACTUALITY_VENV_ROOT": str(root)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"RESOLVED {venv} {venv}" in res.stdout
    assert f"== Megatron-Core/Bridge venv: {venv}" in res.stderr and "building" not in res.stderr


@pytest.mark.parametrize("text, named", [
    ('{"use_distributed_optimizer": true, "optimizer_checkpoint": "sharded", "last_epoch": 3}',
     "optimizer_checkpoint is 'sharded', not one of dp_reshardable, fully_reshardable"),
    ('{"optimizer_checkpoint": "dp_reshardable"}', "use_distributed_optimizer is None, not true/false"),
    ('{"use_distributed_optimizer": false, "tensor_model_parallel_size": "2"}',
     "tensor_model_parallel_size is '2', not a positive integer"),
    ('{"use_distributed_optimizer": true, "optimizer_ch', "is not the JSON the megatron backend writes"),
    ("[1, 2]", "holds list, not the JSON object"),
])
def test_a_schedule_file_the_backend_did_not_write_is_refused_in_one_line(tmp_path, text, named):
    """``megatron_schedule.json`` is read before anything loads: a changed or foreign file is one line naming the file
    and the key (before, an unknown format was a KeyError traceback deep in the load)."""
    from nemo_factuality.trainers.backends.megatron.model import SCHEDULE_FILE, read_schedule
    from nemo_factuality.types import FactualityInputError

    path = tmp_path / SCHEDULE_FILE
    path.write_text(text)
    with pytest.raises(FactualityInputError) as caught:
        read_schedule(path)
    assert named in str(caught.value) and str(path) in str(caught.value) and "\n" not in str(caught.value)
    path.write_text('{"use_distributed_optimizer": true, "optimizer_checkpoint": "dp_reshardable", '
                    '"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "last_epoch": 3}')
    assert read_schedule(path)["last_epoch"] == 3  # what save_model writes passes


def test_an_optimizer_state_resumes_only_into_the_class_that_wrote_it(tmp_path):
    """torch's AdamW (no TE) keeps Adam's step per parameter, TE's FusedAdam per group: a checkpoint written by one and
    loaded by the other is refused in one line naming both (before: a KeyError on ``bias_correction`` at FusedAdam's
    first step); the same class, or a checkpoint recording none, passes. The kind is the class inside the wrappers."""
    import torch

    from nemo_factuality.trainers.backends.megatron.model import check_optimizer_kind, optimizer_kind
    from nemo_factuality.types import FactualityInputError

    class Wrapper:  # Megatron's optimizer around the one that steps (its .optimizer), chained or not
        def __init__(self, inner):
            self.optimizer = inner

    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert optimizer_kind(Wrapper(adamw)) == "torch.optim.adamw.AdamW"
    chained = type("Chained", (), {"chained_optimizers": [Wrapper(adamw)]})()
    assert optimizer_kind(chained) == "torch.optim.adamw.AdamW"
    fused = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    check_optimizer_kind(tmp_path, "torch.optim.adamw.AdamW", "torch.optim.adamw.AdamW")
    check_optimizer_kind(tmp_path, None, fused)  # written before the kind was recorded
    with pytest.raises(FactualityInputError) as caught:
        check_optimizer_kind(tmp_path, "torch.optim.adamw.AdamW", fused)
    line = str(caught.value)
    assert "torch.optim.adamw.AdamW" in line and fused in line and str(tmp_path) in line and "\n" not in line
