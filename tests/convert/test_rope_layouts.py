"""HF config layouts (transformers 4 top-level keys vs transformers 5 ``rope_parameters``) through the converters.

The tiny models use a non-default ``rope_theta``, ``head_dim`` 24 (not hidden/heads = 16) and, for Llama,
Llama-3 rope scaling, so a converter that drops any of them changes the logits and fails ``verify``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from nemo_factuality.convert.hf_config import LLAMA3_FIXED, Rope, installed_layout, read_rope, to_installed_layout
from nemo_factuality.testing.preloaded import PreloadedCommands
from nemo_factuality.types import FactualityInputError

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, **LLAMA3_FIXED}


@pytest.mark.parametrize("cfg,expected", [
    ({"rope_theta": 1e6}, Rope(1e6)),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, Rope(1e6)),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA3}, Rope(5e5, "llama3", 8.0)),
    ({"rope_parameters": {**LLAMA3, "rope_theta": 5e5}}, Rope(5e5, "llama3", 8.0)),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2}}, Rope(1e4, "linear", 2.0)),
    ({"rope_theta": 5e5, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "rope_scaling": LLAMA3}, Rope(5e5, "llama3", 8.0)),
    ({}, Rope(10000.0)),  # no theta anywhere: the HF Llama/Qwen2 default
])
def test_both_layouts_read_the_same(cfg, expected):
    assert read_rope(cfg) == expected


@pytest.mark.parametrize("cfg,needle", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "RoPE type 'yarn'"),
    ({"rope_theta": 1e6, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": 2.0, "rope_theta": 5e5}}, "low_freq_factor"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "disagrees with itself"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "positive 'factor'"),
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}, "per-layer-type"),
])
def test_configs_the_converters_do_not_understand_are_refused(cfg, needle):
    with pytest.raises(FactualityInputError, match=needle):
        read_rope(cfg)


@pytest.mark.parametrize("src", [
    {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": LLAMA3, "torch_dtype": "bfloat16"},
    {"model_type": "llama", "rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "dtype": "bfloat16"},
])
def test_written_config_is_read_back_by_the_installed_transformers(src):
    from transformers import LlamaConfig

    out = to_installed_layout(dict(src, hidden_size=64, num_attention_heads=4, head_dim=24, max_position_embeddings=256))
    layout = installed_layout()
    assert ("rope_parameters" in out) == (layout == "rope_parameters") and ("rope_theta" in out) == (layout == "top_level")
    hf = LlamaConfig(**out)
    params = hf.rope_parameters if layout == "rope_parameters" else {**hf.rope_scaling, "rope_theta": hf.rope_theta}
    assert params["rope_theta"] == 5e5 and params["rope_type"] == "llama3" and params["factor"] == 8.0
    assert str(hf.dtype if hasattr(hf, "dtype") else hf.torch_dtype).removeprefix("torch.") == "bfloat16"


# ------------------------------------------------------------------------------------------- end to end
pytest.importorskip("megatron.core")

MODELS = {  # name: (family, build kwargs)
    "qwen2_theta1e6_v5": ("qwen2", {"rope_theta": 1e6}),
    "llama3_scaled_v4": ("llama", {"rope_theta": 5e5, "rope_scaling": LLAMA3, "legacy_config_layout": True}),
    "llama3_scaled_v5": ("llama", {"rope_theta": 5e5, "rope_scaling": LLAMA3}),
}


COMMANDS: PreloadedCommands | None = None  # set for the module's run by conftest.py


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``nemo-factuality convert ARGS…`` in a new process forked from the module's preloaded one."""
    return COMMANDS.run(["convert", *args], timeout=timeout)


@pytest.fixture(scope="module")
def rope_models(tmp_path_factory):
    from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("rope")
    for name, (family, kwargs) in MODELS.items():
        build_tiny_causal_lm(family, vocab_size=500, head_dim=24, out_dir=root / name, **kwargs)
        build_tiny_tokenizer(root / name)
    return root


@pytest.mark.parametrize("name", list(MODELS))
def test_rope_and_head_dim_survive_both_ways(rope_models, tmp_path, name):
    family, kwargs = MODELS[name]
    src = rope_models / name
    raw = json.loads((src / "config.json").read_text())
    assert ("rope_parameters" in raw) != kwargs.get("legacy_config_layout", False)  # the layout under test
    nemo = tmp_path / "m"
    res = _run("hf-to-nemo", "--hf", str(src), "--out", str(nemo), "--extracted")
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = yaml.safe_load((nemo / "model_config.yaml").read_text())
    assert cfg["rotary_base"] == kwargs["rope_theta"] and cfg["kv_channels"] == 24
    assert cfg.get("scale_positional_embedding", False) == ("rope_scaling" in kwargs)
    assert "seq_len_interpolation_factor" not in cfg  # Llama-3 scaling is not also a linear interpolation
    res = _run("verify", "--hf", str(src), "--nemo", str(nemo))
    result = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])
    assert res.returncode == 0 and result["max_abs_diff"] < 1e-5, res.stdout[-500:] + res.stderr[-2000:]
    res = _run("nemo-to-hf", "--nemo", str(nemo), "--out", str(tmp_path / "back"))
    assert res.returncode == 0, res.stderr[-2000:]
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    expected = Rope(kwargs["rope_theta"], "llama3", 8.0) if "rope_scaling" in kwargs else Rope(kwargs["rope_theta"])
    assert read_rope(back) == expected and back["head_dim"] == 24
    assert ("rope_parameters" in back) == (installed_layout() == "rope_parameters")  # the installed layout, always


def test_checkpoint_without_hf_config_gets_its_rope_from_model_config(rope_models, tmp_path):
    """A training-written checkpoint packs no hf_config.json: theta and Llama-3 scaling come from model_config.yaml."""
    nemo = tmp_path / "m"
    assert _run("hf-to-nemo", "--hf", str(rope_models / "llama3_scaled_v5"), "--out", str(nemo), "--extracted").returncode == 0
    (nemo / "hf_config.json").unlink()
    res = _run("nemo-to-hf", "--nemo", str(nemo), "--out", str(tmp_path / "back"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_rope(json.loads((tmp_path / "back" / "config.json").read_text())) == Rope(5e5, "llama3", 8.0)


def test_unknown_rope_type_stops_the_conversion(rope_models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (rope_models / "qwen2_theta1e6_v5").iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    cfg = json.loads((rope_models / "qwen2_theta1e6_v5" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (bad / "config.json").write_text(json.dumps(cfg))
    res = _run("hf-to-nemo", "--hf", str(bad), "--out", str(tmp_path / "x.nemo"))
    assert res.returncode == 2 and "RoPE type 'yarn'" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.nemo").exists()
