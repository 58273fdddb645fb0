"""Time per GRPO phase on CPU with the tiny policy: the reward in-process vs through the PyTriton server.

    python benchmarks/train_bench.py [--steps 10] [--prompts 4] [--rollouts 8] [--max-length 32]

Both runs use the same policy, prompts and reward (the FactAlign labeller on the packaged demo knowledge
store, offline), so the difference in `reward` time is the serving overhead; generate / logprobs / train
are the backend's cost. The first step of each run is warm-up and left out of the means.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("generate", "reward", "logprobs", "train", "step")


def run(policy: Path, reward, args, run_dir: Path, remote_url: str | None = None) -> list[dict]:
    from nemo_factuality.trainers.backends.hf.actor import HFActor
    from nemo_factuality.trainers.config import GRPOConfig
    from nemo_factuality.trainers.data import load_prompts
    from nemo_factuality.trainers.grpo import GRPOTrainer

    cfg = GRPOConfig()
    cfg.model.path = str(policy)
    cfg.model.length_params.max_length = args.max_length
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_rollouts_per_prompt = args.prompts, args.rollouts
    cfg.grpo.truncated = "keep"
    cfg.model.global_batch_size = cfg.model.micro_batch_size = cfg.model.forward_micro_batch_size = args.prompts * args.rollouts
    cfg.trainer.max_steps, cfg.trainer.progress_bar, cfg.trainer.save_interval = args.steps, False, 0
    cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(run_dir), False
    torch.manual_seed(0)
    actor = HFActor(cfg.model, max_steps=args.steps)
    data = load_prompts("package:demo_prompts.jsonl", "jsonl")
    return GRPOTrainer(cfg, actor, reward, data, run_dir=run_dir).fit()


def summarise(name: str, history: list[dict]) -> dict[str, float]:
    rows = history[1:] or history
    return {p: statistics.mean(h[f"time/{p}"] for h in rows) for p in PHASES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--max-length", type=int, default=32)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from nemo_factuality.knowledge.store import build_store
    from nemo_factuality.registry import REWARDS
    from nemo_factuality.serving.client import RemoteFactualityReward
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.testing.training import build_policy

    with tempfile.TemporaryDirectory(prefix="train_bench_") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("PYTRITON_HOME", str(tmp / "pytriton"))
        policy = build_policy(tmp / "policy")
        data = Path(__file__).resolve().parents[1] / "nemo_factuality" / "data"
        kb = build_store(data / "demo_passages.jsonl", tmp / "demo_kb.sqlite", facts_jsonl=data / "demo_facts.jsonl",
                         progress=False)
        spec = {"name": "factalign", "k": 10, "pipeline": {"verifier": {"name": "kb_exact", "store_path": str(kb)}}}
        results = {"in-process": summarise("in-process", run(policy, REWARDS.build(dict(spec)), args, tmp / "local"))}
        http, grpc, tmetrics, health, metrics = free_ports(5)
        cfg = ServeConfig(host="127.0.0.1", http_port=http, grpc_port=grpc, triton_metrics_port=tmetrics,
                          health_port=health, metrics_port=metrics, max_queue_delay_us=500)
        with FactualityRewardServer(cfg, REWARDS.build(dict(spec))):
            remote = RemoteFactualityReward(f"http://127.0.0.1:{http}", timeout_s=60)
            results["PyTriton server"] = summarise("server", run(policy, remote, args, tmp / "remote"))
    batch = args.prompts * args.rollouts
    print(f"GRPO step on CPU: tiny Qwen2 (2 layers, hidden 48), {args.prompts} prompts × {args.rollouts} samples = "
          f"{batch} responses of ≤ {args.max_length} tokens, torch threads {torch.get_num_threads()}; "
          f"mean over steps 2..{args.steps} (seconds)")
    print(f"{'reward':<18}" + "".join(f"{ph:>11}" for ph in PHASES))
    for name, row in results.items():
        print(f"{name:<18}" + "".join(f"{row[ph]:>11.4f}" for ph in PHASES))
    base, served = results["in-process"]["reward"], results["PyTriton server"]["reward"]
    print(f"serving overhead per step: {served - base:+.4f} s ({served / max(base, 1e-9):.1f}× the in-process reward time); "
          f"{batch / results['in-process']['step']:.1f} vs {batch / results['PyTriton server']['step']:.1f} responses/s per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
