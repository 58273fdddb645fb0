"""The megatron backend's two engines for ``rollout_bench.py``, run by the megatron venv's Python (Megatron-Core 0.16.1
and Megatron-Bridge live there, not in the bench's venv): Megatron-Core's static engine and its dynamic engine (paged KV
cache, continuous batching; plain-torch paged attention where flash-attn is missing, CUDA graphs of its decode steps
on a GPU) on the bench's policy and prompts, greedy, each batch the median of ``--repeats`` runs after a warm-up at
that batch (the dynamic engine is built, and on a GPU its graphs captured, by its first call at a new batch).

    <megatron venv>/bin/python benchmarks/megatron_rollout_child.py --model DIR --prompts FILE --out FILE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _config(args: argparse.Namespace, prompt_tokens: int):
    import importlib.util

    from nemo_factuality.trainers.config import GRPOConfig, load_train_config

    kernels = "flash_attn" if importlib.util.find_spec("flash_attn") else "torch"
    return load_train_config(GRPOConfig, None, [
        f"model.path={args.model}", "trainer.backend=megatron", f"trainer.device={args.device}", f"model.dtype={args.dtype}",
        "remote_rm.url=http://127.0.0.1:1", "model.megatron.inference_engine=dynamic",
        f"model.megatron.attention_kernels={kernels}", f"model.megatron.inference_buffer_gb={args.buffer_gb}",
        f"data.max_prompt_tokens={prompt_tokens}", f"model.length_params.max_length={args.new_tokens}"])


def _measure(actor, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict | None:
    """``rollout_bench._measure`` of the actor's greedy generation at ``len(prompts)`` rows after a warm-up call at that
    batch; None when the batch does not fit."""
    from rollout_bench import _measure as median_of_runs  # this script's folder is on the path

    from nemo_factuality.trainers.interfaces import SamplingParams

    greedy = SamplingParams(max_new_tokens=new_tokens, use_greedy=True)
    actor.cfg.rollout_micro_batch_size = len(prompts)
    actor.generate(prompts, greedy)  # warm-up at this batch
    return median_of_runs(actor.generate, [(len(prompts), prompts)], greedy, new_tokens, repeats).get(len(prompts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON: {batch: [[token ids], ...]}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buffer-gb", type=float, default=0.25, help="the dynamic engine's KV buffer (GiB per GPU)")
    args = ap.parse_args()
    if args.device == "cpu":
        from nemo_factuality.testing import megatron_cpu

        megatron_cpu.apply()  # Megatron-Core's CUDA calls on the host, before anything imports megatron
    from nemo_factuality.trainers.backends.megatron.actor import build_megatron

    batches = {int(b): p for b, p in json.loads(Path(args.prompts).read_text()).items()}
    prompt_tokens = max(len(p) for rows in batches.values() for p in rows)
    actor, _ = build_megatron(_config(args, prompt_tokens), max_steps=10)
    out: dict = {"static": {}, "dynamic": {}, "attention_kernels": actor.cfg.megatron.attention_kernels,
                 "cuda_graphs": actor.settings.cuda_graphs}
    for engine in ("static", "dynamic"):
        actor.cfg.megatron.inference_engine = engine
        for batch, prompts in sorted(batches.items()):
            try:
                result = _measure(actor, prompts, args.new_tokens, args.repeats)
            except (RuntimeError, MemoryError) as err:  # the warm-up past the largest batch that fits
                result, reason = None, str(err).splitlines()[0]
            else:
                reason = "did not fit (the log says why)"
            if result is None:
                out[engine][f"{batch}_error"] = reason
                break
            out[engine][batch] = result
    Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
