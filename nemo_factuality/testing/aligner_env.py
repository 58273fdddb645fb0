"""Find the NeMo-Aligner venv (``tools/setup_stack_env.sh aligner``) and run test programs in it.

The aligner backend's tests run in that venv (nemo-toolkit 2.2.1, nemo-aligner 0.7.0, transformers
4.x), never in the test process: they start ``python`` or ``torchrun`` there as a subprocess in its own
process group, bounded in time, and kill exactly that group when it overruns. Importing this module
imports nothing heavy.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from nemo_factuality.testing.venvs import ProgramRun, built_venv, run_batch_in_venv, run_bounded, run_in_venv, venv_env

__all__ = ["aligner_env", "aligner_venv", "run_batch_in_aligner_venv", "run_bounded", "run_in_aligner_venv", "skip_reason"]

STACK = "aligner"  # tools/setup_stack_env.sh builds its venv
ENV_VAR = "NEMO_FACTUALITY_ALIGNER_VENV"


def aligner_venv() -> Path | None:
    """``$NEMO_FACTUALITY_ALIGNER_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, STACK)


def skip_reason() -> str:
    return (f"the NeMo-Aligner venv is not built: run `bash tools/setup_stack_env.sh {STACK}` "
            f"(about 2 min with uv, 2.4 GB; .ci/run does) or point ${ENV_VAR} at one")


def aligner_env(**extra: str) -> dict[str, str]:
    """Environment for a program in the venv (``venvs.venv_env``), plus what NeMo parses at import."""
    return venv_env(NVIDIA_PYTORCH_VERSION="24.07", **extra)


#: What an aligner driver imports before its first line of work: preloaded once by ``forkrun`` (``preload=True``).
PRELOAD = ("nemo_factuality.testing.aligner_cpu:apply", "nemo_factuality.trainers.backends.aligner.actor")


def run_in_aligner_venv(venv: Path, args: list[str], *, nproc: int = 1, timeout: float = 300, preload: bool = False,
                        then: tuple[list[str], ...] = (), **env: str) -> subprocess.CompletedProcess:
    """``python args…`` (nproc == 1) or ``torchrun --nproc_per_node nproc args…`` in the venv; ``preload``: NeMo's
    import paid once for all ranks and for ``then``'s programs too (``testing.forkrun``)."""
    return run_in_venv(venv, args, env=aligner_env(**env), nproc=nproc, timeout=timeout,
                       preload=PRELOAD if preload else (), then=then)


def run_batch_in_aligner_venv(venv: Path, programs: dict[str, tuple[int, list[str]]], *, logs: Path, timeout: float,
                              **env: str) -> dict[str, ProgramRun]:
    """Independent driver programs (name → (nproc, args)) in one launch that imports NeMo once for all of them
    (``venvs.run_batch_in_venv``); each program's outcome by name."""
    return run_batch_in_venv(venv, programs, env=aligner_env(**env), preload=PRELOAD, logs=logs, timeout=timeout)
