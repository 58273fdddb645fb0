"""Find the NeMo-Aligner venv (``tools/setup_aligner_env.sh``) and run test programs in it.

The aligner backend's tests run in that venv (nemo-toolkit 2.2.1, nemo-aligner 0.7.0, transformers
4.x), never in the test process: they start ``python`` or ``torchrun`` there as a subprocess in its own
process group, bounded in time, and kill exactly that group when it overruns. Importing this module
imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from nemo_factuality.testing.paths import REPO_ROOT
from nemo_factuality.testing.venvs import built_venv

SETUP_SCRIPT = REPO_ROOT / "tools" / "setup_aligner_env.sh"
ENV_VAR = "NEMO_FACTUALITY_ALIGNER_VENV"


def aligner_venv() -> Path | None:
    """``$NEMO_FACTUALITY_ALIGNER_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, SETUP_SCRIPT)


def skip_reason() -> str:
    return (f"the NeMo-Aligner venv is not built: run `bash {SETUP_SCRIPT.relative_to(REPO_ROOT)}` "
            f"(~8 min, ~3 GB; .ci/run does) or point ${ENV_VAR} at one")


def aligner_env(**extra: str) -> dict[str, str]:
    """Environment for a program in the venv: the checkout on PYTHONPATH, offline, one thread, gloo on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               NVIDIA_PYTORCH_VERSION="24.07")  # NeMo parses it at import
    env.update(extra)
    return env


def run_bounded(cmd: list[str], *, timeout: float, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; past ``timeout`` kill that group (and only it) and raise."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd[:4])}… ran past {timeout:.0f} s and was killed; last output:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_in_aligner_venv(venv: Path, args: list[str], *, nproc: int = 1, timeout: float = 300,
                        **env: str) -> subprocess.CompletedProcess:
    """``python args…`` (nproc == 1) or ``torchrun --nproc_per_node nproc args…`` in the venv."""
    python = str(venv / "bin" / "python")
    if nproc == 1:
        cmd = [python, *args]
    else:
        from nemo_factuality.testing.ports import free_ports

        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               f"--master_port={free_ports(1)[0]}", "--master_addr=127.0.0.1", *args]
    return run_bounded(cmd, timeout=timeout, env=aligner_env(**env), cwd=REPO_ROOT)
