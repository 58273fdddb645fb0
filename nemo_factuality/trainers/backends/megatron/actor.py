"""The ``megatron`` backend: a ``PolicyActor`` on Megatron-Core 0.16 built from an HF checkpoint by Megatron-Bridge 0.3
(``trainer.backend=megatron``), at any TP/PP; data parallelism over the rest of the torchrun/srun job.

* Build (``build.py``): ``AutoBridge`` turns ``model.path`` (an HF folder) into Megatron-Core's ``GPTModel``
  for this rank's TP/PP shard, wrapped in Megatron's DDP, with ``get_megatron_optimizer`` (Megatron's distributed
  optimizer with ``model.megatron.use_distributed_optimizer``) and every backend's LR schedule.
* Settings (``build.Settings``): ``model.dtype=bfloat16`` (bf16 weights and activations, fp32 main weights and
  gradient reduction), ``model.megatron.sequence_parallel`` (the batch right-padded to a multiple of TP for it),
  ``model.megatron.recompute``, ``model.megatron.transformer_engine`` (the TE layer spec or the local one).
* Rollouts (``generate.py``): Megatron-Core's static inference engine with a KV cache, sampling from the
  distribution the log-probs here are of (temperature, top-k, top-p as transformers applies them); sequence
  parallelism is off while it runs (the engine has none for dense models).
* Log-probs and training (``model.py``, shared with the critic, ``critic.py``): Megatron's
  forward/backward schedule (pipelined at PP > 1), the gradient the plain sum over micro batches and data-parallel
  ranks (the stages' losses are normalised by the global counts); metrics as the aligner backend reports them.
* Reference policy: a copy of this rank's shard of the initial weights (``model.reference``: ``copy`` keeps it on the
  model's device, ``cpu_weight_swap`` in host memory), swapped into the policy for the reference log-probs.
* Checkpoints: a Megatron distributed checkpoint of weights and optimiser (``megatron/``: every tensor once, whatever
  the layout; it loads at another TP/PP/DP; ``build.load_optimizer_state`` works around Megatron's distributed
  optimizer failing to load torch AdamW's step) plus the LR schedule (``MegatronModel.save_model``). The reference is
  not written while it is the initial HF checkpoint (``reference.json`` records ``model.path`` and its fingerprint, as
  the hf backend does); after ``reset_reference`` (KTO) it is a distributed checkpoint of its own (``reference/``).
* ``export``: an HF folder ``transformers`` loads (Bridge's ``save_hf_pretrained``: the gathered weights, the source
  checkpoint's config and tokenizer files).

Importing this module imports nothing from Megatron; the heavy stack loads in ``MegatronActor.__init__``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.trainers import reference as ref_record
from nemo_factuality.trainers.backends.collectives import on_group_source
from nemo_factuality.trainers.backends.hf.actor import SampledDistribution, token_logprobs
from nemo_factuality.trainers.backends.megatron import build
from nemo_factuality.trainers.backends.megatron.generate import (
    DynamicGenerator,
    check_inference_engine,
    cuda_graphs_on,
    generate_static_batch,
    sequence_parallel_off,
)
from nemo_factuality.trainers.backends.megatron.model import MegatronModel
from nemo_factuality.trainers.interfaces import LossFn, Rollout, RolloutChunk, SamplingParams, assemble_rollout
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)


class MegatronActor(MegatronModel):
    """``PolicyActor`` on Megatron-Core + Megatron-Bridge (module docstring); one instance per rank."""

    def __init__(self, cfg: Any, *, max_steps: int, distributed_timeout_s: float, gradient_clip_val: float = 1.0,
                 seed: int = 1234, device: str = "cpu", max_sequence_length: int | None = None) -> None:
        from transformers import AutoTokenizer

        from nemo_factuality.local_models import from_pretrained

        if not cfg.path:
            raise FactualityInputError("model.path must be an HF checkpoint folder (trainer.backend=megatron)")
        self.cfg = cfg
        check_inference_engine(cfg.megatron.inference_engine, cfg.megatron.attention_kernels)
        sampling_seed = torch.initial_seed()  # the stage's seed: Megatron's own seeding must not replace it
        self.on_gpu = device.startswith("cuda")
        self.settings = build.Settings.of(cfg, on_gpu=self.on_gpu)
        self.layout = build.init_process_groups(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                                device, seed, distributed_timeout_s,
                                                cudagraphable_rng=self.settings.cuda_graphs,
                                                gloo=self.settings.gloo_process_groups)
        self.bridge, self.chunks = build.build_model(cfg.path, self.layout, self.settings, on_gpu=self.on_gpu)
        # this rank's GPTModel (one pipeline stage; no virtual pipelining), inside DDP (and Float16Module with bf16):
        # its parameter names and state dict are the checkpoints' and the reference's whatever the wrappers
        self.model = build.bare_model(self.chunks[0])
        # the run's dynamic engine (built by the first dynamic generate), its context sized for the stage's sequences
        self._dynamic: DynamicGenerator | None = None
        self.max_sequence_length = max_sequence_length
        torch.manual_seed(sampling_seed + self.data_parallel_rank)  # replicas sample different rollouts
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, cfg.path, "model.path")
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer at {cfg.path} has no eos_token; set one so responses can end")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.distribution = SampledDistribution.of(cfg.sampling_params)
        self._setup_training(cfg.optim, max_steps=max_steps, gradient_clip_val=gradient_clip_val, role="policy",
                             lr_key="model.optim.lr")
        self._reference: dict[str, torch.Tensor] = {}
        self.reset_reference()
        # the reference is the checkpoint at model.path until reset_reference(): checkpoints record it, not copy it
        self.initial_reference = ref_record.initial_record(cfg.path, "model.path")
        self.reference_is_initial = True

    # ---- parallel layout ----------------------------------------------------------------------------
    @property
    def is_model_parallel_source(self) -> bool:
        """Whether this rank is its model replica's source rank (the one that calls the reward)."""
        return self.global_rank == min(torch.distributed.get_process_group_ranks(self._model_parallel_group()))

    def on_model_parallel_source(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` once per model replica, the result (or its error) on every rank of the replica."""
        return on_group_source(fn, self._model_parallel_group())

    # ---- rollouts -----------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        """``generate_chunks`` assembled in prompt order, right-padded with ``pad_id`` to one width."""
        return assemble_rollout(list(self.generate_chunks(prompt_ids, sampling)), self.pad_id)

    def generate_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[RolloutChunk]:
        """Chunks of ``model.rollout_micro_batch_size`` rows from ``model.megatron.inference_engine``'s engine, each
        yielded as soon as it is generated."""
        if not prompt_ids:
            raise ValueError("generate: no prompts")
        asked = SampledDistribution.of(sampling)
        if not sampling.use_greedy and asked != self.distribution:
            raise ValueError(f"generate: sampling from {asked} but the log-probs are of {self.distribution} "
                             "(model.sampling_params: temperature, top_k, top_p)")
        if self.cfg.megatron.inference_engine == "dynamic":
            return self._dynamic_chunks(prompt_ids, sampling, asked)
        return self._static_chunks(prompt_ids, sampling, asked)

    def _dynamic_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                        asked: SampledDistribution) -> Iterator[RolloutChunk]:
        """All prompts through the run's dynamic engine (``model.rollout_micro_batch_size`` in flight); the model is in
        generation mode (eval, no grad, no SP, its CUDA graphs on) only while the engine steps, not while the stage
        holds a chunk."""
        # the start-up check again (idempotent): binds the torch kernels where the engine was switched on since
        check_inference_engine("dynamic", self.cfg.megatron.attention_kernels)
        if self._dynamic is None:
            self._dynamic = DynamicGenerator(self.model, self.tokenizer, self.pad_id, self.max_sequence_length)
        m = self.cfg.megatron
        steps = self._dynamic.chunks(prompt_ids, sampling, asked, eos_id=self.eos_id,
                                     max_requests=self.cfg.rollout_micro_batch_size, buffer_gb=m.inference_buffer_gb,
                                     block_tokens=m.inference_block_tokens, max_step_tokens=m.inference_max_step_tokens,
                                     cuda_graphs=m.inference_cuda_graphs if self.settings.cuda_graphs else 0)
        while True:
            self.model.eval()
            with torch.no_grad(), sequence_parallel_off(self.model), cuda_graphs_on(self.model, self.settings.cuda_graphs):
                chunk = next(steps, None)
            if chunk is None:
                return
            yield chunk

    def _static_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                       asked: SampledDistribution) -> Iterator[RolloutChunk]:
        """Static batches of ``model.rollout_micro_batch_size`` prompts, bucketed by length (a stable sort: a prompt's
        samples stay together)."""
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
        if self.layout.tp > 1 and not need_entropy and not d.truncation():
            scaled = logits[:, :-1].float() / d.temperature
            return {"logprobs": -tensor_parallel.vocab_parallel_cross_entropy(scaled, tokens[:, 1:])}
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        out = {"logprobs": token_logprobs(full, tokens, d)}
        if need_entropy:
            out["entropy"] = d.entropy(full[:, :-1])
        return out

    def _logprobs_of_current_weights(self, rollout: Rollout) -> torch.Tensor:
        return self._per_token(rollout, self.cfg.forward_micro_batch_size,
                               lambda logits, tokens: self._token_outputs(logits, tokens, need_entropy=False)["logprobs"],
                               self.pad_id)

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
        return self._train_step(batch, loss_fn, micro_batch_size,
                                lambda logits, mb: self._token_outputs(logits, mb["tokens"], need_entropy))

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Weights + optimiser as a Megatron distributed checkpoint (``megatron/``), the LR schedule, and the reference:
        its record while it is the initial checkpoint, else its own distributed checkpoint (``reference/``)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        self.save_model(path)
        if self.reference_is_initial:
            record = self.initial_reference
        else:
            self._make_dirs(path / "reference")
            dist_checkpointing.save(self._reference_shards(self._reference)[0], str(path / "reference"))
            record = ref_record.stored_record("reference")
        if self.global_rank == 0:
            ref_record.write_record(path, record)
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
        self.load_model(path)
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

    def load_weights(self, path: Path) -> None:
        """The policy weights of a ``save`` directory (the stages' restore-best-on-early-stop)."""
        self.load_model_weights(path)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy in the HF checkpoint's tensor names, CPU copies (a rollout engine's refit by file).
        Collective (``hf_weights``); copies, because on CPU the exported tensors can alias the live parameters."""
        return {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in self.hf_weights()}

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in the HF checkpoint's names, one at a time as Bridge exports it (on this rank's
        device). Collective: every rank of the job iterates it to the end (Bridge gathers each weight over tensor
        and pipeline parallelism once) and every rank gets every tensor."""
        for name, tensor in self.bridge.export_hf_weights(self.chunks, cpu=not self.on_gpu, show_progress=False):
            yield name, tensor.detach()

    def hf_weights_manifest(self) -> list[tuple[str, str, list[int]]]:
        """``[name, dtype, shape]`` of each tensor ``hf_weights`` yields: the checkpoint's at ``model.path`` (Bridge
        exports its names and shapes; the engine started from it), read from the safetensors headers only."""
        from nemo_factuality.convert.safetensors_io import DTYPE_NAMES, read_header

        floats = (torch.float32, torch.bfloat16, torch.float16)
        manifest = []
        for file in sorted(Path(self.cfg.path).glob("*.safetensors")):
            for name, entry in read_header(file).items():
                if entry.dtype not in floats:
                    raise FactualityInputError(f"{file}: {name} is {DTYPE_NAMES[entry.dtype]}, not a float the refit "
                                               "streams")
                manifest.append((name, str(entry.dtype).removeprefix("torch."), list(entry.shape)))
        if not manifest:
            raise FactualityInputError(f"model.path={self.cfg.path} holds no safetensors files: the refit's manifest "
                                       "is read from them")
        return manifest

    def export(self, path: Path) -> None:
        """An HF folder ``transformers`` loads (collective; global rank 0 writes it)."""
        from nemo_factuality.fileio import respect_umask

        path = Path(path)
        self.bridge.save_hf_pretrained(self.chunks, str(path), show_progress=False)
        if self.global_rank == 0:
            respect_umask(path)  # safetensors writes 0600 through a temporary file: the policy is an ordinary output
        self.barrier()


def build_megatron(cfg: Any, *, critic: bool = False, max_steps: int) -> tuple[MegatronActor, Any]:
    """(actor, critic or None) for a stage config with ``trainer.backend=megatron`` (the ``BACKENDS`` builder shape); the
    critic (PPO) is a second Megatron-Core model on the actor's layout (``critic.py``)."""
    t, m = cfg.trainer, cfg.model
    longest = cfg.data.max_prompt_tokens + m.length_params.max_length  # a prompt + its response, at most
    actor = MegatronActor(m, max_steps=max_steps, distributed_timeout_s=t.distributed_timeout_s,
                          gradient_clip_val=t.gradient_clip_val, seed=t.seed, device=t.device,
                          max_sequence_length=longest)
    if not critic:
        return actor, None
    from nemo_factuality.trainers.backends.megatron.critic import MegatronCritic

    value_model = MegatronCritic(cfg.critic, m.path, tensor=m.tensor_model_parallel_size,
                                 pipeline=m.pipeline_model_parallel_size, max_steps=max_steps,
                                 distributed_timeout_s=t.distributed_timeout_s, gradient_clip_val=t.gradient_clip_val,
                                 seed=t.seed, device=t.device, settings=actor.settings)
    return actor, value_model
