"""The GPU smoke kit's megatron phase (``bash tools/gpu_smoke.sh --backend megatron``): the megatron backend's actor
(``MegatronActor``: Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1, local layer spec) built straight from the kit's HF
folder, measured the way the aligner phase measures NeMo-Aligner's: its static engine against its dynamic engine
(``compare_engines``: greedy at two batches, tokens/s, wall and GPU ms per decode step, token equality; the dynamic
engine with CUDA graphs of its decode steps on a GPU and plain-torch paged attention where flash-attn is missing), then
on the faster one generation tokens/s at rollout batch 16 and at the largest batch that fits, ``--steps`` GRPO steps of
the real stage with the step-time split, and peak GPU memory.

* Transformer Engine: a bare GPU machine has none, and Bridge 0.3.1 imports ``transformer_engine.pytorch``
  unconditionally. ``nemo_factuality.testing.megatron_cpu.apply()`` imports Bridge with a throw-away TE stand-in that is
  visible only while Bridge imports (on CUDA it does nothing else); production code never imports it and, without TE,
  stops with ``backends.megatron.build._BRIDGE_HINT``. Megatron-Core then reports no TE, so the backend builds its
  local spec.
* dtype: float32 on CPU (the backend's CI setting); ``model.dtype=bfloat16`` on a GPU (bf16 mixed precision with fp32
  main weights, the presets' setting), as the TRL peer runs.
* Largest batch: no memory formula covers this backend's rollouts yet (fp32 or bf16 weights, Megatron's static engine
  and its logits), so the kit tries ``--max-batch-cap`` and halves on an out-of-memory error.
* Memory: the resident training states of the fp32 layout (weights 4·P, DDP's fp32 gradient buffer 4·P, torch Adam's
  two fp32 moments 8·P, the ``model.reference: copy`` weights 4·P: 20·P bytes) are reported as a lower bound beside
  the measured peak; activations, logits and the KV cache have no term yet, so it is not a prediction.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

# the training states per parameter of the float32 layout this backend runs (module docstring); None: not derived
STATE_BYTES_PER_PARAMETER = {"float32": 4 + 4 + 8 + 4}


def _config(args, hf: Path, run_dir: Path, s: dict, dtype: str):
    from nemo_factuality.trainers.config import GRPOConfig, load_train_config

    rollouts = s["prompts_per_step"] * s["group"]
    overrides = [f"model.path={hf}", "trainer.backend=megatron", f"trainer.device={'cpu' if args.cpu else 'cuda'}",
                 f"model.dtype={dtype}", f"trainer.max_steps={args.steps}", "trainer.save_interval=0",
                 "trainer.progress_bar=false", f"model.micro_batch_size={s['micro_batch']}",
                 f"model.global_batch_size={rollouts}", f"model.forward_micro_batch_size={s['micro_batch']}",
                 "model.rollout_micro_batch_size=16", f"model.length_params.max_length={s['new_tokens']}",
                 f"model.optim.lr={s['lr']}", "model.optim.sched.name=constant",
                 f"grpo.num_prompts_per_step={s['prompts_per_step']}", f"grpo.num_rollouts_per_prompt={s['group']}",
                 "grpo.truncated=keep", "data.apply_chat_template=false", f"exp_manager.explicit_log_dir={run_dir}",
                 "exp_manager.create_tensorboard_logger=false",
                 "remote_rm.url=http://127.0.0.1:1",  # schema: a reward must be named; the stage gets the toy one
                 # built for the dynamic engine (its CUDA graph managers on a GPU); the static engine is measured too
                 "model.megatron.inference_engine=dynamic", f"model.megatron.attention_kernels={_kernels()}",
                 f"model.megatron.inference_buffer_gb={0.05 if args.cpu else 16}",
                 f"model.megatron.inference_cuda_graphs={0 if args.cpu else 16}"]
    return load_train_config(GRPOConfig, None, overrides)


def _kernels() -> str:
    """flash_attn where an importable flash-attn is new enough for Megatron's paged kernels, else the torch ones."""
    import importlib.util

    return "flash_attn" if importlib.util.find_spec("flash_attn") else "torch"


def config_with_dtype(args, hf: Path, run_dir: Path, s: dict):
    """(config, dtype): float32 on CPU, bf16 mixed precision on a GPU."""
    dtype = "float32" if args.cpu else "bfloat16"
    return _config(args, hf, run_dir, s, dtype), dtype


def largest_generation(actor, ids, cap: int, new_tokens: int, measure) -> tuple[dict | None, list[int]]:
    """Generation at ``cap`` sequences, halved on each out-of-memory error down to 16: (the run, the batches that did
    not fit)."""
    import gc

    import torch

    tried, batch = [], cap
    while batch >= 16:
        try:
            return measure(actor, ids, batch, new_tokens), tried
        except torch.OutOfMemoryError:  # say so, and halve
            tried.append(batch)
        # outside the except block: its traceback's frames (the failed batch's tensors) are released only now
        gc.collect()
        torch.cuda.empty_cache()
        batch //= 2
    return None, tried


def _greedy(actor, rows: list[list[int]], new_tokens: int) -> dict:
    """``timed_greedy`` with the engine taking all of ``rows`` at once."""
    from gpu_smoke_common import timed_greedy

    actor.cfg.rollout_micro_batch_size = len(rows)
    return timed_greedy(actor, rows, new_tokens)


def _gpu_busy_ms(fn) -> float | None:
    """Milliseconds the GPU spent in kernels while ``fn()`` ran (torch.profiler's device time): against the wall time,
    how host-bound a run is. None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000.0


def compare_engines(actor, ids: list[list[int]], batches: tuple[int, ...], new_tokens: int) -> dict:
    """Megatron's static engine against its dynamic engine (paged KV, continuous batching; on a GPU its decode steps as
    CUDA graphs) on the same prompts, greedy: per engine and batch the tokens/s, wall ms per decode step (the batch's
    wall time over its ``new_tokens`` steps) and GPU ms per decode step (kernel time, a second profiled pass), each
    after a warm-up call (the dynamic engine is built and its graphs captured by its first); per batch the fraction of
    sequences whose greedy tokens are equal on both."""
    out: dict = {"static": {}, "dynamic": {}, "greedy_equal": {}}
    for batch in batches:
        rows = [ids[i % len(ids)] for i in range(batch)]
        tokens = {}
        for engine in ("static", "dynamic"):
            actor.cfg.megatron.inference_engine = engine
            _greedy(actor, rows, new_tokens)  # warm-up
            run = _greedy(actor, rows, new_tokens)
            tokens[engine], seconds = run["tokens"], run["seconds"]
            gpu_ms = _gpu_busy_ms(lambda rows=rows: _greedy(actor, rows, new_tokens))
            out[engine][str(batch)] = {"tokens_per_s": run["count"] / seconds,
                                       "wall_ms_per_step": 1000 * seconds / new_tokens,
                                       "gpu_ms_per_step": None if gpu_ms is None else gpu_ms / new_tokens}
        same = sum(a == b for a, b in zip(tokens["static"], tokens["dynamic"], strict=True))
        out["greedy_equal"][str(batch)] = same / batch
    first = str(batches[0])
    out["faster"] = max(("static", "dynamic"), key=lambda e: out[e][first]["tokens_per_s"])
    return out


def run_megatron(args, hf: Path, run_dir: Path) -> dict:
    from nemo_factuality.testing import megatron_cpu

    megatron_cpu.apply()  # before anything imports megatron: Bridge without TE (and the CPU stand-ins without CUDA)
    import torch
    from gpu_smoke_common import MODELS, fit_toy_grpo, measure_generation, peak_gib, prompts, shape, step_split

    from nemo_factuality.trainers.backends.aligner.memory import GIB, Arch
    from nemo_factuality.trainers.backends.megatron import build as megatron_build
    from nemo_factuality.trainers.backends.megatron.actor import build_megatron

    s = shape(args)
    cfg, dtype = config_with_dtype(args, hf, run_dir, s)
    t0 = time.perf_counter()
    actor, _ = build_megatron(cfg, max_steps=args.steps)
    setup_s = time.perf_counter() - t0
    a = MODELS[s["model"]]
    arch = Arch(hidden=a["hidden_size"], layers=a["num_hidden_layers"], heads=a["num_attention_heads"],
                kv_heads=a["num_key_value_heads"], ffn=a["intermediate_size"], vocab=a["vocab_size"],
                tied=a["tie_word_embeddings"])
    parameters = sum(p.numel() for p in actor.model.parameters())  # this rank's model: the whole one at TP=PP=1

    def set_batch(n: int) -> None:
        actor.cfg.rollout_micro_batch_size = n

    def measure(actor_, ids_, batch, new_tokens):
        return measure_generation(actor_, ids_, batch, new_tokens, set_batch=set_batch)

    texts = prompts(64, s["prompt_tokens"], arch.vocab)
    ids = [actor.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    engines = compare_engines(actor, ids, (4, 16) if args.cpu else (16, 256), s["new_tokens"])
    actor.cfg.megatron.inference_engine = engines["faster"]  # the sampled rollouts and the GRPO steps run on it
    measure(actor, ids, 16, s["new_tokens"])  # warm-up: first-call allocations, kernel selection
    gen16 = measure(actor, ids, 16, s["new_tokens"])
    gen_max, tried = largest_generation(actor, ids, args.max_batch_cap, s["new_tokens"], measure)
    set_batch(16)

    history = fit_toy_grpo(cfg, actor, texts[: 4 * s["prompts_per_step"]], run_dir)
    per_parameter = STATE_BYTES_PER_PARAMETER.get(dtype)
    return {
        "backend": "megatron", "dtype": dtype, "setup_s": setup_s, "engines": engines,
        "attention_kernels": actor.cfg.megatron.attention_kernels, "cuda_graphs": actor.settings.cuda_graphs,
        "dynamic_engine_builds": actor._dynamic.builds if actor._dynamic else 0,
        "transformer_engine": megatron_build.transformer_engine_available(), "device": str(actor._device()),
        # the stand-in must be gone once Bridge has imported: nothing later may take it for Transformer Engine
        "te_stand_in_left": any(name.split(".")[0] == "transformer_engine" for name in sys.modules),
        "generation_16": gen16, "generation_max": gen_max, "oom_batches": tried, "formula_max_batch": None,
        "step_split_s": step_split(history), "steps": len(history),
        "rewards": [h.get("reward/score") for h in history], "tokens_per_step": s["prompts_per_step"] * s["group"]
        * s["new_tokens"], "peak_gib": {"train": peak_gib(), "rollout_16": gen16["peak_gib"]},
        "states_lower_bound_gib": per_parameter * parameters / GIB if per_parameter else None,
        "parameters_b": parameters / 1e9, "formula_parameters_b": arch.parameters() / 1e9,
        "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None,
    }


def report_rows(a: dict, t: dict, on_gpu: bool = True) -> list[str]:
    """The megatron column's table rows (the TRL peer's beside them), in ``gpu_smoke.report``'s layout; ``on_gpu``
    False (the CPU path): no memory figures, said so."""
    from gpu_smoke_common import gib_cell, oom_text

    g16, gmax, split = a["generation_16"], a["generation_max"], a["step_split_s"]
    trl_gen = f"{t['generation']['tokens_per_s']:.0f}" if t else "not run"
    rows = []
    for batch, equal in a["engines"]["greedy_equal"].items():
        cells = []
        for engine in ("static", "dynamic"):
            m = a["engines"][engine][batch]
            gpu = "—" if m["gpu_ms_per_step"] is None else f"{m['gpu_ms_per_step']:.1f}"
            cells.append(f"{engine} {m['tokens_per_s']:.0f} tok/s, {m['wall_ms_per_step']:.1f} ms/step (GPU {gpu})")
        rows.append(f"| greedy, batch {batch}: {'; '.join(cells)}; equal tokens {equal:.0%} | — | — |")
    rows.append(f"| generation tokens/s, rollout batch 16 ({a['engines']['faster']} engine, sampled) | "
                f"{g16['tokens_per_s']:.0f} | {trl_gen} |")
    if gmax:
        rows.append(f"| generation tokens/s, rollout batch {gmax['batch']} (largest tried that fit; "
                    f"{oom_text(a['oom_batches'], on_gpu)}) | {gmax['tokens_per_s']:.0f} | — |")
    else:
        rows.append(f"| generation at the largest batch | {oom_text(a['oom_batches'], on_gpu)} | — |")
    step = (f"{split.get('step', float('nan')):.2f} ({split.get('generate', 0):.2f} / {split.get('reward', 0):.2f} / "
            f"{split.get('logprobs', 0):.2f} / {split.get('train', 0):.2f})")
    rows.append(f"| GRPO step, s: total (generate / reward / log-probs / train) | {step} | "
                f"{t['step_s']:.2f} |" if t else f"| GRPO step, s: total (generate / reward / log-probs / train) | "
                f"{step} | not run |")
    bound = a["states_lower_bound_gib"]
    bound_text = f"≥ {bound:.1f} (states only, no activation term)" if bound is not None else "no formula for this dtype"
    trl_peak = gib_cell(t["peak_gib"], on_gpu) if t else "not run"
    rows += [f"| peak GPU memory, GiB, training (lower bound: {bound_text}) | {gib_cell(a['peak_gib']['train'], on_gpu)} "
             f"| {trl_peak} |",
             f"| peak GPU memory, GiB, rollout batch 16 (no formula yet) | "
             f"{gib_cell(a['peak_gib']['rollout_16'], on_gpu)} | — |"]
    return rows
