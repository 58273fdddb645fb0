"""``testing.preloaded``, the tests' fork server for command lines: each command is a new process with the request's
arguments, environment and folder, its stdout, stderr and exit code apart; past its timeout the command and what it
started are killed and the server goes on serving; closing the client ends the server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from nemo_factuality.testing.preloaded import PreloadedCommands
from nemo_factuality.testing.venvs import proc_stat

pytestmark = pytest.mark.waits  # mostly on commands' timeouts (tests/conftest.py gives it the waiting lane)

NOISY = 'import sys; print("noisy import", file=sys.stderr); print("noisy stdout")\n'

COMMAND = textwrap.dedent("""
    import os, subprocess, sys, time
    print("pid", os.getpid(), "preloaded", "json" in sys.modules and "email.message" in sys.modules)
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "color", os.environ.get("COLOR"))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("child", child.pid, flush=True)
        time.sleep(120)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def commands(tmp_path):
    (tmp_path / "fake_cli.py").write_text(COMMAND)
    (tmp_path / "noisy.py").write_text(NOISY)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", COLOR="blue")
    with PreloadedCommands(("email.message", "noisy"), env, module="fake_cli") as client:
        yield client


def _field(stdout: str, name: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(name + " ")).split(" ", 1)[1]


def test_each_command_is_a_new_process_with_its_own_arguments_environment_folder_and_output(commands, tmp_path):
    first = commands.run(["0", "x"], cwd=tmp_path)
    second = commands.run(["3"], COLOR="red")
    assert (first.returncode, second.returncode) == (0, 3)
    assert _field(first.stdout, "pid") != _field(second.stdout, "pid") and _field(first.stdout, "pid").endswith("True")
    assert _field(first.stdout, "argv") == f"['0', 'x'] cwd {tmp_path} color blue"
    assert _field(second.stdout, "argv").endswith("color red")
    # what the preload printed comes first, as a new interpreter importing it would print it: once per command
    assert first.stderr == second.stderr == "noisy import\nto stderr\n" and "to stderr" not in first.stdout
    assert first.stdout.startswith("noisy stdout\npid ") and second.stdout.count("noisy stdout") == 1


def test_a_command_past_its_timeout_is_killed_with_what_it_started_and_the_server_serves_on(commands):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as overrun:
        commands.run(["hang"], timeout=3)
    assert time.monotonic() - start < 30
    child = int(_field(overrun.value.output, "child"))
    deadline = time.monotonic() + 10
    while (stat := proc_stat(child)) and stat[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stat or stat[0] == "Z", "the command's own child outlived the timeout"
    assert commands.run(["0"]).returncode == 0


def test_closing_the_client_ends_the_server(tmp_path):
    (tmp_path / "fake_cli.py").write_text(COMMAND)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    client = PreloadedCommands(("email.message",), env, module="fake_cli", python=sys.executable)
    assert client.run(["0"]).returncode == 0
    server = client._proc
    client.close()
    assert server.poll() is not None


class _SlowFlush:
    """The client's pipe to the server, pausing after each flush: the server's answers are all in the pipe before the
    client reads the first (what a loaded machine's scheduling did in a cold CI run)."""

    def __init__(self, pipe, pause_s: float) -> None:
        self._pipe, self._pause_s = pipe, pause_s

    def write(self, text: str) -> int:
        return self._pipe.write(text)

    def flush(self) -> None:
        self._pipe.flush()
        time.sleep(self._pause_s)

    def close(self) -> None:
        self._pipe.close()


def test_answers_that_arrive_together_are_each_read(commands):
    """The preload's answer and the command's start in one read: reading them with select() on the buffered pipe left
    the second in the text buffer, unseen, and the command failed after the 30 s start timeout."""
    commands._proc.stdin = _SlowFlush(commands._proc.stdin, 2.0)
    start = time.monotonic()
    assert commands.run(["0"], timeout=60).returncode == 0
    assert time.monotonic() - start < 15
