"""``trainer.backend=hf`` on the real model (SmolLM2-135M-Instruct, float32, tied): one GRPO step of the real stage
whose exported ``final/`` reloads with the trained model's logits and stays tied; and the real track's smoke — the
training command (``nemo-factuality train grpo``) for 3 steps against FactAlign's labeller served on PyTriton
(``nemo-factuality serve --config-name demo``) over a knowledge store of four real capitals, on questions the model
answers right (France, Japan) and wrong (Bhutan, Moldova)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from nemo_factuality.testing.real_model import QUESTIONS, capital_prompts, even_token_fraction
from nemo_factuality.testing.servers import reward_server, subprocess_env
from nemo_factuality.testing.training import read_metrics, write_jsonl

pytestmark = [pytest.mark.slow]
CAPITALS = {"France": "Paris", "Bhutan": "Thimphu", "Japan": "Tokyo", "Moldova": "Chisinau"}
SMOKE_STEPS = 3


def test_a_grpo_step_trains_and_exports_a_tied_folder_with_the_trained_logits(smollm2_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from nemo_factuality.testing.training import grpo_test_config
    from nemo_factuality.trainers.backends import BACKENDS
    from nemo_factuality.trainers.grpo import GRPOTrainer

    cfg = grpo_test_config(smollm2_dir, tmp_path / "run", steps=1, **{
        "grpo.num_prompts_per_step": 2, "grpo.num_rollouts_per_prompt": 2, "model.global_batch_size": 4,
        "model.micro_batch_size": 2, "model.optim.lr": 1e-4, "model.optim.name": "adamw"})
    actor, _ = BACKENDS.get("hf")(cfg)
    tokens = actor.tokenizer(["The capital of Bhutan is the city of"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = actor.model(tokens).logits
    GRPOTrainer(cfg, actor, even_token_fraction, capital_prompts(4), run_dir=tmp_path / "run").fit()
    (m,) = read_metrics(tmp_path / "run")
    assert math.isfinite(m["loss/policy"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    with torch.no_grad():
        trained = actor.model(tokens).logits
    assert float((trained - before).abs().max()) > 1e-3  # the step moved the model
    final = tmp_path / "run" / "final"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # still tied: the output layer is the embedding
    reloaded = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, trained)  # same weights, same kernels: bit-equal


@pytest.fixture(scope="module")
def capitals_kb(tmp_path_factory):
    from nemo_factuality.knowledge.store import build_store

    root = tmp_path_factory.mktemp("capitals_kb")
    facts = [{"subject": c, "relation": "capital", "value": v, "text": f"The capital of {c} is {v}."}
             for c, v in CAPITALS.items()]
    write_jsonl(root / "p.jsonl", [{"title": f["subject"], "text": f["text"]} for f in facts])
    write_jsonl(root / "f.jsonl", facts)
    return build_store(root / "p.jsonl", root / "kb.sqlite", facts_jsonl=root / "f.jsonl", progress=False)


def test_the_real_track_smoke_trains_against_a_served_reward(smollm2_dir, capitals_kb, tmp_path):
    """The stage command and the reward server as a user runs them: the served labeller judges the real model's
    answers (the knowledge store supports "The capital of France is Paris." and refutes "… of Bhutan is Lumbe."),
    every step's reward is a finite number, and the policy it writes is an HF folder of the real model."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": f"{q} Answer in one short sentence.", "topic": q.rsplit(" ", 1)[-1].rstrip("?")} for q in QUESTIONS])
    run_dir, stopped = tmp_path / "run", {}
    with reward_server("demo", [f"policy_tokenizer={smollm2_dir}", f"reward.pipeline.verifier.store_path={capitals_kb}"],
                       tmp_path / "serve", stopped) as server:
        server["wait_ready"]()
        res = subprocess.run(
            [sys.executable, "-m", "nemo_factuality.cli", "train", "grpo", "--config-name", "tiny_cpu_standin",
             f"model.path={smollm2_dir}", f"remote_rm.url={server['url']}", f"data.train={prompts}",
             f"trainer.max_steps={SMOKE_STEPS}", "trainer.save_interval=0", "model.length_params.max_length=16",
             f"exp_manager.explicit_log_dir={run_dir}"],
            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, SMOKE_STEPS + 1))
    assert all(math.isfinite(m["reward/score"]) and math.isfinite(m["loss/policy"]) for m in metrics), metrics
    assert json.loads((run_dir / "final" / "config.json").read_text())["num_hidden_layers"] == 30
    assert stopped["exit_code"] == 0 and not stopped["left_after_stop"], stopped
