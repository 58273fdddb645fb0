"""What makes one rendered job fit the site it runs on, beside its GPUs (``launch.layout``, ``launch.sizing``): where
its checkpoints go, which ports its servers listen on, and the ``srun`` flags each step needs.

* **Checkpoints.** The trainer's run directory is the stage's ``ckpt_dir`` (default ``{ckpt_root}/{job_name}``, the
  root from the cluster profile). In a container (a profile with ``images``) it must lie under one of the profile's
  ``container_mounts``, writable: anything else is the container's own filesystem, thrown away when the step ends, so
  a requeued job would start over. The batch script itself runs on the host, so it reads the trainer's ``REQUEUE``
  file at the mount's host path.
* **Ports per job.** Two jobs sharing a node must not listen on the same ports, so each job takes a block of the
  profile's ``port_range`` of its own, chosen from ``SLURM_JOB_ID`` at run time: a stage port ``p`` becomes
  ``lo + (p − p_min) + (SLURM_JOB_ID mod blocks) × stride``, with ``stride`` the span of the stage's ports (two blocks
  never overlap) and ``blocks`` as many as fit in the range. Two jobs collide only when their ids agree modulo
  ``blocks`` (hundreds for the shipped stages). Servers and clients agree because both read the same variables,
  exported once by the batch script (``<NAME>_PORT``, ``<NAME>_HEALTH_PORT``, ``<NAME>_<KEY>`` and the URLs built
  from them); a server's command names its ports as ``{port}``, ``{health_port}`` and ``{<key>}`` (its ``ports:``),
  never as numbers. (NeMo-RL's ``ray.sub`` and NeMo-Run's torchrun launcher use fixed ports — 54514, 49450, … —
  and whole nodes, ``#SBATCH --exclusive``; the common ``10000 + last digits of the job id`` idiom is this with
  blocks of one port.)
* **srun flags.** ``--cpus-per-task`` on every step (Slurm 22.05–23.02's srun does not inherit sbatch's), and on the
  steps with one task per GPU (trainer, critic) ``--gpu-bind=none`` — each rank takes GPU ``LOCAL_RANK`` itself and a
  rank's vLLM engine needs its replica's other GPUs, so Slurm must not narrow what a task sees — with each rank's CPUs
  and memory on its GPU's NUMA node (``--cpu-bind=map_ldom:…``, ``--mem-bind=local``) when the profile says where its
  GPUs sit (``gpu_numa_nodes``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

from nemo_factuality.launch.config import ClusterProfile, ServerSpec


# ------------------------------------------------------------------------------------------------ checkpoints
@dataclass(frozen=True)
class Mount:
    """One pyxis ``--container-mounts`` entry: ``SRC[:DST[:FLAGS]]``."""

    source: str
    target: str
    read_only: bool

    @classmethod
    def parse(cls, entry: str) -> Mount:
        parts = entry.split(":")
        flags = parts[2].split("+") if len(parts) > 2 else []
        return cls(parts[0], parts[1] if len(parts) > 1 else parts[0], "ro" in flags)


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ('' for root itself), or None when it is not inside it."""
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    if path == root:
        return ""
    return path[len(root.rstrip("/")) + 1:] if path.startswith(root.rstrip("/") + "/") else None


def ckpt_host_dir(ckpt_dir: str, cluster: ClusterProfile) -> str:
    """Where the batch script (on the host) finds the trainer's ``ckpt_dir`` (a path in its container)."""
    if not cluster.images:
        return ckpt_dir
    for mount in map(Mount.parse, reversed(cluster.container_mounts)):  # pyxis: a later mount shadows an earlier one
        rest = _under(ckpt_dir, mount.target)
        if rest is not None:
            return posixpath.join(mount.source, rest) if rest else mount.source
    return ckpt_dir


def ckpt_problems(ckpt_dir: str, cluster: ClusterProfile) -> list[str]:
    """Why checkpoints written to ``ckpt_dir`` would not outlive the step (one line, naming the keys to change)."""
    return mount_problems(ckpt_dir, cluster, key="ckpt_dir", what="its checkpoints", lost="a requeue would start over",
                          fix="set cluster.ckpt_root (or ckpt_dir=) to a path under a writable mount")


def mount_problems(path: str, cluster: ClusterProfile, *, key: str, what: str, lost: str, fix: str) -> list[str]:
    """Why ``path``, written from inside a step's container, would not reach the host: not under a writable mount."""
    if not cluster.images:
        return []
    fix = f"{fix}, or add its filesystem to cluster.container_mounts"
    mounts = [Mount.parse(m) for m in cluster.container_mounts]
    holders = [m for m in reversed(mounts) if _under(path, m.target) is not None] if posixpath.isabs(path) else []
    if not holders:
        listed = ", ".join(cluster.container_mounts) or "none"
        return [f"{key}={path} is not under any of the profile's container_mounts ({listed}): the step would write "
                f"{what} into the container's own filesystem, lost when the step ends ({lost}); {fix}"]
    if holders[0].read_only:
        return [f"{key}={path} is under the read-only container mount {holders[0].source}:{holders[0].target} (:ro): "
                f"the step could not write {what}; {fix}"]
    return []


# ------------------------------------------------------------------------------------------------ ports
def port_keys(spec: ServerSpec) -> dict[str, int]:
    """Every port ``spec`` listens on, by the placeholder its command names it with: ``port``, ``health_port`` (when
    set) and its ``ports:``."""
    keys = {"port": spec.port}
    if spec.health_port is not None:
        keys["health_port"] = spec.health_port
    keys.update(spec.ports)
    return keys


def port_var(env: str, key: str) -> str:
    """The variable holding a server's port in the job (``FACTUALITY_REWARD`` + ``health_port`` ->
    ``FACTUALITY_REWARD_HEALTH_PORT``; ``port`` -> ``FACTUALITY_REWARD_PORT``)."""
    return f"{env}_{key.upper()}"


@dataclass(frozen=True)
class JobPorts:
    """How a job's ports are found from the stage's: ``p + (lo - lowest) + (SLURM_JOB_ID % blocks) * stride``.

    >>> ports = JobPorts.of([5555, 5556, 5580], (10000, 20000))
    >>> ports.offset_expr, ports.port(5580, job_id=1)
    ('$(( 4445 + (SLURM_JOB_ID % 384) * 26 ))', 10051)
    """

    base: int  # lo - the stage's lowest port
    stride: int
    blocks: int

    @classmethod
    def of(cls, ports: Sequence[int], port_range: Sequence[int]) -> JobPorts:
        lo, hi = port_range
        stride = max(ports) - min(ports) + 1
        return cls(lo - min(ports), stride, (hi - lo) // stride)

    @property
    def offset_expr(self) -> str:
        return f"$(( {self.base} + (SLURM_JOB_ID % {self.blocks}) * {self.stride} ))"

    def port(self, stage_port: int, job_id: int) -> int:
        return stage_port + self.base + job_id % self.blocks * self.stride


def port_problems(specs: Sequence[ServerSpec], commands: dict[str, str], port_range: Sequence[int]) -> list[str]:
    """Ports that cannot be moved per job: a range that holds no block of the stage's ports, or a port written into a
    command as a number (``commands``: each server's command as the stage gives it, placeholders unfilled)."""
    problems = []
    if len(port_range) != 2 or not 1024 <= port_range[0] < port_range[1] <= 65536:
        return [f"cluster.port_range={list(port_range)}: give [lo, hi] with 1024 <= lo < hi <= 65536 (ports the site "
                "leaves free on its compute nodes)"]
    ports = [p for spec in specs for p in port_keys(spec).values()]
    if ports and max(ports) - min(ports) + 1 > port_range[1] - port_range[0]:
        problems.append(f"the stage's ports span {min(ports)}-{max(ports)}, more than cluster.port_range={list(port_range)} "
                        "holds: number the servers' ports closer together (only their spacing matters), or widen the range")
    for spec in specs:
        for key, port in port_keys(spec).items():
            if re.search(rf"(?<![\w.]){port}(?![\w.])", commands.get(spec.name, "")):
                problems.append(f"server {spec.name!r}'s command names its {key} {port} as a number: write {{{key}}} "
                                f"(each job listens on ports of its own, moved from the stage's by its job id)")
    return problems


def serve_port_problems(spec: ServerSpec, overrides: Sequence[str], serve_ports: Sequence[str]) -> list[str]:
    """A ``nemo-factuality serve`` binds every one of ``serve_ports`` (ServeConfig's ``*_port`` keys): each must be set
    on its command from a declared port, else it binds its fixed default on a node another job may share."""
    given = {o.split("=", 1)[0] for o in overrides}
    missing = [key for key in serve_ports if key not in given]
    if not missing:
        return []
    words = " ".join(f"{k}={{{k}}}" for k in missing)
    return [f"server {spec.name!r} runs nemo-factuality serve without {', '.join(missing)}: it would bind the fixed "
            f"default(s) on a node another job may share; pass {words} and declare them under its ports:"]


# ------------------------------------------------------------------------------------------------ srun flags
def srun_flags(cluster: ClusterProfile, *, per_gpu_tasks: int = 0, numa: bool = False) -> list[str]:
    """Flags for one step's ``srun``: ``--cpus-per-task`` always (when the profile sets it); for a step of
    ``per_gpu_tasks`` tasks per node, one per GPU, ``--gpu-bind=none`` and — with ``numa`` (the step holds all of its
    nodes' GPUs, so local task i trains on GPU i) and the profile's ``gpu_numa_nodes`` — task i's CPUs and memory on
    GPU i's NUMA node.

    >>> srun_flags(ClusterProfile(cpus_per_task=16, gpus_per_node=4, gpu_numa_nodes=[0, 0, 1, 1]), per_gpu_tasks=4,
    ...            numa=True)
    ['--cpus-per-task=16', '--gpu-bind=none', '--cpu-bind=map_ldom:0,0,1,1', '--mem-bind=local']
    """
    flags = [f"--cpus-per-task={cluster.cpus_per_task}"] if cluster.cpus_per_task else []
    if per_gpu_tasks and cluster.gpus_per_node:
        flags.append("--gpu-bind=none")
        if numa and cluster.gpu_numa_nodes:
            flags += [f"--cpu-bind=map_ldom:{','.join(str(n) for n in cluster.gpu_numa_nodes[:per_gpu_tasks])}",
                      "--mem-bind=local"]
    return flags


def binding_problems(cluster: ClusterProfile) -> list[str]:
    if cluster.gpu_numa_nodes and len(cluster.gpu_numa_nodes) != cluster.gpus_per_node:
        return [f"cluster.gpu_numa_nodes lists {len(cluster.gpu_numa_nodes)} GPUs but gpus_per_node is "
                f"{cluster.gpus_per_node}: give the NUMA node of each GPU 0..{cluster.gpus_per_node - 1} (nvidia-smi "
                "topo -m, column 'NUMA Affinity')"]
    if cluster.cpus_per_task is not None and cluster.cpus_per_task < 1:
        return [f"cluster.cpus_per_task={cluster.cpus_per_task} must be >= 1 (or null: the site's default)"]
    return []
