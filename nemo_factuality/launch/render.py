"""Render the sbatch script for a stage + cluster profile from the Jinja2 template in ``slurm/``."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from pathlib import Path

import jinja2

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig

TEMPLATE_DIR = REPO_ROOT / "slurm"


class LaunchConfigError(ValueError):
    """The stage or profile cannot produce a valid job."""


def validate(stage: LaunchConfig, cluster: ClusterProfile) -> None:
    problems = []
    gpus_needed = stage.tensor_parallel * stage.pipeline_parallel
    if cluster.gpus_per_node and gpus_needed > stage.actor_nodes * cluster.gpus_per_node:
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
