"""The test command's scheduler (``tests/xdist_lanes.py``) on small suites run by real pytest-xdist workers: with
three workers the modules marked ``waits`` go to the last worker first and every other module to the first two;
a worker whose lane is empty takes the other lane's modules instead of shutting down; with two there is no lane; a
waiting lane's worker that crashes hands its modules to the replacement. The mark is found however ``pytestmark`` is
written, and ``tools/run_tests.sh`` keeps its workers for a ``-k`` expression (one process only for named paths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemo_factuality.config import REPO_ROOT

pytest.importorskip("xdist")

CONFTEST = textwrap.dedent("""
    def pytest_configure(config):
        config.addinivalue_line("markers", "waits: mostly waits")
        config.addinivalue_line("markers", "slow: long")

    def pytest_xdist_make_scheduler(config, log):
        from xdist_lanes import LaneScheduling

        return LaneScheduling(config, log)
""")
# each test records its module, worker and when it ran, after sleeping for the module's duration
MODULE = textwrap.dedent("""
    {mark}
    import json, os, pathlib, time

    def _record(name):
        time.sleep({seconds})
        out = pathlib.Path({out!r}) / f"{{__name__}}.{{name}}.{{os.getpid()}}.json"
        out.write_text(json.dumps({{"module": __name__, "worker": os.environ["PYTEST_XDIST_WORKER"],
                                    "t": time.time()}}))

    def test_one():
        {crash}
        _record("one")

    def test_two():
        _record("two")
""")
# the ways a module says it mostly waits: one line, a list over several lines among other marks, beside a mark with
# arguments, annotated
WAITS_MARKS = ("import pytest\npytestmark = pytest.mark.waits",
               "import pytest\npytestmark = [\n    pytest.mark.slow,\n    pytest.mark.waits,\n]",
               "import pytest\npytestmark = [pytest.mark.timeout(60), pytest.mark.waits]",
               "import pytest\nfrom pytest import mark\npytestmark: list = [mark.waits]")
WAITING = ("test_wait_a", "test_wait_b", "test_wait_c")
OTHERS = ("test_cpu_a", "test_cpu_b", "test_cpu_c", "test_cpu_d", "test_cpu_e")


def _suite(root: Path, waiting=WAITING, others=OTHERS, crash: str | None = None,
           seconds: dict[str, float] | None = None, marks: tuple[str, ...] = WAITS_MARKS) -> Path:
    out = root / "out"
    out.mkdir(parents=True)
    (root / "conftest.py").write_text(CONFTEST)
    # a crash is one worker dying mid-module (os._exit), once, as the bus error the suite once met did
    once = root / "crashed"
    for i, name in enumerate((*waiting, *others)):
        mark = marks[i % len(marks)] if name in waiting else "import pytest\npytestmark = pytest.mark.slow"
        body = (f"import os, pathlib; f = pathlib.Path({str(once)!r}); f.exists() or (f.touch(), os._exit(3))"
                if name == crash else "pass")
        lane = "wait" if name in waiting else "cpu"
        (root / f"{name}.py").write_text(MODULE.format(mark=mark, out=str(out), crash=body,
                                                       seconds=(seconds or {}).get(lane, 0.0)))
    return out


# the plugins these suites do not use: each worker's start 4.4 → 1.0 s
LEAN = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:asyncio", "-p", "no:anyio", "-p", "no:hydra_pytest"]


def _run(root: Path, workers: int) -> tuple[subprocess.CompletedProcess, dict[str, set[str]], dict[str, list]]:
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", *LEAN, "-n", str(workers), "--dist",
                          "loadfile", "--max-worker-restart=2", "--rootdir", str(root), str(root)],
                         capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)})  # xdist_lanes.py
    workers_of: dict[str, set[str]] = {}
    order: dict[str, list] = {}  # worker → its modules in the order it ran them
    rows = sorted((json.loads(record.read_text()) for record in (root / "out").glob("*.json")), key=lambda r: r["t"])
    for row in rows:
        workers_of.setdefault(row["module"], set()).add(row["worker"])
        if row["module"] not in order.setdefault(row["worker"], []):
            order[row["worker"]].append(row["module"])
    return res, workers_of, order


def test_three_workers_give_the_waiting_modules_the_last_worker_then_it_helps_the_other_lane(tmp_path):
    """The waiting modules all on the last worker, before anything else it runs, whichever way each module writes its
    mark; the CPU modules on the other two — and, once its own lane is empty, on the last one too. Before: the
    waiting worker shut down once its lane was empty, so the long CPU lane's tail ran on two workers."""
    others = tuple(f"test_cpu_{c}" for c in "abcdef")
    _suite(tmp_path, WAITING, others, seconds={"wait": 0.05, "cpu": 0.8})
    res, workers_of, order = _run(tmp_path, 3)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert set(workers_of) == {*WAITING, *others}
    assert all(workers_of[m] == {"gw2"} for m in WAITING), workers_of
    assert set(order["gw2"][: len(WAITING)]) == set(WAITING), order  # its own lane first
    assert set().union(*(workers_of[m] for m in others)) >= {"gw0", "gw1"}  # both CPU workers took modules
    assert any(m in others for m in order["gw2"]), order  # then the other lane's work


def test_cpu_workers_take_waiting_modules_once_their_lane_is_empty(tmp_path):
    """Before: a CPU worker shut down once its lane was empty, leaving the waiting lane's six modules to one worker."""
    waiting, others = tuple(f"test_wait_{c}" for c in "abcdef"), ("test_cpu_a",)
    _suite(tmp_path, waiting, others, seconds={"wait": 0.8, "cpu": 0.05}, marks=WAITS_MARKS[:1])  # a mark all can read
    res, workers_of, order = _run(tmp_path, 3)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert workers_of["test_cpu_a"] <= {"gw0", "gw1"} and order["gw2"][0] in waiting, order
    assert any(m in waiting for w in ("gw0", "gw1") for m in order.get(w, [])), order


def test_two_workers_run_every_module_with_no_lane(tmp_path):
    _suite(tmp_path)
    res, workers_of, _ = _run(tmp_path, 2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert set(workers_of) == {*WAITING, *OTHERS}
    assert set().union(*workers_of.values()) == {"gw0", "gw1"}
    # loadfile: a module whole on one worker
    assert all(len(w) == 1 for w in workers_of.values()), workers_of


def test_a_crashed_waiting_worker_hands_its_modules_on(tmp_path):
    """The waiting lane's worker dies in its first module: that test fails (as xdist reports a crash) and every
    test still runs (xdist runs the crashed module's tests again), on the worker that replaced it or the others."""
    _suite(tmp_path, crash="test_wait_a")
    res, workers_of, _ = _run(tmp_path, 3)
    assert res.returncode == 1 and "1 failed" in res.stdout, res.stdout[-3000:]
    assert "test_wait_a.py::test_one" in res.stdout  # the test that was running when the worker died
    assert set(workers_of) == {*WAITING, *OTHERS}  # test_wait_a's second test too


def test_the_waits_mark_is_read_from_pytestmark_however_it_is_written():
    """Before: a regex on one line (`^pytestmark = .*pytest.mark.waits`) missed a multi-line list."""
    from xdist_lanes import marks_waits

    assert all(marks_waits(text) for text in WAITS_MARKS)
    assert not marks_waits("import pytest\npytestmark = pytest.mark.slow\n")
    assert not marks_waits("import pytest\n# pytestmark = pytest.mark.waits\nWAITS = pytest.mark.waits\n")
    assert not marks_waits("pytestmark = 'pytest.mark.waits'\n")  # a string is no mark
    assert not marks_waits("def f():\n    pytestmark = pytest.mark.waits\n")  # not the module's
    assert not marks_waits("pytestmark = [\n")  # does not parse: not marked


@pytest.mark.parametrize("named", [False, True])
def test_the_test_command_keeps_its_workers_for_a_k_expression(tmp_path, named):
    """``run_tests.sh -k EXPR`` selects from the whole suite on the workers (before: any word that was not a flag
    forced one process); naming a path still runs it in one process."""
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text("import os, pathlib\n\ndef test_probe():\n"
                     f"    pathlib.Path({str(tmp_path / 'count')!r}).write_text("
                     "os.environ.get('PYTEST_XDIST_WORKER_COUNT', 'none'))\n")
    skip = {f"NEMO_FACTUALITY_SKIP_{s}": "1" for s in ("ALIGNER", "VLLM", "MEGATRON", "GYM", "NEMORUN")}
    # not this run's own worker variables either: under xdist PYTEST_XDIST_WORKER_COUNT would reach the probe
    env = {k: v for k, v in os.environ.items() if k != "NEMO_FACTUALITY_TEST_WORKERS" and not k.startswith("PYTEST_")}
    # testpaths points the whole-suite run at the probe alone (-o's value is not a path either)
    args = [str(probe)] if named else ["-o", f"testpaths={probe.parent}"]
    res = subprocess.run(["bash", str(REPO_ROOT / "tools" / "run_tests.sh"), "-k", "probe", *args, *LEAN],
                         capture_output=True, text=True, timeout=180, env={**env, **skip})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "count").read_text() == ("none" if named else "3")
