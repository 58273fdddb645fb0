"""Find the NeMo-Run venv (``tools/setup_stack_env.sh nemorun``: nemo-run 0.11.1 and the launcher's dependencies, no
torch) for the tests of ``nemo-factuality launch --via nemo-run``: the launch command runs in it, with the checkout on
PYTHONPATH; the job's steps run in the submitting environment's interpreters, as on the sbatch path. Importing this
module imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

from nemo_factuality.testing.venvs import built_venv

STACK = "nemorun"  # tools/setup_stack_env.sh builds its venv
ENV_VAR = "NEMO_FACTUALITY_NEMORUN_VENV"


def nemorun_venv() -> Path | None:
    """``$NEMO_FACTUALITY_NEMORUN_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, STACK)


def skip_reason() -> str:
    return (f"the NeMo-Run venv is not built: run `bash tools/setup_stack_env.sh {STACK}` (about half a minute with uv, "
            f"0.5 GB; .ci/run does) or point ${ENV_VAR} at one")
