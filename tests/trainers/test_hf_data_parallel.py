"""The hf backend's data parallelism: a step at DP=2 (torchrun, gloo, a full replica per rank) equals the step at
DP=1 on the same global batch — the gradients are summed over the replicas (the losses are normalised by the
global token count), so averaging them instead would halve this SGD step and the reported loss; and the metrics the
backend reports are the mean over ranks, as the stages expect of every backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nemo_factuality.testing.aligner_env import run_in_aligner_venv
from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.slow
DRIVER = "tests/trainers/hf_data_parallel_driver.py"


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_dp")
    build_tiny_causal_lm("qwen2", vocab_size=400, out_dir=root / "hf", rope_theta=5000.0, head_dim=24)
    build_tiny_tokenizer(root / "hf")
    venv = Path(sys.executable).parents[1]
    initial = {k: v.clone() for k, v in _weights(root / "hf").items()}
    for nproc in (1, 2):
        res = run_in_aligner_venv(venv, [DRIVER, f"--hf={root / 'hf'}", f"--out={root}"], nproc=nproc, timeout=300)
        assert res.returncode == 0, res.stdout[-4000:]
    return initial, torch.load(root / "dp1.pt", weights_only=True), torch.load(root / "dp2.pt", weights_only=True)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_the_policy_step_at_dp2_equals_the_step_at_dp1(steps):
    initial, one, two = steps
    moved = max(float((one["actor"][k] - initial[k]).abs().max()) for k in initial if k in one["actor"])
    assert moved > 1e-3  # the step did something a factor of two would show in
    for k, v in one["actor"].items():
        torch.testing.assert_close(two["actor"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert two["actor_metrics"]["grad_norm"] == pytest.approx(one["actor_metrics"]["grad_norm"], rel=1e-5)
    # each rank reports the mean of its per-micro-batch shares; the stage multiplies by micro batches × ranks
    assert two["actor_metrics"]["loss/policy"] * 2 * 2 == pytest.approx(one["actor_metrics"]["loss/policy"] * 4, rel=1e-5)


def test_the_critic_step_at_dp2_equals_the_step_at_dp1(steps):
    _, one, two = steps
    assert one["critic_metrics"]["grad_norm"] > 0
    for k, v in one["critic"].items():
        torch.testing.assert_close(two["critic"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert two["critic_metrics"]["grad_norm"] == pytest.approx(one["critic_metrics"]["grad_norm"], rel=1e-5)
