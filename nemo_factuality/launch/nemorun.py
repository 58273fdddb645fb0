"""``nemo-factuality launch STAGE --via nemo-run``: the job the sbatch path renders (``launch.render.plan``), built as a
NeMo-Run ``Experiment`` of heterogeneous ``SlurmExecutor``\\ s and submitted through ``run.LocalTunnel``.

One NeMo-Run task per component: task 0 the trainer (het group 0), then every reward server and judge in its het
group (``het_group_indices``: servers of one group share its ``#SBATCH`` block, each its own srun on its node), then
the critic. What the sbatch path does around its steps comes from the same template macros (``slurm/job_lib.sh.j2``):
NeMo-Run's ``setup_lines`` carry the environment, restart guard, host discovery and per-job ports, the USR1 trap and
the exit-75 requeue (``slurm/nemo_run_setup.sh.j2``); each task is a script (``slurm/nemo_run_task.sh.j2``) that logs
to the component's log and, for the trainer, first waits for every server in the same order.

What NeMo-Run 0.11.1 does differently, and why this still is the same job:

* It starts every srun at once (the trainer first) and ends the job when the first one ends: the trainer's task waits
  for the servers itself, and a server that dies ends the job with its code (NeMo-Run's monitor loop).
* It writes one set of ``#SBATCH`` flags for every het group but nodes, tasks and GPUs per node: each group asks the
  trainer's ``--mem`` (the profile's ``mem``) and ``--cpus-per-task``; the sbatch path sizes each server group's memory
  (``launch.sizing``). A group without GPUs asks ``--gpus-per-node=0`` on a GPU profile.
* Its container steps run in ``/nemo_run/code`` (the experiment folder, mounted): each task changes to the profile's
  ``container_workdir`` (bare metal: the submit directory) before its command, as the sbatch path's steps start there.
* Its requeue on any failure is off (``retries=0``); the trap requeues on exit 75 / ``REQUEUE`` like the sbatch path.

NeMo-Run is imported only here, only for this path: it is not in the project's venv (its torchx pins
``urllib3<1.27`` and leptonai ``httpx==0.27.2``/``anyio<=4.9``); ``tools/setup_stack_env.sh nemorun`` builds a venv
with it and the launcher's own dependencies (``requirements/nemorun.txt``).
"""

from __future__ import annotations

import logging
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nemo_factuality.launch.layout import PACKAGE_IMAGES
from nemo_factuality.launch.render import JobPlan, LaunchConfigError, Step, template_context, template_env
from nemo_factuality.launch.site import mount_problems

log = logging.getLogger(__name__)

NEMO_RUN_VERSION = "0.11.1"  # what this module is written and tested against (requirements/nemorun.txt)
MONITOR_INTERVAL_S = 2  # NeMo-Run's monitor loop sleeps this between checks: a USR1 waits at most this for the trap


class SubmitFailed(RuntimeError):
    """NeMo-Run's ``sbatch`` failed: its exit code and what it said."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Task:
    """One NeMo-Run task: which het group it runs in, with which resources and srun arguments, what script."""

    name: str
    group: int
    nodes: int
    tasks_per_node: int
    gpus_per_node: int | None
    image: str
    srun_args: tuple[str, ...]
    script: str


def require_nemo_run():
    """The ``nemo_run`` module, or one line saying how to get it."""
    try:
        import nemo_run
    except ImportError:
        raise LaunchConfigError(
            f"--via nemo-run needs nemo-run {NEMO_RUN_VERSION} in this interpreter, which this project's venv leaves out "
            "(its torchx pins urllib3<1.27): build a venv with it, `bash tools/setup_stack_env.sh nemorun`, and run "
            "`<that venv>/bin/python -m nemo_factuality.cli launch ...` with the checkout on PYTHONPATH, or "
            f"`pip install nemo-run=={NEMO_RUN_VERSION}` into an environment of your own") from None
    version = getattr(nemo_run, "__version__", "unknown")
    if version != NEMO_RUN_VERSION:
        log.warning("nemo-run %s is installed; --via nemo-run is written and tested against %s (its het-job script's "
                    "setup_lines and pids[]): check the --dry-run script", version, NEMO_RUN_VERSION)
    return nemo_run


def _workdir(job: JobPlan, image: str) -> str | None:
    """Where a task's command starts, as the sbatch path's step would: the submit directory on bare metal, the
    profile's container_workdir in a package image, the image's own directory otherwise (NeMo-Run's is its own)."""
    cluster = job.cluster
    if not cluster.images:
        return '"$SLURM_SUBMIT_DIR"'
    if cluster.container_workdir and image in PACKAGE_IMAGES:
        return shlex.quote(cluster.container_workdir)
    return None


def tasks(job: JobPlan) -> list[Task]:
    """The trainer, every server of the reward and judge groups, the critic: NeMo-Run's tasks, in het group order."""
    env = template_env().get_template("nemo_run_task.sh.j2")
    context = template_context(job)
    pyxis = ("--no-container-mount-home",) if job.cluster.images else ()

    def script(name: str, command: str, image: str, *, trainer: bool = False, cuda: str | None = None) -> str:
        return env.render(**context, task_name=name, command=command, trainer=trainer, workdir=_workdir(job, image),
                          cuda_visible_devices=cuda)

    out = [Task("trainer", 0, job.stage.actor_nodes, job.tasks_per_node, job.actor_gpus or None, job.trainer_image,
                job.trainer_srun_args + job.trainer_flags + pyxis,
                script("trainer", job.trainer_command, job.trainer_image, trainer=True))]
    for group in job.groups:
        out += [_server_task(s, group.nodes, group.tasks_per_node, group.gpus_per_node if job.actor_gpus else None,
                             pyxis, script(s.name, s.command, s.image, cuda=s.cuda_visible_devices)) for s in group.steps]
    if job.critic:
        c = job.critic
        out.append(_server_task(c, job.stage.critic.nodes, len(c.gpu_ids), len(c.gpu_ids), pyxis,
                                script(c.name, c.command, c.image)))
    return out


def _server_task(step: Step, nodes: int, tasks_per_node: int, gpus: int | None, pyxis: tuple[str, ...],
                 script: str) -> Task:
    return Task(step.name, step.group, nodes, tasks_per_node, gpus, step.image, step.srun_args + step.srun_flags + pyxis,
                script)


def path_problems(job: JobPlan) -> list[str]:
    """What the NeMo-Run path needs beyond the job itself: its tasks log from inside their containers."""
    return mount_problems(job.cluster.log_root, job.cluster, key="cluster.log_root", what="the components' logs",
                          lost="NeMo-Run's tasks write them from inside the container",
                          fix="set cluster.log_root to a path under a writable mount")


def build(run, job: JobPlan, experiments_dir: Path):
    """(the tasks, one ``SlurmExecutor`` per task) of ``job``, with a ``LocalTunnel`` whose job folder is
    ``experiments_dir`` (the Experiment's ``<base_dir>/experiments``: on a filesystem the compute nodes see)."""
    found = path_problems(job)
    if found:
        raise LaunchConfigError("invalid launch config: " + "; ".join(found))
    from nemo_run.core.execution.slurm import SlurmJobDetails

    cluster, stage = job.cluster, job.stage
    setup = template_env().get_template("nemo_run_setup.sh.j2").render(**template_context(job))
    todo = tasks(job)
    tunnel = run.LocalTunnel(job_dir=str(experiments_dir))
    executors = []
    for i, task in enumerate(todo):
        executor = run.SlurmExecutor(
            account=cluster.account, partition=cluster.partition, time=cluster.time_limit,
            cpus_per_task=cluster.cpus_per_task, mem=cluster.mem, nodes=task.nodes, ntasks_per_node=task.tasks_per_node,
            gpus_per_node=task.gpus_per_node, container_image=cluster.images.get(task.image) if cluster.images else None,
            container_mounts=list(cluster.container_mounts), srun_args=list(task.srun_args), tunnel=tunnel,
            packager=run.Packager(), retries=0, job_name_prefix=f"{stage.job_name}.",
            job_details=SlurmJobDetails(job_name=stage.job_name if i == 0 else f"{stage.job_name}.{task.name}",
                                            folder=str(Path(cluster.log_root).absolute())),
            poll_estimated_start_time=False)
        executors.append(executor)
    main = executors[0]
    main.heterogeneous = True
    main.het_group_indices = [t.group for t in todo]
    main.signal = f"B:USR1@{stage.signal_before_end_s}"
    main.setup_lines = setup
    main.wait_time_for_group_job = 0
    main.monitor_group_job_wait_time = MONITOR_INTERVAL_S
    scripts = [run.Script(inline=t.script) for t in todo]
    return scripts, executors


def experiment_root(job: JobPlan) -> Path:
    """Where a submitted experiment lives: beside the component logs (compute nodes read its task scripts)."""
    return Path(job.cluster.log_root).absolute() / "nemo-run"  # not ".../nemo_run": NeMo-Run rewrites "/nemo_run"


def dry_run(job: JobPlan, out: Path) -> str:
    """What NeMo-Run would submit: its het-job script (written to ``out``) followed by each task's script. Only ``out``
    is written: NeMo-Run's experiment folder is a temporary one."""
    run = require_nemo_run()
    root = experiment_root(job)
    with tempfile.TemporaryDirectory(prefix="nemo-run-dryrun-") as tmp:
        scripts, executors = build(run, job, root / "experiments")
        with run.Experiment(job.stage.job_name, base_dir=tmp, clean_mode=True, enable_goodbye_message=False) as exp:
            exp.add(scripts, executor=executors, name=job.stage.job_name)
            exp.dryrun(log=False, delete_exp_dir=False)
        sbatch = next(Path(tmp).rglob("*_sbatch.sh"))
        parts = [f"# NeMo-Run {NEMO_RUN_VERSION} submits: sbatch --requeue --parsable "
                 f"{root / 'experiments' / job.stage.job_name / '<experiment id>' / sbatch.name}",
                 sbatch.read_text(encoding="utf-8")]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(parts[1], encoding="utf-8")
        for path in sorted(Path(tmp).rglob("scripts/*.sh")):
            parts += [f"# ---------- task script {path.name} (NeMo-Run runs it with bash in its srun) ----------",
                      path.read_text(encoding="utf-8")]
    return "\n".join(parts)


def submit(job: JobPlan) -> tuple[str, Path]:
    """Submit ``job`` through NeMo-Run (``sbatch`` on this machine, ``LocalTunnel``); (the Slurm job id, the folder of
    the stage's NeMo-Run experiments)."""
    run = require_nemo_run()
    root = experiment_root(job)
    scripts, executors = build(run, job, root / "experiments")
    Path(job.cluster.log_root).mkdir(parents=True, exist_ok=True)
    from invoke.exceptions import UnexpectedExit  # what NeMo-Run's tunnel raises when sbatch fails

    with run.Experiment(job.stage.job_name, base_dir=str(root), clean_mode=True, enable_goodbye_message=False,
                        skip_status_at_exit=True) as exp:
        group = exp.add(scripts, executor=executors, name=job.stage.job_name)
        try:
            exp.run(detach=True)
        except UnexpectedExit as err:
            said = (err.result.stderr or err.result.stdout or "").strip().splitlines()
            raise SubmitFailed(err.result.exited or 1, " / ".join(line.strip() for line in said)) from None
        handle = next(j for j in exp.jobs if j.id == group).handle
    return handle.rstrip("/").rsplit("/", 1)[-1], root / "experiments" / job.stage.job_name
