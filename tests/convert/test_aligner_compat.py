"""What NeMo-Aligner's actors need from a converted checkpoint: the activation-checkpoint keys NeMo's
generation reads, and a tokenizer the NeMo stack's transformers 4.x loads (ours saves with transformers 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("megatron.core")

from nemo_factuality.convert.nemo_format import ACTIVATIONS_CHECKPOINT_KEYS, _write_loadable_tokenizer_config  # noqa: E402
from nemo_factuality.testing.aligner_env import aligner_venv, run_in_aligner_venv, skip_reason  # noqa: E402
from nemo_factuality.testing.servers import convert_checkpoint  # noqa: E402
from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer  # noqa: E402
from nemo_factuality.types import FactualityInputError  # noqa: E402

TEXT = "The Eiffel Tower is in Paris 🙂"
MESSAGES = [{"role": "user", "content": "Where is the Eiffel Tower?"}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("aligner_compat")
    hf = root / "hf"
    build_tiny_causal_lm("qwen2", vocab_size=500, out_dir=hf)
    build_tiny_tokenizer(hf)
    out = root / "policy"
    convert_checkpoint("hf-to-nemo", "--hf", str(hf), "--out", str(out), "--extracted")
    return hf, out


def test_model_config_carries_the_activation_checkpoint_keys_as_null(converted):
    _, out = converted
    cfg = yaml.safe_load((out / "model_config.yaml").read_text())
    for key in ACTIVATIONS_CHECKPOINT_KEYS:
        assert f"activations_checkpoint_{key}" in cfg and cfg[f"activations_checkpoint_{key}"] is None, key


def test_packed_tokenizer_names_a_class_every_transformers_loads_and_encodes_the_same(converted):
    from transformers import AutoTokenizer

    hf, out = converted
    assert json.loads((hf / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    packed = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert packed["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in packed
    assert packed["chat_template"] == (hf / "chat_template.jinja").read_text()
    original, ours = AutoTokenizer.from_pretrained(str(hf)), AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert ours.encode(TEXT) == original.encode(TEXT)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        original.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert (ours.eos_token, ours.pad_token) == (original.eos_token, original.pad_token)


_LOAD_IN_VENV = """
import json, sys, transformers
from transformers import AutoTokenizer
try:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
print(json.dumps({"version": transformers.__version__, "class": type(tok).__name__, "ids": tok.encode(sys.argv[2]),
                  "eos": tok.eos_token, "chat": tok.apply_chat_template(json.loads(sys.argv[3]), add_generation_prompt=True,
                                                                         tokenize=False)}))
"""


def _load_with_nemo_stack_transformers(venv: Path, tok_dir: Path) -> dict:
    res = run_in_aligner_venv(venv, ["-c", _LOAD_IN_VENV, str(tok_dir), TEXT, json.dumps(MESSAGES)], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_nemo_stack_transformers_4_loads_the_packed_tokenizer(converted):
    venv = aligner_venv()
    if venv is None:
        pytest.skip(skip_reason())
    from transformers import AutoTokenizer

    hf, out = converted
    theirs = _load_with_nemo_stack_transformers(venv, out / "tokenizer")
    assert theirs.get("version", "").startswith("4."), theirs
    original = AutoTokenizer.from_pretrained(str(hf))
    assert theirs["class"] == "PreTrainedTokenizerFast" and theirs["ids"] == original.encode(TEXT)
    assert theirs["eos"] == original.eos_token
    assert theirs["chat"] == original.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    # the defect this guards against: the transformers 5 files as saved do not load there
    assert "TokenizersBackend" in _load_with_nemo_stack_transformers(venv, hf).get("error", ""), "defect no longer reproduces"


def test_a_transformers_5_config_without_tokenizer_json_is_refused_by_name(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    with pytest.raises(FactualityInputError, match="tokenizer.json"):
        _write_loadable_tokenizer_config(tmp_path)
