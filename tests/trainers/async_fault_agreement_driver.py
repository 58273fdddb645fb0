"""Runs under torchrun (gloo, 2 ranks): GRPO at ``grpo.max_staleness=1`` on the ``hf`` backend, each rank with its own
rollout engine (``testing.scripted_engine``), where the engine of data-parallel rank 1 dies mid-flight:

    torchrun --nproc_per_node 2 tests/trainers/async_fault_agreement_driver.py --hf DIR --out DIR

Runs, each from the same initial weights and seed (SGD without momentum: the weights are the whole state):

* ``undisturbed``: 3 steps;
* ``engine``: rank 1's engine dies at its 3rd request — step 3's rollouts, sent while step 2 trains — with no restart
  left (``rollout.vllm.restarts=0``); rank 0's flight ends normally. Step 3 takes them in the stage's agreement: every
  rank checkpoints step 2 (rank 0's step-3 rollouts saved, rank 1's lost) and exits 75;
* ``engine_resumed``: the same command again, on healthy engines, to step 3.

Every group runs under scaled-down timeouts (``trainer.distributed_timeout_s`` = ``--group-timeout``, the engine's
a few seconds), so a rank that waited for another past the group's timeout would fail here as NCCL's watchdog fails
it in production. Each rank writes ``<out>/rank<r>.json``: per run the exit code the command boundary gives, the
seconds from the start of step 3 to the run's end, the checkpoints, the metrics logged and the prompt rows each step
trained on (this rank's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from nemo_factuality.cli import run_command  # noqa: E402
from nemo_factuality.testing.scripted_engine import engine_python  # noqa: E402
from nemo_factuality.testing.training import good_fraction, prompts, read_metrics  # noqa: E402
from nemo_factuality.trainers.backends import BACKENDS  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.engines.vllm_rollout import with_rollout_engine  # noqa: E402
from nemo_factuality.trainers.grpo import GRPOTrainer  # noqa: E402
from nemo_factuality.trainers.runtime import seed_everything  # noqa: E402


class Timed(GRPOTrainer):
    """Records each step's prompt rows and when step 3 started."""

    def train_one_step(self):
        if self.step == 2:
            self.step3_started = time.monotonic()
        out = super().train_one_step()
        self.trained = getattr(self, "trained", []) + [list(self.step_prompts)]
        return out


def overrides(args, run_dir: Path, python: Path) -> list[str]:
    return [f"model.path={args.hf}", "trainer.backend=hf", "trainer.max_steps=3", "trainer.save_interval=0",
            f"trainer.distributed_timeout_s={args.group_timeout}", "trainer.progress_bar=false",
            "grpo.num_prompts_per_step=4", "grpo.num_rollouts_per_prompt=2", "grpo.truncated=keep",
            "grpo.max_staleness=1", "model.micro_batch_size=2", "model.global_batch_size=8",
            "model.forward_micro_batch_size=2", "model.rollout_micro_batch_size=8", "model.length_params.max_length=5",
            "model.dtype=float32", "model.optim.name=sgd", "model.optim.lr=0.05", "model.optim.sched.name=constant",
            "remote_rm.url=http://127.0.0.1:5555", "remote_rm.timeout_s=1", "remote_rm.retry.max_wait_s=3",
            "rollout.engine=vllm", "rollout.vllm.placement=separate",
            "rollout.vllm.tis_cap=2.0", "rollout.vllm.restarts=0", "rollout.vllm.start_timeout_s=30",
            "rollout.vllm.request_timeout_s=5", "rollout.vllm.reply_timeout_s=2", f"rollout.vllm.python={python}",
            f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false"]


def run(actor, args, name: str, run_dir: Path, script: dict) -> dict:
    rank = torch.distributed.get_rank()
    python = engine_python(Path(args.out) / f"{name}_engine_rank{rank}", script)
    cfg = load_train_config(GRPOConfig, None, overrides(args, run_dir, python))
    rollouts = with_rollout_engine(cfg, actor, run_dir)
    trainer = Timed(cfg, rollouts, good_fraction, prompts(8), run_dir=run_dir)
    try:
        code = run_command(lambda _argv: trainer.fit() and 0, [], f"train grpo ({name})")
    finally:
        rollouts.close()
    ckpt = run_dir / "checkpoints"
    started = getattr(trainer, "step3_started", None)
    return {"exit": code, "after_step3_s": None if started is None else time.monotonic() - started,
            "checkpoints": sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else [],
            "metrics": read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [],
            "trained": getattr(trainer, "trained", [])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--group-timeout", type=float, default=30.0,
                    help="trainer.distributed_timeout_s, scaled down from production's 7200 s")
    args = ap.parse_args()
    out = Path(args.out)
    cfg = load_train_config(GRPOConfig, None, overrides(args, out / "init", Path(sys.executable)))
    actor, _ = BACKENDS.get("hf")(cfg)
    initial = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
    dying = {"starts": {"rank1:0": {"die_at_generate": 3}}}
    runs = {}
    for name, script, run_dir in (("undisturbed", {}, out / "undisturbed"), ("engine", dying, out / "engine"),
                                  ("engine_resumed", {}, out / "engine")):
        if name != "engine_resumed":
            actor.model.load_state_dict(initial)
            seed_everything(args.seed)
        runs[name] = run(actor, args, name, run_dir, script)
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "dp_rank": actor.data_parallel_rank, "runs": runs,
                                                      "group_timeout_s": args.group_timeout}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
