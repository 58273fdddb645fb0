"""The converters on a real model: SmolLM2-135M-Instruct (Llama, tied embeddings, vocabulary 49,152, 9 heads / 3 KV
heads, rope_theta 100000, 30 layers) HF → ``.nemo`` → HF bit for bit, and Megatron-Core's logits from the ``.nemo``
against transformers' at TP=1 and TP=3.

TP=2 cannot exist for this model: Megatron-Core splits the attention heads over TP (``TransformerConfig`` raises
"num_attention_heads (9) must be a multiple of tensor_model_parallel_size (2)"), and NeMo-Aligner's Megatron-Core
0.12 also the KV heads (query groups: 3 do not split over 2 ranks; 0.16 would let TP ranks share a KV head, at TP=9).
Both commands refuse it in one line before any rank starts. TP=3 (3 heads and 1 KV head a rank) is the layout checked
instead, from a checkpoint pre-sharded for it with a padded vocabulary (49,152 → 51,000 rows, a multiple of 1000 · 3:
NeMo's own rule pads nothing here, 49,152 being 128 · 384), so the padding of a tied embedding is exercised on real
weights too.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("megatron.core")

from nemo_factuality.convert.nemo_format import hf_tensors  # noqa: E402
from nemo_factuality.testing.ports import free_ports  # noqa: E402
from nemo_factuality.testing.preloaded import PreloadedCommands  # noqa: E402
from nemo_factuality.testing.real_model import FP32_LOGIT_TOLERANCE  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
COMMANDS: PreloadedCommands | None = None  # set for the module's run by conftest.py
LOGIT_TOLERANCE = FP32_LOGIT_TOLERANCE  # float32 rounding in another summation order (testing/real_model.py says why)
PADDED_TO = 1000  # --make-vocab-size-divisible-by: 49,152 → 51,000 rows (1000 · TP=3 divides it)


def _run(*args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return COMMANDS.run(["convert", *args], timeout=timeout, **env)


def _ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, res.stdout[-1500:] + res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def checkpoints(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """Two extracted ``.nemo`` of the real model — ``tp1`` (NeMo's defaults) and ``tp3`` (pre-sharded for TP=3, the
    vocabulary padded to a multiple of 1000) — and each one converted back to HF (``<name>_back``)."""
    root = tmp_path_factory.mktemp("real_convert")
    out = {"tp1": root / "tp1.nemo", "tp3": root / "tp3.nemo"}
    _ok(_run("hf-to-nemo", "--hf", str(smollm2_dir), "--out", str(out["tp1"]), "--extracted"))
    _ok(_run("hf-to-nemo", "--hf", str(smollm2_dir), "--out", str(out["tp3"]), "--extracted", "--tp", "3",
             "--make-vocab-size-divisible-by", str(PADDED_TO)))
    for name in ("tp1", "tp3"):
        out[f"{name}_back"] = root / f"{name}_back"
        _ok(_run("nemo-to-hf", "--nemo", str(out[name]), "--out", str(out[f"{name}_back"])))
    return out


def test_the_nemo_config_is_the_models(checkpoints):
    """What NeMo builds from: tied, 3 query groups, head width 64, RoPE base 100000, the GGUF's epsilon, and the
    padded vocabulary recorded (``override_vocab_size``) so it is stripped on the way back."""
    tp1 = yaml.safe_load((checkpoints["tp1"] / "model_config.yaml").read_text())
    tp3 = yaml.safe_load((checkpoints["tp3"] / "model_config.yaml").read_text())
    want = {"num_layers": 30, "hidden_size": 576, "ffn_hidden_size": 1536, "num_attention_heads": 9,
            "num_query_groups": 3, "kv_channels": 64, "rotary_base": 100000.0, "normalization": "rmsnorm",
            "share_embeddings_and_output_weights": True, "override_vocab_size": 49152, "qkv_bias": False}
    assert {k: tp1[k] for k in want} == want and {k: tp3[k] for k in want} == want
    assert abs(tp1["layernorm_epsilon"] - 1e-5) < 1e-12  # the GGUF's float32 1e-5
    assert (tp1["make_vocab_size_divisible_by"], tp1["tensor_model_parallel_size"]) == (128, 1)
    assert (tp3["make_vocab_size_divisible_by"], tp3["tensor_model_parallel_size"]) == (PADDED_TO, 3)
    # no output layer stored: Megatron's tied GPTModel reads the embedding (NeMo's strict load would refuse an extra)
    stored = json.loads((checkpoints["tp1"] / "manifest.json").read_text())["tensors"]
    assert "output_layer.weight" not in stored and stored["embedding.word_embeddings.weight"]["shape"] == [49_152, 576]
    padded = json.loads((checkpoints["tp3"] / "manifest.json").read_text())["tensors"]
    assert padded["embedding.word_embeddings.weight"]["shape"] == [51_000, 576]  # a multiple of 1000 · TP=3


@pytest.mark.parametrize("name", ["tp1", "tp3"])
def test_hf_nemo_hf_is_bit_exact_on_the_real_weights(smollm2_dir, checkpoints, name):
    ours, back = hf_tensors(smollm2_dir), hf_tensors(checkpoints[f"{name}_back"])
    assert set(ours) == set(back) and "lm_head.weight" not in back  # tied: stored once, both ways
    assert [k for k in ours if not torch.equal(ours[k], back[k])] == []
    config = json.loads((checkpoints[f"{name}_back"] / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49_152
    rope = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    assert rope == 100_000.0


def _verify(hf: Path, nemo: Path, tp: int) -> dict:
    (port,) = free_ports(1)  # the command's torchrun rendezvous: never a fixed port beside other modules
    res = _ok(_run("verify", "--hf", str(hf), "--nemo", str(nemo), "--tp", str(tp), "--tol", str(LOGIT_TOLERANCE),
                   timeout=420, NF_VERIFY_PORT=str(port)))
    result = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])
    assert (result["tp"], result["compared"], result["shape"]) == (tp, "logits", [2, 16, 49_152])
    return result


@pytest.mark.parametrize("name,tp", [("tp1", 1), ("tp3", 3)])
def test_megatron_logits_from_the_nemo_equal_transformers(smollm2_dir, checkpoints, name, tp):
    assert _verify(smollm2_dir, checkpoints[name], tp)["max_abs_diff"] < LOGIT_TOLERANCE


@pytest.mark.parametrize("command", ["hf-to-nemo", "verify"])
def test_tp2_is_refused_in_one_line_naming_the_heads(smollm2_dir, checkpoints, tmp_path, command):
    args = (["hf-to-nemo", "--hf", str(smollm2_dir), "--out", str(tmp_path / "x.nemo"), "--tp", "2"]
            if command == "hf-to-nemo" else ["verify", "--hf", str(smollm2_dir), "--nemo", str(checkpoints["tp1"]),
                                             "--tp", "2"])
    res = _run(*args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[-1].startswith("nemo-factuality convert: error: Megatron-Core cannot split this model at TP=2"), lines
    assert "num_attention_heads=9 is not divisible by TP=2" in lines[-1]
    assert "num_key_value_heads=3 is not divisible by TP=2" in lines[-1]
    assert list(tmp_path.iterdir()) == []
