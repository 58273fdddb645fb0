"""The lab's RL phase on the package's GRPO stage (``trainers.grpo.GRPOTrainer``, ``hf`` backend).

The lab supplies what the stage takes: the pretrained base (``model.path``), the lab reward (served on
PyTriton in this process, or in-process), the RL prompts as ``PromptRecord``s, and ``validate(step)``
(the mean lab reward, precision and claims of T=1 samples on the validation entities), which drives
early stopping. The stage's config is ``conf/lab/grpo.yaml`` (``grpo_quick.yaml`` for ``--quick``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_factuality.lab.policy import sample
from nemo_factuality.lab.world import ABSTAIN_VALUE, RESPONSE_MARKER, prompt_for
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)


def load_grpo_config(preset: str, overrides: Sequence[str]):
    """``conf/lab/<preset>.yaml`` over the GRPOConfig schema, plus ``key=value`` overrides, validated."""
    from nemo_factuality.config import load_config
    from nemo_factuality.trainers.config import GRPOConfig, validate_train_config

    cfg = load_config(GRPOConfig, preset, list(overrides), group="lab")
    validate_train_config(cfg)
    return cfg


@contextlib.contextmanager
def lab_reward(transport: str, spec: dict[str, Any], tokenizer_dir: Path) -> Iterator[tuple[Any, list[str]]]:
    """The reward object and the config overrides that name it: PyTriton (default) or in-process."""
    from nemo_factuality.registry import REWARDS

    if transport == "inprocess":
        yield REWARDS.build(spec), [f"+reward={json.dumps(spec)}"]
        return
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.trainers.config import GRPOConfig
    from nemo_factuality.trainers.runtime import build_reward

    ports = free_ports(5)
    serve_cfg = ServeConfig(reward=spec, policy_tokenizer=str(tokenizer_dir), response_marker=RESPONSE_MARKER,
                            host="127.0.0.1", http_port=ports[0],
                            grpc_port=ports[1], triton_metrics_port=ports[2], health_port=ports[3], metrics_port=ports[4])
    url = f"http://127.0.0.1:{ports[0]}"
    with FactualityRewardServer(serve_cfg, REWARDS.build(spec)):
        cfg = GRPOConfig()
        cfg.remote_rm.url = url
        yield build_reward(cfg, None), [f"remote_rm.url={url}"]  # the stage's own client, health-checked


def make_validator(model: Any, tokenizer: Any, reward: Any, names: Sequence[str], n: int):
    """``validate(step)`` for early stopping: lab reward, precision and claims of T=1 samples on ``names``."""
    prompts = [prompt_for(x) for x in names]

    def validate(step: int) -> dict[str, float]:
        model.eval()
        samples = sample(model, tokenizer, prompts, n=n, seed=10_000 + step)
        batch = reward([s.prompt for s in samples], [s.response for s in samples])
        comp = batch.components
        return {"val/lab_reward": float(np.mean(batch.scores)),
                "val/precision": float(comp["supported"].sum() / max(comp["claims"].sum(), 1)),
                "val/claims": float(np.mean(comp["claims"]))}

    return validate


TRAINABLE = ("all", "calibration")


def restrict_to_calibration(model: Any, abstain_id: int) -> list[str]:
    """Freeze everything but the final norm's gains and the abstention token's output row.

    What is left can sharpen or flatten every value distribution (the norm scales the logits) and
    move the "unknown" logit as a linear function of the state, but it cannot store a fact about any
    one person: RL can learn *when* to answer, not *what* to answer. Returns the trainable names.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    norm = model.get_decoder().norm.weight
    head = model.get_output_embeddings().weight
    norm.requires_grad_(True)
    head.requires_grad_(True)
    rows = torch.zeros(head.shape[0], 1, dtype=head.dtype)
    rows[abstain_id] = 1.0
    head.register_hook(lambda grad: grad * rows.to(grad.device))  # only the abstention row moves
    return ["model.norm.weight", f"lm_head.weight[{abstain_id}]"]


def train_grpo(preset: str, overrides: Sequence[str], base: Path, run_dir: Path, reward: Any,
               rl_names: Sequence[str], val_names: Sequence[str], val_samples: int,
               trainable: str = "all") -> tuple[Any, list[dict], list[dict]]:
    """Run the GRPO stage from ``base``; returns (the policy with its best weights, train metrics, val metrics)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_factuality.trainers.backends.hf import HFActor
    from nemo_factuality.trainers.data import PromptRecord
    from nemo_factuality.trainers.grpo import GRPOTrainer

    if trainable not in TRAINABLE:
        raise FactualityInputError(f"lab: trainable must be one of {TRAINABLE}, got {trainable!r}")
    cfg = load_grpo_config(preset, [f"model.path={base}", f"exp_manager.explicit_log_dir={run_dir}", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    if trainable == "calibration":
        log.info("lab rl: training only %s", restrict_to_calibration(model, tokenizer.convert_tokens_to_ids(ABSTAIN_VALUE)))
    actor = HFActor(cfg.model, max_steps=cfg.trainer.max_steps, gradient_clip_val=cfg.trainer.gradient_clip_val,
                    device=cfg.trainer.device, model=model, tokenizer=tokenizer)
    records = [PromptRecord(prompt=prompt_for(x)) for x in rl_names]
    validate = make_validator(actor.model, actor.tokenizer, reward, val_names, val_samples)
    val_log: list[dict] = []

    def logged_validate(step: int) -> dict[str, float]:
        out = validate(step)
        val_log.append({"step": step, **out})
        return out

    logged_validate(0)  # the base policy's score: RL must beat it to be kept
    trainer = GRPOTrainer(cfg, actor, reward, records, run_dir=run_dir, validate=logged_validate)
    history = trainer.fit()
    _keep_best(trainer, actor, val_log, cfg.trainer.early_stopping.monitor, base)
    train_log = [{"step": i + 1, **m} for i, m in enumerate(history)]
    return actor.model, train_log, val_log


def _keep_best(trainer: Any, actor: Any, val_log: list[dict], monitor: str, base: Path) -> None:
    """End on the best validated weights, also when the run ended at ``max_steps`` (the stage restores
    them only on an early stop) and when no RL step beat the base policy (then the base is kept)."""
    best = max(val_log, key=lambda v: v[monitor])
    if best["step"] == 0:
        log.info("lab rl: no validation beat the base policy; keeping the base weights")
        from transformers import AutoModelForCausalLM

        actor.model.load_state_dict(AutoModelForCausalLM.from_pretrained(base).state_dict())
    elif trainer.checkpointer.best:
        actor.load_weights(trainer.checkpointer.root / trainer.checkpointer.best)
    actor.model.eval()
