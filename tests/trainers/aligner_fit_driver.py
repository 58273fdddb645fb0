"""Runs in the NeMo-Aligner venv (``python``, world 1, gloo): NeMo-Aligner's own ``ReinforceTrainer.fit()``
with its own ``MegatronGPTReinforceActorModel`` against a running reward server, then writes what it saw.

    python tests/trainers/aligner_fit_driver.py --nemo DIR --train P.jsonl --val V.jsonl --port N --out DIR

The run is assembled in the order of Aligner's ``examples/nlp/gpt/train_gpt_reinforce_actor.py`` (config merge →
trainer → exp_manager → ``load_from_nemo`` → ``init_distributed`` → RLHF datasets and dataloader builders →
``init_using_ptl`` → checkpoint callback → reward client → ``ReinforceTrainer(...).fit()``); only the
CPU shims (``aligner_cpu``) and the reward client's bounded timeouts and cleanup
(``remote_reward_client``) are ours. Two observers record without changing what they observe: a
``CustomLoggerWrapper`` subclass keeps every ``log_metrics`` call, and a proxy around the reward client keeps
each request's token rows and the rewards the server answered. ``<out>/result.json`` holds both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The shims are applied in main(), not at import: Megatron's checkpoint writer starts a multiprocessing
# Manager with the spawn method, which re-imports this module, and that helper needs none of NeMo.
from nemo_factuality.testing import aligner_cpu  # noqa: E402

MAX_NEW_TOKENS = 24
SEQ_LENGTH = 96  # prompts up to SEQ_LENGTH // 2 tokens (RLHFDataset); the reward server gets rows padded to this


def build_cfg(args):
    """The example's config (conf/gpt_reinforce_actor.yaml) with the test's sizes: 2 prompts × 4 rollouts a
    step, one optimiser step over all 8, validation after every step, a checkpoint at the end."""
    reinforce_trainer = {
        "max_epochs": 1, "max_steps": args.steps, "val_check_interval": 1, "save_interval": args.save_interval,
        "gradient_clip_val": 1.0, "initial_policy_kl_penalty": 0.01, "use_absolute_kl": True,
        "num_rollouts_per_prompt": args.rollouts, "rollout_batch_seq_length": None,
        "trt_llm": {"enable": False, "reshard": False}, "batch_iterator": {"use_flask": False},
        "model_gbs": 2 * args.rollouts, "model_mbs": 1,
    }
    model = {
        **aligner_cpu.CPU_MODEL_OVERRIDES,
        "reinforce": {
            "rollout_micro_batch_size": 2, "num_rollout_samples": 2, "forward_micro_batch_size": 2,
            "val_rollout_micro_batch_size": 2, "num_val_samples": 2, "offload_adam_states": True,
            "sampling_params": {"use_greedy": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                "repetition_penalty": 1.0, "add_BOS": False, "all_probs": False,
                                "compute_logprob": False, "end_strings": ["<|im_end|>"]},
            "length_params": {"max_length": MAX_NEW_TOKENS, "min_length": 1},
            "trt_llm": reinforce_trainer["trt_llm"],
        },
        "peft": {"peft_scheme": "none", "restore_from_path": None},
        # micro batch 1, as the example: Aligner 0.7.0's REINFORCE loss multiplies [mbs, S-1] log-probs by [mbs]
        # advantages, which broadcasts only when mbs == 1
        "mcore_gpt": True, "micro_batch_size": 1, "global_batch_size": 2 * args.rollouts, "encoder_seq_length": SEQ_LENGTH,
        "seed": args.seed, "gradient_as_bucket_view": True,
        # torch AdamW's 0-dim per-parameter step cannot go into NeMo 2.2's sharded checkpoint (the GPU presets
        # use Apex's distributed_fused_adam); SGD keeps the end-of-run checkpoint possible on CPU
        "optim": {"name": "sgd", "lr": args.lr, "weight_decay": 0.0, "momentum": 0.0,
                  "sched": {"name": "CosineAnnealing", "warmup_steps": 0, "min_lr": args.lr / 10, "max_steps": args.steps}},
        "data": {"data_impl": "jsonl", "splits_string": None, "seq_length": SEQ_LENGTH, "skip_warmup": True,
                 "num_workers": 0, "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
                 "index_mapping_dir": None,
                 "data_prefix": {"train": [args.train], "validation": [args.val], "test": [args.val]}},
    }
    return OmegaConf.create({
        "trainer": {"num_nodes": 1, "devices": 1, "accelerator": "cpu", "precision": 32, "reinforce": reinforce_trainer,
                    "logger": False, "enable_checkpointing": False, "use_distributed_sampler": False, "max_time": None,
                    "max_epochs": 1, "max_steps": args.steps},
        "remote_rm": {"pad_to_length": SEQ_LENGTH, "init_timeout_s": 60.0, "timeout_s": 120.0,
                      "reward_model": {"name": args.model_name, "ip": "127.0.0.1", "port": args.port}},
        "exp_manager": {"explicit_log_dir": str(Path(args.out) / "run"), "exp_dir": None, "name": "megatron_gpt_reinforce_actor",
                        "create_wandb_logger": False, "create_tensorboard_logger": True, "resume_if_exists": True,
                        "resume_ignore_no_checkpoint": True, "create_checkpoint_callback": True,
                        "checkpoint_callback_params": {"monitor": "val_rewards", "save_top_k": 1, "mode": "max",
                                                       "always_save_nemo": False, "save_nemo_on_train_end": False,
                                                       "filename": "megatron_gpt-{step}-{consumed_samples}-{val_rewards:.3f}",
                                                       "model_parallel_size": 1}},
        "pretrained_checkpoint": {"restore_from_path": args.nemo},
        "model": model,
    })


def _recording_logger_class():
    from nemo_aligner.utils.train_script_utils import CustomLoggerWrapper

    class RecordingLogger(CustomLoggerWrapper):
        """Aligner's logger wrapper (it still feeds exp_manager's loggers) that also keeps every metric logged."""

        def __init__(self, loggers):
            super().__init__(loggers)
            self.records: list[dict] = []

        def log_metrics(self, metrics, step=None, prefix=""):
            self.records.append({"step": step, "prefix": prefix,
                                 "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}})
            super().log_metrics(metrics, step=step, prefix=prefix)

    return RecordingLogger


class RecordingRM:
    """Passes ``infer_rm`` through to the reward client and keeps what went out and what came back.

    A request is a training one when the rollout carries ``prompt_tokens`` (ReinforceTrainer sets them before
    calling the reward model for training rollouts, never for validation ones)."""

    def __init__(self, rm) -> None:
        self.rm, self.trainer, self.calls = rm, None, []

    def infer_rm(self, rollout_batch):
        lengths = rollout_batch["response_lengths"].cpu().long()
        tokens = rollout_batch["response_tokens"].cpu().long()
        call = {"phase": "train" if "prompt_tokens" in rollout_batch else "val",
                "step": self.trainer.step if self.trainer is not None else None,
                "tokens": [row[:n].tolist() for row, n in zip(tokens, lengths.tolist(), strict=True)],
                "prompt_lengths": rollout_batch["prompt_lengths"].cpu().long().tolist(),
                "is_end": rollout_batch["is_end"].cpu().bool().tolist(), "width": int(tokens.shape[1])}
        self.calls.append(call)
        return _RecordedFuture(self.rm.infer_rm(rollout_batch), call)


class _RecordedFuture:
    def __init__(self, future, call: dict) -> None:
        self.future, self.call = future, call

    def result(self):
        rewards = self.future.result()
        self.call["rewards"] = rewards.detach().float().cpu().reshape(-1).tolist()
        return rewards


def build_data(cfg, model):
    """Aligner's RLHF prompt datasets (jsonl ``{"text": prompt}``), collate function and dataloader builders."""
    from nemo_aligner.data.nlp.builders import (
        build_dataloader,
        build_train_valid_test_rlhf_datasets,
        collate_with_pad_to_max_batch,
    )

    train_ds, val_ds, _ = build_train_valid_test_rlhf_datasets(
        cfg=cfg.model, data_prefix=cfg.model.data.data_prefix, data_impl=cfg.model.data.data_impl,
        splits_string=cfg.model.data.splits_string, train_valid_test_num_samples=[-1, -1, -1],
        seq_length=cfg.model.data.seq_length, seed=cfg.model.seed, tokenizer=model.tokenizer)
    collate_fn = collate_with_pad_to_max_batch(cfg.model.reinforce.length_params.max_length, model.tokenizer.eos_id, cfg,
                                               generate_masks_and_position_ids=False)
    rollout = cfg.model.reinforce
    train_builder = partial(build_dataloader, cfg=cfg, dataset=train_ds, mbs=rollout.rollout_micro_batch_size,
                            gbs=rollout.num_rollout_samples, collate_fn=collate_fn, load_gbs=False)
    val_builder = partial(build_dataloader, cfg=cfg, dataset=val_ds, mbs=rollout.val_rollout_micro_batch_size,
                          gbs=rollout.num_val_samples, collate_fn=collate_fn, load_gbs=False, use_random_sampler=False)
    return train_ds, collate_fn, train_builder, val_builder


def restore(cfg):
    """Trainer, exp_manager, Aligner's REINFORCE actor from the .nemo, distributed init (the example's order)."""
    from nemo.utils.exp_manager import exp_manager
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel
    from nemo_aligner.utils.train_script_utils import init_distributed, init_peft, resolve_and_create_trainer
    from nemo_aligner.utils.utils import (
        load_and_override_model_config,
        load_from_nemo,
        retrieve_model_state_dict_in_cpu,
    )

    cfg.model = load_and_override_model_config(cfg.pretrained_checkpoint.restore_from_path, cfg.model)
    trainer = resolve_and_create_trainer(cfg, "reinforce")
    exp_manager(trainer, cfg.exp_manager)
    logger = _recording_logger_class()(trainer.loggers)
    from nemo_factuality.trainers.backends.aligner.spec import use_checkpoint_layer_specs

    # NeMo 2.2's get_specs cannot build a spec without TE (it builds every spec eagerly): the layer spec this
    # toolkit installs on every path it builds a model (nemo_trainer), here for Aligner's own script
    use_checkpoint_layer_specs(bool(cfg.model.get("transformer_engine", False)))
    model = load_from_nemo(MegatronGPTReinforceActorModel, cfg.model, trainer, strict=True,
                           restore_path=cfg.pretrained_checkpoint.restore_from_path)
    init_peft(model, cfg.model)
    # the initial-policy KL needs the starting weights (full-parameter tuning, as the example)
    model.init_policy_state_dict = retrieve_model_state_dict_in_cpu(model, megatron_amp_O2=False)
    init_distributed(trainer, model, cfg.model.get("transformer_engine", False))
    if not torch.cuda.is_available():
        # NeMo seeds Megatron's model-parallel RNG tracker only on GPU; sampling forks it
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.model.seed)
    return trainer, model, logger


def run(args) -> dict:
    from megatron.core.utils import divide
    from nemo_aligner.algorithms.reinforce import ReinforceTrainer
    from nemo_aligner.utils import parallel_state
    from nemo_aligner.utils.batch_iterators import get_batch_iterator_cls
    from nemo_aligner.utils.distributed import Timer
    from nemo_aligner.utils.train_script_utils import (
        add_custom_checkpoint_callback,
        extract_optimizer_scheduler_from_ptl_model,
        init_using_ptl,
    )

    from nemo_factuality.trainers.backends.aligner.reward import remote_reward_client

    cfg = build_cfg(args)
    trainer, model, logger = restore(cfg)
    train_ds, collate_fn, train_builder, val_builder = build_data(cfg, model)
    # NeMo sizes the LR schedule from a train dataloader of optimiser batches; the prompt loader is not one
    placeholder = torch.utils.data.DataLoader(train_ds, batch_size=divide(cfg.model.global_batch_size,
                                                                           parallel_state.get_data_parallel_world_size()))
    init_using_ptl(trainer, model, placeholder, train_ds)
    del model._train_dl
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(model)
    ckpt_callback = add_custom_checkpoint_callback(trainer, model)
    logger.log_hyperparams(OmegaConf.to_container(cfg))
    t_fit = time.monotonic()
    # our client: Aligner's RemoteGPTRMClient with bounded timeouts, closed whatever fit() does
    with remote_reward_client(cfg.remote_rm, pad_to_length=cfg.remote_rm.pad_to_length) as rm:
        recorder = RecordingRM(rm)
        reinforce = ReinforceTrainer(cfg=cfg.trainer.reinforce, model=model, optimizer=optimizer, scheduler=scheduler,
                                     train_dataloader_builder=train_builder, val_dataloader_builder=val_builder,
                                     collate_fn=collate_fn, rm=recorder,
                                     batch_iterator_cls=get_batch_iterator_cls(cfg.trainer.reinforce.get("batch_iterator", {})),
                                     logger=logger, ckpt_callback=ckpt_callback, run_timer=Timer(None))
        recorder.trainer = reinforce
        reinforce.fit()
    run_dir = Path(cfg.exp_manager.explicit_log_dir)
    return {"steps": reinforce.step, "optimizer_steps": reinforce.reinforce_optimization_step,
            "consumed_samples": reinforce.consumed_samples, "records": logger.records, "calls": recorder.calls,
            "actor_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "trainer_class": f"{type(reinforce).__module__}.{type(reinforce).__qualname__}",
            "rm_classes": [f"{c.__module__}.{c.__qualname__}" for c in type(rm).__mro__],
            "eos_id": int(model.tokenizer.eos_id), "fit_s": time.monotonic() - t_fit,
            "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--train", required=True, help="jsonl of {\"text\": prompt} (Aligner's RLHF prompt format)")
    ap.add_argument("--val", required=True)
    ap.add_argument("--port", type=int, required=True, help="the reward server's Triton HTTP port on 127.0.0.1")
    ap.add_argument("--model-name", default="reward_model", help="remote_rm.reward_model.name")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=4, help="num_rollouts_per_prompt")
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    t0 = time.monotonic()
    aligner_cpu.apply()  # before anything imports NeMo
    result = run(args)
    result.update(total_s=time.monotonic() - t0, pid=os.getpid())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
