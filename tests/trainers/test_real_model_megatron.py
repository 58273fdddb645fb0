"""``trainer.backend=megatron`` on the real model: SmolLM2-135M-Instruct's HF folder (written by transformers 5) loaded
through Megatron-Bridge in the megatron venv (transformers 4.57) at TP=1 — RoPE base 100000, tied, 49,152 rows —
with logits equal to transformers' (both 4.57's, in the venv, and 5's, here); one GRPO step of the real stage, whose
exported ``final/`` reloads with the trained model's logits and stays tied; and TP=2 refused on every rank in one
line (9 heads / 3 KV heads: TP must divide the heads, and the KV heads must be a multiple or a divisor of TP). One launch
(``real_model_megatron_driver.py``), Megatron imported once."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nemo_factuality.testing.megatron_env import PRELOAD, run_batch_in_megatron_venv
from nemo_factuality.testing.real_model import FP32_LOGIT_TOLERANCE, QUESTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
DRIVER = "tests/trainers/real_model_megatron_driver.py"


@pytest.fixture(scope="module")
def runs(megatron_venv, smollm2_dir, tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("real_megatron")
    programs = {name: (nproc, [DRIVER, name, f"--hf={smollm2_dir}", f"--out={root}"])
                for name, nproc in (("tp1", 1), ("tp2", 2))}
    results = run_batch_in_megatron_venv(megatron_venv, programs, logs=root / "logs", timeout=1200, preload=PRELOAD)
    return root, results


def _ranks(runs, name: str, nproc: int) -> list[dict]:
    root, results = runs
    results[name].check(name)
    return [json.loads((root / f"{name}.rank{r}.json").read_text()) for r in range(nproc)]


def test_bridge_builds_the_real_model_as_it_is(runs):
    (r,) = _ranks(runs, "tp1", 1)
    assert r["built"]["tied"] is True and r["built"]["vocab"] == 49_152
    assert math.isclose(r["built"]["rotary_base"], 100_000.0, rel_tol=1e-4)  # not transformers 4's default 10000


def test_the_megatron_logits_equal_transformers_4_and_5(runs, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (r,) = _ranks(runs, "tp1", 1)
    assert r["logits_max_diff"] < FP32_LOGIT_TOLERANCE and r["logit_scale"] > 10, r  # transformers 4.57 in the venv
    saved = torch.load(runs[0] / "tp1_logits.pt")
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)
           ["input_ids"] for q in QUESTIONS[:2]]
    assert saved["tokens"].tolist() == [list(x[: saved["tokens"].shape[1]]) for x in ids]  # both tokenizers agree
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(saved["tokens"]).logits
    assert float((saved["logits"] - ref).abs().max()) < FP32_LOGIT_TOLERANCE


def test_a_grpo_step_trains_and_exports_a_tied_folder_with_the_trained_logits(runs):
    (r,) = _ranks(runs, "tp1", 1)
    assert r["exit"] == 0 and [m["step"] for m in r["metrics"]] == [1]
    m = r["metrics"][0]
    assert math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0 and math.isfinite(m["grad_norm"])
    assert r["step_moved_logits"] > 1e-3  # the step changed the model (AdamW, lr 1e-4)
    assert r["final_logits_max_diff"] < FP32_LOGIT_TOLERANCE, r["final_logits_max_diff"]
    final = r["final"]
    assert final["tie_word_embeddings"] is True and not final["has_lm_head"], final
    assert final["rope_theta"] == 100_000.0


def test_tp2_is_refused_on_every_rank_in_one_line(runs):
    for r in _ranks(runs, "tp2", 2):
        assert r["refused"] and "\n" not in r["refused"], r
        assert "9 attention heads / 3 KV heads do not split over model.tensor_model_parallel_size=2" in r["refused"]
        assert r["refused"].endswith("choose one of [1, 3, 9]")  # Megatron-Core 0.16's rule: KV heads shared at 9
