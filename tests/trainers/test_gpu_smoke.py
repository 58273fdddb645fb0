"""The GPU smoke kit's CPU path (``bash tools/gpu_smoke.sh --cpu``): the same program that runs on a GPU, on a tiny
model in the NeMo-Aligner venv — build + convert, the aligner backend's generation at batch 16 and at the largest
batch the formula allows (capped), GRPO steps of the real stage with the presets' GPU settings, and TRL's
GRPOTrainer as the peer; then the report."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(venv, tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_smoke")
    env = dict(os.environ, NEMO_FACTUALITY_ALIGNER_VENV=str(venv), OMP_NUM_THREADS="2")
    res = subprocess.run(["bash", "tools/gpu_smoke.sh", "--cpu", "--out", str(out), "--steps", "2"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    return json.loads((out / "smoke.json").read_text()), (out / "smoke.md").read_text(), res.stderr


def test_the_aligner_backend_generates_and_trains_with_the_presets_settings(smoke):
    result, _, stderr = smoke
    a = result["aligner"]
    assert result["device"] == "cpu" and result["model"] == "tiny"
    for gen, batch in ((a["generation_16"], 16), (a["generation_max"], 48)):  # 48 = the CPU path's cap
        assert gen["batch"] == batch and gen["tokens"] > batch and gen["tokens_per_s"] > 0
        assert gen["tokens"] <= batch * result["shape"]["new_tokens"]
    assert a["formula_max_batch"] >= 48 and a["oom_batches"] == []
    assert a["steps"] == 2 and all(0.0 <= r <= 1.0 for r in a["rewards"])
    split = a["step_split_s"]
    assert set(split) == {"generate", "reward", "logprobs", "train", "step"}
    assert all(v >= 0 for v in split.values()) and split["step"] >= split["generate"] + split["train"]
    assert a["predicted_gib"]["train"] > 0 and a["stubbed_packages"] == []  # CI's venv has NeMo's whole stack
    # issue 54 item 6: Megatron-Core's Apex / Transformer Engine / deprecation warnings about the CPU path are not shown
    assert [ln for ln in stderr.splitlines() if "UserWarning:" in ln or "FutureWarning:" in ln] == []


def test_trl_grpo_runs_as_the_peer_on_the_same_model_and_batch(smoke):
    result, report, _ = smoke
    t = result["trl"]
    assert t["steps"] == 2 and t["step_s"] > 0 and t["first_step_s"] > 0
    # the steady state: the first step's generate call (TRL's warm-up) is not counted, the second is
    assert t["generation"]["calls_counted"] == 1
    assert 0 < t["generation"]["tokens"] <= 16 * result["shape"]["new_tokens"] and t["generation"]["tokens_per_s"] > 0
    assert math.isnan(t["peak_gib"])  # no GPU: memory is not measured, and says so
    assert "TRL GRPOTrainer 0.15.2" in report and "generation tokens/s, rollout batch 16" in report
    assert "rollout batch 48" in report
    # issue 54 item 6: no "nan" GiB or "out of memory at none" off a GPU: the report says what it did not measure
    assert re.search(r"\bnan\b", report) is None and "out of memory at" not in report, report
    assert "| not on a GPU (" in report


def test_the_hf_backends_eager_and_compiled_rollouts_are_measured_and_equal(smoke):
    """The hf phase (TRL's stack): eager ``generate`` against ``model.hf_generation=compiled`` greedy at batch 16; on CPU
    the graphs are traced with torch.compile's eager backend, and the tokens are the same."""
    result, report, _ = smoke
    h = result["hf"]
    assert h["compile_backend"] == "eager" and h["greedy_equal"] == 1.0
    assert h["eager"]["tokens_per_s"] > 0 and h["compiled"]["tokens_per_s"] > 0 and h["compiled"]["graphs"] >= 1
    assert h["eager"]["graphs"] is None  # eager traces nothing
    assert "hf backend, greedy at batch 16: eager" in report and "equal tokens 100%" in report


def test_the_gpu_path_refuses_a_machine_without_a_gpu_in_one_line(tmp_path):
    res = subprocess.run(["bash", "tools/gpu_smoke.sh", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == "gpu_smoke: PyTorch sees no GPU here; run with --cpu for the CPU path"


def test_the_kit_outside_any_venv_prints_its_usage_and_one_line_not_a_traceback(tmp_path):
    """Issue 54 item 6: with the system's Python (no torch), ``--help`` was a ModuleNotFoundError traceback and then
    the "no GPU" line; now it is the usage, and a run without --cpu says what the Python lacks."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no venv, no PYTHONPATH: a fresh shell's python3
    helped = subprocess.run(["bash", "tools/gpu_smoke.sh", "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and helped.stderr == "", helped.stderr
    assert helped.stdout.startswith("GPU smoke kit") and "bash tools/gpu_smoke.sh --cpu" in helped.stdout
    ran = subprocess.run(["bash", "tools/gpu_smoke.sh", "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    lines = ran.stderr.strip().splitlines()
    if "has no PyTorch" not in ran.stderr:  # a system Python with torch: the no-GPU line, as in the venv
        assert lines == ["gpu_smoke: PyTorch sees no GPU here; run with --cpu for the CPU path"], ran.stderr
    else:
        assert ran.returncode == 2 and len(lines) == 1 and "Traceback" not in ran.stderr, ran.stderr
