"""What every distributed backend needs from ``torch.distributed``: the device collectives run on, one decision
for the whole job after a call that can fail on some ranks only, a source rank's result (or error) relayed to its
group, and the stages' data-parallel hooks (``parallel.DataParallel``) over a process group.

Only ``torch.distributed`` here: the ``hf`` backend (DP over the default group), the ``aligner`` backend and any
Megatron backend (DP over Megatron's data-parallel group) share it, so a fault is decided the same way on each.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nemo_factuality.types import FactualityInputError, ServerUnavailableError

log = logging.getLogger(__name__)


def collective_device() -> torch.device:
    """Where a tensor must live for the default process group's collectives: NCCL takes CUDA tensors only (a CPU
    tensor raises "No backend type associated with device type cpu", first seen on the GPU smoke run), gloo
    takes CPU ones."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed_world() -> bool:
    """Whether this process is one of several ranks of an initialised job."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def max_over_ranks(value: int) -> int:
    """The largest ``value`` any rank of the job passed (one int64 all-reduce over the default group)."""
    out = torch.tensor([value], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return int(out.item())


def outlivable(err: BaseException) -> bool:
    """Whether the job can outlive ``err``: a reward / critic server or rollout engine gone past its window (every rank
    checkpoints and exits 75, the requeued job resumes). Only such a failure is agreed over the ranks; any other one —
    CUDA's out-of-memory error, a bug, a device fault — ends its rank at once (``stop_this_rank``)."""
    return isinstance(err, ServerUnavailableError)


def relayable(err: BaseException) -> bool:
    """Whether a source rank broadcasts ``err`` to its group's ranks (which wait for it in that broadcast): a failure the
    job outlives, or a user-facing one (a ``FactualityInputError``: one line on every rank, e.g. a refit file the disk
    had no room for). Never a device or program error: after CUDA's out-of-memory or a device fault even the broadcast
    may fail or hang, so that rank stops at once and the launcher ends its peers."""
    from nemo_factuality.config import ConfigError

    return outlivable(err) or isinstance(err, (FactualityInputError, ConfigError))


def stop_this_rank(err: BaseException) -> None:
    """Log ``err`` with its traceback on this rank, now — before any clean-up that could wait — saying that this rank
    stops without entering a collective; the caller re-raises it. Its peers may be inside a collective of this very
    forward (tensor-parallel all-reduces) or the stage's agreement: none of them can be met, so the only way to end
    the job in seconds is for this rank to exit and the launcher (torchrun, ``srun --kill-on-bad-exit``) to end the
    others, instead of waiting out ``trainer.distributed_timeout_s``."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    log.error("rank %d failed with %s: %s; stopping this rank now without entering any collective (the launcher ends "
              "the other ranks)", rank, type(err).__name__, err, exc_info=err)


def relay_kind(err: Exception) -> str:
    """How another rank re-raises a source rank's error (only ``relayable`` ones are relayed): a server gone past its
    retry window stays one (the stage checkpoints on every rank alike), with its ``checkpoint_safe``; a user-facing
    error is raised as that one line."""
    if isinstance(err, ServerUnavailableError):
        return "unavailable" if getattr(err, "checkpoint_safe", True) else "unavailable-no-checkpoint"
    return "input"


def relayed_result(status: str, value: Any, source: int) -> Any:
    """The value another rank broadcast (``status`` "ok"), or its error raised here (see ``relay_kind``)."""
    if status == "ok":
        return value
    if status.startswith("unavailable"):
        relayed = ServerUnavailableError(f"{value} (on rank {source})")
        relayed.checkpoint_safe = status == "unavailable"
        raise relayed
    raise FactualityInputError(f"{value} (on rank {source})")


# how bad a rank's outcome is; the job acts on the worst (a crash anywhere beats a checkpoint, and a checkpoint
# that would be inconsistent anywhere is written nowhere)
_SEVERITY = {"ok": 0, "unavailable": 1, "unavailable-no-checkpoint": 2}


def agree_on_failure(error: Exception | None) -> None:
    """One decision for the whole job after a call that can fail on some ranks only (a replica's reward or critic
    server gone, its engine past its restarts): returns when no rank failed; otherwise raises on every rank the worst
    failure — its own error where this rank had that one, else the failing rank's, relayed (``relayed_result``).

    Every rank calls it at the same point, so the job's next collective is the same on every rank: all go on, or all
    checkpoint and exit 75. One int64 all-reduce when nothing failed; a gather of the reports else. A failure the job
    cannot outlive (``outlivable``) never reaches the all-reduce: it is logged and raised at once on its rank
    (``stop_this_rank``), since its peers may be waiting in another collective."""
    if error is not None and not outlivable(error):
        stop_this_rank(error)
        raise error
    if not distributed_world():
        if error is not None:
            raise error
        return
    kind = "ok" if error is None else relay_kind(error)
    worst = max_over_ranks(_SEVERITY[kind])
    if worst == 0:
        return
    reports: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, (kind, "" if error is None else f"{type(error).__name__}: {error}"))
    if error is not None and _SEVERITY[kind] == worst:
        raise error
    source = next(r for r, (k, _) in enumerate(reports) if _SEVERITY[k] == worst)
    if error is None:
        log.warning("rank %d: %s; stopping with it", source, reports[source][1])
    relayed_result(*reports[source], source)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the job (a preemption signal reaches the ranks at different moments)."""
    return bool(max_over_ranks(int(bool(flag)))) if distributed_world() else bool(flag)


def on_group_source(fn: Callable[[], Any], group: Any) -> Any:
    """``fn()`` on ``group``'s first rank (``None``: the default group, whose first rank is global rank 0), its result —
    or its error when ``relayable``, raised on every rank of the group, so no rank waits forever in the broadcast — on
    the group's other ranks; ``fn()`` alone without a group of several. The one source-rank relay: every backend's
    ``on_..._source`` is this over its group. Any other error of ``fn`` stops the source at once (``stop_this_rank``),
    broadcasting nothing: its peers wait in the broadcast until the launcher ends them."""
    if not torch.distributed.is_initialized():
        return fn()
    group = torch.distributed.group.WORLD if group is None else group
    ranks = torch.distributed.get_process_group_ranks(group)
    if len(ranks) == 1:
        return fn()
    box: list[Any] = [None]
    error: Exception | None = None
    if torch.distributed.get_rank() == ranks[0]:
        try:
            box = [("ok", fn())]
        except Exception as err:
            if not relayable(err):
                stop_this_rank(err)
                raise
            error = err  # re-raised below, on every rank of the group
            box = [(relay_kind(err), f"{type(err).__name__}: {err}" if outlivable(err) else str(err))]
    torch.distributed.broadcast_object_list(box, src=ranks[0], group=group)
    status, value = box[0]
    if error is not None:
        raise error
    return relayed_result(status, value, ranks[0])


def on_megatron_model_parallel_source(fn: Callable[[], Any]) -> Any:
    """``on_group_source`` over Megatron-Core's model-parallel group (TP × PP of one replica), as ``parallel_state``
    holds it for the NeMo-Aligner actor and its critic client; ``fn()`` without ``torch.distributed``."""
    if not torch.distributed.is_initialized():
        return fn()
    from megatron.core import parallel_state as mpu

    return on_group_source(fn, mpu.get_model_parallel_group())


class ProcessGroupDataParallel:
    """The stages' data-parallel hooks (``parallel.DataParallel``) over ``torch.distributed``: a backend mixes it in
    and says which group its data-parallel replicas form (``_data_parallel_group``; None = the default group)."""

    def _data_parallel_group(self) -> Any:
        return None

    @property
    def data_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self._data_parallel_group()) if torch.distributed.is_initialized() else 0

    @property
    def data_parallel_size(self) -> int:
        return torch.distributed.get_world_size(self._data_parallel_group()) if torch.distributed.is_initialized() else 1

    @property
    def is_model_parallel_source(self) -> bool:
        """Whether this rank calls the reward for its replica: every rank, without model parallelism."""
        return True

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (the stages write their run files on rank 0 only)."""
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def on_writer(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on global rank 0 (the stages' writer), its result or error on every rank of the job."""
        if not torch.distributed.is_initialized():
            return fn()
        return on_group_source(fn, torch.distributed.group.WORLD)

    def barrier(self) -> None:
        """Wait for every rank of the job (the stages' checkpoint finalisation)."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (the stage's global token/sequence counts); returns a new CPU tensor."""
        out = value.detach().clone().to(collective_device())
        torch.distributed.all_reduce(out, group=self._data_parallel_group())
        return out.cpu()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's ``obj`` in rank order (KTO gathers its ranks' labelled examples)."""
        out: list[Any] = [None] * self.data_parallel_size
        torch.distributed.all_gather_object(out, obj, group=self._data_parallel_group())
        return out

    def agree_on_failure(self, error: Exception | None) -> None:
        """The stages' one decision after a call that can fail on some ranks only (``agree_on_failure``)."""
        agree_on_failure(error)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the job (``any_rank``)."""
        return any_rank(flag)

    def global_sum(self, value: float) -> float:
        """The stages' hook for global token/sequence counts (sum over data-parallel ranks)."""
        return float(self.all_reduce_sum(torch.tensor([float(value)], dtype=torch.float64))[0])

    def mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over the data-parallel ranks (one all-reduce; every rank passes the same keys), as a
        backend's ``train_step`` reports its loss shares: the stages scale them back by micro batches × ranks."""
        if self.data_parallel_size <= 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        total = self.all_reduce_sum(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
        return {k: float(v) / self.data_parallel_size for k, v in zip(keys, total.tolist(), strict=True)}


# elements per all-reduce of gradients (fp32: 256 MiB), so the flat copy never doubles a large model's memory
_GRADIENT_BUCKET = 1 << 26


def sum_gradients(params: list[torch.nn.Parameter], group: Any = None) -> None:
    """Sum every parameter's gradient over ``group``'s ranks in place (the stages' losses are already normalised
    by the global token/sequence counts, so the step's gradient is the plain sum over data-parallel ranks). A
    parameter without a gradient on this rank counts as zero, so every rank's buckets line up. Reduced in fp32
    (a bf16 sum over ranks would round each partial sum) in buckets of ``_GRADIENT_BUCKET`` elements."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        bucket.append(p)
        size += p.numel()
        if size >= _GRADIENT_BUCKET:
            _sum_bucket(bucket, group)
            bucket, size = [], 0
    if bucket:
        _sum_bucket(bucket, group)


def _sum_bucket(bucket: list[torch.nn.Parameter], group: Any) -> None:
    flat = torch.cat([p.grad.detach().reshape(-1).float() for p in bucket])
    device = collective_device()
    reduced = flat.to(device)
    torch.distributed.all_reduce(reduced, group=group)
    reduced = reduced.to(flat.device)
    offset = 0
    for p in bucket:
        n = p.numel()
        p.grad.copy_(reduced[offset : offset + n].view_as(p.grad))
        offset += n


def ranks_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` for a process that srun started as one task of
    a step of several (one task per GPU, as ``nemo-factuality launch`` starts the megatron backend), read from srun's
    task variables; ``{}`` under torchrun (which sets ``WORLD_SIZE`` itself) and for a single task. Tasks are numbered
    node by node (srun's default block distribution), so a task's local id is its GPU. The rendezvous address is not
    srun's to give: ``MASTER_ADDR`` / ``MASTER_PORT`` come from the job (the rendered script exports them).

    >>> ranks_from_slurm({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "16",
    ...                   "SLURM_STEP_TASKS_PER_NODE": "8(x2)"})
    {'RANK': '9', 'WORLD_SIZE': '16', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '8'}
    """
    if "WORLD_SIZE" in environ or "SLURM_PROCID" not in environ:
        return {}
    world = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    if int(world) <= 1:
        return {}
    per_node = environ.get("LOCAL_WORLD_SIZE") or environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get(
        "SLURM_NTASKS_PER_NODE") or world
    # srun writes e.g. "8(x2)" or "8,4": this node's count is the first number only on uniform layouts, which are the
    # only ones the launcher starts; the stages check the world against the layout
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": world, "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": per_node.split("(")[0].split(",")[0]}


def adopt_slurm_ranks() -> None:
    """Put ``ranks_from_slurm`` into this process's environment (torch.distributed's ``env://`` and the stages read
    it there); a no-op under torchrun or for a single process."""
    import os

    os.environ.update(ranks_from_slurm(os.environ))


def group_timeout(timeout_s: float) -> datetime.timedelta:
    """``trainer.distributed_timeout_s`` as the ``timeout`` torch.distributed's groups take (never torch's default:
    NCCL's 10 minutes would abort the job while a healthy rank waits for one that is retrying a server)."""
    return datetime.timedelta(seconds=float(timeout_s))


def init_from_environment(device: str, timeout_s: float) -> str:
    """Join the job torchrun or srun started (``WORLD_SIZE`` > 1 in the environment, or several srun tasks:
    ``adopt_slurm_ranks``): gloo on CPU, NCCL on GPU, one GPU per local rank, every collective bounded by
    ``timeout_s`` (``trainer.distributed_timeout_s``). Returns the device this rank runs on (``device`` itself for a
    single process)."""
    import os

    from nemo_factuality.config import ConfigError

    adopt_slurm_ranks()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return device
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing and not torch.distributed.is_initialized():
        raise ConfigError(f"{world} ranks but no {' / '.join(missing)} to meet at: start them with torchrun, or export "
                          "the address and a free port of the first rank's node before srun (the launcher's script does)")
    on_gpu = device.startswith("cuda")
    if on_gpu:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if on_gpu else "gloo", timeout=group_timeout(timeout_s))
    log.info("rank %d of %d on %s (collectives time out after %g s)", torch.distributed.get_rank(), world, device,
             timeout_s)
    return device
