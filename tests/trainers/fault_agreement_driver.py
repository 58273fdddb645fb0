"""Runs under torchrun (gloo): the GRPO stage at data parallelism where a fault reaches ONE rank only, and what every
rank did about it. On ``AlignerActor`` at TP×DP (in the NeMo-Aligner venv) or on the ``hf`` backend at DP (a full
replica per rank, in the project's venv):

    torchrun --nproc_per_node 4 tests/trainers/fault_agreement_driver.py --nemo DIR --out DIR --tp 2
    torchrun --nproc_per_node 2 tests/trainers/fault_agreement_driver.py --hf DIR --out DIR

Runs, each from the same initial weights and seed (SGD without momentum: the weights are the whole state):

* ``undisturbed``: 3 steps;
* ``outage``: data-parallel replica 1's reward client gives up at step 2 (its server gone past the retry window,
  as ``RewardServerUnavailable`` says it) while replica 0's answers — then ``outage_resumed`` reruns to step 3;
* ``preempt``: SIGUSR1 reaches replica 1's source rank alone during step 2 (Slurm signals ranks one by one) —
  then ``preempt_resumed`` reruns to step 3.

Each rank writes ``<out>/rank<r>.json``: per run the exit code the command boundary gives (``cli.run_command``),
seconds, the checkpoints on disk, the metrics logged, and after the run the log-probs of fixed sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ON_ALIGNER = "--nemo" in " ".join(sys.argv)
if ON_ALIGNER:
    from nemo_factuality.testing import aligner_cpu

    aligner_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.cli import run_command  # noqa: E402
from nemo_factuality.serving.client import RewardServerUnavailable  # noqa: E402
from nemo_factuality.testing.training import good_fraction, prompts, read_metrics  # noqa: E402
from nemo_factuality.trainers.backends import BACKENDS  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.grpo import GRPOTrainer  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout  # noqa: E402
from nemo_factuality.trainers.runtime import seed_everything  # noqa: E402

FAULT_CALL = 2  # the reward call (= step) at which the fault reaches its rank


class OneRankFault:
    """``good_fraction``; on the chosen rank, at call ``FAULT_CALL``, the fault instead (on the others, nothing)."""

    def __init__(self, fault: str | None, actor) -> None:
        self.fault, self.calls = fault, 0
        # the reward is called on each replica's source rank: replica 1's is the one rank the fault reaches
        self.mine = fault is not None and actor.data_parallel_rank == 1 and actor.is_model_parallel_source

    def __call__(self, prompts_, completions, **columns):
        self.calls += 1
        if self.mine and self.calls == FAULT_CALL:
            if self.fault == "outage":
                raise RewardServerUnavailable("reward server http://127.0.0.1:9 unreachable for 30 s "
                                              "(remote_rm.retry.max_wait_s): injected on data-parallel replica 1")
            os.kill(os.getpid(), signal.SIGUSR1)
        return good_fraction(prompts_, completions, **columns)


def overrides(args, run_dir: Path, max_steps: int) -> list[str]:
    model = ([f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", f"model.tensor_model_parallel_size={args.tp}"]
             if args.nemo else [f"model.path={args.hf}", "trainer.backend=hf"])
    return model + [f"trainer.max_steps={max_steps}",
            "trainer.save_interval=1", "trainer.progress_bar=false", "grpo.num_prompts_per_step=4",
            "grpo.num_rollouts_per_prompt=2", "grpo.truncated=keep", "model.micro_batch_size=2", "model.global_batch_size=8", "model.forward_micro_batch_size=2",
            "model.length_params.max_length=5", "model.dtype=float32", "model.optim.name=sgd", "model.optim.lr=0.05",
            "model.optim.sched.name=constant", "remote_rm.url=http://127.0.0.1:5555",
            f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false"]


def fixed_logprobs(actor) -> list:
    tokens = torch.tensor([[5, 17, 33, 8, 90, 41, 7], [9, 60, 2, 44, 31, 18, 77]])
    rollout = Rollout(tokens, torch.tensor([3, 3]), torch.tensor([7, 7]), torch.ones(2, dtype=torch.bool))
    return actor.logprobs(rollout).tolist()


def run(actor, args, name: str, run_dir: Path, max_steps: int, fault: str | None) -> dict:
    reward = OneRankFault(fault, actor)
    trainer = GRPOTrainer(load_train_config(GRPOConfig, None, overrides(args, run_dir, max_steps)), actor, reward,
                          prompts(8), run_dir=run_dir)
    t0 = time.monotonic()
    code = run_command(lambda _argv: trainer.fit() and 0, [], f"train grpo ({name})")
    ckpt = run_dir / "checkpoints"
    return {"exit": code, "seconds": time.monotonic() - t0, "calls": reward.calls,
            "checkpoints": sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else [],
            "metrics": read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [],
            "logprobs": fixed_logprobs(actor)}


def main() -> int:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--nemo", help="aligner backend: the policy's extracted .nemo")
    which.add_argument("--hf", help="hf backend: the policy's HF folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    out = Path(args.out)
    cfg = load_train_config(GRPOConfig, None, overrides(args, out / "init", 3))
    if args.nemo:
        from nemo_factuality.trainers.backends.aligner import build_actor

        actor = build_actor(cfg, max_steps=10, rollout_micro_batch_size=4,
                            model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    else:
        actor, _ = BACKENDS.get("hf")(cfg)
    initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in actor.model.state_dict().items()}
    runs = {}
    for name, fault in (("undisturbed", None), ("outage", "outage"), ("preempt", "preempt")):
        actor.model.load_state_dict(initial)
        seed_everything(args.seed)
        runs[name] = run(actor, args, name, out / name, 3, fault)
        if fault is not None:  # the requeued job: the same command, the same run directory
            runs[f"{name}_resumed"] = run(actor, args, name, out / name, 3, None)
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "dp_rank": actor.data_parallel_rank, "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
