"""The ``aligner`` backend: a ``PolicyActor`` over NeMo-Aligner 0.7.0's Megatron REINFORCE actor (TP/PP/DP).

The policy is ``MegatronGPTReinforceActorModel`` restored from a ``.nemo`` that ``nemo-factuality
convert hf-to-nemo`` wrote, through Aligner's own ``load_and_override_model_config`` / ``load_from_nemo``
/ ``init_distributed`` / ``init_using_ptl``. Everything the stages call goes through Aligner's
``AlignableGenerativeInterface`` (``prepare_for_inference`` → ``infer`` / ``get_inference_log_probs`` /
``get_init_policy_logprobs`` (``cpu_weight_swap``) → ``finish_inference``; ``prepare_for_training`` →
``prepare_for_training_step`` → ``get_loss_and_metrics`` → ``finish_training_step``). One subclass
(``_stage_actor_class``) replaces the REINFORCE loss with the stage's backend-agnostic ``LossFn``, so
GRPO, dense-reward PPO and (f)KTO all train through Aligner's forward/backward path. The PPO actor
(``MegatronGPTActorModel``) differs from the REINFORCE one only in its loss and config section, both of
which the stage supplies, so one actor class serves every method.

Loss scaling: Megatron's schedule divides each micro batch's loss by the number of micro batches and
NeMo averages gradients over data-parallel ranks; the stage's losses are already normalised by the
global count, so the loss handed to Megatron is multiplied back by both and the result is the plain
sum of gradients over micro batches and DP ranks. ``all_reduce_sum`` gives the stage its global counts.

Checkpoints: NeMo's distributed checkpoint of weights, optimiser and schedule (each tensor written once,
whatever the layout). The reference policy is not written while it is the initial ``.nemo`` (GRPO, PPO):
``reference.json`` records ``model.restore_from_path`` and its fingerprint, and a resumed run's restore of
that path is the reference again (on any layout). After ``reset_reference`` (KTO) it is a Megatron
distributed checkpoint of its own (``reference/``): written once (data-parallel replicas deduplicated),
sharded like the policy, and loaded into whatever TP/PP/DP the resumed run has.

Importing this module imports nothing from NeMo; the heavy stack loads in ``AlignerActor.__init__``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.config import dotlist as _dotlist
from nemo_factuality.config import merge_tree as _merge
from nemo_factuality.trainers import reference as ref_record
from nemo_factuality.trainers.backends.aligner.optimizer import (
    offload_optimizer_states,
    onload_optimizer_states,
    restore_training_state,
    shardable_adam_steps,
)
from nemo_factuality.trainers.backends.collectives import (
    ProcessGroupDataParallel,
    collective_device,
    group_timeout,
    on_megatron_model_parallel_source,
)
from nemo_factuality.trainers.config import TrainerConfig
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



@dataclass
class AlignerRuntime:
    """How the actor is placed and optimised: NeMo's trainer + model knobs the stage config does not carry."""

    devices: int = 1  # processes per node (one per GPU; torchrun/srun start them)
    num_nodes: int = 1  # nodes the Megatron ranks span
    accelerator: str = "auto"  # auto = gpu when CUDA is available, else cpu (gloo)
    max_steps: int = 100  # the LR schedule's horizon (optimiser steps)
    gradient_clip_val: float = 1.0  # NeMo's gradient clipping
    seed: int = 1234  # NeMo's seed
    rollout_micro_batch_size: int = 16  # prompts generated together (KV cache ∝ this × sequence length)
    # the default process group's timeout (the stage's trainer.distributed_timeout_s; Lightning's strategy would
    # otherwise use its own 30 minutes)
    distributed_timeout_s: float = TrainerConfig.distributed_timeout_s
    # Merged last onto the checkpoint's model config (Aligner's ``++model.*`` overrides), e.g. the
    # presets' activation recompute / distributed optimizer / sequence parallel settings.
    model_overrides: dict[str, Any] = field(default_factory=dict)


def _plain(cfg: Any) -> dict:
    if is_dataclass(cfg):
        return asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)


def nemo_optim(optim: Mapping[str, Any], max_steps: int) -> dict:
    """The stage's ``model.optim`` (adamw|sgd, or mcore_distributed_optim via the model overrides; constant|cosine) as NeMo's ``model.optim``."""
    sched = optim.get("sched") or {}
    name = sched.get("name", "constant")
    if name == "cosine":
        nemo_sched = {"name": "CosineAnnealing", "warmup_steps": sched.get("warmup_steps", 0),
                      "min_lr": sched.get("min_lr", 0.0), "max_steps": max_steps}
    elif name == "constant":
        nemo_sched = {"name": "WarmupPolicy", "warmup_steps": sched.get("warmup_steps", 0), "max_steps": max_steps}
    else:
        raise ValueError(f"model.optim.sched.name={name!r}: the aligner backend supports constant | cosine")
    out = {"name": optim.get("name", "adamw"), "lr": optim["lr"], "weight_decay": optim.get("weight_decay", 0.0),
           "sched": nemo_sched}
    if out["name"] == "sgd":
        out["momentum"] = optim.get("momentum", 0.0)
    else:
        out["betas"] = list(optim.get("betas", (0.9, 0.999)))
        out["eps"] = optim.get("eps", 1e-8)
    return out


# Keys NeMo's trainer builder and Aligner's models read that SFT checkpoints carry and converted ones do not
CONVERTED_CHECKPOINT_KEYS = {
    "gradient_as_bucket_view": True,
    "peft": {"peft_scheme": "none", "restore_from_path": None},
    "data": {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False},
}
_PRECISION = {"float32": 32, "bfloat16": "bf16-mixed", "float16": "16-mixed"}


# TensorRT-LLM's model_type per HF family (its LLaMA builder has no QKV biases; its Qwen builder does)
TRTLLM_MODEL_TYPES = {"qwen2": "qwen", "llama": "llama"}


def trtllm_model_type(configured: str | None, checkpoint: str | Path) -> str:
    """``rollout.trtllm_model_type`` when set, else the checkpoint's family (``convert.nemo_format.checkpoint_family``:
    every preset is Qwen2, whose QKV biases a ``llama`` engine would drop)."""
    if configured:
        return configured
    from nemo_factuality.convert.nemo_format import checkpoint_family

    return TRTLLM_MODEL_TYPES[checkpoint_family(checkpoint)]


def trt_llm_section(engine: str, runtime: AlignerRuntime, *, model_type: str | None = None,
                    max_input_len: int = 1024) -> dict:
    """Aligner's ``reinforce.trt_llm`` section: ``rollout.engine=trtllm`` turns on its ``GPTGenerateTRTLLM`` (engine
    built at the first rollout, refit after every update, rebuilt after a checkpoint load: ``AlignerActor``).

    ``max_input_len`` is the longest prompt (``data.max_prompt_tokens``); the engine's batch is the rollout micro
    batch (``reinforce.rollout_micro_batch_size``). The engine stays loaded during training (``unload_engine_train``
    false: the stages open an inference window per call) and the pipeline stages are not resharded (``reshard``
    false: that reshapes the data-parallel layout, which the stages own)."""
    if engine not in ("megatron", "trtllm"):
        raise ValueError(f"rollout.engine={engine!r}: choose megatron or trtllm")
    if engine == "trtllm" and not model_type:
        raise ValueError("rollout.engine=trtllm needs the engine's model_type (trtllm_model_type)")
    return {"enable": engine == "trtllm", "max_input_len": max_input_len, "model_type": model_type,
            "unload_engine_train": False, "reshard": False, "seed": runtime.seed}


def model_overrides(model_cfg: Mapping[str, Any], runtime: AlignerRuntime, trt_llm: Mapping[str, Any] | None = None) -> dict:
    """Aligner's ``model`` section for the REINFORCE actor, from the stage's ``model.*`` (wins over the checkpoint);
    ``trt_llm``: its ``reinforce.trt_llm`` section (``trt_llm_section``; default: NeMo's generation)."""
    sampling, length = model_cfg.get("sampling_params", {}), model_cfg.get("length_params", {})
    precision = _PRECISION[model_cfg.get("dtype", "float32")]
    out = {
        "tensor_model_parallel_size": model_cfg.get("tensor_model_parallel_size", 1),
        "pipeline_model_parallel_size": model_cfg.get("pipeline_model_parallel_size", 1),
        "micro_batch_size": model_cfg.get("micro_batch_size", 1),
        "global_batch_size": model_cfg.get("global_batch_size", 1),
        "precision": precision, "seed": runtime.seed,
        "optim": nemo_optim(model_cfg.get("optim", {"lr": 1e-6}), runtime.max_steps),
        **CONVERTED_CHECKPOINT_KEYS,
        "reinforce": {
            "rollout_micro_batch_size": runtime.rollout_micro_batch_size,  # TensorRT-LLM's engine batch
            "forward_micro_batch_size": model_cfg.get("forward_micro_batch_size", 8),
            "offload_adam_states": True,  # only acts with the distributed optimizer
            "sampling_params": {"use_greedy": sampling.get("use_greedy", False), "temperature": sampling.get("temperature", 1.0),
                                "top_k": sampling.get("top_k", 0), "top_p": sampling.get("top_p", 1.0),
                                "repetition_penalty": 1.0, "add_BOS": False, "all_probs": False,
                                "compute_logprob": False, "end_strings": []},
            "length_params": {"max_length": length.get("max_length", 256), "min_length": 1},
            "trt_llm": dict(trt_llm) if trt_llm is not None else trt_llm_section("megatron", runtime),
        },
    }
    return _merge(out, runtime.model_overrides)


def stage_forward_step(loss_fn: LossFn, need_entropy: bool, scale: float) -> Callable:
    """Megatron's ``forward_step_func`` for the stage's loss: the micro batch's vocab-parallel logits → the response's
    log-probs ``[b, S-1]`` (and entropy when the loss needs it) → ``loss_fn``; the loss scaled by ``scale`` (micro
    batches × DP: Megatron averages over both, the stage's loss is already a share of the step's)."""
    from nemo_aligner.utils.distributed import from_parallel_logits_to_logprobs

    def fwd_output_and_loss_func(data_iterator, model):
        batch = next(data_iterator)
        batch = {k: v.to(torch.cuda.current_device()) if torch.is_tensor(v) else v for k, v in batch.items()}
        parallel_logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=None)

        def loss_func(parallel_logits):
            # [b, S-1] for the stage's S: columns added for sequence parallelism are dropped
            width = batch["mask"].shape[1] if "mask" in batch else batch["tokens"].shape[1] - 1
            out = {"logprobs": from_parallel_logits_to_logprobs(vocab_parallel_logits=parallel_logits,
                                                                target=batch["tokens"], higher_stability=True)[:, :width]}
            if need_entropy:
                out["entropy"] = _token_entropy(parallel_logits)[:, :width]
            loss, metrics = loss_fn(out, batch)
            reported = {k: torch.as_tensor(float(v)) for k, v in metrics.items()}
            reported["loss"] = loss.detach().float()  # this micro batch's share of the step's loss
            return loss * scale, reported

        return parallel_logits, loss_func

    return fwd_output_and_loss_func


@functools.lru_cache(maxsize=1)
def _stage_actor_class():
    """``MegatronGPTReinforceActorModel`` with the stage's loss in Aligner's forward/backward path."""
    from megatron.core import parallel_state as mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel
    from nemo_aligner.utils.train_utils import set_sync_funcs

    class StageReinforceActor(MegatronGPTReinforceActorModel):
        stage_loss_fn: LossFn | None = None
        stage_need_entropy: bool = False
        trtllm_stale: bool = True  # the TensorRT-LLM engine lags the weights (set by updates and checkpoint loads)

        def prepare_for_inference(self):
            """Aligner's, except that the TensorRT-LLM engine is refit only when the weights changed since the last
            refit: the stages open an inference window per call (log-probs too), Aligner's trainer one per step."""
            trtllm, self.use_trtllm_generation = self.use_trtllm_generation, False
            try:
                super().prepare_for_inference()
            finally:
                self.use_trtllm_generation = trtllm
            if trtllm and self.trtllm_stale:
                self.trtllm_generate.refit(self.model)  # builds the engine the first time
                self.trtllm_stale = False

        def get_actor_forward_output_and_loss_func(self):
            scale = get_num_microbatches() * mpu.get_data_parallel_world_size()
            return stage_forward_step(self.stage_loss_fn, self.stage_need_entropy, scale)

        def offload_adam_states(self):
            # Aligner 0.7.0 offloads only Apex's distributed Adam (its bucket layout); Megatron-Core's distributed
            # optimizer (`mcore_distributed_optim`) gets the same treatment here.
            if not self.use_mcore_dist_optim:
                return super().offload_adam_states()
            if self.to_offload_adam_states and getattr(self, "_offloaded_optimizer_states", None) is None:
                self._offloaded_optimizer_states = offload_optimizer_states(self._optimizer.mcore_optimizer)
            return None

        def onload_adam_states(self):
            if not self.use_mcore_dist_optim:
                return super().onload_adam_states()
            if getattr(self, "_offloaded_optimizer_states", None) is not None:
                onload_optimizer_states(self._offloaded_optimizer_states)
                self._offloaded_optimizer_states = None
            return None

        def _reset_sequence_parallelism_args(self):
            # NeMo 2.2 turns sequence parallelism off for generation module by module, but megatron-core 0.12's
            # embeddings (RoPE models) keep reduce-scattering their output over TP: generation then fails or
            # sees a slice of the sequence. Switch that off too, and back on in the restore below.
            super()._reset_sequence_parallelism_args()
            self._scattering_embeddings = [mod for module in self.get_model_module_list() for mod in module.modules()
                                           if getattr(mod, "reduce_scatter_embeddings", False)]
            for mod in self._scattering_embeddings:
                mod.reduce_scatter_embeddings = False

        def _restore_sequence_parallelism_args(self):
            super()._restore_sequence_parallelism_args()
            for mod in getattr(self, "_scattering_embeddings", []):
                mod.reduce_scatter_embeddings = True
            self._scattering_embeddings = []

        def get_loss_and_metrics(self, batch, forward_only):
            tokens = batch["tokens"]
            attention_mask, _, position_ids = self.get_ltor_masks_and_position_ids(tokens=tokens)
            batch = dict(batch, attention_mask=attention_mask, position_ids=position_ids)
            data_iter = iter(split_micro_batches(batch, get_num_microbatches()))
            set_sync_funcs(self, forward_only)
            # the micro batch train_step configured, not the model config's: pipeline stages size the activations
            # they send and receive by it (a mismatch is a gloo/NCCL size error or a hang at PP>1)
            reduced = get_forward_backward_func()(
                forward_step_func=self.get_actor_forward_output_and_loss_func(),
                data_iterator=self._make_data_iterator_list(data_iter), model=self.model,
                num_microbatches=get_num_microbatches(), forward_only=forward_only, seq_length=tokens.size(1),
                micro_batch_size=tokens.size(0) // get_num_microbatches())
            return _step_metrics(reduced)

    return StageReinforceActor


def _step_metrics(reduced: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, float]]:
    """Loss functions' metrics averaged over micro batches; ``loss`` summed over micro batches and DP ranks
    (the step's global loss, since each share is normalised by the global count). They exist on the last
    pipeline stage only: computed there, then broadcast to every rank."""
    from megatron.core import parallel_state as mpu

    metrics: dict[str, float] = {}
    if reduced:
        keys = sorted(k for k in reduced[0] if k != "loss")
        values = torch.tensor([sum(float(r[k]) for r in reduced) / len(reduced) for k in keys]
                              + [sum(float(r["loss"]) for r in reduced)], dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(values, group=mpu.get_data_parallel_group())
        dp = mpu.get_data_parallel_world_size()
        metrics = {k: float(v) / dp for k, v in zip(keys, values[:-1].tolist(), strict=True)}
        metrics["loss"] = float(values[-1])
    shared = [metrics]
    torch.distributed.broadcast_object_list(shared, src=torch.distributed.get_world_size() - 1)
    return shared[0].get("loss", 0.0), shared[0]


def split_micro_batches(batch: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` equal micro batches; tensors whose first dim is the batch are split, anything else (global
    counts, 0-dim tensors, Python values) goes to every micro batch as is."""
    size = batch["tokens"].shape[0]
    if size % n:
        raise ValueError(f"a batch of {size} sequences does not split into {n} micro batches")
    step = size // n
    return [{k: v[i * step:(i + 1) * step] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size else v
             for k, v in batch.items()} for i in range(n)]


def _token_entropy(vocab_parallel_logits: torch.Tensor) -> torch.Tensor:
    """``[b, S-1]`` entropy of the next-token distribution (vocab gathered over TP)."""
    from megatron.core import tensor_parallel

    logits = tensor_parallel.gather_from_tensor_model_parallel_region(vocab_parallel_logits)[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return next(d for d in range(min(n, max(cap, 1)), 0, -1) if n % d == 0)


class AlignerActor(ProcessGroupDataParallel):
    """``PolicyActor`` on NeMo-Aligner's Megatron REINFORCE actor; one instance per rank (torchrun/srun)."""

    def __init__(self, model_cfg: Any, runtime: AlignerRuntime | None = None, *, trt_llm: Mapping[str, Any] | None = None) -> None:
        self.runtime = runtime or AlignerRuntime()
        plain = _plain(model_cfg)
        path = plain.get("restore_from_path")
        if not path or not Path(path).exists():
            raise FileNotFoundError(f"model.restore_from_path={path!r} is not a .nemo file or extracted directory: "
                                    "write one with `nemo-factuality convert hf-to-nemo --extracted`")
        self.forward_micro_batch_size = int(plain.get("forward_micro_batch_size", 8))
        overrides = model_overrides(plain, self.runtime, trt_llm)
        self.model, self.trainer, self.optimizer, self.scheduler = _restore(str(path), overrides, self.runtime)
        hf_tokenizer = getattr(self.model.tokenizer, "tokenizer", self.model.tokenizer)
        self.tokenizer = hf_tokenizer
        self.eos_id = int(self.model.tokenizer.eos_id)
        pad = getattr(hf_tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self._eos_text = hf_tokenizer.convert_ids_to_tokens(self.eos_id)
        # Aligner's init_policy_state_dict is the restored .nemo until reset_reference(): checkpoints record, not copy it
        self.restore_path = str(path)
        self.initial_reference = ref_record.initial_record(path, "model.restore_from_path")
        self.reference_is_initial = True

    # ---- parallel layout (the data-parallel hooks: ``collectives.ProcessGroupDataParallel``) ---------------------
    def _data_parallel_group(self) -> Any:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_group()

    @property
    def is_model_parallel_source(self) -> bool:
        """Whether this rank is its model replica's source rank (the one that calls the reward)."""
        from megatron.core import parallel_state as mpu

        return torch.distributed.get_rank() == min(torch.distributed.get_process_group_ranks(mpu.get_model_parallel_group()))

    def on_model_parallel_source(self, fn: Any) -> Any:
        """``fn()`` once per model replica (its model-parallel source rank), the result broadcast to the replica's
        other ranks: the stages score a rollout, which every rank of a replica holds, through this."""
        return on_megatron_model_parallel_source(fn)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- rollouts and log-probs -----------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        """``generate_chunks`` assembled in prompt order, right-padded with ``pad_id`` to one width."""
        return assemble_rollout(list(self.generate_chunks(prompt_ids, sampling)), self.pad_id)

    def generate_chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Iterator[RolloutChunk]:
        """Rollouts in micro batches of ``rollout_micro_batch_size`` prompts (the preset's KV budget), prompts
        bucketed by length (a stable sort: a batch wastes no steps on short prompts waiting for long ones, and a
        prompt's samples stay together), each batch yielded as soon as it is generated. NeMo's generation loop
        ends a batch at the step where all its sequences have ended. One inference window for all batches (with
        TensorRT-LLM: one engine refit)."""
        if not prompt_ids:
            raise ValueError("generate: no prompts")
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        step = max(1, self.runtime.rollout_micro_batch_size)
        m = self.model
        m._length_params = {"max_length": sampling.max_new_tokens, "min_length": 1}
        m._sampling_params = dict(m._sampling_params, use_greedy=sampling.use_greedy, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, end_strings=[self._eos_text])
        m.prepare_for_inference()
        try:
            for start in range(0, len(order), step):
                rows = order[start : start + step]
                yield RolloutChunk(rows, self._generate_chunk([prompt_ids[i] for i in rows], sampling))
        finally:
            m.finish_inference()

    def _generate_chunk(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollout:
        from nemo_aligner.utils.utils import batch_pad_to_fixed_len

        lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
        if int(lengths.min()) < 1:
            raise ValueError("every prompt needs at least one token")
        # as Aligner's collate: EOS-padded to the longest prompt + the tokens to generate
        text = batch_pad_to_fixed_len([torch.as_tensor(list(p), dtype=torch.long) for p in prompt_ids],
                                      int(lengths.max()) + sampling.max_new_tokens, self.eos_id)
        out = self.model.infer({"text": text.to(self._device()), "length": lengths.to(self._device())})
        tokens = out["response_tokens"].cpu().long()
        response_lengths = out["response_lengths"].cpu().long()
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        tokens = torch.where(positions < response_lengths.unsqueeze(1), tokens, torch.full_like(tokens, self.pad_id))
        return Rollout(tokens=tokens, prompt_lengths=out["prompt_lengths"].cpu().long(),
                       response_lengths=response_lengths, is_end=out["is_end"].cpu().bool())

    def _inference(self, fn, rollout: Rollout) -> torch.Tensor:
        self.model.prepare_for_inference()
        try:
            return fn(rollout.tokens.to(self._device())).float().cpu()
        finally:
            self.model.finish_inference()

    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        size = _largest_divisor_at_most(len(rollout), self.forward_micro_batch_size)
        return self._inference(lambda t: self.model.get_inference_log_probs(t, forward_micro_batch_size=size), rollout)

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        if self.model.init_policy_state_dict is None:
            raise RuntimeError("no reference policy is held: call reset_reference() first")
        size = _largest_divisor_at_most(len(rollout), self.forward_micro_batch_size)
        saved, self.model.forward_micro_batch_size = self.model.forward_micro_batch_size, size
        try:
            return self._inference(self.model.get_init_policy_logprobs, rollout)  # Aligner's cpu_weight_swap
        finally:
            self.model.forward_micro_batch_size = saved

    def reset_reference(self) -> None:
        from nemo_aligner.utils.utils import retrieve_model_state_dict_in_cpu

        self.reference_is_initial = False
        self.model.init_policy_state_dict = retrieve_model_state_dict_in_cpu(self.model, megatron_amp_O2=self.model.megatron_amp_O2)

    # ---- training ----------------------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int,
                   need_entropy: bool = False) -> dict[str, float]:
        from nemo_aligner.utils.train_utils import clip_gradients
        from nemo_aligner.utils.utils import configure_batch_sizes

        size = check_train_batch(batch, micro_batch_size)
        m = self.model
        m.prepare_for_training()  # Aligner: batch-size calculator from the config + Adam states back on device
        configure_batch_sizes(mbs=micro_batch_size, gbs=size * self.data_parallel_size, dp=self.data_parallel_size)
        self.optimizer.zero_grad()
        m.prepare_for_training_step()
        m.stage_loss_fn, m.stage_need_entropy = loss_fn, need_entropy
        try:
            _, metrics = m.get_loss_and_metrics(batch=self._sequence_parallel_padded(batch), forward_only=False)
        finally:
            m.stage_loss_fn = None
        m.finish_training_step()
        grad_norm = clip_gradients(m, self.runtime.gradient_clip_val)
        lr = self.optimizer.param_groups[0]["lr"]
        stepped = self.optimizer.step()
        if grad_norm is None and isinstance(stepped, tuple) and len(stepped) == 3:
            grad_norm = stepped[1]  # Megatron's distributed optimizer clips inside its step: (loss, norm, zeros)
        self.scheduler.step()
        m.trtllm_stale = True  # TensorRT-LLM: refit at the next inference window
        m.finish_training()
        return {**metrics, "grad_norm": float(grad_norm) if grad_norm is not None else 0.0, "lr": float(lr)}

    def _sequence_parallel_padded(self, batch: Mapping[str, torch.Tensor]) -> dict:
        """The batch with ``tokens`` right-padded to a multiple of TP under sequence parallelism (Megatron splits the
        sequence over TP ranks); causal attention keeps the real positions' log-probs unchanged, and the loss
        sees only the stage's ``[b, S-1]`` columns."""
        out = dict(batch)
        tp = int(self.model.cfg.get("tensor_model_parallel_size", 1))
        width = out["tokens"].shape[1]
        if self.model.cfg.get("sequence_parallel", False) and tp > 1 and width % tp:
            out["tokens"] = torch.nn.functional.pad(out["tokens"], (0, tp - width % tp), value=self.pad_id)
            out.setdefault("mask", torch.ones(out["tokens"].shape[0], width - 1))
        return out

    # ---- checkpoints -------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """NeMo's distributed checkpoint (weights, optimiser, LR schedule) + the reference: its record while it is the
        initial .nemo, else its own distributed checkpoint (``reference/``, once, sharded like the policy)."""
        path = Path(path)
        self._check_optimizer_state_is_shardable()
        path.mkdir(parents=True, exist_ok=True)
        self.trainer.save_checkpoint(str(path / "state.ckpt"))
        if self.reference_is_initial:
            record = self.initial_reference
        else:
            self._save_reference(path / "reference")
            record = ref_record.stored_record("reference")
        if torch.distributed.get_rank() == 0:
            ref_record.write_record(path, record)
        torch.distributed.barrier()

    def _reference_shards(self, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The policy's sharded state dict (its layout: TP/PP shards, DP replica ids) with ``state``'s tensors as the
        data: Megatron's ``model.<name>`` keys are Aligner's state-dict names (TE's ``_extra_state`` objects left out;
        SwiGLU's fused ``linear_fc1`` is a factory that shards its two halves separately, so TP can change)."""
        from dataclasses import replace

        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        prefix = "model."
        shards = {k: replace(v, data=state[k[len(prefix):]]) for k, v in self.model.sharded_state_dict().items()
                  if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and k.startswith(prefix)
                  and k[len(prefix):] in state}
        left = [k for k, v in state.items() if torch.is_tensor(v) and not k.endswith("_extra_state")
                and prefix + k not in shards]
        if left:  # a weight the reference checkpoint would silently not hold
            raise RuntimeError(f"reference weights without a sharded-state entry: {left}")
        return shards

    def _save_reference(self, where: Path) -> None:
        from megatron.core import dist_checkpointing

        if torch.distributed.get_rank() == 0:
            where.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(self._reference_shards(self.model.init_policy_state_dict), str(where))

    def _load_reference(self, where: Path) -> None:
        """The stored reference into this run's layout (any TP/PP/DP): the current reference's tensors (the right
        local shapes) are the buffers Megatron loads this rank's shards into."""
        from megatron.core import dist_checkpointing

        current = self.model.init_policy_state_dict
        template = self._reference_shards({k: v.clone() for k, v in current.items() if torch.is_tensor(v)})
        loaded = dist_checkpointing.load(template, str(where))
        self.model.init_policy_state_dict = {**current, **{k[len("model."):]: v.cpu() for k, v in loaded.items()}}

    def _check_optimizer_state_is_shardable(self) -> None:
        """NeMo 2.2 shards a plain torch optimizer's per-parameter state like the parameter itself, so a 0-dim
        per-parameter tensor would fail in Megatron's checkpointing with a bare shape assertion. torch's Adam/AdamW
        ``step`` is moved out of the way (``shardable_adam_steps``); say what to change for anything else.
        Megatron's distributed optimizer writes its own sharded state."""
        if getattr(self.model, "use_mcore_dist_optim", False):
            return
        for state in self.optimizer.state_dict()["state"].values():
            scalars = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 0)
            if scalars:
                raise ValueError(f"{type(self.optimizer).__name__} keeps 0-dim per-parameter state {scalars} that NeMo "
                                 "2.2's distributed checkpoint cannot shard: use adamw, sgd or mcore_distributed_optim "
                                 "(model.optim.name / AlignerRuntime.model_overrides optim.name)")

    def load(self, path: Path) -> None:
        path = Path(path)
        if not (path / "state" / "metadata.json").is_file():  # NeMo stores "<name>.ckpt" as the directory <name>/
            raise FileNotFoundError(f"{path / 'state'} holds no distributed checkpoint: not written by AlignerActor.save")
        restore_training_state(self.trainer, self.scheduler, path / "state")
        self._rebuild_trtllm_engine()
        record = ref_record.read_record(path)
        if record is None:
            self._load_legacy_reference(path)
        elif record["kind"] == "initial":
            ref_record.check_initial(record, self.restore_path, path)
            if not self.reference_is_initial:
                raise FactualityInputError(f"{path}: its reference is the initial checkpoint, but this process reset its "
                                           "reference since the restore; load the checkpoint in a fresh run")
        else:
            self._load_reference(path / record["where"])
            self.reference_is_initial = False

    def _load_legacy_reference(self, path: Path) -> None:
        """Checkpoints written before ``reference.json``: one ``reference.rank<r>.pt`` shard per rank, readable only on
        the layout that wrote them (never a silent ``None``)."""
        files = sorted(path.glob("reference.rank*.pt"))
        world = torch.distributed.get_world_size()
        if len(files) != world:
            raise FactualityInputError(f"{path} holds {len(files)} per-rank reference shards (an older checkpoint "
                                       f"format) but this run has {world} ranks: resume it on the layout that wrote it")
        # tensors and plain containers only: a checkpoint file never runs code
        own = torch.load(path / f"reference.rank{torch.distributed.get_rank()}.pt", weights_only=True)
        current = self.model.init_policy_state_dict
        if {k: tuple(v.shape) for k, v in own.items() if torch.is_tensor(v)} != \
                {k: tuple(v.shape) for k, v in current.items() if torch.is_tensor(v)}:
            raise FactualityInputError(f"{path}: its per-rank reference shards (an older checkpoint format) were written "
                                       "on another TP/PP layout: resume it on the layout that wrote it")
        self.model.init_policy_state_dict = own
        self.reference_is_initial = False

    def load_weights(self, path: Path) -> None:
        """Only the policy weights of a ``save`` directory (the stages' restore-best-on-early-stop)."""
        path = Path(path)
        if not (path / "state" / "metadata.json").is_file():
            raise FileNotFoundError(f"{path / 'state'} holds no distributed checkpoint: not written by AlignerActor.save")
        connector = self.trainer._checkpoint_connector
        connector.resume_start(str(path / "state"))
        connector.restore_model()
        connector.resume_end()
        self._rebuild_trtllm_engine()

    def _rebuild_trtllm_engine(self) -> None:
        """After a checkpoint load the TensorRT-LLM engine is built anew at the next rollout (Aligner's generator
        builds when not compiled, else refits), not refit from weights that were replaced under it."""
        if getattr(self.model, "use_trtllm_generation", False):
            self.model.trtllm_generate._trtllm_model_compiled = False
        self.model.trtllm_stale = True

    def export(self, path: Path) -> None:
        """A ``.nemo`` (NeMo's ``save_to``; every rank takes part) that ``convert nemo-to-hf`` turns into HF.

        NeMo packs only registered artifacts; the HF tokenizer directory the policy was restored with
        (``tokenizer.type``) is added as ``tokenizer/``, as our converter lays it out."""
        self.model.save_to(str(path))
        if torch.distributed.get_rank() == 0:
            _pack_tokenizer_dir(Path(path), Path(str(self.model.cfg.tokenizer.type)))
        torch.distributed.barrier()


def _pack_tokenizer_dir(nemo: Path, tokenizer_dir: Path) -> None:
    import tarfile

    if not tokenizer_dir.is_dir():
        log.warning("tokenizer.type=%s is not a directory: %s carries only NeMo's tokenizer artifact", tokenizer_dir, nemo)
        return
    with tarfile.open(nemo, "a") as tar:  # NeMo writes an uncompressed tar
        for f in sorted(tokenizer_dir.iterdir()):
            if f.is_file():
                tar.add(f, arcname=f"./tokenizer/{f.name}")


def _restore(path: str, overrides: dict, runtime: AlignerRuntime):
    """Aligner's training-script sequence: config merge → trainer → load_from_nemo → distributed init → PTL setup."""
    from nemo_aligner.utils.train_script_utils import (
        extract_optimizer_scheduler_from_ptl_model,
        init_distributed,
        init_peft,
        init_using_ptl,
    )
    from nemo_aligner.utils.utils import (
        load_and_override_model_config,
        load_from_nemo,
        retrieve_model_state_dict_in_cpu,
    )
    from omegaconf import OmegaConf

    model_cfg = load_and_override_model_config(path, OmegaConf.create(overrides))
    trainer = nemo_trainer(model_cfg, runtime)
    model = load_from_nemo(_stage_actor_class(), model_cfg, trainer, strict=True, restore_path=path)
    init_peft(model, model_cfg)
    model.init_policy_state_dict = retrieve_model_state_dict_in_cpu(model, megatron_amp_O2=model.megatron_amp_O2)
    init_distributed(trainer, model, model_cfg.get("transformer_engine", False))
    if not torch.cuda.is_available():
        # NeMo seeds Megatron's model-parallel RNG tracker only on GPU; generation and dropout fork it
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(runtime.seed)
    # NeMo sizes the LR schedule from a train dataloader; the stages feed batches themselves
    placeholder = list(range(model_cfg.global_batch_size))
    loader = torch.utils.data.DataLoader(placeholder, batch_size=max(1, model_cfg.global_batch_size // trainer.world_size))
    init_using_ptl(trainer, model, loader, placeholder)
    del model._train_dl
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(model)
    shardable_adam_steps(getattr(optimizer, "optimizer", optimizer))  # the torch optimizer under NeMo's wrapper
    return model, trainer, optimizer, scheduler


def nemo_trainer(model_cfg: Any, runtime: AlignerRuntime, section: str = "reinforce"):
    """NeMo's Megatron trainer (NLPDDPStrategy, precision plugins) as Aligner's ``resolve_and_create_trainer`` builds
    it; ``section`` is the algorithm's trainer block Aligner pops first (reinforce | ppo)."""
    from nemo_aligner.utils.train_script_utils import resolve_and_create_trainer
    from omegaconf import OmegaConf

    from nemo_factuality.trainers.backends.aligner.spec import use_checkpoint_layer_specs

    use_checkpoint_layer_specs(bool(model_cfg.get("transformer_engine", False)))  # before any model is built
    accelerator = runtime.accelerator if runtime.accelerator != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    cfg = OmegaConf.create({
        "trainer": {"devices": runtime.devices, "num_nodes": runtime.num_nodes, "accelerator": accelerator,
                    "precision": model_cfg.precision, "logger": False, "enable_checkpointing": False,
                    "use_distributed_sampler": False, "max_steps": runtime.max_steps, "max_epochs": 1,
                    "gradient_clip_val": runtime.gradient_clip_val, section: {}},
        "model": model_cfg,
    })
    trainer = resolve_and_create_trainer(cfg, section)
    # Lightning's DDP strategy creates the default group with its own timeout (30 min) unless told: ours, so the
    # ranks that wait for a replica's server time out where the start-up check counted on
    trainer.strategy._timeout = group_timeout(runtime.distributed_timeout_s)
    return trainer


def build_aligner(cfg: Any, *, critic: bool = False, **runtime: Any) -> tuple[AlignerActor, Any]:
    """(actor, critic) for a stage config with ``trainer.backend=aligner`` (the ``BACKENDS`` builder shape); the
    PPO critic is NeMo-Aligner's critic server at ``critic.url`` (``trainers/critic_server.py``)."""
    actor = build_actor(cfg, **runtime)
    if not critic:
        return actor, None
    from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic

    return actor, RemoteCritic(cfg.critic)


def build_actor(cfg: Any, **runtime: Any) -> AlignerActor:
    """The aligner backend's actor for a stage config (``cfg.model``, ``cfg.trainer``); ``runtime`` overrides
    ``AlignerRuntime`` fields (devices/num_nodes default to the launcher's WORLD_SIZE on one node)."""
    import os

    trainer = cfg.trainer
    defaults = {"devices": int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))),
                "num_nodes": int(os.environ.get("SLURM_NNODES", 1)),
                "max_steps": runtime.pop("max_steps", getattr(trainer, "max_steps", 100)),
                "gradient_clip_val": getattr(trainer, "gradient_clip_val", 1.0), "seed": getattr(trainer, "seed", 1234),
                "distributed_timeout_s": getattr(trainer, "distributed_timeout_s", TrainerConfig.distributed_timeout_s)}
    placed = AlignerRuntime(**{**defaults, **runtime})
    rollout = getattr(cfg, "rollout", None)
    engine = getattr(rollout, "engine", "megatron")
    if engine == "trtllm":
        require_trtllm()
    data = getattr(cfg, "data", None)
    configured = getattr(rollout, "trtllm_model_type", None)
    # read from the checkpoint only for an engine that is built (megatron never reads it)
    model_type = trtllm_model_type(configured, cfg.model.restore_from_path) if engine == "trtllm" else configured
    trt_llm = trt_llm_section(engine, placed, model_type=model_type, max_input_len=getattr(data, "max_prompt_tokens", 1024))
    return AlignerActor(cfg.model, placed, trt_llm=trt_llm)


def require_trtllm() -> None:
    """``rollout.engine=trtllm`` needs TensorRT-LLM and a CUDA GPU (the NeMo-Aligner container): say so at start-up,
    before NeMo loads anything, rather than when the first rollout builds the engine."""
    import importlib.util

    from nemo_factuality.config import ConfigError

    missing = [what for what, ok in (("the tensorrt_llm package", importlib.util.find_spec("tensorrt_llm") is not None),
                                      ("a CUDA GPU", torch.cuda.is_available())) if not ok]
    if missing:
        raise ConfigError(f"rollout.engine=trtllm needs {' and '.join(missing)} (NeMo-Aligner's TensorRT-LLM generation "
                          "runs in the NeMo-Aligner container); use rollout.engine=megatron here")


PRESET_DIR = Path(__file__).resolve().parents[4] / "conf" / "train" / "aligner"


def load_preset(name: str, method: str) -> tuple[list[str], dict[str, Any]]:
    """A model preset (``conf/train/aligner/<name>.yaml``) for ``method`` (grpo | ppo | kto) as
    (stage-config ``key=value`` overrides, ``AlignerRuntime`` fields incl. ``model_overrides``)."""
    import yaml

    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no aligner preset {name!r} in {PRESET_DIR}; known: {known}")
    preset = yaml.safe_load(path.read_text(encoding="utf-8"))
    if method not in preset:
        raise KeyError(f"{path} has no {method!r} section (grpo | ppo | kto)")
    stage = _merge({k: v for k, v in preset["common"].items() if k != "aligner"},
                   {k: v for k, v in preset[method]["overrides"].items() if k != "aligner_runtime"})
    runtime = dict(preset[method]["overrides"].get("aligner_runtime", {}))
    runtime.update(num_nodes=preset["nodes"], devices=preset["gpus_per_node"],
                   model_overrides=preset["common"].get("aligner", {}))
    return _dotlist(stage), runtime
