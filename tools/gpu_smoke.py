"""GPU smoke kit: a backend's GRPO stage on one GPU (aligner or megatron), with TRL's GRPOTrainer as the peer.

    bash tools/gpu_smoke.sh [--backend megatron]        # a GPU machine with PyTorch; installs the carried wheels first
    bash tools/gpu_smoke.sh --cpu [--backend megatron]  # the same path on CPU with a tiny model (CI runs it)
    python tools/gpu_smoke.py --out DIR [--backend B] [--cpu] [--steps N] [--max-batch-cap N]   # what the script runs

One run builds a Qwen2-shaped model from a config (``qwen2-0.5b``: Qwen2.5-0.5B's shape, random weights, bf16;
``--cpu``: a 2-layer one) with a word-level tokenizer over its whole vocabulary, converts it to ``.nemo`` with
``nemo-factuality convert``, then, each in its own process:

* **aligner**: NeMo-Aligner 0.7.0's actor (the stage's ``AlignerActor``) with a preset's GPU settings (bf16 +
  ``megatron_amp_O2``, Megatron-Core's distributed optimizer, full recompute, Adam-state offload; TP=1, so no
  sequence parallelism): generation tokens/s at rollout batch 16 and at the largest batch the memory formula
  allows (halved on an out-of-memory error), then ``--steps`` GRPO steps of the real stage on a toy reward,
  with the step-time split from ``metrics.jsonl`` and peak GPU memory against ``backends.aligner.memory``'s prediction;
* **megatron** (``--backend megatron``, instead of aligner): the megatron backend's actor from the HF folder itself
  (no ``.nemo`` step), measured the same way (``tools/gpu_smoke_megatron.py`` says how it differs);
* **trl**: TRL's ``GRPOTrainer`` on the same HF weights, prompts, group size, completion length and reward;
* **async** (``--async``): the hf backend's GRPO with rollouts on a vLLM engine (``--vllm-python``) at
  ``grpo.max_staleness`` 0 and 1 (``tools/gpu_smoke_async.py``; on ``--cpu`` a scripted engine stands in for vLLM).

It prints a table and writes ``smoke.json`` and ``smoke.md`` under ``--out``. Without Transformer Engine and Apex
(a bare GPU) Megatron-Core's local layer spec and ``nemo_factuality.testing.apex_free`` stand in for them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_smoke_async import report_line as async_line  # the async phase's sentence (its run imports the stack)
from gpu_smoke_common import (  # the kit's shared pieces (this folder is on sys.path: python tools/gpu_smoke.py)
    MODELS,
    REPO,
    _pythonpath,
    build,
    fit_toy_grpo,
    gib_cell,
    measure_generation,
    oom_text,
    peak_gib,
    prompts,
    reset_peak,
    shape,
    step_split,
    timed_greedy,
    toy_reward_scores,
)

PRESET = "qwen2.5-7b"  # whose GPU settings the aligner run takes (TP=1 here)


# ------------------------------------------------------------------------------------------------ aligner
def _model_overrides(cpu: bool) -> dict:
    import yaml

    from nemo_factuality.trainers.backends.aligner.actor import PRESET_DIR

    gpu = dict(yaml.safe_load((PRESET_DIR / f"{PRESET}.yaml").read_text())["common"]["aligner"])
    gpu["sequence_parallel"] = False  # TP=1
    from nemo_factuality.testing.aligner_cpu import CPU_MODEL_OVERRIDES

    # the fused kernels NeMo switches on need Apex/TE; without them (CPU, a bare GPU) they stay off
    fusions = {k: v for k, v in CPU_MODEL_OVERRIDES.items() if k not in ("precision", "megatron_amp_O2", "sequence_parallel")}
    if not cpu:
        fusions["use_cpu_initialization"] = False
    import importlib.util

    # the presets build TE's spec (the container has TE); a bare GPU cannot carry it: Megatron's local spec there
    te = importlib.util.find_spec("transformer_engine") is not None
    return {**fusions, **gpu, "transformer_engine": gpu.get("transformer_engine", False) and te}


def run_aligner(args, nemo: Path, run_dir: Path) -> dict:
    import torch

    from nemo_factuality.testing import aligner_cpu, apex_free

    stubs = apex_free.stub_absent_modules()  # NeMo's import-time extras this machine lacks (none in CI's venv)
    if args.cpu:
        aligner_cpu.apply()
    else:
        apex_free.apply()
    from nemo_factuality.trainers.backends.aligner.actor import build_actor
    from nemo_factuality.trainers.backends.aligner.memory import (
        GIB,
        Arch,
        Layout,
        max_rollout_batch,
        rollout_bytes,
        training_bytes,
    )
    from nemo_factuality.trainers.config import GRPOConfig, load_train_config

    s = shape(args)
    rollouts = s["prompts_per_step"] * s["group"]
    overrides = [f"model.restore_from_path={nemo}", "trainer.backend=aligner", f"trainer.max_steps={args.steps}",
                 "trainer.save_interval=0", "trainer.progress_bar=false", "model.dtype=bfloat16",
                 f"model.micro_batch_size={s['micro_batch']}", f"model.global_batch_size={rollouts}",
                 f"model.forward_micro_batch_size={s['micro_batch']}", f"model.length_params.max_length={s['new_tokens']}",
                 f"model.optim.lr={s['lr']}", "model.optim.sched.name=constant",
                 f"grpo.num_prompts_per_step={s['prompts_per_step']}", f"grpo.num_rollouts_per_prompt={s['group']}",
                 "grpo.truncated=keep", "data.apply_chat_template=false", f"exp_manager.explicit_log_dir={run_dir}",
                 "exp_manager.create_tensorboard_logger=false",
                 "remote_rm.url=http://127.0.0.1:1"]  # schema: a reward must be named; the stage gets the toy one below
    cfg = load_train_config(GRPOConfig, None, overrides)
    t0 = time.perf_counter()
    actor = build_actor(cfg, max_steps=args.steps, rollout_micro_batch_size=16, model_overrides=_model_overrides(args.cpu))
    setup_s = time.perf_counter() - t0
    arch_cfg = MODELS[s["model"]]
    arch = Arch(hidden=arch_cfg["hidden_size"], layers=arch_cfg["num_hidden_layers"], heads=arch_cfg["num_attention_heads"],
                kv_heads=arch_cfg["num_key_value_heads"], ffn=arch_cfg["intermediate_size"], vocab=arch_cfg["vocab_size"],
                tied=arch_cfg["tie_word_embeddings"])
    seq = s["prompt_tokens"] + s["new_tokens"]
    layout = Layout(tp=1, pp=1, dp=1, micro_batch=s["micro_batch"], seq_len=seq, rollout_micro_batch=16,
                    prompt_len=s["prompt_tokens"], sequence_parallel=False, overhead_gib=0.0 if args.cpu else 4.0)
    texts = prompts(64, s["prompt_tokens"], arch.vocab)
    ids = [actor.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    measure_generation(actor, ids, 16, s["new_tokens"])  # warm-up: first-call allocations, kernel selection, JIT
    gen16 = measure_generation(actor, ids, 16, s["new_tokens"])
    budget = 0.85 * torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 67.15
    largest = min(args.max_batch_cap, max_rollout_batch(arch, layout, budget))
    gen_max, tried = None, []
    while largest >= 16 and gen_max is None:
        try:
            gen_max = measure_generation(actor, ids, largest, s["new_tokens"])
        except torch.OutOfMemoryError:  # the formula's batch did not fit: say so, and halve
            tried.append(largest)
            torch.cuda.empty_cache()
            largest //= 2
    actor.runtime.rollout_micro_batch_size = 16

    history = fit_toy_grpo(cfg, actor, texts[: 4 * s["prompts_per_step"]], run_dir)
    train_peak = peak_gib()
    split = step_split(history)
    return {
        "backend": "aligner", "setup_s": setup_s, "generation_16": gen16, "generation_max": gen_max, "oom_batches": tried,
        "formula_max_batch": max_rollout_batch(arch, layout, budget), "budget_gib": budget,
        "step_split_s": split, "steps": len(history), "rewards": [h.get("reward/score") for h in history],
        "tokens_per_step": rollouts * s["new_tokens"],
        "peak_gib": {"train": train_peak, "rollout_16": gen16["peak_gib"]},
        "predicted_gib": {"train": training_bytes(arch, layout)["total"] / GIB,
                          "rollout_16": rollout_bytes(arch, layout)["total"] / GIB},
        "parameters_b": arch.parameters() / 1e9, "stubbed_packages": sorted(stubs.stubbed),
    }


# ------------------------------------------------------------------------------------------------ trl
def run_trl(args, hf: Path, run_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_factuality.local_models import dtype_keyword

    s = shape(args)
    tok = AutoTokenizer.from_pretrained(str(hf))
    tok.padding_side = "left"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(hf), **{dtype_keyword(): dtype})
    texts = prompts(64, s["prompt_tokens"], model.config.vocab_size)[: 4 * s["prompts_per_step"]]
    calls: list[tuple[int, float]] = []  # (tokens, seconds) of each generate call: one per step
    generate = model.generate

    def timed_generate(*a, **k):  # TRL calls the unwrapped model's generate once per step
        start = time.perf_counter()
        out = generate(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        prompt_len = (k.get("input_ids") if "input_ids" in k else a[0]).shape[1]
        completion = out[:, prompt_len:]
        ended = (completion == tok.eos_token_id).int().cumsum(1)  # tokens up to and including the first EOS
        calls.append((int(((ended == 0) | ((ended == 1) & (completion == tok.eos_token_id))).sum()), seconds))
        return out

    model.generate = timed_generate
    steps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            steps.append(time.perf_counter() - self.t0)

    def reward(prompts, completions, **_):
        return toy_reward_scores(completions)

    config = GRPOConfig(output_dir=str(run_dir), per_device_train_batch_size=s["prompts_per_step"] * s["group"],
                        num_generations=s["group"], max_prompt_length=s["prompt_tokens"],
                        max_completion_length=s["new_tokens"], learning_rate=s["lr"], beta=0.001, temperature=1.0,
                        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no",
                        bf16=not args.cpu, use_cpu=args.cpu, seed=1234)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config,
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts]), processing_class=tok,
                          callbacks=[StepTimes()])
    reset_peak()
    trainer.train()
    # TRL's steady state: its first step (and first generate call) carries the warm-up, ≥ 17 s on the first GPU run
    steady, steady_calls = steps[1:] or steps, calls[1:] or calls
    tokens, seconds = sum(c[0] for c in steady_calls), sum(c[1] for c in steady_calls)
    return {"step_s": sum(steady) / len(steady), "steps": len(steps), "first_step_s": steps[0] if steps else None,
            "generation": {"tokens": tokens, "seconds": seconds, "calls_counted": len(steady_calls),
                           "tokens_per_s": tokens / seconds if seconds else float("nan")},
            "peak_gib": peak_gib()}


def run_hf(args, hf: Path, _run_dir: Path) -> dict:
    """The hf backend's rollouts, eager ``generate`` against ``model.hf_generation=compiled`` (static KV cache +
    ``torch.compile``, shapes bucketed), greedy at rollout batch 16 on the kit's policy: tokens/s and ms per decode
    step after a warm-up call (the compile's), the graphs traced, the fraction of sequences equal on both. On CPU the
    graphs are traced with torch.compile's ``eager`` backend (inductor's code generation takes about a minute there)."""
    from transformers import PreTrainedTokenizerFast

    from nemo_factuality.trainers.backends.hf import compiled
    from nemo_factuality.trainers.backends.hf.actor import HFActor
    from nemo_factuality.trainers.config import GRPOConfig

    if args.cpu:
        compiled.COMPILE_BACKEND = "eager"
    # the kit's word-level tokenizer as its tokenizer.json says: transformers 5's AutoTokenizer takes the model type's
    # (Qwen2's BPE) and encodes every prompt to nothing
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(hf))
    s = shape(args)
    out: dict = {"compile_backend": compiled.COMPILE_BACKEND}
    tokens: dict[str, list] = {}
    for generation in ("eager", "compiled"):
        cfg = GRPOConfig()
        cfg.model.path, cfg.model.hf_generation, cfg.model.rollout_micro_batch_size = str(hf), generation, 16
        cfg.model.dtype = "float32" if args.cpu else "bfloat16"
        actor = HFActor(cfg.model, max_steps=1, device="cpu" if args.cpu else "cuda", tokenizer=tokenizer)
        texts = prompts(16, s["prompt_tokens"], actor.model.config.vocab_size)
        ids = [actor.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        warm = timed_greedy(actor, ids, s["new_tokens"])["seconds"]  # warm-up: the compile
        run = timed_greedy(actor, ids, s["new_tokens"])
        tokens[generation] = run["tokens"]
        out[generation] = {"tokens_per_s": run["count"] / run["seconds"],
                           "ms_per_step": 1000 * run["seconds"] / s["new_tokens"],
                           "first_call_s": warm, "graphs": getattr(getattr(actor, "_graphs", None), "graphs", None)}
        del actor
    out["greedy_equal"] = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"], strict=True)) / 16
    return out


# ------------------------------------------------------------------------------------------------ report
def _hf_line(h: dict | None) -> str:
    """The hf backend's eager-vs-compiled sentence under the table."""
    if not h:
        return ""
    if "error" in h:
        return f"hf backend, eager vs compiled: {h['error']}."
    e, c = h["eager"], h["compiled"]
    return (f"hf backend, greedy at batch 16: eager {e['tokens_per_s']:.0f} tok/s ({e['ms_per_step']:.1f} ms/step), "
            f"compiled {c['tokens_per_s']:.0f} tok/s ({c['ms_per_step']:.1f} ms/step; first call {c['first_call_s']:.1f} s, "
            f"{c['graphs']} graphs, torch.compile backend {h['compile_backend']}); equal tokens {h['greedy_equal']:.0%}.")


def report(result: dict) -> str:
    """The run as a markdown table (the backend vs TRL) with the memory formula's predictions where one applies."""
    backend = result.get("backend", "aligner")
    a, t = result[backend], result.get("trl") or {}
    if "error" in t:  # the peer was stopped at its timeout: its column says so
        print(f"gpu_smoke: the TRL peer {t['error']}", file=sys.stderr)
        t = {}
    size = a["parameters_b"]
    title = (f"# GPU smoke: {result['device']}, {result['model']} "
             + (f"({size:.2f} B parameters)" if size >= 0.1 else f"({size * 1e3:.2f} M parameters)"))
    on_gpu = result["device"] != "cpu"
    if backend == "megatron":
        from gpu_smoke_megatron import report_rows

        trl_dtype = "float32" if result["device"] == "cpu" else "bf16"
        lines = [title, "", f"| | megatron backend (Megatron-Core 0.16.1 + Bridge 0.3.1, {a['dtype']}, local spec) | "
                 f"TRL GRPOTrainer 0.15.2 ({trl_dtype}) |", "|---|---|---|", *report_rows(a, t, on_gpu), "",
                 f"{a['steps']} GRPO steps of {a['tokens_per_step']} new tokens; toy reward per step: "
                 f"{', '.join(f'{r:.3f}' for r in a['rewards'])}. Build from HF {a['setup_s']:.1f} s; steps after the "
                 f"first are averaged; Transformer Engine in use: {a['transformer_engine']}.", "",
                 _hf_line(result.get("hf")), async_line(result.get("async"))]
        return "\n".join(lines) + "\n"
    g16, gmax, split = a["generation_16"], a["generation_max"], a["step_split_s"]
    trl_gen = f"{t['generation']['tokens_per_s']:.0f}" if t else "not run"
    lines = [title, "",
             "| | aligner backend (NeMo-Aligner 0.7.0) | TRL GRPOTrainer 0.15.2 |", "|---|---|---|",
             f"| generation tokens/s, rollout batch 16 | {g16['tokens_per_s']:.0f} | {trl_gen} |"]
    if gmax:
        lines.append(f"| generation tokens/s, rollout batch {gmax['batch']} (the formula allows {a['formula_max_batch']}) "
                     f"| {gmax['tokens_per_s']:.0f} | — |")
    else:
        lines.append(f"| generation at the largest batch | {oom_text(a['oom_batches'], on_gpu)} | — |")
    lines += [f"| GRPO step, s: total (generate / reward / log-probs / train) | {split.get('step', float('nan')):.2f} "
              f"({split.get('generate', 0):.2f} / {split.get('reward', 0):.2f} / {split.get('logprobs', 0):.2f} / "
              f"{split.get('train', 0):.2f}) | {t['step_s']:.2f} |" if t else
              f"| GRPO step, s | {split.get('step', float('nan')):.2f} | not run |",
              f"| peak GPU memory, GiB, training (the formula's prediction) | {gib_cell(a['peak_gib']['train'], on_gpu)} "
              f"({a['predicted_gib']['train']:.1f}) | {gib_cell(t['peak_gib'], on_gpu)} |" if t else "",
              f"| peak GPU memory, GiB, rollout batch 16 (prediction) | {gib_cell(a['peak_gib']['rollout_16'], on_gpu)} "
              f"({a['predicted_gib']['rollout_16']:.1f}) | — |", "",
              f"{a['steps']} GRPO steps of {a['tokens_per_step']} new tokens; toy reward per step: "
              f"{', '.join(f'{r:.3f}' for r in a['rewards'])}. Restore + init {a['setup_s']:.1f} s; "
              f"steps after the first are averaged.", "", _hf_line(result.get("hf")), async_line(result.get("async"))]
    return "\n".join(line for line in lines if line is not None) + "\n"


# seconds each phase may run on a GPU (``--phase-timeout`` overrides all; 900 each on CPU)
PHASE_TIMEOUTS_S = {"aligner": 240.0, "megatron": 240.0, "hf": 60.0, "trl": 150.0, "async": 240.0}


def _phase(args, phase: str, out: Path) -> dict:
    """Run one phase in its own process (NeMo's and TRL's globals and GPU memory stay apart)."""
    # NF_SMOKE_<PHASE>_PYTHON / _PYTHONPATH: where a phase's stack lives when it is not this process's (gpu_smoke.sh
    # sets them: the megatron stack's folder, or on CPU the aligner venv that holds TRL)
    python = os.environ.get(f"NF_SMOKE_{phase.upper()}_PYTHON", sys.executable)
    path = os.environ.get(f"NF_SMOKE_{phase.upper()}_PYTHONPATH", _pythonpath())
    cmd = [python, __file__, "--phase", phase, "--out", str(out), "--steps", str(args.steps),
           "--max-batch-cap", str(args.max_batch_cap), *(["--cpu"] if args.cpu else []),
           *(["--vllm-python", args.vllm_python] if args.vllm_python else [])]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=path), start_new_session=True)
    try:
        code = proc.wait(timeout=args.phase_timeouts[phase])
    except subprocess.TimeoutExpired:  # the phase and everything it started; the next phase still runs
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        limit = args.phase_timeouts[phase]
        print(f"gpu_smoke: the {phase} phase ran past its {limit:g} s (--phase-timeout): stopped", file=sys.stderr)
        return {"error": f"stopped after {limit:g} s (--phase-timeout)"}
    if code:
        raise SystemExit(f"gpu_smoke: the {phase} phase failed (exit {code}); its output is above")
    return json.loads((out / f"{phase}.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="outputs/gpu_smoke", help="folder for the model, runs, smoke.json and smoke.md")
    ap.add_argument("--cpu", action="store_true", help="the CPU path: a tiny model, no GPU needed")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per trainer (default 4 on GPU, 2 with --cpu)")
    ap.add_argument("--max-batch-cap", type=int, default=None,
                    help="upper bound on the largest rollout batch tried (default 1024 on GPU, 48 with --cpu)")
    ap.add_argument("--backend", choices=("aligner", "megatron"), default="aligner",
                    help="the actor measured: NeMo-Aligner 0.7.0, or Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1")
    ap.add_argument("--skip-trl", action="store_true", help="only the backend, not the TRL peer")
    ap.add_argument("--phase-timeout", type=float, default=None,
                    help="seconds each phase may run; past it the phase is stopped, recorded as such, and the next one "
                         "runs (default on a GPU: the backend's 240, hf 60, TRL 150 — with the model build within 8 "
                         "minutes; 900 each with --cpu)")
    ap.add_argument("--async", dest="run_async", action="store_true",
                    help="also the async GRPO phase: grpo.max_staleness 0 and 1 on a vLLM engine (--vllm-python)")
    ap.add_argument("--vllm-python", help="the interpreter with vLLM the async phase's engine runs in (default "
                                          "$NF_SMOKE_VLLM_PYTHON, then $NEMO_FACTUALITY_VLLM_PYTHON)")
    ap.add_argument("--phase", choices=("aligner", "megatron", "hf", "trl", "async"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.cpu else 4)
    args.max_batch_cap = args.max_batch_cap or (48 if args.cpu else 1024)
    # the GPU run fits 8 minutes (issue 42): the phases' bounds plus the model build
    args.phase_timeouts = ({phase: args.phase_timeout for phase in PHASE_TIMEOUTS_S} if args.phase_timeout else
                           {phase: 900.0 for phase in PHASE_TIMEOUTS_S} if args.cpu else dict(PHASE_TIMEOUTS_S))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    s = shape(args)
    if args.phase:
        from nemo_factuality.stack_warnings import ignore_expected_warnings

        ignore_expected_warnings()  # this process runs one stack: its warnings about the kit's CPU path are known
        hf, nemo = out / "hf", out / "policy"
        run_dir = out / f"{args.phase}_run"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, never a resume of the last one
        if args.phase == "megatron":
            from gpu_smoke_megatron import run_megatron

            result = run_megatron(args, hf, run_dir)
        elif args.phase == "async":
            from gpu_smoke_async import run_async

            result = run_async(args, hf, run_dir)
        else:
            fn = {"aligner": run_aligner, "hf": run_hf, "trl": run_trl}[args.phase]
            result = fn(args, nemo if args.phase == "aligner" else hf, run_dir)
        (out / f"{args.phase}.json").write_text(json.dumps(result, indent=1))
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke: no CUDA device visible; use --cpu for the CPU path")
    build(out, s["model"], nemo_too=args.backend == "aligner")
    result = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(0), "model": s["model"], "shape": s,
              "torch": torch.__version__, "backend": args.backend}
    # hf: TRL's stack, the peer's engine; async: the hf backend's GRPO on a vLLM engine
    for phase in (args.backend, *(() if args.skip_trl else ("hf", "trl")), *(("async",) if args.run_async else ())):
        result[phase] = _phase(args, phase, out)
        (out / "smoke.json").write_text(json.dumps(result, indent=1))  # what has run so far, whatever comes next
    if "error" in result[args.backend]:
        raise SystemExit(f"gpu_smoke: the {args.backend} phase was {result[args.backend]['error']}; smoke.json has the rest")
    text = report(result)
    (out / "smoke.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
