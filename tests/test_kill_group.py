"""``testing.servers.kill_group``: a server killed the way a crash kills it leaves no process and no shared memory,
and the shared memory of processes outside its group stays."""

from __future__ import annotations

import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

from nemo_factuality.testing.servers import group_members, kill_group

# a group leader and a child in its group, each holding a shared-memory block, as PyTriton's proxy and Triton's stubs do
_HOLDERS = """
import subprocess, sys, time
from multiprocessing import resource_tracker, shared_memory
block = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(block._name, "shared_memory")  # as a SIGKILL leaves it: nobody unlinks it
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(block.name, flush=True)
time.sleep(600)
"""
_CHILD = """
import time
from multiprocessing import resource_tracker, shared_memory
block = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(block._name, "shared_memory")
time.sleep(600)
"""


def test_the_group_and_its_shared_memory_are_gone_and_another_process_keeps_its_own():
    mine = shared_memory.SharedMemory(create=True, size=4096)  # outside the group: must survive
    before = set(Path("/dev/shm").iterdir())
    proc = subprocess.Popen([sys.executable, "-c", _HOLDERS, _CHILD], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        leader_block = Path("/dev/shm") / proc.stdout.readline().strip().lstrip("/")
        deadline = time.monotonic() + 60
        while len(set(Path("/dev/shm").iterdir()) - before) < 2:  # the child's block too
            assert time.monotonic() < deadline, "the child never created its block"
            time.sleep(0.1)
        created = set(Path("/dev/shm").iterdir()) - before
        assert leader_block in created and len(group_members(proc.pid)) >= 2  # + their resource trackers
        assert kill_group(proc) == {}
        assert not [p for p in created if p.exists()]  # both blocks unlinked
        assert (Path("/dev/shm") / mine.name.lstrip("/")).exists()
    finally:
        if group_members(proc.pid):  # the test failed before its kill: nothing of the group may outlive it
            kill_group(proc)
        mine.close()
        mine.unlink()
