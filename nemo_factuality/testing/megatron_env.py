"""Find the Megatron-Core/Bridge venv (``tools/setup_stack_env.sh megatron``) and run test programs in it.

The megatron backend's tests run in that venv (megatron-core 0.16.1, megatron-bridge 0.3.1, transformers 4.x), never
in the test process: they start ``python`` or ``torchrun`` there as a subprocess in its own process group, bounded in
time (``aligner_env.run_bounded``: past the bound exactly that group is killed). Importing this module imports nothing
heavy.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from nemo_factuality.testing.venvs import ProgramRun, built_venv, run_batch_in_venv, run_in_venv, venv_env

STACK = "megatron"  # tools/setup_stack_env.sh builds its venv
ENV_VAR = "NEMO_FACTUALITY_MEGATRON_VENV"


def megatron_venv() -> Path | None:
    """``$NEMO_FACTUALITY_MEGATRON_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, STACK)


def skip_reason() -> str:
    return (f"the Megatron-Core/Bridge venv is not built: run `bash tools/setup_stack_env.sh {STACK}` "
            f"(about 1 min with uv, 0.9 GB; .ci/run does) or point ${ENV_VAR} at one")


#: What a megatron driver imports before its first line of work (``preload=PRELOAD``: paid once for all its ranks by
#: ``testing.forkrun``); the preload must do what the driver does, in its order.
PRELOAD = ("nemo_factuality.testing.megatron_cpu:apply", "megatron.core", "megatron.bridge")


def run_in_megatron_venv(venv: Path, args: list[str], *, nproc: int = 1, timeout: float = 300,
                         preload: tuple[str, ...] = (), then: tuple[list[str], ...] = (),
                         **env: str) -> subprocess.CompletedProcess:
    """``python args…`` (nproc == 1) or ``torchrun --nproc_per_node nproc args…`` in the venv, niced (the test
    machines are shared), killed with its process group past ``timeout`` seconds; ``preload``: through
    ``testing.forkrun`` (``venvs.run_in_venv``)."""
    return run_in_venv(venv, args, env=venv_env(**env), nproc=nproc, timeout=timeout, nice=True, preload=preload,
                       then=then)


def run_batch_in_megatron_venv(venv: Path, programs: dict[str, tuple[int, list[str]]], *, logs: Path, timeout: float,
                               preload: tuple[str, ...] = PRELOAD, **env: str) -> dict[str, ProgramRun]:
    """Driver programs (name → (nproc, args)) one after another in one launch that imports ``preload`` once for all
    of them (``venvs.run_batch_in_venv``), niced; each program's outcome by name. A program may read what an earlier
    one wrote (they run in the order given)."""
    return run_batch_in_venv(venv, programs, env=venv_env(**env), preload=preload, logs=logs, timeout=timeout, nice=True)
