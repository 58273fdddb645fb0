"""A torchrun stand-in for the CPU tests' driver programs that pays a heavy stack's import once per run, not per rank.

    python -m nemo_factuality.testing.forkrun --nproc 2 --preload nemo_factuality.testing.aligner_cpu:apply \\
        --preload nemo_factuality.trainers.backends.aligner.actor -- DRIVER.py ARGS… [--next DRIVER.py ARGS…]

NeMo's import costs ~17 s of CPU per process and Megatron-Bridge's ~8; a torchrun program of four ranks paid it four
times for a check that takes seconds. This launcher imports the ``--preload`` modules once (``module:function`` also
calls it), then, for each program in order, forks ``--nproc`` ranks from that state and runs the program in each as
``__main__`` with the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` on a fresh port, ``TORCHELASTIC_RUN_ID`` so that Lightning takes the processes as
launched, not its own to spawn). Every rank is a new process: nothing a program builds (a model, a process group, a
parallel state, patched functions) reaches the next program, as with a new torchrun — which is how one run can hold
a setting's run and the new process that resumes its checkpoint.

Like torchrun, the first rank that fails ends its program: the other ranks get SIGTERM, then SIGKILL after
``--grace`` seconds, and the launcher exits 1 without starting the next program. For a batch of independent programs
(one launch feeding a test module's checks, so the import is paid once for all of them):

    forkrun --nproc 1 --preload … --keep-going --logs DIR -- A.py … --next --nproc=2 B.py … --next C.py …

``--nproc=N`` at the start of a program overrides the launcher's for it; ``--keep-going`` runs every program whatever
the earlier ones gave (exit 1 if any failed); ``--logs DIR`` sends program *i*'s ranks' output to ``DIR/i.log`` and
writes its exit code to ``DIR/i.exit`` once it ends, so each check reads its own program's outcome and output. What torchrun adds and this does not
(restarts, rendezvous, its own signal handling) none of the programs it runs use; fault tests keep torchrun.

Forking after the imports is sound here because the parent has started no thread, process group or CUDA context
when it forks (``OMP_NUM_THREADS=1``; checked below: a parent with another live thread refuses to fork).
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import uuid

from nemo_factuality.ports import free_ports


def preload_modules(specs: list[str]) -> None:
    for spec in specs:
        module, _, function = spec.partition(":")
        imported = importlib.import_module(module)
        if function:
            getattr(imported, function)()


def _rank_main(rank: int, nproc: int, port: int, run_id: str, program: list[str]) -> None:
    """In the forked rank: torchrun's worker environment, then the program as ``__main__``; never returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="default",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port),
                      TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = list(program)
    # as `python script.py` does: the script's folder first on the path (drivers import their siblings)
    sys.path.insert(0, os.path.dirname(os.path.abspath(program[0])))
    code = 0
    try:
        runpy.run_path(program[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001  (a rank's failure is its exit code, with its traceback, as under torchrun)
        traceback.print_exc()
        code = 1
    _exit_after_atexit(code)


def _exit_after_atexit(code: int) -> None:
    """End a forked rank as an interpreter's exit does, less the module teardown: the atexit handlers run
    (multiprocessing's terminates the daemonic helpers a rank started, which would otherwise outlive it holding the
    output pipe; logging's flushes its handlers), stdout and stderr are flushed, then ``os._exit``. The teardown a normal
    exit adds (every module's objects freed) cost a rank with NeMo imported ~3.3 s of CPU and touches every page the
    fork shares with the launcher; nothing a driver program writes depends on it (its files are written and closed)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing left to flush into it
                pass
        os._exit(code)


def _run_program(program: list[str], nproc: int, grace: float, log: str | None = None) -> int:
    """Fork ``nproc`` ranks running ``program``; 0 when all exit 0, else 1 after stopping the rest (torchrun's rule).
    ``log``: the ranks' stdout and stderr go to that file (appended) instead of the launcher's."""
    port, run_id = free_ports(1)[0], uuid.uuid4().hex[:12]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            if log is not None:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
            _rank_main(rank, nproc, port, run_id, program)
        pids[pid] = rank
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            message = f"forkrun: rank {rank} of {program[0]} exited {code}; stopping the other ranks"
            print(message, file=sys.stderr)
            if log is not None:
                with open(log, "a") as f:
                    f.write(message + "\n")
            _stop(list(pids), grace)  # reaps them all
            return 1
    return 0


def _stop(pids: list[int], grace: float) -> None:
    """SIGTERM ``pids``, SIGKILL those still running after ``grace`` seconds; every one of them reaped."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)  # not reaped yet, so still ours even if it exited
    running = set(pids)
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        running = {pid for pid in running if os.waitpid(pid, os.WNOHANG)[0] == 0}
        time.sleep(0.1)
    for pid in running:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def program_nproc(program: list[str], default: int) -> tuple[int, list[str]]:
    """``[--nproc=2, b.py, y]`` → ``(2, [b.py, y])``; a program without the prefix runs at ``default``."""
    if program and program[0].startswith("--nproc="):
        nproc = int(program[0].split("=", 1)[1])
        if nproc < 1 or len(program) == 1:
            raise SystemExit(f"forkrun: bad program {program}: --nproc=N (N ≥ 1) comes before the program's path")
        return nproc, program[1:]
    return default, program


def split_programs(argv: list[str]) -> list[list[str]]:
    """``[a.py, x, --next, b.py, y]`` → ``[[a.py, x], [b.py, y]]``."""
    programs, current = [], []
    for arg in argv:
        if arg == "--next":
            programs.append(current)
            current = []
        else:
            current.append(arg)
    programs.append(current)
    if any(not p for p in programs):
        raise SystemExit("forkrun: an empty program (nothing after --, or around --next)")
    return programs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("forkrun: usage: forkrun --nproc N [--preload MOD[:FN]]… -- PROGRAM ARGS… [--next PROGRAM…]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="forkrun", allow_abbrev=False)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--preload", action="append", default=[])
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL for the other ranks")
    ap.add_argument("--keep-going", action="store_true", help="run every program whatever the earlier ones gave")
    ap.add_argument("--logs", help="a folder: program i's output to <logs>/i.log, its exit code to <logs>/i.exit")
    args = ap.parse_args(argv[:cut])
    programs = [program_nproc(p, args.nproc) for p in split_programs(argv[cut + 1:])]  # bad syntax: before the imports
    preload_modules(args.preload)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if others:  # a fork would copy a lock one of them may hold, without the thread that releases it
        raise SystemExit(f"forkrun: the preloaded modules started threads ({[t.name for t in others]}); use torchrun")
    failed = 0
    for i, (nproc, program) in enumerate(programs):
        log = os.path.join(args.logs, f"{i}.log") if args.logs else None
        code = _run_program(program, nproc, args.grace, log)
        if args.logs:
            with open(os.path.join(args.logs, f"{i}.exit"), "w") as f:
                f.write(f"{code}\n")
        if code and not args.keep_going:
            return code
        failed |= code
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
