"""RLFH's PPO critic on the aligner backend: NeMo-Aligner's critic server, run from the PPO stage's own config.

    python -m nemo_factuality.trainers.critic_server --config-name rlfh trainer.backend=aligner \\
        model.restore_from_path=/ckpt/policy.nemo critic.port=5556 exp_manager.explicit_log_dir=/results/rlfh

It serves, on ``critic.port`` (PyTriton, rank 0; the other ranks follow its broadcasts):

* ``critic_infer``  tokens ``[B, S]`` + sequence lengths → values ``[B, S]`` (Aligner's layout),
* ``critic_train``  tokens, returns, prev_values, mask ``[B, S-1]`` → one optimiser step per
  ``model.global_batch_size`` sequences of Aligner's clipped value loss (``critic.loss_clip_val``),
* ``critic_save``   a step number → a NeMo distributed checkpoint under ``<log dir>/critic/checkpoints``,
* ``critic_state``  → the server's optimiser-step count (the PPO stage checks it when it resumes).

The model is Aligner's ``MegatronGPTCriticModel`` (a GPT with a token-level value head) restored from
``critic.path`` or, by default, from the policy ``.nemo`` with the value head zeroed, as RLFH/OpenRLHF
initialise the critic (the hf backend's critic does the same). The server resumes from its latest
checkpoint at start-up, so a requeued Slurm job restarts actor and critic at the same step.

``combine_rm_and_critic_server`` is false: Aligner combines them only to swap a scalar reward model's
weights into the critic's GPUs; RLFH's reward is the ``factuality_reward`` server (claim extraction and
verification by LLM judges, token-level), which is not a weight set the critic server could hold. Aligner
0.7.0's critic-only path unpacks the value array as if it were a (rewards, values) pair, so the server
subclass below returns values alone there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.trainers.config import PPOConfig

log = logging.getLogger(__name__)

MODELS = {"infer": "critic_infer", "train": "critic_train", "save": "critic_save", "state": "critic_state"}


def critic_optimizer_steps(cfg: PPOConfig) -> int:
    """The critic's LR-schedule horizon: one optimiser step per minibatch of every PPO epoch of every step."""
    per_step = math.ceil(cfg.ppo.num_prompts_per_step / cfg.model.global_batch_size) * cfg.ppo.num_epochs
    return max(1, cfg.trainer.max_steps * per_step)


def critic_model_overrides(cfg: PPOConfig) -> dict[str, Any]:
    """Aligner's critic ``model`` section from the stage config (wins over the checkpoint's config)."""
    from nemo_factuality.trainers.backends.aligner.actor import (
        _PRECISION,
        CONVERTED_CHECKPOINT_KEYS,
        _merge,
        _plain,
        nemo_optim,
    )

    c = cfg.critic
    return _merge({
        "tensor_model_parallel_size": c.tensor_model_parallel_size,
        "pipeline_model_parallel_size": c.pipeline_model_parallel_size,
        "micro_batch_size": c.micro_batch_size, "forward_micro_batch_size": c.micro_batch_size,
        "global_batch_size": cfg.model.global_batch_size,  # one critic_train request = one minibatch = one step
        "precision": _PRECISION[cfg.model.dtype], "seed": cfg.trainer.seed,
        "optim": nemo_optim(_plain(c.optim), critic_optimizer_steps(cfg)),
        "loss_clip_val": c.loss_clip_val, "offload_adam_states": False,
        "output_sequence": True, "use_avg_pool": False, "force_head_dtype": "float32",
        "reward_model_type": "binary_ranking", "reward_standardization": {"enable": False, "mean": None, "std": None},
        "regression": {"num_attributes": 1, "merge_attributes": True, "attribute_weights": None},
        **CONVERTED_CHECKPOINT_KEYS,
    }, dict(c.model_overrides))


def critic_log_dir(cfg: PPOConfig) -> Path:
    return Path(cfg.exp_manager.explicit_log_dir) / "critic"


class CriticMetrics:
    """Aligner's trainer logger shape (``log_metrics(metrics, step, prefix)``) → ``<log dir>/metrics.jsonl`` on rank 0."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def log_metrics(self, metrics: dict, step: int, prefix: str = "") -> None:
        if torch.distributed.get_rank() != 0:
            return
        row = {"step": step, **{f"{prefix}{k}": float(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _committed_step(checkpoints: Path) -> int | None:
    """The critic step the run's committed checkpoint pairs with: ``<log dir>/checkpoints/latest`` → its
    ``critic.json``; None when the run has no checkpoint yet. The run's ``latest`` is the one commit point of a PPO
    checkpoint: the critic's own saves are candidates until the actor's checkpoint naming them is renamed into place."""
    run_checkpoints = checkpoints.parent.parent / "checkpoints"  # <log dir>/critic/checkpoints → <log dir>/checkpoints
    pointer = run_checkpoints / "latest"
    if not pointer.is_file():
        return None
    record = run_checkpoints / pointer.read_text(encoding="utf-8").strip() / "critic.json"
    if not record.is_file():
        return None
    step = json.loads(record.read_text(encoding="utf-8"))["server_step"]
    return None if step is None else int(step)


def _latest(checkpoints: Path) -> tuple[Path, int] | None:
    """Where a (re)started critic server resumes: the server step the run's committed checkpoint names — so a kill
    between the critic's save and the actor's rename leaves the pair at their previous shared step, never a critic
    newer than its actor — or, in a run without one, nothing (a fresh critic, as the actor starts fresh)."""
    step = _committed_step(checkpoints)
    if step is None:
        return None
    state = checkpoints / f"server_step_{step:08d}" / "state"
    if not state.is_dir():
        from nemo_factuality.types import FactualityInputError

        raise FactualityInputError(f"the run's latest checkpoint pairs with critic server step {step}, but {state} is "
                                   "missing: restore that directory, or start the run and its critic afresh")
    return state, step


def build_server(cfg: PPOConfig, *, devices: int, num_nodes: int):
    """Restore the critic (resuming from ``<log dir>/critic/checkpoints`` when a checkpoint is there) and wrap it
    in the PyTriton server; returns the server (call ``run_server()`` on every rank)."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_critic import MegatronGPTCriticModel
    from nemo_aligner.utils.train_script_utils import (
        extract_optimizer_scheduler_from_ptl_model,
        init_distributed,
        init_using_ptl,
    )
    from nemo_aligner.utils.utils import load_and_override_model_config, load_from_nemo
    from omegaconf import OmegaConf

    from nemo_factuality.trainers.backends.aligner.actor import (
        AlignerRuntime,
        nemo_trainer,
        restore_training_state,
        shardable_adam_steps,
    )

    path = cfg.critic.path or cfg.model.restore_from_path
    if not path or not Path(path).exists():
        raise FileNotFoundError(f"critic.path / model.restore_from_path={path!r} is not a .nemo file or extracted "
                                "directory: write one with `nemo-factuality convert hf-to-nemo --extracted`")
    runtime = AlignerRuntime(devices=devices, num_nodes=num_nodes, max_steps=critic_optimizer_steps(cfg),
                             gradient_clip_val=cfg.trainer.gradient_clip_val, seed=cfg.trainer.seed,
                             distributed_timeout_s=cfg.trainer.distributed_timeout_s)
    model_cfg = load_and_override_model_config(str(path), OmegaConf.create(critic_model_overrides(cfg)))
    trainer = nemo_trainer(model_cfg, runtime, section="ppo")
    from_policy = cfg.critic.path is None
    # a policy checkpoint has no value head: load the GPT backbone only, then start every value at 0
    model = load_from_nemo(MegatronGPTCriticModel, model_cfg, trainer, strict=True, restore_path=str(path),
                           load_base_model_only=from_policy)
    if from_policy:
        _zero_value_head(model)
    log_dir = critic_log_dir(cfg)
    checkpoints = log_dir / "checkpoints"
    latest = _latest(checkpoints)
    init_distributed(trainer, model, model_cfg.get("transformer_engine", False))
    if not torch.cuda.is_available():  # NeMo seeds Megatron's model-parallel RNG tracker only on GPU
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.trainer.seed)
    init_using_ptl(trainer, model, None, None)
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(model)
    shardable_adam_steps(getattr(optimizer, "optimizer", optimizer))  # torch AdamW state in the sharded checkpoint
    if latest is not None:  # after the hooks: the optimiser's state goes through them
        restore_training_state(trainer, scheduler, latest[0])
        log.info("critic server resumed from %s (server step %d)", latest[0], latest[1])
    if torch.distributed.get_rank() == 0:
        checkpoints.mkdir(parents=True, exist_ok=True)
    server_cfg = OmegaConf.create({"port": cfg.critic.port, "combine_rm_and_critic_server": False,
                                   "inference_micro_batch_size": [cfg.critic.micro_batch_size],
                                   "gradient_clip_val": cfg.trainer.gradient_clip_val, "max_queue_delay_microseconds": 2000})
    server = _server_class()(cfg=server_cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                             logger=CriticMetrics(log_dir / "metrics.jsonl"), ckpt_callback=None,
                             tokenize_func=_no_text, gbs=cfg.model.global_batch_size,
                             model_forward_micro_batch_size=cfg.critic.micro_batch_size)
    server.trainer, server.checkpoints, server.keep = trainer, checkpoints, max(1, cfg.exp_manager.save_top_k)
    server.step = latest[1] if latest is not None else 0
    return server


def _no_text(_sentences):
    raise ValueError("this critic server takes token ids (tokens + sequence_lengths), not sentences")


def _zero_value_head(model) -> None:
    from megatron.core.transformer.module import Float16Module

    for module in model.get_model_module_list():
        base = module.module if isinstance(module, Float16Module) else module
        head = getattr(base, "rm_head", None)  # only on the last pipeline stage
        if head is not None:
            with torch.no_grad():
                for p in head.parameters():
                    p.zero_()


def _server_class():
    """Aligner's ``CriticServerTrainer`` with critic-only inference fixed, our checkpoint layout and ``critic_state``."""
    import numpy as np
    from nemo_aligner.algorithms.critic_server_trainer import CriticServerTrainer
    from nemo_aligner.utils.server_utils import lock_method
    from pytriton.decorators import sample
    from pytriton.model_config import Tensor

    parent_train = CriticServerTrainer.__dict__["server_train"].__wrapped__  # under @sample: locked, takes arrays

    class FactualityCriticServer(CriticServerTrainer):
        trainer: Any = None
        checkpoints: Path
        keep: int = 2
        applied: tuple[int, dict] | None = None  # (request_id, its answer) of the last update applied

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # reentrant: server_train holds it while the parent's (locked) update runs inside it
            self.lock = threading.RLock()
            self.train_inputs = (*self.train_inputs, Tensor(name="request_id", shape=(1,), dtype=np.int64, optional=True))

        @sample
        @lock_method("self.lock")
        def server_train(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
            """One critic update per request id: a client that timed out resends the same id, and when the first
            request was only slow (queued or still running, not lost) the resend is answered from what the first
            one applied — never a second optimiser step for one minibatch. No id: Aligner's behaviour."""
            request_id = inputs.pop("request_id", None)
            key = None if request_id is None else int(np.asarray(request_id).reshape(-1)[0])
            if key is not None and self.applied is not None and self.applied[0] == key:
                log.warning("critic_train request %d repeated (its client timed out while it ran): answered from the "
                            "update already applied at server step %d, not applied again", key, self.step)
                return dict(self.applied[1])
            out = parent_train(self, **inputs)
            if key is not None:
                self.applied = (key, {k: np.array(v, copy=True) for k, v in out.items()})
            return out

        @torch.no_grad()
        def run_inference(self, inputs=None):
            if self.combine_rm_and_critic_server:
                return super().run_inference(inputs)
            from nemo_aligner.utils.distributed import run_distributed_inference

            self.model.prepare_for_inference()
            values = run_distributed_inference(inputs, self.infer_fn)  # one array, not a (rewards, values) pair
            self.model.finish_inference()
            torch.distributed.barrier()
            return None, values

        @sample
        @lock_method("self.lock")
        def server_state(self, **_: np.ndarray) -> dict[str, np.ndarray]:
            return {"step": np.array([self.step], dtype=np.int64)}

        def save(self, extra_candidates=None, is_train_end=False, save_top_only=False):
            save_server_checkpoint(self)

        def run_server(self):
            if torch.distributed.get_rank() != 0:
                return self.run_subscriber_loop()
            return serve_critic_models(self)

    return FactualityCriticServer


def save_server_checkpoint(server: Any) -> None:
    """Every rank writes its shard of ``<checkpoints>/server_step_<n>/state``; rank 0 then records it in
    ``latest.json`` (information only: a restart resumes from the step the run's committed checkpoint names,
    ``_latest``) and prunes to the newest ``exp_manager.save_top_k`` and the committed one."""
    server.model.prepare_for_training()  # Adam states back where the checkpoint reads them
    name = f"server_step_{server.step:08d}"
    server.trainer.save_checkpoint(str(server.checkpoints / name / "state.ckpt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = server.checkpoints / "latest.json.tmp"
        tmp.write_text(json.dumps({"dir": name, "server_step": server.step}), encoding="utf-8")
        os.replace(tmp, server.checkpoints / "latest.json")
        _prune(server.checkpoints, server.keep)
    torch.distributed.barrier()
    server.model.finish_training()


def serve_critic_models(server: Any) -> None:
    """Rank 0's PyTriton server: ``critic_infer`` dynamically batched, ``critic_train`` / ``critic_save`` /
    ``critic_state`` one request at a time (the other ranks follow in Aligner's subscriber loop)."""
    import numpy as np
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.model_config.common import DynamicBatcher
    from pytriton.triton import Triton, TritonConfig

    from nemo_factuality.serving.server import ensure_python_backend_env

    ensure_python_backend_env()
    whole = ModelConfig(batching=False, max_batch_size=0, batcher=None)  # train/save/state: no batching
    batcher = DynamicBatcher(max_queue_delay_microseconds=server.max_queue_delay_microseconds,
                             preferred_batch_size=server.preferred_batch_sizes)
    triton_cfg = TritonConfig(allow_http=True, allow_grpc=False, allow_metrics=False,
                              http_address=os.environ.get("CRITIC_BIND_ADDRESS", "0.0.0.0"), http_port=server.port)
    with Triton(config=triton_cfg) as triton:
        triton.bind(model_name=MODELS["infer"], infer_func=server.server_infer, inputs=server.infer_inputs,
                    outputs=server.infer_outputs, config=ModelConfig(batching=True, max_batch_size=9_999_999, batcher=batcher))
        triton.bind(model_name=MODELS["train"], infer_func=server.server_train, inputs=server.train_inputs,
                    outputs=server.train_outputs, config=whole)
        triton.bind(model_name=MODELS["save"], infer_func=server.server_save, inputs=server.save_inputs,
                    outputs=server.save_outputs, config=whole)
        triton.bind(model_name=MODELS["state"], infer_func=server.server_state,
                    inputs=(Tensor(name="dummy_var", shape=(1,), dtype=np.int64),),
                    outputs=(Tensor(name="step", shape=(1,), dtype=np.int64),), config=whole)
        log.info("critic server ready on port %d: %s", server.port, ", ".join(MODELS.values()))
        triton.serve()


def _prune(checkpoints: Path, keep: int) -> None:
    """Keep the newest ``keep`` saves and always the one the run's committed checkpoint names (with keep=1 the
    newest save is not committed until the actor's rename: pruning its predecessor would leave the run unpaired)."""
    import shutil

    committed = _committed_step(checkpoints)
    for old in sorted(p for p in checkpoints.glob("server_step_*") if p.is_dir())[:-keep]:
        if committed is None or old.name != f"server_step_{committed:08d}":
            shutil.rmtree(old, ignore_errors=True)


def serve(argv: Sequence[str] | None) -> int:
    """Parse the PPO stage config (``--config-name`` + overrides), build the critic, serve until killed."""
    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.cli import parse_stage_config

    cfg, _ = parse_stage_config("ppo", argv, prog="python -m nemo_factuality.trainers.critic_server")
    if cfg.trainer.backend != "aligner":
        raise ConfigError("the critic server is the aligner backend's critic: set trainer.backend=aligner "
                          "(the hf backend trains its critic inside the PPO process)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    critic_log_dir(cfg).mkdir(parents=True, exist_ok=True)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", os.environ.get("WORLD_SIZE", 1))))
    server = build_server(cfg, devices=devices, num_nodes=int(os.environ.get("SLURM_NNODES", 1)))
    server.run_server()
    return 0


if __name__ == "__main__":
    from nemo_factuality.cli import run_command

    sys.exit(run_command(serve, sys.argv[1:], "critic_server"))
