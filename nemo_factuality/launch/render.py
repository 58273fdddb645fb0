"""Render the sbatch script for a stage + cluster profile from the Jinja2 template in ``slurm/``."""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jinja2
import yaml

from nemo_factuality.config import REPO_ROOT, conf_dir
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig, ServerSpec

TEMPLATE_DIR = REPO_ROOT / "slurm"


class LaunchConfigError(ValueError):
    """The stage or profile cannot produce a valid job."""


_PYTHON_MODULE = re.compile(r"(?:^|[\s;&|(])\S*python[\d.]*\s+(?:-[A-Za-z]+\s+)*-m\s+([A-Za-z_][\w.]*)")
PACKAGE = "nemo_factuality"


def python_modules(command: str) -> list[str]:
    """Modules a shell command runs with ``python -m X`` (in order)."""
    return _PYTHON_MODULE.findall(command)


def servers(stage: LaunchConfig) -> list[ServerSpec]:
    """Every server step of the stage: reward servers, judges, then the critic."""
    return stage.reward_servers + stage.judges + ([stage.critic] if stage.critic else [])


@dataclass(frozen=True)
class PresetLayout:
    """Where an aligner preset (``conf/train/aligner/<name>.yaml``) puts the policy: what the job must allocate."""

    name: str
    nodes: int
    gpus_per_node: int
    tensor_parallel: int
    pipeline_parallel: int


_STAGE_MODULE = re.compile(r"^nemo_factuality\.trainers\.(grpo|ppo|kto)$")


def preset_layout(name: str, trainer_command: str) -> PresetLayout:
    """The preset's layout for the method the trainer command runs. Read from the YAML here, not through
    ``trainers.backends.aligner.load_preset``: the launcher never imports the trainers (torch on a login node);
    the tests check both readings agree."""
    path = conf_dir() / "train" / "aligner" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise LaunchConfigError(f"invalid launch config: no aligner preset {name!r} ({path}); known: {', '.join(known)}")
    methods = [m.group(1) for m in map(_STAGE_MODULE.match, python_modules(trainer_command)) if m]
    if not methods:
        raise LaunchConfigError(f"invalid launch config: preset {name!r} needs a trainer command running "
                                "python -m nemo_factuality.trainers.{grpo,ppo,kto} (the preset's method section)")
    preset = yaml.safe_load(path.read_text(encoding="utf-8"))
    # the method's own model keys win over common's, as in load_preset
    model = {**preset["common"].get("model", {}), **preset[methods[-1]]["overrides"].get("model", {})}
    return PresetLayout(name, int(preset["nodes"]), int(preset["gpus_per_node"]),
                        int(model.get("tensor_model_parallel_size", 1)), int(model.get("pipeline_model_parallel_size", 1)))


def resolve(stage: LaunchConfig) -> tuple[LaunchConfig, int]:
    """(the stage with its actor layout filled in, trainer tasks per node).

    With a preset the layout is the preset's and the trainer runs one task per GPU; a value the stage sets
    that differs is an error (the trainer sizes NeMo's trainer from the preset, so srun must match it).
    Without a preset: 1 node, TP=PP=1 unless set, one task per node (the hf backend's single process)."""
    layout_keys = ("actor_nodes", "tensor_parallel", "pipeline_parallel")
    if not stage.preset:
        return replace(stage, **{k: 1 if getattr(stage, k) is None else getattr(stage, k) for k in layout_keys}), 1
    layout = preset_layout(stage.preset, stage.trainer_command)
    wanted = dict(zip(layout_keys, (layout.nodes, layout.tensor_parallel, layout.pipeline_parallel), strict=True))
    conflicts = [f"{k}={getattr(stage, k)} but preset {stage.preset} has {v}" for k, v in wanted.items()
                 if getattr(stage, k) not in (None, v)]
    if conflicts:
        raise LaunchConfigError("invalid launch config: " + "; ".join(conflicts) + " (leave them unset, or use a preset "
                                "with that layout: conf/train/aligner/)")
    return replace(stage, **wanted), layout.gpus_per_node


def missing_modules(stage: LaunchConfig) -> list[str]:
    """``nemo_factuality.*`` modules the stage runs that this installation does not have.

    Only this package's modules are checked (found, not imported: a login node may lack the GPU stack
    they import); third-party ones (``vllm``, ...) live in the job's container.
    """
    commands = [stage.trainer_command] + [s.command for s in servers(stage)]
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


def validate(stage: LaunchConfig, cluster: ClusterProfile, tasks_per_node: int = 1) -> None:
    """Every problem of the resolved stage × profile in one ``LaunchConfigError`` (GPUs, servers, modules that
    do not exist)."""
    problems = _preset_problems(stage, cluster, tasks_per_node) if stage.preset else []
    if not stage.preset and "{preset}" in stage.trainer_command:
        problems.append("trainer_command uses {preset} but the stage names no preset (preset: <conf/train/aligner name>)")
    gpus_needed = stage.tensor_parallel * stage.pipeline_parallel
    if not cluster.gpus_per_node and gpus_needed > 1:
        problems.append(f"the trainer needs TP×PP = {gpus_needed} GPUs but the profile's nodes have none (gpus_per_node: 0)")
    elif cluster.gpus_per_node and gpus_needed > stage.actor_nodes * cluster.gpus_per_node:
        problems.append(f"TP×PP = {gpus_needed} GPUs but actor_nodes × gpus_per_node = {stage.actor_nodes * cluster.gpus_per_node}")
    if stage.actor_nodes < 1:
        problems.append("actor_nodes must be >= 1")
    if not stage.reward_servers:
        problems.append("at least one reward server is needed (reward_servers: [...])")
    if stage.critic and stage.critic.gpus < 1:
        problems.append(f"critic {stage.critic.name!r} needs gpus >= 1 (it runs one task per GPU)")
    for spec in servers(stage):
        if not spec.command.strip():
            problems.append(f"server {spec.name!r} has no command")
        if spec.gpus > cluster.gpus_per_node:
            problems.append(f"server {spec.name!r} asks for {spec.gpus} GPUs; nodes have {cluster.gpus_per_node}")
    if len({s.name for s in servers(stage)}) != len(servers(stage)):
        problems.append("server names must be unique (they name log files and env variables)")
    problems += [f"python -m {m}: no such module in this installation of {PACKAGE} (a typo, or a newer version is "
                 "needed)" for m in missing_modules(stage)]
    if problems:
        raise LaunchConfigError("invalid launch config: " + "; ".join(problems))


def _preset_problems(stage: LaunchConfig, cluster: ClusterProfile, tasks_per_node: int) -> list[str]:
    problems = []
    if tasks_per_node > cluster.gpus_per_node:
        problems.append(f"preset {stage.preset} runs {tasks_per_node} trainer tasks (one per GPU) per node but the "
                        f"profile's nodes have {cluster.gpus_per_node} GPUs")
    world = stage.actor_nodes * tasks_per_node
    if world % (stage.tensor_parallel * stage.pipeline_parallel):
        problems.append(f"TP×PP = {stage.tensor_parallel * stage.pipeline_parallel} does not divide the {world} GPUs "
                        f"of preset {stage.preset}")
    if not re.search(r"--preset[= ]\{preset\}(\s|$)", stage.trainer_command):
        problems.append("trainer_command must pass --preset {preset}: the trainer builds NeMo's trainer (devices, "
                        "nodes, TP/PP) from the same preset the job is sized from")
    return problems


def render(stage_name: str, stage: LaunchConfig, cluster: ClusterProfile) -> str:
    """The sbatch script text (validated first)."""
    stage, tasks_per_node = resolve(stage)
    validate(stage, cluster, tasks_per_node)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda s: shlex.quote(str(s))
    env.filters["envname"] = lambda s: "".join(c if c.isalnum() else "_" for c in str(s)).upper()
    ckpt_dir = stage.ckpt_dir.format(job_name=stage.job_name)
    return env.get_template("het_job.sbatch.j2").render(
        stage_name=stage_name, stage=asdict(stage), cluster=asdict(cluster), ckpt_dir=ckpt_dir,
        trainer_command=stage.trainer_command.format(ckpt_dir=ckpt_dir, preset=stage.preset or ""),
        actor_tasks_per_node=tasks_per_node, critic_group=2 + bool(stage.judges),
    )


def write_script(text: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    out.chmod(0o755)
    return out
