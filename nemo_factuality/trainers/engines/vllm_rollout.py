"""``rollout.engine=vllm``: a ``PolicyActor`` whose rollouts come from a vLLM engine holding the actor's weights.

Everything but generation is the wrapped actor's (log-probs, training, checkpoints). After each optimiser step
(and a checkpoint load) the engine's weights are stale; the next ``generate`` refits them first, by
``rollout.vllm.refit``: ``file`` — the actor's weights in the checkpoint's tensor names (``hf_state_dict``) go to one
safetensors file the engine reloads; ``broadcast`` — the actor's ``hf_weights`` stream, tensor by tensor as it yields
them, into the engine's workers over a process group of their own (``vllm_worker.py``), with no file and no full
copy. The trainer recomputes every log-prob; each rollout carries the engine's own (``Rollout.logprobs``), so the
stage logs the gap (``rollout/logprob_diff``) and can correct for it (``rollout.vllm.tis_cap``).

With data parallelism each replica has its own engine (colocated with it) and refits it from its own weights. With
model parallelism (the megatron backend at TP/PP > 1) the export is collective — every rank of the replica gathers,
each weight once — and the replica's model-parallel source rank alone holds the engine, writes (or broadcasts) the
weights, asks for the rollouts and broadcasts them (its errors too: an engine gone past its restarts stops every rank
alike). Under ``broadcast`` an engine that dies is restarted by the source and streamed to again by every rank (the
export is collective): a stream's outcome and a rollout's "restarted, stream again" are decided on the source and
broadcast, so every rank takes the same path.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.trainers.engines.rollout_flight import Flight, FlightChunk, FlightReport, PlannedChunk
from nemo_factuality.trainers.engines.vllm_engine import (
    TRANSPORT_ERRORS,
    EngineRestarted,
    VLLMEngine,
    engine_python,
    require_vllm,
)
from nemo_factuality.trainers.interfaces import Rollout, RolloutChunk, SamplingParams, assemble_rollout
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)


class RefitWriteError(FactualityInputError):
    """The source rank could not write the refit file (no space, a quota, an I/O error): every rank of the replica
    stops with this one line (relayed: ``collectives.relayable``), exit 2."""


class VLLMRollout:
    """The actor with ``generate`` / ``generate_chunks`` on ``engine``; every other attribute is the actor's."""

    def __init__(self, actor: Any, engine: VLLMEngine | None, *, weights_dir: Path, chunk_size: int,
                 in_sync: bool = True, refit: str = "file") -> None:
        """``engine``: None on a model-parallel rank that is not its replica's source. ``in_sync``: the engine holds
        the actor's weights now (it started from ``model.path``, the actor's initial weights); else the first
        ``generate`` refits it. ``refit``: ``rollout.vllm.refit`` (every rank of a replica passes the same)."""
        self.actor, self.engine, self.weights_dir, self.chunk_size = actor, engine, Path(weights_dir), max(1, chunk_size)
        if engine is not None and engine.cfg.refit != refit:
            raise ValueError(f"VLLMRollout(refit={refit!r}) on an engine configured for {engine.cfg.refit!r}")
        self.refit_mode = refit
        self.stale = not in_sync
        self._reload_due = False  # weights written, not yet loaded by the engine (the source's next request does)
        self.refits = 0
        self.last_refit_s = 0.0  # trainer export + engine reload, the step's last refit
        # async GRPO names the weight versions (the trainer step whose weights the actor holds; the engine's last refit's):
        # each refit tells the engine its version, which the engine reports with every rollout. None: the on-policy loop
        self.policy_version: int | None = None
        # the engine starts from model.path, the weights before any update (version 0); None: weights of no known version
        self.engine_version: int | None = 0 if in_sync else None
        self.host_copied_bytes = 0  # bytes of the model copied to host memory for file refits (0 off the source)

    def __getattr__(self, name: str) -> Any:  # only for what this class does not define: the actor's
        return getattr(self.__dict__["actor"], name)

    # ------------------------------------------------------------------ what makes the engine stale
    def train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        out = self.actor.train_step(*args, **kwargs)
        self.stale = True
        return out

    def load(self, path: Path) -> None:
        self.actor.load(path)
        self.stale = True

    def load_weights(self, path: Path) -> None:
        self.actor.load_weights(path)
        self.stale = True

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ refit and generation
    @property
    def broadcast(self) -> bool:
        """``rollout.vllm.refit=broadcast`` (every rank knows it, the engine's or not)."""
        return self.refit_mode == "broadcast"

    def refit(self) -> float:
        """Export the actor's current weights (collective under model parallelism) and, on the engine's rank, write
        them for the engine, which loads them before its next rollout (``file``), or stream them into it now
        (``broadcast``); returns the seconds it took. The file is written inside the replica's relay, so a write that
        fails on the source (no space, a quota, an I/O error) stops every rank of the replica with the same line
        instead of leaving its peers in the next broadcast."""
        if self.broadcast:
            return self._refit_broadcast()
        start = time.perf_counter()
        weights = None
        if self.engine is None:
            # a rank of the replica without the engine: the export is collective (Bridge gathers each weight over the
            # model-parallel ranks), so walk it with the source, but keep nothing (no host copy of the model here)
            for _name, _tensor in self.actor.hf_weights():
                pass
        else:
            weights = self.actor.hf_state_dict()
            self.host_copied_bytes += sum(t.numel() * t.element_size() for t in weights.values())
        on_source = getattr(self.actor, "on_model_parallel_source", None) or (lambda fn: fn())
        on_source(lambda: self._write_weights(weights))
        self._refitted(start)
        return self.last_refit_s

    def _refitted(self, start: float) -> None:
        """After either refit: the engine holds (file: will hold, at its next request) the actor's weights."""
        self.stale = False
        self.refits += 1
        if self.policy_version is not None:
            self.engine_version = self.policy_version
        self.last_refit_s = time.perf_counter() - start

    def _write_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The refit file for the engine (on its rank): written beside, then renamed, so the engine never reads a part;
        a failed write removes the part and is one ``RefitWriteError`` saying where and what to change."""
        from safetensors.torch import save_file

        tmp = self.weights_dir / "model.safetensors.partial"  # not *.safetensors: the engine reads only whole files
        try:
            self.weights_dir.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(tmp))
            os.replace(tmp, self.weights_dir / "model.safetensors")
        except OSError as err:
            tmp.unlink(missing_ok=True)
            size = sum(t.numel() * t.element_size() for t in weights.values())
            raise RefitWriteError(
                f"rollout.vllm refit: cannot write the policy's weights for the engine ({size / 2**30:.2f} GiB) to "
                f"{tmp} ({err.strerror or err}): free space there, point rollout.vllm.weights_dir at a filesystem "
                "with room (node-local scratch), or use rollout.vllm.refit=broadcast (no file)") from err
        self._reload_due = True

    def _refit_broadcast(self) -> float:
        """Stream the actor's weights into the engine; every rank of the replica iterates the export, the source
        sends. A dead engine is restarted (on the source) and streamed to again (every rank): the source's verdict
        is broadcast, so all ranks loop alike; past ``restarts`` every rank raises the ``EngineUnavailable``."""
        start = time.perf_counter()
        on_source = getattr(self.actor, "on_model_parallel_source", None) or (lambda fn: fn())
        while True:
            failure = self._stream_once()
            if not on_source(lambda f=failure: self.engine.recover(f)):
                break
        self._refitted(start)
        return self.last_refit_s

    def _stream_once(self) -> BaseException | None:
        """One pass over ``actor.hf_weights()`` (every rank: the export is collective); the source broadcasts each
        tensor as it comes. Returns the source's failure (None elsewhere); the rest of the export still runs, so
        the replica's ranks leave it together."""
        failure: BaseException | None = None
        engine = self.engine
        if engine is not None:
            try:
                engine.open_stream(self.actor.hf_weights_manifest(), self.policy_version)
            except Exception as err:  # judged by engine.recover, on the source, after the export
                failure = err
        for name, tensor in self.actor.hf_weights():
            if engine is not None and failure is None:
                try:
                    engine.send_tensor(name, tensor)
                except Exception as err:
                    failure = err
        if engine is not None:
            try:
                if failure is None:
                    engine.close_stream()
                elif not isinstance(failure, TRANSPORT_ERRORS) and engine.streaming:
                    engine.abort_stream()  # the actor's error, the engine alive: stop its reload cleanly
            except Exception as err:
                failure = failure or err
        return failure

    def _reload(self) -> None:
        """The engine loads the written weights (on the engine's rank, inside the broadcast call: its failure reaches
        every rank of the replica)."""
        if self._reload_due:
            start = time.perf_counter()
            self.engine.refit(self.weights_dir, self._reload_version())
            self._reload_due = False
            self.last_refit_s += time.perf_counter() - start

    def _reload_version(self) -> int | None:
        """The version a pending file refit loads (None in the on-policy loop, whose requests name none)."""
        return None if self.policy_version is None else self.engine_version

    def engine_metrics(self) -> dict[str, float]:
        """The step's refit time (0 when no refit happened since the last call)."""
        out = {"time/refit": self.last_refit_s}
        self.last_refit_s = 0.0
        return out

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        return assemble_rollout(list(self.generate_chunks(prompt_ids, sampling)), self.actor.pad_id)

    def generate_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[RolloutChunk]:
        """One engine request per ``chunk_size`` prompts (the engine batches within it), each yielded when done."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate: every prompt needs at least one token")
        if self.stale:
            self.refit()
        for rows in self.chunk_rows(len(prompt_ids)):
            # from the trainer's random stream, drawn on every rank alike: a resumed step (its RNG state restored)
            # samples the same rollouts, and the model-parallel ranks' streams stay together
            seed = int(torch.randint(0, 2**31 - 1, (1,)))
            yield RolloutChunk(rows, self._generate_rows(prompt_ids, rows, sampling, seed)[0])

    def chunk_rows(self, n: int) -> list[list[int]]:
        """The prompt rows of each engine request for ``n`` prompts (``chunk_size`` a request)."""
        return [list(range(start, min(start + self.chunk_size, n))) for start in range(0, n, self.chunk_size)]

    def _generate_rows(self, prompt_ids: Sequence[Sequence[int]], rows: list[int], sampling: SamplingParams,
                       seed: int) -> tuple[Rollout, int]:
        """``rows``' rollout and the engine's weight version, on every rank of the replica (the source asks)."""
        on_source = getattr(self.actor, "on_model_parallel_source", None) or (lambda fn: fn())
        prompts = [list(prompt_ids[i]) for i in rows]
        while True:
            out = on_source(lambda p=prompts, s=seed: self._engine_rollout(p, sampling, s))
            if out is not None:
                return out
            self.refit()  # broadcast: the engine was restarted; every rank streams the weights again

    def _engine_rollout(self, prompts: list[list[int]], sampling: SamplingParams,
                        seed: int) -> tuple[Rollout, int] | None:
        """The engine's rollout of ``prompts`` and its weight version; None when (``broadcast``) the engine was
        restarted without weights."""
        try:
            return self._generate_on_engine(prompts, sampling, seed)
        except EngineRestarted:
            return None

    def _generate_on_engine(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> tuple[Rollout, int]:
        self._reload()
        out, version = self.engine.generate_versioned(
            prompts, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, greedy=sampling.use_greedy, eos_id=self.actor.eos_id, seed=seed)
        return engine_rollout(prompts, out, self.actor.pad_id), version

    # ------------------------------------------------------------------ async GRPO: a step's rollouts in flight
    def start_flight(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
                     on_chunk: Any = None) -> Flight | None:
        """The rollouts of ``prompt_ids`` (one request per ``chunk_rows`` chunk, with its seed from ``seeds``) generated
        by the engine in a thread while the trainer goes on (``rollout_flight.Flight``), from the weights it holds:
        refit it first, on the trainer's thread, as the stage decides (a file refit's reload is the flight's first
        request). None on a rank of the replica without the engine (``finish_flight`` relays the source's)."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate: every prompt needs at least one token")
        if self.engine is None:
            return None
        plan = [PlannedChunk(i, rows, [list(prompt_ids[r]) for r in rows], int(seed))
                for i, (rows, seed) in enumerate(zip(self.chunk_rows(len(prompt_ids)), seeds, strict=True))]
        reload = (self.weights_dir, self._reload_version()) if self._reload_due else None
        self._reload_due = False  # the flight's first request loads it
        return Flight(self.engine, plan, sampling, eos_id=self.actor.eos_id, reload=reload, on_chunk=on_chunk,
                      to_rollout=lambda prompts, rows: engine_rollout(prompts, rows, self.actor.pad_id))

    def finish_flight(self, flight: Flight | None) -> FlightReport:
        """Every rank of the replica: the flight's report, waited for on the source and broadcast from it (its error
        too: an engine past its restarts is raised on every rank of the replica)."""
        on_source = getattr(self.actor, "on_model_parallel_source", None) or (lambda fn: fn())
        return on_source(lambda: flight.result())

    def generate_planned(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
                         indices: Sequence[int]) -> list[FlightChunk]:
        """The chunks ``indices`` of ``start_flight``'s plan, generated now on the trainer's thread with the seeds
        drawn for them (what a flight did not generate: a broadcast engine restarted mid-flight, a checkpoint saved
        without them), from the actor's current weights (refit first when stale)."""
        if self.stale:
            self.refit()
        plan = self.chunk_rows(len(prompt_ids))
        out = []
        for i in indices:
            rollout, version = self._generate_rows(prompt_ids, plan[i], sampling, int(seeds[i]))
            out.append(FlightChunk(i, RolloutChunk(plan[i], rollout), version))
        return out


def engine_rollout(prompts: Sequence[Sequence[int]], rows: Sequence[dict[str, Any]], pad_id: int) -> Rollout:
    """The engine's answers (``tokens``, ``logprobs``, ``ended`` per prompt) in the stages' right-padded layout, the
    engine's log-prob of each generated token at the position that predicts it (``[B, S-1]``, 0 elsewhere)."""
    seqs = [list(p) + list(r["tokens"]) for p, r in zip(prompts, rows, strict=True)]
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(seqs), width - 1)
    for i, (p, r, s) in enumerate(zip(prompts, rows, seqs, strict=True)):
        assert len(r["logprobs"]) == len(r["tokens"]), (len(r["logprobs"]), len(r["tokens"]))
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        logprobs[i, len(p) - 1 : len(s) - 1] = torch.tensor(r["logprobs"], dtype=torch.float32)
    return Rollout(tokens, torch.tensor([len(p) for p in prompts]), torch.tensor([len(s) for s in seqs]),
                   torch.tensor([bool(r["ended"]) for r in rows]), logprobs=logprobs)


def with_rollout_engine(cfg: Any, actor: Any, run_dir: Path) -> Any:
    """The actor the stage trains with ``cfg.rollout.engine`` (the one place the choice is made): the actor itself for
    its own generation (``megatron``, ``trtllm``), else wrapped in ``VLLMRollout`` with a started engine on each
    replica's model-parallel source rank."""
    if cfg.rollout.engine != "vllm":
        return actor
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    v = cfg.rollout.vllm
    source = getattr(actor, "is_model_parallel_source", True)
    devices = engine_devices(cfg, rank, world, os.environ, source=source)
    engine = None
    if source:
        require_vllm(engine_python(v))
        engine = VLLMEngine(cfg.model.path, v, dtype=v.dtype or cfg.model.dtype, seed=cfg.trainer.seed + rank,
                            log_dir=run_dir / "vllm" / f"rank{rank}", devices=devices).start()
    weights_dir = Path(v.weights_dir) / f"rank{rank}" if v.weights_dir else run_dir / "vllm" / f"rank{rank}" / "weights"
    return VLLMRollout(actor, engine, weights_dir=weights_dir,
                       chunk_size=cfg.model.rollout_micro_batch_size, refit=v.refit)


def engine_devices(cfg: Any, rank: int, world: int, environ: Mapping[str, str], *, source: bool) -> list[str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` of the engine that trainer ``rank`` of ``world`` starts, by
    ``rollout.vllm.placement`` (``nemo_factuality.placement``, the split the launcher renders), in the ids this
    process sees its node's GPUs by (its own ``CUDA_VISIBLE_DEVICES``, else all); ``[]`` for a rank that starts no
    engine, None on CPU. The node's trainer ranks are ``LOCAL_WORLD_SIZE`` (torchrun; srun: ``collectives``)."""
    if not str(cfg.trainer.device).startswith("cuda"):
        return None
    from nemo_factuality import placement
    from nemo_factuality.config import ConfigError

    listed = environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in listed.split(",") if d.strip()] if listed else \
        [str(i) for i in range(torch.cuda.device_count())]
    tasks = int(environ.get("LOCAL_WORLD_SIZE", world))
    local = int(environ.get("LOCAL_RANK", rank % tasks))
    if local != rank % tasks:
        raise ConfigError(f"rank {rank} is local rank {local} of {tasks} on its node, not {rank % tasks}: the engines' "
                          "GPUs are placed for ranks laid out node by node (srun --distribution=block, torchrun)")
    m, v = cfg.model, cfg.rollout.vllm
    try:
        gpus = placement.engine_gpus(rank, world=world, placement=v.placement, tasks_per_node=tasks,
                                     gpus_per_node=len(visible), tensor=m.tensor_model_parallel_size,
                                     pipeline=m.pipeline_model_parallel_size, engine_tp=v.tensor_parallel_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if bool(gpus) != bool(source):
        raise RuntimeError(f"rank {rank}: the actor says it {'is' if source else 'is not'} its replica's source rank, "
                           "Megatron's default rank order says otherwise; the engines' GPU split assumes that order")
    return [visible[i] for i in gpus]
