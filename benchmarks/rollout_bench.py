"""Rollout throughput: the vLLM engine against the native engine (the hf actor's ``generate``) on the same policy,
at rollout batches from 16 up, and the seconds a refit costs — each engine measured alone on the machine at its best
thread setting, whatever the caller's environment.

Fairness (issue 42): the native engine is measured first, with no engine process beside it, at every torch thread
count of ``--native-threads`` (default 1 and every core), its best per batch reported; then the vLLM engine starts
with ``OMP_NUM_THREADS`` set by this script, not inherited (CI sets 1), while the trainer process waits on it. An earlier version measured
native beside the idle engine at torch's default threads: 836–917 tok/s against 5,050–7,660 alone with one thread,
which made vLLM look 4.6× faster. vLLM is measured at every ``OMP_NUM_THREADS`` of ``--engine-threads`` (default 1
and every core), a fresh engine each, its best per batch reported. For each batch: generated tokens per second, and ms per decode step (the batch's
wall time over its new tokens: what one generated token of every sequence costs, the host-bound measure), greedy, the
same prompts; whether the two engines' greedy tokens agree (the fraction of sequences equal token for token); and for
vLLM the refit after one optimiser step both ways (``rollout.vllm.refit``), the median of ``--refit-repeats``.
Batches double from 16 until one fails or ``--max-batch`` is reached. On CPU this says nothing about a GPU.

More engines, each alone on the machine at its best thread count like the native one, greedy on the same prompts, in a
second table (tokens/s, ms per decode step, × native, the fraction of sequences token-for-token equal to native's):
``--hf-compiled``, the hf backend's ``model.hf_generation=compiled`` (static KV cache + torch.compile; each batch's
first call compiles, untimed); ``--megatron-python``, Megatron-Core's static and dynamic engines in the megatron venv
(``megatron_rollout_child.py``; the dynamic one with plain-torch paged attention where flash-attn is missing).

    python benchmarks/rollout_bench.py --vllm-python ~/.cache/nemo_factuality/vllm-venv-*/bin/python
    python benchmarks/rollout_bench.py --hf-compiled --megatron-python ~/.cache/nemo_factuality/megatron-venv-*/bin/python
    python benchmarks/rollout_bench.py --model /models/Qwen2.5-0.5B --device cuda --dtype bfloat16 --max-batch 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from nemo_factuality.algorithms import response_mask
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import GRPOConfig, VLLMEngineConfig, load_train_config
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout
from nemo_factuality.trainers.interfaces import SamplingParams

log = logging.getLogger("rollout_bench")


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


def _batches(max_batch: int, prompt_tokens: int) -> list[tuple[int, list[list[int]]]]:
    gen = torch.Generator().manual_seed(0)
    out, batch = [], 16
    while batch <= max_batch:
        out.append((batch, torch.randint(5, 300, (batch, prompt_tokens), generator=gen).tolist()))
        batch *= 2
    return out


def _measure(generate, batches, sampling, new_tokens: int, repeats: int = 3) -> dict[int, dict]:
    """``{batch: {tok_s, ms_per_step, tokens}}`` for each batch that fits (stops at the first that does not), each
    the median of ``repeats`` runs (one run on the shared 2 cores varied by up to 40 %)."""
    out = {}
    for batch, prompts in batches:
        try:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                rollout = generate(prompts, sampling)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
        except (RuntimeError, MemoryError) as err:  # past the largest batch that fits
            log.info("batch %d does not fit: %s", batch, err)
            break
        new = int((rollout.response_lengths - rollout.prompt_lengths).sum())
        tokens = [rollout.response_ids(i) for i in range(batch)]
        out[batch] = {"tok_s": new / seconds, "ms_per_step": 1000 * seconds / new_tokens, "tokens": tokens}
    return out


def _keep_best(best: dict[int, dict], batch: int, result: dict, threads: int) -> None:
    """``best[batch]``: the faster of what it holds and ``result`` (measured at ``threads``)."""
    if batch not in best or result["tok_s"] > best[batch]["tok_s"]:
        best[batch] = {**result, "threads": threads}


def _native_alone(actor, batches, sampling, args) -> dict[int, dict]:
    """The native engine at each thread count, no other engine running; per batch its best thread count's result."""
    best: dict[int, dict] = {}
    for threads in args.native_threads:
        torch.set_num_threads(threads)
        actor.generate([[5] * args.prompt_tokens] * 4, sampling)  # warm-up at this thread count
        for batch, result in _measure(actor.generate, batches, sampling, args.new_tokens, args.repeats).items():
            log.info("native, %d threads, batch %d: %.0f tok/s, %.1f ms/step", threads, batch, result["tok_s"],
                     result["ms_per_step"])
            _keep_best(best, batch, result, threads)
    return best


def _hf_compiled_alone(cfg, batches, sampling, args) -> dict[int, dict]:
    """The hf backend with ``model.hf_generation=compiled`` (static KV cache + torch.compile), alone like the native
    engine, at each torch thread count: per batch its best. Each batch's first call compiles (a warm-up, not timed)."""
    import copy

    compiled_cfg = copy.deepcopy(cfg.model)
    compiled_cfg.hf_generation = "compiled"
    best: dict[int, dict] = {}
    for threads in args.native_threads:
        torch.set_num_threads(threads)
        actor = HFActor(compiled_cfg, max_steps=10, device=args.device)
        for batch, prompts in batches:
            actor.cfg.rollout_micro_batch_size = batch
            actor.generate(prompts, sampling)  # the compile at this shape
            result = _measure(actor.generate, [(batch, prompts)], sampling, args.new_tokens, args.repeats).get(batch)
            if result is None:
                break
            log.info("hf compiled, %d threads, batch %d: %.0f tok/s, %.1f ms/step", threads, batch, result["tok_s"],
                     result["ms_per_step"])
            _keep_best(best, batch, result, threads)
    return best


def _megatron_alone(model: str, batches, args, work: Path) -> dict[str, dict[int, dict]]:
    """Megatron-Core's static and dynamic engines (``megatron_rollout_child.py`` in the megatron venv; this process only
    waits), at each ``OMP_NUM_THREADS`` of ``--native-threads``: per engine and batch its best."""
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps({str(b): p for b, p in batches}))
    best: dict[str, dict[int, dict]] = {"megatron_static": {}, "megatron_dynamic": {}}
    for threads in args.native_threads:
        out = work / f"megatron_{threads}.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        subprocess.run([args.megatron_python, str(Path(__file__).with_name("megatron_rollout_child.py")),
                        f"--model={model}", f"--prompts={prompts}", f"--out={out}", f"--device={args.device}",
                        f"--dtype={args.dtype}", f"--new-tokens={args.new_tokens}", f"--repeats={args.repeats}"],
                       env=env, check=True)
        measured = json.loads(out.read_text())
        for engine in ("static", "dynamic"):
            for batch, result in measured[engine].items():
                if not batch.isdigit():
                    continue
                log.info("megatron %s, %d threads, batch %s: %.0f tok/s, %.1f ms/step", engine, threads, batch,
                         result["tok_s"], result["ms_per_step"])
                _keep_best(best[f"megatron_{engine}"], int(batch), result, threads)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an HF folder (default: a tiny Qwen2 built here)")
    ap.add_argument("--head-dim", type=int, default=32,
                    help="the built Qwen2's head width (hidden = 4 × it, 2 layers): larger for a refit that moves more")
    ap.add_argument("--vllm-python", help="the interpreter with vLLM (rollout.vllm.python); without it no vLLM column")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--refit-repeats", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="generation runs per engine, thread setting and batch (median)")
    cores = len(os.sched_getaffinity(0))
    ap.add_argument("--native-threads", type=lambda t: [int(x) for x in t.split(",")], default=sorted({1, cores}),
                    help="torch thread counts the native engine is measured at (its best is reported)")
    ap.add_argument("--engine-threads", type=lambda t: [int(x) for x in t.split(",")], default=sorted({1, cores}),
                    help="OMP_NUM_THREADS values the vLLM engine is started with, one engine each (its best is reported)")
    ap.add_argument("--megatron-python", help="the megatron venv's interpreter: also measure Megatron-Core's static and "
                                              "dynamic engines (megatron_rollout_child.py)")
    ap.add_argument("--hf-compiled", action="store_true", help="also measure the hf backend's model.hf_generation=compiled "
                                                               "(each batch's first call compiles: minutes on CPU)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    model = args.model
    if model is None:
        from nemo_factuality.testing.training import build_policy

        model = str(build_policy(work / "policy", head_dim=args.head_dim))
        # transformers 5 records its tokenizer class as TokenizersBackend, which the megatron venv's transformers 4.57
        # does not know; the generic fast tokenizer's name loads the same tokenizer.json in both
        config = Path(model) / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    cfg = load_train_config(GRPOConfig, None, [f"model.path={model}", f"model.dtype={args.dtype}", "remote_rm.url=http://x:1",
                                               "model.optim.name=sgd", "model.optim.lr=0.1", "model.rollout_micro_batch_size=100000"])
    actor = HFActor(cfg.model, max_steps=10, device=args.device)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, use_greedy=True)
    batches = _batches(args.max_batch, args.prompt_tokens)
    native = _native_alone(actor, batches, sampling, args)
    others: dict[str, dict[int, dict]] = {}
    if args.hf_compiled:
        others["hf_compiled"] = _hf_compiled_alone(cfg, batches, sampling, args)
    if args.megatron_python:
        others.update(_megatron_alone(model, batches, args, work))
    torch.set_num_threads(1)  # the trainer only waits while the engine generates
    vllm: dict[int, dict] = {}
    refit: dict[str, float] = {}
    for threads in args.engine_threads if args.vllm_python else []:  # a fresh engine per setting (read at its start)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the engine's, whatever this process was started with
        engine = VLLMEngine(model, VLLMEngineConfig(python=args.vllm_python), dtype=args.dtype,
                            log_dir=work / f"engine_{threads}").start()
        rollout = VLLMRollout(actor, engine, weights_dir=work / f"weights_{threads}", chunk_size=100000)
        try:
            rollout.generate([[5] * args.prompt_tokens] * 4, sampling)  # warm-up: the engine's first batch compiles
            measured = _measure(rollout.generate, [(b, p) for b, p in batches if b in native], sampling, args.new_tokens,
                                args.repeats)
            for batch, result in measured.items():
                log.info("vLLM, OMP_NUM_THREADS=%d, batch %d: %.0f tok/s, %.1f ms/step", threads, batch, result["tok_s"],
                         result["ms_per_step"])
                _keep_best(vllm, batch, result, threads)
            if threads == args.engine_threads[-1]:  # the refit does not depend on the batch or the threads: once
                _one_step(rollout)
                refit = {mode: _refit_seconds(rollout, engine, mode, args.refit_repeats) for mode in ("file", "broadcast")}
        finally:
            engine.close()
    rows = []
    for batch, v in vllm.items():
        n = native[batch]
        equal = sum(a == b for a, b in zip(n["tokens"], v["tokens"], strict=True)) / batch
        rows.append({"batch": batch, "native_tok_s": n["tok_s"], "native_ms_per_step": n["ms_per_step"],
                     "native_threads": n["threads"], "vllm_tok_s": v["tok_s"], "vllm_ms_per_step": v["ms_per_step"],
                     "vllm_threads": v["threads"], "vllm_over_native": v["tok_s"] / n["tok_s"], "greedy_equal": equal})
    print(f"{'batch':>6} {'native tok/s':>13} {'(threads)':>9} {'ms/step':>8} {'vLLM tok/s':>11} {'(threads)':>9} "
          f"{'ms/step':>8} {'vLLM/native':>12} {'greedy equal':>13}")
    for r in rows:
        print(f"{r['batch']:>6} {r['native_tok_s']:>13.0f} {r['native_threads']:>9} {r['native_ms_per_step']:>8.1f} "
              f"{r['vllm_tok_s']:>11.0f} {r['vllm_threads']:>9} {r['vllm_ms_per_step']:>8.1f} "
              f"{r['vllm_over_native']:>11.2f}x {r['greedy_equal']:>12.0%}")
    engines = []
    for name, results in others.items():
        for batch, r in sorted(results.items()):
            n = native[batch]
            equal = sum(a == b for a, b in zip(n["tokens"], r["tokens"], strict=True)) / batch
            engines.append({"engine": name, "batch": batch, "tok_s": r["tok_s"], "ms_per_step": r["ms_per_step"],
                            "threads": r["threads"], "over_native": r["tok_s"] / n["tok_s"], "greedy_equal": equal})
    if engines:
        print(f"{'engine':>17} {'batch':>6} {'tok/s':>8} {'(threads)':>9} {'ms/step':>8} {'/native':>8} {'greedy equal':>13}")
        for r in engines:
            print(f"{r['engine']:>17} {r['batch']:>6} {r['tok_s']:>8.0f} {r['threads']:>9} {r['ms_per_step']:>8.1f} "
                  f"{r['over_native']:>7.2f}x {r['greedy_equal']:>12.0%}")
    if refit:
        print(f"refit after one step: file {refit['file']:.3f} s, broadcast {refit['broadcast']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "model": model, "rows": rows,
                                               "engines": engines, "refit_s": refit}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
