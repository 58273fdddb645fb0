"""The presets' model builds on the container (issue: every RMSNorm preset failed there).

The NGC image has Apex, and with Apex importable Megatron-Core's local spec builds ``FusedLayerNorm``, which
asserts LayerNorm: NeMo's ``get_specs`` never passed the checkpoint's RMSNorm. Here a stand-in ``apex`` package is
importable as on the container, and the actor is built through the cluster run's own code path (no shim of
``get_specs``): it must build with RMSNorm everywhere and give Hugging Face's log-probs. The presets themselves
build Transformer Engine's spec, which the container is for, and a machine without TE that asks for it gets one
line naming the setting.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from nemo_factuality.testing.aligner_env import run_in_aligner_venv
from nemo_factuality.testing.paths import REPO_ROOT
from nemo_factuality.testing.servers import convert_checkpoint
from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.slow
STANDIN = REPO_ROOT / "tests" / "trainers" / "apex_standin"
PRESETS = sorted((REPO_ROOT / "conf" / "train" / "aligner").glob("*.yaml"))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("container_spec")
    build_tiny_causal_lm("qwen2", vocab_size=400, out_dir=root / "hf")
    build_tiny_tokenizer(root / "hf")
    convert_checkpoint("hf-to-nemo", "--hf", str(root / "hf"), "--out", str(root / "policy"), "--extracted")
    return root / "hf", root / "policy"


def test_rmsnorm_actor_builds_with_apex_importable_and_matches_hf(venv, policy, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "built.json"
    res = run_in_aligner_venv(venv, ["tests/trainers/container_spec_driver.py", f"--nemo={policy[1]}", f"--out={out}"],
                              timeout=240, PYTHONPATH=f"{STANDIN}:{REPO_ROOT}")
    assert res.returncode == 0, res.stdout[-5000:]
    built = json.loads(out.read_text())
    assert built["normalization"] == "RMSNorm"
    rms = ["torch.nn.modules.normalization.RMSNorm"]
    assert built["norms"] == {"input_layernorm": rms, "pre_mlp_layernorm": rms, "final_layernorm": rms}, built["norms"]
    assert built["critic_norms"] == ["WrappedTorchNorm"], built["critic_norms"]
    tokens = torch.tensor(built["tokens"])
    model = AutoModelForCausalLM.from_pretrained(str(policy[0]), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1]
    hf = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    ours = torch.tensor(built["logprobs"])[:, : hf.shape[1]]
    # a LayerNorm in place of RMSNorm moves log-probs by O(0.1); fp32 on both sides agrees to ~1e-5
    assert torch.allclose(ours[:, 2:], hf[:, 2:], atol=1e-4), (ours[:, 2:] - hf[:, 2:]).abs().max()


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_presets_build_transformer_engine_spec_for_actor_and_critic(path):
    preset = yaml.safe_load(path.read_text())
    assert preset["common"]["aligner"]["transformer_engine"] is True
    launch = (REPO_ROOT / "conf" / "launch" / "aligner_ppo_rlfh.yaml").read_text()
    assert "critic.model_overrides.transformer_engine=true" in launch


def test_transformer_engine_requested_without_it_is_one_line(venv, tmp_path):
    code = ("from nemo_factuality.trainers.backends.aligner.spec import use_checkpoint_layer_specs\n"
            "from nemo_factuality.types import FactualityInputError\n"
            "try:\n    use_checkpoint_layer_specs(True)\nexcept FactualityInputError as e:\n    print('ERR', e)\n")
    res = run_in_aligner_venv(venv, ["-c", code], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("ERR"))
    assert "Transformer Engine is not installed" in line and "transformer_engine: false" in line
