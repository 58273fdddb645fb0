"""Shared by the launcher tests: a shipped stage with every required ``params`` value set, and its rendering."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from nemo_factuality.config import load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import render


def site_value(key: str) -> str:
    """The value the tests give a required launch parameter (a site path; unique per key)."""
    return f"/site/{key}"


def load_site_stage(stage_name: str, overrides: Sequence[str] = ()) -> LaunchConfig:
    """``conf/launch/<stage_name>.yaml`` under ``overrides``, every params key still empty set to ``site_value``."""
    stage = load_config(LaunchConfig, stage_name, list(overrides), group="launch")
    stage.params = {k: site_value(k) if v is None else v for k, v in stage.params.items()}
    return stage


def site_params(stage_name: str) -> list[str]:
    """``params.<key>=<site value>`` for every required key of a shipped stage (command-line overrides)."""
    stage = load_config(LaunchConfig, stage_name, group="launch")
    return [f"params.{k}={site_value(k)}" for k, v in stage.params.items() if v is None]


def rendered(stage_name: str, cluster_name: str = "h100_pyxis", overrides: Sequence[str] = (), **cluster_over) -> str:
    """The script of a shipped stage (params set) on a shipped profile under ``cluster.<key>=<value>`` overrides."""
    cluster = load_config(ClusterProfile, cluster_name, [f"{k}={v}" for k, v in cluster_over.items()], group="cluster")
    return render(stage_name, load_site_stage(stage_name, overrides), cluster)


def srun_steps(text: str) -> list[tuple[str, str]]:
    """``(srun line, the command its bash -c runs)`` of every step of a rendered script, in script order."""
    lines = text.splitlines()
    return [(line, shlex.split(lines[i + 1].strip().removesuffix("&"))[-1])
            for i, line in enumerate(lines) if line.startswith("srun ")]


def job_variables(text: str, job_id: int = 4242) -> dict[str, str]:
    """What a rendered script's host discovery exports (every server's node, host, ports and URL), run with bash as job
    ``job_id`` would run it: ``scontrol`` answers that group g's node i is ``g<g>n<i>`` at address ``g<g>n<i>.addr``."""
    import os
    import subprocess

    block = text.split("# ---------- host discovery and ports", 1)[1].split("\n", 1)[1].split("\nSERVER_PIDS=()", 1)[0]
    stub = ('scontrol() { if [ "$2" = hostnames ]; then for i in 0 1 2 3; do echo "${3}n$i"; done; '
            'else echo "NodeName=$3 NodeAddr=$3.addr State=IDLE"; fi; }\n')
    groups = {f"SLURM_JOB_NODELIST_HET_GROUP_{g}": f"g{g}" for g in range(5)}
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": str(job_id), **groups}
    out = subprocess.run(["bash", "-c", f"set -euo pipefail\n{stub}{block}\nenv -0"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    seen = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in seen.items() if k not in env and k not in ("PWD", "SHLVL", "_", "OLDPWD")}


def expand(command: str, variables: dict[str, str]) -> str:
    """``command`` with its ``${VAR}`` (and ``$VAR``) references to ``variables`` replaced, as the step's shell would."""
    import re

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), command)


def write_standin_stage(path, **overrides):
    """``conf/launch/cpu_standin.yaml`` with top-level keys replaced (``server=`` updates its reward server), written
    to ``path``."""
    import yaml

    from nemo_factuality.config import REPO_ROOT

    stage = yaml.safe_load((REPO_ROOT / "conf" / "launch" / "cpu_standin.yaml").read_text())
    for key, value in overrides.items():
        if key == "server":
            stage["reward_servers"][0].update(value)
        else:
            stage[key] = value
    path.write_text(yaml.safe_dump(stage))
    return path


def release_requeued(slurm, job: str, restarts: int, timeout_s: float = 120) -> None:
    """slurmctld holds a requeued batch job back (BeginTime about two minutes ahead): wait until the job has been
    requeued ``restarts`` times and is pending again, then start it now, so a test is quick (on a cluster the delay is
    harmless). Waiting for the restart count, not for PENDING alone: a job just submitted is PENDING too, and releasing
    it then leaves the real requeue held for its two minutes (a CI run on a loaded machine timed out that way)."""
    import subprocess
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        fields = slurm.job_fields(job)
        if fields.get("JobState") == "PENDING" and int(fields.get("Restarts", "0")) >= restarts:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.env, check=True)
            return
        time.sleep(0.5)
    last = {k: fields.get(k) for k in ("JobState", "Restarts", "Reason", "StartTime")}
    raise TimeoutError(f"job {job} not pending after restart {restarts} within {timeout_s}s (last: {last})")
