"""The stages' one boundary to data parallelism: shard prompts, reduce metrics, rank-0 writes, barriers.

A backend with data parallelism (the ``aligner`` actor: one process per rank under torchrun/srun)
exposes ``data_parallel_rank``, ``data_parallel_size``, ``global_rank``, ``all_reduce_sum(tensor)``,
``global_sum(float)`` and ``barrier()``; an actor without them (``hf``) is world 1, rank 0. The stages
ask ``DataParallel(actor)`` and never import ``torch.distributed``.

The rules (README, "data parallelism"):

* every rank draws the same global prompt list for a step (same ``PromptSampler`` seed) and keeps its
  contiguous slice of ``num_prompts / dp`` prompts, so a prompt's samples (a GRPO group) stay on one rank;
* ``model.global_batch_size`` counts sequences over all ranks: each rank trains on ``global_batch_size / dp``
  of its own rows per optimiser step, and the losses are normalised by the global token/sequence counts;
* logged metrics are reduced over ranks (means, or sums for counts), so every rank holds the same values;
* only global rank 0 writes the run's own files; the actor's ``save`` / ``export`` are collective.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def shard(items: Sequence[T], rank: int, size: int) -> list[T]:
    """Rank ``rank``'s contiguous slice of ``items`` (``len(items)`` must divide by ``size``)."""
    if len(items) % size:
        raise ValueError(f"{len(items)} items do not split evenly over {size} data-parallel ranks")
    per = len(items) // size
    return list(items[rank * per : (rank + 1) * per])


def data_parallel_problems(dp: int, prompts_key: str, prompts: int, rollouts_per_prompt: int | None,
                           global_batch_size: int, micro_batch_size: int, *,
                           other_micro_batch_sizes: Mapping[str, int] | None = None) -> list[str]:
    """What makes a step's batch arithmetic impossible at data-parallel size ``dp`` (empty when fine).

    ``rollouts_per_prompt=None``: the rollout is not a fixed number of sequences (KTO drops what its
    labeller cannot judge, and pads minibatches instead), so it is not checked against the minibatch.
    ``other_micro_batch_sizes``: other models that train on the same minibatches, by their config key (PPO's
    ``critic.micro_batch_size``): each rank's share must split into them too."""
    if dp <= 1:
        return []
    problems = []
    if prompts % dp:
        problems.append(f"{prompts_key} ({prompts}) must be divisible by the data-parallel size ({dp}): each rank "
                        "samples an equal, contiguous slice of the step's prompts")
    if global_batch_size % dp:
        problems.append(f"model.global_batch_size ({global_batch_size} sequences over all ranks) must be divisible by "
                        f"the data-parallel size ({dp})")
    elif (global_batch_size // dp) % micro_batch_size:
        problems.append(f"model.global_batch_size / data-parallel size ({global_batch_size} / {dp} = "
                        f"{global_batch_size // dp} sequences per rank) must be a multiple of model.micro_batch_size "
                        f"({micro_batch_size})")
    elif bad := {k: v for k, v in (other_micro_batch_sizes or {}).items() if (global_batch_size // dp) % v}:
        problems += [f"model.global_batch_size / data-parallel size ({global_batch_size} / {dp} = "
                     f"{global_batch_size // dp} sequences per rank) must be a multiple of {k} ({v})"
                     for k, v in bad.items()]
    elif rollouts_per_prompt is not None and prompts % dp == 0 and (prompts // dp * rollouts_per_prompt) % (global_batch_size // dp):
        problems.append(f"each rank's rollout ({prompts // dp} prompts × {rollouts_per_prompt}) must split into "
                        f"minibatches of model.global_batch_size / dp = {global_batch_size // dp} sequences")
    return problems


def metric_vector(metrics: Mapping[str, float], keys: Sequence[str], sums: Collection[str]) -> torch.Tensor:
    """``[2K + 1]`` float64: per key (finite value or 0, 1 if finite) then a checksum of the key list.

    Summed over ranks it gives every key's total and its number of finite values; the checksum
    catches ranks whose metric names differ (a reduction over misaligned vectors would be silently wrong).
    """
    out = []
    for k in keys:
        v = float(metrics[k])
        finite = math.isfinite(v)
        out += [v if finite else 0.0, 1.0 if finite else 0.0]
    out.append(_checksum(keys, sums))
    return torch.tensor(out, dtype=torch.float64)


def _checksum(keys: Sequence[str], sums: Collection[str]) -> float:
    # < 2**24, so the sum over ranks stays exact in float64
    return float(zlib.crc32(("\n".join(keys) + "|" + "\n".join(sorted(sums))).encode()) % 2**24)


def reduced_metrics(total: torch.Tensor, keys: Sequence[str], sums: Collection[str], dp: int) -> dict[str, float]:
    """Global metrics from the summed ``metric_vector``s: sums for ``sums`` keys, else the mean over the
    ranks where the value was finite (NaN where it was finite nowhere)."""
    if float(total[-1]) != dp * _checksum(keys, sums):
        raise RuntimeError(f"data-parallel ranks logged different metric names (this rank: {sorted(keys)}); "
                           "every rank must report the same keys for the step's metrics to be reduced")
    out = {}
    for i, k in enumerate(keys):
        value, count = float(total[2 * i]), float(total[2 * i + 1])
        out[k] = value if k in sums else (value / count if count else math.nan)
    return out


class DataParallel:
    """The actor's data-parallel layout as the stages see it (world 1 for actors without one)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.size = int(getattr(actor, "data_parallel_size", 1))
        self.rank = int(getattr(actor, "data_parallel_rank", 0))
        self.global_rank = int(getattr(actor, "global_rank", 0))
        self.is_writer = self.global_rank == 0  # global rank 0 writes the run's files

    def shard(self, items: Sequence[T]) -> list[T]:
        return shard(items, self.rank, self.size) if self.size > 1 else list(items)

    def global_sum(self, value: float) -> float:
        reducer = getattr(self.actor, "global_sum", None)
        return float(reducer(value)) if reducer is not None and self.size > 1 else float(value)

    def sum_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over data-parallel ranks (a CPU tensor; ``value`` itself on world 1)."""
        return self.actor.all_reduce_sum(value).cpu() if self.size > 1 else value

    def gather(self, obj: T) -> list[T]:
        """Every data-parallel rank's ``obj`` (picklable), in rank order; ``[obj]`` on world 1."""
        return list(self.actor.all_gather_object(obj)) if self.size > 1 else [obj]

    @property
    def is_model_parallel_source(self) -> bool:
        """Whether this rank is its model replica's source rank (the one that calls the reward); True without
        model parallelism."""
        return bool(getattr(self.actor, "is_model_parallel_source", True))

    def split(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous part of ``items`` split as evenly as possible (sizes differ by at most one; a rank
        may get none). ``gather`` of the parts, concatenated, is ``items`` in order."""
        if self.size <= 1:
            return list(items)
        n = len(items)
        return list(items[self.rank * n // self.size : (self.rank + 1) * n // self.size])

    def on_model_parallel_source(self, fn: Callable[[], T]) -> T:
        """``fn()`` once per model replica, its result on every rank of the replica (the actor's model-parallel
        ranks hold the same rollout: scoring it on each would multiply the judge load and, with a sampling
        judge, give the ranks of one replica different rewards to train on)."""
        runner = getattr(self.actor, "on_model_parallel_source", None)
        return runner(fn) if runner is not None else fn()

    def agreed(self, fn: Callable[[], T]) -> T:
        """``fn()``, then one decision on every rank of the job before any other collective: all go on, or all raise
        the worst failure any rank had (a server gone past its window: every rank checkpoints and exits 75). For the
        calls that can fail on some ranks only — a replica's reward, its critic values, its validation scoring —
        which, decided per rank, would leave one rank in the step's all-reduce and another in the checkpoint's
        barrier until the NCCL watchdog ends the job. Only a failure the job outlives is agreed: any other (CUDA's
        out-of-memory error inside a tensor-parallel forward, whose peers wait in that forward's collectives) is
        logged and raised at once on its rank, entering no collective (``collectives.agree_on_failure``), so the
        launcher ends the job in seconds. Without an actor that agrees (world 1) it is ``fn()``."""
        agree = getattr(self.actor, "agree_on_failure", None)
        if agree is None:
            return fn()
        try:
            value = fn()
        except Exception as err:
            agree(err)  # a server gone: raises on every rank; anything else: raises here at once
            raise
        agree(None)
        return value

    def on_writer(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the writer rank (global rank 0) alone, its result on every rank of the job (every rank calls
        it at the same point): a decision about the run's shared files that only the writer may make."""
        runner = getattr(self.actor, "on_writer", None)
        return runner(fn) if runner is not None else fn()

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the job (every rank calls it at the same point)."""
        fn = getattr(self.actor, "any_rank", None)
        return bool(fn(flag)) if fn is not None else bool(flag)

    def barrier(self) -> None:
        fn = getattr(self.actor, "barrier", None)
        if fn is not None:
            fn()

    def reduce_metrics(self, metrics: Mapping[str, float], sums: Collection[str] = ()) -> dict[str, float]:
        """One all-reduce: every rank gets the global metrics (means; sums for the ``sums`` keys)."""
        if self.size <= 1:
            return dict(metrics)
        keys = sorted(metrics)
        used = set(sums) & set(keys)
        total = self.sum_tensor(metric_vector(metrics, keys, used))
        return reduced_metrics(total, keys, used, self.size)


def masked_whiten_global(values: torch.Tensor, mask: torch.Tensor, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
                         *, unbiased: bool = False, eps: float = 1e-8) -> torch.Tensor:
    """``algorithms.masked_whiten`` with the mean and variance taken over every rank's masked entries.

    ``values``, ``mask``: ``[B, T]`` (this rank's rows); ``sum_over_ranks`` sums a float64 tensor over
    the data-parallel ranks. Returns ``[B, T]``, zero where masked out.
    """
    count_sum = sum_over_ranks(torch.stack([mask.sum(), (values * mask).sum()]).double())
    n = float(count_sum[0])
    if n == 0:
        return values * mask
    mean = float(count_sum[1]) / n
    sq = float(sum_over_ranks((((values.double() - mean) ** 2) * mask).sum().reshape(1))[0])
    var = sq / n
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return (values - mean) * (1.0 / math.sqrt(var + eps)) * mask
