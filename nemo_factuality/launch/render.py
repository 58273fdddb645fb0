"""Render the sbatch script for a stage + cluster profile from the Jinja2 template in ``slurm/``."""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import asdict
from pathlib import Path

import jinja2

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig

TEMPLATE_DIR = REPO_ROOT / "slurm"


class LaunchConfigError(ValueError):
    """The stage or profile cannot produce a valid job."""


_PYTHON_MODULE = re.compile(r"(?:^|[\s;&|(])\S*python[\d.]*\s+(?:-[A-Za-z]+\s+)*-m\s+([A-Za-z_][\w.]*)")
PACKAGE = "nemo_factuality"


def python_modules(command: str) -> list[str]:
    """Modules a shell command runs with ``python -m X`` (in order)."""
    return _PYTHON_MODULE.findall(command)


def missing_modules(stage: LaunchConfig) -> list[str]:
    """``nemo_factuality.*`` modules the stage runs that this installation does not have.

    Only this package's modules are checked (found, not imported: a login node may lack the GPU stack
    they import); third-party ones (``vllm``, ...) live in the job's container.
    """
    commands = [stage.trainer_command] + [s.command for s in stage.reward_servers + stage.judges]
    missing = []
    for module in (m for c in commands for m in python_modules(c)):
        if module.split(".")[0] != PACKAGE:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found and module not in missing:
            missing.append(module)
    return missing


def validate(stage: LaunchConfig, cluster: ClusterProfile) -> None:
    """Every problem of the stage × profile in one ``LaunchConfigError`` (GPUs, servers, modules that do not exist)."""
    problems = []
    gpus_needed = stage.tensor_parallel * stage.pipeline_parallel
    if not cluster.gpus_per_node and gpus_needed > 1:
        problems.append(f"the trainer needs TP×PP = {gpus_needed} GPUs but the profile's nodes have none (gpus_per_node: 0)")
    elif cluster.gpus_per_node and gpus_needed > stage.actor_nodes * cluster.gpus_per_node:
        problems.append(f"TP×PP = {gpus_needed} GPUs but actor_nodes × gpus_per_node = {stage.actor_nodes * cluster.gpus_per_node}")
    if stage.actor_nodes < 1:
        problems.append("actor_nodes must be >= 1")
    if not stage.reward_servers:
        problems.append("at least one reward server is needed (reward_servers: [...])")
    for spec in stage.reward_servers + stage.judges:
        if not spec.command.strip():
            problems.append(f"server {spec.name!r} has no command")
        if spec.gpus > cluster.gpus_per_node:
            problems.append(f"server {spec.name!r} asks for {spec.gpus} GPUs; nodes have {cluster.gpus_per_node}")
    if len({s.name for s in stage.reward_servers + stage.judges}) != len(stage.reward_servers + stage.judges):
        problems.append("server names must be unique (they name log files and env variables)")
    problems += [f"python -m {m}: no such module in this installation of {PACKAGE} (a typo, or a newer version is "
                 "needed)" for m in missing_modules(stage)]
    if problems:
        raise LaunchConfigError("invalid launch config: " + "; ".join(problems))


def render(stage_name: str, stage: LaunchConfig, cluster: ClusterProfile) -> str:
    """The sbatch script text (validated first)."""
    validate(stage, cluster)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda s: shlex.quote(str(s))
    env.filters["envname"] = lambda s: "".join(c if c.isalnum() else "_" for c in str(s)).upper()
    ckpt_dir = stage.ckpt_dir.format(job_name=stage.job_name)
    return env.get_template("het_job.sbatch.j2").render(
        stage_name=stage_name, stage=asdict(stage), cluster=asdict(cluster), ckpt_dir=ckpt_dir,
        trainer_command=stage.trainer_command.format(ckpt_dir=ckpt_dir),
    )


def write_script(text: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    out.chmod(0o755)
    return out
