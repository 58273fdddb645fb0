"""``kill <lab pid>`` or Ctrl-C stops the lab and everything it started (issue 43: SIGTERM exited 143 at once with
no message while the pool's workers, re-parented to PID 1, kept training, started PyTriton servers and wrote into
``--out`` for minutes; SIGINT cleaned up but took 54 s). Through the real command, in a process of its own."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.testing.processes import command_in_own_group, signal_and_wait

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_the_lab_and_its_workers_within_seconds(tmp_path, sig, code):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "nemo_factuality.cli", "lab", "--quick", "--methods", "knowrl", "--jobs", "2", "--out",
            str(out)]
    with command_in_own_group(args, env) as proc:
        lab = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        while (len(lab.children()) < 2 or not (out / "INCOMPLETE").exists()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(2)  # the workers are at work (spawned, importing, preparing the seed)
        tree = lab.children(recursive=True)
        assert len(tree) >= 2, tree
        err, took = signal_and_wait(proc, sig)
    assert proc.returncode == code and took < 20, (proc.returncode, took, err[-3000:])
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert alive == [], alive  # before: the workers kept running, re-parented to PID 1
    name = signal.Signals(sig).name
    assert f"nemo-factuality lab: {name} received: stopping the processes it started" in err
    assert f"nemo-factuality lab: error: stopped by {name}" in err and f"(exit {code})" in err
    assert "Traceback" not in err
    assert (out / "INCOMPLETE").read_text().startswith(f"incomplete: stopped by {name}")
    assert not (out / "report.json").exists()
