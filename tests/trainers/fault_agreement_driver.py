"""Runs under torchrun (gloo): the GRPO stage at data parallelism where a fault reaches ONE rank only, and what every
rank did about it. On ``AlignerActor`` at TP×DP (in the NeMo-Aligner venv) or on the ``hf`` backend at DP (a full
replica per rank, in the project's venv):

    torchrun --nproc_per_node 4 tests/trainers/fault_agreement_driver.py --nemo DIR --out DIR --tp 2
    torchrun --nproc_per_node 2 tests/trainers/fault_agreement_driver.py --hf DIR --out DIR

Runs, each from the same initial weights and seed (SGD without momentum: the weights are the whole state):

* ``undisturbed``: 3 steps;
* ``outage``: data-parallel replica 1's reward client gives up at step 2 — it retries a closed port through the
  reward client's own retry loop for its whole window, ``2 × remote_rm.timeout_s + remote_rm.retry.max_wait_s``,
  while replica 0's answers and its ranks wait in the step's agreement — then ``outage_resumed`` reruns to step 3;
* ``preempt``: SIGUSR1 reaches replica 1's source rank alone during step 2 (Slurm signals ranks one by one) —
  then ``preempt_resumed`` reruns to step 3;
* ``engine``: replica 1's rollout engine is gone for good at step 2 — every rank of replica 1 raises the
  ``EngineUnavailable`` that ``VLLMRollout`` raises past ``rollout.vllm.restarts`` (relayed over the replica) while
  replica 0 generates — then ``engine_resumed`` reruns to step 3.

Every process group runs under the production timeouts scaled down (``--group-timeout`` for
``trainer.distributed_timeout_s``, a retry window of a few seconds inside it), so a healthy rank that waited longer
than the group allows would fail here as NCCL's watchdog fails it in production.

Each rank writes ``<out>/rank<r>.json``: per run the exit code the command boundary gives (``cli.run_command``),
seconds, the checkpoints on disk, the metrics logged, and after the run the log-probs of fixed sequences; then
``timeout_probe``: how long rank 0 waited in an all-reduce that no other rank joins.
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
from nemo_factuality.serving.client import Backoff, RewardServerUnavailable, call_with_retry  # noqa: E402
from nemo_factuality.testing.ports import free_ports  # noqa: E402
from nemo_factuality.testing.training import good_fraction, prompts, read_metrics  # noqa: E402
from nemo_factuality.trainers.backends import BACKENDS  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.engines.vllm_engine import EngineUnavailable  # noqa: E402
from nemo_factuality.trainers.grpo import GRPOTrainer  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout  # noqa: E402
from nemo_factuality.trainers.runtime import seed_everything  # noqa: E402

FAULT_CALL = 2  # the reward call (= step) at which the fault reaches its rank
REQUEST_TIMEOUT_S, MAX_WAIT_S = 1.0, 3.0  # remote_rm.timeout_s, remote_rm.retry.max_wait_s: a 5 s window


def dead_server_window() -> None:
    """What a reward client does when its server is gone: the stages' retry loop against a closed port, for the
    whole of ``remote_rm.retry.max_wait_s``, then ``RewardServerUnavailable``."""
    import socket

    (port,) = free_ports(1)  # nothing listens there

    def request() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S):
            pass

    call_with_retry(request, what="reward server", url=f"http://127.0.0.1:{port}", key="remote_rm.retry.max_wait_s",
                    backoff=Backoff(max_wait_s=MAX_WAIT_S, initial_s=0.5, max_s=1.0, jitter=0.0),
                    unavailable=RewardServerUnavailable, went_away=lambda err: isinstance(err, OSError))


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
                dead_server_window()  # raises RewardServerUnavailable after the window
            os.kill(os.getpid(), signal.SIGUSR1)
        return good_fraction(prompts_, completions, **columns)


def overrides(args, run_dir: Path, max_steps: int) -> list[str]:
    model = ([f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", f"model.tensor_model_parallel_size={args.tp}"]
             if args.nemo else [f"model.path={args.hf}", "trainer.backend=hf"])
    return model + [f"trainer.max_steps={max_steps}", f"trainer.distributed_timeout_s={args.group_timeout}",
            f"remote_rm.timeout_s={REQUEST_TIMEOUT_S}", f"remote_rm.retry.max_wait_s={MAX_WAIT_S}",
            "trainer.save_interval=1", "trainer.progress_bar=false", "grpo.num_prompts_per_step=4",
            "grpo.num_rollouts_per_prompt=2", "grpo.truncated=keep", "model.micro_batch_size=2", "model.global_batch_size=8", "model.forward_micro_batch_size=2",
            "model.length_params.max_length=5", "model.dtype=float32", "model.optim.name=sgd", "model.optim.lr=0.05",
            "model.optim.sched.name=constant", "remote_rm.url=http://127.0.0.1:5555",
            f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false"]


def fixed_logprobs(actor) -> list:
    tokens = torch.tensor([[5, 17, 33, 8, 90, 41, 7], [9, 60, 2, 44, 31, 18, 77]])
    rollout = Rollout(tokens, torch.tensor([3, 3]), torch.tensor([7, 7]), torch.ones(2, dtype=torch.bool))
    return actor.logprobs(rollout).tolist()


class EngineGoneOnReplica1:
    """``actor.generate_chunks``, except that on data-parallel replica 1 (every rank of it: ``VLLMRollout`` relays its
    source's verdict over the replica) the step-2 rollouts raise what an engine past its restarts raises."""

    def __init__(self, actor) -> None:
        self.actor, self.generate_chunks, self.calls = actor, actor.generate_chunks, 0

    def __call__(self, prompt_ids, sampling):
        self.calls += 1
        if self.actor.data_parallel_rank == 1 and self.calls == FAULT_CALL:
            raise EngineUnavailable("the vLLM engine died 3 times (rollout.vllm.restarts=2): injected on data-parallel "
                                    "replica 1")
        yield from self.generate_chunks(prompt_ids, sampling)


def run(actor, args, name: str, run_dir: Path, max_steps: int, fault: str | None) -> dict:
    if fault == "engine":
        actor.generate_chunks = EngineGoneOnReplica1(actor)
    try:
        return _run(actor, args, name, run_dir, max_steps, None if fault == "engine" else fault)
    finally:
        actor.__dict__.pop("generate_chunks", None)


def _run(actor, args, name: str, run_dir: Path, max_steps: int, fault: str | None) -> dict:
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
    ap.add_argument("--group-timeout", type=float, default=15.0,
                    help="trainer.distributed_timeout_s, scaled down from production's 7200 s (the window is 5 s)")
    ap.add_argument("--probe-timeout", action="store_true", help="end with timeout_probe (costs the group timeout)")
    args = ap.parse_args()
    out = Path(args.out)
    cfg = load_train_config(GRPOConfig, None, overrides(args, out / "init", 3))
    if args.nemo:
        from nemo_factuality.trainers.backends.aligner.actor import build_actor

        actor = build_actor(cfg, max_steps=10, rollout_micro_batch_size=4,
                            model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    else:
        actor, _ = BACKENDS.get("hf")(cfg)
    initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in actor.model.state_dict().items()}
    runs = {}
    for name, fault in (("undisturbed", None), ("outage", "outage"), ("preempt", "preempt"), ("engine", "engine")):
        actor.model.load_state_dict(initial)
        seed_everything(args.seed)
        runs[name] = run(actor, args, name, out / name, 3, fault)
        if fault is not None:  # the requeued job: the same command, the same run directory
            runs[f"{name}_resumed"] = run(actor, args, name, out / name, 3, None)
    rank = torch.distributed.get_rank()
    report = {"rank": rank, "dp_rank": actor.data_parallel_rank, "runs": runs, "group_timeout_s": args.group_timeout,
              "max_wait_s": MAX_WAIT_S}
    if args.probe_timeout:
        report["timeout_probe"] = timeout_probe(rank, out, args.group_timeout)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


def timeout_probe(rank: int, out: Path, group_timeout: float) -> dict:
    """Whether the default group really times out after ``group_timeout`` (not torch's 30-minute gloo default):
    rank 0 enters an all-reduce the other ranks never join and must give up at the timeout, while they stay alive
    (a peer that exits fails the all-reduce at once) until rank 0 says it is done. The group is unusable
    afterwards, so this runs last."""
    done = out / "timeout_probe.done"
    if rank == 0:
        done.unlink(missing_ok=True)
    torch.distributed.barrier()
    t0 = time.monotonic()
    error = None
    if rank == 0:
        try:
            torch.distributed.all_reduce(torch.ones(1))
        except RuntimeError as err:
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        done.write_text("done")
    else:
        while not done.exists() and time.monotonic() - t0 < 3 * group_timeout:
            time.sleep(0.1)
    return {"waited_s": time.monotonic() - t0, "error": error}


if __name__ == "__main__":
    raise SystemExit(main())
