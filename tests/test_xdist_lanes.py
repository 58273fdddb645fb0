"""The test command's scheduler (``tests/xdist_lanes.py``) on a small suite run by real pytest-xdist workers: with
three workers the modules marked ``waits`` run on the last worker and every other module on the first two; with two
there is no lane; a waiting lane's worker that crashes hands its modules to the replacement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = textwrap.dedent("""
    def pytest_configure(config):
        config.addinivalue_line("markers", "waits: mostly waits")

    def pytest_xdist_make_scheduler(config, log):
        from xdist_lanes import LaneScheduling

        return LaneScheduling(config, log)
""")
# each test records its module and worker; a waiting module's first line is what the scheduler reads
MODULE = textwrap.dedent("""
    {mark}
    import json, os, pathlib

    def _record(name):
        out = pathlib.Path({out!r}) / f"{{__name__}}.{{name}}.{{os.getpid()}}.json"
        out.write_text(json.dumps({{"module": __name__, "worker": os.environ["PYTEST_XDIST_WORKER"]}}))

    def test_one():
        {crash}
        _record("one")

    def test_two():
        _record("two")
""")
WAITING = ("test_wait_a", "test_wait_b", "test_wait_c")
OTHERS = ("test_cpu_a", "test_cpu_b", "test_cpu_c", "test_cpu_d", "test_cpu_e")


def _suite(root: Path, crash: str | None = None) -> Path:
    out = root / "out"
    out.mkdir(parents=True)
    (root / "conftest.py").write_text(CONFTEST)
    # a crash is one worker dying mid-module (os._exit), once, as the bus error the suite once met did
    once = root / "crashed"
    for name in (*WAITING, *OTHERS):
        mark = "import pytest\npytestmark = pytest.mark.waits" if name in WAITING else ""
        body = (f"import os, pathlib; f = pathlib.Path({str(once)!r}); f.exists() or (f.touch(), os._exit(3))"
                if name == crash else "pass")
        (root / f"{name}.py").write_text(MODULE.format(mark=mark, out=str(out), crash=body))
    return out


def _run(root: Path, workers: int) -> tuple[subprocess.CompletedProcess, dict[str, set[str]]]:
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers), "--dist",
                          "loadfile", "--max-worker-restart=2", "--rootdir", str(root), str(root)],
                         capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)})  # xdist_lanes.py
    workers_of: dict[str, set[str]] = {}
    for record in (root / "out").glob("*.json"):
        row = json.loads(record.read_text())
        workers_of.setdefault(row["module"], set()).add(row["worker"])
    return res, workers_of


def test_three_workers_give_the_waiting_modules_the_last_worker_and_the_rest_the_others(tmp_path):
    _suite(tmp_path)
    res, workers_of = _run(tmp_path, 3)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert set(workers_of) == {*WAITING, *OTHERS}
    assert all(workers_of[m] == {"gw2"} for m in WAITING), workers_of
    assert all(workers_of[m] <= {"gw0", "gw1"} for m in OTHERS), workers_of
    assert set().union(*(workers_of[m] for m in OTHERS)) == {"gw0", "gw1"}  # both CPU workers took modules


def test_two_workers_run_every_module_with_no_lane(tmp_path):
    _suite(tmp_path)
    res, workers_of = _run(tmp_path, 2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert set(workers_of) == {*WAITING, *OTHERS}
    assert set().union(*workers_of.values()) == {"gw0", "gw1"}
    # loadfile: a module whole on one worker
    assert all(len(w) == 1 for w in workers_of.values()), workers_of


def test_a_crashed_waiting_worker_hands_its_modules_on(tmp_path):
    """The waiting lane's worker dies in its first module: that test fails (as xdist reports a crash) and every
    test still runs (xdist runs the crashed module's tests again), the waiting modules on the worker that replaced it
    or the others."""
    _suite(tmp_path, crash="test_wait_a")
    res, workers_of = _run(tmp_path, 3)
    assert res.returncode == 1 and "1 failed" in res.stdout, res.stdout[-3000:]
    assert "test_wait_a.py::test_one" in res.stdout  # the test that was running when the worker died
    assert set(workers_of) == {*WAITING, *OTHERS}  # test_wait_a's second test too
    assert all(workers_of[m] <= {"gw0", "gw1"} for m in OTHERS), workers_of
