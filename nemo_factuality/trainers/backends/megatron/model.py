"""What the megatron backend's actor and critic share: one Megatron-Core model (this rank's TP/PP shard, in Megatron's
DDP) trained by Megatron's forward/backward schedule and optimiser, and written as a Megatron distributed checkpoint.

* Forward/backward: Megatron's schedule (pipelined at PP > 1) over equal-shape micro batches. The stages' losses are
  normalised by the global token/sequence counts, so the step's gradient is the plain sum over micro batches and
  data-parallel ranks: the models are built with ``calculate_per_token_loss`` (the schedule does not divide a micro
  batch's loss by their number, DDP does not average over ranks) and ``finalize_model_grads`` runs without a token count.
* Metrics, as the aligner backend reports them: each loss metric averaged over micro batches and data-parallel ranks,
  ``loss`` their sum (the step's global loss), ``grad_norm`` (before clipping) and ``lr`` (this step's).
* Checkpoint (``save_model`` / ``load_model``): ``<dir>/megatron/`` holds weights and optimiser (every tensor once,
  whatever the layout), and ``<dir>/megatron_schedule.json`` the LR schedule's step, the optimiser kind, and with the
  distributed optimizer the format of its state and the TP/PP it was written at. The weights (and a plain optimiser's
  state) load at any TP/PP/DP. The distributed optimizer's state is written as ``model.megatron.optimizer_checkpoint``
  says: ``dp_reshardable`` (Megatron-LM's default) writes each rank's shard as it holds it — a save gathers nothing and
  adds no GPU memory, which is what a 32B job's first checkpoint can afford — and loads at the same TP/PP with any DP
  (another TP/PP is refused in one line naming the route); ``fully_reshardable`` gathers each TP·PP shard's state on
  its first data-parallel rank's host (over gloo: Megatron's memory-efficient variant, never on the GPUs) and loads
  at any layout. Only that save uses Megatron's gloo groups, so a run builds them only when it saves that format
  (``model.megatron.use_gloo_process_groups``); a load reads every format without them.

Importing this module imports nothing from Megatron.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.config import ConfigError
from nemo_factuality.trainers.backends.collectives import ProcessGroupDataParallel, collective_device
from nemo_factuality.trainers.backends.megatron import build
from nemo_factuality.trainers.backends.memory import ParallelLayout
from nemo_factuality.trainers.interfaces import LossFn, Rollout, check_train_batch, trim_to_longest
from nemo_factuality.types import FactualityInputError

SCHEDULE_FILE = "megatron_schedule.json"
# model.megatron.optimizer_checkpoint → the metadata Megatron's DistributedOptimizer.sharded_state_dict reads
OPTIMIZER_FORMATS = {
    "dp_reshardable": {"distrib_optim_sharding_type": "dp_reshardable"},
    # gathered with gloo into host memory on the first DP rank (the default variant all-gathers every shard's whole
    # state on every GPU: the 32B presets' first checkpoint ran out of memory there)
    "fully_reshardable": {"distrib_optim_sharding_type": "fully_reshardable",
                          "distrib_optim_fully_reshardable_mem_efficient": True},
}
# what a checkpoint that does not record its format was written in (this backend's only format before)
_UNRECORDED_FORMAT = "fully_reshardable"


def read_schedule(path: Path) -> dict[str, Any]:
    """``megatron_schedule.json`` as ``save_model`` wrote it; a file that is not (no JSON object, no
    ``use_distributed_optimizer`` flag, a format or layout this backend does not write) is refused in one line naming
    the file and the key, before anything loads."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FactualityInputError(f"{path} is not the JSON the megatron backend writes ({err}): restore it from the "
                                   "run's other checkpoints or resume from another one") from None
    if not isinstance(state, dict):
        raise FactualityInputError(f"{path} holds {type(state).__name__}, not the JSON object the megatron backend writes")
    problems = []
    if not isinstance(state.get("use_distributed_optimizer"), bool):
        problems.append(f"use_distributed_optimizer is {state.get('use_distributed_optimizer')!r}, not true/false")
    if state.get("optimizer_checkpoint", _UNRECORDED_FORMAT) not in OPTIMIZER_FORMATS:
        problems.append(f"optimizer_checkpoint is {state['optimizer_checkpoint']!r}, not one of "
                        f"{', '.join(OPTIMIZER_FORMATS)}")
    if not isinstance(state.get("optimizer", ""), str):
        problems.append(f"optimizer is {state['optimizer']!r}, not a class name")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = state.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key} is {value!r}, not a positive integer")
    if problems:
        raise FactualityInputError(f"{path} was not written by the megatron backend as it stands: {'; '.join(problems)}")
    return state


def optimizer_kind(optimizer: Any) -> str:
    """The class that steps the parameters inside Megatron's optimizer wrapper (torch's AdamW without TE or Apex, TE's
    FusedAdam in the container), as a checkpoint records it."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    inner = getattr(inner, "optimizer", inner)
    return f"{type(inner).__module__}.{type(inner).__qualname__}"


def check_optimizer_kind(where: Path, written: str | None, here: str) -> None:
    """A checkpoint's optimizer state resumes only into the class that wrote it: torch's AdamW keeps Adam's step per
    parameter, TE's FusedAdam per group with its own group keys (a CPU-written checkpoint stepped by FusedAdam failed
    on a missing ``bias_correction``). Refused in one line; a checkpoint that records none is not checked."""
    if written is None or written == here:
        return
    raise FactualityInputError(f"{where} holds the optimizer state of {written}, and this run's optimizer is {here}: "
                               "their states are laid out differently; resume where the same optimizer is built (Transformer "
                               "Engine installed or not, the same model.optim.name), or start a new stage from its "
                               "exported weights (model.path=<run>/final)")


# (what the model returned for one micro batch, that micro batch) → the loss function's inputs, e.g. {"logprobs": …}
OutputsOf = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


class MegatronModel(ProcessGroupDataParallel):
    """One trained Megatron-Core model per rank (the actor's policy, the critic's value model). A subclass builds
    ``layout``, ``settings``, ``chunks`` and ``model``, then calls ``_setup_training``."""

    layout: ParallelLayout
    settings: build.Settings  # model.dtype and model.megatron.*, as they reach Megatron's configs
    chunks: list[Any]  # this rank's model chunks in Megatron's DDP (one pipeline stage; no virtual pipelining)
    model: Any  # the GPTModel inside chunks[0]

    def _setup_training(self, optim: Any, *, max_steps: int, gradient_clip_val: float, role: str, lr_key: str) -> None:
        """Megatron's optimiser for ``optim`` (an ``OptimConfig``) with clipping and ``self.settings`` (bf16 keeps fp32
        main weights; the distributed optimizer), and every backend's LR schedule; a non-finite gradient's error names
        the ``role`` ("policy", "critic") and its ``lr_key``."""
        self._role, self._lr_key = role, lr_key
        self.optimizer = build.build_optimizer(self.chunks, optim, self.settings, clip_grad=gradient_clip_val)
        self.schedule = build.LearningRateSchedule(self.optimizer, optim, max_steps)

    @property
    def use_distributed_optimizer(self) -> bool:
        return self.settings.distributed_optimizer

    # ---- parallel layout (the data-parallel hooks: ``collectives.ProcessGroupDataParallel``) ---------------------
    def _data_parallel_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _model_parallel_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group()

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _from_last_pipeline_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the last pipeline stage holds it, on every stage of this replica."""
        from megatron.core import parallel_state

        if self.layout.pp == 1:
            return tensor
        moved = tensor.to(collective_device())
        torch.distributed.broadcast(moved, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
        return moved.cpu()

    # ---- forward / backward -----------------------------------------------------------------------------
    def _run_schedule(self, micro_batches: list[dict[str, torch.Tensor]], loss_of: Callable[..., Any],
                      forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """Megatron's forward(/backward) schedule over equal-shape micro batches; returns what ``loss_of(mb,
        output)`` reported for each (``(loss, reported)``), on the last pipeline stage (empty elsewhere)."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        batch, width = micro_batches[0]["tokens"].shape
        # sequence parallelism splits the sequence over TP: the model sees it right-padded to a multiple of TP (causal
        # attention: the padding changes no earlier position), the losses see the outputs of the real positions
        multiple = self.layout.tp if self.settings.sequence_parallel else 1
        padded = -(-width // multiple) * multiple
        device = self._device()
        positions = torch.arange(padded, device=device).unsqueeze(0).expand(batch, padded)

        def forward_step(data_iterator: Iterator[dict], model: Any):
            mb = next(data_iterator)
            on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}
            tokens = torch.nn.functional.pad(on_device["tokens"], (0, padded - width), value=0)  # any id: never seen
            output = model(input_ids=tokens, position_ids=positions, attention_mask=None)

            def loss_func(out: torch.Tensor):  # [b, padded, …] (last pipeline stage only)
                loss, reported = loss_of(on_device, out[:, :width])
                # 3 values + calculate_per_token_loss: the schedule leaves the loss as the stage normalised it
                return loss, torch.ones((), dtype=torch.int), reported

            return output, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=self.chunks,
            num_microbatches=len(micro_batches), seq_length=padded, micro_batch_size=batch, forward_only=forward_only)

    @torch.no_grad()
    def _per_token(self, rollout: Rollout, size: int, per_token_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   pad_id: int) -> torch.Tensor:
        """``[B, S-1]`` of ``per_token_of(output [b, w, …], tokens [b, w]) → [b, w-1]`` over the rollout's rows, in
        micro batches of ``size`` rows cut to the longest sequence (rows of ``pad_id`` fill the last one: pipeline
        stages exchange fixed shapes); the same on every rank of the replica."""
        rows, width = len(rollout), int(rollout.response_lengths.max())
        size = min(size, rows)
        padded_rows = -(-rows // size) * size
        tokens = torch.full((padded_rows, width), pad_id, dtype=torch.long)
        tokens[:rows] = rollout.tokens[:, :width]
        self.model.eval()

        def report(mb: dict, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            values = per_token_of(output, mb["tokens"])
            return torch.zeros((), device=values.device), {"per_token": values.float().cpu()}

        reported = self._run_schedule([{"tokens": t} for t in tokens.split(size)], report, forward_only=True)
        out = torch.zeros(padded_rows, width - 1)
        if reported:
            out = torch.cat([r["per_token"] for r in reported])
        out = self._from_last_pipeline_stage(out)
        full = torch.zeros(rows, rollout.tokens.shape[1] - 1)
        full[:, : width - 1] = out[:rows]
        return full

    def _train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, micro_batch_size: int,
                    outputs_of: OutputsOf) -> dict[str, float]:
        """One optimiser step over ``batch`` (``loss_fn`` on ``outputs_of(output, micro batch)``): the step's metrics
        (module docstring)."""
        size = check_train_batch(batch, micro_batch_size)
        trimmed = trim_to_longest(batch)
        micro = [{k: v[i : i + micro_batch_size] if _per_row(v, size) else v for k, v in trimmed.items()}
                 for i in range(0, size, micro_batch_size)]

        def loss_of(mb: dict, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss, metrics = loss_fn(outputs_of(output, mb), mb)
            reported = {k: torch.as_tensor(float(v)) for k, v in metrics.items()}
            reported["loss"] = loss.detach().float().cpu()  # this micro batch's share of the step's loss
            return loss, reported

        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = self._run_schedule(micro, loss_of, forward_only=False)
        lr = self.schedule.current_lr()
        grad_norm = self._reduce_gradients()
        self._clip_and_step(grad_norm)
        self.schedule.step()
        return {**self._step_metrics(reduced), "grad_norm": grad_norm, "lr": lr}

    def _reduce_gradients(self) -> float:
        """Sum the gradients over data-parallel ranks (and the layer norms / embeddings Megatron keeps in sync), then
        their global norm, once per step — refusing to step on a non-finite one."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads(self.chunks, num_tokens=None)
        if self.optimizer.prepare_grads():  # an fp16 loss scaler's overflow (bf16 and fp32 have none)
            raise RuntimeError("Megatron's optimizer skipped the step (a non-finite gradient)")
        grad_norm = float(self.optimizer.get_grad_norm())
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.zero_grad()
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} in the {self._role} update; "
                                     f"lower {self._lr_key} or check the reward for inf values")
        return grad_norm

    def _clip_and_step(self, grad_norm: float) -> None:
        """Clip by ``grad_norm`` and step. Megatron's own ``optimizer.step()`` would prepare the gradients and compute
        the norm a second time (it only clips with it, and steps whatever the norm), so its remaining parts are called
        here in its order instead (``ChainedOptimizer.step`` for several parameter groups)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = part.get_parameters()
            if part.config.clip_grad > 0.0 and params and not getattr(part, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        if not self.optimizer.step_with_ready_grads():
            raise RuntimeError("Megatron's optimizer skipped the step")

    def _step_metrics(self, reduced: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The loss functions' metrics averaged over micro batches and data-parallel ranks; ``loss`` summed over both
        (each share is normalised by the global count). Computed on the last pipeline stage, then sent everywhere."""
        metrics: dict[str, float] = {}
        if reduced:
            keys = sorted(k for k in reduced[0] if k != "loss")
            values = torch.tensor([sum(float(r[k]) for r in reduced) / len(reduced) for k in keys]
                                  + [sum(float(r["loss"]) for r in reduced)], dtype=torch.float64)
            total = self.all_reduce_sum(values) if self.data_parallel_size > 1 else values
            metrics = {k: float(v) / self.data_parallel_size for k, v in zip(keys, total[:-1].tolist(), strict=True)}
            metrics["loss"] = float(total[-1])
        shared = [metrics]
        torch.distributed.broadcast_object_list(shared, src=torch.distributed.get_world_size() - 1)
        return shared[0]

    # ---- checkpoints --------------------------------------------------------------------------------
    def _sharded_state(self, *, loading: bool, optimizer_format: str | None) -> dict[str, Any]:
        """The model's sharded state and, unless ``optimizer_format`` is None, the optimiser's in that format (a key
        of ``OPTIMIZER_FORMATS``; only the distributed optimizer's state depends on it)."""
        model = self.model.sharded_state_dict()
        if optimizer_format is None:
            return {"model": model}
        if self.settings.distributed_optimizer:
            # before the first step (a fresh process loading, a save at step 0) Adam has no state, and Megatron's
            # distributed optimizer cannot describe (AssertionError) nor load (KeyError) a state without it
            build.initialize_adam_state(self.optimizer)
        optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading,
                                                      metadata=self._optimizer_metadata(optimizer_format, loading))
        return {"model": model, "optimizer": optimizer}

    def _optimizer_metadata(self, optimizer_format: str, loading: bool) -> dict[str, Any]:
        """What Megatron's ``sharded_state_dict`` reads for ``optimizer_format``. A load gathers nothing (each rank
        reads the whole state, then keeps its shard), so it never asks for the memory-efficient gather, which needs
        the gloo groups: a run without them (dp_reshardable) resumes a fully_reshardable checkpoint. A save that needs
        them where they were not built is refused before anything is written."""
        metadata = dict(OPTIMIZER_FORMATS[optimizer_format])
        gathers_on_gloo = metadata.get("distrib_optim_fully_reshardable_mem_efficient", False)
        if loading:
            metadata.pop("distrib_optim_fully_reshardable_mem_efficient", None)
        elif gathers_on_gloo and self.settings.distributed_optimizer and not self.settings.gloo_process_groups:
            raise ConfigError(f"model.megatron.optimizer_checkpoint={optimizer_format} gathers the distributed "
                              "optimizer's state over gloo, and this run built no gloo groups "
                              "(model.megatron.use_gloo_process_groups); set it null or true")
        return metadata

    def _make_dirs(self, where: Path) -> None:
        if self.global_rank == 0:
            where.mkdir(parents=True, exist_ok=True)
        self.barrier()

    def save_model(self, where: Path) -> None:
        """Weights + optimiser (``where/megatron/``) and the LR schedule with what a resume must know of the format
        (``where/megatron_schedule.json``, global rank 0). Collective; the caller's barrier ends it."""
        from megatron.core import dist_checkpointing

        where = Path(where)
        self._make_dirs(where / "megatron")
        written = self.settings.optimizer_checkpoint
        dist_checkpointing.save(self._sharded_state(loading=False, optimizer_format=written), str(where / "megatron"))
        if self.global_rank == 0:
            state = {**self.schedule.state_dict(), "use_distributed_optimizer": self.use_distributed_optimizer,
                     "optimizer_checkpoint": written, "tensor_model_parallel_size": self.layout.tp,
                     "pipeline_model_parallel_size": self.layout.pp, "optimizer": optimizer_kind(self.optimizer)}
            (where / SCHEDULE_FILE).write_text(json.dumps(state), encoding="utf-8")

    def load_model(self, where: Path) -> None:
        """What ``save_model`` wrote, at this run's layout (module docstring: which layouts a format loads at)."""
        where = Path(where)
        if not (where / SCHEDULE_FILE).is_file():
            raise FileNotFoundError(f"{where} has no {SCHEDULE_FILE}: not written by the megatron backend")
        state = read_schedule(where / SCHEDULE_FILE)
        written = state.pop("use_distributed_optimizer")
        if written != self.use_distributed_optimizer:  # the two optimizers' states are stored differently
            raise FactualityInputError(f"{where} was written with model.megatron.use_distributed_optimizer={written}; "
                                       "resume with the same setting (the TP/PP/DP layout may change)")
        check_optimizer_kind(where, state.pop("optimizer", None), optimizer_kind(self.optimizer))
        optimizer_format = state.pop("optimizer_checkpoint", _UNRECORDED_FORMAT)
        layout = (state.pop("tensor_model_parallel_size", None), state.pop("pipeline_model_parallel_size", None))
        self._check_resumable_layout(where, optimizer_format, layout)
        self._load(where, optimizer_format)
        self.schedule.load_state_dict(state)

    def _check_resumable_layout(self, where: Path, optimizer_format: str, written: tuple[int | None, int | None]) -> None:
        """A dp_reshardable state follows the distributed optimizer's buffers, which TP and PP shape: at another TP/PP
        it is refused (the same on every rank: the file is shared) with the route that works."""
        here = (self.layout.tp, self.layout.pp)
        if not self.use_distributed_optimizer or optimizer_format != "dp_reshardable" or written == here:
            return
        raise FactualityInputError(
            f"{where} holds the distributed optimizer's state in model.megatron.optimizer_checkpoint=dp_reshardable, "
            f"written at TP={written[0]} PP={written[1]}, which loads only at that TP and PP (this run: TP={here[0]} "
            f"PP={here[1]}); resume once at TP={written[0]} PP={written[1]} with model.megatron.optimizer_checkpoint="
            "fully_reshardable until it saves, then from that checkpoint at the new layout")

    def load_model_weights(self, where: Path) -> None:
        """The weights ``save_model`` wrote under ``where`` (any layout), without the optimiser state."""
        self._load(Path(where), optimizer_format=None)

    def _load(self, where: Path, optimizer_format: str | None) -> None:
        from megatron.core import dist_checkpointing

        checkpoint = where / "megatron"
        if not (checkpoint / "metadata.json").is_file():
            raise FileNotFoundError(f"{checkpoint} holds no distributed checkpoint: not written by the megatron backend")
        loaded = dist_checkpointing.load(self._sharded_state(loading=True, optimizer_format=optimizer_format),
                                         str(checkpoint))
        self.model.load_state_dict(loaded["model"], strict=False)
        if optimizer_format is not None:
            build.load_optimizer_state(self.optimizer, loaded["optimizer"])
        else:  # bf16: the optimizer's fp32 main weights would otherwise overwrite these at the next step
            self.optimizer.reload_model_params()
        self.barrier()


def _per_row(value: Any, rows: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows
