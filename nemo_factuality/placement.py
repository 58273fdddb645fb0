"""Where a training job's processes sit on a node's GPUs: one trainer rank per GPU and one vLLM rollout engine per
model replica (``rollout.engine=vllm``), ``colocated`` with its replica or on GPUs of its ``separate`` own.

Pure arithmetic on integers, shared by the launcher (the GPU split it writes into the rendered job and the tasks per
node it asks Slurm for) and the trainer (the ``CUDA_VISIBLE_DEVICES`` it gives each engine process), so the job that
is rendered and the engines that are started cannot disagree.

Ranks follow Megatron-Core's default order (``tp-cp-ep-dp-pp``, no context or expert parallelism): global rank
``r = tp + TP·dp + TP·DP·pp``, laid out node by node (srun's block distribution, torchrun's ``--nnodes``): node
``r // tasks_per_node``, local rank (= the GPU index it trains on) ``r % tasks_per_node``. A replica's source rank
(tp = pp = 0, the lowest rank of its model-parallel group) starts its engine (``trainers/engines/vllm_rollout.py``).

* ``colocated``: every GPU of the node trains; the engine shares the first ``engine_tp`` GPUs of its replica's
  tensor-parallel block (``gpu_memory_utilization`` of each: the presets count it in their memory arithmetic).
* ``separate``: a node holds ``r`` whole replicas (``TP`` GPUs each, PP = 1) and their ``r`` engines (``engine_tp``
  GPUs each) on GPUs of their own: the trainer ranks take GPUs ``0 … r·TP − 1``, the engines the next ``r·engine_tp``.

>>> engine_gpus(2, world=8, placement="separate", tasks_per_node=4, gpus_per_node=8, tensor=2, pipeline=1, engine_tp=2)
(6, 7)
>>> engine_gpus(0, world=16, placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=8, pipeline=1, engine_tp=8)
(0, 1, 2, 3, 4, 5, 6, 7)
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("colocated", "separate")


def trainer_tasks_per_node(placement: str, *, gpus_per_node: int, tensor: int, pipeline: int, engine_tp: int) -> int:
    """Trainer ranks (one per GPU) a node runs: all its GPUs colocated; with separate engines as many whole replicas
    as fit beside their engines (``gpus_per_node // (TP + engine_tp)`` replicas of TP GPUs)."""
    if placement == "colocated":
        return gpus_per_node
    return gpus_per_node // (tensor * pipeline + engine_tp) * tensor * pipeline


def layout_problems(placement: str, *, tasks_per_node: int, gpus_per_node: int, tensor: int, pipeline: int,
                    engine_tp: int, key: str = "rollout.vllm") -> list[str]:
    """Why engines of ``engine_tp`` GPUs cannot be placed this way (each a setting to change); empty when they can."""
    if placement not in PLACEMENTS:
        return [f"{key}.placement={placement!r} (choose one of {', '.join(PLACEMENTS)})"]
    if engine_tp < 1:
        return [f"{key}.tensor_parallel_size must be >= 1, got {engine_tp}"]
    if placement == "colocated":
        if tasks_per_node % tensor and tensor % tasks_per_node:
            return [f"{key}: model.tensor_model_parallel_size={tensor} splits replicas across the node boundary of "
                    f"{tasks_per_node} ranks; use a TP that divides (or is a multiple of) the GPUs per node"]
        own = min(tensor, tasks_per_node)  # the replica's tensor-parallel GPUs on its source's node
        if engine_tp > own:
            return [f"{key}.tensor_parallel_size={engine_tp}: a colocated engine shares its replica's GPUs on one node, "
                    f"{own} here (model.tensor_model_parallel_size={tensor}); use at most {own} or placement=separate"]
        return []
    if pipeline != 1:
        return [f"{key}.placement=separate needs model.pipeline_model_parallel_size=1 (a replica's ranks must sit on one "
                f"node beside its engine), got {pipeline}; use placement=colocated"]
    if tasks_per_node % tensor:
        return [f"{key}.placement=separate: {tasks_per_node} trainer ranks per node do not hold whole replicas of "
                f"model.tensor_model_parallel_size={tensor}"]
    need = tasks_per_node + tasks_per_node // tensor * engine_tp
    if tasks_per_node < tensor or need > gpus_per_node:
        return [f"{key}.placement=separate: {tasks_per_node // tensor} replica(s) of {tensor} GPU(s) and their engines "
                f"of {engine_tp} need {max(need, tensor + engine_tp)} GPUs per node, the node has {gpus_per_node}; "
                "use placement=colocated or a smaller model.tensor_model_parallel_size / tensor_parallel_size"]
    return []


def is_replica_source(rank: int, *, tensor: int, data: int) -> bool:
    """Whether global ``rank`` is its replica's source (tp = 0, pp = 0 in Megatron's order): it starts the engine."""
    return rank % tensor == 0 and rank < tensor * data


def engine_gpus(rank: int, *, world: int, placement: str, tasks_per_node: int, gpus_per_node: int, tensor: int,
                pipeline: int, engine_tp: int) -> tuple[int, ...]:
    """GPU indices on its node of the engine that global trainer ``rank`` of ``world`` starts (a replica source's;
    ``()`` for any other rank). Raises ``ValueError`` with ``layout_problems``' words for a layout that cannot place
    it."""
    problems = layout_problems(placement, tasks_per_node=tasks_per_node, gpus_per_node=gpus_per_node, tensor=tensor,
                               pipeline=pipeline, engine_tp=engine_tp)
    if problems:
        raise ValueError("; ".join(problems))
    if not is_replica_source(rank, tensor=tensor, data=world // (tensor * pipeline)):
        return ()
    local = rank % tasks_per_node  # a source opens a TP block: its replica's GPUs on this node start here
    if placement == "colocated":
        return tuple(range(local, local + engine_tp))
    first = tasks_per_node + local // tensor * engine_tp  # the node's spare GPUs, one slice per replica in rank order
    return tuple(range(first, first + engine_tp))


@dataclass(frozen=True)
class EngineSlot:
    """One engine of a node: the replica it serves, the trainer rank that starts it and its GPUs on the node."""

    replica: int
    rank: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class NodeSplit:
    """One node of the trainer's het group: its trainer ranks (local rank i on GPU i) and its engines."""

    node: int
    ranks: tuple[int, ...]
    engines: tuple[EngineSlot, ...]


def node_splits(*, nodes: int, placement: str, tasks_per_node: int, gpus_per_node: int, tensor: int, pipeline: int,
                engine_tp: int) -> list[NodeSplit]:
    """The whole job's split, node by node (what the launcher writes out; the trainer computes its own rank's part
    with ``engine_gpus``)."""
    world = nodes * tasks_per_node
    data = world // (tensor * pipeline)
    out = []
    for node in range(nodes):
        ranks = tuple(range(node * tasks_per_node, (node + 1) * tasks_per_node))
        slots = []
        for rank in ranks:
            if not is_replica_source(rank, tensor=tensor, data=data):
                continue
            gpus = engine_gpus(rank, world=world, placement=placement, tasks_per_node=tasks_per_node, gpus_per_node=gpus_per_node,
                               tensor=tensor, pipeline=pipeline, engine_tp=engine_tp)
            slots.append(EngineSlot(rank // tensor, rank, gpus))
        out.append(NodeSplit(node, ranks, tuple(slots)))
    return out
