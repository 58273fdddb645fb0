"""Test support: a command in a process group of its own, stopped by a signal the way a user stops it.

Never imported by production code."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def command_in_own_group(args: list[str], env: Mapping[str, str]) -> Iterator[subprocess.Popen]:
    """``args`` started in a new session (its own process group), output captured as text; on the way out whatever of
    the group is still running is killed (a failed test leaves nothing behind)."""
    proc = subprocess.Popen(args, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def signal_and_wait(proc: subprocess.Popen, sig: int, timeout: float = 60) -> tuple[str, float]:
    """Send ``sig`` to ``proc`` and wait for it to end: (its stderr, seconds from the signal to its end)."""
    start = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return err, time.monotonic() - start
