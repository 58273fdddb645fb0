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


def test_setup_env_says_what_each_long_step_does_before_it(tmp_path):
    """Run tools/setup_env.sh against a stub venv whose ``python`` only records its arguments: every pip install
    is preceded by a progress line on stderr."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "tools" / "setup_env.sh", root / "tools" / "setup_env.sh")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _stub(venv_bin / "python", 'echo "PIP $*" >&2\n')
    (venv_bin / "activate").write_text(f'export PATH="{venv_bin}:$PATH"\n')
    tools = tmp_path / "bin"  # the Slurm and lint binaries "present": no apt-get
    tools.mkdir()
    for binary in ("slurmctld", "slurmd", "sbatch", "shellcheck"):
        _stub(tools / binary, "exit 0\n")
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}")
    res = subprocess.run(["bash", str(root / "tools" / "setup_env.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    installs = [i for i, line in enumerate(lines) if line.startswith("PIP ") and " install " in f" {line} "]
    # pip itself, torch, the project with the docs toolchain: one editable build (two printed setuptools' banner twice)
    assert len(installs) == 3, lines
    for i in installs:
        assert i > 0 and lines[i - 1].startswith("[setup_env] "), lines[max(i - 1, 0): i + 1]
    assert "torch" in lines[installs[1] - 1] and ".[all,dev,docs]" in lines[installs[2]]
    # no byte-compiling of every installed module (torch alone took minutes of a shared core)
    assert all("--no-compile" in lines[i] for i in installs[1:]), [lines[i] for i in installs]
