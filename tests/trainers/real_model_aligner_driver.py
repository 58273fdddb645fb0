"""Runs in the NeMo-Aligner venv (NeMo 2.2.1, NeMo-Aligner 0.7.0, Megatron-Core 0.12.3, transformers 4.48) on gloo:
the aligner backend on the real model, restored by Aligner from the extracted ``.nemo`` our converter wrote from
SmolLM2-135M-Instruct's HF folder. Writes ``<out>/result.json`` and ``<out>/logprobs.pt``:

    python tests/trainers/real_model_aligner_driver.py --nemo DIR --hf DIR --out DIR

The restored actor's log-probs of two chat-templated questions against this venv's transformers on the HF folder;
one GRPO step of the real stage (``GRPOTrainer``, a toy reward with variance, SGD); the trained log-probs, and the
trained policy exported as a ``.nemo`` (``<out>/trained.nemo``) for the test to convert back and compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import aligner_cpu  # noqa: E402

aligner_cpu.apply()

import torch  # noqa: E402

from nemo_factuality.testing.real_model import QUESTIONS, capital_prompts, even_token_fraction  # noqa: E402
from nemo_factuality.trainers.backends.aligner.actor import build_actor  # noqa: E402
from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout  # noqa: E402


def overrides(args, run_dir: Path) -> list[str]:
    return [f"model.restore_from_path={args.nemo}", "trainer.backend=aligner", "trainer.max_steps=1",
            "trainer.save_interval=0", "trainer.progress_bar=false", "grpo.num_prompts_per_step=2",
            "grpo.num_rollouts_per_prompt=2", "grpo.truncated=keep", "model.micro_batch_size=2",
            "model.global_batch_size=4", "model.forward_micro_batch_size=2", "model.length_params.max_length=6",
            "model.dtype=float32", "model.optim.name=sgd", "model.optim.lr=0.01", "model.optim.sched.name=constant",
            "data.max_prompt_tokens=64", "remote_rm.url=http://127.0.0.1:9", f"exp_manager.explicit_log_dir={run_dir}",
            "exp_manager.create_tensorboard_logger=false"]


def chat_rollout(path: str) -> Rollout:
    """Two chat-templated questions (this venv's tokenizer), cut to the shorter one's length, as a rollout whose
    response is the template's last 6 tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS[:2]]
    width = min(map(len, ids))
    tokens = torch.tensor([x[:width] for x in ids])
    return Rollout(tokens, torch.full((2,), width - 6), torch.full((2,), width), torch.ones(2, dtype=torch.bool))


def hf_logprobs(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from nemo_factuality.trainers.backends.hf.actor import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return token_logprobs(model(tokens).logits, tokens)


def main() -> int:
    from nemo_factuality.cli import run_command
    from nemo_factuality.testing.training import read_metrics
    from nemo_factuality.trainers.grpo import GRPOTrainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    cfg = load_train_config(GRPOConfig, None, overrides(args, out / "grpo"))
    actor = build_actor(cfg, max_steps=1, rollout_micro_batch_size=4, model_overrides=dict(aligner_cpu.CPU_MODEL_OVERRIDES))
    rollout = chat_rollout(args.hf)
    restored = actor.logprobs(rollout)
    ref = hf_logprobs(args.hf, rollout.tokens)
    result = {"restored_vs_hf": float((restored - ref).abs().max()), "tied":
              bool(actor.model.cfg.get("share_embeddings_and_output_weights")),
              "rotary_base": float(actor.model.cfg.get("rotary_base"))}
    trainer = GRPOTrainer(cfg, actor, even_token_fraction, capital_prompts(4), run_dir=out / "grpo")
    result["exit"] = run_command(lambda _argv: trainer.fit() and 0, [], "train grpo (real model, aligner)")
    result["metrics"] = read_metrics(out / "grpo")
    trained = actor.logprobs(rollout)
    result["step_moved_logprobs"] = float((trained - restored).abs().max())
    actor.export(out / "trained.nemo")
    torch.save({"tokens": rollout.tokens, "restored": restored, "trained": trained}, out / "logprobs.pt")
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
