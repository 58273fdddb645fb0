"""``nemo-factuality launch --via nemo-run`` (issue 52 item 4) with NeMo-Run 0.11.1's own code, in its venv
(``tools/setup_stack_env.sh nemorun``): the dry run shows the heterogeneous job NeMo-Run would submit for the same
stage and profile as the sbatch path, with that path's own host discovery and ports; end to end on the loopback Slurm
through NeMo-Run's ``LocalTunnel``, the ``cpu_standin`` stage waits for its reward server, is requeued on exit 75,
checkpoints and is requeued on USR1, resumes, and completes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launch_helpers import release_requeued, rendered, site_params, write_standin_stage

from nemo_factuality.config import REPO_ROOT

pytestmark = pytest.mark.waits  # mostly on a Slurm job (tests/conftest.py gives it the waiting lane)


@pytest.fixture(scope="module")
def nemorun_venv() -> Path:
    """The NeMo-Run venv the launch command runs in; skips with the reason when not built."""
    from nemo_factuality.testing.nemorun_env import nemorun_venv as find
    from nemo_factuality.testing.nemorun_env import skip_reason

    found = find()
    if found is None:
        pytest.skip(skip_reason())
    return found


def _launch(nemorun_venv: Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``nemo-factuality launch ... --via nemo-run`` in the NeMo-Run venv (the checkout on PYTHONPATH); the job's steps
    find this venv's ``python`` and ``nemo-factuality`` first on PATH, as a user's would be their environment's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "NEMO_FACTUALITY_DEBUG"))}
    base.update(PYTHONPATH=str(REPO_ROOT), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                NEMORUN_HOME=str(cwd / "nemorun_home"), **(env or {}))
    return subprocess.run([str(nemorun_venv / "bin" / "python"), "-m", "nemo_factuality.cli", "launch", *args,
                           "--via", "nemo-run"], cwd=cwd, env=base, capture_output=True, text=True, timeout=180)


def test_dry_run_shows_the_het_job_nemo_run_would_submit(nemorun_venv, tmp_path):
    """grpo_klcf on h100_pyxis: three het groups (the trainer; the reward server; four judges sharing one #SBATCH
    block), one srun per component in its group and image with the srun flags of the sbatch path, the USR1 signal,
    NeMo-Run's own requeue off, and the sbatch path's host discovery and ports verbatim in its setup lines."""
    res = _launch(nemorun_venv, tmp_path, "grpo_klcf", "--dry-run", *site_params("grpo_klcf"))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "outputs" / "launch" / "grpo_klcf.nemo_run.sbatch"
    script = out.read_text()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == \
        ["outputs/launch/grpo_klcf.nemo_run.sbatch"]  # nothing else: NeMo-Run's experiment folder was a temporary one
    assert script.count("#SBATCH hetjob") == 2 and "#SBATCH --signal=B:USR1@300" in script
    assert "export TORCHX_MAX_RETRIES=0" in script  # NeMo-Run requeues on no failure itself: 75 / REQUEUE only
    assert re.findall(r"^#SBATCH --nodes=(\d+)$", script, re.M) == ["1", "1", "1"]
    assert re.findall(r"^#SBATCH --gpus-per-node=(\d+)$", script, re.M) == ["1", "0", "7"]
    sruns = [line for line in script.splitlines() if line.startswith("srun --het-group=")]
    assert [re.match(r"srun --het-group=(\d)", s).group(1) for s in sruns] == ["0", "1", "2", "2", "2", "2"]
    assert all("--cpus-per-task=16" in s and "--no-container-mount-home" in s for s in sruns)
    images = load_images()
    assert [images[re.search(r"--container-image (\S+)", s).group(1)] for s in sruns] == \
        ["trainer", "trainer", "judge", "judge", "judge", "trainer"]
    assert '--nodelist="${EXTRACTOR_NODE}"' in sruns[2] and "pids[0]=$!" in sruns[0]
    sbatch = rendered("grpo_klcf")  # one piece of code: the sbatch path's discovery block, verbatim
    discovery = sbatch.split("# ---------- host discovery and ports", 1)[1].split("\nSERVER_PIDS=()", 1)[0].strip()
    assert discovery in script
    trainer_task = res.stdout.split("task script grpo_klcf-0.sh", 1)[1].split("# ---------- task script", 1)[0]
    waits = re.findall(r"^wait_ready (\w+) ", trainer_task, re.M)
    assert waits == ["extractor", "checklist", "truthfulness", "general_rm", "factuality_reward"]  # judges first
    assert trainer_task.index("wait_ready factuality_reward") < trainer_task.index("python -m nemo_factuality.trainers.grpo")
    assert 'exec >>"$LOG_DIR/trainer.log" 2>&1' in trainer_task and "cd /workspace/nemo_factuality" in trainer_task


def load_images() -> dict[str, str]:
    from nemo_factuality.config import load_config
    from nemo_factuality.launch.config import ClusterProfile

    return {path: kind for kind, path in load_config(ClusterProfile, "h100_pyxis", group="cluster").images.items()}


def _logs(tmp_path: Path, job: str) -> tuple[str, str]:
    """(NeMo-Run's batch log, the trainer's log)."""
    batch = tmp_path / "logs" / f"sbatch_cpu_standin_{job}.out"
    trainer = tmp_path / "logs" / f"cpu_standin-{job}" / "trainer.log"
    return (batch.read_text() if batch.exists() else "", trainer.read_text() if trainer.exists() else "")


def test_cpu_standin_runs_requeues_and_resumes_through_nemo_run(nemorun_venv, slurm, tmp_path):
    """One job, three starts: the first trainer stops as a stage does when a server stayed away (exit 75 and a REQUEUE
    file) and the job is requeued; the second (the real GRPO stage, after its reward server answered) is sent USR1,
    checkpoints and the job is requeued; the third resumes from that checkpoint and completes."""
    shipped = yaml.safe_load((REPO_ROOT / "conf" / "launch" / "cpu_standin.yaml").read_text())
    trainer = shipped["trainer_command"] + " trainer.max_steps=40"
    first = ('if [ "x$SLURM_RESTART_COUNT" = x ] || [ "$SLURM_RESTART_COUNT" = 0 ]; then mkdir -p "$CKPT_DIR" && '
             'echo reward server gone past its retry window > "$CKPT_DIR/REQUEUE"; exit 75; fi; ')
    stage = write_standin_stage(tmp_path / "stage.yaml", trainer_command=first + trainer)
    (tmp_path / "logs").mkdir()
    res = _launch(nemorun_venv, tmp_path, str(stage), "--cluster", "local_cpu", f"cluster.log_root={tmp_path / 'logs'}",
                  env={k: v for k, v in slurm.env.items() if k in ("SLURM_CONF", "NF_SLURM_TEST_RUN")})
    assert res.returncode == 0, res.stdout + res.stderr
    job = res.stdout.strip().splitlines()[-1]
    assert job.isdigit(), res.stdout
    release_requeued(slurm, job, restarts=1)  # start 0: exit 75 -> requeued
    deadline = time.time() + 180
    while "step 10:" not in _logs(tmp_path, job)[1] and time.time() < deadline:
        time.sleep(0.5)
    batch, log = _logs(tmp_path, job)
    assert "step 10:" in log, batch[-3000:] + log[-3000:]
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True)
    release_requeued(slurm, job, restarts=2)  # start 1: USR1 -> checkpoint -> requeued
    assert slurm.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 240) == "COMPLETED", _logs(tmp_path, job)[0][-4000:]
    batch, log = _logs(tmp_path, job)
    assert "reward server gone past its retry window" in batch and "a server stayed away; requeueing job" in batch
    assert "USR1: time limit near; asking the trainer to checkpoint" in batch
    assert re.search(r"start 1 .*\n(.|\n)*start 2 ", batch)
    assert log.index("factuality_reward ready") < log.index("step 1:")  # the trainer waited for its server
    saved = int(log.split("stopped by SIGUSR1 at step ")[1].split(";")[0])
    assert f"(step {saved})" in log.split("stopped by SIGUSR1")[1] and "training finished at step 40" in log
    assert list((tmp_path / "logs" / "nemo-run" / "experiments" / "cpu_standin").iterdir())  # NeMo-Run's record of it
