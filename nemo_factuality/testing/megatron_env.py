"""Find the Megatron-Core/Bridge venv (``tools/setup_megatron_env.sh``) and run test programs in it.

The megatron backend's tests run in that venv (megatron-core 0.16.1, megatron-bridge 0.3.1, transformers 4.x), never
in the test process: they start ``python`` or ``torchrun`` there as a subprocess in its own process group, bounded in
time (``aligner_env.run_bounded``: past the bound exactly that group is killed). Importing this module imports nothing
heavy.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nemo_factuality.testing.aligner_env import run_bounded
from nemo_factuality.testing.paths import REPO_ROOT
from nemo_factuality.testing.venvs import built_venv

SETUP_SCRIPT = REPO_ROOT / "tools" / "setup_megatron_env.sh"
ENV_VAR = "NEMO_FACTUALITY_MEGATRON_VENV"


def megatron_venv() -> Path | None:
    """``$NEMO_FACTUALITY_MEGATRON_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, SETUP_SCRIPT)


def skip_reason() -> str:
    return (f"the Megatron-Core/Bridge venv is not built: run `bash {SETUP_SCRIPT.relative_to(REPO_ROOT)}` "
            f"(~1 min, ~1.5 GB; .ci/run does) or point ${ENV_VAR} at one")


def megatron_env(**extra: str) -> dict[str, str]:
    """Environment for a program in the venv: the checkout on PYTHONPATH, offline, one thread, gloo on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    env.update(extra)
    return env


def run_in_megatron_venv(venv: Path, args: list[str], *, nproc: int = 1, timeout: float = 300,
                         **env: str) -> subprocess.CompletedProcess:
    """``python args…`` (nproc == 1) or ``torchrun --nproc_per_node nproc args…`` in the venv, niced (the test
    machines are shared), killed with its process group past ``timeout`` seconds."""
    python = str(venv / "bin" / "python")
    if nproc == 1:
        cmd = [python, *args]
    else:
        from nemo_factuality.testing.ports import free_ports

        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               f"--master_port={free_ports(1)[0]}", "--master_addr=127.0.0.1", *args]
    return run_bounded(["nice", "-n", "10", *cmd], timeout=timeout, env=megatron_env(**env), cwd=REPO_ROOT)
