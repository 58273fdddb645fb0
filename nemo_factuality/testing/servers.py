"""Servers that the aligner-backend tests start on loopback, each in its own process group, and stop exactly.

* ``reward_server``: ``nemo-factuality serve --config-name NAME key=value…`` (the project venv), with a
  readiness wait and a record of what was left in its group after the stop;
* ``critic_server``: NeMo-Aligner's critic server (``tests/trainers/critic_server_driver.py`` in the Aligner
  venv) started with a PPO stage config, ready when ``critic_infer`` answers;
* ``ppo_overrides``: one small CPU PPO stage config for both the critic server and the stage;
* ``convert_checkpoint``: ``nemo-factuality convert …`` as a child of the project venv (the tests' .nemo files).

Importing this module imports nothing heavy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from nemo_factuality.stopping import group_members, wait_group_empty  # noqa: F401 (the tests' names for them)
from nemo_factuality.testing.paths import REPO_ROOT
from nemo_factuality.testing.ports import free_ports

# how long a reward server may take to stop on SIGTERM before the test counts it as not stopping by itself
STOP_WAIT_S = 90

SERVE_PORT_KEYS = ("http_port", "grpc_port", "triton_metrics_port", "health_port", "metrics_port")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The project venv's environment for a child: this checkout on PYTHONPATH, offline, one thread."""
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", **extra)


def convert_checkpoint(*args: str, timeout_s: float = 240) -> None:
    """``nemo-factuality convert ARGS…`` (e.g. ``hf-to-nemo --hf DIR --out DIR --extracted``) in a child process,
    bounded; a failure raises with the converter's stderr."""
    res = subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "convert", *args], env=subprocess_env(),
                         capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"convert {' '.join(args)} exited {res.returncode}:\n{res.stderr[-2000:]}")


def shared_memory_of(pgid: int) -> set[Path]:
    """The ``/dev/shm`` files that process group ``pgid``'s live processes map (PyTriton's tensor stores and Triton's
    Python-backend regions): a server killed by SIGKILL never unlinks them."""
    files = set()
    for pid in group_members(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone meanwhile
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith("(deleted)"):
                files.add(Path(fields[5]))
    return files


def kill_group(proc: subprocess.Popen, *, timeout_s: float = 30, term_wait_s: float | None = None) -> dict[int, str]:
    """SIGKILL ``proc``'s process group (started with ``start_new_session``), as a crash or ``scancel`` does; wait for
    its processes to end and remove the shared memory they held, so that a test's crash leaves nothing behind
    (``/dev/shm`` is memory). With ``term_wait_s``, the group first gets SIGTERM and ``proc`` that long to stop.
    Returns the processes still there after ``timeout_s`` (none expected)."""
    held = shared_memory_of(proc.pid)  # before any signal: a process that stops may not unlink what it held
    if term_wait_s is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=timeout_s)
    left = wait_group_empty(proc.pid, timeout_s)
    for path in held:  # only files this group mapped: another test's server keeps its own
        path.unlink(missing_ok=True)
    return left


def wait_reward_ready(proc: subprocess.Popen, ports: dict[str, int], log: Path, timeout_s: float = 150.0) -> None:
    """Until Triton serves ``reward_model`` and the health endpoint says ready; fails with the log's tail."""
    import httpx

    deadline = time.monotonic() + timeout_s
    urls = [f"http://127.0.0.1:{ports['http_port']}/v2/models/reward_model/ready",
            f"http://127.0.0.1:{ports['health_port']}/health/ready"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the reward server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if all(httpx.get(url, timeout=2.0).status_code == 200 for url in urls):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the reward server was not ready within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@contextmanager
def reward_server(config_name: str, overrides: list[str], workdir: Path, stopped: dict,
                  ports: list[int] | None = None) -> Iterator[dict]:
    """``nemo-factuality serve --config-name NAME`` on loopback in its own process group, on ``ports`` (5; default:
    free ones — a caller starting several servers at once draws all their ports in one ``free_ports`` call, or two
    could be handed the same port before either binds it). Yields {proc, ports, log, url, wait_ready}. On exit:
    SIGTERM (the server stops Triton itself), then SIGKILL to that group only if something in it outlived the stop;
    ``stopped`` gets the exit code and what was left in the group after the stop and after the kill."""
    ports = dict(zip(SERVE_PORT_KEYS, ports or free_ports(len(SERVE_PORT_KEYS)), strict=True))
    cmd = [sys.executable, "-m", "nemo_factuality.cli", "serve", "--config-name", config_name, "host=127.0.0.1",
           *(f"{k}={v}" for k, v in ports.items()), *overrides]
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "serve.log"
    # a short PYTRITON_HOME: Triton's Python backend puts Unix sockets under it (108-byte path limit)
    home = tempfile.mkdtemp(prefix="pyt_")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=subprocess_env(PYTRITON_HOME=home), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield {"proc": proc, "ports": ports, "log": log, "url": f"http://127.0.0.1:{ports['http_port']}",
               "wait_ready": lambda timeout_s=150.0: wait_reward_ready(proc, ports, log, timeout_s)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                # PyTriton's stop (Triton, its stubs, the proxies) took over 30 s once on the loaded 2-core machine
                # while four other servers and a test module stopped beside it (a cold CI run, 2026-11-29)
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        stopped["exit_code"] = proc.poll()
        # Triton, its Python-backend stubs and multiprocessing helpers share the group; after a clean stop
        # they exit on their own within moments
        stopped["left_after_stop"] = wait_group_empty(proc.pid, 10)
        if stopped["left_after_stop"] or proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        stopped["left_after_kill"] = wait_group_empty(proc.pid, 5)
        stopped["log"] = log.read_text()[-4000:]
        shutil.rmtree(home, ignore_errors=True)


def ppo_overrides(nemo: Path, run_dir: Path, port: int, *, critic_optimizer: str | None = None) -> list[str]:
    """One stage config for both processes (as a Slurm job passes the same file to both). ``critic_optimizer``: the
    critic server's NeMo optimizer (e.g. ``mcore_distributed_optim``, the presets'), else the stage's AdamW."""
    from nemo_factuality.testing.aligner_cpu import CPU_MODEL_OVERRIDES

    cpu = [f"critic.model_overrides.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in CPU_MODEL_OVERRIDES.items()]
    if critic_optimizer:
        cpu.append(f"critic.model_overrides.optim.name={critic_optimizer}")
    return [f"model.restore_from_path={nemo}", "trainer.backend=aligner", "trainer.save_interval=1",
            "trainer.progress_bar=false", "ppo.num_prompts_per_step=4", "ppo.critic_warmup_steps=0",
            "model.micro_batch_size=2", "model.global_batch_size=4", "model.forward_micro_batch_size=4",
            "model.length_params.max_length=6", "model.dtype=float32", "model.optim.name=adamw", "model.optim.lr=3e-3",
            "critic.micro_batch_size=4", "critic.optim.name=adamw", "critic.optim.lr=1e-2",
            f"critic.url=http://127.0.0.1:{port}", f"critic.port={port}", "critic.init_timeout_s=30",
            "remote_rm.url=http://127.0.0.1:5555",  # satisfies the schema; the test passes the reward in
            f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false", *cpu]


@contextmanager
def critic_server(venv: Path, overrides: list[str], port: int, log: Path, *,
                  ready_timeout_s: float = 240) -> Iterator[subprocess.Popen]:
    """The critic server in its own process group, ready within ``ready_timeout_s``; that group (and only it)
    killed after. ``overrides`` are the server's arguments (``[--config-name NAME] key=value…``)."""
    from nemo_factuality.testing.aligner_env import aligner_env
    from nemo_factuality.trainers.backends.aligner.critic import RemoteCritic, RemoteCriticError

    home = tempfile.mkdtemp(prefix="pyt_")  # short: Triton's Unix sockets (108-byte path limit)
    env = aligner_env(CRITIC_BIND_ADDRESS="127.0.0.1", PYTRITON_HOME=home)
    with log.open("a") as out:
        proc = subprocess.Popen([str(venv / "bin" / "python"), "tests/trainers/critic_server_driver.py", *overrides],
                                env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                RemoteCritic(SimpleNamespace(url=f"http://127.0.0.1:{port}", timeout_s=30, init_timeout_s=2,
                                             micro_batch_size=4))
                break
            except RemoteCriticError:
                assert proc.poll() is None, f"critic server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"critic server not ready in {ready_timeout_s:.0f} s:\n{log.read_text()[-4000:]}"
        yield proc
    finally:
        # Triton's own children share the group; none may outlive the test, nor the shared memory they held
        kill_group(proc, term_wait_s=20)
        shutil.rmtree(home, ignore_errors=True)
