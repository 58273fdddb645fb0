"""The docs site builds offline with warnings as errors, and the examples in the public docstrings run."""

from __future__ import annotations

import doctest
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# modules whose docstring examples are part of the docs (pure functions: no models, no servers)
DOCTEST_MODULES = [
    "nemo_factuality.algorithms.advantages",
    "nemo_factuality.algorithms.losses",
    "nemo_factuality.text.segment",
    "nemo_factuality.registry",
    "nemo_factuality.exit_codes",
    "nemo_factuality.trainers.metric_names",
]


def test_the_site_builds_with_no_warning(tmp_path):
    pytest.importorskip("sphinx", reason="the docs toolchain: pip install -e '.[docs]' (tools/setup_env.sh does)")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"),
                           str(tmp_path / "html")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for page in ("index", "getting_started", "reference/cli", "reference/config", "reference/metrics",
                 "reference/exit_codes", "api/rewards", "guides/klcf", "cluster/index", "lab", "benchmarks"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    # autodoc really rendered the interfaces (a module that failed to import is only a warning, caught above)
    assert "PolicyActor" in (tmp_path / "html" / "api" / "trainers.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0


def test_the_readme_is_the_front_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250, len(lines)
    # its first two commands, exactly: set up + run the lab, and the tests
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[:2] == ["bash tools/setup_env.sh && . .venv/bin/activate && nemo-factuality lab --out outputs/lab",
                         "bash tools/run_tests.sh"]
    # every link into the site names a page that exists, the generated reference pages included (they are committed)
    import re

    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), target


def test_lab_and_suite_times_are_measured_figures_in_one_place():
    """How long the lab and the test suite take is stated once, in the Timings table, each as a measured figure
    with its date; the README and the lab page link there instead of restating figures that go stale."""
    import re

    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    timings = benchmarks.split("## Timings", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in timings.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    for command in ("`nemo-factuality lab --out outputs/lab`", "`bash tools/run_tests.sh`"):
        row = next(r for r in rows if command in r)
        assert re.search(r"\d min", row) and re.search(r"\b20\d\d-\d\d-\d\d\b", row), row
        assert "about" not in row, row  # a measurement, not an estimate
    pages = [ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
    for page in pages:
        text = page.read_text(encoding="utf-8").replace(timings, "")
        assert not re.search(r"\d min (wall|CPU)|\d min of CPU", text), page  # a run's time outside the table
    assert "(docs/benchmarks.md#timings)" in (ROOT / "README.md").read_text(encoding="utf-8")
