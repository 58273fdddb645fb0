"""``python -m nemo_factuality.cli ARGS…`` for the tests, each command in a process forked from one that imported the
heavy stack once: a fork server for command lines.

A converter command spends ~4 of its ~4.5 CPU seconds importing torch, transformers and torch.distributed.checkpoint;
a module of tests that runs forty of them paid the import forty times. ``PreloadedCommands`` starts one server
(``python -m nemo_factuality.testing.preloaded --preload MOD…``) that imports the modules, then for each request forks
a child that runs ``nemo_factuality.cli`` as ``__main__`` with the request's arguments, environment and working folder,
its stdout and stderr in files, and exits as an interpreter does (atexit handlers run). Every command is a new process
and nothing it builds reaches the next. What the preloaded imports printed (a library's import-time warning) is put in
front of every command's captured stdout and stderr, so a check that a command prints one line, or nothing, sees at
least what a new interpreter would print; preload only what the commands import at their start without a filter of
their own (Megatron-Core's import warnings, which ``convert verify`` silences around its import, are not preloaded).

The client waits for each command within a timeout and kills the command's process tree past it. ``close()`` ends the server; a server whose client
went away sees its stdin end and exits.

Forking is sound for the same reason as in ``testing.forkrun``: the server has started no thread when it forks
(checked after the preload).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from nemo_factuality.testing.forkrun import preload_modules
from nemo_factuality.testing.paths import REPO_ROOT
from nemo_factuality.testing.venvs import kill_tree

#: What ``nemo-factuality convert`` imports at its start (its commands and the HF models ``verify`` compares with)
CONVERTERS = ("nemo_factuality.convert.nemo_format", "nemo_factuality.convert.verify",
              "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama")


def _child(request: dict) -> None:
    """In the forked child: the request's folder, environment, argv and output files; raises SystemExit."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.argv = ["nemo-factuality", *request["argv"]]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback on stderr, exit 1)
        import traceback

        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # nothing of the server's loop catches it: this process ends as an interpreter does


def _preload_quietly(preload: list[str]) -> dict[str, str]:
    """Import ``preload`` with stdout and stderr going to files; returns what it printed on each."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    printed = {}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            preload_modules(preload)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        for name, f in (("stdout", out), ("stderr", err)):
            f.seek(0)
            printed[name] = f.read().decode(errors="replace")
    return printed


def serve(preload: list[str]) -> int:
    """Say what the preload printed (``{"stdout": …, "stderr": …}``), then answer requests (one JSON line each on
    stdin) with ``{"pid": …}`` when the command starts and ``{"code": …}`` when it ends, until stdin ends."""
    printed = _preload_quietly(preload)
    if "nemo_factuality.cli" in sys.modules:  # runpy would warn on every command that its __main__ was imported
        del sys.modules["nemo_factuality.cli"]
    sys.stdout.write(json.dumps(printed) + "\n")
    sys.stdout.flush()
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if others:
        raise SystemExit(f"preloaded: the preloaded modules started threads ({others}); run the commands as processes")
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()
    return 0


class PreloadedCommands:
    """A client of one server: ``run(args)`` is ``subprocess.run([python, -m, module, *args])`` (``module``:
    ``nemo_factuality.cli``) with output captured, minus the preloaded import. A context manager (or ``close()``)."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str], python: str = sys.executable,
                 start_timeout_s: float = 300, module: str = "nemo_factuality.cli"):
        self._env, self._module = dict(env), module
        self._dir = Path(tempfile.mkdtemp(prefix="nf_preloaded_"))
        self._proc = subprocess.Popen([python, "-m", "nemo_factuality.testing.preloaded",
                                       *(f"--preload={p}" for p in preload)], env=self._env, cwd=REPO_ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, start_new_session=True)
        self._start_timeout_s = start_timeout_s
        self._count = 0
        self._printed: dict[str, str] | None = None  # what the preload printed, once the server has said
        # the server's lines through a reader thread: select() on the pipe misses a line the text buffer already
        # holds (two lines in one read — the preload's answer and a command's start, on a loaded machine — left the
        # second waiting until the 30 s start timeout in a cold CI run)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, name="preloaded-replies", daemon=True).start()

    def _read_lines(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # the server closed its output

    def _reply(self, timeout_s: float) -> dict | None:
        """The server's next line as JSON; None past ``timeout_s``; raises if the server is gone."""
        try:
            line = self._lines.get(timeout=max(timeout_s, 0.001))
        except queue.Empty:
            return None
        if not line:
            raise RuntimeError(f"the preloaded command server exited {self._proc.wait()}")
        return json.loads(line)

    def run(self, args: list[str], *, timeout: float = 240, cwd: Path | None = None,
            **env: str) -> subprocess.CompletedProcess:
        """``nemo-factuality ARGS…`` in a forked child with this client's environment plus ``env``; raises
        ``subprocess.TimeoutExpired`` past ``timeout`` (the command's process group killed first)."""
        self._count += 1
        out, err = self._dir / f"{self._count}.out", self._dir / f"{self._count}.err"
        request = {"module": self._module, "argv": list(args), "env": {**self._env, **env}, "cwd": str(cwd or os.getcwd()),
                   "stdout": str(out), "stderr": str(err)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        if self._printed is None:  # the first command also waits for the server's preload
            self._printed = self._reply(self._start_timeout_s)
            if self._printed is None:
                raise RuntimeError("the preloaded command server did not finish its imports in time")
        started = self._reply(30)
        if started is None:
            raise RuntimeError("the preloaded command server did not start the command in time")
        ended = self._reply(timeout)
        if ended is None:
            kill_tree(started["pid"])  # the command and all it started (torchrun's ranks sit in sessions of their own)
            self._reply(30)
            raise subprocess.TimeoutExpired(args, timeout, self._printed["stdout"] + out.read_text(errors="replace"),
                                            self._printed["stderr"] + err.read_text(errors="replace"))
        result = subprocess.CompletedProcess(args, ended["code"], self._printed["stdout"] + out.read_text(errors="replace"),
                                             self._printed["stderr"] + err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        return result

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_tree(self._proc.pid)
                self._proc.wait()
        for leftover in self._dir.iterdir():
            leftover.unlink()
        self._dir.rmdir()

    def __enter__(self) -> PreloadedCommands:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_factuality.testing.preloaded")
    ap.add_argument("--preload", action="append", default=[], help="a module to import once (module:function calls it)")
    return serve(ap.parse_args(argv).preload)


if __name__ == "__main__":
    sys.exit(main())
