"""Registers the backends' builders (the builders import their heavy stacks only when called)."""

from __future__ import annotations

from typing import Any

from nemo_factuality.trainers.backends import BACKENDS


@BACKENDS.register("hf")
def build_hf(cfg: Any, *, critic: bool = False, **runtime: Any) -> tuple[Any, Any]:
    """(actor, critic or None) for a stage config with ``trainer.backend=hf`` (``runtime`` is the aligner
    presets'; the CLI refuses a preset on this backend, so it is always empty here)."""
    from nemo_factuality.trainers.backends.collectives import init_from_environment
    from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic

    t = cfg.trainer
    device = init_from_environment(t.device, t.distributed_timeout_s)  # data parallelism under torchrun: one full replica per rank
    actor = HFActor(cfg.model, max_steps=_optimizer_steps(cfg), gradient_clip_val=t.gradient_clip_val, device=device)
    value_model = None
    if critic:
        value_model = HFCritic(cfg.critic, cfg.model.path, max_steps=_optimizer_steps(cfg),
                               gradient_clip_val=t.gradient_clip_val, device=device, dtype=cfg.model.dtype)
    return actor, value_model


@BACKENDS.register("aligner")
def build_aligner_backend(cfg: Any, *, critic: bool = False, **runtime: Any) -> tuple[Any, Any]:
    """(actor, None) on NeMo-Aligner's Megatron REINFORCE actor (TP/PP/DP from ``model.*`` and the launcher);
    ``runtime``: ``AlignerRuntime`` fields from ``--preset`` (devices, num_nodes, model_overrides, ...)."""
    from nemo_factuality.trainers.backends.aligner.actor import build_aligner

    return build_aligner(cfg, critic=critic, max_steps=_optimizer_steps(cfg), **runtime)


@BACKENDS.register("megatron")
def build_megatron_backend(cfg: Any, *, critic: bool = False, **runtime: Any) -> tuple[Any, Any]:
    """(actor, critic or None) on Megatron-Core built from the HF checkpoints at ``model.path`` (and ``critic.path``) by
    Megatron-Bridge (TP/PP from ``model.*``, DP over the rest of the torchrun/srun job); ``runtime`` is the aligner
    presets' (always empty here)."""
    from nemo_factuality.trainers.backends.megatron.actor import build_megatron

    return build_megatron(cfg, critic=critic, max_steps=_optimizer_steps(cfg))


def _optimizer_steps(cfg: Any) -> int:
    """How many optimiser steps the run takes (the LR schedule's horizon)."""
    algo = getattr(cfg, "grpo", None) or getattr(cfg, "ppo", None)
    if algo is not None:
        rollout = (algo.num_prompts_per_step * getattr(algo, "num_rollouts_per_prompt", 1))
        return cfg.trainer.max_steps * algo.num_epochs * max(1, rollout // cfg.model.global_batch_size)
    return cfg.trainer.max_steps
