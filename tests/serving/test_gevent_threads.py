"""Fork safety of a process that called a reward server: gevent's name-resolution threads (PyTriton's HTTP client) stay.

gevent retires an idle thread of its default pool after 5 s. A thread exiting at the instant Megatron-Core forks its
checkpoint writer (each dist-checkpoint save forks) deadlocks the child in CPython's after-fork cleanup: two aligner
ranks once waited forever in their final export's save, the forked writer stuck in ``PyOS_AfterFork_Child`` (gdb), with
five gevent pool threads alive at the fork that had all exited since. Every PyTriton client the toolkit makes comes from
``serving.client.pytriton_client()``, which keeps them (``GEVENT_THREAD_IDLE_S``); the race itself is too narrow to
provoke in a test, the thread churn that opens it is not. ``import nemo_factuality`` itself sets no variable.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.waits  # mostly on its probes' idle timeouts (tests/conftest.py gives it the waiting lane)

PROBE = """
import os, sys, time
{imports}
import gevent, gevent.socket
threads = lambda: len(os.listdir("/proc/self/task"))
gevent.joinall([gevent.spawn(gevent.socket.getaddrinfo, "localhost", 80) for _ in range(3)])
after_calls = threads()
time.sleep(6.5)  # past gevent's 5 s idle timeout
print(after_calls, threads())
"""


def _probe(imports: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GEVENT_THREADPOOL_IDLE_TASK_TIMEOUT"}
    return subprocess.Popen([sys.executable, "-c", PROBE.format(imports=imports)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_toolkits_pytriton_client_keeps_gevents_pool_threads_past_its_idle_timeout():
    with_toolkit = _probe("from nemo_factuality.serving.client import pytriton_client; pytriton_client()")
    bare = _probe("import nemo_factuality, pytriton.client")  # the package alone changes nothing: gevent's default
    kept, err = with_toolkit.communicate(timeout=60)
    assert with_toolkit.returncode == 0, err
    out, err = bare.communicate(timeout=60)
    assert bare.returncode == 0, err
    during, after = map(int, kept.split())
    assert during > 1 and after == during, kept  # the pool threads are all still there after 6.5 s idle
    during, after = map(int, out.split())
    assert after < during, out  # without it they exit: the churn a fork can meet


def test_importing_the_toolkit_writes_no_environment_variable():
    probe = ("import os, json; before = dict(os.environ); import nemo_factuality, nemo_factuality.cli; "
             "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "{}"
