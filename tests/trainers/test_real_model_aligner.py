"""``trainer.backend=aligner`` on the real model: SmolLM2-135M-Instruct converted to an extracted ``.nemo`` by our
converter, restored by NeMo-Aligner's own actor in its venv (NeMo 2.2.1, Megatron-Core 0.12.3, transformers 4.48) —
tied, RoPE base 100000 — with log-probs equal to transformers' on the HF folder; one GRPO step of the real stage; the
trained policy exported as a ``.nemo``, converted back to HF here, with the trained log-probs in transformers 5 and
the embedding still tied (``real_model_aligner_driver.py``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nemo_factuality.testing.aligner_env import run_in_aligner_venv
from nemo_factuality.testing.real_model import FP32_LOGIT_TOLERANCE
from nemo_factuality.testing.servers import convert_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
DRIVER = "tests/trainers/real_model_aligner_driver.py"


@pytest.fixture(scope="module")
def run(venv, smollm2_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("real_aligner")
    convert_checkpoint("hf-to-nemo", "--hf", str(smollm2_dir), "--out", str(root / "policy"), "--extracted")
    res = run_in_aligner_venv(venv, [DRIVER, f"--nemo={root / 'policy'}", f"--hf={smollm2_dir}", f"--out={root}"],
                              timeout=1200, preload=True)
    assert res.returncode == 0, res.stdout[-5000:]
    return {"root": root, **json.loads((root / "result.json").read_text())}


def test_aligner_restores_the_converted_real_model_with_transformers_log_probs(run):
    assert run["tied"] is True and run["rotary_base"] == 100_000.0
    assert run["restored_vs_hf"] < FP32_LOGIT_TOLERANCE, run["restored_vs_hf"]


def test_a_grpo_step_on_aligner_trains_and_its_exported_nemo_converts_back_with_the_trained_log_probs(run, tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_factuality.convert.nemo_format import hf_tensors
    from nemo_factuality.trainers.backends.hf.actor import token_logprobs

    assert run["exit"] == 0 and [m["step"] for m in run["metrics"]] == [1]
    m = run["metrics"][0]
    assert math.isfinite(m["loss/policy"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert run["step_moved_logprobs"] > 1e-3
    convert_checkpoint("nemo-to-hf", "--nemo", str(run["root"] / "trained.nemo"), "--out", str(tmp_path / "hf"))
    assert "lm_head.weight" not in hf_tensors(tmp_path / "hf")  # still tied after training and export
    saved = torch.load(run["root"] / "logprobs.pt")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        ours = token_logprobs(model(saved["tokens"]).logits, saved["tokens"])
    assert float((ours - saved["trained"]).abs().max()) < FP32_LOGIT_TOLERANCE
