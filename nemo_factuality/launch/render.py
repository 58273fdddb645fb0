"""Plan a stage + cluster profile as one job (``plan``) and render it as the sbatch script in ``slurm/`` (``render``).

Before anything is rendered the stage is resolved into steps and checked as a whole: required ``params`` set,
the actor layout (preset or the hf backend's single process), each server placed on a node of its het group
with its own GPUs, every endpoint of the served rewards wired to a server of the job (``launch.wiring``), each
step's image present in the profile, every ``python -m nemo_factuality.*`` module present, and what makes the job
fit its site (``launch.site``: checkpoints under a container mount, ports per job, srun flags). The ``JobPlan`` is
what both launch paths take: this sbatch script and the NeMo-Run experiment (``launch.nemorun``), which render the
same shell pieces (``slurm/job_lib.sh.j2``: environment, host discovery, readiness waits, preemption, requeue).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import jinja2

from nemo_factuality import exit_codes
from nemo_factuality.config import REPO_ROOT
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig, ServerSpec
from nemo_factuality.launch.layout import (
    PACKAGE_IMAGES,
    TRAINER_IMAGES,
    VLLM_PYTHON_ENV,
    PresetError,
    PresetLayout,
    command_backend,
    gpu_split_lines,
    layout_problems,
    preset_layout,
    python_modules,
)
from nemo_factuality.launch.site import (
    JobPorts,
    binding_problems,
    ckpt_host_dir,
    ckpt_problems,
    port_keys,
    port_problems,
    port_var,
    serve_port_problems,
    srun_flags,
)
from nemo_factuality.launch.sizing import busiest, group_mem, mem_need, place, size_problems
from nemo_factuality.launch.wiring import envname, serve_invocation, served_name_problems, wire

TEMPLATE_DIR = REPO_ROOT / "slurm"


class LaunchConfigError(ValueError):
    """The stage or profile cannot produce a valid job."""


_PLACEHOLDER = re.compile(r"(?<!\$)\{([a-z][a-z0-9_]*)\}")  # {port}, {policy_model}; never the shell's ${VAR}
_RUNS_VLLM = re.compile(r"(?:^|[\s;&|(])vllm\s")
# a value nobody's site has: <account>, CHANGEME, TODO, xxx, ... (as a path component too); an account or
# partition named my_account / your_partition
_PLACEHOLDER_PART = re.compile(r"<[^<>]*>|change[_-]?me|todo|fixme|tbd|x{3,}|\.{3}|placeholder", re.IGNORECASE)
_PLACEHOLDER_NAME = re.compile(r"(?:my|your)[_-]?(?:account|partition|project|qos|group|cluster|site)", re.IGNORECASE)
PACKAGE = "nemo_factuality"


def servers(stage: LaunchConfig) -> list[ServerSpec]:
    """Every server step of the stage: reward servers, judges, then the critic."""
    return stage.reward_servers + stage.judges + ([stage.critic] if stage.critic else [])


# ------------------------------------------------------------------------------------------------ params
def missing_params(stage: LaunchConfig) -> list[str]:
    return [k for k, v in stage.params.items() if v is None or not str(v).strip()]


def require_params(stage_name: str, stage: LaunchConfig) -> None:
    """One error naming every required launch value left empty, and how to set it."""
    missing = missing_params(stage)
    if missing:
        keys = " ".join(f"params.{k}=..." for k in missing)
        them = "it" if len(missing) == 1 else "them"
        raise LaunchConfigError(f"{stage_name} needs {', '.join('params.' + k for k in missing)} (the stage leaves {them} "
                                f"to you): nemo-factuality launch {stage_name} {keys}, or set {them} under params: in the "
                                "stage's YAML")


def fill(text: str, values: dict[str, str], where: str, problems: list[str]) -> str:
    """``text`` with its ``{key}`` placeholders replaced; an unknown key is a problem naming ``where``."""
    unknown = sorted({k for k in _PLACEHOLDER.findall(text) if k not in values})
    if unknown:
        problems.append(f"{where} uses {', '.join('{' + k + '}' for k in unknown)}: not a params key nor a launcher "
                        f"value (known here: {', '.join('{' + k + '}' for k in sorted(values))})")
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


# ------------------------------------------------------------------------------------------------ actor layout
def resolve(stage: LaunchConfig, cluster: ClusterProfile | None = None) -> tuple[LaunchConfig, PresetLayout | None]:
    """(the stage with its actor layout filled in, its preset's layout or None).

    With a preset the layout is the preset's (``launch.layout``: its nodes, one trainer task per GPU, fewer on a node
    whose vLLM engines have GPUs of their own), laid out on ``cluster``'s nodes when the stage sets ``fit_nodes``; a
    value the stage sets that differs is an error (the trainer sizes itself from the same preset, so srun must match
    it). Without a preset: 1 node, TP=PP=1 unless set, one task per node (the hf backend's single process)."""
    layout_keys = ("actor_nodes", "tensor_parallel", "pipeline_parallel")
    if not stage.preset:
        return replace(stage, **{k: 1 if getattr(stage, k) is None else getattr(stage, k) for k in layout_keys}), None
    node_gpus = cluster.gpus_per_node if stage.fit_nodes and cluster is not None else None
    try:
        layout = preset_layout(stage.preset, stage.trainer_command, node_gpus)
    except PresetError as err:
        raise LaunchConfigError(f"invalid launch config: {err}") from None
    wanted = dict(zip(layout_keys, (layout.nodes, layout.tensor_parallel, layout.pipeline_parallel), strict=True))
    where = "laid out on the profile's nodes " if layout.fitted_from else ""
    conflicts = [f"{k}={getattr(stage, k)} but preset {stage.preset} {where}has {v}" for k, v in wanted.items()
                 if getattr(stage, k) not in (None, v)]
    if conflicts:
        raise LaunchConfigError("invalid launch config: " + "; ".join(conflicts) + " (leave them unset, or use a preset "
                                f"with that layout: conf/train/{layout.backend}/)")
    return replace(stage, **wanted), layout


def trainer_image(stage: LaunchConfig) -> str:
    """The profile image the trainer step runs: its backend's (``trainer.backend=`` in its command; hf when none)."""
    return TRAINER_IMAGES.get(command_backend(stage.trainer_command) or ("aligner" if stage.preset else "hf"), "trainer")


# ------------------------------------------------------------------------------------------------ server steps
@dataclass(frozen=True)
class Step:
    """One server as the job starts it: where (het group, node of the group, GPU ids), in which image, what, on which
    ports (``(key, stage port)``: the job's are these shifted by its offset, in ``<ENV>_<KEY>``)."""

    name: str
    env: str  # prefix of its shell variables: <ENV>_NODE, <ENV>_HOST, <ENV>_URL, <ENV>_PORT, ...
    group: int
    node: int
    gpu_ids: tuple[int, ...]
    image: str
    command: str
    ports: tuple[tuple[str, int], ...]
    health_key: str  # the port key its health endpoint is on: health_port, else port
    health_path: str  # GET path that answers once it is ready
    ready_deadline_s: int
    srun_flags: tuple[str, ...] = ()  # the site's (launch.site.srun_flags)
    srun_args: tuple[str, ...] = ()  # where its tasks run: node, tasks (set once placed)
    cuda_visible_devices: str | None = None  # set on every server of a group that holds GPUs ("" = none for it)

    @property
    def ready_url(self) -> str:
        """Its readiness URL as the job's shell sees it."""
        return f"http://${{{self.env}_HOST}}:${{{port_var(self.env, self.health_key)}}}{self.health_path}"

    def var(self, key: str) -> str:
        return port_var(self.env, key)


@dataclass(frozen=True)
class Group:
    """A het group of servers: its ``#SBATCH`` line's sizes (the busiest node's tasks, GPUs and memory:
    ``launch.sizing``)."""

    index: int
    title: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    steps: tuple[Step, ...]
    mem: str | None = None  # its --mem (None: none asked)


def _values(stage: LaunchConfig, ckpt_dir: str) -> dict[str, str]:
    values = {k: shlex.quote(str(v)) for k, v in stage.params.items() if v is not None}
    values.update(ckpt_dir=ckpt_dir, preset=stage.preset or "")
    return values


def server_steps(stage: LaunchConfig, cluster: ClusterProfile, ckpt_dir: str,
                 problems: list[str]) -> tuple[list[Group], Step | None]:
    """The reward and judge groups (placed, commands filled and wired) and the critic step.

    A command is filled twice: with the stage's port numbers for the checks and the wiring (which loads each reward
    server's config as it will run), then with the job's port variables for the script."""
    base = _values(stage, ckpt_dir)
    numbered: list[ServerSpec] = []
    for spec in servers(stage):
        values = {**base, **{k: str(p) for k, p in port_keys(spec).items()}, "gpus": str(spec.gpus),
                  "served_model_name": "{served_model_name}"}
        numbered.append(replace(spec, command=fill(spec.command, values, f"server {spec.name!r}", problems)))
    wiring = wire(numbered[: len(stage.reward_servers) + len(stage.judges)])  # the critic serves no reward blocks
    problems += wiring.problems
    problems += port_problems(servers(stage), {s.name: s.command for s in servers(stage)}, cluster.port_range)
    steps: dict[str, Step] = {}
    for spec, checked in zip(servers(stage), numbered, strict=True):
        problems += _serve_ports(spec, checked.command)
        env = envname(spec.name)
        values = {**base, **{k: "${" + port_var(env, k) + "}" for k in port_keys(spec)}, "gpus": str(spec.gpus),
                  "served_model_name": "{served_model_name}"}
        command = fill(spec.command, values, "", [])
        if wiring.overrides.get(spec.name):
            command = f"{command} {' '.join(wiring.overrides[spec.name])}"
        served = wiring.served_model_names.get(spec.name)
        if "{served_model_name}" in command and served is None:
            problems.append(f"server {spec.name!r} uses {{served_model_name}} but serves no judge block with a model")
        command = command.replace("{served_model_name}", shlex.quote(served or ""))
        problems += served_name_problems(spec, command, served)
        steps[spec.name] = Step(spec.name, env, 0, 0, (), spec.image, command, tuple(port_keys(spec).items()),
                                "health_port" if spec.health_port is not None else "port", spec.health_path,
                                spec.ready_deadline_s, tuple(srun_flags(cluster)))
    groups = []
    for index, title, specs in ((1, "factuality reward server(s)", stage.reward_servers),
                                (2, "judges (vLLM, a served general RM)", stage.judges)):
        if not specs:
            continue
        needs = [mem_need(s, stage) for s in specs]
        placed = place(specs, cluster.gpus_per_node, needs, cluster.node_mem_gb)
        nodes = 1 + max(node for node, _ in placed)
        # what the judges (or reward servers) placed on the busiest node use, not the partition's gpus_per_node
        group_gpus = int(busiest([s.gpus for s in specs], placed)) if cluster.gpus_per_node else 0
        group_steps = tuple(replace(steps[s.name], group=index, node=node, gpu_ids=gpus,
                                    cuda_visible_devices=",".join(map(str, gpus)) if group_gpus else None,
                                    srun_args=("--nodes=1", "--ntasks=1", f'--nodelist="${{{steps[s.name].env}_NODE}}"',
                                               "--overlap"))
                            for s, (node, gpus) in zip(specs, placed, strict=True))
        groups.append(Group(index, title, nodes, int(busiest([1] * len(specs), placed)), group_gpus, group_steps,
                            group_mem(needs, placed, stage, cluster)))
        problems += _port_clashes(specs, placed)
    critic = None
    if stage.critic:
        c = stage.critic  # one task per GPU; a critic holding all of a node's GPUs binds each rank to its GPU's NUMA
        flags = srun_flags(cluster, per_gpu_tasks=c.gpus, numa=c.gpus == cluster.gpus_per_node)
        critic = replace(steps[c.name], group=2 + bool(stage.judges), gpu_ids=tuple(range(c.gpus)), srun_flags=tuple(flags),
                         srun_args=(f"--nodes={c.nodes}", f"--ntasks-per-node={c.gpus}", "--kill-on-bad-exit=1",
                                    f"--export=ALL,LOCAL_WORLD_SIZE={c.gpus}"))
    return groups, critic


def _serve_ports(spec: ServerSpec, command: str) -> list[str]:
    """A ``nemo-factuality serve`` must be given every port it binds (``launch.site.serve_port_problems``)."""
    from nemo_factuality.serving.config import ServeConfig

    try:
        invocation = serve_invocation(command)
    except ValueError:  # wiring reports it
        return []
    if invocation is None:
        return []
    keys = [f.name for f in fields(ServeConfig) if f.name.endswith("_port")]
    return serve_port_problems(spec, invocation[1], keys)


def _port_clashes(specs: list[ServerSpec], placed: list[tuple[int, tuple[int, ...]]]) -> list[str]:
    """Servers sharing a node need distinct ports (``port``, ``health_port``)."""
    taken: dict[tuple[int, int], str] = {}
    problems = []
    for spec, (node, _) in zip(specs, placed, strict=True):
        for port in dict.fromkeys(p for p in (spec.port, spec.health_port) if p is not None):
            if (node, port) in taken:
                problems.append(f"servers {taken[node, port]!r} and {spec.name!r} share a node and port {port}")
            taken[node, port] = spec.name
    return problems


# ------------------------------------------------------------------------------------------------ checks
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


def validate(stage: LaunchConfig, cluster: ClusterProfile, layout: PresetLayout | None = None) -> list[str]:
    """Every problem of the resolved stage × profile that does not need the rendered steps (GPUs, servers,
    images, modules); ``layout``: the stage's preset's (``resolve``)."""
    problems = _preset_problems(stage, cluster, layout) if layout is not None else _hf_problems(stage, cluster)
    problems += placeholder_settings(cluster) + binding_problems(cluster)
    if stage.preset:
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
        problems += _server_problems(spec, cluster, is_critic=spec is stage.critic)
    problems += size_problems(stage, cluster, servers(stage))
    if stage.critic and stage.critic.serves:
        problems.append(f"critic {stage.critic.name!r} cannot serve reward blocks (serves: is for reward servers and judges)")
    if len({envname(s.name) for s in servers(stage)}) != len(servers(stage)):
        problems.append("server names must be unique (they name log files and env variables)")
    image = trainer_image(stage)
    if cluster.images and image not in cluster.images:
        build = "`docker build .`" if image == "trainer" else f"`docker build --target {image} .`"
        problems.append(f"the profile's images have no {image!r} (the trainer's; {build})")
    commands = " ".join([stage.trainer_command, stage.ckpt_dir] + [s.command for s in servers(stage)])
    problems += [f"params.{k} is set but no command uses {{{k}}}" for k in stage.params if f"{{{k}}}" not in commands]
    problems += [f"python -m {m}: no such module in this installation of {PACKAGE} (a typo, or a newer version is "
                 "needed)" for m in missing_modules(stage)]
    return problems


def placeholder_settings(cluster: ClusterProfile) -> list[str]:
    """The profile's site settings still holding a placeholder (``account: my_account``): sbatch or pyxis would
    refuse the job only once it is submitted (or a step starts), so rendering refuses it first."""
    settings = {"account": cluster.account, "partition": cluster.partition, "log_root": cluster.log_root,
                "container_workdir": cluster.container_workdir, "vllm_python": cluster.vllm_python,
                **{f"images.{k}": v for k, v in cluster.images.items()},
                **{f"container_mounts[{i}]": v for i, v in enumerate(cluster.container_mounts)}}
    return [f"cluster.{key}={value} is a placeholder: set your site's value (cluster.{key}=... on the command line, "
            "or in the profile's YAML" + ("; null for none)" if key in ("account", "partition") else ")")
            for key, value in settings.items() if isinstance(value, str) and _is_placeholder(key, value)]


def _is_placeholder(key: str, value: str) -> bool:
    if key in ("account", "partition") and _PLACEHOLDER_NAME.fullmatch(value.strip()):
        return True
    return any(_PLACEHOLDER_PART.fullmatch(part.strip()) for part in re.split(r"[/:,]", value))


def _server_problems(spec: ServerSpec, cluster: ClusterProfile, is_critic: bool) -> list[str]:
    problems = []
    if not spec.command.strip():
        problems.append(f"server {spec.name!r} has no command")
    if spec.gpus > cluster.gpus_per_node:
        problems.append(f"server {spec.name!r} asks for {spec.gpus} GPUs; nodes have {cluster.gpus_per_node}")
    if not is_critic and spec.nodes != 1:
        problems.append(f"server {spec.name!r} has nodes={spec.nodes}: a reward server or judge is one task on one node "
                        "(only the critic spans nodes)")
    if cluster.images and spec.image not in cluster.images:
        problems.append(f"server {spec.name!r} runs image {spec.image!r}, which the profile's images "
                        f"({', '.join(sorted(cluster.images))}) do not have")
    if _RUNS_VLLM.search(spec.command) and spec.image in PACKAGE_IMAGES:
        problems.append(f"server {spec.name!r} runs vllm in the {spec.image!r} image, which has no vLLM on its PATH "
                        "(image: judge)")
    return problems


def _hf_problems(stage: LaunchConfig, cluster: ClusterProfile) -> list[str]:
    problems = []
    if not cluster.gpus_per_node and "trainer.device=cuda" in stage.trainer_command:
        problems.append("trainer_command trains on trainer.device=cuda but the profile's nodes have no GPUs (gpus_per_node: 0)")
    if "{preset}" in stage.trainer_command:
        problems.append("trainer_command uses {preset} but the stage names no preset (preset: <a conf/train/aligner or "
                        "conf/train/megatron name>)")
    layout = {"actor_nodes": stage.actor_nodes, "tensor_parallel": stage.tensor_parallel,
              "pipeline_parallel": stage.pipeline_parallel}
    if any(v != 1 for v in layout.values()):
        wrong = ", ".join(f"{k}={v}" for k, v in layout.items() if v != 1)
        problems.append(f"{wrong}: a stage without a preset runs the hf backend, one process on one device; "
                        "multi-GPU training is the aligner and megatron backends' (an aligner_* or megatron_* stage with "
                        "preset: <conf/train/aligner or conf/train/megatron name>)")
    return problems


def _preset_problems(stage: LaunchConfig, cluster: ClusterProfile, layout: PresetLayout) -> list[str]:
    problems = layout_problems(layout, stage.trainer_command, cluster.gpus_per_node)
    if not re.search(r"--preset[= ]\{preset\}(\s|$)", stage.trainer_command):
        problems.append("trainer_command must pass --preset {preset}: the trainer takes its layout (devices, nodes, "
                        "TP/PP, the rollout engines) from the same preset the job is sized from")
    if layout.engines is not None and not cluster.vllm_python and not cluster.images:
        problems.append(f"the trainer's rollouts run on vLLM (rollout.engine=vllm) but cluster.vllm_python is unset and "
                        f"the profile has no images: set it to an interpreter with vLLM (exported as {VLLM_PYTHON_ENV})")
    return problems


# ------------------------------------------------------------------------------------------------ the job
@dataclass(frozen=True)
class JobPlan:
    """A stage on a profile, resolved and checked: what both launch paths (this sbatch script, the NeMo-Run
    experiment) start, in which het group, with which commands, ports and flags."""

    stage_name: str
    stage: LaunchConfig  # resolved (its layout filled in)
    cluster: ClusterProfile
    layout: PresetLayout | None
    ckpt_dir: str  # the trainer's run directory as its steps see it
    ckpt_host_dir: str  # the same directory as the batch script sees it (the host side of its container mount)
    trainer_command: str
    trainer_env: dict[str, object]  # exported to the trainer step only
    trainer_srun_args: tuple[str, ...]  # its srun's tasks and exports
    trainer_flags: tuple[str, ...]  # its srun flags from the site (launch.site.srun_flags)
    groups: tuple[Group, ...]
    critic: Step | None
    ports: JobPorts

    @property
    def steps(self) -> list[Step]:
        """The reward and judge servers, in group order (the critic apart)."""
        return [s for g in self.groups for s in g.steps]

    @property
    def servers(self) -> list[Step]:
        return self.steps + ([self.critic] if self.critic else [])

    @property
    def ready_order(self) -> list[Step]:
        """The order the trainer waits for them in: judges first (a reward server is ready only once every judge it
        calls is), then the reward servers, then the critic."""
        return ([s for s in self.steps if s.group == 2] + [s for s in self.steps if s.group == 1]
                + ([self.critic] if self.critic else []))

    @property
    def backend(self) -> str:
        return self.layout.backend if self.layout else "hf"

    @property
    def tasks_per_node(self) -> int:
        return self.layout.tasks_per_node if self.layout else 1

    @property
    def actor_gpus(self) -> int:
        """GPUs per node the trainer's group asks for (0 on a profile without GPUs)."""
        return (self.layout.gpus_per_node if self.layout else 1) if self.cluster.gpus_per_node else 0

    @property
    def trainer_image(self) -> str:
        return trainer_image(self.stage)


def plan(stage_name: str, stage: LaunchConfig, cluster: ClusterProfile) -> JobPlan:
    """The job of ``stage`` on ``cluster`` (every problem reported at once, in one ``LaunchConfigError``)."""
    require_params(stage_name, stage)
    stage, layout = resolve(stage, cluster)
    problems = validate(stage, cluster, layout)
    try:
        ckpt_dir = stage.ckpt_dir.format(job_name=stage.job_name, ckpt_root=cluster.ckpt_root)
    except (KeyError, IndexError, ValueError) as err:
        raise LaunchConfigError(f"invalid launch config: ckpt_dir={stage.ckpt_dir} may use {{ckpt_root}} and "
                                f"{{job_name}} only ({err})") from None
    problems += ckpt_problems(ckpt_dir, cluster)
    trainer_command = fill(stage.trainer_command, _values(stage, ckpt_dir), "trainer_command", problems)
    groups, critic = server_steps(stage, cluster, ckpt_dir, problems)
    if problems:
        raise LaunchConfigError("invalid launch config: " + "; ".join(dict.fromkeys(problems)))
    gpus = (layout.gpus_per_node if layout else 1) if cluster.gpus_per_node else 0
    if layout is not None and layout.backend == "megatron" and gpus:  # every task sees the node's GPUs: its own and its engines'
        trainer_command = f"export CUDA_VISIBLE_DEVICES={','.join(map(str, range(gpus)))}; {trainer_command}"
    trainer_env: dict[str, object] = {"LOCAL_WORLD_SIZE": layout.tasks_per_node} if layout else {}
    if layout and layout.engines is not None and cluster.vllm_python:
        trainer_env[VLLM_PYTHON_ENV] = cluster.vllm_python
    # the preset stages run one task per GPU; the node is theirs whole when they ask all of its GPUs
    flags = srun_flags(cluster, per_gpu_tasks=layout.tasks_per_node if layout else 0,
                       numa=layout is not None and gpus == cluster.gpus_per_node)
    args = [f"--nodes={stage.actor_nodes}", f"--ntasks-per-node={layout.tasks_per_node if layout else 1}"]
    if layout is not None:  # a dead rank would leave the others blocked in a collective: it ends the step
        args += ["--kill-on-bad-exit=1", "--export=" + ",".join(["ALL"] + [f"{k}={shlex.quote(str(v))}"
                                                                        for k, v in trainer_env.items()])]
    every_port = [p for spec in servers(stage) for p in port_keys(spec).values()]
    return JobPlan(stage_name, stage, cluster, layout, ckpt_dir, ckpt_host_dir(ckpt_dir, cluster), trainer_command,
                   trainer_env, tuple(args), tuple(flags), tuple(groups), critic,
                   JobPorts.of(every_port, cluster.port_range))


def template_env() -> jinja2.Environment:
    """The Jinja environment of ``slurm/`` (both launch paths render from it)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda s: shlex.quote(str(s))
    return env


def template_context(job: JobPlan, **extra: object) -> dict[str, object]:
    """What the templates read (``slurm/job_lib.sh.j2``'s macros and the two scripts)."""
    layout = job.layout
    return dict(
        job=job, stage_name=job.stage_name, stage=asdict(job.stage), cluster=asdict(job.cluster), ckpt_dir=job.ckpt_dir,
        trainer_command=job.trainer_command, actor_tasks_per_node=job.tasks_per_node, actor_gpus=job.actor_gpus,
        groups=job.groups, steps=job.steps, critic=job.critic, critic_nodes=job.stage.critic.nodes if job.critic else 0,
        critic_mem=group_mem([mem_need(job.stage.critic, job.stage)], [(0, ())], job.stage, job.cluster)
        if job.critic else None,
        has_gpus=bool(job.cluster.gpus_per_node), trainer_image=job.trainer_image, package_images=PACKAGE_IMAGES,
        exit_codes=exit_codes, backend=job.backend, trainer_env=job.trainer_env, engines=layout.engines if layout else None,
        gpu_split=gpu_split_lines(layout) if job.backend == "megatron" else [], **extra)


def render(stage_name: str, stage: LaunchConfig, cluster: ClusterProfile) -> str:
    """The sbatch script text (every problem reported at once, in one ``LaunchConfigError``, before rendering)."""
    job = plan(stage_name, stage, cluster)
    pid_index = {s.name: i for i, s in enumerate(job.servers)}  # SERVER_PIDS order
    return template_env().get_template("het_job.sbatch.j2").render(**template_context(job, pid_index=pid_index))


def write_script(text: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    out.chmod(0o755)
    return out
