"""Rollout throughput: the vLLM engine against the native engine (the hf actor's ``generate``) on the same policy,
at rollout batches from 16 up, and the seconds a refit costs — all in one run, so the two are compared on one
machine under one load.

For each batch size: generated tokens per second of each engine (greedy, ``--new-tokens`` per prompt, prompts of
``--prompt-tokens``), and for vLLM the refit after one optimiser step, both ways (``rollout.vllm.refit``) on the same
engine and weights: ``file`` (export, write one safetensors file, the engine reloads it) and ``broadcast`` (the
tensors streamed into the engine's workers over the refit group, gloo on CPU / NCCL on GPUs, reload included); each
the median of ``--refit-repeats``. Batches double from 16 until one fails or ``--max-batch`` is reached: on a GPU,
the largest that fits.

    python benchmarks/rollout_bench.py --vllm-python ~/.cache/nemo_factuality/vllm-venv-*/bin/python
    python benchmarks/rollout_bench.py --model /models/Qwen2.5-0.5B --device cuda --dtype bfloat16 --max-batch 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nemo_factuality.algorithms import response_mask
from nemo_factuality.trainers.backends.hf import HFActor
from nemo_factuality.trainers.config import GRPOConfig, VLLMEngineConfig, load_train_config
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout
from nemo_factuality.trainers.interfaces import SamplingParams

log = logging.getLogger("rollout_bench")


def _tokens_per_s(generate, prompts, sampling) -> tuple[float, float]:
    start = time.perf_counter()
    rollout = generate(prompts, sampling)
    seconds = time.perf_counter() - start
    new = int((rollout.response_lengths - rollout.prompt_lengths).sum())
    return new / seconds, seconds


def _one_step(actor) -> None:
    """One SGD step on a fixed sequence: the weights a refit must then push."""
    tokens = torch.randint(5, 300, (2, 12))
    lengths = torch.tensor([12, 12])
    mask = response_mask(torch.tensor([4, 4]), lengths, 11)
    batch = {"tokens": tokens, "prompt_lengths": torch.tensor([4, 4]), "response_lengths": lengths, "mask": mask}
    actor.train_step(batch, lambda out, mb: (-(out["logprobs"] * mb["mask"]).sum() / mask.sum(), {}), micro_batch_size=2)


def _refit_seconds(rollout, engine, mode: str, repeats: int) -> float:
    """Median seconds of a whole refit by ``mode`` (trainer export to the engine holding the new weights)."""
    engine.cfg = dataclasses.replace(engine.cfg, refit=mode)
    rollout.refit_mode = mode
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout.refit()
        rollout._reload()  # file: the engine loads the written file (broadcast: already loaded; a no-op)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an HF folder (default: a tiny Qwen2 built here)")
    ap.add_argument("--head-dim", type=int, default=32,
                    help="the built Qwen2's head width (hidden = 4 × it, 2 layers): larger for a refit that moves more")
    ap.add_argument("--vllm-python", required=True, help="the interpreter with vLLM (rollout.vllm.python)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--refit-repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    model = args.model
    if model is None:
        from nemo_factuality.testing.training import build_policy

        model = str(build_policy(work / "policy", head_dim=args.head_dim))
    cfg = load_train_config(GRPOConfig, None, [f"model.path={model}", f"model.dtype={args.dtype}", "remote_rm.url=http://x:1",
                                               "model.optim.name=sgd", "model.optim.lr=0.1", "model.rollout_micro_batch_size=100000"])
    actor = HFActor(cfg.model, max_steps=10, device=args.device)
    engine = VLLMEngine(model, VLLMEngineConfig(python=args.vllm_python), dtype=args.dtype, log_dir=work / "engine").start()
    rollout = VLLMRollout(actor, engine, weights_dir=work / "weights", chunk_size=100000)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, use_greedy=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        rollout.generate([[5] * args.prompt_tokens] * 4, sampling)  # warm-up: the engine's first batch compiles
        batch = 16
        while batch <= args.max_batch:
            prompts = torch.randint(5, 300, (batch, args.prompt_tokens), generator=gen).tolist()
            try:
                native, native_s = _tokens_per_s(actor.generate, prompts, sampling)
                vllm, vllm_s = _tokens_per_s(rollout.generate, prompts, sampling)
            except (RuntimeError, MemoryError) as err:  # past the largest batch that fits
                log.info("batch %d does not fit: %s", batch, err)
                break
            _one_step(rollout)
            refit = {mode: _refit_seconds(rollout, engine, mode, args.refit_repeats) for mode in ("file", "broadcast")}
            rows.append({"batch": batch, "native_tok_s": native, "vllm_tok_s": vllm, "speedup": vllm / native,
                         "native_s": native_s, "vllm_s": vllm_s, "refit_file_s": refit["file"],
                         "refit_broadcast_s": refit["broadcast"]})
            log.info("batch %d: native %.0f tok/s, vLLM %.0f tok/s (×%.1f), refit file %.3f s, broadcast %.3f s", batch,
                     native, vllm, vllm / native, refit["file"], refit["broadcast"])
            batch *= 2
    finally:
        engine.close()
    print(f"{'batch':>6} {'native tok/s':>13} {'vLLM tok/s':>11} {'speedup':>8} {'refit file s':>13} "
          f"{'refit broadcast s':>18}")
    for r in rows:
        print(f"{r['batch']:>6} {r['native_tok_s']:>13.0f} {r['vllm_tok_s']:>11.0f} {r['speedup']:>7.1f}x "
              f"{r['refit_file_s']:>13.3f} {r['refit_broadcast_s']:>18.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "model": model, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
