"""Stopping a command that started processes (the lab's workers and the reward servers they start): on SIGTERM or
SIGINT it says so in one line, stops every process it started and exits 128 + the signal within seconds.

A pool's own shutdown waits for its running tasks (minutes of training), and a worker killed alone orphans the
servers it started, so the stop takes each worker's whole process tree: SIGTERM to each process, SIGKILL after
``grace_s`` to whatever is left.

    with stop_on_signals("lab"):
        try:
            run_the_pool(pool)
        except BaseException:
            stop_process_trees(worker_pids)   # before the pool's shutdown, which would wait for the tasks
            raise
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """A stop signal reached the command; ``exit_code`` is 128 + the signal, as a shell reports it."""

    def __init__(self, signum: int) -> None:
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; every process it started was stopped")


def stop_process_trees(pids: list[int], grace_s: float = 5.0) -> int:
    """SIGTERM each of ``pids`` and all their descendants, then SIGKILL those alive after ``grace_s``; returns how many
    processes there were."""
    import psutil

    tree = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in tree:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return len(tree)


def proc_stat(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` fields after the command name: [state, ppid, pgrp, ...]; None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> dict[int, str]:
    """Live (not zombie) processes in process group ``pgid``, with their command lines (Linux ``/proc``). A zombie
    holds no memory: an orphaned worker's zombie waits for init to reap it, and in a container whose first process
    reaps nothing it would wait for ever."""
    members = {}
    for entry in Path("/proc").iterdir():
        stat = proc_stat(entry.name) if entry.name.isdigit() else None
        if stat and stat[0] != "Z" and int(stat[2]) == pgid:
            try:
                members[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            except OSError:
                continue
    return members


def wait_group_empty(pgid: int, timeout_s: float, *, leader: subprocess.Popen | None = None) -> dict[int, str]:
    """Wait until process group ``pgid`` has no live process, at most ``timeout_s``; returns those still there.
    ``leader``: the group's first process, a child of this one, reaped meanwhile (else it stays a zombie)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if leader is not None:
            leader.poll()
        members = group_members(pgid)
        if not members or time.monotonic() >= deadline:
            return members
        time.sleep(0.05)


def stop_process_group(leader: subprocess.Popen, *, term_grace_s: float, kill_wait_s: float = 30.0) -> dict[int, str]:
    """Stop the process group ``leader`` heads (started with ``start_new_session``) and wait until every process of
    it is gone, not only the leader: SIGTERM to the group, up to ``term_grace_s`` for all of it to exit (a vLLM
    engine's workers release their GPU memory on SIGTERM), then SIGKILL to what is left and up to ``kill_wait_s`` for
    it to go (a killed process keeps its GPU memory until its CUDA context is torn down). Returns the processes
    still there at the end (none expected); the leader is reaped."""
    pgid = leader.pid
    for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if not wait_group_empty(pgid, wait_s, leader=leader):
            break
    try:
        leader.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        pass
    return group_members(pgid)


@contextmanager
def stop_on_signals(command: str) -> Iterator[None]:
    """SIGTERM / SIGINT raise ``Stopped`` in the main thread (after one line on stderr saying so); the block stops
    what it started on the way out (``stop_process_trees``). Handlers are restored on the way out; in a thread other
    than the main one (signals cannot be caught there) the block runs as it is."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, _frame: Any) -> None:
        print(f"nemo-factuality {command}: {signal.Signals(signum).name} received: stopping the processes it started",
              file=sys.stderr, flush=True)
        for sig in SIGNALS:  # a second signal while stopping must not interrupt the stop
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals_in_workers() -> None:
    """For a pool worker: Ctrl-C reaches the whole foreground process group, but the parent decides (and stops
    the worker); a worker must not unwind its task on its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
