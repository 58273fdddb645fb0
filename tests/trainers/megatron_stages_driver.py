"""Runs in the megatron venv under torchrun (gloo): the real PPO stage (RLFH: ``PPOTrainer`` with the backend's critic,
a dense toy reward) and the real KTO stage (FactAlign: ``KTOTrainer``, iterated, a toy labeller) on
``trainer.backend=megatron``, through the command boundary (``cli.run_command``) as the stage CLI runs them, from an HF
checkpoint to the exported HF folder ``final/``:

    torchrun --nproc_per_node 2 tests/trainers/megatron_stages_driver.py --hf DIR --out DIR --tp 2
    torchrun --nproc_per_node 2 tests/trainers/megatron_stages_driver.py --hf DIR --out DIR

Each run starts as a job does: the seed set, the actor (and critic) built from the HF checkpoint, then the stage. Per
stage, ``straight`` (to the end, a checkpoint every step) and ``interrupted`` (stopped by ``trainer.max_steps`` and
rerun with a larger one: the requeued job, resuming from the last checkpoint). PPO: 3 steps, interrupted after step 2;
AdamW for the actor and the critic, clipping at 1 — the optimisers' moments are state a resume must restore. KTO: 2
iterations of 2 minibatches (4 prompts × 2 samples, one left unlabelled: 4 + 3 examples), interrupted after step 2
(the iteration's end: its successor already sampled, its reference reset) and again after step 3 (mid-iteration).

Each rank writes ``<out>/rank<r>.json``: per run the exit code, the metrics logged, the checkpoints, the policy's
log-probs (and PPO's critic's values) of fixed sequences afterwards, and the largest difference between ``final/``
reloaded in transformers and the trained Megatron model's logits (global rank 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import megatron_cpu  # noqa: E402

megatron_cpu.apply()

import torch  # noqa: E402
from megatron_grpo_driver import FIXED, final_logits_diff, fixed_logprobs  # noqa: E402  (sibling driver)

from nemo_factuality.cli import run_command  # noqa: E402
from nemo_factuality.testing.training import good_tokens_dense, half_good_labeller, prompts, read_metrics  # noqa: E402
from nemo_factuality.trainers.backends import BACKENDS  # noqa: E402
from nemo_factuality.trainers.config import KTOConfig, PPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout  # noqa: E402
from nemo_factuality.trainers.kto import KTOTrainer  # noqa: E402
from nemo_factuality.trainers.ppo import PPOTrainer  # noqa: E402
from nemo_factuality.trainers.runtime import seed_everything  # noqa: E402

SEED = 7


def common(args, run_dir: Path, max_steps: int) -> list[str]:
    return [f"model.path={args.hf}", "trainer.backend=megatron", f"model.tensor_model_parallel_size={args.tp}",
            f"trainer.max_steps={max_steps}", "trainer.save_interval=1", "trainer.progress_bar=false",
            f"trainer.seed={SEED}", "model.micro_batch_size=2", "model.global_batch_size=4",
            "model.forward_micro_batch_size=2", "model.rollout_micro_batch_size=4", "model.length_params.max_length=5",
            "model.optim.name=adamw", "model.optim.lr=0.01", "model.optim.sched.name=constant",
            "remote_rm.url=http://127.0.0.1:9", f"exp_manager.explicit_log_dir={run_dir}",
            "exp_manager.create_tensorboard_logger=false"]


def ppo_config(args, run_dir: Path, max_steps: int) -> PPOConfig:
    return load_train_config(PPOConfig, None, [*common(args, run_dir, max_steps), "ppo.num_prompts_per_step=4",
                                               "critic.micro_batch_size=2", "critic.optim.lr=0.01"])


def kto_config(args, run_dir: Path, max_steps: int) -> KTOConfig:
    return load_train_config(KTOConfig, None, [*common(args, run_dir, max_steps), "kto.num_iterations=2",
                                               "kto.prompts_per_iteration=4", "kto.samples_per_prompt=2",
                                               "kto.epochs_per_iteration=1"])


def fixed_values(critic) -> list:
    rollout = Rollout(FIXED, torch.tensor([3, 3]), torch.tensor([7, 7]), torch.ones(2, dtype=torch.bool))
    return critic.values(rollout).tolist()


def run_once(args, stage: str, name: str, run_dir: Path, max_steps: int) -> tuple[dict, object]:
    """One job: seeded, the models built from the HF checkpoint, the stage run to ``max_steps`` (resuming the run
    directory's checkpoint when there is one). Returns what it recorded and the actor (for ``final/``)."""
    seed_everything(SEED)
    if stage == "ppo":
        cfg = ppo_config(args, run_dir, max_steps)
        actor, critic = BACKENDS.get("megatron")(cfg, critic=True)
        trainer = PPOTrainer(cfg, actor, critic, good_tokens_dense, prompts(8), run_dir=run_dir)
    else:
        cfg = kto_config(args, run_dir, max_steps)
        actor, critic = BACKENDS.get("megatron")(cfg)
        trainer = KTOTrainer(cfg, actor, half_good_labeller, prompts(4), run_dir=run_dir)
    code = run_command(lambda _argv: trainer.fit() and 0, [], f"train {stage} ({name})")
    ckpt = run_dir / "checkpoints"
    out = {"exit": code, "checkpoints": sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else [],
           "metrics": read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [],
           "logprobs": fixed_logprobs(actor), "values": fixed_values(critic) if critic is not None else None,
           "dp": actor.data_parallel_size, "dp_rank": actor.data_parallel_rank}
    if (ckpt / "latest").is_file():
        out["latest_files"] = sorted(p.name for p in (ckpt / (ckpt / "latest").read_text().strip()).iterdir())
    return out, actor


def stage_runs(args, stage: str, plans: dict[str, tuple[int, ...]]) -> dict:
    runs: dict = {}
    for name, steps in plans.items():
        for max_steps in steps:  # the later ones are the requeued job: the same command, the same run directory
            runs[name], actor = run_once(args, stage, name, Path(args.out) / stage / name, max_steps)
            if max_steps != steps[-1]:
                del actor
                gc.collect()
    final = Path(args.out) / stage / "interrupted" / "final"
    runs["final_logits_max_diff"] = final_logits_diff(actor, final)
    runs["final_files"] = sorted(p.name for p in final.iterdir())
    return runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    result = {"ppo": stage_runs(args, "ppo", {"straight": (3,), "interrupted": (2, 3)}),
              "kto": stage_runs(args, "kto", {"straight": (4,), "interrupted": (2, 3, 4)})}
    rank = torch.distributed.get_rank()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
