"""``testing.venvs.run_bounded``: a test program past its time is killed with every process it started, even ranks
that torchrun put in sessions of their own (a hung aligner run left its two ranks running as orphans, and the test
waited on their open output pipe until pytest's own timeout)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from nemo_factuality.testing.venvs import proc_stat, run_bounded

# a parent that starts a child in a new session (as torchrun starts each rank), prints its pid, then hangs; the child
# hangs too, holding the output pipe
TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("CHILD", child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def test_a_program_past_its_time_is_killed_with_the_ranks_it_started_in_their_own_sessions(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        run_bounded([sys.executable, "-c", TREE], timeout=3, env=dict(os.environ))
    assert time.monotonic() - start < 30  # not held by the orphan's open pipe
    child = int(str(err.value).split("CHILD ")[1].split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), f"the child {child} in its own session outlived the bound"
