"""Runs in the megatron venv under torchrun (gloo): the real GRPO stage (``GRPOTrainer``, through the command boundary
``cli.run_command`` as the stage CLI runs it) on ``trainer.backend=megatron``, from an HF checkpoint to the exported
HF folder ``final/``:

    torchrun --nproc_per_node 2 tests/trainers/megatron_grpo_driver.py --hf DIR --out DIR --tp 2
    torchrun --nproc_per_node 2 tests/trainers/megatron_grpo_driver.py --hf DIR --out DIR
    torchrun --nproc_per_node 4 tests/trainers/megatron_grpo_driver.py --hf DIR --out DIR --tp 2 --preset
    torchrun --nproc_per_node 4 tests/trainers/megatron_grpo_driver.py --hf DIR --out DIR --tp 2 --dynamic

Runs, each from the initial state (weights and optimiser, saved before the first) and the same seed (SGD without
momentum; ``--preset``: the GPU presets' settings, AdamW; ``--dynamic``: rollouts on Megatron's dynamic inference
engine — ``model.megatron.attention_kernels=torch``, pages of 4 tokens — with sequence parallelism on):
``straight`` (3 steps, a checkpoint every step) and ``interrupted`` (2 steps, then the same command with
``trainer.max_steps=3`` resumes from the step-2 checkpoint). Each rank writes ``<out>/rank<r>.json``: per run the exit
code, the metrics logged, the checkpoints, the log-probs of fixed sequences afterwards, and (global rank 0) the
largest difference between ``final/`` reloaded in transformers and the trained Megatron model's logits.
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

from nemo_factuality.cli import run_command  # noqa: E402
from nemo_factuality.testing.training import good_fraction, prompts, read_metrics  # noqa: E402
from nemo_factuality.trainers.backends import BACKENDS  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.grpo import GRPOTrainer  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout  # noqa: E402
from nemo_factuality.trainers.runtime import seed_everything  # noqa: E402

FIXED = torch.tensor([[5, 17, 33, 8, 90, 41, 7], [9, 60, 2, 44, 31, 18, 77]])


def overrides(args, run_dir: Path, max_steps: int) -> list[str]:
    return [f"model.path={args.hf}", "trainer.backend=megatron", f"model.tensor_model_parallel_size={args.tp}",
            f"trainer.max_steps={max_steps}", "trainer.save_interval=1", "trainer.progress_bar=false",
            "grpo.num_prompts_per_step=4", "grpo.num_rollouts_per_prompt=2", "grpo.truncated=keep",
            "model.micro_batch_size=2", "model.global_batch_size=8", "model.forward_micro_batch_size=2",
            "model.rollout_micro_batch_size=4", "model.length_params.max_length=5", "model.optim.sched.name=constant",
            "remote_rm.url=http://127.0.0.1:9", f"exp_manager.explicit_log_dir={run_dir}",
            "exp_manager.create_tensorboard_logger=false",
            *(PRESET if args.preset else ["model.optim.name=sgd", "model.optim.lr=0.05"]),
            *(DYNAMIC if args.dynamic else [])]


# the GPU presets' settings (at TP > 1): bf16 mixed precision, sequence parallelism, Megatron's distributed optimizer
# (which is Adam's only), full activation recompute
PRESET = ["model.dtype=bfloat16", "model.megatron.sequence_parallel=true", "model.megatron.use_distributed_optimizer=true",
          "model.megatron.recompute=full", "model.optim.name=adamw", "model.optim.lr=0.01"]


# rollouts on the dynamic engine (2 requests in flight: each replica's 4 prompts at TP=2×DP=2 wait for slots), SP on
# several KV pages per sequence (flash-attn's kernels need 256 tokens a page; the torch kernels take any)
DYNAMIC = ["model.megatron.inference_engine=dynamic", "model.megatron.attention_kernels=torch",
           "model.megatron.inference_buffer_gb=0.01",
           "model.megatron.inference_block_tokens=4",
           "model.megatron.sequence_parallel=true", "model.rollout_micro_batch_size=2"]


def fixed_logprobs(actor) -> list:
    rollout = Rollout(FIXED, torch.tensor([3, 3]), torch.tensor([7, 7]), torch.ones(2, dtype=torch.bool))
    return actor.logprobs(rollout).tolist()


def final_logits_diff(actor, final: Path) -> float:
    """``final/`` reloaded in transformers against the trained Megatron model, on ``FIXED``."""
    from megatron_driver import full_logits  # the sibling driver (this script's directory is on sys.path)
    from transformers import AutoModelForCausalLM

    ours = full_logits(actor, FIXED)
    if actor.global_rank != 0:
        return 0.0
    hf = AutoModelForCausalLM.from_pretrained(str(final), torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # with bf16 weights: in bf16, as the Megatron model computes
        hf = hf.to(actor.settings.dtype)
        return float((hf.eval()(FIXED).logits.float() - ours).abs().max())


def run(actor, args, name: str, run_dir: Path, max_steps: int) -> dict:
    trainer = GRPOTrainer(load_train_config(GRPOConfig, None, overrides(args, run_dir, max_steps)), actor, good_fraction,
                          prompts(8), run_dir=run_dir)
    code = run_command(lambda _argv: trainer.fit() and 0, [], f"train grpo ({name})")
    ckpt = run_dir / "checkpoints"
    return {"exit": code, "checkpoints": sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else [],
            "metrics": read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [],
            "logprobs": fixed_logprobs(actor)}


def _count_decode_steps() -> list[int]:
    """``[n]``: how often Megatron's attention calls its paged decode kernel (the dynamic engine's only; call it once the
    actor's start-up check bound the kernels)."""
    import functools

    from megatron.core.transformer import attention

    count, kernel = [0], attention.flash_attn_with_kvcache
    if kernel is None:  # no dynamic engine in this run: nothing bound, nothing to count
        return count

    @functools.wraps(kernel)  # keeps the torch kernel's mark, which Megatron's version check reads
    def counted(*args, **kwargs):
        count[0] += 1
        return kernel(*args, **kwargs)

    attention.flash_attn_with_kvcache = counted
    return count


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--preset", action="store_true", help="the GPU presets' settings (PRESET)")
    ap.add_argument("--dynamic", action="store_true", help="rollouts on the dynamic inference engine (DYNAMIC)")
    args = ap.parse_args()
    out = Path(args.out)
    actor, _ = BACKENDS.get("megatron")(load_train_config(GRPOConfig, None, overrides(args, out / "init", 3)))
    decodes = _count_decode_steps()
    actor.save(out / "initial")  # weights, fp32 main weights and Adam's (empty) state: each run starts from it
    runs = {}
    for name, steps in (("straight", (3,)), ("interrupted", (2, 3))):
        actor.load(out / "initial")
        seed_everything(args.seed)
        for max_steps in steps:  # the second is the requeued job: the same command, the same run directory
            runs[f"{name}_{max_steps}"] = run(actor, args, name, out / name, max_steps)
        runs[name] = runs.pop(f"{name}_{steps[-1]}")
    runs["final_logits_max_diff"] = final_logits_diff(actor, out / "interrupted" / "final")
    runs["final_files"] = sorted(p.name for p in (out / "interrupted" / "final").iterdir())
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "dp_rank": actor.data_parallel_rank,
                                                      "dp": actor.data_parallel_size, "runs": runs,
                                                      "paged_decode_calls": decodes[0],
                                                      "dynamic_builds": actor._dynamic.builds if actor._dynamic else 0}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
