"""How big each server het group is: the node of the group each server runs on, its GPUs there, and what the group's
``#SBATCH`` line asks per node (``--gpus-per-node``, ``--mem``), all derived from the servers the stage declares.

* GPUs: first fit in order, a node's GPUs split between its servers; the group asks for its busiest node's sum
  (one het group asks the same of each of its nodes), never the partition's ``gpus_per_node``.
* Memory: a server needs its ``mem_gb``, or the stage's ``cpu_server_mem_gb`` when it holds no GPUs. A group whose
  servers' needs are all known asks for its busiest node's sum times ``1 + server_mem_headroom`` (at most the node's
  ``node_mem_gb``, when the profile knows it); a group with a GPU server that declares none asks for the profile's
  ``mem``, since a vLLM judge's host memory follows its model, which the launcher cannot see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nemo_factuality.launch.config import ClusterProfile, LaunchConfig, ServerSpec

MIB_PER_GIB = 1024  # Slurm's --mem units (M, G) are binary: 1G = 1024M


def mem_need(spec: ServerSpec, stage: LaunchConfig) -> float | None:
    """GiB of host memory ``spec`` needs on its node; None: unknown (a server with GPUs that declares no mem_gb)."""
    if spec.mem_gb is not None:
        return spec.mem_gb
    return stage.cpu_server_mem_gb if not spec.gpus else None


def place(specs: Sequence[ServerSpec], gpus_per_node: int, mem_gb: Sequence[float | None] | None = None,
          node_mem_gb: float | None = None) -> list[tuple[int, tuple[int, ...]]]:
    """``(node, GPU ids)`` per server, first fit in order: a node's GPUs are split between its servers, never shared,
    and, when the node's memory is known, its servers' ``mem_gb`` (GiB, one per spec; None counts as 0) fit in it.
    A server too big for any node gets a node of its own (``size_problems`` names it).

    >>> [p for p in place([ServerSpec(gpus=4), ServerSpec(gpus=4), ServerSpec(gpus=2)], 8)]
    [(0, (0, 1, 2, 3)), (0, (4, 5, 6, 7)), (1, (0, 1))]
    >>> place([ServerSpec(), ServerSpec(), ServerSpec()], 0, [10, 10, 5], node_mem_gb=16)
    [(0, ()), (1, ()), (0, ())]
    """
    mems = [m or 0.0 for m in (mem_gb if mem_gb is not None else [None] * len(specs))]
    used_gpus: list[int] = []
    used_mem: list[float] = []
    out = []
    for spec, mem in zip(specs, mems, strict=True):
        node = next((i for i, (g, m) in enumerate(zip(used_gpus, used_mem, strict=True))
                     if g + spec.gpus <= gpus_per_node and (node_mem_gb is None or m + mem <= node_mem_gb)), None)
        if node is None:
            used_gpus.append(0)
            used_mem.append(0.0)
            node = len(used_gpus) - 1
        out.append((node, tuple(range(used_gpus[node], used_gpus[node] + spec.gpus))))
        used_gpus[node] += spec.gpus
        used_mem[node] += mem
    return out


def busiest(values: Sequence[float], placed: Sequence[tuple[int, tuple[int, ...]]]) -> float:
    """The largest per-node sum of ``values`` (one per placed server) over the group's nodes."""
    per_node: dict[int, float] = {}
    for value, (node, _) in zip(values, placed, strict=True):
        per_node[node] = per_node.get(node, 0) + value
    return max(per_node.values(), default=0)


def group_mem(needs: Sequence[float | None], placed: Sequence[tuple[int, tuple[int, ...]]], stage: LaunchConfig,
              cluster: ClusterProfile) -> str | None:
    """The group's ``--mem`` value: its busiest node's needs plus headroom, in whole MiB (``20G``, ``1280M``), capped
    at the node's memory when the profile knows it; the profile's ``mem`` when a need is unknown."""
    if not needs or any(n is None for n in needs):
        return cluster.mem
    # round() first: 0.1 GiB x 1.25 x 1024 is 128.00000000000003 in floating point, which is 128 MiB, not 129
    mib = math.ceil(round(busiest(needs, placed) * (1 + stage.server_mem_headroom) * MIB_PER_GIB, 6))
    if cluster.node_mem_gb is not None:
        mib = min(mib, math.floor(cluster.node_mem_gb * MIB_PER_GIB))
    return f"{mib // MIB_PER_GIB}G" if mib % MIB_PER_GIB == 0 else f"{mib}M"


def size_problems(stage: LaunchConfig, cluster: ClusterProfile, specs: Sequence[ServerSpec]) -> list[str]:
    """Memory sizes no job can have: a zero or negative one (``--mem=0`` would ask Slurm for the whole node), a
    negative headroom, a server needing more than the profile's nodes have."""
    problems = []
    if stage.cpu_server_mem_gb <= 0:
        problems.append(f"cpu_server_mem_gb={stage.cpu_server_mem_gb:g}: give the GiB a server without GPUs needs "
                        "(> 0; --mem=0 would ask Slurm for a whole node's memory)")
    if stage.server_mem_headroom < 0:
        problems.append(f"server_mem_headroom={stage.server_mem_headroom:g} must be >= 0 (0.25 = a quarter more than "
                        "the servers declare)")
    for spec in specs:
        if spec.mem_gb is not None and spec.mem_gb <= 0:
            problems.append(f"server {spec.name!r} has mem_gb={spec.mem_gb:g}: give the GiB it needs (> 0; --mem=0 would "
                            "ask Slurm for a whole node's memory), or leave it unset")
            continue
        need = mem_need(spec, stage)
        if need is not None and cluster.node_mem_gb is not None and need > cluster.node_mem_gb:
            source = "mem_gb" if spec.mem_gb is not None else "cpu_server_mem_gb, its default without GPUs"
            problems.append(f"server {spec.name!r} needs {need:g} GiB of memory ({source}) but the profile's nodes have "
                            f"{cluster.node_mem_gb:g} GiB (node_mem_gb)")
    return problems
