"""The aligner actor's optimizer state, apart from its model: Megatron-Core's distributed optimizer's Adam moments and
fp32 main shards moved to host memory around generation and back (the presets' ``offload_adam_states``), torch Adam's
per-parameter steps made shardable for NeMo 2.2's distributed checkpoint, and a resume through PTL's checkpoint
connector as Aligner's ``init_using_ptl`` does. ``backends/aligner/actor.py`` uses these; nothing here imports NeMo."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class OffloadedTensors:
    """Host copies of an optimizer's device tensors, and where each goes back (``onload_optimizer_states``)."""

    states: list[tuple[dict, str, torch.device, torch.Tensor]] = field(default_factory=list)  # (state, key, device, host)
    params: list[tuple[torch.nn.Parameter, torch.device, torch.Tensor]] = field(default_factory=list)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = t.detach().to("cpu", copy=True)  # a copy even on CPU: the device storage is released either way
    return host.pin_memory() if t.is_cuda else host


def offload_optimizer_states(optimizer: Any) -> OffloadedTensors:
    """Move Megatron-Core's distributed optimizer's Adam moments and fp32 main-parameter shards to host memory
    (around generation, where they are not needed); ``onload_optimizer_states`` brings them back bit-exactly.

    Only main parameters that are separate fp32 copies of bf16/fp16 weights move: the shards of fp32 weights
    are views of the weights generation uses."""
    out = OffloadedTensors()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.shard_fp32_from_float16_groups:
            for param in group:
                out.params.append((param, param.device, _to_host(param.data)))
                param.data = out.params[-1][2]
        for state in opt.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    out.states.append((state, key, value.device, _to_host(value)))
                    state[key] = out.states[-1][3]
    return out


def onload_optimizer_states(offloaded: OffloadedTensors) -> None:
    for param, device, host in offloaded.params:
        param.data = host.to(device, copy=True)
    for state, key, device, host in offloaded.states:
        state[key] = host.to(device, copy=True)


def restore_training_state(trainer: Any, scheduler: Any, state_dir: Path) -> None:
    """Weights, optimiser and LR schedule from a NeMo distributed checkpoint, through the trainer's checkpoint
    connector as Aligner's ``init_using_ptl`` resumes (called after ``shardable_adam_steps``, whose hooks the
    optimiser's load needs)."""
    connector = trainer._checkpoint_connector
    connector.resume_start(str(state_dir))
    connector.restore_model()
    connector.restore_training_state()
    connector.resume_end()
    if scheduler.last_epoch > 0:  # as init_using_ptl: re-apply the restored LR to the optimiser
        scheduler.step(scheduler.last_epoch)


def shardable_adam_steps(optimizer: Any) -> None:
    """Let torch's Adam/AdamW state go into NeMo 2.2's sharded checkpoint.

    NeMo shards every per-parameter state tensor like its parameter; Adam's per-parameter ``step`` is a 0-dim
    tensor, which Megatron's checkpointing rejects. Megatron's own optimizers keep the step in the parameter
    group instead; these two hooks (torch's public optimizer hooks, nothing patched) do the same for a plain
    torch Adam: ``state_dict()`` moves each group's step into the group (common, unsharded state) and
    ``load_state_dict`` puts it back on every parameter. Other optimizers are left alone."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    optimizer.register_state_dict_post_hook(_steps_into_param_groups)
    optimizer.register_load_state_dict_pre_hook(_steps_from_param_groups)


def _steps_into_param_groups(_optimizer: Any, state_dict: dict) -> dict:
    state = {pid: dict(s) for pid, s in state_dict["state"].items()}  # copies: the inner dicts are the live state
    groups = [dict(g) for g in state_dict["param_groups"]]
    for group in groups:
        steps = {float(state[p].pop("step")) for p in group["params"] if "step" in state.get(p, {})}
        if len(steps) > 1:  # every parameter of a group steps together unless someone stepped a subset
            raise ValueError(f"parameters of one optimizer group are at different Adam steps {sorted(steps)}")
        if steps:
            group["step"] = steps.pop()
    return {**state_dict, "state": state, "param_groups": groups}


def _steps_from_param_groups(_optimizer: Any, state_dict: dict) -> dict:
    state = {pid: dict(s) for pid, s in state_dict["state"].items()}
    groups = [dict(g) for g in state_dict["param_groups"]]
    for group in groups:
        if "step" not in group:
            continue
        step = float(group.pop("step"))
        for p in group["params"]:
            if p in state:
                state[p]["step"] = torch.tensor(step, dtype=torch.float32)
    return {**state_dict, "state": state, "param_groups": groups}
