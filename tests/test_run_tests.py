"""``bash tools/run_tests.sh`` (the README's test command) runs the NeMo-Aligner backend's tests too: it finds the
aligner venv, or builds it beside the tests when missing, and exports it before pytest starts (before: those tests
all skipped). The tests that need it wait for its build, and a failed build fails the run.

No real venv is built here: ``NEMO_FACTUALITY_VENV_ROOT`` points the setup script at a scratch directory holding a fake
complete venv, or at an empty one with a Python that cannot build a venv, or with one whose "build" takes seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from nemo_factuality.config import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "run_tests.sh"
SETUP = REPO_ROOT / "tools" / "setup_stack_env.sh"
PROBE = '''
import os

from nemo_factuality.testing.aligner_env import aligner_venv  # this test file runs programs in the aligner venv


def test_probe():
    print("RESOLVED", os.environ.get("NEMO_FACTUALITY_ALIGNER_VENV"), aligner_venv())
'''


def _run_tests(tmp_path: Path, root: Path, **env: str) -> subprocess.CompletedProcess:
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir(exist_ok=True)
    probe.write_text(PROBE)
    # none of the outer run's aligner settings (its venv, opt-out, or a build it is running beside the suite)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_FACTUALITY_ALIGNER_VENV", "NEMO_FACTUALITY_SKIP_ALIGNER"))}
    # one process: the probe prints what it resolved (-s), which xdist workers would not pass through
    return subprocess.run(["bash", str(SCRIPT), str(probe), "-s", "-p", "no:cacheprovider"], capture_output=True, text=True,
                          timeout=180, env={**base, "PYTHONPATH": str(REPO_ROOT), "NEMO_FACTUALITY_VENV_ROOT": str(root),
                                            "NEMO_FACTUALITY_TEST_WORKERS": "1", **env})


def _venv_path(root: Path) -> Path:
    out = subprocess.run(["bash", str(SETUP), "aligner", "--path"], capture_output=True, text=True, check=True, timeout=30,
                         env={**os.environ, "NEMO_FACTUALITY_VENV_ROOT": str(root)})
    return Path(out.stdout.strip())


def test_the_test_command_exports_the_aligner_venv_it_finds(tmp_path):
    root = tmp_path / "venvs"
    venv = _venv_path(root)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".complete").touch()
    res = _run_tests(tmp_path, root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"RESOLVED {venv} {venv}" in res.stdout  # exported to the tests, which find it
    assert f"== NeMo-Aligner venv: {venv}" in res.stderr and "building" not in res.stderr


def test_a_missing_venv_whose_build_fails_fails_the_run(tmp_path):
    """The build is attempted (and its failure fails the run, its log shown) rather than every aligner test skipping;
    the test that needed it errors instead of skipping."""
    res = _run_tests(tmp_path, tmp_path / "empty", PYTHON="false")  # `false -m venv` fails at once
    assert res.returncode != 0 and not re.search(r"^RESOLVED ", res.stdout, re.M)
    assert "the NeMo-Aligner venv is missing: building it beside the tests" in res.stderr
    assert "StackBuildFailed" in res.stdout  # the probe errored on the failed build
    assert "the NeMo-Aligner venv build failed (exit 1)" in res.stderr
    assert "building the NeMo-Aligner venv in" in res.stderr  # the setup script's own progress, from its log


FAKE_PYTHON = """#!/bin/sh
# a Python whose venv "build" takes 3 s and whose pip and import checks succeed: the setup script's steps run for real
# (its copy names the build folder, as a real venv's scripts do: the setup script rewrites them when it moves it)
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && echo "# $3" >>"$3/bin/python" && sleep 3; fi
exit 0
"""


def test_a_missing_venv_is_built_beside_the_tests_which_wait_for_it(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    root = tmp_path / "venvs"
    venv = _venv_path(root)
    res = _run_tests(tmp_path, root, PYTHON=str(fake), NEMO_FACTUALITY_STACK_INSTALLER="pip")  # pip: `python -m pip`
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"RESOLVED {venv} {venv}" in res.stdout  # the probe waited for the build, then found the venv complete
    assert (venv / ".complete").is_file()
    assert "building it beside the tests" in res.stderr and "the NeMo-Aligner venv was built beside the tests" in res.stderr


def test_the_opt_out_skips_the_build(tmp_path):
    res = _run_tests(tmp_path, tmp_path / "empty", PYTHON="false", NEMO_FACTUALITY_SKIP_ALIGNER="1")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "RESOLVED None None" in res.stdout and "building" not in res.stderr
