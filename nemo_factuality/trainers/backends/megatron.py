"""The ``megatron`` backend: a ``PolicyActor`` on Megatron-Core 0.16 built from an HF checkpoint by Megatron-Bridge 0.3
(``trainer.backend=megatron``), at any TP/PP; data parallelism over the rest of the torchrun/srun job.

* Build (``megatron_build.py``): ``AutoBridge`` turns ``model.path`` (an HF folder) into Megatron-Core's ``GPTModel``
  for this rank's TP/PP shard, wrapped in Megatron's DDP, with ``get_megatron_optimizer`` (Megatron's distributed
  optimizer with ``model.megatron.use_distributed_optimizer``) and every backend's LR schedule.
* Settings (``megatron_build.Settings``): ``model.dtype=bfloat16`` (bf16 weights and activations, fp32 main weights and
  gradient reduction), ``model.megatron.sequence_parallel`` (the batch right-padded to a multiple of TP for it),
  ``model.megatron.recompute``, ``model.megatron.transformer_engine`` (the TE layer spec or the local one).
* Rollouts (``megatron_generate.py``): Megatron-Core's static inference engine with a KV cache, sampling from the
  distribution the log-probs here are of (temperature, top-k, top-p as transformers applies them); sequence
  parallelism is off while it runs (the engine has none for dense models).
* Log-probs and training: Megatron's forward/backward schedule (pipelined at PP > 1). The stage's losses are
  normalised by the global token/sequence counts, so the step's gradient must be the plain sum over micro batches and
  data-parallel ranks: the model is built with ``calculate_per_token_loss`` (the schedule does not divide each micro
  batch's loss by their number, DDP does not average over ranks) and the gradients are reduced by
  ``finalize_model_grads`` without a token count. Metrics are reported as the aligner backend reports them: each loss
  metric averaged over micro batches and data-parallel ranks, ``loss`` their sum (the step's global loss), plus
  ``grad_norm`` (before clipping) and ``lr`` (this step's).
* Reference policy: a copy of this rank's shard of the initial weights (``model.reference``: ``copy`` keeps it on the
  model's device, ``cpu_weight_swap`` in host memory), swapped into the policy for the reference log-probs.
* Checkpoints: a Megatron distributed checkpoint of weights and optimiser (``megatron/``: every tensor once, whatever
  the layout; it loads at another TP/PP/DP; ``megatron_build.load_optimizer_state`` works around Megatron's distributed
  optimizer failing to load torch AdamW's step) plus the LR schedule. The reference is not written while it is the initial
  HF checkpoint (``reference.json`` records ``model.path`` and its fingerprint, as the hf backend does); after
  ``reset_reference`` (KTO) it is a distributed checkpoint of its own (``reference/``).
* ``export``: an HF folder ``transformers`` loads (Bridge's ``save_hf_pretrained``: the gathered weights, the source
  checkpoint's config and tokenizer files).

Importing this module imports nothing from Megatron; the heavy stack loads in ``MegatronActor.__init__``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.trainers import reference as ref_record
from nemo_factuality.trainers.backends import megatron_build as build
from nemo_factuality.trainers.backends.collectives import ProcessGroupDataParallel, collective_device, on_group_source
from nemo_factuality.trainers.backends.hf import SampledDistribution, token_logprobs
from nemo_factuality.trainers.backends.megatron_generate import generate_static_batch, sequence_parallel_off
from nemo_factuality.trainers.interfaces import (
    LossFn,
    Rollout,
    RolloutChunk,
    SamplingParams,
    assemble_rollout,
    check_train_batch,
)
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

_SCHEDULE_FILE = "megatron_schedule.json"
# the distributed optimizer's checkpoint format that reloads at another TP/PP/DP (Megatron's default does not)
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class MegatronActor(ProcessGroupDataParallel):
    """``PolicyActor`` on Megatron-Core + Megatron-Bridge (module docstring); one instance per rank."""

    def __init__(self, cfg: Any, *, max_steps: int, gradient_clip_val: float = 1.0, seed: int = 1234,
                 device: str = "cpu") -> None:
        from transformers import AutoTokenizer

        from nemo_factuality.local_models import from_pretrained

        if not cfg.path:
            raise FactualityInputError("model.path must be an HF checkpoint folder (trainer.backend=megatron)")
        self.cfg = cfg
        sampling_seed = torch.initial_seed()  # the stage's seed: Megatron's own seeding must not replace it
        self.layout = build.init_process_groups(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                                device, seed)
        self.on_gpu = device.startswith("cuda")
        self.settings = build.Settings.of(cfg)
        self.bridge, self.chunks = build.build_policy(cfg.path, self.layout, self.settings, on_gpu=self.on_gpu)
        # this rank's GPTModel (one pipeline stage; no virtual pipelining), inside DDP (and Float16Module with bf16):
        # its parameter names and state dict are the checkpoints' and the reference's whatever the wrappers
        self.model = build.bare_model(self.chunks[0])
        torch.manual_seed(sampling_seed + self.data_parallel_rank)  # replicas sample different rollouts
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, cfg.path, "model.path")
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer at {cfg.path} has no eos_token; set one so responses can end")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.distribution = SampledDistribution.of(cfg.sampling_params)
        self.optimizer = build.build_optimizer(self.chunks, cfg.optim, self.settings, clip_grad=gradient_clip_val)
        self.schedule = build.LearningRateSchedule(self.optimizer, cfg.optim, max_steps)
        self._reference: dict[str, torch.Tensor] = {}
        self.reset_reference()
        # the reference is the checkpoint at model.path until reset_reference(): checkpoints record it, not copy it
        self.initial_reference = ref_record.initial_record(cfg.path, "model.path")
        self.reference_is_initial = True

    # ---- parallel layout (the data-parallel hooks: ``collectives.ProcessGroupDataParallel``) ---------------------
    def _data_parallel_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _model_parallel_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group()

    @property
    def is_model_parallel_source(self) -> bool:
        """Whether this rank is its model replica's source rank (the one that calls the reward)."""
        return self.global_rank == min(torch.distributed.get_process_group_ranks(self._model_parallel_group()))

    def on_model_parallel_source(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` once per model replica, the result (or its error) on every rank of the replica."""
        return on_group_source(fn, self._model_parallel_group())

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- rollouts -----------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        """``generate_chunks`` assembled in prompt order, right-padded with ``pad_id`` to one width."""
        return assemble_rollout(list(self.generate_chunks(prompt_ids, sampling)), self.pad_id)

    def generate_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[RolloutChunk]:
        """Static batches of ``model.rollout_micro_batch_size`` prompts, bucketed by length (a stable sort: a prompt's
        samples stay together), each yielded as soon as it is generated."""
        if not prompt_ids:
            raise ValueError("generate: no prompts")
        asked = SampledDistribution.of(sampling)
        if not sampling.use_greedy and asked != self.distribution:
            raise ValueError(f"generate: sampling from {asked} but the log-probs are of {self.distribution} "
                             "(model.sampling_params: temperature, top_k, top_p)")
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        size = max(1, self.cfg.rollout_micro_batch_size)
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            self.model.eval()
            with torch.no_grad(), sequence_parallel_off(self.model):
                rollout = generate_static_batch(self.model, self.tokenizer, self.eos_id, self.pad_id,
                                                [prompt_ids[i] for i in rows], sampling, asked)
            yield RolloutChunk(rows, rollout)

    # ---- log-probs ----------------------------------------------------------------------------------
    def _token_outputs(self, logits: torch.Tensor, tokens: torch.Tensor, need_entropy: bool) -> dict[str, torch.Tensor]:
        """``[b, S, V/TP]`` logits (this rank's vocabulary shard), ``[b, S]`` tokens → ``logprobs`` ``[b, S-1]`` of the
        sampled distribution (and its ``entropy``). Without truncation or entropy at TP > 1 the log-softmax runs on the
        vocabulary shards (Megatron's vocab-parallel cross-entropy); otherwise the vocabulary is gathered first."""
        from megatron.core import tensor_parallel

        d = self.distribution
        if self.layout.tensor > 1 and not need_entropy and not d.truncation():
            scaled = logits[:, :-1].float() / d.temperature
            return {"logprobs": -tensor_parallel.vocab_parallel_cross_entropy(scaled, tokens[:, 1:])}
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        out = {"logprobs": token_logprobs(full, tokens, d)}
        if need_entropy:
            out["entropy"] = d.entropy(full[:, :-1])
        return out

    def _run_schedule(self, micro_batches: list[dict[str, torch.Tensor]], loss_of: Callable[..., Any],
                      forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """Megatron's forward(/backward) schedule over equal-shape micro batches; returns what ``loss_of(mb,
        logits)`` reported for each (``(loss, reported)``), on the last pipeline stage (empty elsewhere)."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        batch, width = micro_batches[0]["tokens"].shape
        # sequence parallelism splits the sequence over TP: the model sees it right-padded to a multiple of TP (causal
        # attention: the padding changes no earlier position), the losses see the logits of the real positions
        multiple = self.layout.tensor if self.settings.sequence_parallel else 1
        padded = -(-width // multiple) * multiple
        device = self._device()
        positions = torch.arange(padded, device=device).unsqueeze(0).expand(batch, padded)

        def forward_step(data_iterator: Iterator[dict], model: Any):
            mb = next(data_iterator)
            on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}
            tokens = torch.nn.functional.pad(on_device["tokens"], (0, padded - width), value=self.pad_id)
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)

            def loss_func(output: torch.Tensor):  # [b, padded, V/TP] logits (last pipeline stage only)
                loss, reported = loss_of(on_device, output[:, :width])
                # 3 values + calculate_per_token_loss: the schedule leaves the loss as the stage normalised it
                return loss, torch.ones((), dtype=torch.int), reported

            return logits, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=self.chunks,
            num_microbatches=len(micro_batches), seq_length=padded, micro_batch_size=batch, forward_only=forward_only)

    @torch.no_grad()
    def _logprobs_of_current_weights(self, rollout: Rollout) -> torch.Tensor:
        rows, width = len(rollout), int(rollout.response_lengths.max())
        size = min(self.cfg.forward_micro_batch_size, rows)
        padded_rows = -(-rows // size) * size  # equal micro batches (pipeline stages exchange fixed shapes)
        tokens = torch.full((padded_rows, width), self.pad_id, dtype=torch.long)
        tokens[:rows] = rollout.tokens[:, :width]
        self.model.eval()

        def logprobs_of(mb: dict, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            lp = self._token_outputs(logits, mb["tokens"], need_entropy=False)["logprobs"]
            return torch.zeros((), device=lp.device), {"logprobs": lp.float().cpu()}

        reported = self._run_schedule([{"tokens": t} for t in tokens.split(size)], logprobs_of, forward_only=True)
        out = torch.zeros(padded_rows, width - 1)
        if reported:
            out = torch.cat([r["logprobs"] for r in reported])
        out = self._from_last_pipeline_stage(out)
        full = torch.zeros(rows, rollout.tokens.shape[1] - 1)
        full[:, : width - 1] = out[:rows]
        return full

    def _from_last_pipeline_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the last pipeline stage holds it, on every stage of this replica."""
        from megatron.core import parallel_state

        if self.layout.pipeline == 1:
            return tensor
        moved = tensor.to(collective_device())
        torch.distributed.broadcast(moved, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
        return moved.cpu()

    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        return self._logprobs_of_current_weights(rollout)

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        current = self._swap_weights(self._reference)
        try:
            return self._logprobs_of_current_weights(rollout)
        finally:
            self._swap_weights(current)

    # ---- reference policy ---------------------------------------------------------------------------
    def _local_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def _swap_weights(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``weights`` into the policy in place (Megatron's grad/param buffers keep their views); returns the
        weights they replaced, where the reference would be kept."""
        keep = self._reference_device()
        replaced = {}
        with torch.no_grad():
            for name, param in self._local_weights().items():
                replaced[name] = param.detach().to(keep, copy=True)
                param.copy_(weights[name])
        return replaced

    def _reference_device(self) -> torch.device:
        return torch.device("cpu") if self.cfg.reference == "cpu_weight_swap" else self._device()

    def reset_reference(self) -> None:
        """This rank's shard of the current weights becomes the reference (copies: never views of live parameters)."""
        keep = self._reference_device()
        self._reference = {n: p.detach().to(keep, copy=True) for n, p in self._local_weights().items()}
        self.reference_is_initial = False

    # ---- training -----------------------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int,
                   need_entropy: bool = False) -> dict[str, float]:
        size = check_train_batch(batch, micro_batch_size)
        trimmed = _trim_to_longest(batch)
        micro = [{k: v[i : i + micro_batch_size] if _per_row(v, size) else v for k, v in trimmed.items()}
                 for i in range(0, size, micro_batch_size)]

        def loss_of(mb: dict, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss, metrics = loss_fn(self._token_outputs(logits, mb["tokens"], need_entropy), mb)
            reported = {k: torch.as_tensor(float(v)) for k, v in metrics.items()}
            reported["loss"] = loss.detach().float().cpu()  # this micro batch's share of the step's loss
            return loss, reported

        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = self._run_schedule(micro, loss_of, forward_only=False)
        grad_norm = self._reduce_gradients()
        lr = self.schedule.current_lr()
        stepped, _, _ = self.optimizer.step()
        if not stepped:
            raise RuntimeError("Megatron's optimizer skipped the step (a non-finite gradient)")
        self.schedule.step()
        return {**self._step_metrics(reduced), "grad_norm": grad_norm, "lr": lr}

    def _reduce_gradients(self) -> float:
        """Sum the gradients over data-parallel ranks (and the layer norms / embeddings Megatron keeps in sync), then
        their global norm — refusing to step on a non-finite one."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads(self.chunks, num_tokens=None)
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.zero_grad()
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} in the policy update; lower "
                                     "model.optim.lr or check the reward for inf values")
        return grad_norm

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
    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        if self.settings.distributed_optimizer:
            # before the first step (a fresh process loading, a save at step 0) Adam has no state, and Megatron's
            # distributed optimizer cannot describe (AssertionError) nor load (KeyError) a state without it
            build.initialize_adam_state(self.optimizer)
        model = self.model.sharded_state_dict()
        optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=_OPTIMIZER_FORMAT)
        return {"model": model, "optimizer": optimizer}

    def save(self, path: Path) -> None:
        """Weights + optimiser as a Megatron distributed checkpoint (``megatron/``), the LR schedule, and the reference:
        its record while it is the initial checkpoint, else its own distributed checkpoint (``reference/``)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        self._make_dirs(path / "megatron")
        dist_checkpointing.save(self._sharded_state(loading=False), str(path / "megatron"))
        if self.reference_is_initial:
            record = self.initial_reference
        else:
            self._make_dirs(path / "reference")
            dist_checkpointing.save(self._reference_shards(self._reference)[0], str(path / "reference"))
            record = ref_record.stored_record("reference")
        if self.global_rank == 0:
            state = {**self.schedule.state_dict(), "use_distributed_optimizer": self.cfg.megatron.use_distributed_optimizer}
            (path / _SCHEDULE_FILE).write_text(json.dumps(state), encoding="utf-8")
            ref_record.write_record(path, record)
        self.barrier()

    def _make_dirs(self, where: Path) -> None:
        if self.global_rank == 0:
            where.mkdir(parents=True, exist_ok=True)
        self.barrier()

    def _reference_shards(self, weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, str]]:
        """The model's sharded state dict (its TP/PP layout, global layer numbers) with ``weights`` — keyed by this
        stage's parameter names — as the data: the reference is written and read like the policy, so it loads at
        another layout. Entries are matched to parameters by storage (SwiGLU's fused ``linear_fc1`` is a factory that
        shards its two halves separately). Returns (the sharded entries, the parameter name of each entry's key)."""
        from dataclasses import replace

        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        name_of = {(p.data_ptr(), tuple(p.shape)): n for n, p in self._local_weights().items()}
        shards, names = {}, {}
        for key, entry in self.model.sharded_state_dict().items():
            if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
                continue
            name = name_of.get((entry.data.data_ptr(), tuple(entry.data.shape)))
            if name is not None:
                shards[key], names[key] = replace(entry, data=weights[name]), name
        left = sorted(set(weights) - set(names.values()))
        if left:  # a weight the reference checkpoint would silently not hold
            raise RuntimeError(f"reference weights without a sharded-state entry: {left[:4]}")
        return shards, names

    def load(self, path: Path) -> None:
        """What ``save`` wrote, at this run's layout (any TP/PP/DP)."""
        path = Path(path)
        state = json.loads((path / _SCHEDULE_FILE).read_text(encoding="utf-8"))
        written = state.pop("use_distributed_optimizer")
        if written != self.cfg.megatron.use_distributed_optimizer:  # the two optimizers' states are stored differently
            raise FactualityInputError(f"{path} was written with model.megatron.use_distributed_optimizer={written}; "
                                       "resume with the same setting (the TP/PP/DP layout may change)")
        self.load_weights(path, with_optimizer=True)
        self.schedule.load_state_dict(state)
        record = ref_record.read_record(path)
        if record is None:
            raise FileNotFoundError(f"{path} has no {ref_record.RECORD}: not written by MegatronActor.save")
        if record["kind"] == "initial":
            ref_record.check_initial(record, self.cfg.path, path)
            if not self.reference_is_initial:
                raise FactualityInputError(f"{path}: its reference is the initial checkpoint, but this process reset "
                                           "its reference since it started; load the checkpoint in a fresh run")
        else:
            from megatron.core import dist_checkpointing

            shards, names = self._reference_shards({k: v.clone() for k, v in self._reference.items()})  # this layout
            loaded = dist_checkpointing.load(shards, str(path / record["where"]))
            self._reference = {names[k]: v.to(self._reference_device()) for k, v in loaded.items()}
            self.reference_is_initial = False

    def load_weights(self, path: Path, *, with_optimizer: bool = False) -> None:
        """The policy weights of a ``save`` directory (the stages' restore-best-on-early-stop), and with
        ``with_optimizer`` the optimiser state too."""
        from megatron.core import dist_checkpointing

        where = Path(path) / "megatron"
        if not (where / "metadata.json").is_file():
            raise FileNotFoundError(f"{where} holds no distributed checkpoint: not written by MegatronActor.save")
        state = self._sharded_state(loading=True)
        if not with_optimizer:
            state.pop("optimizer")
        loaded = dist_checkpointing.load(state, str(where))
        self.model.load_state_dict(loaded["model"], strict=False)
        if with_optimizer:
            build.load_optimizer_state(self.optimizer, loaded["optimizer"])
        else:  # bf16: the optimizer's fp32 main weights would otherwise overwrite these at the next step
            self.optimizer.reload_model_params()
        self.barrier()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy in the HF checkpoint's tensor names, CPU copies (a rollout engine's refit). Collective: every
        rank of the job takes part (Bridge gathers each weight over tensor and pipeline parallelism once) and every
        rank gets every tensor; copies, because on CPU the exported tensors can alias the live parameters."""
        return {name: tensor.detach().to("cpu", copy=True).contiguous()
                for name, tensor in self.bridge.export_hf_weights(self.chunks, cpu=True, show_progress=False)}

    def export(self, path: Path) -> None:
        """An HF folder ``transformers`` loads (collective; global rank 0 writes it)."""
        from nemo_factuality.fileio import respect_umask

        path = Path(path)
        self.bridge.save_hf_pretrained(self.chunks, str(path), show_progress=False)
        if self.global_rank == 0:
            respect_umask(path)  # safetensors writes 0600 through a temporary file: the policy is an ordinary output
        self.barrier()


def _per_row(value: Any, rows: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows


def _trim_to_longest(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The batch cut to its longest sequence (every micro batch then has one shape, as pipeline stages need):
    ``tokens`` to that width, per-token ``[B, S-1]`` tensors to one less."""
    width = int(batch["response_lengths"].max())
    full = batch["tokens"].shape[1]
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "tokens":
            out[key] = value[:, :width]
        elif torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == full - 1:
            out[key] = value[:, : width - 1]
        else:
            out[key] = value
    return out


def build_megatron(cfg: Any, *, critic: bool = False, max_steps: int) -> tuple[MegatronActor, None]:
    """(actor, None) for a stage config with ``trainer.backend=megatron`` (the ``BACKENDS`` builder shape)."""
    from nemo_factuality.config import ConfigError

    if critic:
        raise ConfigError("trainer.backend=megatron has no critic yet (PPO / RLFH): use trainer.backend=hf or aligner")
    t = cfg.trainer
    return MegatronActor(cfg.model, max_steps=max_steps, gradient_clip_val=t.gradient_clip_val, seed=t.seed,
                         device=t.device), None
