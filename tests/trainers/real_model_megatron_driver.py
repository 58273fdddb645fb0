"""Runs in the megatron venv (Megatron-Core 0.16.1, Megatron-Bridge 0.3.1, transformers 4.57) on gloo: the megatron
backend on the real model's HF folder (SmolLM2-135M-Instruct, written by transformers 5), each command writing
``<out>/<tag>.rank<r>.json``:

    python tests/trainers/real_model_megatron_driver.py tp1 --hf DIR --out DIR
    torchrun --nproc_per_node 2 tests/trainers/real_model_megatron_driver.py tp2 --hf DIR --out DIR

* ``tp1``: the actor built through Bridge at TP=1; what it built (RoPE base, tie, vocabulary); its logits on two
  chat-templated prompts against this venv's transformers (and saved, ``tp1_logits.pt``, for the test to compare with
  transformers 5's); one GRPO step of the real stage (``GRPOTrainer``, a toy reward with variance, AdamW) and
  ``final/`` exported, reloaded in transformers and compared with the trained model's logits; the exported folder's
  tie and RoPE.
* ``tp2``: the actor at TP=2, which must be refused on every rank in one line (9 heads / 3 KV heads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import megatron_cpu  # noqa: E402

megatron_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.config import ConfigError  # noqa: E402
from nemo_factuality.testing.real_model import QUESTIONS, capital_prompts, even_token_fraction  # noqa: E402
from nemo_factuality.testing.training import read_metrics  # noqa: E402
from nemo_factuality.trainers.backends import BACKENDS  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402


def overrides(args, run_dir: Path) -> list[str]:
    return [f"model.path={args.hf}", "trainer.backend=megatron", f"model.tensor_model_parallel_size={args.tp}",
            "trainer.max_steps=1", "trainer.save_interval=0", "trainer.progress_bar=false",
            "grpo.num_prompts_per_step=2", "grpo.num_rollouts_per_prompt=2", "grpo.truncated=keep",
            "model.micro_batch_size=2", "model.global_batch_size=4", "model.forward_micro_batch_size=2",
            "model.rollout_micro_batch_size=4", "model.length_params.max_length=6", "model.optim.sched.name=constant",
            "model.optim.name=adamw", "model.optim.lr=1e-4", "data.max_prompt_tokens=64",
            "remote_rm.url=http://127.0.0.1:9", f"exp_manager.explicit_log_dir={run_dir}",
            "exp_manager.create_tensorboard_logger=false"]


def chat_tokens(path: str) -> torch.Tensor:
    """``[2, S]``: two chat-templated questions, this venv's tokenizer, cut to the shorter one's length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS[:2]]
    ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in ids]
    width = min(map(len, ids))
    return torch.tensor([x[:width] for x in ids])


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def built(actor) -> dict:
    """What Bridge built: the RoPE base its frequencies come from (``inv_freq[i] = base^(-2i/d)``), the tie (the output
    layer holds no weight of its own) and the vocabulary."""
    model = actor.model
    inv_freq = model.rotary_pos_emb.inv_freq.double()
    return {"rotary_base": float(inv_freq[1] ** (-len(inv_freq))),
            "tied": bool(model.share_embeddings_and_output_weights) and model.output_layer.weight is None,
            "vocab": int(model.embedding.word_embeddings.weight.shape[0])}


def exported(final: Path) -> dict:
    """The exported folder's tensors and config as files say them (no transformers in between)."""
    from safetensors import safe_open

    keys = set()
    for shard in final.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            keys |= set(f.keys())
    config = json.loads((final / "config.json").read_text())
    return {"has_lm_head": "lm_head.weight" in keys, "tensors": len(keys),
            "tie_word_embeddings": config.get("tie_word_embeddings"),
            "rope_theta": config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))}


def tp1(args) -> dict:
    from megatron_driver import full_logits  # the sibling driver (this script's directory is on sys.path)

    from nemo_factuality.cli import run_command
    from nemo_factuality.trainers.grpo import GRPOTrainer

    out = Path(args.out)
    cfg = load_train_config(GRPOConfig, None, overrides(args, out / "grpo"))
    actor, _ = BACKENDS.get("megatron")(cfg)
    tokens = chat_tokens(args.hf)
    ours = full_logits(actor, tokens)
    torch.save({"tokens": tokens, "logits": ours}, out / "tp1_logits.pt")
    ref = hf_logits(args.hf, tokens)
    result = {"built": built(actor), "tokens": tokens.tolist(), "logit_scale": float(ref.abs().max()),
              "logits_max_diff": float((ours - ref).abs().max())}
    trainer = GRPOTrainer(cfg, actor, even_token_fraction, capital_prompts(4), run_dir=out / "grpo")
    result["exit"] = run_command(lambda _argv: trainer.fit() and 0, [], "train grpo (real model, megatron)")
    result["metrics"] = read_metrics(out / "grpo")
    trained = full_logits(actor, tokens)
    result["step_moved_logits"] = float((trained - ours).abs().max())
    final = out / "grpo" / "final"
    result["final"] = exported(final)
    result["final_logits_max_diff"] = float((hf_logits(str(final), tokens) - trained).abs().max())
    return result


def tp2(args) -> dict:
    try:
        BACKENDS.get("megatron")(load_train_config(GRPOConfig, None, overrides(args, Path(args.out) / "tp2")))
    except ConfigError as err:
        return {"refused": str(err)}
    return {"refused": None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["tp1", "tp2"])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.tp = 2 if args.command == "tp2" else 1
    result = {"tp1": tp1, "tp2": tp2}[args.command](args)
    rank = int(os.environ.get("RANK", "0"))  # tp2 is refused before any process group exists
    (Path(args.out) / f"{args.command}.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
