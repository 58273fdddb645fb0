"""The GPU smoke kit's async phase on its CPU path (``python tools/gpu_smoke.py --cpu --phase async``): the program the
next lent GPU runs with ``--async --vllm-python …``, on the kit's tiny model with the scripted engine standing in for
vLLM — GRPO at ``grpo.max_staleness`` 0 and 1 on the same work, its measurements and its sentence in the report; and
the GPU path without a vLLM interpreter recording that it was skipped and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _phase(out: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NF_SMOKE_VLLM_PYTHON", "NEMO_FACTUALITY_VLLM_PYTHON")}
    res = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--phase", "async", "--out", str(out), *args], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    return json.loads((out / "async.json").read_text())


def test_the_async_phase_runs_max_staleness_0_and_1_on_the_same_work_and_reports_them(tmp_path):
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tools'); from pathlib import Path; "
                    f"from gpu_smoke_common import build; build(Path({str(tmp_path)!r}), 'tiny', nemo_too=False)"],
                   cwd=REPO, check=True, timeout=120)
    a = _phase(tmp_path, "--cpu", "--steps", "3")
    assert (a["engine"], a["placement"], a["refit"]) == ("scripted", "colocated", "file")  # no GPU: nothing to separate
    assert a["k0"]["steps"] == a["k1"]["steps"] == 3
    assert a["k0"]["staleness"] == [0.0, 0.0, 0.0] and a["k1"]["staleness"] == [0.0, 1.0, 1.0]
    assert all(0.0 <= r <= 1.0 for r in a["k0"]["rewards"] + a["k1"]["rewards"])
    for key in ("time/step", "time/generate", "time/generate_exposed", "time/engine_idle", "rollout/tis_weight_mean"):
        assert a["k1"][key] >= 0, key
    assert a["speedup"] > 0
    sys.path.insert(0, str(REPO / "tools"))
    from gpu_smoke_async import report_line

    line = report_line(a)
    assert line.startswith("async GRPO on scripted (colocated, refit by file): step ") and "staleness 1" in line, line


def test_the_gpu_path_without_a_vllm_interpreter_records_the_phase_as_skipped(tmp_path):
    a = _phase(tmp_path)
    assert a == {"skipped": "no vLLM interpreter: pass --vllm-python (or set NF_SMOKE_VLLM_PYTHON) to a Python with vLLM"}
