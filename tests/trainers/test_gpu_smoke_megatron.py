"""The GPU smoke kit's megatron phase (``bash tools/gpu_smoke.sh --backend megatron``), everything of it a CPU runs:

* the CPU path in the megatron venv: the kit's HF folder (no ``.nemo`` step) → ``MegatronActor`` with Bridge imported
  through the kit's Transformer Engine stand-in, generation at rollout batch 16 and at the CPU cap (48), 2 GRPO steps
  of the real stage with the step-time split, the report (the TRL peer is ``test_gpu_smoke.py``'s: skipped here);
* the dtype the kit asks for on a GPU (bf16, float32 only with the backend's reason printed);
* the offline ``--no-index`` install of the carried megatron wheels (requirements/gpu_smoke_megatron.txt) into a
  Python 3.12 venv shaped like the GPU machine (``tools/setup_gpu_smoke_wheels.sh``): every pin at its version in a
  folder of its own, megatron-core's C++ helper built for 3.12, and the carried transformers 4.57 / tokenizers /
  huggingface-hub importing there in front of the machine's. That venv has no torch (no CPU build of torch exists for
  3.12 on the index this machine reaches), so megatron.core's import is shown to stop at torch and nothing else; the
  import of Bridge + Megatron-Core through the stand-in is the CPU path's (Python 3.11, the same pins).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_factuality.testing.paths import REPO_ROOT


# ------------------------------------------------------------------------------------------------ the CPU path
@pytest.fixture(scope="module")
def smoke(megatron_venv, tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("gpu_smoke_megatron")
    env = dict(os.environ, NEMO_FACTUALITY_MEGATRON_VENV=str(megatron_venv), OMP_NUM_THREADS="2")
    cmd = ["bash", "tools/gpu_smoke.sh", "--cpu", "--backend", "megatron", "--skip-trl", "--out", str(out), "--steps", "2"]
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    (out / "stderr.log").write_text(res.stderr)
    return json.loads((out / "smoke.json").read_text()), (out / "smoke.md").read_text(), out


@pytest.mark.slow
def test_the_megatron_actor_builds_from_the_hf_folder_through_the_te_stand_in(smoke):
    result, _, out = smoke
    m = result["megatron"]
    assert result["backend"] == "megatron" and result["device"] == "cpu" and result["model"] == "tiny"
    assert (out / "hf" / "config.json").is_file() and not (out / "policy").exists()  # no .nemo step
    assert m["device"] == "cpu" and m["dtype"] == "float32"
    # Megatron-Core saw no Transformer Engine (local spec), and the stand-in Bridge imported through is gone again
    assert m["transformer_engine"] is False and m["te_stand_in_left"] is False
    # the built model is the config's: Megatron's parameter count equals the Qwen2 arithmetic (139,840 exactly)
    assert m["parameters_b"] == m["formula_parameters_b"] == pytest.approx(139_840 / 1e9, abs=0)


@pytest.mark.slow
def test_generation_at_16_and_at_the_largest_batch_then_grpo_steps_with_the_split(smoke):
    result, report, out = smoke
    m, new_tokens = result["megatron"], result["shape"]["new_tokens"]
    for gen, batch in ((m["generation_16"], 16), (m["generation_max"], 48)):  # 48 = the CPU path's cap
        assert gen["batch"] == batch and batch < gen["tokens"] <= batch * new_tokens and gen["tokens_per_s"] > 0
    assert m["oom_batches"] == [] and m["formula_max_batch"] is None  # no rollout formula for this backend yet
    assert m["steps"] == 2 and len(m["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in m["rewards"])
    split = m["step_split_s"]
    assert set(split) == {"generate", "reward", "logprobs", "train", "step"}
    assert all(v >= 0 for v in split.values()) and split["step"] >= split["generate"] + split["train"]
    metrics = [json.loads(line) for line in (out / "megatron_run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "time/step" in r] == [1, 2]  # the stage's own steps, logged
    assert (out / "megatron_run" / "final" / "config.json").is_file()  # the stage's HF export
    # fp32 states: 20 bytes per parameter (weights, fp32 grad buffer, two Adam moments, the reference copy)
    assert m["states_lower_bound_gib"] == pytest.approx(20 * 139_840 / 2**30, rel=1e-12)
    assert "megatron backend (Megatron-Core 0.16.1 + Bridge 0.3.1, float32, local spec)" in report
    assert "rollout batch 48" in report and "Transformer Engine in use: False" in report
    # issue 54 item 6: before, "out of memory at none" and "peak GPU memory ... | nan |" on this CPU path
    assert re.search(r"\bnan\b", report) is None and "out of memory at" not in report, report
    assert "the CPU path's cap" in report
    assert "| peak GPU memory, GiB, rollout batch 16 (no formula yet) | not on a GPU | — |" in report
    # and the ~15 Apex / Transformer Engine / deprecation warnings of Megatron-Core's import and run are not shown
    stderr = (out / "stderr.log").read_text()
    assert [ln for ln in stderr.splitlines() if "Warning:" in ln or "is deprecated" in ln] == [], stderr[-3000:]


@pytest.mark.slow
def test_the_static_and_dynamic_engines_are_compared_greedy_with_equal_tokens(smoke):
    """Megatron's static engine against its dynamic engine (plain-torch paged attention: no flash-attn here; CUDA graphs
    only on a GPU), greedy at batches 4 and 16: each measured after a warm-up, the same tokens on both (fp32 on CPU), the
    faster one named and used for the rest of the phase."""
    result, report, _ = smoke
    m = result["megatron"]
    engines = m["engines"]
    assert engines["greedy_equal"] == {"4": 1.0, "16": 1.0}
    for engine in ("static", "dynamic"):
        for batch in ("4", "16"):
            run = engines[engine][batch]
            assert run["tokens_per_s"] > 0 and run["wall_ms_per_step"] > 0 and run["gpu_ms_per_step"] is None
    assert engines["faster"] in ("static", "dynamic")
    assert (m["attention_kernels"], m["cuda_graphs"]) == ("torch", False)
    assert m["dynamic_engine_builds"] >= 2  # one per number of requests in flight (4, 16, ...), reused within each
    assert "greedy, batch 16: static" in report and "equal tokens 100%" in report


# ------------------------------------------------------------------------------------------------ dtype on a GPU
def test_on_a_gpu_the_kit_runs_bf16_as_the_peer_does_and_float32_on_cpu(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        from gpu_smoke_common import shape
        from gpu_smoke_megatron import config_with_dtype
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))

    for cpu, want in ((False, "bfloat16"), (True, "float32")):
        args = argparse.Namespace(cpu=cpu, steps=4)
        cfg, dtype = config_with_dtype(args, tmp_path, tmp_path / "run", shape(args))  # validated by the stage schema
        assert dtype == cfg.model.dtype == want and cfg.trainer.backend == "megatron"
        assert cfg.trainer.device == ("cpu" if cpu else "cuda")


# ------------------------------------------------------------------------------------------------ the carried wheels
def _pins() -> dict[str, str]:
    lines = (REPO_ROOT / "requirements" / "gpu_smoke_megatron.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    return {name.lower().replace("_", "-"): version for name, version in (p.split("==") for p in pins)}


@pytest.fixture(scope="module")
def carried(tmp_path_factory):
    res = subprocess.run(["bash", "tools/setup_gpu_smoke_wheels.sh"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=900)
    if res.returncode == 3:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    wheels, venv = res.stdout.split()[-2:]
    site = tmp_path_factory.mktemp("smoke_site")
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(site), "NF_SMOKE_WHEELS": wheels,
           "NF_SMOKE_SITE": str(site / "aligner"), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run(["bash", "tools/gpu_smoke.sh", "--install-only", "--backend", "megatron", "--skip-trl"],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
    return Path(venv), site / "aligner-megatron", Path(wheels)


@pytest.mark.slow
def test_every_carried_megatron_pin_installs_offline_into_its_own_folder(carried):
    venv, site, wheels = carried
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version "
            "for d in m.distributions(path=[sys.argv[1]])}))")
    out = subprocess.run([f"{venv}/bin/python", "-c", code, str(site)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == _pins()  # these and nothing else (--skip-trl: not the aligner stack)
    assert not (site.parent / "aligner").exists()
    helpers = list((site / "megatron" / "core" / "datasets").glob("helpers_cpp.cpython-312-*.so"))
    assert helpers, "megatron-core's C++ helper is not the cp312 build"
    # what travels with the working tree: both kits' wheels, under the device tool's 64 MiB (with the ~2.5 MB tree)
    total = sum(p.stat().st_size for p in wheels.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert total < 60 * 2**20, total / 2**20


@pytest.mark.slow
def test_the_carried_transformers_stack_imports_on_python_312_in_front_of_the_machines(carried):
    venv, site, _ = carried
    code = ("import sys, transformers, tokenizers, huggingface_hub, omegaconf; "
            "from transformers import Qwen2Config; "
            "print(sys.version_info[:2] == (3, 12), transformers.__version__, tokenizers.__version__, "
            "huggingface_hub.__version__, omegaconf.__version__, transformers.__file__.startswith(sys.argv[1]), "
            "Qwen2Config(rope_theta=1e6).rope_theta)")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(site.parent)}
    out = subprocess.run([f"{venv}/bin/python", "-c", code, str(site)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    pins = _pins()
    assert out.stdout.split() == ["True", pins["transformers"], pins["tokenizers"], pins["huggingface-hub"],
                                  pins["omegaconf"], "True", "1000000.0"]
    # megatron.core (and Bridge behind it) stop at torch, which this venv lacks and the GPU machine has: nothing else
    # of their import is missing from the carried folder + the machine's packages
    for module in ("megatron.core", "megatron.bridge"):
        res = subprocess.run([f"{venv}/bin/python", "-c", f"import {module}"], capture_output=True, text=True, env=env)
        assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'torch'", \
            res.stderr[-2000:]


def test_the_largest_batch_halves_on_out_of_memory_and_says_which_did_not_fit():
    import torch

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        from gpu_smoke_megatron import largest_generation
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))
    asked = []

    def measure(_actor, _ids, batch, _new_tokens):  # a device that holds at most 300 sequences
        asked.append(batch)
        if batch > 300:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"batch": batch}

    assert largest_generation(None, [], 1024, 8, measure) == ({"batch": 256}, [1024, 512])
    assert asked == [1024, 512, 256]
    assert largest_generation(None, [], 1024, 8, lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError())) == \
        (None, [1024, 512, 256, 128, 64, 32, 16])
