"""Fixtures for the training-stage tests: a tiny policy with non-default settings and a tiny NLI model."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_factuality.testing.training import build_policy


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    return build_policy(tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def tiny_nli(tmp_path_factory, tiny_policy) -> Path:
    """A 2-label sequence classifier (contradiction / entailment) with the same tokenizer, for nli verifiers."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("tiny_nli")
    tok = AutoTokenizer.from_pretrained(str(tiny_policy))
    tok.save_pretrained(str(out))
    torch.manual_seed(1)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=len(tok), num_labels=2, pad_token_id=tok.pad_token_id,
                      id2label={0: "contradiction", 1: "entailment"}, label2id={"contradiction": 0, "entailment": 1})
    Qwen2ForSequenceClassification(cfg).save_pretrained(str(out))
    return out




@pytest.fixture(scope="session")
def stage_policy(tmp_path_factory, tiny_policy) -> Path:
    """The tiny policy as an extracted .nemo written by our converter (the aligner backend's tests)."""
    from nemo_factuality.testing.servers import convert_checkpoint

    root = tmp_path_factory.mktemp("stage_policy")
    convert_checkpoint("hf-to-nemo", "--hf", str(tiny_policy), "--out", str(root / "policy"), "--extracted")
    return root / "policy"


@pytest.fixture(scope="session")
def venv() -> Path:
    """The NeMo-Aligner venv the aligner backend's tests run programs in; skips with the reason when not built."""
    from nemo_factuality.testing.aligner_env import aligner_venv, skip_reason

    found = aligner_venv()
    if found is None:
        pytest.skip(skip_reason())
    return found


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM test venv's interpreter (the engine's process runs there); skips with the reason when not built."""
    from nemo_factuality.testing.vllm_env import skip_reason, vllm_venv

    found = vllm_venv()
    if found is None:
        pytest.skip(skip_reason())
    return str(found / "bin" / "python")


@pytest.fixture(scope="session")
def engine_policy(tmp_path_factory) -> Path:
    """The tiny policy with 32-wide heads, which vLLM's CPU attention takes."""
    return build_policy(tmp_path_factory.mktemp("engine_policy"), head_dim=32)


@pytest.fixture(scope="session")
def megatron_venv() -> Path:
    """The Megatron-Core/Bridge venv the megatron backend's tests run programs in; skips with the reason when not built."""
    from nemo_factuality.testing.megatron_env import megatron_venv as find_megatron_venv
    from nemo_factuality.testing.megatron_env import skip_reason

    found = find_megatron_venv()
    if found is None:
        pytest.skip(skip_reason())
    return found
