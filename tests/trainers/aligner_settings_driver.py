"""Runs in the NeMo-Aligner venv (python or torchrun, gloo): the presets' GPU settings on the aligner actor.

    torchrun --nproc_per_node 2 tests/trainers/aligner_settings_driver.py --nemo DIR --out DIR --tp 2 --setting preset

Settings (``--setting``), read from a shipped preset's ``common`` block (``--preset``) so the test follows them:

* ``plain``: float32, torch AdamW, no recompute / sequence parallelism / offload (the reference run);
* ``exact``: the preset's NeMo settings (Megatron-Core's distributed optimizer, sequence parallelism at TP > 1,
  full activation recompute, Adam-state offload around generation) in float32: equal to ``plain`` up to
  reduction order;
* ``preset``: the same in the preset's dtype (bf16 weights, ``megatron_amp_O2`` fp32 main weights): equal to
  ``plain`` within bf16 tolerance.

One fixed batch (prompts + seeded response tokens, fixed advantages) is trained for ``--steps`` GRPO steps
(old log-probs from the actor, PPO-clip loss over the global token count) under one setting, then
save → step → load → step. Each rank writes ``<out>/rank<r>.json``: the per-step losses, the greedy rollout
and its log-probs, the update of every parameter this rank holds (``after − before``, fp32) and the two
post-checkpoint steps' losses and log-probs (they must be equal).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import aligner_cpu  # noqa: E402

aligner_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.algorithms.advantages import response_mask  # noqa: E402
from nemo_factuality.algorithms.losses import ppo_policy_loss  # noqa: E402
from nemo_factuality.trainers.backends.aligner.actor import AlignerActor, build_actor  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout, SamplingParams  # noqa: E402

PROMPTS = ["The Eiffel Tower is", "Marie Curie won", "Water boils at 100 degrees", "Albert Einstein was born in Ulm"]
ADVANTAGES = [1.0, -0.5, 0.25, 0.75]
RESPONSE = 8


# How often each setting's own code ran during training (a setting silently off would still match the baseline).
PROBES = {"recompute": 0, "reduce_scatter": 0, "offload": 0, "onload": 0}


def _install_probes() -> None:
    import megatron.core.tensor_parallel.mappings as mappings
    from megatron.core import tensor_parallel

    from nemo_factuality.trainers.backends.aligner import actor as aligner_actor

    def counting(key, fn):
        def wrapper(*args, **kwargs):
            PROBES[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    tensor_parallel.checkpoint = counting("recompute", tensor_parallel.checkpoint)
    mappings.dist_reduce_scatter_func = counting("reduce_scatter", mappings.dist_reduce_scatter_func)
    aligner_actor.offload_optimizer_states = counting("offload", aligner_actor.offload_optimizer_states)
    aligner_actor.onload_optimizer_states = counting("onload", aligner_actor.onload_optimizer_states)


def setting_overrides(setting: str, preset: str, tp: int) -> tuple[str, dict]:
    """(stage ``model.dtype``, NeMo model overrides) for one setting of a preset's ``common`` block."""
    import yaml

    from nemo_factuality.trainers.backends.aligner.actor import PRESET_DIR

    common = yaml.safe_load((PRESET_DIR / f"{preset}.yaml").read_text())["common"]
    cpu = dict(aligner_cpu.CPU_MODEL_OVERRIDES)
    if setting == "plain":
        return "float32", {**cpu, "reinforce": {"offload_adam_states": False}}
    gpu = dict(common["aligner"])
    if tp == 1:  # Megatron refuses sequence parallelism without tensor parallelism (every preset has TP > 1)
        gpu["sequence_parallel"] = False
    gpu["transformer_engine"] = False  # no TE on CPU: the local spec (test_container_spec builds it with Apex importable)
    if setting == "exact":
        return "float32", {**cpu, **gpu, "megatron_amp_O2": False}
    cpu.pop("precision")  # the stage's model.dtype gives it
    return common["model"]["dtype"], {**cpu, **gpu}


def _actor(args) -> AlignerActor:
    dtype, model_overrides = setting_overrides(args.setting, args.preset, args.tp)
    overrides = [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "trainer.gradient_clip_val=1.0",
                 f"model.tensor_model_parallel_size={args.tp}", "model.micro_batch_size=1",
                 f"model.global_batch_size={len(PROMPTS)}", "model.forward_micro_batch_size=2",
                 f"model.dtype={dtype}", "model.optim.name=adamw", f"model.optim.lr={args.lr}",
                 "model.optim.weight_decay=0.0", "model.optim.sched.name=constant", "remote_rm.url=http://127.0.0.1:5555"]
    cfg = load_train_config(GRPOConfig, None, overrides)
    return build_actor(cfg, max_steps=10, rollout_micro_batch_size=2, model_overrides=model_overrides)


def _my_rows(actor: AlignerActor) -> slice:
    per_rank = len(PROMPTS) // actor.data_parallel_size
    return slice(actor.data_parallel_rank * per_rank, (actor.data_parallel_rank + 1) * per_rank)


def _fixed_rollout(actor: AlignerActor) -> Rollout:
    """Every prompt + RESPONSE seeded token ids (the same on every setting and layout), right-padded."""
    gen = torch.Generator().manual_seed(11)
    rows = [actor.tokenizer.encode(p) + torch.randint(5, len(actor.tokenizer) - 1, (RESPONSE,), generator=gen).tolist()
            for p in PROMPTS]
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), actor.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    prompt = torch.tensor([len(actor.tokenizer.encode(p)) for p in PROMPTS])
    rollout = Rollout(tokens=tokens, prompt_lengths=prompt, response_lengths=prompt + RESPONSE,
                      is_end=torch.ones(len(rows), dtype=torch.bool))
    mine = _my_rows(actor)
    return Rollout(tokens=rollout.tokens[mine], prompt_lengths=rollout.prompt_lengths[mine],
                   response_lengths=rollout.response_lengths[mine], is_end=rollout.is_end[mine])


def _loss(out, mb):
    return ppo_policy_loss(out["logprobs"], mb["old_logprobs"], mb["advantages"], mb["mask"],
                           global_tokens=float(mb["global_tokens"]))


def _batch(actor: AlignerActor, rollout: Rollout, advantages: list[float]) -> dict:
    """The rollout's GRPO batch; its old log-probs are the actor's now, so later steps on it move the ratio."""
    mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, rollout.tokens.shape[1] - 1)
    return {"tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths,
            "response_lengths": rollout.response_lengths, "mask": mask,
            "advantages": torch.tensor(advantages).unsqueeze(1).expand_as(mask).contiguous(),
            "old_logprobs": actor.logprobs(rollout), "global_tokens": actor.all_reduce_sum(mask.sum())}


def _step(actor: AlignerActor, batch: dict) -> dict:
    return actor.train_step(batch, _loss, micro_batch_size=1)


def _params(actor: AlignerActor) -> dict[str, torch.Tensor]:
    """This rank's parameters by name (Megatron's DDP / Float16Module wrappers' ``module.`` prefixes removed), fp32."""
    return {k.replace("module.", ""): v.detach().float().clone()
            for chunk in actor.model.get_model_module_list() for k, v in chunk.named_parameters()}


def _owned_ranges(actor: AlignerActor) -> dict[str, tuple[torch.nn.Parameter, int, int, Any]]:
    """name → (model parameter, start, length, its fp32 main shard or None): the flattened slice of each parameter
    this rank's optimiser steps (Megatron's distributed optimizer: its own shard of every buffer; else all of it)."""
    names = {p: k.replace("module.", "") for chunk in actor.model.get_model_module_list() for k, p in chunk.named_parameters()}
    mcore = getattr(actor.optimizer, "mcore_optimizer", None)
    if mcore is None:
        return {name: (p, 0, p.numel(), None) for p, name in names.items()}
    out = {}
    for optimizer in getattr(mcore, "chained_optimizers", [mcore]):  # one per parameter-group kind
        pairs = [*zip(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups, strict=True),
                 *zip(optimizer.model_fp32_groups, optimizer.shard_fp32_groups, strict=True)]
        for model_group, shard_group in pairs:
            for model_param, shard in zip(model_group, shard_group, strict=True):
                start = optimizer._get_model_param_range_map(model_param)["param"].start
                out[names[model_param]] = (model_param, start, shard.numel(), shard)
    return out


# The first optimiser step's gradient (fp32, before clipping), recorded when the actor asks Aligner to clip.
FIRST_GRADIENT: dict[str, list] = {}


def _record_first_gradient(actor: AlignerActor) -> None:
    """Wrap Aligner's ``clip_gradients`` (called between the gradient reduction and the optimiser step) to keep the
    first step's reduced gradient on this rank's owned slices: ``main_grad`` (Megatron's fp32 grad buffer) where
    the model has one, else ``grad``."""
    import nemo_aligner.utils.train_utils as train_utils

    clip = train_utils.clip_gradients

    def recording(model, clip_val):
        if not FIRST_GRADIENT:
            for name, (param, start, n, _) in _owned_ranges(actor).items():
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                FIRST_GRADIENT[name] = [start, grad.detach().float().flatten()[start:start + n].tolist()]
        return clip(model, clip_val)

    train_utils.clip_gradients = recording


def _master(actor: AlignerActor) -> dict[str, tuple[int, torch.Tensor]]:
    """The weights the optimiser updates, by parameter name: ``(start, values)`` with ``values`` the flattened
    slice ``[start, start + n)`` of that parameter this rank owns. Megatron's distributed optimizer keeps fp32
    main shards (of bf16 parameters under ``megatron_amp_O2``); a plain optimiser updates the parameters."""
    return {name: (start, (param if shard is None else shard).detach().float().flatten().clone())
            for name, (param, start, _, shard) in _owned_ranges(actor).items()}


def run(actor: AlignerActor, args) -> dict:
    rollout, advantages = _fixed_rollout(actor), ADVANTAGES[_my_rows(actor)]
    before, master_before = _params(actor), _master(actor)
    batch = _batch(actor, rollout, advantages)
    metrics = [_step(actor, batch)]
    # generation between updates: Adam's moments exist now, so an offload around it moves real state
    t0 = time.monotonic()
    greedy = actor.generate([actor.tokenizer.encode(p) for p in PROMPTS[_my_rows(actor)]],
                            SamplingParams(max_new_tokens=4, use_greedy=True))
    gen_s = time.monotonic() - t0
    metrics += [_step(actor, batch) for _ in range(args.steps - 1)]
    probes = dict(PROBES)
    after, master_after = _params(actor), _master(actor)
    ckpt = Path(args.out) / "ckpt"
    actor.save(ckpt)
    m_a = _step(actor, batch)
    lp_a = actor.logprobs(rollout)
    actor.load(ckpt)
    m_b = _step(actor, batch)
    lp_b = actor.logprobs(rollout)
    return {"metrics": metrics, "lp0": batch["old_logprobs"].tolist(), "greedy_tokens": greedy.tokens.tolist(), "generate_s": gen_s,
            "mask": response_mask(rollout.prompt_lengths, rollout.response_lengths, rollout.tokens.shape[1] - 1).tolist(),
            "update": {k: (after[k] - before[k]).flatten().tolist() for k in sorted(before)},
            "master_update": {k: [start, (master_after[k][1] - values).tolist()] for k, (start, values) in master_before.items()},
            "param_dtypes": sorted({str(p.dtype) for p in actor.model.parameters()}),
            "optimizer": type(actor.optimizer).__name__, "probes": probes, "first_gradient": FIRST_GRADIENT, "metrics_a": m_a, "metrics_b": m_b,
            "lp_a": lp_a.tolist(), "lp_b": lp_b.tolist()}


def resume(actor: AlignerActor, args) -> dict:
    """A new process resuming ``--resume-from``'s checkpoint (as a requeued job does): one step on the same batch."""
    first = json.loads((Path(args.resume_from) / f"rank{torch.distributed.get_rank()}.json").read_text())
    rollout, advantages = _fixed_rollout(actor), ADVANTAGES[_my_rows(actor)]
    actor.load(Path(args.resume_from) / "ckpt")
    batch = dict(_batch(actor, rollout, advantages), old_logprobs=torch.tensor(first["lp0"]))
    metrics = _step(actor, batch)
    return {"metrics_resumed": metrics, "lp_resumed": actor.logprobs(rollout).tolist(), "probes": dict(PROBES)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--setting", choices=("plain", "exact", "preset"), default="plain")
    ap.add_argument("--preset", default="qwen2.5-7b", help="the conf/train/aligner preset whose settings run")
    ap.add_argument("--resume-from", default=None, help="an earlier run's --out: load its checkpoint first, step once")
    args = ap.parse_args()
    t0 = time.monotonic()
    _install_probes()
    actor = _actor(args)
    _record_first_gradient(actor)
    result = resume(actor, args) if args.resume_from else run(actor, args)
    result.update(total_s=time.monotonic() - t0, dp_rank=actor.data_parallel_rank, dp_size=actor.data_parallel_size,
                  rank=torch.distributed.get_rank(), pid=os.getpid())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
