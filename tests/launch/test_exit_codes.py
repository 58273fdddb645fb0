"""The toolkit's exit codes: one module, distinct codes, the README's table is that module, and the rendered sbatch
script ends with them; the docs' table is generated from it (its restart guard run with bash: "too many restarts" is not a stalled run's 3)."""

from __future__ import annotations

import os
import re
import subprocess

from launch_helpers import rendered

from nemo_factuality import exit_codes
from nemo_factuality.trainers.runtime import RunStopped, TrainingStalledError
from nemo_factuality.types import ServerUnavailableError

CODES = {name: value for name, value in vars(exit_codes).items() if name.isupper() and isinstance(value, int)}


def test_every_code_is_distinct_and_has_a_meaning():
    assert len(set(CODES.values())) == len(CODES), CODES
    assert set(exit_codes.MEANINGS) == set(CODES.values())
    assert exit_codes.TOO_MANY_RESTARTS not in (exit_codes.TRAINING_STALLED, exit_codes.TEMPFAIL)
    assert exit_codes.TEMPFAIL == os.EX_TEMPFAIL  # the sysexits value a launcher reads as "try again later"


def test_the_errors_that_stop_a_run_carry_the_modules_codes():
    assert TrainingStalledError("x").exit_code == exit_codes.TRAINING_STALLED
    assert ServerUnavailableError("x").exit_code == RunStopped("x").exit_code == exit_codes.TEMPFAIL


def _sbatch(tmp_path, **cluster_over) -> str:
    text = rendered("cpu_standin", "local_cpu", log_root=str(tmp_path / "logs"), **cluster_over)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    return str(script)


def test_the_rendered_restart_guard_exits_too_many_restarts(tmp_path):
    """The rendered script run with bash as Slurm would start it after more requeues than the stage's max_restarts:
    it stops before any step starts, with TOO_MANY_RESTARTS (it was 3, a stalled run's code)."""
    script = tmp_path / "job.sbatch"
    script.write_text(rendered("cpu_standin", "local_cpu", log_root=str(tmp_path / "logs")))
    env = {**os.environ, "SLURM_JOB_NAME": "t", "SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "99"}
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert res.returncode == exit_codes.TOO_MANY_RESTARTS, res.stderr
    assert "more than max_restarts=" in res.stderr and f"(exit {exit_codes.TOO_MANY_RESTARTS})" in res.stderr
    text = script.read_text()
    assert "exit 3" not in text and f'"$rc" -eq {exit_codes.TEMPFAIL} ]' in text
    assert len(re.findall(rf"^ *exit {exit_codes.TOO_MANY_RESTARTS}\b", text, flags=re.M)) == 2  # the guard; the last restart after an outage
