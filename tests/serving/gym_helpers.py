"""What the NeMo-Gym stack tests share (``test_gym_stack.py``, ``test_gym_real_policy.py``): NeMo-Gym's runner
(``ng_run``) started from the project's shipped config with every server in the NeMo-Gym venv, waited for, and
stopped as a user stops it; the rows its rollout collection reads."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.testing.venvs import descendants, proc_stat

SERVER_DIRS = ("resources_servers/nemo_factuality", "responses_api_agents/simple_agent", "responses_api_models/vllm_model")
READY_TIMEOUT_S = 300


def row(name_or_question: str, checklist: list[str], text: str) -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": name_or_question}]}, "checklist": checklist,
            "policy_text": text}


def start_runner(gym_venv: Path, work: Path, ports: dict[str, int], policy_url: str, serve_yaml: Path) -> subprocess.Popen:
    """``ng_run`` with the shipped config, in a working folder where ``resources_servers/nemo_factuality`` is the
    project's (NeMo-Gym looks there first) and every server's venv is the NeMo-Gym venv (``skip_venv_if_present``)."""
    (work / "resources_servers").mkdir(parents=True)
    (work / "resources_servers" / "nemo_factuality").symlink_to(REPO_ROOT / "conf" / "gym" / "resources_servers" / "nemo_factuality")
    for server_dir in SERVER_DIRS:
        (work / "venvs" / server_dir).mkdir(parents=True)
        (work / "venvs" / server_dir / ".venv").symlink_to(gym_venv)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", RAY_TMPDIR=str(ray_tmp),
               # Ray on loopback (its node address is otherwise the machine's interface), no usage report, no token file
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               # no idle Ray workers started ahead of tasks: nothing here runs a Ray task (each is an interpreter)
               RAY_enable_worker_prestart="0", RAY_prestart_worker_first_driver="0",
               WANDB_MODE="disabled", HF_HOME=str(work / "hf"))
    command = [str(gym_venv / "bin" / "ng_run"),
               "+config_paths=[resources_servers/nemo_factuality/configs/nemo_factuality.yaml,"
               "responses_api_models/vllm_model/configs/vllm_model.yaml]",
               f"+policy_base_url={policy_url}", "+policy_api_key=none", "+policy_model_name=policy",
               "++policy_model.responses_api_models.vllm_model.uses_reasoning_parser=false",
               f"++policy_model.responses_api_models.vllm_model.port={ports['model']}",
               f"++nemo_factuality_simple_agent.responses_api_agents.simple_agent.port={ports['agent']}",
               f"++nemo_factuality.resources_servers.nemo_factuality.port={ports['adapter']}",
               f"++nemo_factuality.resources_servers.nemo_factuality.serve_config={serve_yaml}",
               f"+head_server={{host: 127.0.0.1, port: {ports['head']}}}", "+skip_venv_if_present=true",
               f"+uv_venv_dir={work / 'venvs'}", f"+uv_cache_dir={work / 'uv_cache'}"]
    log = (work / "ng_run.log").open("w")
    proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.ray_tmp = ray_tmp  # type: ignore[attr-defined]
    return proc


def wait_ready(proc: subprocess.Popen, log: Path) -> float:
    start = time.monotonic()
    while "All 3 / 3 servers ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() - start > READY_TIMEOUT_S:
            raise AssertionError(f"NeMo-Gym's runner (exit {proc.poll()}) did not start its servers:\n"
                                 f"{log.read_text(errors='replace')[-6000:]}")
        time.sleep(0.5)
    return time.monotonic() - start


def stop_runner(proc: subprocess.Popen) -> list[int]:
    """Ctrl-C, as a user stops ``ng_run`` (it stops its servers and its Ray cluster); the processes it had started that
    are still alive 10 s later are killed and returned (none expected)."""
    tree = descendants(proc.pid)  # its servers and Ray's processes, before they go
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while (left := [pid for pid in tree if (proc_stat(pid) or ["Z"])[0] != "Z"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in [proc.pid, *left]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return left


@contextlib.contextmanager
def gym_runner(gym_venv: Path, work: Path, ports: dict[str, int], policy_url: str, serve_yaml: Path):
    """``ng_run`` started (``start_runner``) and ready; yields the seconds it took to be ready. At the end it is stopped
    with Ctrl-C and Ray's folder removed; a process of it still alive then fails the test."""
    runner = start_runner(gym_venv, work, ports, policy_url, serve_yaml)
    try:
        yield wait_ready(runner, work / "ng_run.log")
    finally:
        left = stop_runner(runner)
        shutil.rmtree(runner.ray_tmp, ignore_errors=True)
    assert left == [], f"NeMo-Gym's runner left processes behind after Ctrl-C: {left}"


def run_driver(gym_venv: Path, work: Path, *args: str) -> dict:
    """``gym_driver.py`` in the NeMo-Gym venv (its ``--out`` is ``work/out``); what it wrote to ``driver.json``."""
    (work / "out").mkdir(exist_ok=True)
    driver = subprocess.run([str(gym_venv / "bin" / "python"), str(Path(__file__).with_name("gym_driver.py")), *args,
                             f"--out={work / 'out'}"],
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), WANDB_MODE="disabled", HF_HOME=str(work / "hf")),
                            cwd=work, capture_output=True, text=True, timeout=300)
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-6000:]
    return json.loads((work / "out" / "driver.json").read_text())
