"""A clone with nothing beside it — how a user gets the project — collects the whole suite and passes the tests that
read the parity goldens (issue 43: they read ``../shared/parity`` and failed at collection without it). The goldens
are in the repository (``tests/data/parity``); while the project's shared copy is beside the clone, the two must be
byte-identical (only the README, which says where the copy lives, differs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_factuality.config import REPO_ROOT

PARITY = REPO_ROOT / "tests" / "data" / "parity"
SHARED = REPO_ROOT.parent / "shared" / "parity"
PARITY_MODULES = ["tests/metrics/test_parity.py", "tests/algorithms/test_aligner_parity.py",
                  "tests/judge/test_verdict_parity.py"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not SHARED.is_dir(), reason="no ../shared/parity beside this clone to compare the copy with")
def test_the_repositorys_goldens_are_the_shared_ones():
    ours, shared = _files(PARITY), _files(SHARED)
    ours.pop("README.md"), shared.pop("README.md")
    assert sorted(ours) == sorted(shared)
    assert [name for name in ours if ours[name] != shared[name]] == []


@pytest.fixture(scope="module")
def bare_clone(tmp_path_factory) -> Path:
    """The repository's files (tracked, and untracked ones git does not ignore) in a folder with no sibling."""
    root = tmp_path_factory.mktemp("bare") / "nemo_factuality_clone"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = REPO_ROOT / rel
        if source.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / rel)
    assert not (root.parent / "shared").exists()
    return root


def _pytest(clone: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NEMO_FACTUALITY_PARITY"}
    env.update(PYTHONPATH=str(clone), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=420)


def test_a_bare_clone_collects_every_test(bare_clone):
    res = _pytest(bare_clone, "--collect-only", "tests")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "error" not in res.stdout.splitlines()[-1].lower(), res.stdout[-1000:]


def test_a_bare_clone_passes_the_parity_tests(bare_clone):
    res = _pytest(bare_clone, *PARITY_MODULES)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout.splitlines()[-1] and "skipped" not in res.stdout.splitlines()[-1]
