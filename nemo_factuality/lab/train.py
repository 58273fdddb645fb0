"""The lab's training phase on the package's own stages (``trainers/{grpo,ppo,kto}.py``, ``hf`` backend).

The lab supplies what a stage takes: the pretrained base (``model.path``), the method's reward (served on
PyTriton in this process, or in-process), the RL prompts as ``PromptRecord``s with the columns the
reward reads, and ``validate(step)``: the method's own mean reward on T=1 samples of the *validation*
entities (plus the lab's precision and claims, for the curves). The validator keeps the best weights it
has seen, the base's included (step 0), and training ends on them: model selection never looks at the
held-out entities. Stage configs: ``conf/lab/{grpo,ppo,kto}.yaml`` (``*_quick.yaml`` for ``--quick``).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_factuality.lab.methods import TRAINABLE
from nemo_factuality.lab.world import ABSTAIN_VALUE
from nemo_factuality.trainers.data import PromptRecord
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)
PORT_ATTEMPTS = 3  # fresh ports for a reward server whose ports another process took between the pick and the bind

MONITOR = "val/reward"


@contextlib.contextmanager
def lab_reward(transport: str, spec: dict[str, Any], tokenizer_dir: Path, server_log: Path | None = None,
               response_marker: str | None = None) -> Iterator[tuple[Any, list[str]]]:
    """The reward object and the config overrides that name it: PyTriton (default) or in-process. The server splits
    the token rows it gets at ``response_marker`` (None: the policy's chat template's assistant marker).

    The Triton server prints its start-up tables and shutdown notes to this process's stdout; they go to
    ``server_log`` instead (nothing else of the lab writes to stdout while the server lives)."""
    from nemo_factuality.registry import build_reward

    if transport == "inprocess":
        yield build_reward(spec, str(tokenizer_dir)), ["+reward=" + _json(spec)]
        return
    from nemo_factuality.config import ConfigError
    from nemo_factuality.ports import free_ports
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.trainers.config import GRPOConfig
    from nemo_factuality.trainers.runtime import build_reward as stage_reward

    with contextlib.ExitStack() as stack:
        if server_log is not None:
            server_log.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(server_log.open("a", encoding="utf-8"))))
        for attempt in range(1, PORT_ATTEMPTS + 1):
            # free a moment ago: another process may bind one before the server does (it then stops what it
            # started and says so), so a taken port means new ports, a few times, not a failed method
            ports = free_ports(5)
            serve_cfg = ServeConfig(reward=spec, policy_tokenizer=str(tokenizer_dir), response_marker=response_marker,
                                    host="127.0.0.1", http_port=ports[0], grpc_port=ports[1],
                                    triton_metrics_port=ports[2], health_port=ports[3], metrics_port=ports[4])
            try:
                stack.enter_context(FactualityRewardServer(serve_cfg, build_reward(spec, str(tokenizer_dir))))
                break
            except ConfigError as err:
                taken = isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.EADDRINUSE
                if attempt == PORT_ATTEMPTS or not taken:
                    raise
                log.warning("lab: reward server ports taken meanwhile (%s); trying new ones", err)
        url = f"http://127.0.0.1:{ports[0]}"
        cfg = GRPOConfig()
        cfg.remote_rm.url = url
        yield stage_reward(cfg, None), [f"remote_rm.url={url}"]  # the stage's own client, health-checked


def _json(spec: Mapping[str, Any]) -> str:
    import json

    return json.dumps(dict(spec))


class Validator:
    """``validate(step)``: the method's own mean reward on T=1 samples of the validation prompts, and the lab's
    precision / claims per response (``slot_reward``); remembers the weights of the best ``val/reward`` so far."""

    def __init__(self, model: Any, tokenizer: Any, reward: Any, records: Sequence[PromptRecord], n: int,
                 slot_reward: Callable[..., Any], label: str = "", max_new_tokens: int = 64,
                 max_steps: int | None = None) -> None:
        self.model, self.tokenizer, self.reward, self.records, self.n = model, tokenizer, reward, list(records), n
        self.slot_reward, self.label, self.max_new_tokens = slot_reward, label, max_new_tokens
        self.max_steps = max_steps  # the stage's trainer.max_steps: its lines say "step 40/80"
        self.log: list[dict[str, float]] = []
        self.best_step: int | None = None
        self.best_value = -float("inf")
        self.best_state: dict[str, torch.Tensor] | None = None

    def __call__(self, step: int) -> dict[str, float]:
        self.model.eval()
        from nemo_factuality.lab.evaluate import sample_records

        samples = sample_records(self.model, self.tokenizer, self.records, n=self.n, seed=10_000 + step,
                                 max_new_tokens=self.max_new_tokens)
        rows = [r for r in self.records for _ in range(self.n)]
        names = sorted({k for r in rows for k in r.columns})
        prompts, texts = [r.prompt for r in rows], [s.response for s in samples]
        batch = self.reward(prompts, texts, is_end=[s.ended for s in samples], **{k: [r.columns.get(k) for r in rows] for k in names})
        slots = self.slot_reward(prompts, texts).components
        out = {MONITOR: float(np.nanmean(batch.scores)) if np.isfinite(batch.scores).any() else float("nan"),
               "val/precision": float(slots["supported"].sum() / max(slots["claims"].sum(), 1)),
               "val/claims": float(np.mean(slots["claims"])), "val/abstained": float(np.mean(slots["abstained"]))}
        self.log.append({"step": step, **out})
        if out[MONITOR] > self.best_value:  # NaN never wins
            self.best_value, self.best_step = out[MONITOR], step
            self.best_state = copy.deepcopy(self.model.state_dict())
        of = f"/{self.max_steps}" if self.max_steps else ""
        log.info("%svalidation at step %d%s: reward %.3f, precision %.3f, claims %.2f (best: step %s)", self.label, step,
                 of, out[MONITOR], out["val/precision"], out["val/claims"], self.best_step)
        return out

    def restore_best(self) -> None:
        if self.best_state is None:
            raise FactualityInputError("lab: no validation produced a finite reward; the method's reward is NaN on every sample")
        if self.best_step == 0:
            log.info("lab: no trained policy beat the base on the validation entities; keeping the base weights")
        self.model.load_state_dict(self.best_state)
        self.model.eval()




def restrict_trainable(model: Any, scope: str, abstain_id: int) -> list[str]:
    """What RL may change. ``all``: every weight. ``calibration``: the final norm's gains and the abstention
    token's output row. ``abstention``: that row alone (no temperature channel: the norm gains scale every
    logit, the row moves only "unknown"). Neither narrow scope can store a fact about any one person:
    RL can learn *when* to answer, not *what* to answer. Returns the trainable parameter names."""
    if scope not in TRAINABLE:
        raise FactualityInputError(f"lab: trainable must be one of {TRAINABLE}, got {scope!r}")
    if scope == "all":
        return ["all"]
    for p in model.parameters():
        p.requires_grad_(False)
    head = model.get_output_embeddings().weight
    head.requires_grad_(True)
    rows = torch.zeros(head.shape[0], 1, dtype=head.dtype)
    rows[abstain_id] = 1.0
    head.register_hook(lambda grad: grad * rows.to(grad.device))  # only the abstention row moves
    names = [f"lm_head.weight[{abstain_id}]"]
    if scope == "calibration":
        model.get_decoder().norm.weight.requires_grad_(True)
        names.insert(0, "model.norm.weight")
    return names


def train_stage(stage: str, cfg: Any, base: Path, run_dir: Path, reward: Any, records: Sequence[PromptRecord],
                validator_for: Callable[[Any, Any], Validator], trainable: str) -> tuple[Any, list[dict], Validator]:
    """Run ``stage`` from ``base`` with the loaded ``cfg``; returns (the policy on its best validated weights,
    the stage's per-step metrics, the validator with its log)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_factuality.lab.methods import REAL_TRAINABLE
    from nemo_factuality.lab.real_policy import merge_trained, restrict_real
    from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    if trainable in REAL_TRAINABLE:
        model, names = restrict_real(model, trainable)
    else:
        names = restrict_trainable(model, trainable, tokenizer.convert_tokens_to_ids(ABSTAIN_VALUE))
    log.info("lab %s: training %s", stage, names if len(names) < 8 else f"{len(names)} tensors ({trainable})")
    t = cfg.trainer
    actor = HFActor(cfg.model, max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val, device=t.device, model=model,
                    tokenizer=tokenizer)
    validate = validator_for(actor.model, actor.tokenizer)
    validate(0)  # the base policy's score: training must beat it to be kept
    if stage == "kto":
        from nemo_factuality.trainers.kto import KTOTrainer

        trainer: Any = KTOTrainer(cfg, actor, reward, records, run_dir=run_dir, validate=validate)
        trainer.fit()
        history = _metrics_lines(run_dir)
    else:
        if stage == "ppo":
            from nemo_factuality.trainers.ppo import PPOTrainer

            critic = HFCritic(cfg.critic, str(base), max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val,
                              device=t.device, dtype=cfg.model.dtype)
            if trainable == "top_layers":  # a real critic trains its top layers and value head, as the actor its top
                restrict_real(critic.model, "top_layers")
                critic.model.score.requires_grad_(True)
            trainer = PPOTrainer(cfg, actor, critic, reward, records, run_dir=run_dir, validate=validate)
        else:
            from nemo_factuality.trainers.grpo import GRPOTrainer

            trainer = GRPOTrainer(cfg, actor, reward, records, run_dir=run_dir, validate=validate)
        history = [{"step": i + 1, **m} for i, m in enumerate(trainer.fit())]
    validate.restore_best()
    return merge_trained(actor.model), history, validate


def _metrics_lines(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] if path.exists() else []
